//! A guard's assembly: from what a request won (granted by the server, handed over by a
//! local release, or passed within a cohort) to its hold record, renewal and guard.

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{AcquireRequest, HoldIds};
use crate::context;
use crate::engine::{Outcome, Won};
use crate::guard::{Acquired, LockGuard, Parts};
use crate::handed::LocalPass;
use crate::held::{Held, HoldKind};
use crate::key::Keys;
use crate::lease::{LeaseState, keep_until};
use crate::manager::{Inner, LockManager};
use crate::request::plan::Plan;
use crate::watchdog::{Leased, Registration, Renewable};

/// The guard of what a request won: granted by the server, handed over by a local release,
/// or passed locally within a cohort.
pub(super) fn granted(
    manager: &LockManager,
    plan: Plan<Keys>,
    request: Arc<AcquireRequest>,
    kind: HoldKind,
    outcome: Outcome<u64>,
) -> LockGuard {
    let Outcome {
        won,
        attempts,
        started,
        queued,
        ticket,
        late_until,
    } = outcome;
    let (sent, fence, local) = match won {
        Won::Asked { won, sent } => (sent, won, None),
        Won::Handed(handed) => {
            let (sent, local) = handed.take();
            (sent, 0, local)
        }
    };
    let acquired = Acquired {
        attempts,
        waited: started.elapsed(),
        sent,
    };
    crate::metrics::handed_over(plan.metrics, queued);
    tracing::debug!(attempts, waited = ?acquired.waited, local = local.is_some(), "acquired");
    let origin = match local {
        Some(local) => Origin::Passed(local),
        // The request's own strings become the hold's: no copy once its attempts are done.
        None => Origin::Server {
            ids: Arc::new(HoldIds {
                late_until,
                ..Arc::unwrap_or_clone(request).into_hold_ids()
            }),
            fence,
        },
    };
    let guard = grant(manager, plan, kind, acquired, origin);
    // The waiters behind see the holder until the guard exists.
    drop(ticket);
    guard
}

/// Where a first hold comes from.
enum Origin {
    /// The server granted it to `ids` (or a release handed it over through the server).
    Server { ids: Arc<HoldIds>, fence: u64 },
    /// A local release passed the server hold of the holder before on, as it is.
    Passed(LocalPass),
}

/// The guard of a first hold: a new hold with a lease of its own, or, passed locally, a hold
/// of its own on the server hold it takes over (the owner token and lease of the holder
/// before it).
fn grant(
    manager: &LockManager,
    plan: Plan<Keys>,
    kind: HoldKind,
    acquired: Acquired,
    origin: Origin,
) -> LockGuard {
    let sent = acquired.sent;
    let (ids, lease, set, start, fence, run) = match origin {
        Origin::Server { ids, fence } => {
            let lease = Arc::new(LeaseState::new(sent, plan.ttl));
            let keep = keep_until(sent, plan.options.min_hold);
            let shown = plan.options.fencing.then_some(fence);
            (ids, lease, sent, (fence, keep, 0), shown, None)
        }
        // Renewals follow the shared lease from when it was last set (the first one may be
        // due at once), not from the pass. Fenced locks never pass.
        Origin::Passed(LocalPass { run, passes }) => {
            let (ids, lease) = (run.ids().clone(), run.lease().clone());
            let set = lease.valid_until().checked_sub(lease.ttl()).unwrap_or(sent);
            (
                ids,
                lease,
                set.min(sent),
                (0, None, passes),
                None,
                Some(run),
            )
        }
    };
    let renewal = register_renewal(&manager.inner, &plan, Leased::One(ids.clone()), &lease, set);
    let held = Held::first(&manager.inner, &plan, kind, ids, lease.clone(), start);
    if let Some(run) = run {
        let _ = held.run.set(run);
    }
    build(manager, plan, fence, lease, acquired, renewal, held)
}

/// The watchdog's renewal of `lease` (set at `set`), when the request asked for one.
pub(crate) fn register_renewal<K>(
    inner: &Arc<Inner>,
    plan: &Plan<K>,
    holds: Leased,
    lease: &Arc<LeaseState>,
    set: Instant,
) -> Option<Registration> {
    plan.options.watchdog.then(|| {
        let target = Renewable {
            holds,
            metrics: plan.metrics,
        };
        inner
            .watchdog
            .register(inner, target, lease.clone(), set, plan.max_hold)
    })
}

impl Held {
    /// A first hold of a lock (`start`: its fencing token, until when its key must live,
    /// and how many local passes it is from the server's grant): one guard, recorded in the
    /// current frame unless the request says otherwise.
    pub(crate) fn first<K>(
        inner: &Arc<Inner>,
        plan: &Plan<K>,
        kind: HoldKind,
        ids: Arc<HoldIds>,
        lease: Arc<LeaseState>,
        start: (u64, Option<Instant>, u32),
    ) -> Arc<Self> {
        let (fence, keep_until, passes) = start;
        let held = Arc::new(Held {
            manager_addr: inner.addr(),
            reentrant: plan.options.reentrant,
            kind,
            ids,
            fence,
            lease,
            guards: AtomicUsize::new(1),
            keep_until: Mutex::new(keep_until),
            cohort: !plan.options.server_path,
            passes,
            run: std::sync::OnceLock::new(),
            set: std::sync::OnceLock::new(),
            wrote: std::sync::atomic::AtomicBool::new(false),
        });
        if !plan.options.recorded_by_caller {
            context::record(&held);
        }
        held
    }
}

/// The guard, from its parts.
pub(super) fn build(
    manager: &LockManager,
    plan: Plan<Keys>,
    fence: Option<u64>,
    lease: Arc<LeaseState>,
    acquired: Acquired,
    renewal: Option<Registration>,
    held: Arc<Held>,
) -> LockGuard {
    LockGuard::new(Parts {
        manager: manager.clone(),
        name: plan.keys.name,
        fence,
        lease,
        acquired,
        renewal,
        held,
        metrics: plan.metrics,
        span: crate::trace::HoldSpan::default(),
    })
}
