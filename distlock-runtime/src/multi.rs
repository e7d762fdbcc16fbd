//! Several locks at once: the request built by [`LockManager::lock_all`], its acquire loop,
//! and [`MultiGuard`].
//!
//! A set is all or nothing: one attempt either takes every lock of the set or leaves nothing
//! behind, so a set never holds some keys while it waits for others, and two sets that
//! overlap cannot deadlock whatever order their keys are listed in. Every lock of a set is
//! written as a single exclusive lock is, so single locks, the watchdog and the other lock
//! kinds on the same keys see nothing new.

use std::fmt;
use std::future::Future;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::backend::{HoldIds, SetAttempt, SetKey, SetRequest};
use crate::context::RequestKind;
use crate::context::{self, Held, Kind};
use crate::guard::Acquired;
use crate::holds::Live;
use crate::key::Keys;
use crate::lease::LeaseState;
use crate::lease::{MAX_TTL, check_ttl};
use crate::lock::{is_transient, new_token};
use crate::manager::{Inner, LockManager};
use crate::retry::Backoff;
use crate::waiters::Ticket;
use crate::watchdog::{Registration, Target};
use crate::{LockError, LockGuard};

impl LockManager {
    /// Starts a request for the exclusive locks named `keys`, taken together: either every
    /// one is held or none is.
    ///
    /// The order of `keys` does not matter: two requests that list the same keys in opposite
    /// orders never deadlock, because a request never holds some of its keys while it waits
    /// for the others. Names that are equal are taken once. Each lock is the same lock that
    /// [`lock`](Self::lock) takes on that name, so a set waits for (and keeps out) single
    /// locks and every other kind of lock on any of its keys.
    ///
    /// ```no_run
    /// # async fn run(locks: distlock_runtime::LockManager) -> Result<(), distlock_runtime::LockError> {
    /// use std::time::Duration;
    ///
    /// let guard = locks
    ///     .lock_all(["account:1", "account:2"])
    ///     .ttl(Duration::from_secs(10))
    ///     .wait(Duration::from_secs(5))
    ///     .acquire()
    ///     .await?;
    /// // ... move the money ...
    /// guard.release().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn lock_all<I>(&self, keys: I) -> MultiLockRequest<'_>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        MultiLockRequest {
            manager: self,
            keys: keys.into_iter().map(Into::into).collect(),
            template: None,
            ttl: None,
            retries: None,
            retry_delay: None,
            wait: None,
            fencing: false,
            watchdog: false,
            max_hold: None,
            reentrant: false,
            record: true,
        }
    }
}

/// A request for several exclusive locks taken together, built by
/// [`LockManager::lock_all`]; send it with [`acquire`](Self::acquire) or
/// [`try_acquire`](Self::try_acquire).
///
/// The options are those of [`LockRequest`](crate::LockRequest), by the same names, and
/// apply to every lock of the set.
#[must_use = "a lock request does nothing until `acquire().await` or `try_acquire().await`"]
pub struct MultiLockRequest<'m> {
    manager: &'m LockManager,
    keys: Vec<String>,
    template: Option<&'static str>,
    ttl: Option<Duration>,
    retries: Option<u32>,
    retry_delay: Option<Duration>,
    wait: Option<Duration>,
    fencing: bool,
    watchdog: bool,
    max_hold: Option<Duration>,
    reentrant: bool,
    record: bool,
}

impl fmt::Debug for MultiLockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLockRequest")
            .field("keys", &self.keys)
            .field("ttl", &self.ttl)
            .field("retries", &self.retries)
            .field("retry_delay", &self.retry_delay)
            .field("wait", &self.wait)
            .field("fencing", &self.fencing)
            .field("watchdog", &self.watchdog)
            .field("max_hold", &self.max_hold)
            .field("reentrant", &self.reentrant)
            .finish_non_exhaustive()
    }
}

/// A set request with every option resolved and checked.
#[derive(Debug)]
struct Plan {
    /// Distinct locks, in the order first named.
    keys: Vec<Keys>,
    template: &'static str,
    ttl: Duration,
    retries: u32,
    backoff: Backoff,
    wait: Option<Duration>,
    fencing: bool,
    watchdog: bool,
    max_hold: Option<Duration>,
    reentrant: bool,
}

impl<'m> MultiLockRequest<'m> {
    /// Leaves the holds out of the current frame (see `LockRequest::unrecorded`).
    pub(crate) fn unrecorded(mut self) -> Self {
        self.record = false;
        self
    }

    /// The lease of every lock of the set. Must be at least 1 ms and at most [`MAX_TTL`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Extra attempts after the first when any lock of the set is busy or Redis fails
    /// transiently.
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

    /// Draw a fencing token for every lock of the set, from that key's own counter (the one
    /// single locks on the key draw from). See [`MultiGuard::fencing_token`].
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// Renew every lease of the set while the guard lives, in the manager's batched renewal.
    /// The guard is lost as soon as any one lease is.
    pub fn watchdog(mut self, watchdog: bool) -> Self {
        self.watchdog = watchdog;
        self
    }

    /// With `watchdog`: stop renewing after this long. Default: the manager's (1 hour).
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// A key of the set that code running inside a reentrant hold of it asks for again (see
    /// [`LockRequest::reentrant`](crate::LockRequest::reentrant)) becomes a nested hold of
    /// that key; the other keys are taken as usual. Without it, such a key fails the request
    /// at once with [`LockError::WouldDeadlock`].
    pub fn reentrant(mut self, reentrant: bool) -> Self {
        self.reentrant = reentrant;
        self
    }

    /// Names this request in metrics and tracing (the `template` label), in place of
    /// `<manual>`, as [`LockRequest::label`](crate::LockRequest::label) does: the shape of
    /// the keys, such as `"transfer:{from}:{to}"`, never the keys themselves. Keys of the set
    /// that are nested holds of this task's own locks carry it too.
    pub fn label(self, label: &'static str) -> Self {
        self.template(label)
    }

    #[doc(hidden)]
    /// The key templates this request was formatted from, as a low-cardinality tracing label.
    pub fn template(mut self, template: &'static str) -> Self {
        self.template = Some(template);
        self
    }

    /// Takes every lock of the set, retrying within the request's bounds; a busy set waits
    /// for a release of the key it found busy.
    ///
    /// Errors: those of [`LockRequest::acquire`](crate::LockRequest::acquire), naming the key
    /// found busy (or lost); [`LockError::InvalidInput`] for an empty set as well, and
    /// [`LockError::ShutDown`] once [`LockManager::shutdown`] was called.
    ///
    /// Cancel-safe: if this future is dropped while an attempt is in flight, a release of the
    /// whole set is sent right behind it.
    pub async fn acquire(self) -> Result<MultiGuard, LockError> {
        let plan = self.plan()?;
        let names: Vec<&str> = plan.keys.iter().map(|k| k.name.as_str()).collect();
        let span =
            tracing::debug_span!("lock.acquire_all", template = plan.template, keys = ?names);
        let holds = &self.manager.inner.holds;
        if holds.is_shut_down() {
            return Err(LockError::ShutDown);
        }
        let acquiring = Box::pin(acquire(self.manager, plan, self.record).instrument(span));
        let guard = tokio::select! {
            acquired = acquiring => acquired?,
            () = holds.until_shut_down() => return Err(LockError::ShutDown),
        };
        if guard.listing == Listing::Unlisted {
            // Granted while the manager shut down: dropping it gives it back.
            return Err(LockError::ShutDown);
        }
        Ok(guard)
    }

    /// Makes exactly one attempt: `Ok(None)` when another owner holds any lock of the set.
    pub async fn try_acquire(self) -> Result<Option<MultiGuard>, LockError> {
        match self.retries(0).wait(Duration::ZERO).acquire().await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Busy { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn plan(&self) -> Result<Plan, LockError> {
        let defaults = self.manager.defaults();
        let mut keys: Vec<Keys> = Vec::with_capacity(self.keys.len());
        for name in &self.keys {
            let key = Keys::new(&self.manager.inner.prefix, name.clone())?;
            if keys.iter().all(|k| k.lock != key.lock) {
                keys.push(key);
            }
        }
        if keys.is_empty() {
            return Err(LockError::invalid(
                "keys",
                "`lock_all` needs at least one key",
            ));
        }
        let ttl = self.ttl.unwrap_or(defaults.ttl);
        check_ttl(ttl).map_err(|reason| {
            LockError::invalid("ttl", format!("the lease of a lock set {reason}"))
        })?;
        if self.fencing && !self.manager.inner.backend.capabilities().fencing {
            return Err(LockError::invalid(
                "fencing",
                "fencing tokens need one counter; RedLock masters count independently",
            ));
        }
        if self.max_hold.is_some_and(|v| v.is_zero()) {
            return Err(LockError::invalid(
                "max_hold",
                "`max_hold` must be greater than zero",
            ));
        }
        let retries = match (self.retries, self.wait) {
            (Some(retries), _) => retries,
            (None, Some(_)) => u32::MAX,
            (None, None) if defaults.wait.is_some() && defaults.retries == 0 => u32::MAX,
            (None, None) => defaults.retries,
        };
        Ok(Plan {
            keys,
            template: self.template.unwrap_or("<manual>"),
            ttl,
            retries,
            backoff: Backoff::new(self.retry_delay.unwrap_or(defaults.retry_delay)),
            // Longer than any lease: no time bound at all.
            wait: self.wait.or(defaults.wait).filter(|wait| *wait <= MAX_TTL),
            fencing: self.fencing,
            watchdog: self.watchdog,
            max_hold: self.max_hold.or(defaults.max_hold),
            reentrant: self.reentrant,
        })
    }
}

async fn acquire(manager: &LockManager, plan: Plan, record: bool) -> Result<MultiGuard, LockError> {
    let inner = &manager.inner;
    let manager_id = Arc::as_ptr(inner) as usize;
    let names: Vec<String> = plan.keys.iter().map(|k| k.name.clone()).collect();
    // Keys this code already holds are nested holds of those locks, granted at once (or
    // refused at once); the others form the set taken in one attempt.
    let (outer, fresh): (Vec<Keys>, Vec<Keys>) = plan
        .keys
        .iter()
        .cloned()
        .partition(|k| context::find(manager_id, &k.lock).is_some());
    let mut nested = Vec::with_capacity(outer.len());
    for keys in outer {
        let mut request = manager
            .lock(keys.name.clone())
            .template(plan.template)
            .ttl(plan.ttl)
            .reentrant(plan.reentrant)
            .fencing(plan.fencing)
            .watchdog(plan.watchdog);
        if let Some(max_hold) = plan.max_hold {
            request = request.max_hold(max_hold);
        }
        nested.push(request.acquire().await?);
    }
    let token = new_token(manager.inner.waiters.tag());
    let request = SetRequest {
        keys: fresh
            .iter()
            .map(|k| SetKey {
                lock: k.lock.clone(),
                fence: k.fence(),
                wake: k.wake(),
            })
            .collect(),
        token: token.clone(),
        lease: plan.ttl,
        fencing: plan.fencing,
    };
    let started = Instant::now();
    if fresh.is_empty() {
        let acquired = Acquired {
            attempts: 1,
            waited: started.elapsed(),
            sent: started,
        };
        return Ok(grant(
            manager,
            &plan,
            names,
            fresh,
            request,
            Vec::new(),
            nested,
            acquired,
            record,
        ));
    }
    let deadline = plan.wait.map(|wait| started + wait);
    let mut in_flight = InFlight {
        manager,
        request: &request,
        maybe_held: false,
    };
    let give_up = |attempts, at: usize, failure: Option<redis::RedisError>| match failure {
        Some(error) => LockError::redis(&fresh[at].name, error),
        None => LockError::Busy {
            key: fresh[at].name.clone(),
            attempts,
            waited: started.elapsed(),
            holder_token: None,
            holder: None,
        },
    };
    // A set that may wait follows the wake channel of the lock it last found busy, in that
    // lock's local queue.
    let queues = plan.retries > 0;
    let mut ticket: Option<(usize, Ticket)> = None;
    let mut failure: Option<redis::RedisError>;
    let mut attempts = 0u32;
    let mut busy_at = 0usize;
    let mut just_joined = false;
    loop {
        if let Some((at, ticket)) = &ticket {
            let turn = async {
                ticket.until_head().await;
                ticket.subscribe().await;
            };
            match deadline {
                Some(deadline) => tokio::select! {
                    () = turn => {}
                    _ = inner.sleep_until(deadline) => {
                        return Err(give_up(attempts, *at, ticket.last_failure()));
                    }
                },
                None => turn.await,
            }
        }
        let mut seen = ticket.as_ref().map(|(_, t)| t.wakes());
        attempts += 1;
        let sent = Instant::now();
        in_flight.maybe_held = true;
        let attempt = request.clone();
        let outcome = inner
            .exec(move |backend| async move { backend.acquire_set(&attempt).await })
            .await?;
        if outcome.is_ok() {
            inner.waiters.attempted();
        }
        let holder_ttl = match outcome {
            Ok(SetAttempt::Held { fences }) => {
                in_flight.maybe_held = false;
                drop(in_flight);
                let acquired = Acquired {
                    attempts,
                    waited: started.elapsed(),
                    sent,
                };
                tracing::debug!(attempts, waited = ?acquired.waited, "acquired");
                return Ok(grant(
                    manager, &plan, names, fresh, request, fences, nested, acquired, record,
                ));
            }
            Ok(SetAttempt::Busy { at, holder_ttl }) => {
                in_flight.maybe_held = false;
                failure = None;
                busy_at = at.min(fresh.len() - 1);
                holder_ttl
            }
            Ok(SetAttempt::Unreplicated { acked, wanted }) => {
                in_flight.maybe_held = false;
                return Err(LockError::NotReplicated {
                    key: fresh[0].name.clone(),
                    acked,
                    wanted,
                });
            }
            Err(error) if is_transient(&error) => {
                tracing::debug!(attempts, %error, "acquire attempt failed");
                failure = Some(error);
                None
            }
            Err(error) => return Err(LockError::redis(&fresh[busy_at].name, error)),
        };
        if let Some((_, ticket)) = &ticket {
            ticket.heard(failure.clone());
        }
        let now = Instant::now();
        if attempts > plan.retries || deadline.is_some_and(|d| d <= now) {
            return Err(give_up(attempts, busy_at, failure));
        }
        let follows = ticket.as_ref().is_some_and(|(at, _)| *at == busy_at);
        if queues && failure.is_none() && !follows {
            // Busy on a lock not followed yet: queue for it. Look again at once after
            // subscribing (a release in between publishes unheard), unless that was just done.
            let labels = crate::metrics::Labels::new(plan.template, RequestKind::Exclusive);
            let joined = inner.waiters.join(
                &request.keys[busy_at].wake,
                &inner.backend,
                &inner.driver,
                labels,
            );
            joined.heard(None);
            seen = Some(joined.wakes());
            ticket = Some((busy_at, joined));
            if !just_joined {
                just_joined = true;
                continue;
            }
        }
        just_joined = false;
        let mut until = now + plan.backoff.delay(attempts, holder_ttl);
        if let Some(deadline) = deadline {
            until = until.min(deadline);
        }
        match &ticket {
            Some((_, waiting)) => {
                let seen = seen.unwrap_or_default();
                tokio::select! {
                    () = waiting.woken_since(seen) => {}
                    _ = inner.sleep_until(until) => {}
                }
            }
            None => {
                let _ = inner.sleep_until(until).await;
            }
        }
        if deadline.is_some_and(|d| d <= Instant::now()) {
            let last = match &ticket {
                Some((_, ticket)) => ticket.last_failure(),
                None => failure,
            };
            return Err(give_up(attempts, busy_at, last));
        }
    }
}

/// Builds the guard of a granted set: one lease for the set, its renewals, and its place in
/// the acquisition context.
#[allow(clippy::too_many_arguments)]
fn grant(
    manager: &LockManager,
    plan: &Plan,
    names: Vec<String>,
    fresh: Vec<Keys>,
    request: SetRequest,
    fences: Vec<u64>,
    nested: Vec<LockGuard>,
    acquired: Acquired,
    record: bool,
) -> MultiGuard {
    let inner = &manager.inner;
    let lease = Arc::new(LeaseState::new(acquired.sent, plan.ttl));
    // One hold identity per lock, shared by its renewal, its context entry and its release.
    let ids: Vec<Arc<HoldIds>> = request
        .keys
        .iter()
        .map(|key| Arc::new(hold_ids(key, &request.token)))
        .collect();
    // Every lease of the set shares one state: a renewal that finds any lock gone marks the
    // whole set lost.
    let renewals = if plan.watchdog && !fresh.is_empty() {
        ids.iter()
            .map(|hold| {
                let target = Target {
                    hold: hold.clone(),
                    metrics: crate::metrics::Labels::new(plan.template, RequestKind::Exclusive),
                };
                inner
                    .watchdog
                    .register(inner, target, lease.clone(), acquired.sent, plan.max_hold)
            })
            .collect()
    } else {
        Vec::new()
    };
    let held: Vec<Arc<Held>> = ids
        .into_iter()
        .zip(&fences)
        .map(|(ids, &fence)| {
            Arc::new(Held {
                manager: Arc::as_ptr(inner) as usize,
                reentrant: plan.reentrant,
                kind: Kind::Exclusive,
                ids,
                fence,
                lease: lease.clone(),
                guards: AtomicUsize::new(1),
                keep_until: Mutex::new(None),
                cohort: false,
                passes: 0,
            })
        })
        .collect();
    if record {
        held.iter().for_each(context::record);
    }
    // Each lock of the set is listed as the first hold it is, for shutdown to give back.
    let mut ids = Vec::with_capacity(request.keys.len());
    let mut after_shutdown = false;
    for key in &request.keys {
        let live = Live {
            ids: Arc::new(hold_ids(key, &request.token)),
            keep_until: None,
            lease: lease.clone(),
        };
        match inner.holds.list(live) {
            Some(id) => ids.push(id),
            None => after_shutdown = true,
        }
    }
    let listing = if after_shutdown {
        for id in ids {
            inner.holds.unlist(id);
        }
        Listing::Unlisted
    } else {
        Listing::Listed(ids)
    };
    MultiGuard {
        listing,
        manager: manager.clone(),
        names,
        fresh,
        fences: plan.fencing.then_some(fences),
        request,
        nested,
        lease,
        acquired,
        renewals,
        held,
    }
}

/// An attempt whose answer has not arrived: if the request is dropped here, the set may be
/// held on the server, so a release is sent behind it.
struct InFlight<'a> {
    manager: &'a LockManager,
    request: &'a SetRequest,
    maybe_held: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.maybe_held {
            release_behind_attempt(self.manager, self.request.clone());
        }
    }
}

/// Proof that this owner holds every lock of a set. Dropping it releases them all.
///
/// Prefer [`release`](Self::release), which waits for Redis to confirm; dropping the guard
/// hands the release to the manager's background runtime, as for [`LockGuard`].
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiGuard {
    manager: LockManager,
    /// Every key of the set, deduplicated, in the order first named.
    names: Vec<String>,
    /// The keys taken by this set (not nested holds), in `request` order.
    fresh: Vec<Keys>,
    fences: Option<Vec<u64>>,
    request: SetRequest,
    /// Nested holds of keys this code already held.
    nested: Vec<LockGuard>,
    lease: Arc<LeaseState>,
    acquired: Acquired,
    renewals: Vec<Registration>,
    held: Vec<Arc<Held>>,
    listing: Listing,
}

/// Where a set's locks stand with its manager (as a `LockGuard`'s hold does).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Listing {
    /// Listed under these ids, so that shutdown can give them back.
    Listed(Vec<u64>),
    /// Granted while the manager shut down: not listed, still to be given back.
    Unlisted,
    /// Given back, or handed to shutdown.
    Done,
}

/// What names the hold a set has of one of its locks: a first exclusive hold of its token.
fn hold_ids(key: &SetKey, token: &str) -> HoldIds {
    HoldIds {
        lock: key.lock.clone(),
        wake: key.wake.clone(),
        token: token.to_owned(),
        share: None,
        plain: false,
        fair: None,
    }
}

impl MultiGuard {
    /// The keys of the set as requested (without the manager's prefix), each once, in the
    /// order first named.
    pub fn keys(&self) -> &[String] {
        &self.names
    }

    /// The set's owner token (as [`LockGuard::token`]), shared by every lock the set took.
    /// A key held as a nested hold keeps its outer hold's token.
    pub fn token(&self) -> &str {
        &self.request.token
    }

    /// The fencing token of `key` for this acquisition, when the request asked for fencing
    /// and `key` is in the set. Each key draws from its own counter, the one single locks on
    /// that key draw from; see [`LockGuard::fencing_token`].
    pub fn fencing_token(&self, key: &str) -> Option<u64> {
        if let Some(at) = self.fresh.iter().position(|k| k.name == key) {
            return self.fences.as_ref().map(|fences| fences[at]);
        }
        self.nested
            .iter()
            .find(|guard| guard.key() == key)
            .and_then(LockGuard::fencing_token)
    }

    /// The lease length this set was granted or last extended to.
    pub fn ttl(&self) -> Duration {
        self.lease.ttl()
    }

    /// How many attempts the acquisition took (1 when every lock was free at once).
    pub fn attempts(&self) -> u32 {
        self.acquired.attempts
    }

    /// How long the acquisition took, from the first attempt to holding every lock.
    pub fn waited(&self) -> Duration {
        self.acquired.waited
    }

    /// How long every lease of the set is still valid by this process's monotonic clock (the
    /// shortest of them); zero once any is known lost.
    pub fn remaining(&self) -> Duration {
        let own = if self.fresh.is_empty() {
            Duration::MAX
        } else {
            self.lease.remaining()
        };
        self.nested
            .iter()
            .map(LockGuard::remaining)
            .fold(own, Duration::min)
    }

    /// Whether any lease of the set is known to be lost. Asks nothing of Redis.
    pub fn is_lost(&self) -> bool {
        (!self.fresh.is_empty() && self.lease.is_lost())
            || self.nested.iter().any(LockGuard::is_lost)
    }

    /// Completes when any lease of the set is lost, with the [`LockError::Lost`] to report;
    /// see [`LockGuard::lost`].
    pub async fn lost(&self) -> LockError {
        let own = async {
            if self.fresh.is_empty() {
                return std::future::pending().await;
            }
            loop {
                if self.lease.is_lost() {
                    self.lease.mark_lost();
                    return self.lost_error(None);
                }
                let timer = self.manager.inner.sleep_until(self.lease.valid_until());
                tokio::select! {
                    () = self.lease.until_marked_lost() => {}
                    _ = timer => {}
                }
            }
        };
        type Lost<'a> = std::pin::Pin<Box<dyn Future<Output = LockError> + Send + 'a>>;
        let nested = futures_util::future::select_all(
            self.nested
                .iter()
                .map(|guard| Box::pin(guard.lost()) as Lost<'_>)
                .chain(std::iter::once(Box::pin(std::future::pending()) as Lost<'_>)),
        );
        tokio::select! {
            lost = own => lost,
            (lost, _, _) = nested => lost,
        }
    }

    /// Asks Redis whether this owner still holds every lock of the set.
    pub async fn is_held(&self) -> Result<bool, LockError> {
        let checks = self.request.keys.iter().map(|key| {
            let (lock, token) = (key.lock.clone(), self.request.token.clone());
            self.manager
                .inner
                .exec(move |backend| async move { backend.holds(&lock, None, &token).await })
        });
        for (answer, keys) in futures_util::future::join_all(checks)
            .await
            .into_iter()
            .zip(&self.fresh)
        {
            if !answer?.map_err(|e| LockError::redis(&keys.name, e))? {
                return Ok(false);
            }
        }
        for guard in &self.nested {
            if !guard.is_held().await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Makes every lease of the set last at least `ttl` from now, if this owner still holds
    /// them all; otherwise [`LockError::Lost`] naming a lock that was lost (the others are
    /// extended). Like [`LockGuard::extend`], it never shortens a lease.
    /// The extensions go out together, in one round trip per server.
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        check_ttl(ttl).map_err(|reason| LockError::invalid("ttl", format!("a lease {reason}")))?;
        if self.given_back_by_shutdown() {
            return Err(LockError::ShutDown);
        }
        let sent = Instant::now();
        let calls = self.request.keys.iter().map(|key| {
            let (lock, token) = (key.lock.clone(), self.request.token.clone());
            self.manager
                .inner
                .exec(move |backend| async move { backend.extend(&lock, None, &token, ttl).await })
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut lost = None;
        for (answer, keys) in answers.into_iter().zip(&self.fresh) {
            let extended = answer?.map_err(|e| LockError::redis(&keys.name, e))?;
            if !extended && lost.is_none() {
                lost = Some(keys);
            }
        }
        // An answer after the local deadline finds the lease already lost.
        let lost = match lost {
            None if !self.fresh.is_empty() && !self.lease.renewed(sent, ttl) => self.fresh.first(),
            None => None,
            Some(at) => Some(at),
        };
        if let Some(key) = lost {
            self.lease.mark_lost();
            return Err(self.lost_error(Some(&key.name)));
        }
        for guard in &self.nested {
            guard.extend(ttl).await?;
        }
        Ok(())
    }

    /// Gives every lock of the set back and waits for Redis to confirm, in one round trip
    /// per server (per hash slot on Cluster). Renewal stops at once.
    ///
    /// [`LockError::Lost`] names a lock whose lease had already ended; the others are given
    /// back all the same. A release whose reply is lost is sent once more, as for
    /// [`LockGuard::release`].
    pub async fn release(mut self) -> Result<(), LockError> {
        self.renewals.clear();
        if !self.unlist() {
            return Err(LockError::ShutDown);
        }
        let inner = self.manager.inner.clone();
        let mut outcome = Ok(());
        // A lock re-entered by a nested hold taken inside the set stays with that hold: its
        // last release gives the lock back.
        let (request, fresh) = self.last_holds();
        if !fresh.is_empty() {
            let mut retried = false;
            let released = loop {
                let request = request.clone();
                let answer = inner
                    .exec(move |backend| async move { backend.release_set(&request).await })
                    .await?;
                match answer {
                    Ok(released) => break released,
                    Err(error) if !retried && error.is_io_error() => retried = true,
                    Err(error) => {
                        return Err(LockError::redis(&fresh[0].name, error));
                    }
                }
            };
            // After a resent release, a lock found gone while the lease was valid had been
            // given back by the first attempt.
            let mut lost = None;
            for ((yes, key), keys) in released.iter().zip(&request.keys).zip(&fresh) {
                if *yes {
                    inner.waiters.released(&key.wake);
                } else if lost.is_none() && (!retried || self.lease.is_lost()) {
                    lost = Some(keys.name.clone());
                }
            }
            tracing::debug!(keys = ?self.names, held_for = ?self.acquired.sent.elapsed(), "released");
            if let Some(key) = lost {
                self.lease.mark_lost();
                outcome = Err(LockError::Lost { key });
            }
        }
        // Nested holds end after the set, innermost first.
        for guard in std::mem::take(&mut self.nested).into_iter().rev() {
            let released = guard.release().await;
            if outcome.is_ok() {
                outcome = released;
            }
        }
        outcome
    }

    /// The part of the set whose last hold this guard is (every lock, unless code inside the
    /// set re-entered some and still holds them), counted off each lock's holds.
    fn last_holds(&self) -> (SetRequest, Vec<Keys>) {
        let mut request = SetRequest {
            keys: Vec::with_capacity(self.request.keys.len()),
            ..self.request.clone()
        };
        let mut fresh = Vec::with_capacity(self.fresh.len());
        for ((key, keys), held) in self.request.keys.iter().zip(&self.fresh).zip(&self.held) {
            if held.leave() {
                request.keys.push(key.clone());
                fresh.push(keys.clone());
            }
        }
        (request, fresh)
    }

    /// Takes the set off the manager's list: `true` when giving it back is up to the caller,
    /// `false` when shutdown (or an earlier release) already did.
    fn unlist(&mut self) -> bool {
        match std::mem::replace(&mut self.listing, Listing::Done) {
            // Shutdown takes every hold at once: one still listed means all are.
            Listing::Listed(ids) => {
                let holds = &self.manager.inner.holds;
                ids.into_iter()
                    .fold(self.fresh.is_empty(), |ours, id| holds.unlist(id) | ours)
            }
            Listing::Unlisted => true,
            Listing::Done => false,
        }
    }

    /// Whether [`LockManager::shutdown`] gave the set back.
    fn given_back_by_shutdown(&self) -> bool {
        match &self.listing {
            Listing::Listed(ids) => ids
                .iter()
                .any(|&id| !self.manager.inner.holds.is_listed(id)),
            Listing::Unlisted | Listing::Done => false,
        }
    }

    fn lost_error(&self, key: Option<&str>) -> LockError {
        if self.given_back_by_shutdown() {
            return LockError::ShutDown;
        }
        let key = key.or_else(|| self.fresh.first().map(|k| k.name.as_str()));
        LockError::Lost {
            key: key.unwrap_or_default().to_owned(),
        }
    }

    pub(crate) fn held(&self) -> &[Arc<Held>] {
        &self.held
    }
}

impl Drop for MultiGuard {
    fn drop(&mut self) {
        self.renewals.clear();
        if self.unlist() && !self.fresh.is_empty() {
            let (request, fresh) = self.last_holds();
            if fresh.is_empty() {
                return;
            }
            // From the manager's own runtime, which outlives the caller's.
            let release = release_logged(self.manager.inner.clone(), request);
            self.manager.inner.driver.spawn(release);
        }
    }
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiGuard")
            .field("keys", &self.names)
            .field("token", &self.request.token)
            .field("fencing_tokens", &self.fences)
            .field("remaining", &self.remaining())
            .field("watchdog", &!self.renewals.is_empty())
            .finish_non_exhaustive()
    }
}

/// Sends a release of a whole set right behind an attempt whose caller gave up: on the
/// caller's runtime, queued before this returns on the connection the attempt went out on
/// (outside any runtime, from the manager's own).
fn release_behind_attempt(manager: &LockManager, request: SetRequest) {
    let release = release_logged(manager.inner.clone(), request);
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            // One poll queues the request on the connection; the task finishes the rest.
            let mut release = Box::pin(release);
            let mut cx = Context::from_waker(Waker::noop());
            if release.as_mut().poll(&mut cx).is_pending() {
                drop(runtime.spawn(release));
            }
        }
        Err(_) => manager.inner.driver.spawn(release),
    }
}

/// Gives back a whole set; the outcome is only logged.
async fn release_logged(inner: Arc<Inner>, request: SetRequest) {
    match inner.backend.release_set(&request).await {
        Ok(released) => {
            for (yes, key) in released.into_iter().zip(&request.keys) {
                if yes {
                    inner.waiters.released(&key.wake);
                }
            }
            tracing::debug!(locks = request.keys.len(), "set released in the background");
        }
        Err(error) => tracing::warn!(
            %error,
            "background release of a lock set failed; the leases will expire"
        ),
    }
}
