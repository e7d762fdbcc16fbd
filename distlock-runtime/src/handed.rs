//! A lock handed over by a local release, on its way to the waiter that offered to take it
//! ([`Handed`]).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::HoldIds;
use crate::cohort::CohortRun;

/// What gives back a handed lock that nobody took: the manager's releaser (see
/// `release`), seen from here only as this.
pub(crate) trait UntakenGiver: Send + Sync {
    /// Gives back `ids` from the manager's own runtime; `run`: the lock was passed within
    /// that cohort's run, which this release ends.
    fn give_back(&self, ids: Arc<HoldIds>, run: Option<Arc<CohortRun>>);
}

/// A lock handed over by a local release, on its way to the waiter that offered to take it.
/// Dropped untaken (that waiter gave up meanwhile), it gives the lock back from the
/// manager's runtime.
pub(crate) struct Handed {
    sent: Instant,
    untaken: Option<(Arc<dyn UntakenGiver>, Arc<HoldIds>)>,
    /// Passed locally: the server hold taken over as it is.
    local: Option<LocalPass>,
}

/// A server hold passed on by a local release, with no server command: the run it belongs
/// to (which names the hold and its lease, and whose checks tell whether the server still
/// has it), and how many passes it is from the server's grant.
#[derive(Debug)]
pub(crate) struct LocalPass {
    pub(crate) run: Arc<CohortRun>,
    pub(crate) passes: u32,
}

impl Handed {
    /// The lock held as `ids`, handed over at `sent` (when its lease began), and passed
    /// locally as `local` if it was; dropped untaken, `giver` gives `ids` back.
    pub(crate) fn new(
        sent: Instant,
        giver: Arc<dyn UntakenGiver>,
        ids: Arc<HoldIds>,
        local: Option<LocalPass>,
    ) -> Self {
        Self {
            sent,
            untaken: Some((giver, ids)),
            local,
        }
    }

    /// Takes the lock over: when the hand-off was sent, which is when its lease began, and
    /// the server hold it takes over when it was passed locally.
    pub(crate) fn take(mut self) -> (Instant, Option<LocalPass>) {
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

    /// The hold that dropping this gives back: none once taken or disarmed.
    pub(crate) fn untaken(&self) -> Option<&Arc<HoldIds>> {
        self.untaken.as_ref().map(|(_, ids)| ids)
    }

    /// Leaves the lock to whoever holds this now: dropping it then gives nothing back.
    pub(crate) fn disarm(&mut self) {
        self.untaken = None;
    }
}

impl fmt::Debug for Handed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handed")
            .field("sent", &self.sent)
            .field("taken", &self.untaken.is_none())
            .finish()
    }
}

impl Drop for Handed {
    fn drop(&mut self) {
        if let Some((giver, ids)) = self.untaken.take() {
            giver.give_back(ids, self.local.take().map(|local| local.run));
        }
    }
}
