//! Several locks at once: a set request's acquire, and [`MultiGuard`].
//!
//! A set is all or nothing: one attempt either takes every lock of the set or leaves nothing
//! behind, so a set never holds some keys while it waits for others, and two sets that
//! overlap cannot deadlock whatever order their keys are listed in. Every lock of a set is
//! written as a single exclusive lock is, so single locks, the watchdog and the other lock
//! kinds on the same keys see nothing new.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::Instrument;

use crate::backend::{AcquireAnswer, HoldIds, SetKey, SetRequest};
use crate::engine::{Claim, Engine, Won};
use crate::error::LockError;
use crate::guard::Acquired;
use crate::guard::LockGuard;
use crate::held::{Held, HoldKind};
use crate::holds::{KeepUntil, ListedHold, Listing};
use crate::key::Keys;
use crate::kind::RequestKind;
use crate::lease::{LeaseState, check_ttl, keep_from};
use crate::lock;
use crate::manager::{Inner, LockManager};
use crate::release::{Known, Outcome, Resend, SetRelease, Unanswered};
use crate::request::plan::Plan;
use crate::request::{KeySet, LockRequest, MultiLockRequest, Target};
use crate::token::new_token;
use crate::watchdog::{Leased, Registration};

impl Target for KeySet {
    type Guard = MultiGuard;

    fn acquire<'m>(
        request: LockRequest<'m, Self>,
    ) -> impl Future<Output = Result<MultiGuard, LockError>> + Send + 'm {
        acquire_set(request)
    }
}

/// Takes a set: see [`LockRequest::acquire`].
async fn acquire_set(mut request: MultiLockRequest<'_>) -> Result<MultiGuard, LockError> {
    let plan = request.plan_set()?;
    let manager = request.manager;
    if manager.inner.holds.is_shut_down() {
        return Err(LockError::ShutDown);
    }
    let names: Vec<&str> = plan.keys.iter().map(|k| k.name.as_str()).collect();
    let span = crate::trace::acquire(plan.metrics, &names.join(","));
    let taking = async {
        let result = take_set(manager, plan).await;
        crate::trace::acquired(&tracing::Span::current(), &result);
        result
    };
    let mut guard = Box::pin(taking.instrument(span)).await?;
    if guard.listing == Listing::Unlisted {
        // Granted while the manager shut down: dropping it gives it back.
        return Err(LockError::ShutDown);
    }
    // Here, outside the acquire span: the hold is a child of the caller's span.
    let keys = guard.names.join(",");
    guard.span = crate::trace::HoldSpan::start(&crate::trace::HoldFields {
        labels: guard.metrics,
        key: &keys,
        token: &guard.request.token,
        fence: None,
        passes: 0,
    });
    Ok(guard)
}

async fn take_set(manager: &LockManager, plan: Plan<Vec<Keys>>) -> Result<MultiGuard, LockError> {
    let inner = &manager.inner;
    let names: Vec<String> = plan.keys.iter().map(|k| k.name.clone()).collect();
    // Keys this code already holds are nested holds of those locks, granted at once (or
    // refused at once); the others form the set taken in one attempt.
    let mut nested = Vec::new();
    let mut fresh = Vec::with_capacity(plan.keys.len());
    for keys in &plan.keys {
        let one = plan.with_keys(keys.clone());
        let (labels, timer) = (one.metrics, crate::metrics::Timer::start());
        // Counted as the acquisitions they are, under the set's label.
        let taken = match lock::outer_hold(manager, RequestKind::Exclusive, &one) {
            Ok(None) => {
                fresh.push(keys.clone());
                continue;
            }
            Ok(Some(held)) => lock::nest(manager, one, held).await,
            Err(error) => Err(error),
        };
        crate::metrics::acquire_ended(labels, timer, &taken);
        nested.push(taken?);
    }
    let request = SetRequest {
        keys: fresh
            .iter()
            .map(|k| SetKey {
                lock: k.lock.clone(),
                fence: k.fence(),
                wake: k.wake(),
                keep: Duration::ZERO,
            })
            .collect(),
        token: new_token(inner.waiters.manager_id()),
        lease: plan.ttl,
        fencing: plan.options.fencing,
    };
    let started = Instant::now();
    let (fences, sent, attempts, ticket, late_until) = if fresh.is_empty() {
        (Vec::new(), started, 1, None, None)
    } else {
        let engine = Engine::new(inner, &request, &plan, &fresh, started);
        let outcome = engine.acquire(None, false).await?;
        let Won::Asked { won, sent } = outcome.won else {
            unreachable!("a set stands ready for no hand-off");
        };
        (
            won,
            sent,
            outcome.attempts,
            outcome.ticket,
            outcome.late_until,
        )
    };
    let acquired = Acquired {
        attempts,
        waited: started.elapsed(),
        sent,
    };
    tracing::debug!(attempts, waited = ?acquired.waited, "acquired");
    let taken = Taken {
        names,
        fresh,
        request,
        fences,
        nested,
        late_until,
    };
    let guard = grant_set(manager, &plan, taken, acquired);
    // The waiters behind see the holder until the guard exists.
    drop(ticket);
    still_nested(guard, attempts > 1).await
}

/// A set whose nested holds may have ended while it waited for its other locks (`waited`)
/// is granted only if each is still this owner's on the server; otherwise the set is given
/// back and the request answers [`LockError::Lost`] for that key, as a nested acquire of a
/// lost hold does.
async fn still_nested(guard: MultiGuard, waited: bool) -> Result<MultiGuard, LockError> {
    let mut lost = None;
    for nested in &guard.nested {
        let gone = nested.is_lost() || (waited && !nested.is_held().await?);
        if gone {
            nested.held().lease.mark_lost();
            lost = Some(nested.key().to_owned());
            break;
        }
    }
    match lost {
        None => Ok(guard),
        Some(key) => {
            // Its own locks go back now; the lost nested hold reports itself.
            let _ = guard.release().await;
            Err(LockError::Lost { key })
        }
    }
}

/// What a set request took: its keys, the locks it took itself and their fencing tokens, and
/// the nested holds of keys this code already held.
struct Taken {
    names: Vec<String>,
    fresh: Vec<Keys>,
    request: SetRequest,
    fences: Vec<u64>,
    nested: Vec<LockGuard>,
    /// Until when an attempt whose answer never came may still reach the server.
    late_until: Option<Instant>,
}

/// Builds the guard of a granted set: one lease for the set, its renewals, and its place in
/// the acquisition context.
fn grant_set(
    manager: &LockManager,
    plan: &Plan<Vec<Keys>>,
    taken: Taken,
    acquired: Acquired,
) -> MultiGuard {
    let inner = &manager.inner;
    let Taken {
        names,
        fresh,
        request,
        fences,
        nested,
        late_until,
    } = taken;
    // Every lease of the set shares one state: a renewal that finds any lock gone marks the
    // whole set lost.
    let lease = Arc::new(LeaseState::new(acquired.sent, plan.ttl));
    let mut holds = Vec::with_capacity(request.keys.len());
    let mut held = Vec::with_capacity(request.keys.len());
    for (key, &fence) in request.keys.iter().zip(&fences) {
        // One hold identity per lock, shared by its renewal, its context entry and its
        // release.
        let ids = Arc::new(hold_ids(key, &request.token, late_until));
        holds.push(ids.clone());
        let start = (fence, None, 0);
        held.push(Held::first(
            inner,
            plan,
            HoldKind::Exclusive,
            ids,
            lease.clone(),
            start,
        ));
    }
    let sharers: Arc<[std::sync::Weak<Held>]> = held.iter().map(Arc::downgrade).collect();
    for one in &held {
        let _ = one.set.set(sharers.clone());
    }
    // Each lock listed as the first hold it is, for shutdown to give back.
    let listing = inner.holds.list(holds.iter().zip(&held).map(|(ids, one)| {
        let one = Arc::downgrade(one);
        ListedHold {
            ids: ids.clone(),
            keep_until: KeepUntil::new(move || one.upgrade().and_then(|one| one.keep_until())),
            lease: lease.clone(),
        }
    }));
    // One renewal for the whole set: its lease goes on only if every lock was renewed.
    let renewals: Vec<Registration> = lock::register_renewal(
        inner,
        plan,
        Leased::Set(holds.into()),
        &lease,
        acquired.sent,
    )
    .into_iter()
    .collect();
    MultiGuard {
        listing,
        manager: manager.clone(),
        names,
        fresh,
        fences: plan.options.fencing.then_some(fences),
        request,
        late_until,
        nested,
        lease,
        acquired,
        renewals,
        held,
        metrics: plan.metrics,
        span: crate::trace::HoldSpan::default(),
    }
}

impl Claim for SetRequest {
    type Fences = Vec<u64>;
    const SET: bool = true;

    async fn send(
        &self,
        inner: &Inner,
    ) -> Result<redis::RedisResult<AcquireAnswer<Vec<u64>>>, LockError> {
        let attempt = self.clone();
        inner
            .on_runtime(move |backend| async move { backend.acquire_set(&attempt).await })
            .await
    }

    fn token(&self) -> &str {
        &self.token
    }

    fn wake(&self, at: usize) -> &str {
        &self.keys[at].wake
    }

    fn release_behind(&self, inner: &Arc<Inner>, _intent: Option<String>) {
        let (given, releaser) = (attempted(self), inner.releaser());
        crate::engine::send_behind(inner, move || {
            let (releaser, given) = (releaser.clone(), given.clone());
            async move {
                releaser
                    .give_back(given, Known::default())
                    .await
                    .answer()
                    .map(drop)
            }
        });
    }

    async fn give_back(&self, inner: &Inner) -> Option<bool> {
        let (given, releaser) = (attempted(self), inner.releaser());
        let outcome = inner
            .on_runtime(move |_| releaser.give_back(given, Known::default()))
            .await;
        outcome.ok()?.answer().ok()
    }
}

/// What a set's attempts may hold, to give back behind them.
fn attempted(request: &SetRequest) -> SetRelease {
    SetRelease {
        request: request.clone(),
        late_until: None,
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
    /// As [`HoldIds::late_until`], for the set's own attempts.
    late_until: Option<Instant>,
    /// Nested holds of keys this code already held.
    nested: Vec<LockGuard>,
    lease: Arc<LeaseState>,
    acquired: Acquired,
    renewals: Vec<Registration>,
    held: Vec<Arc<Held>>,
    listing: Listing,
    metrics: crate::metrics::Labels,
    /// The `lock.hold` span of the set, from the grant to the release.
    span: crate::trace::HoldSpan,
}

/// What names the hold a set has of one of its locks: a first exclusive hold of its token.
fn hold_ids(key: &SetKey, token: &str, late_until: Option<Instant>) -> HoldIds {
    HoldIds {
        lock: key.lock.clone(),
        wake: key.wake.clone(),
        token: token.to_owned(),
        shared: false,
        plain: false,
        fair: None,
        late_until,
    }
}

impl MultiGuard {
    /// What a guarded write must find held: each key's name and hold, those this set took
    /// and those nested in holds of this code (for guarded writes).
    pub(crate) fn write_holds(&self) -> (&LockManager, Vec<(String, Arc<Held>)>) {
        let fresh = self
            .fresh
            .iter()
            .map(|keys| keys.name.clone())
            .zip(self.held.iter().cloned());
        let nested = self
            .nested
            .iter()
            .map(|guard| (guard.key().to_owned(), guard.held().clone()));
        (&self.manager, fresh.chain(nested).collect())
    }

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
        type LostFuture<'a> = std::pin::Pin<Box<dyn Future<Output = LockError> + Send + 'a>>;
        let nested = futures_util::future::select_all(
            self.nested
                .iter()
                .map(|guard| Box::pin(guard.lost()) as LostFuture<'_>)
                .chain(std::iter::once(
                    Box::pin(std::future::pending()) as LostFuture<'_>
                )),
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
            self.manager.inner.on_runtime(move |backend| async move {
                backend.is_held(&lock, false, &token).await
            })
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
            self.manager.inner.on_runtime(move |backend| async move {
                backend.extend(&lock, false, &token, ttl).await
            })
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
    /// [`LockGuard::release`]; and as for it, if this future is dropped before Redis answers,
    /// the release is still sent, from the manager's background runtime.
    pub async fn release(mut self) -> Result<(), LockError> {
        self.span.releasing();
        self.renewals.clear();
        if !self.unlist() {
            return Err(LockError::ShutDown);
        }
        // A lock re-entered by a nested hold taken inside the set stays with that hold: its
        // last release gives the lock back.
        let (request, fresh) = self.last_holds();
        let mut outcome = Ok(());
        if !fresh.is_empty() {
            let giving = Giving {
                inner: &self.manager.inner,
                given: self.given(request),
                lease: self.lease.clone(),
            };
            let mut unanswered = Unanswered::armed(&giving);
            // An error here leaves it armed: it is sent again from the background.
            outcome = self.send(&giving, &fresh).await?;
            unanswered.answered();
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

    /// The part `request` of the set given back, its late attempts covered.
    fn given(&self, request: SetRequest) -> SetRelease {
        SetRelease {
            request,
            late_until: self.late_until,
        }
    }

    /// Gives back the locks of `giving` (named `fresh`) on the server: `Err` when it could
    /// not be sent from here.
    async fn send(
        &self,
        giving: &Giving<'_>,
        fresh: &[Keys],
    ) -> Result<Result<(), LockError>, LockError> {
        let inner = giving.inner;
        let (given, releaser) = (giving.given.clone(), inner.releaser());
        let known = Known::hold(giving.lease.clone());
        let outcome = inner
            .on_runtime(move |_| releaser.give_back(given, known))
            .await?;
        tracing::debug!(keys = ?self.names, held_for = ?self.acquired.sent.elapsed(), "released");
        Ok(match outcome {
            Outcome::Released => Ok(()),
            Outcome::Lost(at) => Err(LockError::Lost {
                key: fresh[at].name.clone(),
            }),
            Outcome::Unknown(error) => Err(LockError::redis(&fresh[0].name, error)),
        })
    }

    /// The part of the set whose last hold this guard is (every lock, unless code inside the
    /// set re-entered some and still holds them), counted off each lock's holds; each lock
    /// keeps the `min_hold` a hold nested in it asked for.
    fn last_holds(&self) -> (SetRequest, Vec<Keys>) {
        let mut request = SetRequest {
            keys: Vec::with_capacity(self.request.keys.len()),
            ..self.request.clone()
        };
        let mut fresh = Vec::with_capacity(self.fresh.len());
        for ((key, keys), held) in self.request.keys.iter().zip(&self.fresh).zip(&self.held) {
            if held.leave() {
                request.keys.push(SetKey {
                    keep: keep_from(held.keep_until()),
                    ..key.clone()
                });
                fresh.push(keys.clone());
            }
        }
        (request, fresh)
    }

    /// Takes the set off the manager's list: `true` when giving it back is up to the caller,
    /// `false` when shutdown (or an earlier release) already did.
    fn unlist(&mut self) -> bool {
        self.manager.inner.holds.unlist(&mut self.listing)
    }

    /// Whether [`LockManager::shutdown`] gave the set back.
    fn given_back_by_shutdown(&self) -> bool {
        self.manager.inner.holds.given_back(&self.listing)
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
        let shutdown = self.given_back_by_shutdown();
        let lost = self.lease.is_lost() && !shutdown;
        if !self.fresh.is_empty() {
            // A set of nested holds only is counted by those holds, under the set's label.
            crate::metrics::hold_ended(self.metrics, self.acquired.sent, lost);
        }
        self.span.end(shutdown, lost);
        self.renewals.clear();
        if self.unlist() && !self.fresh.is_empty() {
            let (request, fresh) = self.last_holds();
            if fresh.is_empty() {
                return;
            }
            // From the manager's own runtime, which outlives the caller's.
            let known = Known::hold(self.lease.clone());
            (self.manager.inner.releaser()).in_background(self.given(request), known);
        }
    }
}

/// The part of a set one release gives back (the locks whose last hold the set is), and the
/// manager it goes through.
struct Giving<'g> {
    inner: &'g Inner,
    given: SetRelease,
    lease: Arc<LeaseState>,
}

impl Resend for Giving<'_> {
    fn resend(&self) {
        // The release dropped may have landed.
        let known = Known {
            resent: true,
            ..Known::hold(self.lease.clone())
        };
        (self.inner.releaser()).in_background(self.given.clone(), known);
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
