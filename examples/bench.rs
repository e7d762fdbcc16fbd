//! Throughput and waiting, measured against a raw client in the same run.
//!
//! Run it with `cargo run --release --example bench` (add `-- --quick` for a short run, or
//! `-- --soak 1000000` to check that a million cycles leave nothing behind). It starts its own
//! `redis-server` (which must be on `PATH`) and prints one table.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use redis::Script;
use redis::aio::MultiplexedConnection;

/// The baseline: `SET NX PX` to take, a compare-and-delete script to give back.
static RAW_RELEASE: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
    )
});

#[derive(Clone, Copy)]
enum Kind {
    Raw,
    Manual,
    Annotated,
}

#[distributed_lock(key = "{key}", ttl = "10s", manager = locks)]
async fn annotated(locks: &LockManager, key: &str) -> Result<(), LockError> {
    let _ = key;
    Ok(())
}

async fn uncontended_loop(
    kind: Kind,
    locks: LockManager,
    mut raw: MultiplexedConnection,
    key: String,
    stop: Arc<AtomicBool>,
) -> u64 {
    let mut pairs = 0;
    let token = format!("{key}-token");
    while !stop.load(Ordering::Relaxed) {
        match kind {
            Kind::Raw => {
                let ok: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg(&token)
                    .arg("NX")
                    .arg("PX")
                    .arg(10_000)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                assert!(ok.is_some());
                let released: i64 = RAW_RELEASE
                    .key(&key)
                    .arg(&token)
                    .invoke_async(&mut raw)
                    .await
                    .unwrap();
                assert_eq!(released, 1);
            }
            Kind::Manual => {
                let guard = locks
                    .lock(key.as_str())
                    .ttl(Duration::from_secs(10))
                    .acquire()
                    .await
                    .unwrap();
                guard.release().await.unwrap();
            }
            Kind::Annotated => annotated(&locks, &key).await.unwrap(),
        }
        pairs += 1;
    }
    pairs
}

async fn uncontended(
    kind: Kind,
    locks: &LockManager,
    raw: &MultiplexedConnection,
    tasks: usize,
    run: Duration,
) -> f64 {
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        set.spawn(uncontended_loop(
            kind,
            locks.clone(),
            raw.clone(),
            format!("u:{t}"),
            stop.clone(),
        ));
    }
    let started = Instant::now();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let mut pairs = 0;
    while let Some(n) = set.join_next().await {
        pairs += n.unwrap();
    }
    pairs as f64 / started.elapsed().as_secs_f64()
}

struct Contended {
    per_sec: f64,
    wait_p50: Duration,
    wait_p99: Duration,
    handoff_p50: Duration,
    handoff_p99: Duration,
    same_holder: f64,
    commands_per_acquisition: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Commands sent by clients (scripts count once; the commands they run inside are not
/// round trips).
fn total_calls(server: &RedisServer) -> u64 {
    const CLIENT_COMMANDS: [&str; 7] = [
        "cmdstat_evalsha:",
        "cmdstat_eval:",
        "cmdstat_subscribe:",
        "cmdstat_unsubscribe:",
        "cmdstat_ssubscribe:",
        "cmdstat_sunsubscribe:",
        "cmdstat_script|load:",
    ];
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter(|l| CLIENT_COMMANDS.iter().any(|c| l.starts_with(c)))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// `tasks` tasks spread over `managers` managers take one key in turn.
async fn contended(
    server: &RedisServer,
    url: &str,
    managers: usize,
    tasks: usize,
    run: Duration,
) -> Contended {
    let epoch = Instant::now();
    let last_holder = Arc::new(AtomicU64::new(u64::MAX));
    let release_started = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    let mut all = Vec::new();
    for _ in 0..managers {
        all.push(
            LockManager::builder()
                .redis_url(url)
                .key_prefix("bench:")
                .build()
                .await
                .unwrap(),
        );
    }
    let calls_before = total_calls(server);
    for t in 0..tasks {
        let locks = all[t % managers].clone();
        let (last_holder, release_started, stop) =
            (last_holder.clone(), release_started.clone(), stop.clone());
        set.spawn(async move {
            let (mut waits, mut handoffs, mut same, mut count) =
                (Vec::new(), Vec::new(), 0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                let asked = Instant::now();
                let guard = match locks
                    .lock("hot")
                    .ttl(Duration::from_secs(10))
                    .wait(Duration::from_secs(5))
                    .retry_delay(Duration::from_millis(1))
                    .acquire()
                    .await
                {
                    Ok(guard) => guard,
                    Err(LockError::Busy { .. }) => continue,
                    Err(e) => panic!("{e}"),
                };
                let inside = epoch.elapsed().as_nanos() as u64;
                waits.push(asked.elapsed());
                let released_at = release_started.load(Ordering::Acquire);
                if released_at > 0 {
                    handoffs.push(Duration::from_nanos(inside.saturating_sub(released_at)));
                }
                if last_holder.swap(t as u64, Ordering::AcqRel) == t as u64 {
                    same += 1;
                }
                count += 1;
                release_started.store(epoch.elapsed().as_nanos() as u64, Ordering::Release);
                guard.release().await.unwrap();
            }
            (waits, handoffs, same, count)
        });
    }
    let started = Instant::now();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let (mut waits, mut handoffs, mut same, mut count) = (Vec::new(), Vec::new(), 0, 0);
    while let Some(done) = set.join_next().await {
        let (w, h, s, c) = done.unwrap();
        waits.extend(w);
        handoffs.extend(h);
        same += s;
        count += c;
    }
    let elapsed = started.elapsed();
    let calls = total_calls(server) - calls_before;

    waits.sort();
    handoffs.sort();
    Contended {
        per_sec: count as f64 / elapsed.as_secs_f64(),
        wait_p50: percentile(&waits, 0.5),
        wait_p99: percentile(&waits, 0.99),
        handoff_p50: percentile(&handoffs, 0.5),
        handoff_p99: percentile(&handoffs, 0.99),
        same_holder: same as f64 / count.max(1) as f64,
        commands_per_acquisition: calls as f64 / count.max(1) as f64,
    }
}

fn used_memory(server: &RedisServer) -> u64 {
    let info = server.command(&["INFO", "memory"]).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// `--soak N`: N acquire/release cycles by 32 tasks on 4 keys across 2 managers, then what
/// is left: lock keys, subscriptions, local waiter entries and server memory.
async fn soak(cycles: u64) -> Result<(), Box<dyn std::error::Error>> {
    let server = RedisServer::start()?;
    let url = server.url();
    let memory_before = used_memory(&server);
    let mut managers = Vec::new();
    for _ in 0..2 {
        managers.push(
            LockManager::builder()
                .redis_url(&url)
                .key_prefix("soak:")
                .build()
                .await?,
        );
    }
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for t in 0..32u64 {
        let (locks, done) = (managers[(t % 2) as usize].clone(), done.clone());
        set.spawn(async move {
            while done.fetch_add(1, Ordering::Relaxed) < cycles {
                let key = format!("k{}", t % 4);
                let guard = locks
                    .lock(key)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                guard.release().await.unwrap();
            }
        });
    }
    while let Some(task) = set.join_next().await {
        task?;
    }
    let elapsed = started.elapsed();
    // Unsubscribing happens in the background right after the last waiter leaves.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let channels = server.command(&["PUBSUB", "CHANNELS", "*"])?;
    let keys = server.command(&["DBSIZE"])?;
    println!("{cycles} acquire/release cycles (32 tasks, 4 keys, 2 managers) in {elapsed:.1?}");
    println!("keys left in Redis: {}", keys.trim_start_matches(':'));
    println!(
        "subscribed channels left: {}",
        channels.lines().filter(|l| !l.is_empty()).count()
    );
    println!(
        "local waiter entries left: {}",
        managers
            .iter()
            .map(|m| m.stats().waiting_keys)
            .sum::<usize>()
    );
    println!(
        "server memory: {:+} bytes vs. start",
        used_memory(&server) as i64 - memory_before as i64
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--soak") {
        let cycles = args
            .get(at + 1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(1_000_000);
        return soak(cycles).await;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let run = if quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    };
    let server = RedisServer::start()?;
    let url = server.url();
    let locks = LockManager::builder()
        .redis_url(&url)
        .key_prefix("bench:")
        .build()
        .await?;
    let raw = redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?;
    let memory_before = used_memory(&server);

    println!("distlock bench: redis-server on loopback, {run:?} per row\n");
    println!("uncontended acquire+release pairs/s (distinct keys)");
    println!(
        "{:>6}  {:>12} {:>12} {:>7} {:>12} {:>7}",
        "tasks", "raw", "manual", "ratio", "annotated", "ratio"
    );
    for tasks in [1, 16, 64] {
        let raw_rate = uncontended(Kind::Raw, &locks, &raw, tasks, run).await;
        let manual = uncontended(Kind::Manual, &locks, &raw, tasks, run).await;
        let annotated = uncontended(Kind::Annotated, &locks, &raw, tasks, run).await;
        println!(
            "{tasks:>6}  {raw_rate:>12.0} {manual:>12.0} {:>6.2}x {annotated:>12.0} {:>6.2}x",
            manual / raw_rate,
            annotated / raw_rate
        );
    }

    println!("\ncontended: one key");
    println!(
        "{:>6} {:>8}  {:>10} {:>10} {:>10} {:>11} {:>11} {:>11} {:>9}",
        "tasks",
        "managers",
        "entries/s",
        "wait p50",
        "wait p99",
        "handoff p50",
        "handoff p99",
        "same holder",
        "cmds/acq"
    );
    for (tasks, managers) in [(16, 1), (64, 1), (16, 3), (64, 3)] {
        let c = contended(&server, &url, managers, tasks, run).await;
        println!(
            "{tasks:>6} {managers:>8}  {:>10.0} {:>10.2?} {:>10.2?} {:>11.2?} {:>11.2?} {:>10.1}% {:>9.2}",
            c.per_sec,
            c.wait_p50,
            c.wait_p99,
            c.handoff_p50,
            c.handoff_p99,
            c.same_holder * 100.0,
            c.commands_per_acquisition
        );
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("bench:*")
        .query_async(&mut raw.clone())
        .await?;
    println!(
        "\nafter all releases: {} lock keys left, server memory {:+} bytes vs. start",
        keys.len(),
        used_memory(&server) as i64 - memory_before as i64
    );
    Ok(())
}
