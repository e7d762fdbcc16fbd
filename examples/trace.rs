//! The spans of a request that waited, held and released, printed by `tracing-subscriber`'s
//! formatter. Run it with `cargo run --example trace`. It uses the Redis at `REDIS_URL` if
//! set, and otherwise starts a throwaway server.
//!
//! Any subscriber sees the same spans: `lock.acquire` (level `debug`) while a request asks,
//! and `lock.hold` (level `info`) from the grant to the release, a child of the caller's span
//! (here the annotated function's, from `#[tracing::instrument]`), with the fencing token it
//! wrote with and how it ended. With `tracing-opentelemetry` they become a trace's spans.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager, distributed_lock};
use tracing_subscriber::fmt::format::FmtSpan;

#[distributed_lock(key = "invoice:{id}", fencing, wait = "5s", manager = locks)]
#[tracing::instrument(skip(locks))]
async fn send_invoice(locks: &LockManager, id: u32) -> Result<(), LockError> {
    tokio::time::sleep(Duration::from_millis(20)).await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), LockError> {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_span_events(FmtSpan::CLOSE)
        .with_target(false)
        .without_time()
        .init();
    let (url, _server) = match std::env::var("REDIS_URL") {
        Ok(url) => (url, None),
        Err(_) => match RedisServer::start() {
            Ok(server) => (server.url(), Some(server)),
            Err(error) => {
                eprintln!("trace: cannot start a throwaway Redis server: {error}");
                std::process::exit(1);
            }
        },
    };
    let locks = LockManager::builder()
        .redis_url(url)
        .key_prefix("trace:")
        .build()
        .await?;
    // Another holder keeps the invoice for a moment: the request waits, then holds.
    let other = locks.lock("invoice:7").acquire().await?;
    let waiting = tokio::spawn({
        let locks = locks.clone();
        async move { send_invoice(&locks, 7).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    other.release().await?;
    waiting.await.expect("the request ran")?;
    locks.shutdown().await;
    Ok(())
}
