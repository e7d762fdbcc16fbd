//! Sets beyond one server: on a Cluster, a set spans hash slots (one call per slot, given
//! back when a later slot is busy); on RedLock, a majority grants the whole set.

use std::time::Duration;

use distlock::LockError;
use distlock::testing::RedisServer;

use crate::support::{self, keys};

fn cluster_keys(nodes: &[RedisServer], prefix: &str) -> Vec<String> {
    let mut all: Vec<String> = nodes
        .iter()
        .flat_map(|n| {
            let reply = n.command(&["KEYS", &format!("{prefix}*")]).unwrap();
            reply
                .lines()
                .filter(|l| !l.is_empty() && !l.ends_with(":fence"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    all.sort();
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cluster_a_set_spans_slots_and_rolls_back_when_a_later_slot_is_busy() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let locks = support::cluster_manager(&nodes, "m:").await;
    let other = support::cluster_manager(&nodes, "m:").await;
    let names: Vec<String> = (0..8).map(|i| format!("account:{i}")).collect();
    let slot = |name: &str| -> u16 {
        let reply = nodes[0]
            .command(&["CLUSTER", "KEYSLOT", &locks.redis_key(name)])
            .unwrap();
        reply.trim_start_matches(':').parse().unwrap()
    };

    let set = locks
        .lock_all(&names)
        .fencing(true)
        .acquire()
        .await
        .unwrap();
    let held = cluster_keys(&nodes, "m:{");
    assert_eq!(held.len(), names.len(), "{held:?}");
    let masters = nodes
        .iter()
        .filter(|n| !n.command(&["KEYS", "m:{*"]).unwrap().trim().is_empty())
        .count();
    assert!(masters >= 2, "the set spans several masters");
    assert!(names.iter().all(|n| set.fencing_token(n) == Some(1)));
    set.release().await.unwrap();
    assert!(cluster_keys(&nodes, "m:{").is_empty());

    // The key in the highest slot is taken last: busy there, every group before it was
    // taken and must be given back.
    let last = names.iter().max_by_key(|n| slot(n)).unwrap().clone();
    let busy = other.lock(&last).acquire().await.unwrap();
    let reversed: Vec<String> = names.iter().rev().cloned().collect();
    assert!(
        locks
            .lock_all(&reversed)
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(cluster_keys(&nodes, "m:{"), vec![locks.redis_key(&last)]);
    busy.release().await.unwrap();

    // Two sets in opposite orders contend without deadlock.
    let mut tasks = tokio::task::JoinSet::new();
    for (t, order) in [names.clone(), reversed].into_iter().enumerate() {
        let locks = if t == 0 { locks.clone() } else { other.clone() };
        tasks.spawn(async move {
            for _ in 0..20 {
                let set = locks
                    .lock_all(&order)
                    .wait(Duration::from_secs(20))
                    .retry_delay(Duration::from_millis(2))
                    .acquire()
                    .await
                    .unwrap();
                set.release().await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(cluster_keys(&nodes, "m:{").is_empty());
}

#[tokio::test]
async fn on_redlock_a_majority_grants_the_whole_set() {
    let servers = support::redlock_masters(3);
    let (locks, other) = (
        support::redlock_manager(&servers, "rl:").await,
        support::redlock_manager(&servers, "rl:").await,
    );
    // One master holds a key of the set for someone else: the other two still grant it.
    let foreign = locks.redis_key("b");
    servers[0]
        .command(&["HSET", &foreign, "someone-else", "1"])
        .unwrap();
    servers[0].command(&["PEXPIRE", &foreign, "60000"]).unwrap();
    let set = locks.lock_all(["a", "b"]).acquire().await.unwrap();
    assert!(
        other
            .lock_all(["b", "a"])
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    assert!(other.lock("a").try_acquire().await.unwrap().is_none());
    set.release().await.unwrap();
    // The master that refused was left untouched; the others hold nothing.
    assert_eq!(keys(&servers[0], "rl:"), vec![foreign.clone()]);
    assert!(keys(&servers[1], "rl:").is_empty() && keys(&servers[2], "rl:").is_empty());

    // A majority busy: nothing is left anywhere.
    servers[1]
        .command(&["HSET", &foreign, "someone-else", "1"])
        .unwrap();
    assert!(
        locks
            .lock_all(["a", "b"])
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    for server in &servers {
        assert!(!keys(server, "rl:").contains(&locks.redis_key("a")));
    }
    let error = locks
        .lock_all(["a"])
        .fencing(true)
        .acquire()
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        LockError::InvalidInput {
            what: "fencing",
            ..
        }
    ));
}
