//! Real faults: a server that is killed, frozen, restarted empty, or never there. Each test
//! owns its server, since it breaks it.

use std::time::Duration;

use distlock::testing::{Fault, FaultProxy, RedisServer};
use distlock::{LockError, LockManager};

use crate::support;
use crate::support::{keys, manager};

/// Far above every bound the library sets (500 ms response timeout in these tests): reaching
/// it means something hung.
const HANG: Duration = Duration::from_secs(10);

fn redis_error<T: std::fmt::Debug>(outcome: Result<T, LockError>) -> redis::RedisError {
    match outcome {
        Err(LockError::Redis { source, .. }) => source,
        other => panic!("expected a Redis error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_killed_server_is_an_error_and_the_manager_recovers_on_restart() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "kill:").await;
    let held = locks.lock("k").acquire().await.unwrap();

    server.kill().unwrap();
    let outcome = tokio::time::timeout(HANG, locks.lock("other").acquire())
        .await
        .expect("no hang");
    let error = redis_error(outcome);
    assert!(error.is_io_error() || error.is_timeout(), "{error}");
    let release = tokio::time::timeout(HANG, held.release())
        .await
        .expect("no hang");
    assert!(
        matches!(release, Err(LockError::Redis { .. })),
        "{release:?}"
    );

    server.restart().unwrap();
    let guard = tokio::time::timeout(
        HANG,
        locks
            .lock("k")
            .retries(20)
            .retry_delay(Duration::from_millis(20))
            .acquire(),
    )
    .await
    .expect("no hang")
    .expect("the manager reconnects to the restarted server");
    guard.release().await.unwrap();
}

/// On RESP3 the server's end of a connection is announced as it happens: a request made a
/// moment after a restart finds a new connection, not the dead one. (On RESP2 nothing tells
/// the client; its first request after the restart is the one that finds out.)
#[tokio::test]
async fn on_resp3_the_first_request_after_a_restart_succeeds() {
    let server = RedisServer::start().unwrap();
    let locks = LockManager::builder()
        .redis_url(format!("{}?protocol=resp3", server.url()))
        .key_prefix("resp3:")
        .response_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    locks
        .lock("k")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    server.restart().unwrap();
    // The scenario itself: the next request comes a little after the restart, not at the
    // same instant (the library exposes no event to wait for; the notice is internal).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let guard = tokio::time::timeout(HANG, locks.lock("k").retries(0).acquire())
        .await
        .expect("no hang")
        .expect("a new connection, not the one the restart ended");
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_frozen_server_times_out_and_is_used_again_once_thawed() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "pause:").await;
    server.pause().unwrap();
    let outcome = tokio::time::timeout(HANG, locks.lock("k").acquire())
        .await
        .expect("no hang");
    assert!(redis_error(outcome).is_timeout());
    server.resume().unwrap();
    // The request that timed out reaches the server on resume: a fresh owner token then
    // finds the key busy until the background release behind it has run.
    let guard = locks
        .lock("k")
        .wait(Duration::from_secs(5))
        .retry_delay(Duration::from_millis(5))
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();
    assert!(keys(&server, "pause:").is_empty());
}

#[tokio::test]
async fn a_server_restarted_empty_means_the_lease_is_lost() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "empty:").await;
    let guard = locks
        .lock("k")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    server.restart().unwrap();
    let held = locks
        .lock("probe")
        .retries(20)
        .retry_delay(Duration::from_millis(20))
        .acquire()
        .await;
    held.unwrap().release().await.unwrap();
    assert!(!guard.is_held().await.unwrap());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
}

/// Cancelling an acquire whose request is already on the wire must not leave the lock
/// behind: the release follows the acquire on the same connection.
#[tokio::test]
async fn cancelling_an_acquire_in_flight_leaves_no_lock() {
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "inflight:").await;
    server.pause().unwrap();
    let cancelled = tokio::time::timeout(
        Duration::from_millis(50),
        locks.lock("k").ttl(Duration::from_secs(60)).acquire(),
    )
    .await;
    assert!(cancelled.is_err(), "the frozen server cannot have answered");
    server.resume().unwrap();
    // Sent after the cancelled acquire and its release, so answered after both.
    let next = locks.lock("k").try_acquire().await.unwrap();
    next.expect("the cancelled acquire left no lock")
        .release()
        .await
        .unwrap();
    assert!(keys(&server, "inflight:").is_empty());
}

#[tokio::test]
async fn building_against_nothing_is_a_bounded_error() {
    let server = RedisServer::start().unwrap();
    let url = server.url();
    server.kill().unwrap();
    let outcome = tokio::time::timeout(
        HANG,
        LockManager::builder()
            .redis_url(&url)
            .connect_timeout(Duration::from_millis(200))
            .build(),
    )
    .await
    .expect("no hang");
    match outcome {
        Err(LockError::Config(message)) => assert!(message.contains(&url), "{message}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[tokio::test]
async fn credentials_never_appear_in_errors() {
    let server = RedisServer::start().unwrap();
    let url = format!("redis://:hunter2@127.0.0.1:{}", server.port());
    server.kill().unwrap();
    let error = LockManager::builder()
        .redis_url(url)
        .connect_timeout(Duration::from_millis(200))
        .build()
        .await
        .unwrap_err();
    let text = format!("{error} {error:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("***@127.0.0.1"), "{text}");
}

async fn through(proxy: &FaultProxy) -> LockManager {
    support::manager_at(proxy.url(), "proxy:").await
}

#[tokio::test]
async fn latency_blackhole_and_reset_on_the_network() {
    let server = RedisServer::start().unwrap();
    let proxy = FaultProxy::start(server.port()).unwrap();
    let locks = through(&proxy).await;

    proxy.set(Fault::Latency(Duration::from_millis(50)));
    let guard = locks
        .lock("k")
        .acquire()
        .await
        .expect("slow but within the response timeout");
    guard.release().await.unwrap();

    // The request may get through with its reply cut off: keep its lease short, since a lock
    // stranded by a partition is only freed by its lease.
    proxy.set(Fault::Blackhole);
    let blocked = locks.lock("k").ttl(Duration::from_millis(300)).acquire();
    let outcome = tokio::time::timeout(HANG, blocked).await.expect("no hang");
    assert!(redis_error(outcome).is_timeout());

    // Connections cut while partitioned: what was held back is never delivered.
    proxy.reset();
    proxy.set(Fault::Pass);
    let guard = tokio::time::timeout(
        HANG,
        locks
            .lock("k")
            .wait(Duration::from_secs(5))
            .retry_delay(Duration::from_millis(20))
            .acquire(),
    )
    .await
    .expect("no hang")
    .expect("works again over fresh connections");
    guard.release().await.unwrap();
}

/// One RedLock master behind a blackhole costs at most its per-node timeout (a tenth of the
/// lease), not the response timeout.
#[tokio::test]
async fn a_blackholed_redlock_master_costs_only_its_node_timeout() {
    let servers = support::redlock_masters(3);
    let proxy = FaultProxy::start(servers[2].port()).unwrap();
    let urls = [servers[0].url(), servers[1].url(), proxy.url()];
    let locks = LockManager::builder()
        .redlock(urls)
        .response_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    proxy.set(Fault::Blackhole);
    let ttl = Duration::from_secs(1);
    let started = std::time::Instant::now();
    let guard = locks
        .lock("k")
        .ttl(ttl)
        .acquire()
        .await
        .expect("a majority is reachable");
    let took = started.elapsed();
    assert!(
        took < ttl / 10 + Duration::from_millis(300),
        "took {took:?}"
    );
    assert!(guard.remaining() <= ttl - ttl / 100 - Duration::from_millis(2));
    proxy.set(Fault::Pass);
    guard.release().await.unwrap();
}
