//! Workers in two "processes" (one `LockManager` each) move money between a few accounts in
//! both directions. Each transfer locks both accounts at once with `keys = [...]`, so
//! opposite transfers never deadlock, and the total of all balances never changes.
//!
//! Run it with `cargo run --example transfer`. It uses the Redis at `REDIS_URL` if set;
//! otherwise it starts a throwaway `redis-server` (which must be on `PATH`).

use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use redis::AsyncCommands;

const MANAGERS: usize = 2;
const WORKERS_PER_MANAGER: usize = 8;
const TRANSFERS_PER_WORKER: u64 = 25;
const ACCOUNTS: u64 = 4;
const OPENING_BALANCE: i64 = 1_000;

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

fn balance_key(account: u64) -> String {
    format!("transfer:balance:{account}")
}

/// Moves `amount` from one account to the other with plain GETs and SETs: safe only because
/// both accounts are locked for the whole read-modify-write.
#[distributed_lock(
    keys = ["account:{from}", "account:{to}"],
    ttl = "10s",
    wait = "30s",
    retry_delay = "2ms",
    manager = locks
)]
async fn transfer(
    locks: &LockManager,
    redis: &mut redis::aio::MultiplexedConnection,
    from: u64,
    to: u64,
    amount: i64,
) -> Result<(), AppError> {
    let (a, b): (i64, i64) = (
        redis.get(balance_key(from)).await?,
        redis.get(balance_key(to)).await?,
    );
    tokio::task::yield_now().await; // let other workers try to get in here
    let () = redis.set(balance_key(from), a - amount).await?;
    let () = redis.set(balance_key(to), b + amount).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = RedisServer::start()?;
            (server.url(), Some(server))
        }
    };
    let client = redis::Client::open(url.as_str())?;
    let mut admin = client.get_multiplexed_async_connection().await?;
    for account in 1..=ACCOUNTS {
        let () = admin.set(balance_key(account), OPENING_BALANCE).await?;
    }

    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..MANAGERS {
        let locks = LockManager::builder()
            .redis_url(&url)
            .key_prefix("transfer:lock:")
            .build()
            .await?;
        for worker in 0..WORKERS_PER_MANAGER as u64 {
            let locks = locks.clone();
            let mut redis = client.get_multiplexed_async_connection().await?;
            workers.spawn(async move {
                for n in 0..TRANSFERS_PER_WORKER {
                    // Every pair of accounts, in both directions.
                    let from = (worker + n) % ACCOUNTS + 1;
                    let to = (from + n % (ACCOUNTS - 1)) % ACCOUNTS + 1;
                    let amount = ((worker * 5 + n * 3) % 9 + 1) as i64;
                    transfer(&locks, &mut redis, from, to, amount).await?;
                }
                Ok::<_, AppError>(())
            });
        }
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let elapsed = started.elapsed();

    let transfers = MANAGERS as u64 * WORKERS_PER_MANAGER as u64 * TRANSFERS_PER_WORKER;
    println!(
        "{transfers} transfers between {ACCOUNTS} accounts by {MANAGERS} managers x \
         {WORKERS_PER_MANAGER} workers in {:?}\n",
        Duration::from_millis(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
    );
    let mut total = 0;
    for account in 1..=ACCOUNTS {
        let balance: i64 = admin.get(balance_key(account)).await?;
        total += balance;
        println!("account:{account:<4} {balance:>8}");
    }
    let expected = OPENING_BALANCE * ACCOUNTS as i64;
    println!("total        {total:>8}  (expected {expected})");
    let left: Vec<String> = admin.keys("transfer:lock:*").await?;
    println!("lock keys left in Redis: {}", left.len());
    if total != expected || !left.is_empty() {
        return Err("a transfer was lost or a lock was left behind".into());
    }
    Ok(())
}
