//! Shared by the integration tests: real `redis-server` processes and managers on them.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

/// The server shared by the tests of one binary that do not fault it.
pub fn shared_server() -> Arc<RedisServer> {
    RedisServer::shared().expect("redis-server must be installed to run the integration tests")
}

/// A fresh key prefix, so that tests sharing a server never see each other's keys.
pub fn unique_prefix(test: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("t{}:{test}:", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A manager on `server` under `prefix`, with short timeouts so faults show quickly.
pub async fn manager(server: &RedisServer, prefix: &str) -> LockManager {
    LockManager::builder()
        .redis_url(server.url())
        .key_prefix(prefix)
        .response_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("manager connects to the test server")
}

/// The keys under `prefix` that exist on `server`.
pub fn keys(server: &RedisServer, prefix: &str) -> Vec<String> {
    let reply = server
        .command(&["KEYS", &format!("{prefix}*")])
        .expect("KEYS");
    reply
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A raw connection for checks that must not go through distlock.
pub async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}
