//! A scheduled job run by three replicas of a service, at most once per period.
//!
//! Run it with `cargo run --example scheduled` (or `cargo run --example scheduled -- 10` for
//! ten periods). It uses the Redis at `REDIS_URL` if set; otherwise it starts a throwaway
//! `redis-server` (which must be on `PATH`).
//!
//! Every replica (one `LockManager` each, as if in three processes) wakes at every period,
//! a little off each other like real clocks, and calls the job. The first to get the lock
//! runs it; the others skip (`on_busy = "skip"`). `min_hold` keeps the key for most of the
//! period after the job ends, so a replica that wakes late cannot run it a second time.
//! A real deployment would use, say, a one-hour period with `min_hold = "55m"`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};

/// How often the job is due.
pub const PERIOD: Duration = Duration::from_secs(1);
const REPLICAS: [&str; 3] = ["replica-a", "replica-b", "replica-c"];

/// Which replica ran the job in which period (counted from 1).
pub type Runs = Arc<Mutex<Vec<(u32, &'static str)>>>;

/// The job. It takes a few milliseconds; the key stays for `min_hold` anyway.
#[distributed_lock(
    key = "nightly-report",
    ttl = "30s",
    min_hold = "800ms",
    on_busy = "skip",
    manager = locks
)]
async fn report(
    locks: &LockManager,
    replica: &'static str,
    period: u32,
    runs: &Runs,
) -> Result<(), LockError> {
    runs.lock().unwrap().push((period, replica));
    tokio::time::sleep(Duration::from_millis(20)).await; // the work
    Ok(())
}

/// Runs three replicas against the Redis at `url` for `periods` periods, keys under
/// `prefix`, and returns who ran the job in each period.
pub async fn run(url: &str, prefix: &str, periods: u32) -> Result<Runs, LockError> {
    let runs = Runs::default();
    // Each period starts at the same instant for every replica, plus its clock's skew.
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut replicas = tokio::task::JoinSet::new();
    for (n, replica) in (0u32..).zip(REPLICAS) {
        let locks = LockManager::builder()
            .redis_url(url)
            .key_prefix(prefix)
            .build()
            .await?;
        let runs = runs.clone();
        replicas.spawn(async move {
            for period in 1..=periods {
                // Wake-ups drift: a different replica is first each period.
                let skew = Duration::from_millis(u64::from((n + period) % 3) * 40);
                tokio::time::sleep_until(start + PERIOD * (period - 1) + skew).await;
                report(&locks, replica, period, &runs).await?;
            }
            Ok::<_, LockError>(())
        });
    }
    while let Some(done) = replicas.join_next().await {
        done.expect("a replica panicked")?;
    }
    Ok(runs)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let periods = match std::env::args().nth(1) {
        Some(n) => n.parse()?,
        None => 5,
    };
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = RedisServer::start()?;
            (server.url(), Some(server))
        }
    };
    println!(
        "{} replicas, a job due every {PERIOD:?}, {periods} periods\n",
        REPLICAS.len()
    );
    let runs = run(&url, "scheduled:lock:", periods).await?;
    let runs = runs.lock().unwrap();
    for period in 1..=periods {
        let ran: Vec<_> = runs.iter().filter(|(p, _)| *p == period).collect();
        match ran.as_slice() {
            [] => println!("period {period}: nobody ran it"),
            [(_, replica)] => println!("period {period}: {replica} ran it, the others skipped"),
            _ => return Err(format!("period {period} ran more than once: {ran:?}").into()),
        }
    }
    Ok(())
}
