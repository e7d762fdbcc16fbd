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
use std::sync::{Arc, Weak};

use crate::held::Held;

tokio::task_local! {
    static FRAME: RefCell<Vec<Weak<Held>>>;
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
