//! The rows of held locks, waiters and managers on one server.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockGuard, LockManager};

use super::{
    PREFIX, TAKERS, info, left, lefts, manager, median, median_time, percentile, rss,
    subscriptions, used_memory,
};
use crate::harness;

impl Held {
    /// Each figure the median of `runs`; losses and late renewals the most of any run.
    pub(super) fn median_of(runs: &[Held]) -> Held {
        let late: Vec<Duration> = runs.iter().filter_map(|r| r.late_p99).collect();
        Held {
            take: median_time(runs, |r| r.take),
            client_per_hold: median(runs, |r| r.client_per_hold),
            server_per_hold: median(runs, |r| r.server_per_hold),
            renewed: median(runs, |r| r.renewed as f64) as u64,
            due: runs.iter().map(|r| r.due).max().unwrap_or(0),
            renewed_per_sec: median(runs, |r| r.renewed_per_sec),
            due_per_sec: median(runs, |r| r.due_per_sec),
            late_p99: (!late.is_empty()).then(|| median_time(&late, |d| *d)),
            late_renewals: runs.iter().map(|r| r.late_renewals).max().unwrap_or(0),
            lost: runs.iter().map(|r| r.lost).max().unwrap_or(0),
            server_cpu: median(runs, |r| r.server_cpu),
            give_back: median_time(runs, |r| r.give_back),
            left: lefts(runs.iter().map(|r| r.left.as_str())),
        }
    }
}

/// Takes keys `{name}0..n` with [`TAKERS`] tasks; the guards (in key order) and the time it
/// took.
async fn take_all(
    locks: &LockManager,
    n: usize,
    name: &str,
    ttl: Duration,
    watchdog: bool,
) -> (Vec<LockGuard>, Duration) {
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for t in 0..TAKERS.min(n) {
        let (locks, name) = (locks.clone(), name.to_owned());
        set.spawn(async move {
            let mut guards = Vec::with_capacity(n / TAKERS + 1);
            for i in (t..n).step_by(TAKERS) {
                let request = locks.lock(format!("{name}{i}")).ttl(ttl).watchdog(watchdog);
                guards.push((i, request.acquire().await.expect("take")));
            }
            guards
        });
    }
    let mut guards = Vec::with_capacity(n);
    while let Some(taken) = set.join_next().await {
        guards.extend(taken.expect("taker"));
    }
    let took = started.elapsed();
    // In key order: guard `i` holds key `i`.
    guards.sort_by_key(|&(i, _)| i);
    (guards.into_iter().map(|(_, guard)| guard).collect(), took)
}

/// Gives every guard back with [`TAKERS`] tasks; the time it took, and how many releases
/// answered that the lease had been lost.
async fn give_back_counting(guards: Vec<LockGuard>) -> (Duration, u64) {
    let started = Instant::now();
    let mut chunks: Vec<Vec<LockGuard>> = (0..TAKERS).map(|_| Vec::new()).collect();
    for (i, guard) in guards.into_iter().enumerate() {
        chunks[i % TAKERS].push(guard);
    }
    let mut set = tokio::task::JoinSet::new();
    for chunk in chunks {
        set.spawn(async move {
            let mut lost = 0;
            for guard in chunk {
                match guard.release().await {
                    Ok(()) => {}
                    Err(distlock::LockError::Lost { .. }) => lost += 1,
                    Err(error) => panic!("release: {error}"),
                }
            }
            lost
        });
    }
    let mut lost = 0;
    while let Some(n) = set.join_next().await {
        lost += n.expect("releaser");
    }
    (started.elapsed(), lost)
}

/// Server memory per bare `SET key token PX` of the same key and token lengths.
pub(super) async fn floor(server: &RedisServer, url: &str, n: usize) -> f64 {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let before = used_memory(server);
    let token = "0123456789abcdef0123456789abcdef";
    for start in (0..n).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..(start + 1000).min(n) {
            pipe.cmd("SET")
                .arg(format!("{PREFIX}{{f{i}}}"))
                .arg(token)
                .arg("PX")
                .arg(30_000)
                .ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
    }
    let per = (used_memory(server) - before) / n as f64;
    for start in (0..n).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..(start + 1000).min(n) {
            pipe.cmd("DEL").arg(format!("{PREFIX}{{f{i}}}")).ignore();
        }
        let () = pipe.query_async(&mut conn).await.unwrap();
    }
    per
}

/// What holding `n` locks cost.
pub(super) struct Held {
    pub(super) take: Duration,
    pub(super) client_per_hold: f64,
    pub(super) server_per_hold: f64,
    pub(super) renewed: u64,
    pub(super) due: u64,
    pub(super) renewed_per_sec: f64,
    pub(super) due_per_sec: f64,
    pub(super) late_p99: Option<Duration>,
    /// Renewals the watchdog itself reported late (`Stats::renewals_late`): each warned of.
    pub(super) late_renewals: u64,
    pub(super) lost: u64,
    pub(super) server_cpu: f64,
    pub(super) give_back: Duration,
    pub(super) left: String,
}

/// Takes `n` locks (with the watchdog if `watch` is some: the renewal rounds to hold them
/// for), holds them, gives them back.
pub(super) async fn held(
    server: &RedisServer,
    url: &str,
    n: usize,
    ttl: Duration,
    watch: Option<u32>,
) -> Held {
    let locks = manager(url).await;
    let (memory, resident) = (used_memory(server), rss());
    let (guards, take) = take_all(&locks, n, "h", ttl, watch.is_some()).await;
    let client_per_hold = rss().saturating_sub(resident) as f64 / n as f64;
    let server_per_hold = (used_memory(server) - memory) / n as f64;
    let mut row = Held {
        take,
        client_per_hold,
        server_per_hold,
        renewed: 0,
        due: 0,
        renewed_per_sec: 0.0,
        due_per_sec: 0.0,
        late_p99: None,
        late_renewals: 0,
        lost: 0,
        server_cpu: 0.0,
        give_back: Duration::ZERO,
        left: String::new(),
    };
    if let Some(rounds) = watch {
        // Every lease falls due `rounds` times within this window (each was taken less than
        // a quarter of an interval before it starts), and its renewal lands in it unless late.
        let interval = ttl / 3;
        let window = interval * rounds + interval / 4;
        let every = interval / 20;
        let before = locks.stats();
        let cpu = harness::server_cpu(server);
        let started = Instant::now();
        // Lateness is sampled on at most 10,000 leases, so that sampling costs little.
        let step = (n / 10_000).max(1);
        let sampled: Vec<&LockGuard> = guards.iter().step_by(step).collect();
        // The lease left right after a renewal (or the take), and at the last sample.
        let mut last: Vec<Duration> = sampled.iter().map(|g| g.remaining()).collect();
        let mut fresh = last.iter().copied().max().unwrap_or_default();
        let mut lateness = Vec::new();
        while started.elapsed() < window {
            tokio::time::sleep(every).await;
            for (guard, last) in sampled.iter().zip(&mut last) {
                let now = guard.remaining();
                if now > *last + every {
                    fresh = fresh.max(now);
                    // Due when a third of the lease had passed; seen at most `every` later.
                    let due_at = fresh.saturating_sub(interval);
                    lateness.push(due_at.saturating_sub(*last) + every);
                }
                *last = now;
            }
        }
        let elapsed = started.elapsed().as_secs_f64();
        let after = locks.stats();
        row.server_cpu = (harness::server_cpu(server) - cpu).as_secs_f64() / elapsed;
        row.renewed = after.leases_renewed - before.leases_renewed;
        row.late_renewals = after.renewals_late - before.renewals_late;
        row.due = n as u64 * u64::from(rounds);
        row.renewed_per_sec = row.renewed as f64 / elapsed;
        row.due_per_sec = n as f64 / interval.as_secs_f64();
        // Found lost by a renewal, or past the local deadline without one.
        row.lost = after
            .leases_lost
            .max(guards.iter().filter(|g| g.is_lost()).count() as u64);
        lateness.sort();
        row.late_p99 = Some(percentile(&lateness, 0.99)).filter(|_| !lateness.is_empty());
    }
    let (took, lost) = give_back_counting(guards).await;
    row.give_back = took;
    row.lost = row.lost.max(lost);
    row.left = left(server).await;
    row
}

/// What `n` waiters on `n / 10` keys held by another manager cost.
pub(super) struct Waiting {
    pub(super) client_per_waiter: f64,
    pub(super) channels: usize,
    pub(super) subscribers: u64,
    pub(super) quiet_per_sec: f64,
    pub(super) quiet_per_key: f64,
    pub(super) entry_p50: Duration,
    pub(super) entry_p99: Duration,
    pub(super) drained: Duration,
    /// Waiters' releases that did not answer within the response timeout.
    pub(super) unanswered: u64,
    pub(super) left: String,
}

impl Waiting {
    /// Each figure the median of `runs`.
    pub(super) fn median_of(runs: &[Waiting]) -> Waiting {
        Waiting {
            client_per_waiter: median(runs, |r| r.client_per_waiter),
            channels: median(runs, |r| r.channels as f64) as usize,
            subscribers: median(runs, |r| r.subscribers as f64) as u64,
            quiet_per_sec: median(runs, |r| r.quiet_per_sec),
            quiet_per_key: median(runs, |r| r.quiet_per_key),
            entry_p50: median_time(runs, |r| r.entry_p50),
            entry_p99: median_time(runs, |r| r.entry_p99),
            drained: median_time(runs, |r| r.drained),
            unanswered: runs.iter().map(|r| r.unanswered).max().unwrap_or(0),
            left: lefts(runs.iter().map(|r| r.left.as_str())),
        }
    }
}

pub(super) async fn waiting(server: &RedisServer, url: &str, n: usize, quiet: Duration) -> Waiting {
    let keys = (n / 10).max(1);
    let holder = manager(url).await;
    let (held, _) = take_all(&holder, keys, "w", Duration::from_secs(60), false).await;
    let locks = manager(url).await;
    let resident = rss();
    // When each key's release began, and when its first waiter got in after it.
    let released: Arc<Vec<AtomicU64>> = Arc::new((0..keys).map(|_| AtomicU64::new(0)).collect());
    let entered: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; keys]));
    // Releases that did not answer in time (sent again in the background, as any is).
    let unanswered = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let (locks, entered, unanswered) = (locks.clone(), entered.clone(), unanswered.clone());
        set.spawn(async move {
            let key = i % keys;
            let request = locks
                .lock(format!("w{key}"))
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(600));
            let guard = request.acquire().await.expect("waiter");
            let now = Instant::now();
            entered.lock().unwrap()[key].get_or_insert(now);
            if guard.release().await.is_err() {
                unanswered.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while locks.stats().waiting_requests < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The looks right after joining, and the subscriptions, settle.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let client_per_waiter = rss().saturating_sub(resident) as f64 / n as f64;
    let (channels, subscribers) = subscriptions(server);
    let before = harness::Commands::read(server);
    let started = Instant::now();
    tokio::time::sleep(quiet).await;
    let commands = harness::Commands::read(server).since(&before).total() as f64;
    let quiet_per_sec = commands / started.elapsed().as_secs_f64();

    // Release-to-entry, one key at a time: the first keys (up to `SAMPLED`) are released one
    // after another, each once the previous one's first waiter got in; then the rest at once,
    // for the time it takes every waiter to get in and out.
    const SAMPLED: usize = 1_000;
    let epoch = Instant::now();
    let mut held = held.into_iter().enumerate();
    for (key, guard) in held.by_ref().take(SAMPLED) {
        released[key].store(epoch.elapsed().as_nanos() as u64, Ordering::Release);
        guard.release().await.expect("holder's release");
        let deadline = Instant::now() + Duration::from_secs(5);
        while entered.lock().unwrap()[key].is_none() && Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
    }
    release_all(held.map(|(_, guard)| guard)).await;
    while set.join_next().await.is_some() {}
    let drained = epoch.elapsed();
    let entered = entered.lock().unwrap().clone();
    let latencies = entry_latencies(&entered[..SAMPLED.min(keys)], &released, epoch);
    Waiting {
        client_per_waiter,
        channels,
        subscribers,
        quiet_per_sec,
        quiet_per_key: quiet_per_sec / keys as f64,
        entry_p50: percentile(&latencies, 0.5),
        entry_p99: percentile(&latencies, 0.99),
        drained,
        unanswered: unanswered.load(Ordering::Relaxed),
        left: left(server).await,
    }
}

/// From each key's release (nanoseconds after `epoch`) to its first waiter inside, sorted.
fn entry_latencies(
    entered: &[Option<Instant>],
    released: &[AtomicU64],
    epoch: Instant,
) -> Vec<Duration> {
    let mut latencies: Vec<Duration> = entered
        .iter()
        .zip(released)
        .filter_map(|(inside, released)| {
            let released = epoch + Duration::from_nanos(released.load(Ordering::Acquire));
            Some(inside.as_ref()?.saturating_duration_since(released))
        })
        .collect();
    latencies.sort();
    latencies
}

/// Releases `held` with [`TAKERS`] tasks, expecting each release to succeed.
async fn release_all(held: impl Iterator<Item = LockGuard>) {
    let mut chunks: Vec<Vec<LockGuard>> = (0..TAKERS).map(|_| Vec::new()).collect();
    for (i, guard) in held.enumerate() {
        chunks[i % TAKERS].push(guard);
    }
    let mut releasers = tokio::task::JoinSet::new();
    for chunk in chunks {
        releasers.spawn(async move {
            for guard in chunk {
                guard.release().await.expect("holder's release");
            }
        });
    }
    while releasers.join_next().await.is_some() {}
}

/// `m` managers whose tasks (two per key) take 1,000 keys in turn.
pub(super) struct Managers {
    pub(super) connections: f64,
    pub(super) channels: usize,
    pub(super) subscribers: u64,
    pub(super) entries_per_sec: f64,
    pub(super) memory_per_manager: f64,
    pub(super) left: String,
}

impl Managers {
    /// Each figure the median of `runs`.
    pub(super) fn median_of(runs: &[Managers]) -> Managers {
        Managers {
            connections: median(runs, |r| r.connections),
            channels: median(runs, |r| r.channels as f64) as usize,
            subscribers: median(runs, |r| r.subscribers as f64) as u64,
            entries_per_sec: median(runs, |r| r.entries_per_sec),
            memory_per_manager: median(runs, |r| r.memory_per_manager),
            left: lefts(runs.iter().map(|r| r.left.as_str())),
        }
    }
}

pub(super) async fn managers(server: &RedisServer, url: &str, m: usize, run: Duration) -> Managers {
    const KEYS: usize = 1_000;
    let clients = info(server, "clients", "connected_clients");
    let resident = rss();
    let mut all = Vec::new();
    for _ in 0..m {
        all.push(manager(url).await);
    }
    let memory_per_manager = rss().saturating_sub(resident) as f64 / m as f64;
    let stop = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..2 * KEYS {
        let (locks, stop, entries) = (all[t % m].clone(), stop.clone(), entries.clone());
        set.spawn(async move {
            let key = format!("m{}", t % KEYS);
            while !stop.load(Ordering::Relaxed) {
                let request = locks
                    .lock(key.as_str())
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(60));
                let guard = request.acquire().await.expect("manager row");
                entries.fetch_add(1, Ordering::Relaxed);
                guard.release().await.expect("manager row release");
            }
        });
    }
    tokio::time::sleep(run / 2).await;
    let connections = (info(server, "clients", "connected_clients") - clients) / m as f64;
    let (channels, subscribers) = subscriptions(server);
    let counted = entries.load(Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(run / 2).await;
    let entries_per_sec =
        (entries.load(Ordering::Relaxed) - counted) as f64 / started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    while set.join_next().await.is_some() {}
    for locks in &all {
        locks.shutdown().await;
    }
    drop(all);
    Managers {
        connections,
        channels,
        subscribers,
        entries_per_sec,
        memory_per_manager,
        left: left(server).await,
    }
}
