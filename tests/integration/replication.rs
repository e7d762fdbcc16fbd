//! Replica acknowledgement: the crash-failover scenario that grants a lock twice.
//!
//! A replica stops receiving (frozen, its link cut), a client takes the lock on the master, the master
//! crashes, and the replica is promoted without the lock. Without `sync_replicas` a second
//! client is then granted the same lock; with it, the first grant is refused instead.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};

use crate::cluster::{ClusterView, keyslot};
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

/// The scenario above on a Cluster with a replica per master: the replica of the lock's
/// master stops receiving, the lock is taken, the master crashes and its replica takes over.
/// Returns the first grant and whether a second manager was granted the lock again.
async fn cluster_failover(sync: bool) -> (Result<(), LockError>, bool) {
    let nodes = RedisServer::start_cluster_with_replicas(3, 1).unwrap();
    let prefix = if sync { "crepl-sync:" } else { "crepl:" };
    let key = format!("{prefix}{{order:1}}");
    let slot = keyslot(&nodes[0], &key);
    // Each replica shows in CLUSTER NODES once the nodes have gossiped about it.
    let started = std::time::Instant::now();
    let (master_port, replica_port) = loop {
        let view = ClusterView::of(&nodes[0]);
        let owner = view.owner(slot);
        if let Some(replica) = view.nodes.iter().find(|n| n.master_id == owner.id) {
            break (owner.port, replica.port);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no replica");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let node = |port: u16| nodes.iter().find(|n| n.port() == port).unwrap();
    let (master, replica) = (node(master_port), node(replica_port));
    let mut builder = support::quick(support::cluster(&nodes), prefix);
    if sync {
        builder = builder.sync_replicas(1, Duration::from_millis(200));
    }
    let first = support::connect(builder).await;
    // Every lane is open before the trouble.
    drop(first.lock("warm").try_acquire().await.unwrap());

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
    assert_eq!(
        replica
            .command(&["CLUSTER", "FAILOVER", "TAKEOVER"])
            .unwrap(),
        "+OK"
    );
    let started = std::time::Instant::now();
    while !replica.command(&["ROLE"]).unwrap().starts_with("master") {
        assert!(started.elapsed() < Duration::from_secs(20), "no takeover");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let alive: Vec<&RedisServer> = nodes.iter().filter(|n| n.port() != master_port).collect();
    let second = support::connect(support::quick(support::cluster(&alive), prefix)).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_without_acknowledgement_a_failover_grants_twice() {
    let (first, second) = cluster_failover(false).await;
    assert!(first.is_ok(), "{first:?}");
    assert!(second, "the promoted replica never saw the first grant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_with_acknowledgement_the_unreplicated_grant_is_refused() {
    let (first, second) = cluster_failover(true).await;
    match first {
        Err(LockError::NotReplicated { acked, wanted, .. }) => {
            assert_eq!((acked, wanted), (0, 1));
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
    assert!(second, "the refused grant was given back: the lock is free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_with_live_replicas_grants_and_sets_are_acknowledged() {
    let nodes = RedisServer::start_cluster_with_replicas(3, 1).unwrap();
    let builder = support::quick(support::cluster(&nodes), "crepl-live:");
    let locks = support::connect(builder.sync_replicas(1, Duration::from_secs(2))).await;
    // Keys on several masters: each grant waits on its own master's replica.
    for i in 0..6 {
        let guard = locks.lock(format!("k{i}")).acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    let set = locks
        .lock_all(["a", "b", "c", "d"])
        .acquire()
        .await
        .unwrap();
    set.release().await.unwrap();
}

/// Whether the server the kit starts has `WAITAOF` (Redis 7.2+, Valkey 8+).
fn has_waitaof(server: &RedisServer) -> bool {
    let info = server.command(&["COMMAND", "INFO", "WAITAOF"]).unwrap();
    // The command's own name comes back where it exists.
    info.to_ascii_lowercase().contains("waitaof")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waitaof_acknowledges_where_the_server_has_it_and_is_refused_where_not() {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::start_replica_of(&master).unwrap();
    replica
        .command(&["CONFIG", "SET", "appendonly", "yes"])
        .unwrap();
    let built = support::quick(support::single(master.url()), "aof:")
        .sync_replicas(1, Duration::from_secs(2))
        .sync_replicas_aof(true)
        .build()
        .await;
    if !has_waitaof(&master) {
        let error = built.expect_err("a server without WAITAOF is refused at build()");
        assert!(error.to_string().contains("WAITAOF"), "{error}");
        return;
    }
    let locks = built.unwrap();
    let guard = locks.lock("k").acquire().await.unwrap();
    let on_replica = replica.command(&["EXISTS", &locks.redis_key("k")]).unwrap();
    assert_eq!(on_replica, ":1", "acknowledged, so present on the replica");
    guard.release().await.unwrap();
}
