//! `--scale`: what thousands of held locks, waiters and managers cost, on the client and on
//! the server, at 1k, 10k and 100k (`--scale-max N` caps it; `--quick` stops at 10k with
//! shorter windows). Included by `examples/bench.rs`.
//!
//! Client memory is the process's resident set (`VmRSS` in `/proc/self/status`) before and
//! after; server figures come from `INFO` (memory, cpu, clients, commandstats) and `PUBSUB`.
//! Renewal lateness is sampled from the guards' local lease (`remaining()`), which jumps up
//! when a renewal lands: the last sample before the jump, against the lease left when the
//! renewal was due, at a twentieth of the renewal interval (the figure is rounded up by that).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockGuard, LockManager};

use crate::harness;

/// Keys and channels of every row start with this.
const PREFIX: &str = "scale:";

/// Tasks that take (and give back) the held locks side by side.
const TAKERS: usize = 256;

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn info(server: &RedisServer, section: &str, field: &str) -> f64 {
    let info = server.command(&["INFO", section]).unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn used_memory(server: &RedisServer) -> f64 {
    info(server, "memory", "used_memory")
}

/// Channels under the prefix, and their subscribers in all (`PUBSUB NUMSUB`).
fn subscriptions(server: &RedisServer) -> (usize, u64) {
    let reply = server
        .command(&["PUBSUB", "CHANNELS", &format!("{PREFIX}*")])
        .unwrap_or_default();
    let channels: Vec<&str> = reply.lines().filter(|l| !l.is_empty()).collect();
    let mut subscribers = 0;
    for chunk in channels.chunks(1000) {
        let mut args = vec!["PUBSUB", "NUMSUB"];
        args.extend(chunk);
        let reply = server.command(&args).unwrap_or_default();
        subscribers += reply
            .lines()
            .skip(1)
            .step_by(2)
            .filter_map(|n| n.trim_start_matches(':').parse::<u64>().ok())
            .sum::<u64>();
    }
    (channels.len(), subscribers)
}

/// Keys and channels left under the prefix once background work has settled.
async fn left(server: &RedisServer) -> String {
    let (keys, channels) = harness::left_over(server, &format!("{PREFIX}*")).await;
    format!("{keys}/{channels}")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The median of `rows`' `field` (the middle one of an odd count, the lower middle of an even).
fn median<T>(rows: &[T], field: impl Fn(&T) -> f64) -> f64 {
    let mut values: Vec<f64> = rows.iter().map(field).collect();
    values.sort_by(f64::total_cmp);
    values
        .get(values.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0.0)
}

/// `median` of a duration field.
fn median_time<T>(rows: &[T], field: impl Fn(&T) -> Duration) -> Duration {
    Duration::from_secs_f64(median(rows, |row| field(row).as_secs_f64()))
}

/// What was left in Redis after each run, once each distinct answer.
fn lefts<'a>(all: impl Iterator<Item = &'a str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for left in all {
        if !seen.contains(&left) {
            seen.push(left);
        }
    }
    seen.join(",")
}

impl Held {
    /// Each figure the median of `runs`; losses and late renewals the most of any run.
    fn median_of(runs: &[Held]) -> Held {
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

async fn manager(url: &str) -> LockManager {
    LockManager::builder()
        .redis_url(url)
        .key_prefix(PREFIX)
        .build()
        .await
        .expect("manager")
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
async fn floor(server: &RedisServer, url: &str, n: usize) -> f64 {
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
struct Held {
    take: Duration,
    client_per_hold: f64,
    server_per_hold: f64,
    renewed: u64,
    due: u64,
    renewed_per_sec: f64,
    due_per_sec: f64,
    late_p99: Option<Duration>,
    /// Renewals the watchdog itself reported late (`Stats::renewals_late`): each warned of.
    late_renewals: u64,
    lost: u64,
    server_cpu: f64,
    give_back: Duration,
    left: String,
}

/// Takes `n` locks (with the watchdog if `watch` is some: the renewal rounds to hold them
/// for), holds them, gives them back.
async fn held(
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
struct Waiting {
    client_per_waiter: f64,
    channels: usize,
    subscribers: u64,
    quiet_per_sec: f64,
    quiet_per_key: f64,
    entry_p50: Duration,
    entry_p99: Duration,
    drained: Duration,
    /// Waiters' releases that did not answer within the response timeout.
    unanswered: u64,
    left: String,
}

impl Waiting {
    /// Each figure the median of `runs`.
    fn median_of(runs: &[Waiting]) -> Waiting {
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

async fn waiting(server: &RedisServer, url: &str, n: usize, quiet: Duration) -> Waiting {
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
    let mut chunks: Vec<Vec<(usize, LockGuard)>> = (0..TAKERS).map(|_| Vec::new()).collect();
    for (i, item) in held.enumerate() {
        chunks[i % TAKERS].push(item);
    }
    let mut releasers = tokio::task::JoinSet::new();
    for chunk in chunks {
        releasers.spawn(async move {
            for (_, guard) in chunk {
                guard.release().await.expect("holder's release");
            }
        });
    }
    while releasers.join_next().await.is_some() {}
    while set.join_next().await.is_some() {}
    let drained = epoch.elapsed();
    let entered = entered.lock().unwrap().clone();
    let mut latencies: Vec<Duration> = entered
        .iter()
        .zip(released.iter())
        .take(SAMPLED)
        .filter_map(|(inside, released)| {
            let released = epoch + Duration::from_nanos(released.load(Ordering::Acquire));
            Some(inside.as_ref()?.saturating_duration_since(released))
        })
        .collect();
    latencies.sort();
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

/// `m` managers whose tasks (two per key) take 1,000 keys in turn.
struct Managers {
    connections: f64,
    channels: usize,
    subscribers: u64,
    entries_per_sec: f64,
    memory_per_manager: f64,
    left: String,
}

impl Managers {
    /// Each figure the median of `runs`.
    fn median_of(runs: &[Managers]) -> Managers {
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

async fn managers(server: &RedisServer, url: &str, m: usize, run: Duration) -> Managers {
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

fn kib(bytes: f64) -> String {
    format!("{:.2} KiB", bytes / 1024.0)
}

fn thousands(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

/// The `--scale` run.
pub(crate) async fn run(args: &[String], quick: bool) -> Result<(), Box<dyn std::error::Error>> {
    let max = match args.iter().position(|a| a == "--scale-max") {
        Some(at) => args
            .get(at + 1)
            .and_then(|n| n.parse().ok())
            .ok_or("--scale-max needs a number, such as `--scale-max 10000`")?,
        None if quick => 10_000,
        None => 100_000,
    };
    // Each row is the median of this many runs (one with `--quick`).
    let runs: usize = match args.iter().position(|a| a == "--runs") {
        Some(at) => args
            .get(at + 1)
            .and_then(|n| n.parse().ok())
            .filter(|&n| n > 0)
            .ok_or("--runs needs a positive number, such as `--runs 3`")?,
        None if quick => 1,
        None => 3,
    };
    let sizes: Vec<usize> = [1_000, 10_000, 100_000]
        .into_iter()
        .filter(|&n| n <= max)
        .collect();
    // Renewal rounds held for, at ttl 30 s (10 s each) and 3 s (1 s each).
    let (rounds_30, rounds_3, quiet, run) = if quick {
        (1, 2, Duration::from_secs(2), Duration::from_secs(2))
    } else {
        (2, 6, Duration::from_secs(5), Duration::from_secs(4))
    };
    let server = RedisServer::start()?;
    let url = server.url();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "distlock scale: {} on loopback, {cores} cores shared by client and server{}; each row \
         the median of {runs} run{} (lost and late: the most of any run)\n",
        harness::server_version(&server),
        if quick { ", quick" } else { "" },
        if runs == 1 { "" } else { "s" }
    );

    println!(
        "held locks (one manager, {TAKERS} tasks taking them): with `watchdog`, held for \
         {rounds_30} renewal rounds at ttl 30 s, {rounds_3} at ttl 3 s (a round: a third of the \
         ttl); renewed/due: leases renewed in those rounds, of those due; late p99: of the \
         renewal interval, sampled at a twentieth of it (so at least 5%); warned: renewals the \
         watchdog sent with less than half of their lease left, which it logs a warning for"
    );
    println!(
        "{:>5} {:>5} {:>10} {:>6} {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>7} {:>8} {:>5}",
        "held",
        "ttl",
        "taken/s",
        "vs no",
        "client",
        "server",
        "floor",
        "renewed/due, per s",
        "late p99",
        "warned",
        "lost",
        "srv cpu",
        "give back",
        "left"
    );
    for &n in &sizes {
        let mut floors = Vec::new();
        let mut plains = Vec::new();
        for _ in 0..runs {
            floors.push(floor(&server, &url, n).await);
            plains.push(held(&server, &url, n, Duration::from_secs(30), None).await);
        }
        let bare = median(&floors, |f| *f);
        let plain = Held::median_of(&plains);
        let plain_rate = n as f64 / plain.take.as_secs_f64();
        println!(
            "{:>5} {:>5} {:>10.0} {:>6} {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>7} {:>8.2?} {:>5}",
            thousands(n),
            "no wd",
            plain_rate,
            "",
            kib(plain.client_per_hold),
            format!("{:.0} B", plain.server_per_hold),
            format!("{bare:.0} B"),
            "",
            "",
            "",
            "",
            "",
            plain.give_back,
            plain.left
        );
        for (ttl, rounds) in [(30, rounds_30), (3, rounds_3)] {
            let ttl = Duration::from_secs(ttl);
            let mut all = Vec::new();
            for _ in 0..runs {
                all.push(held(&server, &url, n, ttl, Some(rounds)).await);
            }
            let h = Held::median_of(&all);
            let rate = n as f64 / h.take.as_secs_f64();
            let interval = ttl / 3;
            println!(
                "{:>5} {:>5} {:>10.0} {:>5.2}x {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>6.1}% {:>8.2?} {:>5}",
                thousands(n),
                format!("{}s", ttl.as_secs()),
                rate,
                rate / plain_rate,
                kib(h.client_per_hold),
                format!("{:.0} B", h.server_per_hold),
                format!("{bare:.0} B"),
                format!(
                    "{}/{} {:.0}/{:.0}/s",
                    h.renewed, h.due, h.renewed_per_sec, h.due_per_sec
                ),
                h.late_p99.map_or("-".to_owned(), |late| format!(
                    "{:.1}%",
                    late.as_secs_f64() * 100.0 / interval.as_secs_f64()
                )),
                h.late_renewals,
                h.lost,
                h.server_cpu * 100.0,
                h.give_back,
                h.left
            );
        }
    }

    println!(
        "\nwaiters: N tasks of one manager waiting on N/10 keys another manager holds (ttl 60 s); \
         server commands over a quiet {quiet:?}; entry: from a release to its first waiter inside, \
         over the first 1,000 keys released one at a time; all in: until every waiter got in \
         and out"
    );
    println!(
        "{:>7} {:>6} {:>11} {:>9} {:>6} {:>9} {:>13} {:>10} {:>10} {:>9} {:>5}",
        "waiters",
        "keys",
        "client",
        "channels",
        "subs",
        "cmds/s",
        "per key /s",
        "entry p50",
        "entry p99",
        "all in",
        "left"
    );
    for &n in &sizes {
        let mut all = Vec::new();
        for _ in 0..runs {
            all.push(waiting(&server, &url, n, quiet).await);
        }
        let w = Waiting::median_of(&all);
        println!(
            "{:>7} {:>6} {:>11} {:>9} {:>6} {:>9.1} {:>13.4} {:>10.2?} {:>10.2?} {:>9.2?} {:>5}",
            thousands(n),
            thousands(n / 10),
            kib(w.client_per_waiter),
            w.channels,
            w.subscribers,
            w.quiet_per_sec,
            w.quiet_per_key,
            w.entry_p50,
            w.entry_p99,
            w.drained,
            w.left
        );
        if w.unanswered > 0 {
            println!(
                "        ({} of the waiters' releases did not answer within the response \
                 timeout, in the worst run: each was sent again in the background)",
                w.unanswered
            );
        }
    }

    println!(
        "\nmanagers (as processes would be) on 1,000 keys, two tasks per key, for {run:?}: \
         server connections and subscriptions mid-run"
    );
    println!(
        "{:>8} {:>14} {:>9} {:>6} {:>10} {:>12} {:>5}",
        "managers", "conns/manager", "channels", "subs", "entries/s", "memory/mgr", "left"
    );
    for m in [1, 8, 32] {
        let mut all = Vec::new();
        for _ in 0..runs {
            all.push(managers(&server, &url, m, run).await);
        }
        let r = Managers::median_of(&all);
        println!(
            "{m:>8} {:>14.2} {:>9} {:>6} {:>10.0} {:>12} {:>5}",
            r.connections,
            r.channels,
            r.subscribers,
            r.entries_per_sec,
            kib(r.memory_per_manager),
            r.left
        );
    }

    println!(
        "\ncluster: uncontended acquire+release pairs/s on distinct keys, 64 tasks, {run:?} each; \
         a single server beside 3 masters (redis-cli makes no cluster of fewer than 3). Client \
         and servers share the {cores} cores, which cap both."
    );
    let cluster = RedisServer::start_cluster(3)?;
    let seeds: Vec<String> = cluster.iter().map(RedisServer::url).collect();
    let on_cluster = LockManager::builder()
        .cluster(seeds)
        .key_prefix(PREFIX)
        .build()
        .await?;
    let single = manager(&url).await;
    let mut pairs = Vec::new();
    for _ in 0..runs {
        pairs.push(
            harness::in_turns(run, async |workload, slice| {
                let locks = if workload == 0 { &single } else { &on_cluster };
                harness::uncontended(&harness::Manual(locks.clone()), 64, slice)
                    .await
                    .rate()
            })
            .await,
        );
    }
    let (one, three) = (
        median(&pairs, |p: &[f64; 2]| p[0]),
        median(&pairs, |p: &[f64; 2]| p[1]),
    );
    let mut cluster_left = Vec::new();
    for master in &cluster {
        cluster_left.push(left(master).await);
    }
    println!(
        "{:>10} {:>10} {:>7}  left (server, each master)",
        "1 server", "3 masters", "ratio"
    );
    println!(
        "{one:>10.0} {three:>10.0} {:>6.2}x  {} | {}",
        three / one,
        left(&server).await,
        cluster_left.join(" ")
    );
    Ok(())
}
