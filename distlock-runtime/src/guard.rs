//! `LockGuard`: proof of holding a lock, and the way to give it back.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::LockError;
use crate::backend::{FairRelease, HoldIds};
use crate::cohort::{Checked, Run};
use crate::context::Held;
use crate::holds::Live;
use crate::lease::{LeaseState, check_ttl, keep_from};
use crate::manager::{Inner, LockManager};
use crate::release::{self, Resend, Unanswered};
use crate::waiters::{Handed, LocalPass, Next, Offer, Passable};
use crate::watchdog::Registration;

/// How an acquisition went: attempts made and time spent before the lock was held.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Acquired {
    pub(crate) attempts: u32,
    pub(crate) waited: Duration,
    /// When the successful attempt was sent: the start of the lease.
    pub(crate) sent: Instant,
}

/// Everything a guard is made of, assembled by the acquire loop.
#[derive(Debug)]
pub(crate) struct Parts {
    pub(crate) manager: LockManager,
    /// The key as it was requested (without the manager's prefix).
    pub(crate) name: String,
    pub(crate) fence: Option<u64>,
    /// The lease of the hold on the server (shared with nested holds).
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) acquired: Acquired,
    pub(crate) renewal: Option<Registration>,
    /// The hold on the server, shared with the other guards of this owner that nest in it.
    pub(crate) held: Arc<Held>,
    pub(crate) metrics: crate::metrics::Labels,
    /// The `lock.hold` span, from the grant to the release.
    pub(crate) span: crate::trace::HoldSpan,
}

/// Proof that this owner holds a lock. Dropping it releases the lock.
///
/// Prefer [`release`](Self::release): it waits for Redis to confirm, so the next waiter can
/// enter at once, and reports a lease that was lost. Dropping the guard (on panic, when the
/// future holding it is cancelled, or when its runtime shuts down) hands the release to the
/// manager's background runtime instead; if that fails, the lease simply expires.
/// [`LockManager::shutdown`] gives back every guard of the manager; dropping such a guard
/// then does nothing.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    parts: Parts,
    hold: Hold,
}

/// What a release did in this process, before the server.
enum Locally {
    /// The lock went to a waiter of this manager, or to other processes' turns.
    Done(Result<(), LockError>),
    /// The lock was passed on within a cohort's run: the release answers once this check of
    /// the run (or a later one) tells whether the server still had the hold after the pass.
    Passed(Arc<Run>, u64),
    /// A hand-off's answer was lost: the release on the server settles it.
    Unsettled,
    /// Nothing here: the release goes to the server.
    NotHere,
}

/// Where a guard's hold stands with its manager.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// Listed with the manager under this id, so that shutdown can give it back.
    Listed(u64),
    /// Granted while the manager shut down: not listed, still to be given back.
    Unlisted,
    /// Given back, or handed to shutdown.
    Done,
}

impl LockGuard {
    pub(crate) fn new(parts: Parts) -> Self {
        let live = Live {
            ids: parts.held.ids.clone(),
            keep_until: parts.held.keep_until(),
            lease: parts.lease.clone(),
        };
        let hold = match parts.manager.inner.holds.list(live) {
            Some(id) => Hold::Listed(id),
            None => Hold::Unlisted,
        };
        Self { parts, hold }
    }

    /// Opens the hold's `lock.hold` span, under the caller's current span.
    pub(crate) fn start_span(&mut self, labels: crate::metrics::Labels) {
        let held = &self.parts.held;
        self.parts.span = crate::trace::HoldSpan::start(&crate::trace::HoldFields {
            labels,
            key: &self.parts.name,
            token: &held.ids.token,
            fence: self.parts.fence,
            passes: held.passes,
        });
    }

    /// Whether the manager shut down before this guard could be listed with it.
    pub(crate) fn came_after_shutdown(&self) -> bool {
        self.hold == Hold::Unlisted
    }

    /// Whether [`LockManager::shutdown`] gave this hold back.
    fn given_back_by_shutdown(&self) -> bool {
        match self.hold {
            Hold::Listed(id) => !self.parts.manager.inner.holds.is_listed(id),
            Hold::Unlisted | Hold::Done => false,
        }
    }

    /// Takes the hold off the manager's list: `true` when giving it back is up to the caller,
    /// `false` when it was already given back (by shutdown, or before).
    fn unlist(&mut self) -> bool {
        match std::mem::replace(&mut self.hold, Hold::Done) {
            Hold::Listed(id) => self.parts.manager.inner.holds.unlist(id),
            Hold::Unlisted => true,
            Hold::Done => false,
        }
    }

    /// The key as it was requested (without the manager's prefix).
    pub fn key(&self) -> &str {
        &self.parts.name
    }

    /// This acquisition's owner token: 128 bits in hex, unique to it: the manager's id (its
    /// first 16 hex digits, drawn at random when the manager was built, which the inspector
    /// reads its [`HolderIdentity`](crate::HolderIdentity) by) and 64 bits counting. Nested
    /// reentrant holds share the outer hold's token, and so do the holders of a cohort's run
    /// (see [`local_passes`](Self::local_passes)): the token names the hold on the server.
    pub fn token(&self) -> &str {
        &self.parts.held.ids.token
    }

    /// The fencing token drawn for this acquisition, when the request asked for one.
    ///
    /// Tokens of one key grow strictly with every acquisition. Hand the token to the storage
    /// you write to and have it reject any write that carries a smaller token than the largest
    /// it has seen: that stops a holder whose lease ended (after a long GC pause, say) from
    /// overwriting the work of the next holder. A nested reentrant hold carries the outer
    /// hold's token.
    pub fn fencing_token(&self) -> Option<u64> {
        self.parts.fence
    }

    /// How many local passes this hold is from the server's grant: 0 when Redis granted it to
    /// this request; `n` when it came by the `n`-th pass of a run among this manager's own
    /// tasks (see [`LockRequest::cohort`](crate::LockRequest::cohort)), holding the server
    /// hold of the first holder of the run, its [`token`](Self::token) and lease included.
    pub fn local_passes(&self) -> u32 {
        self.parts.held.passes
    }

    /// The lease length this guard was granted or last extended to.
    pub fn ttl(&self) -> Duration {
        self.parts.lease.ttl()
    }

    /// How many attempts the acquisition took (1 when the lock was free at once).
    pub fn attempts(&self) -> u32 {
        self.parts.acquired.attempts
    }

    /// How long the acquisition took, from the first attempt to holding the lock.
    pub fn waited(&self) -> Duration {
        self.parts.acquired.waited
    }

    /// How long the lease is still valid by this process's monotonic clock, with a safety
    /// margin for drift; zero once the lease is known lost. The watchdog moves it forward.
    pub fn remaining(&self) -> Duration {
        self.parts.lease.remaining()
    }

    /// Whether the lease is known to be lost: a renewal found another owner or no key, or the
    /// local validity deadline passed without a renewal. Asks nothing of Redis.
    pub fn is_lost(&self) -> bool {
        self.parts.lease.is_lost()
    }

    /// Completes when the lease is lost, with the [`LockError::Lost`] to report
    /// ([`LockError::ShutDown`] when [`LockManager::shutdown`] gave the lock back).
    ///
    /// With the watchdog on, that is when a renewal finds the lock gone or taken, or when
    /// renewals have failed until the local deadline; without it, when the lease runs out.
    /// Race it against the work the lock protects to stop that work in time:
    ///
    /// ```no_run
    /// # async fn run(guard: distlock_runtime::LockGuard) -> Result<(), distlock_runtime::LockError> {
    /// # async fn work() {}
    /// tokio::select! {
    ///     () = work() => guard.release().await?,
    ///     lost = guard.lost() => return Err(lost),
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lost(&self) -> LockError {
        let lease = &self.parts.lease;
        loop {
            if lease.is_lost() {
                lease.mark_lost();
                return self.lost_error();
            }
            let timer = self.parts.manager.inner.sleep_until(lease.valid_until());
            tokio::select! {
                () = lease.until_marked_lost() => {}
                _ = timer => {}
            }
        }
    }

    /// Asks Redis whether this owner still holds the lock.
    pub async fn is_held(&self) -> Result<bool, LockError> {
        let hold = self.ids();
        self.parts
            .manager
            .inner
            .exec(move |backend| async move {
                match hold.plain {
                    true => backend.holds_plain(&hold).await,
                    false => {
                        backend
                            .holds(&hold.lock, hold.share.as_deref(), &hold.token)
                            .await
                    }
                }
            })
            .await?
            .map_err(|e| LockError::redis(self.key(), e))
    }

    /// Makes the lease last at least `ttl` from now, if this owner still holds the lock;
    /// otherwise [`LockError::Lost`], and nothing is changed.
    ///
    /// Extending never shortens a lease, in Redis or in [`remaining`](Self::remaining): a
    /// `ttl` shorter than what is left changes nothing. To give the lock back early, release
    /// it. `ttl` must be at least 1 ms and at most [`MAX_TTL`](crate::MAX_TTL).
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        check_ttl(ttl).map_err(|reason| LockError::invalid("ttl", format!("a lease {reason}")))?;
        if self.given_back_by_shutdown() {
            return Err(LockError::ShutDown);
        }
        // A nested hold of a set's lock shares the set's lease: every lock of the set still
        // held is extended, or the lease would promise more than the others have.
        let holds = self.parts.held.lease_sharers();
        let sent = Instant::now();
        let extended = self
            .parts
            .manager
            .inner
            .exec(move |backend| async move {
                let mut all = true;
                for hold in &holds {
                    all &= backend
                        .extend(&hold.lock, hold.share.as_deref(), &hold.token, ttl)
                        .await?;
                }
                Ok::<bool, redis::RedisError>(all)
            })
            .await?
            .map_err(|e| LockError::redis(self.key(), e))?;
        // An answer after the local deadline finds the lease already lost.
        if !extended || !self.parts.lease.renewed(sent, ttl) {
            self.parts.lease.mark_lost();
            return Err(self.lost_error());
        }
        Ok(())
    }

    /// Gives the lock back and waits for Redis to confirm. Renewal stops at once.
    ///
    /// [`LockError::Lost`] means the lease had already ended: another owner may have held the
    /// key meanwhile (that owner's lock is left untouched). A release whose reply is lost is
    /// sent once more; if that second attempt finds the lock gone while the lease was still
    /// valid, it counts as released.
    /// With `min_hold`, the key stays (owned by nobody) until `min_hold` after the acquisition.
    ///
    /// Nested holds are counted in this process: releasing one while others of the same owner
    /// remain (in any order) asks nothing of Redis, and the lock is given back with the last.
    ///
    /// If this future is dropped before Redis answers, the release is still sent, from the
    /// manager's background runtime. After [`LockManager::shutdown`] gave the lock back, this
    /// returns [`LockError::ShutDown`].
    pub async fn release(mut self) -> Result<(), LockError> {
        self.parts.span.releasing();
        self.parts.renewal = None;
        if !self.unlist() {
            return Err(LockError::ShutDown);
        }
        if !self.parts.held.leave() {
            // Other holds of this owner keep the lock.
            if self.parts.lease.is_lost() {
                self.parts.lease.mark_lost();
                return Err(self.lost_error());
            }
            return Ok(());
        }
        let keep_until = self.parts.held.keep_until();
        // Sends the release again from the background if this future is dropped midway.
        let mut unanswered = Unanswered::armed(&self);
        if self.parts.held.ids.fair.is_some() {
            // Boxed, as the other paths off the plain one: their state stays out of this
            // future, which the caller's task carries.
            let outcome = Box::pin(self.release_fair()).await;
            unanswered.answered();
            return outcome;
        }
        let retried = match self.release_locally(keep_until).await? {
            Locally::Done(outcome) => {
                unanswered.answered();
                return outcome;
            }
            Locally::Passed(run, check) => {
                // The hold is the next holder's now: nothing of it is this guard's to send.
                unanswered.answered();
                return Box::pin(self.checked(&run, check)).await;
            }
            Locally::Unsettled => true,
            Locally::NotHere => false,
        };
        let outcome = self.release_on_server(keep_until, retried).await;
        unanswered.answered();
        outcome
    }

    /// Gives a plain lock to a waiter of this manager, if one waits: passed as it is within
    /// a cohort, or handed over in the release's own round trip; or lets other processes
    /// have their turn after a run of hand-offs.
    async fn release_locally(&self, keep_until: Option<Instant>) -> Result<Locally, LockError> {
        let inner = &self.parts.manager.inner;
        let held = &self.parts.held;
        if !held.ids.plain || keep_until.is_some() || !inner.backend.capabilities().hand_off {
            return Ok(Locally::NotHere);
        }
        // A run whose check found the hold gone (or could not tell) passes it no more.
        let run = held.run.get();
        let passable = (held.cohort && run.is_none_or(|run| run.passable())).then(|| Passable {
            remaining: self.parts.lease.remaining(),
            passes: held.passes,
            run_began: run.map(|run| run.began()),
        });
        Ok(
            match inner
                .waiters
                .next(&held.ids.wake, self.parts.lease.ttl(), passable)
            {
                Next::Release => Locally::NotHere,
                Next::Pass(offer) => match self.pass(offer) {
                    Ok((run, check)) => Locally::Passed(run, check),
                    // The waiter left: this release goes to everyone.
                    Err(()) => Locally::NotHere,
                },
                // Boxed, as the other paths off the plain one: their state stays out of
                // this future, which the caller's task carries.
                Next::Yield => Locally::Done(Box::pin(self.yield_to_others()).await),
                Next::HandOff(offer) => match Box::pin(self.hand_off(offer)).await? {
                    Some(outcome) => Locally::Done(outcome),
                    // No answer: whether the owner changed is unknown. The release on the
                    // server settles it (the waiter, told nothing, tries by itself
                    // meanwhile).
                    None => Locally::Unsettled,
                },
            },
        )
    }

    /// Gives the lock back on the server, once more if the reply is lost; `retried`: a
    /// release was sent already, so a lock found gone may have been given back by it.
    async fn release_on_server(
        &self,
        keep_until: Option<Instant>,
        mut retried: bool,
    ) -> Result<(), LockError> {
        let inner = &self.parts.manager.inner;
        self.end_run();
        inner.releaser().after_release(&self.parts.held.ids);
        loop {
            let ids = self.ids();
            let keep = keep_from(keep_until);
            let outcome = inner
                .exec(move |backend| async move { backend.release(&ids, keep).await })
                .await?;
            let settled = match &outcome {
                Ok(true) => Ok(true),
                Ok(false) if !release::found_lost(retried, &self.parts.lease) => Ok(true),
                Ok(false) => Ok(false),
                Err(error) if release::send_again(error, retried) => {
                    retried = true;
                    continue;
                }
                Err(error) => Err(error.clone()),
            };
            self.run_ended(settled);
            return match outcome {
                Ok(true) => {
                    inner.waiters.released(&self.parts.held.ids.wake);
                    tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "released");
                    Ok(())
                }
                // The first attempt may have released it before its reply was lost.
                Ok(false) if !release::found_lost(retried, &self.parts.lease) => {
                    inner.waiters.released(&self.parts.held.ids.wake);
                    Ok(())
                }
                Ok(false) => {
                    // Nobody of this manager holds it: the local head asks the server.
                    inner.waiters.released(&self.parts.held.ids.wake);
                    self.parts.lease.mark_lost();
                    Err(self.lost_error())
                }
                Err(error) => Err(LockError::redis(self.key(), error)),
            };
        }
    }

    /// Gives back a fair lock: to the oldest waiter in its queue, if any, or to everyone. A
    /// waiter of this manager gets the grant in-process, at once.
    async fn release_fair(&self) -> Result<(), LockError> {
        let inner = &self.parts.manager.inner;
        let ids = self.ids();
        inner.releaser().after_release(&ids);
        let mut retried = false;
        loop {
            let sent = Instant::now();
            let release = {
                let ids = ids.clone();
                move |backend: crate::backend::Backend| async move { backend.release_fair(&ids).await }
            };
            match inner.exec(release).await? {
                Ok(FairRelease::Granted(next)) => {
                    tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "granted to the next in line");
                    inner.releaser().hand_fair(&ids, &next, sent);
                    return Ok(());
                }
                Ok(FairRelease::Freed) => {
                    inner.waiters.released(&ids.wake);
                    tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "released");
                    return Ok(());
                }
                Ok(FairRelease::NotHeld) if !release::found_lost(retried, &self.parts.lease) => {
                    return Ok(());
                }
                Ok(FairRelease::NotHeld) => {
                    self.parts.lease.mark_lost();
                    return Err(self.lost_error());
                }
                Err(error) if release::send_again(&error, retried) => retried = true,
                Err(error) => return Err(LockError::redis(self.key(), error)),
            }
        }
    }

    /// Gives back a plain lock at the end of a run of local hand-offs: the lock goes to every
    /// process alike, and the local waiters sit out while other processes' waiters take
    /// their turns.
    async fn yield_to_others(&self) -> Result<(), LockError> {
        let inner = &self.parts.manager.inner;
        let ids = self.ids();
        let lease = self.parts.lease.ttl();
        let release = {
            let ids = ids.clone();
            move |backend: crate::backend::Backend| async move { backend.release_plain(&ids).await }
        };
        self.end_run();
        inner.releaser().after_release(&ids);
        let answer = inner.exec(release).await?;
        self.run_ended(answer.as_ref().map(Option::is_some).map_err(Clone::clone));
        match answer {
            Ok(Some(heard)) => {
                let cohort = self.parts.held.cohort;
                inner.waiters.yielded(&ids.wake, heard, lease, cohort);
                Ok(())
            }
            Ok(None) => {
                inner.waiters.unyielded(&ids.wake);
                self.parts.lease.mark_lost();
                Err(self.lost_error())
            }
            Err(error) => {
                inner.waiters.unyielded(&ids.wake);
                // Sent again from the background: whether it arrived is unknown.
                inner.releaser().in_background(ids, None);
                Err(LockError::redis(self.key(), error))
            }
        }
    }

    /// Passes the lock to a local waiter's `offer` with no server command: the waiter takes
    /// this server hold over as it is (token and lease), in the same run (this hold's, or one
    /// that begins here). Answers the run and the number of the check, sent from now on, that
    /// tells whether the server still had the hold; `Err` when the waiter has left: the lock
    /// is still this guard's to release.
    fn pass(&self, offer: Offer) -> Result<(Arc<Run>, u64), ()> {
        let inner = &self.parts.manager.inner;
        let ids = self.ids();
        let run = match self.parts.held.run.get() {
            Some(run) => run.clone(),
            None => Run::new(
                ids.clone(),
                self.parts.lease.clone(),
                inner.backend.clone(),
                inner.driver.clone(),
            ),
        };
        let local = LocalPass {
            run: run.clone(),
            passes: self.parts.held.passes.saturating_add(1),
        };
        let handed = Handed::new(Instant::now(), inner.releaser(), ids, Some(local));
        match offer.handed.send(handed) {
            Ok(()) => {
                inner.waiters.passed();
                let check = run.passed();
                tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "passed locally");
                Ok((run, check))
            }
            Err(mut handed) => {
                handed.disarm();
                Err(())
            }
        }
    }

    /// Passes the lock to a local waiter's `offer` in one round trip: the owner becomes the
    /// waiter's token, with the waiter's lease, if this owner still holds it. `None` when the
    /// answer was lost; otherwise the release's outcome.
    async fn hand_off(&self, offer: Offer) -> Result<Option<Result<(), LockError>>, LockError> {
        let inner = &self.parts.manager.inner;
        let ids = self.ids();
        let Offer {
            token,
            lease,
            handed,
            ..
        } = offer;
        // The waiter's own attempts were all answered, or its cover gives back what they
        // may hold: nothing late of this token is this release's to cover.
        let next = Arc::new(HoldIds {
            token,
            late_until: None,
            ..(*ids).clone()
        });
        let sent = Instant::now();
        let swap = {
            let (ids, next) = (ids.clone(), next.clone());
            move |backend: crate::backend::Backend| async move {
                backend.hand_off(&ids, &next.token, lease).await
            }
        };
        self.end_run();
        inner.releaser().after_release(&ids);
        let answer = inner.exec(swap).await?;
        match &answer {
            // The release sent next settles the run.
            Err(error) if error.is_io_error() => {}
            answer => self.run_ended(answer.clone()),
        }
        match answer {
            Ok(true) => {
                inner.waiters.handed_off();
                tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "handed over");
                let handed = handed.send(Handed::new(sent, inner.releaser(), next, None));
                // The waiter gave up (or was cancelled) meanwhile: nobody takes the lock here,
                // so this release gives it to everyone, with the wake-up, before it returns.
                // One that gives up after this point drops the grant, which does the same from
                // the background.
                // The grant stays armed until the release has been answered: an error, or
                // this future dropped midway, drops it armed, which releases from the
                // manager's runtime.
                if let Err(mut handed) = handed
                    && let Some(next) = handed.unclaimed()
                {
                    let release = {
                        let next = next.clone();
                        move |backend: crate::backend::Backend| async move {
                            backend.release(&next, Duration::ZERO).await
                        }
                    };
                    match inner.exec(release).await? {
                        Ok(released) => {
                            handed.disarm();
                            if released {
                                inner.waiters.released(&ids.wake);
                            }
                        }
                        // Whether it arrived is unknown: the armed grant sends it again.
                        Err(_) => drop(handed),
                    }
                }
                Ok(Some(Ok(())))
            }
            // Not this owner's any more: the waiter, told nothing, tries by itself.
            Ok(false) => {
                self.parts.lease.mark_lost();
                Ok(Some(Err(self.lost_error())))
            }
            Err(error) if error.is_io_error() => Ok(None),
            Err(error) => Ok(Some(Err(LockError::redis(self.key(), error)))),
        }
    }

    /// The run this hold came by, if it came by a local pass: its last release is about to
    /// be sent (see [`Run::ending`]). Settled by [`run_ended`](Self::run_ended), or, when
    /// this release is dropped before its answer, by the release sent again from the
    /// manager's runtime (see [`Unanswered`]). Nothing of it is kept across the release's
    /// awaits: every caller's release future would carry it.
    fn end_run(&self) {
        if let Some(run) = self.parts.held.run.get() {
            run.ending();
        }
    }

    /// The run's last release answered (see [`end_run`](Self::end_run)).
    fn run_ended(&self, answer: redis::RedisResult<bool>) {
        if let Some(run) = self.parts.held.run.get() {
            run.settle(answer);
        }
    }

    /// A release that passed the lock on within `run`: `Ok` once `check` (or a later check)
    /// found the hold still the run's; [`LockError::Lost`] when it was gone.
    async fn checked(&self, run: &Arc<Run>, check: u64) -> Result<(), LockError> {
        match run.confirm(check, &self.parts.manager.inner.holds).await {
            Checked::Held => Ok(()),
            Checked::Stolen => {
                self.parts.lease.mark_lost();
                Err(LockError::Lost {
                    key: self.parts.name.clone(),
                })
            }
            Checked::Failed(error) => Err(LockError::redis(self.key(), error)),
            Checked::ShutDown => Err(LockError::ShutDown),
        }
    }

    fn ids(&self) -> Arc<HoldIds> {
        self.parts.held.ids.clone()
    }

    fn lost_error(&self) -> LockError {
        if self.given_back_by_shutdown() {
            return LockError::ShutDown;
        }
        LockError::Lost {
            key: self.parts.name.clone(),
        }
    }

    pub(crate) fn held(&self) -> &Arc<Held> {
        &self.parts.held
    }

    /// The manager this guard's hold belongs to (for guarded writes).
    pub(crate) fn manager(&self) -> &LockManager {
        &self.parts.manager
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let shutdown = self.given_back_by_shutdown();
        let lost = self.is_lost() && !shutdown;
        crate::metrics::hold_ended(self.parts.metrics, self.parts.acquired.sent, lost);
        self.parts.span.end(shutdown, lost);
        self.parts.renewal = None;
        if self.unlist() && self.parts.held.leave() {
            let keep_until = self.parts.held.keep_until();
            let releaser = self.parts.manager.inner.releaser();
            match self.parts.held.run.get() {
                Some(run) => releaser.end_run_in_background(self.ids(), keep_until, run),
                None => releaser.in_background(self.ids(), keep_until),
            }
        }
    }
}

impl Resend for LockGuard {
    fn resend(&self) {
        let releaser = self.parts.manager.inner.releaser();
        let (ids, keep_until) = (self.ids(), self.parts.held.keep_until());
        match self.parts.held.run.get() {
            // Its answer settles the run's checks.
            Some(run) => releaser.end_run_in_background(ids, keep_until, run),
            None => releaser.in_background(ids, keep_until),
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.parts.name)
            .field("token", &self.parts.held.ids.token)
            .field("fencing_token", &self.parts.fence)
            .field("remaining", &self.remaining())
            .field("watchdog", &self.parts.renewal.is_some())
            .finish_non_exhaustive()
    }
}

/// Takes back the write intent `intent` of the writer `ids` (which gave up without the
/// lock), if it is still that writer's, and wakes the readers it kept out.
pub(crate) async fn withdraw_intent(inner: Arc<Inner>, ids: Arc<HoldIds>, intent: String) {
    match inner
        .backend
        .withdraw_intent(&intent, &ids.wake, &ids.token)
        .await
    {
        Ok(true) => inner.waiters.released(&ids.wake),
        Ok(false) => {}
        Err(error) => {
            tracing::debug!(%error, "a write intent could not be taken back; it expires");
        }
    }
}
