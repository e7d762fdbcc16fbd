//! The request builder for one lock, and the acquire loop.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::Instrument;

use crate::LockError;
use crate::backend::{AcquireRequest, Attempt, Shape};
use crate::context::{self, Held, Kind, RequestKind};
use crate::decide::{self, Step};
use crate::guard::{Acquired, LockGuard, Parts};
use crate::key::Keys;
use crate::lease::{LeaseState, keep_until, saturating_add};
use crate::lease::{MAX_TTL, check_ttl};
use crate::manager::LockManager;
use crate::retry::Backoff;
use crate::waiters::{Handed, LocalPass, Ticket};
use crate::watchdog::Target;

/// A request for one lock, built by [`LockManager::lock`]; send it with
/// [`acquire`](Self::acquire) or [`try_acquire`](Self::try_acquire).
///
/// Options not set here come from the manager's defaults. They mirror the arguments of
/// `#[distributed_lock]`, by the same names.
#[must_use = "a lock request does nothing until `acquire().await` or `try_acquire().await`"]
pub struct LockRequest<'m> {
    manager: &'m LockManager,
    kind: RequestKind,
    key: String,
    template: Option<&'static str>,
    ttl: Option<Duration>,
    retries: Option<u32>,
    retry_delay: Option<Duration>,
    wait: Option<Duration>,
    fencing: bool,
    watchdog: bool,
    max_hold: Option<Duration>,
    reentrant: bool,
    min_hold: Option<Duration>,
    fair: bool,
    cohort: bool,
    /// Whether a busy error names the holder (not for `try_acquire`, which drops the error).
    name_holder: bool,
    /// Whether the hold is recorded in the current frame; an annotated call records it in the
    /// frame it opens for its body instead.
    record: bool,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("kind", &self.kind)
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("retries", &self.retries)
            .field("retry_delay", &self.retry_delay)
            .field("wait", &self.wait)
            .field("fencing", &self.fencing)
            .field("watchdog", &self.watchdog)
            .field("max_hold", &self.max_hold)
            .field("reentrant", &self.reentrant)
            .field("min_hold", &self.min_hold)
            .field("fair", &self.fair)
            .field("cohort", &self.cohort)
            .finish_non_exhaustive()
    }
}

/// A request with every option resolved and checked.
#[derive(Debug)]
struct Plan {
    kind: RequestKind,
    keys: Keys,
    template: &'static str,
    ttl: Duration,
    retries: u32,
    backoff: Backoff,
    wait: Option<Duration>,
    fencing: bool,
    watchdog: bool,
    max_hold: Option<Duration>,
    reentrant: bool,
    min_hold: Option<Duration>,
    fair: bool,
    cohort: bool,
    metrics: crate::metrics::Labels,
}

impl<'m> LockRequest<'m> {
    pub(crate) fn new(manager: &'m LockManager, kind: RequestKind, key: String) -> Self {
        Self {
            manager,
            kind,
            key,
            template: None,
            ttl: None,
            retries: None,
            retry_delay: None,
            wait: None,
            fencing: false,
            watchdog: false,
            max_hold: None,
            reentrant: false,
            min_hold: None,
            fair: false,
            cohort: true,
            name_holder: true,
            record: true,
        }
    }

    /// Leaves the hold out of the current frame: the caller runs the code it protects in a
    /// frame of its own that holds it.
    pub(crate) fn unrecorded(mut self) -> Self {
        self.record = false;
        self
    }

    /// The lease: how long the lock stays held if its holder stops renewing or releasing it.
    /// Must be at least 1 ms and at most [`MAX_TTL`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Extra attempts after the first when the lock is busy or Redis fails transiently.
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = Some(retries);
        self
    }

    /// The base delay between attempts; it doubles per attempt (up to 32×, and at most
    /// [`MAX_TTL`]) with full jitter.
    pub fn retry_delay(mut self, delay: Duration) -> Self {
        self.retry_delay = Some(delay);
        self
    }

    /// An upper bound on the total time spent trying. Without `retries`, the request keeps
    /// trying until this much time has passed; with both, whichever ends first. A wait longer
    /// than [`MAX_TTL`] (such as `Duration::MAX`) sets no time bound.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// Draw a fencing token: a per-key number that grows with every acquisition, for storage
    /// that must reject writes from a holder whose lease has ended. See
    /// [`LockGuard::fencing_token`]. The counter stays in Redis after release.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// Renew the lease while the guard lives: the manager's watchdog extends it at about a
    /// third of the TTL, in one batched round trip for all leases due, and stops the moment
    /// the guard is released or dropped, or when `max_hold` has passed. A renewal that finds
    /// the lock gone or taken marks the lease lost ([`LockGuard::lost`]).
    pub fn watchdog(mut self, watchdog: bool) -> Self {
        self.watchdog = watchdog;
        self
    }

    /// With `watchdog`: stop renewing after this long, whatever the holder does, so a body
    /// that never finishes cannot hold the lock forever. Default: the manager's (1 hour).
    /// `Duration::MAX` renews for as long as the guard lives.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// Allow a nested acquisition of the same key, by code running inside this hold (see
    /// [`scope`](crate::scope)), to succeed: it shares the outer hold's owner token and adds one
    /// to the hold count in Redis; the lock is free once every hold is released. Both the
    /// outer and the nested request must be reentrant. Without it, a nested acquisition fails
    /// at once with [`LockError::WouldDeadlock`].
    pub fn reentrant(mut self, reentrant: bool) -> Self {
        self.reentrant = reentrant;
        self
    }

    /// Keep the key at least this long after the acquisition, even when released sooner:
    /// release leaves it to expire at acquisition + `min_hold` (owned by nobody) instead of
    /// deleting it. For scheduled jobs that must run at most once per period across nodes
    /// whose clocks differ. It must not be longer than the lease.
    pub fn min_hold(mut self, min_hold: Duration) -> Self {
        self.min_hold = Some(min_hold);
        self
    }

    /// Take the lock in strict arrival order across every process: waiters queue in Redis
    /// (one queue per key, next to the lock), and a release grants the lock to the oldest
    /// waiter in the same step, then tells that waiter, which nobody can overtake meanwhile.
    ///
    /// Each queue entry has a short lease of its own, renewed while its waiter waits: a
    /// waiter whose process dies drops out of the queue within seconds instead of blocking
    /// it, and one that gives up (its `wait` or `retries` run out, or its future is dropped)
    /// takes its entry out at once. A lock granted to a waiter that died meanwhile is held for
    /// two seconds at most. [`try_acquire`](Self::try_acquire) never queues: it takes the lock
    /// only when nobody is waiting.
    ///
    /// For exclusive locks on one Redis deployment (single node, Sentinel or Cluster), without
    /// `fencing` or `min_hold`; other requests get [`LockError::InvalidInput`]. The order
    /// binds fair requests: use `fair` for every request on the key, as a request without it
    /// may take the lock whenever it is free.
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = fair;
        self
    }

    /// Whether this lock may pass among this manager's own tasks without a server command
    /// (default: yes). When a holder releases while another task of the same manager waits
    /// for the same plain exclusive lock, the lock passes to that task as it is — the key in
    /// Redis keeps its owner token and lease, and the new holder gets a guard of its own on
    /// that server hold — up to the manager's [cohort bounds](crate::LockManagerBuilder::cohort),
    /// then goes back to Redis so that other processes get their turn. Both the releasing and
    /// the waiting request must allow it. `false`: every hand-over goes through the server.
    ///
    /// Only plain exclusive locks pass locally, and only to a waiter that asked for the same
    /// `ttl` as the holder, while at least half of the lease is left (otherwise the lock goes
    /// through the server, which gives the waiter a lease of its own). Fenced locks (each
    /// holder draws a new token from the server), `min_hold`, fair locks, read-write locks and
    /// semaphores never pass locally, and neither does any lock on RedLock or with
    /// `sync_replicas`.
    pub fn cohort(mut self, cohort: bool) -> Self {
        self.cohort = cohort;
        self
    }

    /// Names this request in metrics and tracing (the `template` label), in place of
    /// `<manual>`. Give the shape of the key, such as `"order:{id}"`, never the key itself: one
    /// name per kind of lock keeps the number of series small. Annotated functions pass their
    /// key template.
    pub fn label(self, label: &'static str) -> Self {
        self.template(label)
    }

    #[doc(hidden)]
    /// The key template this request was formatted from, as a low-cardinality tracing label.
    pub fn template(mut self, template: &'static str) -> Self {
        self.template = Some(template);
        self
    }

    /// Takes the lock, retrying within the request's bounds.
    ///
    /// Errors: [`LockError::Busy`] when another owner kept it for all attempts (or for the
    /// whole `wait`), whatever kind of lock that owner holds on the key;
    /// [`LockError::Redis`] when the last attempt could not reach Redis;
    /// [`LockError::InvalidInput`] for a bad key or ttl, before anything is sent;
    /// [`LockError::PermitsMismatch`] at once, without retrying, for a semaphore in use with
    /// another number of permits.
    ///
    /// [`LockError::ShutDown`] once [`LockManager::shutdown`] was called, also for a request
    /// that was waiting then.
    ///
    /// Cancel-safe: if this future is dropped while an attempt is in flight, a release for
    /// that attempt's token is sent right behind it, so no lock is left behind.
    pub async fn acquire(mut self) -> Result<LockGuard, LockError> {
        let plan = self.plan()?;
        let holds = &self.manager.inner.holds;
        if holds.is_shut_down() {
            return Err(LockError::ShutDown);
        }
        let span =
            tracing::debug_span!("lock.acquire", template = plan.template, key = %plan.keys.name);
        let (labels, timer) = (plan.metrics, crate::metrics::Timer::start());
        // Shutdown ends the waits inside (an attempt in flight is bounded by the response
        // timeout): racing it here would register every acquisition with the shutdown signal.
        let result = acquire(self.manager, plan, self.record)
            .instrument(span)
            .await;
        let result = match result {
            // Dropping it gives it back.
            Ok(guard) if guard.came_after_shutdown() => Err(LockError::ShutDown),
            Err(
                busy @ LockError::Busy {
                    holder_token: Some(_),
                    ..
                },
            ) if self.name_holder => Err(Box::pin(name_holder(self.manager, busy)).await),
            result => result,
        };
        crate::metrics::acquire_ended(labels, timer, &result);
        result
    }

    /// Makes exactly one attempt: `Ok(None)` when another owner holds the lock (of any kind).
    /// Other errors are those of [`acquire`](Self::acquire).
    pub async fn try_acquire(mut self) -> Result<Option<LockGuard>, LockError> {
        // Nobody sees the busy error: no holder to name.
        self.name_holder = false;
        match self.retries(0).wait(Duration::ZERO).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Busy { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Resolves and checks every option; the key moves into the plan.
    fn plan(&mut self) -> Result<Plan, LockError> {
        let defaults = self.manager.defaults();
        let keys = Keys::new(&self.manager.inner.prefix, std::mem::take(&mut self.key))?;
        let ttl = self.ttl.unwrap_or(defaults.ttl);
        check_ttl(ttl).map_err(|reason| {
            LockError::invalid("ttl", format!("the lease of `{}` {reason}", keys.name))
        })?;
        let capabilities = self.manager.inner.backend.capabilities();
        if self.fencing && !capabilities.fencing {
            return Err(LockError::invalid(
                "fencing",
                "fencing tokens need one counter; RedLock masters count independently",
            ));
        }
        if self.kind != RequestKind::Exclusive && !capabilities.shared_kinds {
            return Err(LockError::invalid(
                "lock kind",
                "read-write locks and semaphores are not available with RedLock",
            ));
        }
        if self.fair {
            let refused = if self.kind != RequestKind::Exclusive {
                Some("fair locks are exclusive: not for read-write locks or semaphores")
            } else if self.fencing {
                Some("fair locks do not draw fencing tokens")
            } else if self.min_hold.is_some() {
                Some("fair locks do not keep a `min_hold`")
            } else if !capabilities.fair {
                Some("fair locks need one queue; RedLock masters would each keep their own")
            } else {
                None
            };
            if let Some(reason) = refused {
                return Err(LockError::invalid("fair", reason));
            }
        }
        if self.kind == RequestKind::Permits(0) {
            return Err(LockError::invalid(
                "permits",
                format!("semaphore `{}` needs at least one permit", keys.name),
            ));
        }
        if self.min_hold.is_some()
            && matches!(self.kind, RequestKind::Read | RequestKind::Permits(_))
        {
            return Err(LockError::invalid(
                "min_hold",
                "`min_hold` applies to exclusive and write locks, not to read locks or permits",
            ));
        }
        if let Some(min_hold) = self.min_hold.filter(|min_hold| *min_hold > ttl) {
            return Err(LockError::invalid(
                "min_hold",
                format!("`min_hold` ({min_hold:?}) must not be longer than the lease ({ttl:?})"),
            ));
        }
        for (what, value) in [("max_hold", self.max_hold), ("min_hold", self.min_hold)] {
            if value.is_some_and(|v| v.is_zero()) {
                return Err(LockError::invalid(
                    what,
                    format!("`{what}` must be greater than zero"),
                ));
            }
        }
        // Longer than any lease: no time bound at all.
        let wait = self.wait.or(defaults.wait).filter(|wait| *wait <= MAX_TTL);
        // With only a time bound, keep trying until it runs out.
        let retries = match (self.retries, self.wait) {
            (Some(retries), _) => retries,
            (None, Some(_)) => u32::MAX,
            (None, None) if defaults.wait.is_some() && defaults.retries == 0 => u32::MAX,
            (None, None) => defaults.retries,
        };
        let template = self.template.unwrap_or("<manual>");
        Ok(Plan {
            kind: self.kind,
            keys,
            template,
            ttl,
            retries,
            backoff: Backoff::new(self.retry_delay.unwrap_or(defaults.retry_delay)),
            wait,
            fencing: self.fencing,
            watchdog: self.watchdog,
            max_hold: self.max_hold.or(defaults.max_hold),
            reentrant: self.reentrant,
            min_hold: self.min_hold,
            fair: self.fair,
            cohort: self.cohort,
            metrics: crate::metrics::Labels::new(template, self.kind),
        })
    }
}

async fn acquire(
    manager: &LockManager,
    mut plan: Plan,
    record: bool,
) -> Result<LockGuard, LockError> {
    let inner = &manager.inner;
    let manager_id = Arc::as_ptr(inner) as usize;
    let outer = context::find(manager_id, &plan.keys.lock);
    let busy_self = |upgrade: bool| {
        let key = plan.keys.name.clone();
        Err(if upgrade {
            LockError::Upgrade { key }
        } else {
            LockError::WouldDeadlock { key }
        })
    };
    // Who holds what: a fresh owner, a nested hold of this task's own lock, or a mistake.
    let nest = match (plan.kind, outer.as_deref()) {
        (_, None) => false,
        (RequestKind::Exclusive | RequestKind::Write, Some(held)) => match held.kind {
            Kind::Exclusive if held.reentrant && plan.reentrant => true,
            Kind::Read if plan.kind == RequestKind::Write => return busy_self(true),
            _ => return busy_self(false),
        },
        (RequestKind::Read, Some(held)) => match held.kind {
            // Downgrade: the writer takes the read side as a nested hold of its write lock;
            // or another read hold of the same share.
            Kind::Exclusive | Kind::Read => true,
            Kind::Permit => return busy_self(false),
        },
        // Another permit is an independent holder; anything else on the key would wait for
        // this task's own lock.
        // Unless this code already holds every permit: it would wait for itself.
        (RequestKind::Permits(permits), Some(held))
            if held.kind == Kind::Permit
                && context::count(manager_id, &plan.keys.lock) >= permits as usize =>
        {
            return busy_self(false);
        }
        (RequestKind::Permits(_), Some(held)) if held.kind == Kind::Permit => false,
        (RequestKind::Permits(_), Some(_)) => return busy_self(false),
    };
    if let (true, Some(held)) = (nest, outer) {
        // The task already owns the lock: counted here, no round trip.
        return Ok(nested(manager, plan, held));
    }
    let token = new_token(inner.waiters.tag());
    let (shape, kind) = shape_of(plan.kind, &plan, &token, inner.waiters.tag());
    // The lock key moves into the request (and on into the hold): nothing reads it from the
    // plan from here on.
    let wake = plan.keys.wake();
    let request = Arc::new(AcquireRequest {
        shape,
        lock: std::mem::take(&mut plan.keys.lock),
        wake,
        token,
        lease: plan.ttl,
        fencing: plan.fencing,
        reentrant: plan.reentrant,
    });
    if matches!(request.shape, Shape::Fair { .. }) {
        // Boxed: its state stays out of the plain path's future.
        return Box::pin(fair(manager, plan, request, kind, record)).await;
    }
    let started = Instant::now();
    // A request that may wait queues behind local waiters instead of overtaking them (see
    // `wait`). Any other makes its first attempt here: most find the lock free, and their
    // future need not carry the waiting loop's state.
    let shares = matches!(plan.kind, RequestKind::Read | RequestKind::Permits(_));
    if plan.retries > 0 && !shares && inner.waiters.has_waiters(&request.wake) {
        return Box::pin(wait(manager, plan, request, kind, record, started, None)).await;
    }
    let mut in_flight = InFlight::new(manager, &request, false);
    // Inline, not boxed: a box this size costs the allocator's slow path on every lock
    // (about 5 % of the client's work per lock). The waiting loop, several times larger,
    // stays boxed, out of the futures of the callers that nest this one.
    let (sent, outcome) = send_attempt(manager, &plan, &request, &mut in_flight).await?;
    if let Ok(Attempt::Held { fence }) = outcome {
        in_flight.maybe_held = false;
        drop(in_flight);
        crate::metrics::handed_over(plan.metrics, false);
        let acquired = Acquired {
            attempts: 1,
            waited: started.elapsed(),
            sent,
        };
        tracing::debug!(attempts = 1, waited = ?acquired.waited, "acquired");
        let request = Arc::unwrap_or_clone(request);
        return Ok(grant(manager, plan, request, kind, fence, acquired, record));
    }
    // The loop takes over the attempt's answer, and its cover if it may have been granted.
    let maybe_held = std::mem::replace(&mut in_flight.maybe_held, false);
    drop(in_flight);
    let first = First {
        sent,
        outcome,
        maybe_held,
    };
    Box::pin(wait(
        manager,
        plan,
        request,
        kind,
        record,
        started,
        Some(first),
    ))
    .await
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

/// The answer to a first attempt made before the waiting loop.
struct First {
    sent: Instant,
    outcome: redis::RedisResult<Attempt>,
    /// The attempt may have been granted (its answer was lost): it is covered until settled.
    maybe_held: bool,
}

/// The acquire loop of every request but a fair one: attempts, waits for a release (or a
/// hand-off, or a timer), and attempts again, within the request's bounds. `first` is the
/// answer to an attempt already made.
async fn wait(
    manager: &LockManager,
    plan: Plan,
    request: Arc<AcquireRequest>,
    kind: Kind,
    record: bool,
    started: Instant,
    mut first: Option<First>,
) -> Result<LockGuard, LockError> {
    let inner = &manager.inner;
    let deadline = plan.wait.map(|wait| started + wait);
    let bounds = decide::Bounds {
        retries: plan.retries,
        deadline,
    };
    let now = Instant::now;
    let mut in_flight = InFlight::new(
        manager,
        &request,
        first.as_ref().is_some_and(|first| first.maybe_held),
    );
    // The holder the server named in this request's last busy answer, if it did.
    let mut holder: Option<[u64; 2]> = None;
    let give_up = |attempts, failure: Option<redis::RedisError>, holder: Option<[u64; 2]>| {
        given_up(&plan, attempts, started, failure, holder)
    };
    // The last word from Redis on this lock: a failure, or none after a busy answer. Once in
    // the queue, the word of whichever local waiter asked last (see `Ticket::heard`).
    let last_word = |ticket: &Option<Ticket>, own: &Option<redis::RedisError>| match ticket {
        Some(ticket) => ticket.last_failure(),
        None => own.clone(),
    };
    // A request that may wait queues behind local waiters instead of overtaking them. A nested
    // hold of this task's own lock never queues: it is granted at once, and the waiters ahead
    // of it wait for this very lock.
    let queues = plan.retries > 0;
    let join = || {
        inner
            .waiters
            .join(&request.wake, &inner.backend, &inner.driver, plan.metrics)
    };
    // Readers and permit holders try first: the waiters ahead may want another kind, while
    // this request may overlap the holders (a free permit, readers inside); queueing it
    // behind them could make it wait for a lock the server would grant, even for itself.
    let shares = matches!(plan.kind, RequestKind::Read | RequestKind::Permits(_));
    // A plain lock can be handed over by a local release, in that release's round trip.
    let hand_off = matches!(request.shape, Shape::Plain) && inner.backend.capabilities().hand_off;
    // After a first attempt, the loop goes on from its answer, not from the queue.
    let mut ticket =
        (first.is_none() && queues && !shares && inner.waiters.has_waiters(&request.wake))
            .then(join);
    let mut failure: Option<redis::RedisError> = None;
    let mut attempts = 0u32;
    // The receiving end of this waiter's standing offer to take the lock from a local release
    // (see `waiters`), while one stands.
    let mut offer: Option<oneshot::Receiver<Handed>> = None;
    loop {
        if let (true, Some(waiting), None) = (hand_off, &ticket, &offer) {
            offer = Some(waiting.offer(&request.token, plan.ttl, plan.cohort));
        }
        if let Some(ticket) = &ticket {
            // Every step of waiting for a turn, the wake channel included, ends by the deadline.
            let turn = async {
                ticket.until_head().await;
                ticket.subscribe().await;
            };
            let deadline = async {
                match deadline {
                    Some(deadline) => inner.sleep_until(deadline).await,
                    None => std::future::pending().await,
                }
            };
            // A hand-off may come before this task even sees its turn.
            let handed = tokio::select! {
                () = turn => None,
                handed = receive(&mut offer) => handed,
                _ = deadline => {
                    return Err(give_up(attempts, ticket.last_failure(), holder));
                }
                () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
            };
            if let Some(handed) = handed {
                // A hand-off through the server gave this request's own token: it covers any
                // grant an unanswered attempt may hold, which must not be released now. A local
                // pass gave another: the cover stays, for what such an attempt may hold.
                if !handed.is_local() {
                    in_flight.maybe_held = false;
                }
                drop(in_flight);
                let taken = Taken {
                    attempts,
                    started,
                    handed,
                    ticket: Some(ticket),
                    record,
                };
                return Ok(taken.grant(manager, plan, request, kind));
            }
        }
        let seen = ticket.as_ref().map(Ticket::wakes);
        // A task of this manager holds the lock: its release hands it over (or wakes this
        // head); asking the server now would only hear "busy".
        let sibling_holds = ticket
            .as_ref()
            .and_then(Ticket::held_here)
            .filter(|_| hand_off);
        // Or this manager just had a run of hand-offs: other processes' turns come first.
        let sitting_out = ticket.as_ref().and_then(Ticket::sitting_out);
        let holder_ttl = if let Some(until) = sibling_holds {
            // A task of this manager holds it now, whoever the server named before.
            holder = None;
            // Its lease bounds the wait, as the holder's PTTL would.
            Some(until.saturating_duration_since(Instant::now()))
        } else if sitting_out.is_some() {
            holder = None;
            None
        } else {
            // No offer stands while this waiter asks the server itself; one a release took
            // meanwhile decides first.
            if let (Some(receiver), Some(waiting)) = (offer.take(), &ticket)
                && !waiting.withdraw()
            {
                let deadline = async {
                    match deadline {
                        Some(deadline) => inner.sleep_until(deadline).await,
                        None => std::future::pending().await,
                    }
                };
                // Within that release's bounds.
                let handed = tokio::select! {
                    handed = receiver => handed.ok(),
                    _ = deadline => return Err(give_up(attempts, waiting.last_failure(), holder)),
                    () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
                };
                if let Some(handed) = handed {
                    // A hand-off through the server gave this request's own token: it covers any
                    // grant an unanswered attempt may hold, which must not be released now. A local
                    // pass gave another: the cover stays, for what such an attempt may hold.
                    if !handed.is_local() {
                        in_flight.maybe_held = false;
                    }
                    drop(in_flight);
                    let taken = Taken {
                        attempts,
                        started,
                        handed,
                        ticket: Some(waiting),
                        record,
                    };
                    return Ok(taken.grant(manager, plan, request, kind));
                }
            }
            attempts += 1;
            let (sent, outcome) = match first.take() {
                Some(first) => (first.sent, first.outcome),
                None => send_attempt(manager, &plan, &request, &mut in_flight).await?,
            };
            in_flight.answered(outcome.as_ref().ok());
            let answer = decide::Answer::of(&outcome, is_transient);
            let holder_ttl = match outcome {
                Ok(Attempt::Held { fence }) => {
                    in_flight.maybe_held = false;
                    drop(in_flight);
                    if let (true, Some(ticket)) = (hand_off, &ticket) {
                        ticket.holding(saturating_add(sent, plan.ttl));
                    }
                    crate::metrics::handed_over(plan.metrics, ticket.is_some());
                    let acquired = Acquired {
                        attempts,
                        waited: started.elapsed(),
                        sent,
                    };
                    tracing::debug!(attempts, waited = ?acquired.waited, "acquired");
                    let request = Arc::unwrap_or_clone(request);
                    return Ok(grant(manager, plan, request, kind, fence, acquired, record));
                }
                Ok(Attempt::Busy {
                    holder_ttl,
                    holder: named,
                }) => {
                    in_flight.maybe_held = false;
                    failure = None;
                    holder = named;
                    holder_ttl
                }
                // Waiting cannot help: the other users of the key must agree on the count first.
                Ok(Attempt::PermitsMismatch { stored }) => {
                    in_flight.maybe_held = false;
                    let requested = match plan.kind {
                        RequestKind::Permits(permits) => permits,
                        _ => 0,
                    };
                    return Err(LockError::PermitsMismatch {
                        key: plan.keys.name.clone(),
                        stored,
                        requested,
                    });
                }
                Ok(Attempt::Unreplicated { acked, wanted }) => {
                    in_flight.maybe_held = false;
                    return Err(LockError::NotReplicated {
                        key: plan.keys.name.clone(),
                        acked,
                        wanted,
                    });
                }
                // A lost reply may hide a granted lock: the next attempt resends the same hold,
                // which the script recognises; `in_flight` releases it if none follows.
                Err(error) if is_transient(&error) => {
                    tracing::debug!(attempts, %error, "acquire attempt failed");
                    failure = Some(error);
                    None
                }
                Err(error) => return Err(LockError::redis(&plan.keys.name, error)),
            };
            if let Some(ticket) = &ticket {
                ticket.heard(failure.clone());
            }
            let queue = (ticket.is_some(), queues);
            let step = decide::after(answer, bounds, &plan.backoff, attempts, queue, None, now());
            if step == Step::GiveUp {
                return Err(give_up(attempts, failure, holder));
            }
            if step == Step::Queue {
                // First time busy: queue up and follow the wake channel, then look again at once
                // (a release between the busy answer and the subscription publishes unheard).
                let joined = join();
                joined.heard(failure.clone());
                // A writer queued behind waiters of its own manager does not compete before its
                // turn: its intent would only keep those ahead of it (readers) out of a free
                // lock, with nobody to take it. It leaves one again once refused as the head.
                if !joined.is_head() {
                    in_flight.withdraw_intent();
                }
                ticket = Some(joined);
                continue;
            }
            holder_ttl
        };
        // Wait for a release, or for the fallback timer (backoff with full jitter, capped by
        // the holder's lease) that catches an expiry or a missed announcement.
        let step = decide::sleep(
            bounds,
            &plan.backoff,
            attempts,
            holder_ttl,
            sitting_out,
            now(),
        );
        let Step::Sleep { until } = step else {
            return Err(give_up(attempts, last_word(&ticket, &failure), holder));
        };
        let woken = async {
            match &ticket {
                Some(waiting) => waiting.woken_since(seen.unwrap_or_default()).await,
                None => std::future::pending().await,
            }
        };
        // Ready for a hand-off again while this waits.
        if let (true, Some(waiting), None) = (hand_off, &ticket, &offer) {
            offer = Some(waiting.offer(&request.token, plan.ttl, plan.cohort));
        }
        let handed = tokio::select! {
            handed = receive(&mut offer) => handed,
            () = woken => None,
            _ = inner.sleep_until(until) => None,
            () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
        };
        if let Some(handed) = handed {
            // A hand-off through the server gave this request's own token: it covers any
            // grant an unanswered attempt may hold, which must not be released now. A local
            // pass gave another: the cover stays, for what such an attempt may hold.
            if !handed.is_local() {
                in_flight.maybe_held = false;
            }
            drop(in_flight);
            let taken = Taken {
                attempts,
                started,
                handed,
                ticket: ticket.as_ref(),
                record,
            };
            return Ok(taken.grant(manager, plan, request, kind));
        }
        if deadline.is_some_and(|d| d <= Instant::now()) {
            return Err(give_up(attempts, last_word(&ticket, &failure), holder));
        }
    }
}

/// The acquire loop of a fair lock: ask (which queues this request in Redis the first time),
/// then wait for the grant — handed over by a release of this manager, or heard from
/// another's — or for the timer that renews the queue entry and notices an expiry.
async fn fair(
    manager: &LockManager,
    plan: Plan,
    request: Arc<AcquireRequest>,
    kind: Kind,
    record: bool,
) -> Result<LockGuard, LockError> {
    use crate::backend::FAIR_REFRESH;
    let inner = &manager.inner;
    let started = Instant::now();
    let deadline = plan.wait.map(|wait| started + wait);
    let until_deadline = || async move {
        match deadline {
            Some(deadline) => inner.sleep_until(deadline).await,
            None => std::future::pending().await,
        }
    };
    // From the first attempt until the request settles, it may have an entry in the queue, or
    // a lock granted to it: dropped, it takes both back, right behind its last attempt.
    let mut queued = InFlight::new(manager, &request, false);
    let join_fair = || {
        inner.waiters.join_fair(
            &request.wake,
            &request.token,
            &inner.backend,
            &inner.driver,
            plan.metrics,
        )
    };
    let mut ticket: Option<Ticket> = None;
    let mut offer: Option<oneshot::Receiver<Handed>> = None;
    let mut failure: Option<redis::RedisError> = None;
    let mut attempts = 0u32;
    let mut looked_again = false;
    let handed = loop {
        // No offer stands while this waiter asks the server itself; one a release took
        // meanwhile decides first.
        if let (Some(receiver), Some(waiting)) = (offer.take(), &ticket)
            && !waiting.withdraw()
        {
            tokio::select! {
                handed = receiver => if let Ok(handed) = handed {
                    break handed;
                },
                _ = until_deadline() => {
                    return Err(fair_give_up(&plan, &mut queued, attempts, started, failure).await);
                }
                () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
            }
        }
        // Where this manager already waits for the key, this request waits with them from
        // its first attempt on: it hears every grant from then on, and needs no second look.
        let join = matches!(request.shape, Shape::Fair { join: true, .. });
        if ticket.is_none() && join && inner.waiters.has_waiters(&request.wake) {
            ticket = Some(join_fair());
        }
        let heard_all = ticket.as_ref().is_some_and(Ticket::is_subscribed);
        attempts += 1;
        let (sent, outcome) = send_attempt(manager, &plan, &request, &mut queued).await?;
        let holder_ttl = match outcome {
            Ok(Attempt::Held { .. }) => {
                queued.maybe_held = false;
                drop(queued);
                crate::metrics::handed_over(plan.metrics, ticket.is_some());
                let acquired = Acquired {
                    attempts,
                    waited: started.elapsed(),
                    sent,
                };
                tracing::debug!(attempts, waited = ?acquired.waited, "acquired");
                let request = Arc::unwrap_or_clone(request);
                return Ok(grant(manager, plan, request, kind, 0, acquired, record));
            }
            Ok(Attempt::Busy { holder_ttl, .. }) => {
                failure = None;
                holder_ttl
            }
            Ok(Attempt::Unreplicated { acked, wanted }) => {
                return Err(LockError::NotReplicated {
                    key: plan.keys.name.clone(),
                    acked,
                    wanted,
                });
            }
            Ok(Attempt::PermitsMismatch { .. }) => None,
            Err(error) if is_transient(&error) => {
                tracing::debug!(attempts, %error, "acquire attempt failed");
                failure = Some(error);
                None
            }
            Err(error) => return Err(LockError::redis(&plan.keys.name, error)),
        };
        if attempts > plan.retries || deadline.is_some_and(|d| d <= Instant::now()) {
            return Err(fair_give_up(&plan, &mut queued, attempts, started, failure).await);
        }
        let waiting = ticket.get_or_insert_with(join_fair);
        if !heard_all {
            // Follow the wake channel (again, after a lost connection)...
            tokio::select! {
                () = waiting.subscribe() => {}
                _ = until_deadline() => {}
                () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
            }
            // ...then, the first time, ask again at once: a grant published before the
            // subscription went unheard.
            if !looked_again {
                looked_again = true;
                continue;
            }
        }
        // Grants are told; asking again only renews the entry and notices a holder whose
        // lease ended (which tells nobody). A request bounded by a number of retries spends
        // them at its backoff's pace, as any other.
        let pause = if plan.retries == u32::MAX {
            let expiry = holder_ttl.map(|ttl| ttl + Duration::from_millis(1));
            expiry.unwrap_or(FAIR_REFRESH).min(FAIR_REFRESH)
        } else {
            plan.backoff.delay(attempts, holder_ttl).min(FAIR_REFRESH)
        };
        let now = Instant::now();
        let mut until = now + pause;
        if let Some(deadline) = deadline {
            until = until.min(deadline);
        }
        offer = Some(waiting.offer(&request.token, plan.ttl, false));
        tokio::select! {
            handed = receive(&mut offer) => if let Some(handed) = handed {
                break handed;
            },
            () = waiting.signalled() => {}
            _ = inner.sleep_until(until) => {}
            () = inner.holds.until_shut_down() => return Err(LockError::ShutDown),
        }
        if deadline.is_some_and(|d| d <= Instant::now()) {
            // A grant that came meanwhile is given back (or passed on) by the leaving.
            return Err(fair_give_up(&plan, &mut queued, attempts, started, failure).await);
        }
    };
    queued.maybe_held = false;
    drop(queued);
    let taken = Taken {
        attempts,
        started,
        handed,
        ticket: None,
        record,
    };
    Ok(taken.grant(manager, plan, request, kind))
}

/// Sends one attempt of `request`; `in_flight` covers it from now until its answer has been
/// looked at. Returns when it was sent, and the answer.
async fn send_attempt(
    manager: &LockManager,
    plan: &Plan,
    request: &Arc<AcquireRequest>,
    in_flight: &mut InFlight<'_>,
) -> Result<(Instant, redis::RedisResult<Attempt>), LockError> {
    crate::metrics::attempt(plan.metrics);
    let sent = Instant::now();
    in_flight.maybe_held = true;
    let attempt = request.clone();
    let outcome = manager
        .inner
        .exec(move |backend| async move { backend.acquire(&attempt).await })
        .await?;
    if outcome.is_ok() {
        manager.inner.waiters.attempted();
    }
    Ok((sent, outcome))
}

/// A fair request that gives up leaves the queue before it answers (and gives back a lock a
/// release granted it meanwhile); if Redis does not answer, its drop sends that again.
async fn fair_give_up(
    plan: &Plan,
    queued: &mut InFlight<'_>,
    attempts: u32,
    started: Instant,
    failure: Option<redis::RedisError>,
) -> LockError {
    let ids = queued.request.hold_ids();
    let inner = &queued.manager.inner;
    let left = inner
        .exec(move |backend| async move { backend.release(&ids, Duration::ZERO).await })
        .await;
    if let Ok(Ok(released)) = left {
        queued.maybe_held = false;
        if released {
            tracing::debug!("a lock granted while giving up was passed on");
        }
    }
    given_up(plan, attempts, started, failure, None)
}

/// The error of a request that gave up after `attempts`: the last word decides, so a
/// failure to reach Redis is not reported as busy; a busy error carries the holder the
/// server named, if it did.
fn given_up(
    plan: &Plan,
    attempts: u32,
    started: Instant,
    failure: Option<redis::RedisError>,
    holder: Option<[u64; 2]>,
) -> LockError {
    match failure {
        Some(error) => LockError::redis(&plan.keys.name, error),
        None => LockError::Busy {
            key: plan.keys.name.clone(),
            attempts,
            waited: started.elapsed(),
            holder_token: holder.map(crate::backend::token_text),
            holder: None,
        },
    }
}

/// Waits for the hand-off behind a standing offer: `None` (and the offer gone) when the
/// release that took it could not hand the lock over; pending while no offer stands.
async fn receive(offer: &mut Option<oneshot::Receiver<Handed>>) -> Option<Handed> {
    let Some(receiver) = offer else {
        return std::future::pending().await;
    };
    let handed = receiver.await.ok();
    *offer = None;
    handed
}

/// A lock a local release handed to a waiting request.
struct Taken<'t> {
    attempts: u32,
    started: Instant,
    handed: Handed,
    ticket: Option<&'t Ticket>,
    record: bool,
}

impl Taken<'_> {
    /// The guard: its lease began when the hand-off was sent; a local pass takes over the
    /// server hold of the holder before, lease and all.
    fn grant(
        self,
        manager: &LockManager,
        plan: Plan,
        request: Arc<AcquireRequest>,
        kind: Kind,
    ) -> LockGuard {
        let (sent, local) = self.handed.claim();
        let until = match &local {
            Some(local) => local.lease.valid_until(),
            None => saturating_add(sent, plan.ttl),
        };
        if let Some(ticket) = self.ticket {
            ticket.holding(until);
        }
        crate::metrics::handed_over(plan.metrics, true);
        let acquired = Acquired {
            attempts: self.attempts,
            waited: self.started.elapsed(),
            sent,
        };
        tracing::debug!(attempts = self.attempts, waited = ?acquired.waited, local = local.is_some(), "handed over");
        let request = Arc::unwrap_or_clone(request);
        match local {
            Some(local) => passed(manager, plan, local, kind, acquired, self.record),
            None => grant(manager, plan, request, kind, 0, acquired, self.record),
        }
    }
}

/// The guard of a lock passed locally: a hold of its own on the server hold it takes over
/// (the owner token and lease of the holder before it).
fn passed(
    manager: &LockManager,
    plan: Plan,
    local: crate::guard::LocalPass,
    kind: Kind,
    acquired: Acquired,
    recorded: bool,
) -> LockGuard {
    let inner = &manager.inner;
    let LocalPass { ids, lease, passes } = local;
    let renewal = plan.watchdog.then(|| {
        let target = Target {
            hold: ids.clone(),
            metrics: plan.metrics,
        };
        // Renewals follow the shared lease from when it was last set (the first one may be
        // due at once), not from the pass.
        let set = lease
            .valid_until()
            .checked_sub(lease.ttl())
            .unwrap_or(acquired.sent)
            .min(acquired.sent);
        inner
            .watchdog
            .register(inner, target, lease.clone(), set, plan.max_hold)
    });
    let held = Arc::new(Held {
        manager: Arc::as_ptr(inner) as usize,
        reentrant: plan.reentrant,
        kind,
        ids,
        fence: 0,
        lease: lease.clone(),
        guards: AtomicUsize::new(1),
        keep_until: Mutex::new(None),
        cohort: plan.cohort,
        passes,
    });
    if recorded {
        context::record(&held);
    }
    LockGuard::new(Parts {
        manager: manager.clone(),
        name: plan.keys.name,
        fence: None,
        lease,
        acquired,
        renewal,
        held,
        metrics: plan.metrics,
    })
}

/// Builds the guard of a granted request: lease state, renewal, and its place in the
/// acquisition context.
fn grant(
    manager: &LockManager,
    plan: Plan,
    request: AcquireRequest,
    kind: Kind,
    fence: u64,
    acquired: Acquired,
    recorded: bool,
) -> LockGuard {
    let inner = &manager.inner;
    let lease = Arc::new(LeaseState::new(acquired.sent, plan.ttl));
    let ids = Arc::new(request.into_hold_ids());
    let renewal = plan.watchdog.then(|| {
        let target = Target {
            hold: ids.clone(),
            metrics: plan.metrics,
        };
        inner
            .watchdog
            .register(inner, target, lease.clone(), acquired.sent, plan.max_hold)
    });
    let held = Arc::new(Held {
        manager: Arc::as_ptr(inner) as usize,
        reentrant: plan.reentrant,
        kind,
        ids,
        fence,
        lease: lease.clone(),
        guards: AtomicUsize::new(1),
        keep_until: Mutex::new(keep_until(acquired.sent, plan.min_hold)),
        cohort: plan.cohort,
        passes: 0,
    });
    if recorded {
        context::record(&held);
    }
    LockGuard::new(Parts {
        manager: manager.clone(),
        name: plan.keys.name,
        fence: plan.fencing.then_some(fence),
        lease,
        acquired,
        renewal,
        held,
        metrics: plan.metrics,
    })
}

/// The guard of a nested hold of `held`, which this code already owns: it shares the outer
/// hold's token, lease, share and fencing token, and asks nothing of Redis. Its `min_hold`
/// is kept when the last hold is released; with `watchdog`, it renews the shared lease too.
/// Not recorded: the outer hold is already visible where it is taken.
fn nested(manager: &LockManager, plan: Plan, held: Arc<Held>) -> LockGuard {
    let inner = &manager.inner;
    let sent = Instant::now();
    held.enter(keep_until(sent, plan.min_hold));
    let lease = held.lease.clone();
    let renewal = plan.watchdog.then(|| {
        let target = Target {
            hold: held.ids.clone(),
            metrics: plan.metrics,
        };
        inner
            .watchdog
            .register(inner, target, lease.clone(), sent, plan.max_hold)
    });
    tracing::debug!("acquired a nested hold");
    LockGuard::new(Parts {
        manager: manager.clone(),
        name: plan.keys.name,
        fence: plan.fencing.then_some(held.fence),
        lease,
        acquired: Acquired {
            attempts: 1,
            waited: Duration::ZERO,
            sent,
        },
        renewal,
        held,
        metrics: plan.metrics,
    })
}

/// The script shape and context kind of a first (or shared) hold of `kind` for `token`.
fn shape_of(kind: RequestKind, plan: &Plan, token: &str, tag: &str) -> (Shape, Kind) {
    let share = || plan.keys.share(token);
    let intent = || plan.keys.write_intent();
    match kind {
        // Checked by `plan`: exclusive, without fencing or min_hold.
        RequestKind::Exclusive if plan.fair => {
            let shape = Shape::Fair {
                queue: crate::backend::FairQueue::new(&plan.keys.lock, tag, plan.ttl, token),
                join: plan.retries > 0,
            };
            (shape, Kind::Exclusive)
        }
        // The string form: one native command each way.
        RequestKind::Exclusive if !plan.fencing && plan.min_hold.is_none() => {
            (Shape::Plain, Kind::Exclusive)
        }
        RequestKind::Exclusive => (Shape::Exclusive, Kind::Exclusive),
        RequestKind::Write => {
            // Keeps new readers out between this writer's attempts, no longer.
            let between = plan
                .backoff
                .ceiling()
                .saturating_mul(2)
                .max(Duration::from_secs(1));
            let shape = Shape::Write {
                intent: intent(),
                // A writer that will not try again leaves no intent behind.
                intent_lease: if plan.retries == 0 {
                    Duration::ZERO
                } else {
                    between.min(plan.ttl)
                },
            };
            (shape, Kind::Exclusive)
        }
        RequestKind::Read => {
            let shape = Shape::Share {
                share: share(),
                intent: intent(),
                permits: None,
            };
            (shape, Kind::Read)
        }
        RequestKind::Permits(permits) => {
            let shape = Shape::Share {
                share: share(),
                intent: intent(),
                permits: Some(permits),
            };
            (shape, Kind::Permit)
        }
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

/// Errors after which the same attempt may succeed if sent again.
/// Connection failures, and server answers that say "not now" (TRYAGAIN, CLUSTERDOWN,
/// MASTERDOWN, LOADING, READONLY during a failover, …): retried within the request's
/// bounds, and reported as the Redis error they are, never as busy, if the bounds run out.
pub(crate) fn is_transient(error: &redis::RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || !matches!(error.retry_method(), redis::RetryMethod::NoRetry)
}

/// An attempt whose answer has not arrived: if the request is dropped here, the hold may
/// exist on the server, so a release is sent behind it on the same connection.
///
/// It also covers a writer's intent. A writer refused while it may try again leaves an
/// intent that keeps new readers out (see `write_acquire.lua`); one that stops waiting
/// without the lock — it gives up, fails, or is cancelled — takes its intent back at once,
/// which wakes the readers it kept out: a free lock does not stay closed to them until the
/// intent expires. Behind an unanswered attempt, the intent is taken back after that
/// attempt's release, on the same connection, so that the attempt cannot set it again after.
struct InFlight<'a> {
    manager: &'a LockManager,
    request: &'a AcquireRequest,
    maybe_held: bool,
    /// An intent of this request may be in Redis (an answered attempt was refused).
    intent_left: bool,
}

impl<'a> InFlight<'a> {
    fn new(manager: &'a LockManager, request: &'a AcquireRequest, maybe_held: bool) -> Self {
        Self {
            manager,
            request,
            maybe_held,
            intent_left: false,
        }
    }

    /// The intent this request leaves while refused, if it leaves one.
    fn intent(&self) -> Option<&str> {
        match &self.request.shape {
            Shape::Write {
                intent,
                intent_lease,
            } if !intent_lease.is_zero() => Some(intent),
            _ => None,
        }
    }

    /// Notes what an attempt's answer (`None`: none came) means for the intent: a writer
    /// granted the lock took its own intent back in the same script; one refused, or whose
    /// answer was lost, may have left one.
    fn answered(&mut self, attempt: Option<&Attempt>) {
        self.intent_left =
            self.intent().is_some() && matches!(attempt, None | Some(Attempt::Busy { .. }));
    }
}

impl InFlight<'_> {
    /// Takes back the intent an answered, refused attempt left, now.
    fn withdraw_intent(&mut self) {
        if !self.intent_left || self.maybe_held {
            return;
        }
        self.intent_left = false;
        if let Some(intent) = self.intent() {
            let inner = &self.manager.inner;
            let ids = Arc::new(self.request.hold_ids());
            let withdraw = crate::guard::withdraw_intent(inner.clone(), ids, intent.to_owned());
            inner.driver.spawn(withdraw);
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let intent = self
            .intent()
            .filter(|_| self.intent_left || self.maybe_held)
            .map(str::to_owned);
        let inner = &self.manager.inner;
        if self.maybe_held {
            let ids = self.request.hold_ids();
            crate::guard::release_behind_acquire(inner, ids, intent);
        } else if let Some(intent) = intent {
            let ids = Arc::new(self.request.hold_ids());
            inner
                .driver
                .spawn(crate::guard::withdraw_intent(inner.clone(), ids, intent));
        }
    }
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
