//! Replica acknowledgement: the crash-failover scenario that grants a lock twice.
//!
//! A replica stops receiving (frozen, its link cut), a client takes the lock on the master, the master
//! crashes, and the replica is promoted without the lock. Without `sync_replicas` a second
//! client is then granted the same lock; with it, the first grant is refused instead.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};

use crate::support;

async fn manager(server: &RedisServer, sync: bool) -> LockManager {
    let mut builder = support::quick(support::single(server.url()), "repl:");
    if sync {
        builder = builder.sync_replicas(1, Duration::from_millis(200));
    }
    builder.build().await.unwrap()
}

/// Runs the scenario; returns whether the first client was granted the lock and whether the
/// second one was, on the promoted replica.
async fn failover(sync: bool) -> (Result<(), LockError>, bool) {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::start_replica_of(&master).unwrap();
    let first = manager(&master, sync).await;

    // Cut replication: freeze the replica, then have the master drop its link, so that
    // nothing written from now on reaches the replica (a frozen process alone would still
    // find the stream waiting in its socket buffer).
    replica.pause().unwrap();
    master
        .command(&["CLIENT", "KILL", "TYPE", "replica"])
        .unwrap();
    let granted = first
        .lock("order:1")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await;
    let first_grant = granted.map(std::mem::forget);
    master.kill().unwrap();
    replica.resume().unwrap();
    replica.promote().unwrap();

    let second = manager(&replica, false).await;
    let again = second
        .lock("order:1")
        .ttl(Duration::from_secs(60))
        .try_acquire()
        .await
        .unwrap();
    let second_grant = again.is_some();
    if let Some(guard) = again {
        guard.release().await.unwrap();
    }
    (first_grant, second_grant)
}

#[tokio::test]
async fn without_acknowledgement_a_failover_grants_twice() {
    let (first, second) = failover(false).await;
    assert!(first.is_ok());
    assert!(second, "the promoted replica never saw the first grant");
}

#[tokio::test]
async fn with_acknowledgement_the_unreplicated_grant_is_refused() {
    let (first, _) = failover(true).await;
    match first {
        Err(LockError::NotReplicated { acked, wanted, .. }) => {
            assert_eq!((acked, wanted), (0, 1));
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
}

#[tokio::test]
async fn with_a_live_replica_the_grant_is_acknowledged() {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::start_replica_of(&master).unwrap();
    let locks = manager(&master, true).await;
    let guard = locks.lock("k").acquire().await.unwrap();
    let on_replica = replica.command(&["EXISTS", &locks.redis_key("k")]).unwrap();
    assert_eq!(on_replica, ":1", "acknowledged, so present on the replica");
    guard.release().await.unwrap();
    let bad = LockManager::builder()
        .redis_url(master.url())
        .sync_replicas(0, Duration::from_millis(10))
        .build()
        .await;
    assert!(matches!(bad, Err(LockError::Config(_))));
}
