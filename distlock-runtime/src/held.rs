//! A hold's record: the hold on the server, shared by the guard that took it and every
//! nested hold of it, and what kind of hold it is.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use crate::backend::HoldIds;
use crate::lease::LeaseState;

/// One lock held in a context: the hold on the server, shared by the guard that took it and
/// every nested hold of it (nested holds are counted here, not in Redis). Owned by those
/// guards; frames only point at it, so it disappears from every frame once the last of them
/// is released or dropped.
#[derive(Debug)]
pub(crate) struct Held {
    /// Which manager ([`Inner::addr`](crate::manager::Inner::addr)): the same key on two
    /// managers is two locks.
    pub(crate) manager_addr: usize,
    pub(crate) reentrant: bool,
    pub(crate) kind: HoldKind,
    /// What names the hold on the server, for the release of the last guard.
    pub(crate) ids: Arc<HoldIds>,
    /// The fencing token drawn by the first hold (0 without fencing).
    pub(crate) fence: u64,
    /// The lease of the hold on the server, seen by every guard of it.
    pub(crate) lease: Arc<LeaseState>,
    /// Guards not yet released: the first one and the nested ones.
    pub(crate) guards: AtomicUsize,
    /// The latest end of a `min_hold` asked for by any of the guards.
    pub(crate) keep_until: Mutex<Option<Instant>>,
    /// The request allows a local pass at release (see `LockRequest::cohort`).
    pub(crate) cohort: bool,
    /// How many local passes this hold is from the server's grant (0: granted by Redis).
    pub(crate) passes: u32,
    /// The cohort's run this hold came by, when it came by a local pass (see `cohort`).
    pub(crate) run: std::sync::OnceLock<Arc<crate::cohort::CohortRun>>,
    /// For a lock of a set: every lock of the set (this one included), which share this
    /// hold's lease. What moves that lease on (a nested hold's renewal or extend) must reach
    /// every one of them still held, or the set's `remaining()` would promise more than a lock
    /// left behind has.
    pub(crate) set: std::sync::OnceLock<Arc<[Weak<Held>]>>,
    /// A guarded write was sent under this hold: it is never passed on locally, since a
    /// write still on its way would run under the next holder's identical token.
    pub(crate) wrote: std::sync::atomic::AtomicBool,
}

impl Held {
    /// One more guard on this hold, keeping the key until `keep_until` at least: `false`
    /// (and nothing changed) when the last guard has left, and the hold is being given back.
    pub(crate) fn enter(&self, keep_until: Option<Instant>) -> bool {
        let entered = self
            .guards
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |guards| {
                (guards > 0).then_some(guards + 1)
            })
            .is_ok();
        if entered {
            self.keep(keep_until);
        }
        entered
    }

    /// Whether a guard still holds this: after the last one left, its release is on its way
    /// and nothing may nest in it.
    pub(crate) fn is_held_here(&self) -> bool {
        self.guards.load(Ordering::Acquire) > 0
    }

    /// Keeps the key until `until` at least once the last guard is released.
    pub(crate) fn keep(&self, until: Option<Instant>) {
        let mut keep = self.keep_until.lock().unwrap_or_else(|e| e.into_inner());
        *keep = (*keep).max(until);
    }

    /// The holds that share this hold's lease and are still held: the live locks of its set,
    /// or this hold alone.
    pub(crate) fn lease_sharers(&self) -> Vec<Arc<HoldIds>> {
        match self.set.get() {
            Some(set) => set
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|held| held.is_held_here())
                .map(|held| held.ids.clone())
                .collect(),
            None => vec![self.ids.clone()],
        }
    }

    /// One guard fewer: `true` for the last one, which gives the hold back on the server.
    pub(crate) fn leave(&self) -> bool {
        self.guards.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Until when the key must live after the last release.
    pub(crate) fn keep_until(&self) -> Option<Instant> {
        *self.keep_until.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a hold in the context holds, which decides what a later request of the same task
/// may nest in it. Not what the request asked for ([`RequestKind`](crate::kind::RequestKind),
/// which tells a write lock from an exclusive one and counts permits): see
/// [`RequestKind::hold_kind`](crate::kind::RequestKind::hold_kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldKind {
    /// An exclusive lock, or the write side of a read-write lock.
    Exclusive,
    /// The read side of a read-write lock.
    Read,
    /// A semaphore permit.
    Permit,
}
