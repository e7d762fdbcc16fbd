//! Which locks the current task holds: reentrancy and self-deadlock detection without
//! thread identity.
//!
//! Ownership belongs to an acquisition context, a task-local list of the locks held by the
//! code running in it. `#[distributed_lock]` opens one around its body when none is open, so
//! nested annotated calls in the same task see the outer locks, while a spawned task (which
//! does not inherit task-locals) starts empty and is a different owner.

use std::cell::RefCell;
use std::future::Future;
use std::sync::{Arc, Weak};

tokio::task_local! {
    static HELD: RefCell<Vec<Weak<Held>>>;
}

/// One lock held in a context. Owned by its guard; the context only points at it, so a
/// released or dropped guard disappears from the context by itself.
#[derive(Debug)]
pub(crate) struct Held {
    /// Which manager (its shared state's address): the same key on two managers is two locks.
    pub(crate) manager: usize,
    pub(crate) lock: String,
    pub(crate) token: String,
    pub(crate) reentrant: bool,
    pub(crate) kind: Kind,
}

/// What sort of hold a context entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An exclusive lock, or the write side of a read-write lock.
    Exclusive,
    /// The read side of a read-write lock.
    Read,
    /// A semaphore permit.
    Permit,
}

/// The lock `lock` of `manager` held in the current context, if any.
pub(crate) fn find(manager: usize, lock: &str) -> Option<Arc<Held>> {
    HELD.try_with(|held| {
        held.borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .find(|h| h.manager == manager && h.lock == lock)
    })
    .ok()
    .flatten()
}

/// Records `held` in the current context, if there is one.
pub(crate) fn record(held: &Arc<Held>) {
    let _ = HELD.try_with(|list| {
        let mut list = list.borrow_mut();
        list.retain(|h| h.strong_count() > 0);
        list.push(Arc::downgrade(held));
    });
}

/// Runs `body` in an acquisition context that holds `held`: the current one if the task is
/// in one (where acquiring already recorded it), a new one otherwise.
pub(crate) async fn run_holding<F: Future>(held: Option<&Arc<Held>>, body: F) -> F::Output {
    if HELD.try_with(|_| ()).is_ok() {
        body.await
    } else {
        let list = held.map(Arc::downgrade).into_iter().collect();
        HELD.scope(RefCell::new(list), body).await
    }
}

/// Runs `body` in an acquisition context, so that locks taken by hand inside it can be
/// re-entered (with `reentrant`) and re-acquiring a held non-reentrant key fails at once with
/// [`LockError::WouldDeadlock`](crate::LockError::WouldDeadlock) instead of waiting for itself.
///
/// `#[distributed_lock]` bodies already run in one. Contexts do not cross `tokio::spawn`:
/// a spawned task is a different owner.
pub async fn scope<F: Future>(body: F) -> F::Output {
    run_holding(None, body).await
}
