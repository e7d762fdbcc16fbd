//! Redis Cluster: locks on keys spread over every master, with their companion keys in the
//! lock's own hash slot (never CROSSSLOT), renewal batched per slot, and exclusion held.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

async fn cluster(nodes: &[RedisServer], prefix: &str) -> LockManager {
    LockManager::builder()
        .cluster(nodes.iter().map(RedisServer::url))
        .key_prefix(prefix)
        .build()
        .await
        .unwrap()
}

/// Keys under `prefix` on every node.
fn keys(nodes: &[RedisServer], prefix: &str) -> Vec<String> {
    nodes
        .iter()
        .flat_map(|n| {
            let reply = n.command(&["KEYS", &format!("{prefix}*")]).unwrap();
            reply
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_across_slots_and_masters() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let locks = cluster(&nodes, "c:").await;
    // Scripts forgotten everywhere (as after restarts): each node gets them again on NOSCRIPT.
    for node in &nodes {
        assert_eq!(node.command(&["SCRIPT", "FLUSH"]).unwrap(), "+OK");
    }

    let mut guards = Vec::new();
    for i in 0..120 {
        let guard = locks
            .lock(format!("order:{i}"))
            .fencing(true)
            .acquire()
            .await
            .unwrap();
        assert!(guard.fencing_token().unwrap() >= 1);
        guards.push(guard);
    }
    // Spread over every master.
    for node in &nodes {
        let held = node.command(&["DBSIZE"]).unwrap();
        assert_ne!(held, ":0", "a master holds none of 120 locks");
    }
    // Shared kinds and reentrancy run their scripts in the lock's slot too.
    let read = locks.read_lock("doc").acquire().await.unwrap();
    let permit = locks.semaphore("pool", 2).acquire().await.unwrap();
    read.release().await.unwrap();
    permit.release().await.unwrap();
    distlock::scope(async {
        let outer = locks
            .lock("nested")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        let inner = locks
            .lock("nested")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        inner.release().await.unwrap();
        outer.release().await.unwrap();
    })
    .await;

    for guard in guards {
        guard.release().await.unwrap();
    }
    let left = keys(&nodes, "c:");
    assert!(left.iter().all(|k| k.ends_with(":fence")), "{left:?}");
    assert_eq!(left.len(), 120, "one fencing counter per key, nothing else");
}

#[tokio::test]
async fn leases_are_renewed_slot_by_slot() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let locks = cluster(&nodes, "w:").await;
    let ttl = Duration::from_millis(400);
    let mut guards = Vec::new();
    for i in 0..30 {
        guards.push(
            locks
                .lock(format!("job:{i}"))
                .ttl(ttl)
                .watchdog(true)
                .acquire()
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(ttl * 4).await;
    assert!(guards.iter().all(|g| !g.is_lost()), "every lease renewed");
    assert!(locks.stats().leases_renewed >= 30 * 5);
    for guard in guards {
        assert!(guard.is_held().await.unwrap());
        guard.release().await.unwrap();
    }
    assert!(keys(&nodes, "w:").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let locks = cluster(&nodes, "x:").await;
        for _ in 0..5 {
            let (locks, inside, entries) = (locks.clone(), inside.clone(), entries.clone());
            tasks.spawn(async move {
                for _ in 0..10 {
                    let guard = locks
                        .lock("hot")
                        .wait(Duration::from_secs(30))
                        .retry_delay(Duration::from_millis(2))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    entries.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(entries.load(Ordering::SeqCst), 150);
    assert!(keys(&nodes, "x:").is_empty());
}

/// The port of the replica of the master that owns `key`'s slot, asked of `node`.
fn replica_of_owner(node: &RedisServer, key: &str) -> u16 {
    let slot: u16 = node
        .command(&["CLUSTER", "KEYSLOT", key])
        .unwrap()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    let nodes = node.command(&["CLUSTER", "NODES"]).unwrap();
    let lines: Vec<Vec<&str>> = nodes.lines().map(|l| l.split(' ').collect()).collect();
    let owner = lines
        .iter()
        .find(|f| {
            f[2].contains("master")
                && f[8..].iter().any(|range| {
                    let mut ends = range
                        .split('-')
                        .map(|n| n.parse::<u16>().unwrap_or(u16::MAX));
                    let first = ends.next().unwrap_or(u16::MAX);
                    let last = ends.next().unwrap_or(first);
                    (first..=last).contains(&slot)
                })
        })
        .expect("a master owns every slot");
    let replica = lines
        .iter()
        .find(|f| f[3] == owner[0])
        .expect("the owner has a replica");
    replica[1]
        .split(['@', ':'])
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

/// A `CLUSTER FAILOVER` of the master that owns a contended key, in the middle of the run:
/// no two holders inside at once, every entry done, and fencing tokens still increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_during_a_contended_run() {
    let nodes = RedisServer::start_cluster_with_replicas(3, 1).unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU32::new(0));
    let fences = Arc::new(std::sync::Mutex::new(Vec::new()));
    let halfway = Arc::new(tokio::sync::Notify::new());
    let redis_key = "f:{hot}";
    let replica_port = replica_of_owner(&nodes[0], redis_key);
    let replica = nodes.iter().find(|n| n.port() == replica_port).unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let locks = cluster(&nodes, "f:").await;
        for _ in 0..4 {
            let (locks, inside, entries, fences, halfway) = (
                locks.clone(),
                inside.clone(),
                entries.clone(),
                fences.clone(),
                halfway.clone(),
            );
            tasks.spawn(async move {
                for _ in 0..25 {
                    let guard = locks
                        .lock("hot")
                        .fencing(true)
                        .wait(Duration::from_secs(30))
                        .retry_delay(Duration::from_millis(5))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    fences.lock().unwrap().push(guard.fencing_token().unwrap());
                    if entries.fetch_add(1, Ordering::SeqCst) + 1 == 50 {
                        halfway.notify_one();
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    // A release that lands during the switch may fail; the lease then ends.
                    let _ = guard.release().await;
                }
            });
        }
    }
    halfway.notified().await;
    let reply = replica.command(&["CLUSTER", "FAILOVER"]).unwrap();
    assert_eq!(reply, "+OK");
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(entries.load(Ordering::SeqCst), 200);
    assert!(
        replica.command(&["ROLE"]).unwrap().starts_with("master"),
        "the failover happened"
    );
    let fences = fences.lock().unwrap();
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens kept increasing"
    );
}

/// The id and port of every master, from `node`'s view.
fn masters(node: &RedisServer) -> Vec<(String, u16)> {
    node.command(&["CLUSTER", "NODES"])
        .unwrap()
        .lines()
        .map(|l| l.split(' ').collect::<Vec<_>>())
        .filter(|f| f[2].contains("master"))
        .map(|f| {
            (
                f[0].to_owned(),
                f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap(),
            )
        })
        .collect()
}

/// Moves `slot` from the master at `from` to the one at `to`, key by key, as
/// `redis-cli --cluster reshard` does.
fn migrate(nodes: &[RedisServer], slot: u16, from: (&str, u16), to: (&str, u16)) {
    let node = |port: u16| nodes.iter().find(|n| n.port() == port).unwrap();
    let (source, target) = (node(from.1), node(to.1));
    let slot = slot.to_string();
    assert_eq!(
        target
            .command(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", from.0])
            .unwrap(),
        "+OK"
    );
    assert_eq!(
        source
            .command(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", to.0])
            .unwrap(),
        "+OK"
    );
    loop {
        let keys = source
            .command(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"])
            .unwrap();
        let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        if keys.is_empty() {
            break;
        }
        let port = to.1.to_string();
        let mut args = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
        args.extend(keys);
        let reply = source.command(&args).unwrap();
        assert!(reply == "+OK" || reply == "+NOKEY", "MIGRATE: {reply}");
    }
    for master in nodes {
        let _ = master.command(&["CLUSTER", "SETSLOT", &slot, "NODE", to.0]);
    }
}

/// The slot of a contended key moves to another master mid-run: no overlap, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_during_a_contended_run() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU32::new(0));
    let halfway = Arc::new(tokio::sync::Notify::new());
    let slot: u16 = nodes[0]
        .command(&["CLUSTER", "KEYSLOT", "m:{hot}"])
        .unwrap()
        .trim_start_matches(':')
        .parse()
        .unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let locks = cluster(&nodes, "m:").await;
        for _ in 0..4 {
            let (locks, inside, entries, halfway) = (
                locks.clone(),
                inside.clone(),
                entries.clone(),
                halfway.clone(),
            );
            tasks.spawn(async move {
                for _ in 0..25 {
                    let guard = locks
                        .lock("hot")
                        .fencing(true)
                        .wait(Duration::from_secs(30))
                        .retry_delay(Duration::from_millis(5))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    if entries.fetch_add(1, Ordering::SeqCst) + 1 == 50 {
                        halfway.notify_one();
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    let _ = guard.release().await;
                }
            });
        }
    }
    halfway.notified().await;
    let masters = masters(&nodes[0]);
    let owner_reply = nodes[0].command(&["CLUSTER", "NODES"]).unwrap();
    let owner = masters
        .iter()
        .find(|(id, _)| {
            owner_reply.lines().any(|l| {
                l.starts_with(id.as_str())
                    && l.split(' ').skip(8).any(|range| {
                        let mut ends = range
                            .split('-')
                            .map(|n| n.parse::<u16>().unwrap_or(u16::MAX));
                        let first = ends.next().unwrap_or(u16::MAX);
                        let last = ends.next().unwrap_or(first);
                        (first..=last).contains(&slot)
                    })
            })
        })
        .unwrap()
        .clone();
    let target = masters
        .iter()
        .find(|(id, _)| *id != owner.0)
        .unwrap()
        .clone();
    migrate(&nodes, slot, (&owner.0, owner.1), (&target.0, target.1));
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(entries.load(Ordering::SeqCst), 200);
    let target_node = nodes.iter().find(|n| n.port() == target.1).unwrap();
    let fence = target_node.command(&["GET", "m:{hot}:fence"]).unwrap();
    assert_eq!(
        fence, "200",
        "the fencing counter moved with the slot and counted every entry"
    );
}
