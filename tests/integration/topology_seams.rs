//! Where a lock meets its deployment: key names that carry braces on a Cluster, replica
//! acknowledgement, RedLock with a frozen or restarted master, and Sentinel behind a password.

use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

use crate::support;

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
    let locks = support::cluster_manager(&nodes, "br:").await;
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

/// Whether a client of `server` is blocked in `WAIT` right now.
fn blocked_in_wait(server: &RedisServer) -> bool {
    let clients = server.command(&["CLIENT", "LIST"]).unwrap();
    clients.lines().any(|client| {
        let flags = client.split(' ').find_map(|f| f.strip_prefix("flags="));
        let cmd = client.split(' ').find_map(|f| f.strip_prefix("cmd="));
        flags.is_some_and(|f| f.contains('b')) && cmd == Some("wait")
    })
}

/// While one acquire waits for a lagging replica, the manager's other requests go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_replica_blocks_no_other_request() {
    let master = RedisServer::start().unwrap();
    let replica = RedisServer::start_replica_of(&master).unwrap();
    let locks = LockManager::builder()
        .redis_url(master.url())
        .key_prefix("wait:")
        .response_timeout(Duration::from_millis(500))
        .sync_replicas(1, Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let held = locks.lock("a").acquire().await.unwrap();

    replica.pause().unwrap();
    let waiting = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("b").acquire().await })
    };
    let started = std::time::Instant::now();
    while !blocked_in_wait(&master) {
        assert!(!waiting.is_finished(), "{:?}", waiting.await);
        assert!(started.elapsed() < Duration::from_secs(10), "no WAIT sent");
        tokio::task::yield_now().await;
    }
    // Answered on the shared connection while the WAIT still blocks its own.
    assert!(held.is_held().await.unwrap());
    assert!(
        blocked_in_wait(&master),
        "the other request was answered only once WAIT returned"
    );

    // The replica catches up: the waiting grant is acknowledged.
    replica.resume().unwrap();
    let granted = waiting.await.unwrap().unwrap();
    granted.release().await.unwrap();
    held.release().await.unwrap();
}

/// A frozen master costs a RedLock lease nothing: renewals and the release count on the
/// others instead of waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redlock_master_neither_loses_a_lease_nor_holds_up_its_release() {
    let servers = support::redlock_masters(3);
    let response_timeout = Duration::from_secs(60);
    let locks = support::redlock(&servers)
        .key_prefix("fz:")
        .response_timeout(response_timeout)
        .build()
        .await
        .unwrap();
    servers[2].pause().unwrap();
    let ttl = Duration::from_millis(600);
    let guard = locks
        .lock("k")
        .ttl(ttl)
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    let extended = tokio::time::timeout(response_timeout / 2, guard.extend(ttl))
        .await
        .expect("extend waited for the frozen master");
    extended.unwrap();
    // Several leases long: renewed on the two live masters every time.
    tokio::time::sleep(ttl * 5).await;
    assert!(!guard.is_lost(), "the lease was reported lost");
    assert_eq!(locks.stats().leases_lost, 0);
    let released = tokio::time::timeout(response_timeout / 2, guard.release())
        .await
        .expect("the release waited for the frozen master");
    released.unwrap();
    for server in &servers[..2] {
        assert!(support::keys(server, "fz:").is_empty());
    }
    servers[2].resume().unwrap();
}

/// Behind a password, a Sentinel-managed master is reached with the Sentinel URL's
/// credentials, and the password shows nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_master_behind_a_password() {
    let password = "s3cret-pw";
    let master = RedisServer::start_with_password(password).unwrap();
    let sentinel = RedisServer::start_sentinel(&master, "pw-master", 1).unwrap();
    assert!(sentinel.url().contains(password));
    let locks = support::sentinel(&[&sentinel], "pw-master")
        .key_prefix("pw:")
        .build()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!format!("{locks:?}").contains(password));
    let guard = locks.lock("k").acquire().await.unwrap();
    assert_eq!(
        master.command(&["EXISTS", &locks.redis_key("k")]).unwrap(),
        ":1"
    );
    assert!(!format!("{guard:?}").contains(password));
    guard.release().await.unwrap();
    assert!(support::keys(&master, "pw:").is_empty());

    // The wrong password is refused, without being shown.
    let wrong = LockManager::builder()
        .sentinel(
            [sentinel.url().replace(password, "not-the-password")],
            "pw-master",
        )
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(!wrong.contains("not-the-password"), "{wrong}");
}
