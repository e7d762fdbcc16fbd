//! Throughput and waiting, measured against a raw client in the same run.
//!
//! Run it with `cargo run --release --example bench` (add `-- --quick` for a short run,
//! `-- --reps 5` for medians of five runs of the uncontended rows, `-- --server valkey` or
//! `-- --server /path/to/valkey-server` to measure another server, `-- --scale` for what 1k,
//! 10k and 100k held locks, waiters and 1–32 managers cost, and what Cluster costs at 3 and 6
//! masters beside one server (`-- --scale-max 10000` to stop earlier, `-- --scale --cluster`
//! for the Cluster tables alone; see `bench/scale/`), or `-- --soak 1000000` to
//! check that a million cycles leave nothing behind, or `-- --only manual 1` to run one
//! uncontended workload — `raw`, `manual` or `annotated` — with that many tasks for the row's
//! time, alone, for a profiler such as `valgrind --tool=callgrind`; `-- --writes` for the
//! "writes under a held lock" table alone: a plain write beside a guarded one). It starts its own
//! `redis-server` (on
//! `PATH` unless `--server` or `DISTLOCK_REDIS_SERVER` names another) and prints one table.
//! The comparison with rslock lives in `bench/compare`, outside the workspace.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use distlock::LockManager;
use distlock::testing::RedisServer;

#[path = "../bench/harness.rs"]
mod harness;
#[path = "../bench/scale/mod.rs"]
mod scale;
#[path = "../bench/writes.rs"]
mod writes;

use harness::{Annotated, Commands, Fair, Manual, Raw, Server};

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
    if let Some(code) = harness::select_server(&args)? {
        std::process::exit(code);
    }
    if let Some(at) = args.iter().position(|a| a == "--soak") {
        let cycles = args
            .get(at + 1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(1_000_000);
        return soak(cycles).await;
    }
    let options = harness::Options::parse(&args, 1)?;
    if args.iter().any(|a| a == "--scale") {
        return scale::run(&args, options.quick).await;
    }
    let run = options.run;
    let server = RedisServer::start()?;
    let url = server.url();
    let manager = || async {
        LockManager::builder()
            .redis_url(&url)
            .key_prefix("bench:")
            .build()
            .await
    };
    let locks = manager().await?;
    let raw = Raw(redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?);
    if args.iter().any(|a| a == "--writes") {
        return writes::run(&server, &locks, &raw.0, run).await;
    }
    if let Some(at) = args.iter().position(|a| a == "--only") {
        let usage = "--only takes a workload and a number of tasks, such as `--only manual 1`";
        let workload = args.get(at + 1).ok_or(usage)?;
        let tasks: usize = args
            .get(at + 2)
            .and_then(|n| n.parse().ok())
            .filter(|&n| n > 0)
            .ok_or(usage)?;
        let rate = match workload.as_str() {
            "raw" => harness::uncontended(&raw, tasks, run).await.rate(),
            "manual" => harness::uncontended(&Manual(locks.clone()), tasks, run)
                .await
                .rate(),
            "annotated" => harness::uncontended(&Annotated(locks.clone()), tasks, run)
                .await
                .rate(),
            _ => return Err(usage.into()),
        };
        println!("{workload}, {tasks} tasks, {run:?}: {rate:.0} pairs/s");
        return Ok(());
    }
    let memory_before = used_memory(&server);

    println!(
        "distlock bench: {} on loopback, {run:?} per row{}\n",
        harness::server_version(&server),
        if options.reps > 1 {
            format!(", medians of {} reps", options.reps)
        } else {
            String::new()
        }
    );
    println!(
        "uncontended acquire+release pairs/s (distinct keys); server: the server's CPU time per \
         pair meanwhile (INFO cpu)"
    );
    println!(
        "{:>6}  {:>12} {:>12} {:>7} {:>12} {:>7}  {:>19}",
        "tasks", "raw", "manual", "ratio", "annotated", "ratio", "server raw / manual"
    );
    for tasks in [1, 16, 64] {
        let mut rows = Vec::new();
        for _ in 0..options.reps {
            // The server's CPU time and the pairs run meanwhile, for raw and manual: both from
            // the tasks' start to the last one's end.
            let mut spent = [(Duration::ZERO, 0u64); 2];
            let [raw_rate, manual, annotated] = harness::in_turns(run, async |workload, slice| {
                let before = harness::server_cpu(&server);
                let done = match workload {
                    0 => harness::uncontended(&raw, tasks, slice).await,
                    1 => harness::uncontended(&Manual(locks.clone()), tasks, slice).await,
                    _ => harness::uncontended(&Annotated(locks.clone()), tasks, slice).await,
                };
                if let Some((cpu, pairs)) = spent.get_mut(workload) {
                    *cpu += harness::server_cpu(&server).saturating_sub(before);
                    *pairs += done.pairs;
                }
                done.rate()
            })
            .await;
            let micros =
                |(cpu, pairs): (Duration, u64)| cpu.as_secs_f64() * 1e6 / pairs.max(1) as f64;
            rows.push([
                raw_rate,
                manual,
                annotated,
                micros(spent[0]),
                micros(spent[1]),
            ]);
        }
        let median = |f: &dyn Fn(&[f64; 5]) -> f64| harness::median(rows.iter().map(f).collect());
        println!(
            "{tasks:>6}  {:>12.0} {:>12.0} {:>6.2}x {:>12.0} {:>6.2}x  {:>6.1} / {:>4.1} µs",
            median(&|r| r[0]),
            median(&|r| r[1]),
            median(&|r| r[1] / r[0]),
            median(&|r| r[2]),
            median(&|r| r[2] / r[0]),
            median(&|r| r[3]),
            median(&|r| r[4]),
        );
    }

    let pairs = if options.quick { 200 } else { 2_000 };
    println!(
        "\ncommands the server runs per uncontended pair (INFO commandstats over {pairs} pairs, \
         those inside scripts included)"
    );
    let rows: [(&str, Commands); 3] = [
        (
            "raw",
            harness::commands_per_pair(&server, &raw, pairs).await,
        ),
        (
            "manual",
            harness::commands_per_pair(&server, &Manual(locks.clone()), pairs).await,
        ),
        (
            "annotated",
            harness::commands_per_pair(&server, &Annotated(locks.clone()), pairs).await,
        ),
    ];
    for (name, commands) in rows {
        println!(
            "{name:>10} {:>5}  {}",
            harness::short(commands.total() as f64 / pairs as f64),
            commands.per(pairs)
        );
    }

    writes::run(&server, &locks, &raw.0, run).await?;

    println!("\ncontended: one key");
    println!(
        "{:>6} {:>8} {:>6}  {:>10} {:>10} {:>10} {:>11} {:>11} {:>11} {:>10} {:>9}  share per manager",
        "tasks",
        "managers",
        "lock",
        "entries/s",
        "wait p50",
        "wait p99",
        "handoff p50",
        "handoff p99",
        "same holder",
        "cmds/entry",
        "overtook",
    );
    let mut breakdown = Vec::new();
    // "cohort": the manual API as it is (local passes within one manager); "server": the
    // same with `cohort(false)`, every hand-over through Redis; "fair": strict arrival order.
    let rows = [
        (16, 1, "cohort"),
        (64, 1, "cohort"),
        (63, 3, "cohort"),
        (1_000, 1, "cohort"),
        (64, 1, "server"),
        (63, 3, "server"),
        (1_000, 1, "server"),
        (64, 1, "fair"),
        (63, 3, "fair"),
        (1_000, 1, "fair"),
    ];
    for (tasks, managers, lock) in rows {
        // A thousand waiters need a few rounds of the whole queue to reach a steady state.
        let run = if tasks > 100 {
            run.max(Duration::from_secs(2))
        } else {
            run
        };
        let c = match lock {
            "fair" => {
                let mut groups = Vec::new();
                for _ in 0..managers {
                    groups.push(Fair(manager().await?));
                }
                harness::contended(&server, &groups, tasks, run).await
            }
            "server" => {
                let mut groups = Vec::new();
                for _ in 0..managers {
                    groups.push(Server(manager().await?));
                }
                harness::contended(&server, &groups, tasks, run).await
            }
            _ => {
                let mut groups = Vec::new();
                for _ in 0..managers {
                    groups.push(Manual(manager().await?));
                }
                harness::contended(&server, &groups, tasks, run).await
            }
        };
        println!(
            "{tasks:>6} {managers:>8} {lock:>6}  {:>10.0} {:>10.2?} {:>10.2?} {:>11.2?} {:>11.2?} {:>10.1}% {:>10.2} {:>8.1}%  {}",
            c.per_sec,
            c.wait_p50,
            c.wait_p99,
            c.handoff_p50,
            c.handoff_p99,
            c.same_holder * 100.0,
            c.commands_per_entry(),
            c.overtaking * 100.0,
            c.shares()
        );
        breakdown.push(format!(
            "{tasks:>6} x {managers} {lock}: {}",
            c.commands.per(c.entries)
        ));
    }
    println!("\ncommands per entry (each entry is one hand-off), by command");
    for line in breakdown {
        println!("{line}");
    }

    let (keys, channels) = harness::left_over(&server, "bench:*").await;
    println!(
        "\nafter all releases: {keys} lock keys left, {channels} subscribed channels left, \
         server memory {:+} bytes vs. start",
        used_memory(&server) as i64 - memory_before as i64
    );
    Ok(())
}
