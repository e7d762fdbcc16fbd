//! Where a lock meets its deployment: key names that carry braces on a Cluster, replica
//! acknowledgement, RedLock with a frozen or restarted master, and Sentinel behind a password.

mod support;

use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

/// Keys under `prefix` on every node of a cluster.
fn cluster_keys(nodes: &[RedisServer], prefix: &str) -> Vec<String> {
    nodes
        .iter()
        .flat_map(|node| support::keys(node, prefix))
        .collect()
}

/// Names from user data may open or close braces anywhere: every kind of lock still keeps its
/// keys in one slot (no CROSSSLOT) and releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_with_braces_stay_in_one_slot_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let locks = LockManager::builder()
        .cluster(nodes.iter().map(RedisServer::url))
        .key_prefix("br:")
        .build()
        .await
        .unwrap();
    let names = ["}x", "a}b{c", "{}", "}{", "{", "x}", "%7D}"];
    for name in names {
        let exclusive = locks
            .lock(format!("{name}:e"))
            .fencing(true)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("exclusive {name:?}: {e}"));
        assert!(exclusive.fencing_token().is_some_and(|f| f >= 1));
        assert!(exclusive.is_held().await.unwrap());
        exclusive.release().await.unwrap();

        let permit = locks
            .semaphore(format!("{name}:p"), 2)
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("permit {name:?}: {e}"));
        assert!(permit.is_held().await.unwrap());
        permit.release().await.unwrap();

        // A writer waits behind a reader: its intent key goes into the lock's slot too.
        let rw = format!("{name}:rw");
        let read = locks
            .read_lock(rw.clone())
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("read {name:?}: {e}"));
        let writer = {
            let (locks, rw) = (locks.clone(), rw.clone());
            tokio::spawn(async move {
                locks
                    .write_lock(rw)
                    .wait(Duration::from_secs(20))
                    .retry_delay(Duration::from_millis(5))
                    .acquire()
                    .await
            })
        };
        let intent = format!("{}:wi", locks.redis_key(&rw));
        let started = std::time::Instant::now();
        while !cluster_keys(&nodes, "br:").contains(&intent) {
            assert!(
                !writer.is_finished(),
                "the writer gave up: {:?}",
                writer.await
            );
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "no write intent {intent:?}"
            );
            tokio::task::yield_now().await;
        }
        read.release().await.unwrap();
        let write = writer
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("write {name:?}: {e}"));
        write.release().await.unwrap();
    }
    let mut left = cluster_keys(&nodes, "br:");
    left.sort();
    let mut fences: Vec<String> = names
        .iter()
        .map(|name| format!("{}:fence", locks.redis_key(&format!("{name}:e"))))
        .collect();
    fences.sort();
    assert_eq!(left, fences, "only the fencing counters are left");
}
