//! Grants on their way to their waiters ([`Handed`]), and what gives a hold back from the
//! manager's own runtime ([`Releaser`]).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Grant, Waiters};
use crate::backend::{Backend, FairRelease, HoldIds, SetRequest};
use crate::cohort::Run;
use crate::driver::Driver;
use crate::lease::keep_from;

/// A lock handed over by a local release, on its way to the waiter that offered to take it.
/// Dropped unclaimed (that waiter gave up meanwhile), it gives the lock back from the
/// manager's runtime.
pub(crate) struct Handed {
    sent: Instant,
    unclaimed: Option<(Releaser, Arc<HoldIds>)>,
    /// Passed locally: the server hold taken over as it is.
    local: Option<LocalPass>,
}

/// A server hold passed on by a local release, with no server command: the run it belongs
/// to (which names the hold and its lease, and whose checks tell whether the server still
/// has it), and how many passes it is from the server's grant.
#[derive(Debug)]
pub(crate) struct LocalPass {
    pub(crate) run: Arc<Run>,
    pub(crate) passes: u32,
}

impl Handed {
    /// The lock held as `ids`, handed over at `sent` (when its lease began), and passed
    /// locally as `local` if it was; dropped unclaimed, `releaser` gives `ids` back.
    pub(crate) fn new(
        sent: Instant,
        releaser: Releaser,
        ids: Arc<HoldIds>,
        local: Option<LocalPass>,
    ) -> Self {
        Self {
            sent,
            unclaimed: Some((releaser, ids)),
            local,
        }
    }

    /// Takes the lock over: when the hand-off was sent, which is when its lease began, and
    /// the server hold it takes over when it was passed locally.
    pub(crate) fn claim(mut self) -> (Instant, Option<LocalPass>) {
        self.disarm();
        (self.sent, self.local.take())
    }

    /// Whether the lock came by a local pass (the waiter's own token took no part).
    pub(crate) fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// Until when the lock's lease runs: the shared lease of a hold passed locally, else a
    /// lease of `ttl` from when the hand-off was sent.
    pub(crate) fn lease_until(&self, ttl: Duration) -> Instant {
        match &self.local {
            Some(local) => local.run.lease().valid_until(),
            None => crate::lease::saturating_add(self.sent, ttl),
        }
    }

    /// The hold that dropping this gives back: none once claimed or disarmed.
    pub(crate) fn unclaimed(&self) -> Option<&Arc<HoldIds>> {
        self.unclaimed.as_ref().map(|(_, ids)| ids)
    }

    /// Leaves the lock to whoever holds this now: dropping it then gives nothing back.
    pub(crate) fn disarm(&mut self) {
        self.unclaimed = None;
    }
}

impl fmt::Debug for Handed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handed")
            .field("sent", &self.sent)
            .field("claimed", &self.unclaimed.is_none())
            .finish()
    }
}

impl Drop for Handed {
    fn drop(&mut self) {
        if let Some((releaser, ids)) = self.unclaimed.take() {
            match self.local.take() {
                // Passed locally: this release ends the run.
                Some(local) => releaser.end_run_in_background(ids, None, &local.run),
                None => releaser.in_background(ids, None),
            }
        }
    }
}

/// What gives a hold back from the manager's own runtime: the server, that runtime (which
/// outlives the caller's, and works outside any runtime), and the manager's waiters, to wake
/// or to hand a fair lock to.
#[derive(Debug, Clone)]
pub(crate) struct Releaser {
    pub(crate) backend: Backend,
    pub(crate) driver: Arc<Driver>,
    pub(crate) waiters: Waiters,
}

impl Releaser {
    /// Sends a release for one hold from the manager's own runtime, without waiting for it;
    /// the outcome is only logged. That runtime outlives the caller's, so this works while the
    /// caller's runtime shuts down, and outside any runtime.
    pub(crate) fn in_background(&self, ids: Arc<HoldIds>, keep_until: Option<Instant>) {
        let task = self.clone().logged(ids, keep_until);
        self.driver.spawn(task);
    }

    /// Sends the release of the last hold of a cohort's run from the manager's own runtime,
    /// as [`in_background`](Self::in_background) does; its answer settles the run's checks
    /// (see [`Run::ending_guarded`]).
    pub(crate) fn end_run_in_background(
        &self,
        ids: Arc<HoldIds>,
        keep_until: Option<Instant>,
        run: &Arc<Run>,
    ) {
        // Set before the release is sent.
        let ending = run.ending_guarded();
        let releaser = self.clone();
        self.driver.spawn(async move {
            let answer = releaser.release_logged(&ids, keep_until).await;
            ending.settle(answer);
        });
    }

    /// What every release of `ids` owes once it was sent, whatever its path: when an attempt
    /// of that token whose answer never came may still reach the server (see
    /// [`HoldIds::late_until`]), the release is sent once more then, from the manager's
    /// runtime, so that such an attempt landing after the release cannot keep the lock for
    /// nobody. A release of a hold already given back changes nothing.
    pub(crate) fn after_release(&self, ids: &Arc<HoldIds>) {
        let Some(until) = ids.late_until.filter(|until| *until > Instant::now()) else {
            return;
        };
        let (releaser, ids) = (self.clone(), ids.clone());
        self.driver.spawn(async move {
            tokio::time::sleep_until(until.into()).await;
            match releaser.backend.release(&ids, Duration::ZERO).await {
                Ok(true) => {
                    releaser.waiters.released(&ids.wake);
                    tracing::debug!(lock = %ids.lock, "a late attempt's grant was given back");
                }
                Ok(false) => {}
                Err(error) => tracing::debug!(%error, "the release behind a late attempt failed"),
            }
        });
    }

    /// Sends the release of a whole set from the manager's own runtime, as
    /// [`in_background`](Self::in_background) does for one hold.
    pub(crate) fn set_in_background(&self, request: SetRequest) {
        let task = self.clone().set_logged(request);
        self.driver.spawn(task);
    }

    /// Gives back a whole set and wakes the local waiters of each lock it freed.
    pub(crate) async fn release_set(&self, request: &SetRequest) -> redis::RedisResult<()> {
        let released = self.backend.release_set(request).await?;
        for (yes, key) in released.into_iter().zip(&request.keys) {
            if yes {
                self.waiters.released(&key.wake);
            }
        }
        Ok(())
    }

    /// Gives back a whole set; the outcome is only logged.
    async fn set_logged(self, request: SetRequest) {
        match self.release_set(&request).await {
            Ok(()) => tracing::debug!(locks = request.keys.len(), "set released in the background"),
            Err(error) => tracing::warn!(
                %error,
                "background release of a lock set failed; the leases will expire"
            ),
        }
    }

    /// Releases one hold (keeping the key until `keep_until`), wakes or hands the lock to the
    /// local waiters, and logs the outcome.
    pub(crate) async fn logged(self, ids: Arc<HoldIds>, keep_until: Option<Instant>) {
        let _ = self.release_logged(&ids, keep_until).await;
    }

    /// What [`logged`](Self::logged) does, answering whether the hold was still this owner's.
    async fn release_logged(
        &self,
        ids: &Arc<HoldIds>,
        keep_until: Option<Instant>,
    ) -> redis::RedisResult<bool> {
        self.after_release(ids);
        let answer = if ids.fair.is_some() {
            let sent = Instant::now();
            self.backend
                .release_fair(ids)
                .await
                .map(|release| match release {
                    FairRelease::Granted(next) => {
                        self.hand_fair(ids, &next, sent);
                        true
                    }
                    FairRelease::Freed => {
                        self.waiters.released(&ids.wake);
                        true
                    }
                    FairRelease::NotHeld => false,
                })
        } else {
            let released = self.backend.release(ids, keep_from(keep_until)).await;
            if let Ok(true) = released {
                self.waiters.released(&ids.wake);
                tracing::debug!(lock = %ids.lock, "released in the background");
            }
            released
        };
        match &answer {
            Ok(true) => {}
            Ok(false) => {
                // Nobody of this manager holds it any more.
                self.waiters.released(&ids.wake);
                tracing::debug!(lock = %ids.lock, "background release found the lock already gone");
            }
            Err(error) => tracing::warn!(
                lock = %ids.lock, %error,
                "background release failed; the lease will expire"
            ),
        }
        answer
    }

    /// A release of fair lock `ids` (sent at `sent`) granted it to the owner of token `next`:
    /// if that is a waiter of this manager with a standing offer, it gets the lock in-process,
    /// its lease counted from `sent` (the grant gave it its whole lease, after `sent`). Any
    /// other waiter hears the grant's publish, and asks.
    pub(crate) fn hand_fair(&self, ids: &HoldIds, next: &str, sent: Instant) {
        let Grant::Offer(offer) = self.waiters.grant(&ids.wake, next) else {
            return;
        };
        let fair = ids
            .fair
            .as_ref()
            .map(|queue| queue.for_owner(self.waiters.manager_id(), offer.lease, &offer.token));
        let next = Arc::new(HoldIds {
            token: offer.token,
            fair,
            late_until: None,
            ..ids.clone()
        });
        self.waiters.handed_off();
        // A waiter that gave up meanwhile drops it, which gives the lock back.
        let _ = offer
            .handed
            .send(Handed::new(sent, self.clone(), next, None));
    }
}
