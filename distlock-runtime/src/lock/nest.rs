//! The reentrancy rule, for one lock and for each lock of a set: whether this task already
//! holds what a request asks for, and the nested hold it then gets, once the server confirms
//! that the outer hold still holds the lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::context;
use crate::error::LockError;
use crate::guard::{Acquired, LockGuard};
use crate::held::{Held, HoldKind};
use crate::key::Keys;
use crate::kind::RequestKind;
use crate::lease::keep_until;
use crate::manager::LockManager;
use crate::request::plan::Plan;
use crate::watchdog::Leased;

use super::grant::{build, register_renewal};

/// Whether this task already holds the lock `plan` asks for, in a way that makes the request
/// a nested hold of it (`Some`), a fresh owner (`None`), or a mistake (an error).
pub(crate) fn outer_hold(
    manager: &LockManager,
    kind: RequestKind,
    plan: &Plan<Keys>,
) -> Result<Option<Arc<Held>>, LockError> {
    let manager_addr = manager.inner.addr();
    let Some(held) = context::find(manager_addr, &plan.keys.lock) else {
        return Ok(None);
    };
    let key = || plan.keys.name.clone();
    let nest = match kind {
        RequestKind::Exclusive | RequestKind::Write => match held.kind {
            HoldKind::Exclusive if held.reentrant && plan.options.reentrant => true,
            HoldKind::Read if kind == RequestKind::Write => {
                return Err(LockError::Upgrade { key: key() });
            }
            _ => false,
        },
        // Downgrade: the writer takes the read side as a nested hold of its write lock; or
        // another read hold of the same share.
        RequestKind::Read => matches!(held.kind, HoldKind::Exclusive | HoldKind::Read),
        // Another permit is an independent holder, unless this code already holds every
        // permit: it would wait for itself. Anything else on the key would wait for this
        // task's own lock.
        RequestKind::Permits(permits) if held.kind == HoldKind::Permit => {
            if context::count(manager_addr, &plan.keys.lock) < permits as usize {
                return Ok(None);
            }
            false
        }
        RequestKind::Permits(_) => false,
    };
    if nest {
        Ok(Some(held))
    } else {
        Err(LockError::WouldDeadlock { key: key() })
    }
}

/// A nested hold of `held`, which this code already owns, once the server confirms that the
/// outer hold's token still holds the lock (one round trip): a nested acquire never answers
/// `Ok` for a hold that is lost, stolen or being given back. Refused with
/// [`LockError::Lost`] when the outer hold is known lost, when its last guard has left (its
/// release is on its way), or when the server no longer has it (the shared lease is then
/// marked lost, which every guard of the hold sees).
pub(crate) async fn nest(
    manager: &LockManager,
    plan: Plan<Keys>,
    held: Arc<Held>,
) -> Result<LockGuard, LockError> {
    let lost = |key: &str| LockError::Lost {
        key: key.to_owned(),
    };
    if held.lease.is_lost() {
        held.lease.mark_lost();
        return Err(lost(&plan.keys.name));
    }
    let key = plan.keys.name.clone();
    let Some(guard) = nested(manager, plan, held) else {
        return Err(lost(&key));
    };
    // Dropped, the nested guard only counts itself off: the outer hold keeps the lock.
    // An answer that came after the lease's local deadline vouches for nothing.
    if !guard.is_held().await? || guard.held().lease.is_lost() {
        guard.held().lease.mark_lost();
        return Err(lost(&key));
    }
    Ok(guard)
}

/// The guard of a nested hold of `held`: it shares the outer hold's token, lease, share and
/// fencing token, counted here. Its `min_hold` is kept when the last hold is released; with
/// `watchdog`, it renews the shared lease too. Not recorded: the outer hold is already
/// visible where it is taken. `None` when the last guard of `held` left meanwhile.
fn nested(manager: &LockManager, plan: Plan<Keys>, held: Arc<Held>) -> Option<LockGuard> {
    let sent = Instant::now();
    if !held.enter(keep_until(sent, plan.options.min_hold)) {
        return None;
    }
    let lease = held.lease.clone();
    // Inside a set's lock, the lease is the set's: renewed for all of its locks or none.
    let holds = match held.set.get() {
        Some(_) => Leased::InSet {
            ids: held.ids.clone(),
            held: Arc::downgrade(&held),
        },
        None => Leased::One(held.ids.clone()),
    };
    let renewal = register_renewal(&manager.inner, &plan, holds, &lease, sent);
    tracing::debug!("acquired a nested hold");
    let acquired = Acquired {
        attempts: 1,
        waited: Duration::ZERO,
        sent,
    };
    let fence = plan.options.fencing.then_some(held.fence);
    Some(build(manager, plan, fence, lease, acquired, renewal, held))
}
