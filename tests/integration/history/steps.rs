//! The steps programs are made of: the plans they draw, taking, working in and leaving a
//! hold, annotated calls, and a runtime dropped under its tasks.

use std::time::{Duration, Instant};

use distlock::{
    LockError, LockGuard, LockManager, LockRequest, MultiGuard, MultiLockRequest, distributed_lock,
};

use super::entries::Entry;
use super::model::{BOUND, Features, KEYS, Kind, OVERSTAY, OVERSTAY_FAULTS};
use super::world::World;

/// The request options a program picked.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) kind: Kind,
    pub(super) key: &'static str,
    pub(super) ttl: Duration,
    pub(super) wait: Option<Duration>,
    pub(super) fencing: bool,
    pub(super) watchdog: bool,
    pub(super) min_hold: Option<Duration>,
    pub(super) reentrant: bool,
    pub(super) fair: bool,
    /// A read request nested in this owner's write lock: a nested hold of the write lock.
    pub(super) downgrade: bool,
    /// The base of the fallback timer: long for some patient requests without faults, so
    /// that they depend on wake-ups (a missed one shows as a starved waiter).
    pub(super) retry_delay: Duration,
}

impl Plan {
    /// What the hold is: a downgrade is part of the owner's write lock.
    pub(super) fn held_as(&self) -> Kind {
        if self.downgrade {
            Kind::Write
        } else {
            self.kind
        }
    }

    pub(super) fn random(rng: &mut fastrand::Rng, features: Features) -> Self {
        let kind = if features.shared_kinds {
            [Kind::Exclusive, Kind::Read, Kind::Write, Kind::Permit][rng.usize(..4)]
        } else {
            Kind::Exclusive
        };
        let choices = if features.short_leases { 3 } else { 4 };
        let ttl = [150, 400, 2_000, 10_000][rng.usize(..choices)];
        let exclusive = matches!(kind, Kind::Exclusive | Kind::Write);
        let fencing = features.fencing && rng.u8(..4) == 0;
        let min_hold =
            (exclusive && rng.u8(..10) == 0).then(|| Duration::from_millis(rng.u64(1..40)));
        let fair = features.fair
            && kind == Kind::Exclusive
            && !fencing
            && min_hold.is_none()
            && rng.u8(..3) == 0;
        Self {
            kind,
            key: KEYS[rng.usize(..KEYS.len())],
            ttl: Duration::from_millis(ttl),
            // Some requests wait long: long enough to see a free lock left untaken.
            wait: rng.bool().then(|| match rng.u8(..5) {
                0 => Duration::from_millis(rng.u64(300..1_500)),
                _ => Duration::from_millis(rng.u64(1..300)),
            }),
            fencing,
            watchdog: rng.u8(..4) == 0,
            min_hold,
            reentrant: rng.bool(),
            fair,
            downgrade: false,
            retry_delay: Duration::from_millis(2),
        }
    }

    pub(super) fn request<'m>(&self, locks: &'m LockManager) -> LockRequest<'m> {
        let mut request = self
            .kind
            .request(locks, self.key)
            .ttl(self.ttl)
            .fencing(self.fencing)
            .watchdog(self.watchdog)
            .reentrant(self.reentrant)
            .fair(self.fair)
            .retry_delay(self.retry_delay);
        if let Some(wait) = self.wait {
            request = request.wait(wait);
        }
        if let Some(min_hold) = self.min_hold {
            request = request.min_hold(min_hold.min(self.ttl));
        }
        request
    }
}

/// The request options of a set a program picked.
#[derive(Debug, Clone)]
pub(super) struct SetPlan {
    /// 2–4 keys of the pool, as listed: now and then one is named twice (a set takes it once).
    pub(super) names: Vec<&'static str>,
    pub(super) ttl: Duration,
    pub(super) wait: Option<Duration>,
    pub(super) fencing: bool,
    pub(super) watchdog: bool,
    pub(super) reentrant: bool,
    pub(super) retry_delay: Duration,
}

impl SetPlan {
    pub(super) fn random(rng: &mut fastrand::Rng, features: Features, faults: bool) -> Self {
        let mut pool = KEYS;
        rng.shuffle(&mut pool);
        let mut names = pool[..rng.usize(2..=4)].to_vec();
        if rng.u8(..8) == 0 {
            names.push(names[rng.usize(..names.len())]);
            rng.shuffle(&mut names);
        }
        let choices = if features.short_leases { 3 } else { 4 };
        let ttl = [150, 400, 2_000, 10_000][rng.usize(..choices)];
        // A set needs every key free at once: most of them wait.
        let wait = (rng.u8(..4) != 0).then(|| match rng.u8(..5) {
            0 => Duration::from_millis(rng.u64(300..1_500)),
            _ => Duration::from_millis(rng.u64(1..300)),
        });
        // As for single locks: some patient sets depend on wake-ups (see `Plan`).
        let patient = !faults && wait.is_some_and(|wait| wait >= Duration::from_millis(300));
        Self {
            names,
            ttl: Duration::from_millis(ttl),
            wait,
            fencing: features.fencing && rng.u8(..4) == 0,
            watchdog: rng.u8(..4) == 0,
            reentrant: rng.bool(),
            retry_delay: Duration::from_millis(if patient { 300 } else { 2 }),
        }
    }

    /// The keys of the set, each once, in the order first named.
    pub(super) fn keys(&self) -> Vec<&'static str> {
        let mut keys = Vec::with_capacity(self.names.len());
        for name in &self.names {
            if !keys.contains(name) {
                keys.push(*name);
            }
        }
        keys
    }

    pub(super) fn request<'m>(&self, locks: &'m LockManager) -> MultiLockRequest<'m> {
        let mut request = locks
            .lock_all(self.names.iter().copied())
            .ttl(self.ttl)
            .fencing(self.fencing)
            .watchdog(self.watchdog)
            .reentrant(self.reentrant)
            .retry_delay(self.retry_delay);
        if let Some(wait) = self.wait {
            request = request.wait(wait);
        }
        request
    }
}

/// A hold the code runs inside: a set taken there re-enters its key (a nested hold of this
/// owner, not the set's).
#[derive(Debug, Clone)]
pub(super) struct Inside {
    pub(super) key: &'static str,
    pub(super) owner: String,
    pub(super) passes: u32,
    pub(super) kind: Kind,
}

impl Inside {
    /// A single hold of `key`, recorded as `kind`.
    pub(super) fn single(key: &'static str, kind: Kind, guard: &LockGuard) -> Self {
        Self {
            key,
            owner: guard.token().to_owned(),
            passes: guard.local_passes(),
            kind,
        }
    }

    /// `outer` and the keys of `set` that no hold of `outer` has: the holds inside both.
    pub(super) fn and_set(outer: &[Self], set: &MultiGuard, keys: &[&'static str]) -> Vec<Self> {
        let mut inside = outer.to_vec();
        for &key in keys {
            if inside.iter().all(|held| held.key != key) {
                inside.push(Self {
                    key,
                    owner: set.token().to_owned(),
                    passes: 0,
                    kind: Kind::Exclusive,
                });
            }
        }
        inside
    }
}

/// The errors a program may meet: anything else is a violation.
pub(super) fn expected(error: &LockError, _faults: bool) -> bool {
    match error {
        LockError::Busy { .. }
        | LockError::Lost { .. }
        | LockError::WouldDeadlock { .. }
        | LockError::Upgrade { .. } => true,
        // Redis failing to answer in time (faults, or a loaded machine) breaks no guarantee;
        // every call is still bounded by `BOUND`.
        LockError::Redis { .. } => true,
        _ => false,
    }
}

/// Takes `plan` by hand; on success the caller is inside.
pub(super) async fn take(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    faults: bool,
) -> Option<(LockGuard, Entry)> {
    let attempt = plan.request(locks);
    let asked = Instant::now();
    let result = if plan.wait.is_some() {
        let waiting = world.history.waits(&format!("{who} {plan:?}"), plan.key);
        let result = world.bounded("acquire", attempt.acquire()).await;
        drop(waiting);
        // The wait bounds the call: past it, only an attempt in flight (bounded by the
        // response timeout) may finish.
        let took = asked.elapsed();
        let overstay = if faults { OVERSTAY_FAULTS } else { OVERSTAY };
        if let Some(wait) = plan.wait
            && took > wait + overstay
        {
            world.history.violation(format!(
                "wait: {who}'s acquire of {} with a wait of {wait:?} took {took:?}",
                plan.key
            ));
        }
        result?.map(Some)
    } else {
        world.bounded("try_acquire", attempt.try_acquire()).await?
    };
    match result {
        Ok(Some(guard)) => {
            let entry = (world.history).enter(who, plan.key, plan.held_as(), &guard, asked);
            if plan.fair {
                entry.uncapped();
            }
            world
                .check_lease(locks, plan.key, plan.held_as(), &guard)
                .await;
            Some((guard, entry))
        }
        Ok(None) => None,
        Err(error) => {
            if !expected(&error, faults) {
                world
                    .history
                    .violation(format!("error: {who} {plan:?}: unexpected {error:?}"));
            }
            None
        }
    }
}

/// Leaves: the exit is recorded, then the guard released (or dropped, or its release
/// cancelled after a random time).
pub(super) async fn leave(
    world: &World,
    guard: LockGuard,
    entry: Entry,
    rng: &mut fastrand::Rng,
    faults: bool,
) {
    drop(entry);
    let owner = guard.token().to_owned();
    let answered = match rng.u8(..10) {
        0..=5 => match world.bounded("release", guard.release()).await {
            Some(Ok(())) => true,
            Some(Err(error)) => {
                if !expected(&error, faults) {
                    world
                        .history
                        .violation(format!("error: release: unexpected {error:?}"));
                }
                false
            }
            None => false,
        },
        6 | 7 => {
            drop(guard);
            false
        }
        _ => {
            let cancel_after = Duration::from_micros(rng.u64(0..2_000));
            matches!(
                tokio::time::timeout(cancel_after, guard.release()).await,
                Ok(Ok(()))
            )
        }
    };
    world.history.released(&owner, answered);
}

/// The critical section's work: a short random pause, refreshing the bound on the way.
pub(super) async fn work(guard: &LockGuard, entry: &Entry, rng: &mut fastrand::Rng) {
    for _ in 0..rng.u8(..3) {
        tokio::time::sleep(Duration::from_micros(rng.u64(0..3_000))).await;
        entry.refresh(guard);
    }
}

#[distributed_lock(key = "{key}", ttl = "2s", retries = 50, retry_delay = "2ms", wait = "300ms",
    reentrant, guard = guard, manager = locks)]
pub(super) async fn annotated(
    locks: &LockManager,
    world: &World,
    key: &'static str,
    depth: u32,
    asked: Instant,
) -> Result<(), LockError> {
    let _entry = (world.history).enter("annotated", key, Kind::Exclusive, guard, asked);
    world.check_lease(locks, key, Kind::Exclusive, guard).await;
    if depth > 0 {
        // Re-enters its own lock: a nested hold of the same owner.
        Box::pin(annotated(locks, world, key, depth - 1, asked)).await?;
    }
    tokio::task::yield_now().await;
    Ok(())
}

/// Builds a runtime, has its tasks take `plan` and hold it, and drops the runtime under them.
pub(super) async fn shut_down_a_runtime(
    world: &World,
    locks: &LockManager,
    who: &str,
    plan: Plan,
    faults: bool,
) {
    let (world, locks, who) = (world.clone(), locks.clone(), format!("{who}/runtime"));
    let dropped = tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (inside, entered) = std::sync::mpsc::channel();
        for _ in 0..2 {
            let (world, locks, who, inside) =
                (world.clone(), locks.clone(), who.clone(), inside.clone());
            runtime.spawn(async move {
                let held = take(&world, &locks, &who, plan, faults).await;
                let _ = inside.send(());
                if let Some((_guard, _entry)) = held {
                    std::future::pending::<()>().await;
                }
            });
        }
        // Both tasks have tried (and the winners hold) before the runtime goes.
        for _ in 0..2 {
            let _ = entered.recv_timeout(BOUND);
        }
        drop(runtime);
    });
    let _ = tokio::time::timeout(BOUND, dropped).await;
}
