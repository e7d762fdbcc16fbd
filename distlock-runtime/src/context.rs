//! Which locks the current code holds: reentrancy and self-deadlock detection without
//! thread identity.
//!
//! Ownership belongs to an acquisition context: a chain of frames kept in a task-local. Every
//! `#[distributed_lock]` call and every [`scope`] opens a frame of its own for the future it
//! wraps; the frame starts with the holds visible where it was opened (copied on entry), and
//! a hold is recorded in the frame of the code that took it. A hold is therefore visible to
//! everything that runs inside it, and never to concurrent siblings of the same task
//! (branches of `join!`, `select!`, `FuturesUnordered`) that each run in a frame of their own:
//! those are separate owners and exclude each other. A spawned task (which does not inherit
//! task-locals) starts empty.
//!
//! Locks taken by hand are recorded in the current frame, so code that locks by hand in
//! several concurrent branches of one frame cannot be told apart from nested code: wrap each
//! such branch in its own [`scope`].

use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use crate::backend::HoldIds;
use crate::lease::LeaseState;

tokio::task_local! {
    static FRAME: RefCell<Vec<Weak<Held>>>;
}

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
/// may nest in it. Not what the request asked for ([`RequestKind`](crate::request::RequestKind),
/// which tells a write lock from an exclusive one and counts permits): see
/// [`RequestKind::hold_kind`](crate::request::RequestKind::hold_kind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HoldKind {
    /// An exclusive lock, or the write side of a read-write lock.
    Exclusive,
    /// The read side of a read-write lock.
    Read,
    /// A semaphore permit.
    Permit,
}

/// The lock `lock` of the manager at `manager_addr` visible in the current frame, if any.
/// A hold whose last guard has left is not: its release is on its way, and a request for
/// the lock waits for it on the server as any other owner's would.
pub(crate) fn find(manager_addr: usize, lock: &str) -> Option<Arc<Held>> {
    FRAME
        .try_with(|held| {
            held.borrow()
                .iter()
                .filter_map(Weak::upgrade)
                .find(|h| h.manager_addr == manager_addr && h.ids.lock == lock && h.is_held_here())
        })
        .ok()
        .flatten()
}

/// How many holds of `lock` of the manager at `manager_addr` the current frame sees
/// (several permits, say).
pub(crate) fn count(manager_addr: usize, lock: &str) -> usize {
    FRAME
        .try_with(|held| {
            held.borrow()
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|h| {
                    h.manager_addr == manager_addr && h.ids.lock == lock && h.is_held_here()
                })
                .count()
        })
        .unwrap_or(0)
}

/// Records `held` in the current frame, if there is one.
pub(crate) fn record(held: &Arc<Held>) {
    let _ = FRAME.try_with(|list| {
        let mut list = list.borrow_mut();
        list.retain(|h| h.strong_count() > 0);
        list.push(Arc::downgrade(held));
    });
}

/// Runs `body` in a frame of its own that starts with the holds visible here, plus `held`.
pub(crate) async fn run_holding<'h, F: Future>(
    held: impl IntoIterator<Item = &'h Arc<Held>>,
    body: F,
) -> F::Output {
    let mut list = FRAME
        .try_with(|list| {
            list.borrow()
                .iter()
                .filter(|h| h.strong_count() > 0)
                .cloned()
                .collect()
        })
        .unwrap_or_else(|_| Vec::new());
    list.extend(held.into_iter().map(Arc::downgrade));
    FRAME.scope(RefCell::new(list), body).await
}

/// Runs `body` as an owner of its own within the current acquisition context: it sees the
/// locks held where it is called, and the locks it takes by hand are visible to the code that
/// runs inside it (re-entered with `reentrant`; re-acquired without it, they fail at once with
/// [`LockError::WouldDeadlock`](crate::LockError::WouldDeadlock) instead of waiting for
/// themselves), but not to the code around it.
///
/// `#[distributed_lock]` bodies already run in one. Concurrent branches of one task that take
/// locks by hand (`join!`, `select!`, `FuturesUnordered`) must each run in a scope of their
/// own to exclude each other: branches of one scope share its holds, as nested code does.
/// Contexts do not cross `tokio::spawn`: a spawned task is a different owner.
pub async fn scope<F: Future>(body: F) -> F::Output {
    run_holding([], body).await
}
