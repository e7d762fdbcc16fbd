//! How a guard gives its hold back once its owner's last guard leaves: to a waiter of this
//! manager (passed as it is within a cohort, or handed over in the release's own round
//! trip), to every process at the end of a run of hand-offs, or to everyone. Every way that
//! asks the server to give the hold back goes through
//! [`Releaser::give_back`](crate::release::Releaser::give_back); a hand-off
//! changes the owner instead, and when its answer is lost that release settles it.

use std::sync::Arc;
use std::time::Instant;

use super::LockGuard;
use crate::backend::HoldIds;
use crate::cohort::{Checked, CohortRun};
use crate::error::LockError;
use crate::handed::{Handed, LocalPass};
use crate::release::{Known, OneHold, Outcome, Unanswered, Yielding};
use crate::waiters::{Next, Offer, Passable};

/// What a release did in this process, before the server.
enum Locally {
    /// The lock went to a waiter of this manager, or to other processes' turns.
    Done(Result<(), LockError>),
    /// The lock was passed on within a cohort's run: the release answers once this check of
    /// the run (or a later one) tells whether the server still had the hold after the pass.
    Passed(Arc<CohortRun>, u64),
    /// A hand-off's answer was lost: the release on the server settles it.
    Unsettled,
    /// Nothing here: the release goes to the server.
    NotHere,
}

impl LockGuard {
    /// Gives back the hold this guard was the last of, keeping its key until `keep_until`,
    /// and answers how that went. `Err` when the release could not be carried out here (the
    /// manager's runtime is gone): `unanswered` is left armed, to send it again. Once the
    /// hold is passed on, nothing of it is this guard's to send: `unanswered` is disarmed
    /// before the pass is checked.
    pub(crate) async fn give_back(
        &self,
        keep_until: Option<Instant>,
        unanswered: &mut Unanswered<'_, Self>,
    ) -> Result<Result<(), LockError>, LockError> {
        let resent = match self.release_locally(keep_until).await? {
            Locally::Done(outcome) => return Ok(outcome),
            Locally::Passed(run, check) => {
                unanswered.answered();
                return Ok(Box::pin(self.checked(&run, check)).await);
            }
            Locally::Unsettled => true,
            Locally::NotHere => false,
        };
        self.send(OneHold::new(self.ids(), keep_until), resent)
            .await
    }

    /// The hold this guard gives back, from the manager's runtime (dropped, or its release
    /// future dropped before the answer: `resent`, as the release dropped may have landed).
    pub(crate) fn give_back_in_background(&self, keep_until: Option<Instant>, resent: bool) {
        let known = self.known(resent);
        (self.parts.manager.inner.releaser())
            .in_background(OneHold::new(self.ids(), keep_until), known);
    }

    /// What a release of this hold knows: its lease, and the cohort's run it ends.
    fn known(&self, resent: bool) -> Known {
        Known {
            lease: Some(self.parts.lease.clone()),
            run: self.parts.held.run.get().cloned(),
            resent,
            held_here: true,
        }
    }

    /// Gives `given` back on the server, and answers as a guard's release does (`Err`: it
    /// could not be sent from here).
    async fn send(&self, given: OneHold, resent: bool) -> Result<Result<(), LockError>, LockError> {
        let inner = &self.parts.manager.inner;
        let (releaser, known) = (inner.releaser(), self.known(resent));
        // Boxed: the loop's state stays out of the caller's release future.
        match inner
            .on_runtime(move |_| Box::pin(releaser.give_back(given, known)))
            .await?
        {
            Outcome::Released => {
                tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "released");
                Ok(Ok(()))
            }
            Outcome::Lost(_) => Ok(Err(self.lost_error())),
            Outcome::Unknown(error) => Ok(Err(LockError::redis(self.key(), error))),
        }
    }

    /// Gives a plain lock to a waiter of this manager, if one waits: passed as it is within
    /// a cohort, or handed over in the release's own round trip; or lets other processes
    /// have their turn after a run of hand-offs.
    async fn release_locally(&self, keep_until: Option<Instant>) -> Result<Locally, LockError> {
        let inner = &self.parts.manager.inner;
        let held = &self.parts.held;
        // A fair lock goes to the head of its server queue, never to a local waiter first.
        let fair = held.ids.fair.is_some();
        if fair || !held.ids.plain || keep_until.is_some() || !inner.backend.capabilities().hand_off
        {
            return Ok(Locally::NotHere);
        }
        // A run whose check found the hold gone (or could not tell) passes it no more.
        let run = held.run.get();
        // A hold that sent a guarded write is not passed on: a write of it still on its way
        // would run under the next holder's identical token. It is handed off instead.
        let wrote = held.wrote.load(std::sync::atomic::Ordering::Acquire);
        let passable =
            (held.cohort && !wrote && run.is_none_or(|run| run.passable())).then(|| Passable {
                remaining: self.parts.lease.remaining(),
                passes: held.passes,
                run_began: run.map(|run| run.began()),
            });
        let lease = self.parts.lease.ttl();
        Ok(match inner.waiters.next(&held.ids.wake, lease, passable) {
            Next::Release => Locally::NotHere,
            Next::Pass(offer) => match self.pass(offer) {
                Ok((run, check)) => Locally::Passed(run, check),
                // The waiter left: this release goes to everyone.
                Err(()) => Locally::NotHere,
            },
            // Boxed, as the other paths off the plain one: their state stays out of this
            // future, which the caller's task carries.
            Next::Yield => {
                let cohort = held.cohort;
                let given = OneHold::yielding(self.ids(), Yielding { lease, cohort });
                Locally::Done(Box::pin(self.send(given, false)).await?)
            }
            Next::HandOff(offer) => match Box::pin(self.hand_off(offer)).await? {
                Some(outcome) => Locally::Done(outcome),
                // No answer: whether the owner changed is unknown. The release on the server
                // settles it (the waiter, told nothing, tries by itself meanwhile).
                None => Locally::Unsettled,
            },
        })
    }

    /// Passes the lock to a local waiter's `offer` with no server command: the waiter takes
    /// this server hold over as it is (token and lease), in the same run (this hold's, or one
    /// that begins here). Answers the run and the number of the check, sent from now on, that
    /// tells whether the server still had the hold; `Err` when the waiter has left: the lock
    /// is still this guard's to release.
    fn pass(&self, offer: Offer) -> Result<(Arc<CohortRun>, u64), ()> {
        let inner = &self.parts.manager.inner;
        let ids = self.ids();
        let run = match self.parts.held.run.get() {
            Some(run) => run.clone(),
            None => CohortRun::new(
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
        let handed = Handed::new(Instant::now(), inner.giver(), ids, Some(local));
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
        let run = self.parts.held.run.get();
        if let Some(run) = run {
            run.ending();
        }
        let releaser = inner.releaser();
        releaser.cover_late(&OneHold::new(ids.clone(), None));
        let answer = inner.on_runtime(swap).await?;
        match (&answer, run) {
            // The release sent next settles the run.
            (Err(error), _) if error.is_io_error() => {}
            (answer, Some(run)) => run.ended_by(answer.clone()),
            (_, None) => {}
        }
        match answer {
            Ok(true) => {
                inner.waiters.handed_off();
                tracing::debug!(key = %self.key(), held_for = ?self.parts.acquired.sent.elapsed(), "handed over");
                let handed = handed.send(Handed::new(sent, inner.giver(), next, None));
                // The waiter gave up (or was cancelled) meanwhile: nobody takes the lock here,
                // so this release gives it to everyone, with the wake-up, before it returns.
                // One that gives up after this point drops the grant, which does the same from
                // the background. The grant stays armed until the release has been answered:
                // an error, or this future dropped midway, drops it armed, which releases
                // from the manager's runtime.
                if let Err(mut handed) = handed
                    && let Some(next) = handed.untaken()
                {
                    let given = OneHold::new(next.clone(), None);
                    let outcome = inner
                        .on_runtime(move |_| releaser.give_back(given, Known::default()))
                        .await?;
                    if !matches!(outcome, Outcome::Unknown(_)) {
                        handed.disarm();
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

    /// A release that passed the lock on within `run`: `Ok` once `check` (or a later check)
    /// found the hold still the run's; [`LockError::Lost`] when it was gone.
    async fn checked(&self, run: &Arc<CohortRun>, check: u64) -> Result<(), LockError> {
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
}
