//! Several workers in three "processes" (one `LockManager` each) contend for a few keys
//! through an annotated function that does a read-modify-write in Redis.
//!
//! Run it with `cargo run --example quickstart`. It uses the Redis at `REDIS_URL` if set;
//! otherwise it starts a throwaway `redis-server` (which must be on `PATH`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use redis::AsyncCommands;

const MANAGERS: usize = 3;
const WORKERS_PER_MANAGER: usize = 8;
const CALLS_PER_WORKER: usize = 20;
const ACCOUNTS: u64 = 3;

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Redis(redis::RedisError),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        Self::Lock(error)
    }
}

impl From<redis::RedisError> for AppError {
    fn from(error: redis::RedisError) -> Self {
        Self::Redis(error)
    }
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lock(e) => write!(f, "{e}"),
            Self::Redis(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for AppError {}

/// Adds one to an account's balance with a GET and a SET: safe only under the lock.
/// Returns whether the call had to wait for another holder.
#[distributed_lock(
    key = "account:{account}",
    ttl = "10s",
    wait = "30s",
    retry_delay = "2ms",
    guard = lock,
    manager = locks
)]
async fn deposit(
    locks: &LockManager,
    redis: &mut redis::aio::MultiplexedConnection,
    account: u64,
) -> Result<bool, AppError> {
    let balance_key = format!("quickstart:balance:{account}");
    let balance: Option<u64> = redis.get(&balance_key).await?;
    tokio::task::yield_now().await; // let other workers try to get in here
    let () = redis.set(&balance_key, balance.unwrap_or(0) + 1).await?;
    Ok(lock.attempts() > 1)
}

#[derive(Default)]
struct Row {
    calls: u64,
    waited: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => match RedisServer::start() {
            Ok(server) => (server.url(), Some(server)),
            // One plain sentence that says what to install, not a `Debug` dump.
            Err(error) => {
                eprintln!("quickstart: cannot start a throwaway Redis server: {error}");
                std::process::exit(1);
            }
        },
    };
    let client = redis::Client::open(url.as_str())?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    for account in 1..=ACCOUNTS {
        let () = admin.del(format!("quickstart:balance:{account}")).await?;
    }

    let rows = Arc::new(Mutex::new(BTreeMap::<u64, Row>::new()));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..MANAGERS {
        let locks = LockManager::builder()
            .redis_url(&url)
            .key_prefix("quickstart:lock:")
            .build()
            .await?;
        for worker in 0..WORKERS_PER_MANAGER {
            let (locks, rows) = (locks.clone(), rows.clone());
            let mut redis = client.get_multiplexed_async_connection().await?;
            workers.spawn(async move {
                for call in 0..CALLS_PER_WORKER {
                    let account = (worker + call) as u64 % ACCOUNTS + 1;
                    let waited = deposit(&locks, &mut redis, account).await?;
                    let mut rows = rows.lock().unwrap();
                    let row = rows.entry(account).or_default();
                    row.calls += 1;
                    row.waited += u64::from(waited);
                }
                Ok::<_, AppError>(())
            });
        }
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let elapsed = started.elapsed();

    println!(
        "{MANAGERS} managers x {WORKERS_PER_MANAGER} workers x {CALLS_PER_WORKER} calls on {ACCOUNTS} keys in {:.0?}\n",
        round(elapsed)
    );
    println!(
        "{:<12} {:>6} {:>12} {:>8}  check",
        "key", "calls", "had to wait", "balance"
    );
    let rows = std::mem::take(&mut *rows.lock().unwrap());
    let mut all_exact = true;
    for (account, row) in &rows {
        let balance: u64 = admin.get(format!("quickstart:balance:{account}")).await?;
        let exact = balance == row.calls;
        all_exact &= exact;
        let check = if exact { "exact" } else { "LOST UPDATES" };
        println!(
            "{:<12} {:>6} {:>12} {:>8}  {check}",
            format!("account:{account}"),
            row.calls,
            row.waited,
            balance
        );
    }
    let left: Vec<String> = admin.keys("quickstart:lock:*").await?;
    println!("\nlock keys left in Redis: {}", left.len());
    if !all_exact || !left.is_empty() {
        return Err("mutual exclusion failed".into());
    }
    Ok(())
}

fn round(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
