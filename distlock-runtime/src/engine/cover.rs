//! What an unsettled request may leave on the server, given back if it is dropped or gives up:
//! [`Cover`], and the release sent right behind an attempt whose caller gave up
//! ([`send_behind`]).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::claim::{Attempted, Claim};
use crate::backend::AcquireAnswer;
use crate::error::LockError;
use crate::handed::Handed;
use crate::manager::Inner;
use crate::metrics::Labels;

/// Sends a release right behind an attempt whose caller gave up (`release` makes one; it
/// says whether Redis answered), for a lock or a set alike.
///
/// In a tokio runtime, the release is queued on that runtime's connection before this
/// returns, right behind the attempt, so it cannot overtake it there. If that runtime goes
/// away (or the connection fails) before the answer, the manager's runtime sends it once more,
/// and only that outcome is logged. Outside any runtime, the manager's runtime sends it.
///
/// A connection whose answer timed out is dropped, and the release may then go on a new one
/// while the attempt still sits in the old socket, to be delivered if the network heals
/// before the kernel gives up on it. So the release is sent once more when that can no
/// longer happen ([`Backend::late_delivery`](crate::backend::Backend::late_delivery)): a
/// release of what was never granted, or was already given back, changes nothing.
pub(crate) fn send_behind<R, F>(inner: &Inner, release: R)
where
    R: Fn() -> F + Send + 'static,
    F: Future<Output = redis::RedisResult<()>> + Send + 'static,
{
    let late = inner.backend.late_delivery();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return inner.driver.spawn(release_again(None, release, late));
    };
    let (answered, answer) = oneshot::channel();
    let here = release();
    let here = async move {
        if here.await.is_ok() {
            let _ = answered.send(());
        }
    };
    // One poll queues the request on the connection; the task finishes the rest.
    let mut here = Box::pin(here);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if here.as_mut().poll(&mut cx).is_pending() {
        drop(runtime.spawn(here));
    }
    inner
        .driver
        .spawn(release_again(Some(answer), release, late));
}

/// Sends `release` from the manager's runtime, unless `first` says the one sent before was
/// answered, and logs a failure; then, `late` after, once more (see [`send_behind`]).
async fn release_again<R, F>(first: Option<oneshot::Receiver<()>>, release: R, late: Duration)
where
    R: Fn() -> F,
    F: Future<Output = redis::RedisResult<()>>,
{
    let sent = tokio::time::Instant::now();
    let answered = match first {
        Some(answer) => answer.await.is_ok(),
        None => false,
    };
    if !answered && let Err(error) = release().await {
        tracing::warn!(%error, "a release behind an abandoned attempt failed; the lease will expire");
    }
    tokio::time::sleep_until(sent + late).await;
    if let Err(error) = release().await {
        tracing::debug!(%error, "the late release behind an abandoned attempt failed");
    }
}

/// What an attempt may leave on the server that nothing else gives back, while the request
/// has not settled: if the request is dropped (or gives up) there, a release is sent behind
/// it on the same connection.
///
/// That is a hold granted to an attempt whose answer has not arrived (or was lost), and a
/// fair request's place in the server's queue, which a release may grant the lock to until
/// the request leaves it. The state is written where an attempt is sent and answered
/// ([`send`](Self::send)), where a hand-off is taken and where a fair request leaves its
/// queue, and read in `drop`.
///
/// It also covers a writer's intent. A writer refused while it may try again leaves an
/// intent that keeps new readers out (see `write_acquire.lua`); one that stops waiting
/// without the lock — it gives up, fails, or is cancelled — takes its intent back at once,
/// which wakes the readers it kept out: a free lock does not stay closed to them until the
/// intent expires. Behind an unanswered attempt, the intent is taken back after that
/// attempt's release, on the same connection, so that the attempt cannot set it again after.
pub(crate) struct Cover<'a, A: Claim> {
    inner: &'a Arc<Inner>,
    claim: &'a A,
    /// The request may hold the lock on the server, by an attempt or a place in its queue.
    maybe_held: bool,
    /// An intent of this request may be in Redis (an answered attempt was refused).
    intent_left: bool,
    /// Until when an attempt whose answer never came may still reach the server.
    pub(super) late_until: Option<Instant>,
    /// The request won the lock under its own token (granted, or handed over through the
    /// server): the guard's release covers what a late attempt may take.
    won: bool,
}

impl<'a, A: Claim> Cover<'a, A> {
    /// Covers nothing yet.
    pub(crate) fn new(inner: &'a Arc<Inner>, claim: &'a A) -> Self {
        Self {
            inner,
            claim,
            maybe_held: false,
            intent_left: false,
            late_until: None,
            won: false,
        }
    }

    /// Sends one attempt, covered from now until its answer has come: when it was sent, and
    /// the answer.
    pub(crate) async fn send(
        &mut self,
        metrics: Labels,
    ) -> Result<Attempted<A::Fences>, LockError> {
        crate::metrics::attempt(metrics);
        let sent = Instant::now();
        self.maybe_held = true;
        let answer = self.claim.send(self.inner).await?;
        match &answer {
            Ok(_) => self.inner.waiters.attempted(),
            // It may still land, as late as the kernel retransmits it.
            Err(_) => {
                let late = crate::lease::saturating_add(sent, self.inner.backend.late_delivery());
                self.late_until = self.late_until.max(Some(late));
            }
        }
        self.answered(&answer);
        Ok(Attempted { sent, answer })
    }

    /// What an attempt's answer leaves to cover.
    fn answered(&mut self, answer: &redis::RedisResult<AcquireAnswer<A::Fences>>) {
        self.won = matches!(answer, Ok(AcquireAnswer::Held(_)));
        self.maybe_held = match answer {
            // The guard built from it gives it back.
            Ok(AcquireAnswer::Held(_)) => false,
            // Turned away, a fair request keeps its place in the server's queue.
            Ok(_) => self.claim.fair(),
            // A lost reply may hide a grant.
            Err(_) => true,
        };
        // A writer granted the lock took its own intent back in the same script; one refused,
        // or whose answer was lost, may have left one.
        self.intent_left = self.claim.intent().is_some()
            && matches!(answer, Err(_) | Ok(AcquireAnswer::Busy { .. }));
    }

    /// A local release handed the lock over. RenewalPath the server, it went to this request's
    /// own token, which covers any grant an unanswered attempt may hold: that must not be
    /// released now. A local pass gave another's hold: the cover stays, for what such an
    /// attempt may hold.
    pub(super) fn taken(&mut self, handed: &Handed) {
        if !handed.is_local() {
            self.maybe_held = false;
            self.won = true;
        }
    }

    /// Gives back now what the attempts may hold (a fair request leaves the server's queue,
    /// and gives back a lock a release granted it meanwhile); if Redis does not answer,
    /// `drop` sends it again.
    pub(super) async fn give_back(&mut self) {
        if let Some(released) = self.claim.give_back(self.inner).await {
            self.maybe_held = false;
            if released {
                tracing::debug!("a lock granted while giving up was passed on");
            }
        }
    }

    /// Takes back the intent an answered, refused attempt left, now.
    pub(super) fn withdraw_intent(&mut self) {
        if !self.intent_left || self.maybe_held {
            return;
        }
        self.intent_left = false;
        if let Some(intent) = self.claim.intent() {
            self.claim.withdraw_intent(self.inner, intent.to_owned());
        }
    }
}

impl<A: Claim> Drop for Cover<'_, A> {
    fn drop(&mut self) {
        let intent = self
            .claim
            .intent()
            .filter(|_| self.intent_left || self.maybe_held)
            .map(str::to_owned);
        // An attempt whose answer never came may still land, even after a later one was
        // answered: unless the request won under its own token (its guard covers that), what
        // it may take is given back behind it, and once more when it no longer can. A hold
        // passed on locally keeps its giver's token: this request's is nobody's.
        let late = !self.won && self.late_until.is_some_and(|late| late > Instant::now());
        if self.maybe_held || late {
            self.claim.release_behind(self.inner, intent);
        } else if let Some(intent) = intent {
            self.claim.withdraw_intent(self.inner, intent);
        }
    }
}
