//! distlock next to rslock 0.10 and a raw client, in one process and one run.
//!
//! Run it from `bench/compare` with `cargo run --release` (add `-- --quick` for a short run,
//! `-- --reps 10` for medians of ten runs, `-- --server valkey` or
//! `-- --server /path/to/valkey-server` to measure another server). It starts its own
//! servers: one for the single-server rows, three independent masters for RedLock.

use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

// Shared with `examples/bench.rs`, which uses all of it.
#[allow(dead_code)]
#[path = "../../harness.rs"]
mod harness;

use harness::{Annotated, Commands, Contend, Contended, Manual, Pair, Raw, Server, TTL};

/// rslock's `LockManager`: `lock(resource, ttl)` (three tries, up to 200 ms apart, its
/// defaults), then `unlock(&lock)`.
#[derive(Clone)]
struct Rslock(rslock::LockManager);

impl Pair for Rslock {
    // The raw baseline's keys are `u:…` on the same server.
    const KEYS: &'static str = "r";

    async fn pair(&mut self, key: &str) {
        let lock = self.0.lock(key, TTL).await.expect("rslock lock");
        self.0.unlock(&lock).await;
    }
}

impl Contend for Rslock {
    type Guard = rslock::Lock;

    async fn acquire(&mut self, key: &str) -> Option<rslock::Lock> {
        // `Unavailable` after its tries: ask again, as its own `acquire` loop does.
        self.0.lock(key, TTL).await.ok()
    }

    async fn release(&mut self, lock: rslock::Lock) {
        self.0.unlock(&lock).await;
    }
}

/// One repetition of the uncontended rows at one concurrency.
#[derive(Clone, Copy)]
struct Rates {
    raw: f64,
    manual: f64,
    annotated: f64,
    rslock: f64,
    redlock: f64,
    rslock_redlock: f64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(code) = harness::select_server(&args)? {
        std::process::exit(code);
    }
    let options = harness::Options::parse(&args, 3)?;
    let (run, reps) = (options.run, options.reps);

    let server = RedisServer::start()?;
    let url = server.url();
    let masters = [
        RedisServer::start()?,
        RedisServer::start()?,
        RedisServer::start()?,
    ];
    let master_urls: Vec<String> = masters.iter().map(RedisServer::url).collect();

    let manager = || async {
        LockManager::builder()
            .redis_url(&url)
            .key_prefix("bench:")
            .build()
            .await
    };
    let locks = manager().await?;
    let redlock = LockManager::builder()
        .redlock(master_urls.clone())
        .key_prefix("bench:")
        .build()
        .await?;
    let raw = Raw(redis::Client::open(url.as_str())?
        .get_multiplexed_async_connection()
        .await?);
    let rslock = Rslock(rslock::LockManager::new(vec![url.clone()]));
    let rslock_redlock = Rslock(rslock::LockManager::new(master_urls));

    println!(
        "distlock vs rslock 0.10: {} on loopback, {run:?} per row, {reps} rep{}\n",
        harness::server_version(&server),
        if reps == 1 { "" } else { "s" }
    );

    let concurrency = [1, 16, 64];
    let mut rates: Vec<Vec<Rates>> = vec![Vec::new(); concurrency.len()];
    for _ in 0..reps {
        for (i, &tasks) in concurrency.iter().enumerate() {
            let [raw, manual, annotated, rslock, redlock, rslock_redlock] =
                harness::in_turns(run, async |workload, slice| {
                    let done = match workload {
                        0 => harness::uncontended(&raw, tasks, slice).await,
                        1 => harness::uncontended(&Manual(locks.clone()), tasks, slice).await,
                        2 => harness::uncontended(&Annotated(locks.clone()), tasks, slice).await,
                        3 => harness::uncontended(&rslock, tasks, slice).await,
                        4 => harness::uncontended(&Manual(redlock.clone()), tasks, slice).await,
                        _ => harness::uncontended(&rslock_redlock, tasks, slice).await,
                    };
                    done.rate()
                })
                .await;
            rates[i].push(Rates {
                raw,
                manual,
                annotated,
                rslock,
                redlock,
                rslock_redlock,
            });
        }
    }
    let median =
        |reps: &[Rates], f: fn(&Rates) -> f64| harness::median(reps.iter().map(f).collect());

    println!("uncontended acquire+release pairs/s (distinct keys), medians");
    println!(
        "{:>6}  {:>9} {:>9} {:>9} {:>9}   {:>17} {:>15}",
        "tasks", "raw", "manual", "annotated", "rslock", "RedLock×3 distlock", "RedLock×3 rslock"
    );
    for (tasks, reps) in concurrency.iter().zip(&rates) {
        println!(
            "{tasks:>6}  {:>9.0} {:>9.0} {:>9.0} {:>9.0}   {:>18.0} {:>16.0}",
            median(reps, |r| r.raw),
            median(reps, |r| r.manual),
            median(reps, |r| r.annotated),
            median(reps, |r| r.rslock),
            median(reps, |r| r.redlock),
            median(reps, |r| r.rslock_redlock),
        );
    }

    println!("\nratios, medians of per-rep ratios (distlock = the manual API)");
    println!(
        "{:>6}  {:>13} {:>16} {:>17} {:>26}",
        "tasks", "distlock/raw", "distlock/rslock", "annotated/manual", "RedLock×3 distlock/rslock"
    );
    for (tasks, reps) in concurrency.iter().zip(&rates) {
        println!(
            "{tasks:>6}  {:>12.2}x {:>15.2}x {:>16.2}x {:>25.2}x",
            median(reps, |r| r.manual / r.raw),
            median(reps, |r| r.manual / r.rslock),
            median(reps, |r| r.annotated / r.manual),
            median(reps, |r| r.redlock / r.rslock_redlock),
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
            "distlock",
            harness::commands_per_pair(&server, &Manual(locks.clone()), pairs).await,
        ),
        (
            "rslock",
            harness::commands_per_pair(&server, &rslock, pairs).await,
        ),
    ];
    for (name, commands) in rows {
        println!(
            "{name:>10} {:>5}  {}",
            harness::short(commands.total() as f64 / pairs as f64),
            commands.per(pairs)
        );
    }

    println!("\ncontended: one key, one manager (process), medians");
    println!(
        "{:>6} {:>9}  {:>10} {:>10} {:>10} {:>11} {:>11} {:>10}",
        "tasks",
        "library",
        "entries/s",
        "wait p50",
        "wait p99",
        "handoff p50",
        "same holder",
        "cmds/entry"
    );
    let mut ratios = Vec::new();
    for tasks in [16, 64] {
        let (mut ours, mut server_path, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            ours.push(harness::contended(&server, &[Manual(manager().await?)], tasks, run).await);
            let path = [Server(manager().await?)];
            server_path.push(harness::contended(&server, &path, tasks, run).await);
            let rslock = Rslock(rslock::LockManager::new(vec![url.clone()]));
            theirs.push(harness::contended(&server, &[rslock], tasks, run).await);
        }
        for (name, rows) in [
            ("distlock", &ours),
            ("no cohort", &server_path),
            ("rslock", &theirs),
        ] {
            let med = |f: &dyn Fn(&Contended) -> f64| harness::median(rows.iter().map(f).collect());
            let ms = |f: fn(&Contended) -> Duration| {
                Duration::from_secs_f64(med(&|c| f(c).as_secs_f64()))
            };
            println!(
                "{tasks:>6} {name:>9}  {:>10.0} {:>10.2?} {:>10.2?} {:>11.2?} {:>10.1}% {:>10.2}",
                med(&|c| c.per_sec),
                ms(|c| c.wait_p50),
                ms(|c| c.wait_p99),
                ms(|c| c.handoff_p50),
                med(&|c| c.same_holder * 100.0),
                med(&Contended::commands_per_entry),
            );
        }
        let ratio = |a: &[Contended], b: &[Contended]| {
            harness::median(a.iter().zip(b).map(|(o, t)| o.per_sec / t.per_sec).collect())
        };
        ratios.push((tasks, ratio(&ours, &theirs), ratio(&ours, &server_path)));
    }
    for (tasks, rslock, server_path) in ratios {
        println!(
            "{tasks:>6} tasks: distlock / rslock critical sections per second {rslock:.2}x; \
             distlock / distlock without cohorts {server_path:.2}x"
        );
    }
    Ok(())
}
