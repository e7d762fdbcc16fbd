//! Sentinel: the manager finds the master through the Sentinels and follows a failover.

use std::time::{Duration, Instant};

use distlock::LockError;
use distlock::testing::RedisServer;

use crate::support;

const MASTER: &str = "locks";

#[tokio::test]
async fn the_manager_follows_a_failover() {
    let group = support::SentinelGroup::start(MASTER);
    let (master, replica) = (&group.master, &group.replica);
    group.wait_until_ready();

    let locks = group
        .builder()
        .key_prefix("sentinel:")
        .response_timeout(Duration::from_millis(300))
        .connect_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    locks
        .lock("before")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    master.kill().unwrap();
    let killed = Instant::now();
    let mut failures = 0;
    let guard = loop {
        match locks
            .lock("after")
            .ttl(Duration::from_secs(30))
            .try_acquire()
            .await
        {
            Ok(Some(guard)) => break guard,
            Ok(None) => panic!("nobody else holds `after`"),
            Err(LockError::Redis { .. }) => failures += 1,
            Err(other) => panic!("{other}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no new master after {failures} attempts"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let recovered = killed.elapsed();
    assert!(failures > 0, "the old master was really gone");
    // The grant is on the promoted replica, the only server left that accepts writes.
    let on_new_master = replica
        .command(&["EXISTS", &locks.redis_key("after")])
        .unwrap();
    assert_eq!(on_new_master, ":1");
    assert!(replica.command(&["ROLE"]).unwrap().starts_with("master"));
    guard.release().await.unwrap();
    // The Sentinels notice the death and elect within a few seconds; on a busy machine, where
    // they share the cores with the suite, allow twice that.
    assert!(
        recovered < Duration::from_secs(10),
        "acquisitions worked again after {recovered:?}"
    );
}

#[tokio::test]
async fn an_unknown_master_name_is_a_configuration_error() {
    let master = RedisServer::start().unwrap();
    let sentinel = RedisServer::start_sentinel(&master, MASTER, 1).unwrap();
    let outcome = support::sentinel(&[&sentinel], "no-such-master")
        .connect_timeout(Duration::from_millis(300))
        .build()
        .await;
    match outcome {
        Err(LockError::Config(message)) => assert!(message.contains("no-such-master"), "{message}"),
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

/// The exclusion checker across two managers while the master is killed and a replica takes
/// over: nobody is ever inside with another holder, and every entry gets done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_through_a_failover() {
    let group = support::SentinelGroup::start(MASTER);
    group.wait_until_ready();
    let mut managers = Vec::new();
    for _ in 0..2 {
        let locks = group
            .builder()
            .key_prefix("sx:")
            .response_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap();
        managers.push(locks);
    }
    let halfway = std::sync::Arc::new(tokio::sync::Notify::new());
    let run = support::contend(&managers, 4, 10, true, Some(halfway.clone()));
    let kill = async {
        halfway.notified().await;
        group.master.kill().unwrap();
    };
    let (run, ()) = tokio::join!(run, kill);
    assert_eq!(run.entries, 80);
}
