//! One lock: a request's acquire, and the guards it grants — a first hold, a nested hold of
//! this task's own lock, a lock handed over by a local release or passed within a cohort.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::LockError;
use crate::backend::{AcquireAnswer, AcquireRequest, HoldIds, Shape};
use crate::context::{self, Held, HoldKind};
use crate::engine::{Ask, Attempted, Cover, Engine, Outcome, Won};
use crate::guard::{Acquired, LockGuard, Parts};
use crate::handed::LocalPass;
use crate::key::Keys;
use crate::lease::LeaseState;
use crate::lease::keep_until;
use crate::manager::{Inner, LockManager};
use crate::release::{Known, OneHold};
use crate::request::{LockRequest, Plan, RequestKind, Single, Target};
use crate::watchdog::{Leased, Registration, Renewable};

impl Target for Single {
    type Guard = LockGuard;

    fn acquire<'m>(
        request: LockRequest<'m, Self>,
    ) -> impl Future<Output = Result<LockGuard, LockError>> + Send + 'm {
        acquire_one(request)
    }
}

/// Takes one lock: see [`LockRequest::acquire`].
async fn acquire_one(request: LockRequest<'_>) -> Result<LockGuard, LockError> {
    let (manager, skip_holder_lookup) = (request.manager, request.options.skip_holder_lookup);
    let plan = request.into_plan()?;
    if manager.inner.holds.is_shut_down() {
        return Err(LockError::ShutDown);
    }
    let span = crate::trace::acquire(plan.metrics, &plan.keys.name);
    let (labels, timer) = (plan.metrics, crate::metrics::Timer::start());
    let asking = {
        let _entered = span.enter();
        ask(manager, plan)
    };
    let result = match asking {
        Ok(Asking::Nested(plan, held)) => nest(manager, *plan, held).instrument(span).await,
        Ok(Asking::Server(asking)) => {
            let taking = async {
                let result = take(manager, asking).await;
                crate::trace::acquired(&tracing::Span::current(), &result);
                result
            };
            taking.instrument(span).await
        }
        Err(error) => Err(error),
    };
    let result = match result {
        // Dropping it gives it back.
        Ok(guard) if guard.came_after_shutdown() => Err(LockError::ShutDown),
        Err(
            busy @ LockError::Busy {
                holder_token: Some(_),
                ..
            },
        ) if !skip_holder_lookup => Err(Box::pin(name_holder(manager, busy)).await),
        result => result,
    };
    crate::metrics::acquire_ended(labels, timer, &result);
    result.map(|mut guard| {
        // Here, outside the acquire span: the hold is a child of the caller's span.
        guard.start_span(labels);
        guard
    })
}

/// What a request for one lock asks of the server, once the task's own holds are looked at.
enum Asking {
    /// The task already owns the lock, and this is a nested hold of it.
    Nested(Box<Plan<Keys>>, Arc<Held>),
    /// The lock.
    Server(Box<Server>),
}

/// A request for one lock ready to be sent: its plan, what each attempt sends, and the kind
/// of hold it gives.
struct Server {
    plan: Plan<Keys>,
    request: Arc<AcquireRequest>,
    kind: HoldKind,
}

/// Looks at the task's own holds, then shapes what the attempts send.
fn ask(manager: &LockManager, mut plan: Plan<Keys>) -> Result<Asking, LockError> {
    if let Some(held) = outer_hold(manager, plan.kind, &plan)? {
        // The task already owns the lock: counted here, checked on the server.
        return Ok(Asking::Nested(Box::new(plan), held));
    }
    let manager_id = manager.inner.waiters.manager_id();
    let token = new_token(manager_id);
    let shape = shape_of(&plan, &token, manager_id);
    let kind = plan.kind.hold_kind();
    // The lock key moves into the request (and on into the hold): nothing reads it from the
    // plan from here on.
    let wake = plan.keys.wake();
    let request = Arc::new(AcquireRequest {
        shape,
        lock: std::mem::take(&mut plan.keys.lock),
        wake,
        token,
        lease: plan.ttl,
        fencing: plan.options.fencing,
        reentrant: plan.options.reentrant,
    });
    Ok(Asking::Server(Box::new(Server {
        plan,
        request,
        kind,
    })))
}

/// Takes the lock from the server (or from a local release).
async fn take(manager: &LockManager, asking: Box<Server>) -> Result<LockGuard, LockError> {
    let inner = &manager.inner;
    let Server {
        plan,
        request,
        kind,
    } = *asking;
    let started = Instant::now();
    let engine = || {
        Engine::new(
            inner,
            &request,
            &plan,
            std::slice::from_ref(&plan.keys),
            started,
        )
    };
    if let Shape::Fair { .. } = request.shape {
        // Boxed: its state stays out of the plain path's future. A fair request waits with
        // this manager's waiters of the lock from its first attempt on: it hears every grant
        // from then on.
        let outcome = Box::pin(engine().acquire(None, true)).await?;
        return Ok(granted(manager, plan, request, kind, outcome));
    }
    // A plain lock can be handed over by a local release, in that release's round trip.
    let hand_off = matches!(request.shape, Shape::Plain) && inner.backend.capabilities().hand_off;
    // A request that may wait queues behind local waiters instead of overtaking them. Readers
    // and permit holders try first: the waiters ahead may want another kind, while this
    // request may overlap the holders (a free permit, readers inside); queueing it behind
    // them could make it wait for a lock the server would grant, even for itself.
    let shares = matches!(plan.kind, RequestKind::Read | RequestKind::Permits(_));
    let outcome = if plan.retries > 0 && !shares && inner.waiters.has_waiters(&request.wake) {
        Box::pin(engine().hand_off(hand_off).acquire(None, true)).await?
    } else {
        // Any other makes its first attempt here: most find the lock free, and their future
        // need not carry the waiting loop's state. Inline, not boxed: a box this size costs
        // the allocator's slow path on every lock (about 5 % of the client's work per lock).
        let mut cover = Cover::new(inner, &request);
        match cover.send(plan.metrics).await? {
            Attempted {
                sent,
                answer: Ok(AcquireAnswer::Held(fence)),
            } => Outcome::at_once(fence, sent, started),
            first => {
                // The loop takes over the attempt's answer, and its cover if it may have
                // been granted.
                let engine = engine().hand_off(hand_off).covering(cover);
                Box::pin(engine.acquire(Some(first), !shares)).await?
            }
        }
    };
    Ok(granted(manager, plan, request, kind, outcome))
}

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

/// A busy error whose holder the server named gets the holder's identity, read from its
/// manager's registration (once per manager). Reading it is best effort: the error stays as
/// it was if Redis does not answer.
async fn name_holder(manager: &LockManager, error: LockError) -> LockError {
    match error {
        LockError::Busy {
            key,
            attempts,
            waited,
            holder_token: Some(token),
            holder: None,
        } => {
            let holder = crate::identity::resolve(manager, &token)
                .await
                .map(Box::new);
            if let Some(holder) = &holder {
                tracing::debug!(%holder, holder_token = %token, "busy");
            }
            LockError::Busy {
                key,
                attempts,
                waited,
                holder_token: Some(token),
                holder,
            }
        }
        error => error,
    }
}

/// The guard of what a request won: granted by the server, handed over by a local release,
/// or passed locally within a cohort.
fn granted(
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
            let (sent, local) = handed.claim();
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
            cohort: !plan.options.solo,
            passes,
            run: std::sync::OnceLock::new(),
            set: std::sync::OnceLock::new(),
            wrote: std::sync::atomic::AtomicBool::new(false),
        });
        if !plan.options.unrecorded {
            context::record(&held);
        }
        held
    }
}

/// The guard, from its parts.
fn build(
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

impl Ask for Arc<AcquireRequest> {
    type Fences = u64;

    async fn send(&self, inner: &Inner) -> Result<redis::RedisResult<AcquireAnswer>, LockError> {
        let attempt = self.clone();
        inner
            .exec(move |backend| async move { backend.acquire(&attempt).await })
            .await
    }

    fn fair(&self) -> bool {
        matches!(self.shape, Shape::Fair { .. })
    }

    fn token(&self) -> &str {
        &self.token
    }

    fn wake(&self, _: usize) -> &str {
        &self.wake
    }

    fn release_behind(&self, inner: &Arc<Inner>, intent: Option<String>) {
        // The intent is taken back after the release, on the same connection, so that the
        // unanswered attempt cannot set it again after.
        let (ids, owner) = (Arc::new(self.hold_ids()), inner.clone());
        crate::engine::send_behind(inner, move || {
            let (inner, ids, intent) = (owner.clone(), ids.clone(), intent.clone());
            async move {
                let given = OneHold::new(ids.clone(), None);
                inner
                    .releaser()
                    .give_back(given, Known::default())
                    .await
                    .answer()?;
                if let Some(intent) = intent {
                    withdraw_intent(inner, ids, intent).await;
                }
                Ok(())
            }
        });
    }

    async fn give_back(&self, inner: &Inner) -> Option<bool> {
        let (given, releaser) = (
            OneHold::new(Arc::new(self.hold_ids()), None),
            inner.releaser(),
        );
        let outcome = inner
            .exec(move |_| releaser.give_back(given, Known::default()))
            .await;
        outcome.ok()?.answer().ok()
    }

    fn intent(&self) -> Option<&str> {
        match &self.shape {
            Shape::Write {
                intent,
                intent_lease,
            } if !intent_lease.is_zero() => Some(intent),
            _ => None,
        }
    }

    fn withdraw_intent(&self, inner: &Arc<Inner>, intent: String) {
        let ids = Arc::new(self.hold_ids());
        let withdraw = withdraw_intent(inner.clone(), ids, intent);
        inner.driver.spawn(withdraw);
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

/// The script shape of a first (or shared) hold of the plan's kind for `token`.
fn shape_of(plan: &Plan<Keys>, token: &str, manager_id: &str) -> Shape {
    let intent = || plan.keys.write_intent();
    match plan.kind {
        // Checked by `plan`: exclusive, without fencing or min_hold.
        RequestKind::Exclusive if plan.options.fair => Shape::Fair {
            queue: crate::backend::FairQueue::new(&plan.keys.lock, manager_id, plan.ttl, token),
            join: plan.retries > 0,
        },
        // The string form: one native command each way.
        RequestKind::Exclusive if !plan.options.fencing && plan.options.min_hold.is_none() => {
            Shape::Plain
        }
        RequestKind::Exclusive => Shape::Exclusive,
        RequestKind::Write => {
            // Keeps new readers out between this writer's attempts, no longer.
            let between = plan
                .backoff
                .ceiling()
                .saturating_mul(2)
                .max(Duration::from_secs(1));
            Shape::Write {
                intent: intent(),
                // A writer that will not try again leaves no intent behind.
                intent_lease: if plan.retries == 0 {
                    Duration::ZERO
                } else {
                    between.min(plan.ttl)
                },
            }
        }
        RequestKind::Read => Shape::Share {
            intent: intent(),
            permits: None,
        },
        RequestKind::Permits(permits) => Shape::Share {
            intent: intent(),
            permits: Some(permits),
        },
    }
}

/// A new owner token: 128 bits in hex, the manager's id (64 bits drawn at random when it was
/// built, which also names its registration: see `identity`) and 64 counting the tokens this
/// process made, so that no two owners anywhere share one. Drawn without a system call per
/// lock.
pub(crate) fn new_token(manager_id: &str) -> String {
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let mut token = Vec::with_capacity(32);
    token.extend_from_slice(manager_id.as_bytes());
    token.extend_from_slice(&hex(COUNT.fetch_add(1, Ordering::Relaxed)));
    String::from_utf8(token).expect("hex digits are ASCII")
}

/// `n` as 16 hex digits, most significant first (as `{:016x}` would write them).
fn hex(n: u64) -> [u8; 16] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 16];
    for (at, digit) in digits.iter_mut().enumerate() {
        *digit = HEX[(n >> (4 * (15 - at))) as usize & 0xf];
    }
    digits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_32_hex_digits_and_never_repeat() {
        let (a, b) = (new_token("0123456789abcdef"), new_token("0123456789abcdef"));
        for token in [&a, &b] {
            assert_eq!(token.len(), 32, "{token}");
            assert!(
                token
                    .bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            );
        }
        // One process part, then a count that moved on.
        assert_eq!(a[..16], b[..16]);
        let count = |t: &str| u64::from_str_radix(&t[16..], 16).unwrap();
        assert!(count(&b) > count(&a));
        assert_eq!(
            a[..16],
            format!("{:016x}", u64::from_str_radix(&a[..16], 16).unwrap())
        );
    }
}
