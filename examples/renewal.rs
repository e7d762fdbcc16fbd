//! Measures what the watchdog costs: holds 1,000 leases with `watchdog` for a few seconds
//! and prints how many renewal round trips reached Redis.
//!
//! Run it with `cargo run --release --example renewal`. It uses the Redis at `REDIS_URL` if
//! set; otherwise it starts a throwaway `redis-server` (which must be on `PATH`).

use std::time::{Duration, Instant};

use distlock::LockManager;
use distlock::testing::RedisServer;

const LEASES: usize = 1_000;
const TTL: Duration = Duration::from_secs(3);
const HOLD: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => {
            let server = RedisServer::start()?;
            (server.url(), Some(server))
        }
    };
    let locks = LockManager::builder()
        .redis_url(&url)
        .key_prefix("renewal-bench:")
        .build()
        .await?;

    let taking = Instant::now();
    let mut guards = Vec::with_capacity(LEASES);
    for i in 0..LEASES {
        guards.push(
            locks
                .lock(format!("lease:{i}"))
                .ttl(TTL)
                .watchdog(true)
                .acquire()
                .await?,
        );
    }
    let taken_in = taking.elapsed();

    let before = locks.stats();
    tokio::time::sleep(HOLD).await;
    let after = locks.stats();
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    for guard in guards {
        guard.release().await?;
    }

    let trips = after.renewal_round_trips - before.renewal_round_trips;
    let renewed = after.leases_renewed - before.leases_renewed;
    let ticks = HOLD.as_secs_f64() / (TTL.as_secs_f64() / 3.0);
    println!(
        "{LEASES} leases, ttl {TTL:?}, watchdog on, held {HOLD:?} (taken in {taken_in:.0?})\n"
    );
    println!(
        "{:<34} {:>10}",
        "renewal intervals (ttl/3)",
        format!("{ticks:.1}")
    );
    println!("{:<34} {:>10}", "renewal round trips", trips);
    println!("{:<34} {:>10}", "leases renewed", renewed);
    println!(
        "{:<34} {:>10.1}",
        "round trips per interval",
        trips as f64 / ticks
    );
    println!(
        "{:<34} {:>10.1}",
        "leases renewed per round trip",
        renewed as f64 / trips.max(1) as f64
    );
    println!("{:<34} {:>10}", "leases lost", lost);
    Ok(())
}
