//! Redis Cluster: locks on keys spread over every master, with their companion keys in the
//! lock's own hash slot (never CROSSSLOT), renewal batched per slot, and exclusion held.

use std::sync::Arc;
use std::time::Duration;

use distlock::testing::RedisServer;

use crate::support;

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
    let locks = support::cluster_manager(&nodes, "c:").await;
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
        let held = node.command(&["KEYS", "c:*"]).unwrap();
        assert!(!held.trim().is_empty(), "a master holds none of 120 locks");
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
    let locks = support::cluster_manager(&nodes, "w:").await;
    // Long enough that a renewal a third of the way in is on time on a busy machine too.
    let ttl = Duration::from_millis(1_500);
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
    // Five renewals of each lease, however long the machine takes to make them.
    let within = tokio::time::Instant::now() + Duration::from_secs(30);
    while locks.stats().leases_renewed < 30 * 5 {
        assert!(tokio::time::Instant::now() < within, "renewals stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(guards.iter().all(|g| !g.is_lost()), "every lease renewed");
    for guard in guards {
        assert!(guard.is_held().await.unwrap());
        guard.release().await.unwrap();
    }
    assert!(keys(&nodes, "w:").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let mut managers = Vec::new();
    for _ in 0..3 {
        managers.push(support::cluster_manager(&nodes, "x:").await);
    }
    let run = support::contend(&managers, 5, 10, true, None).await;
    assert_eq!(run.entries, 150);
    assert!(run.fences.windows(2).all(|w| w[0] < w[1]));
    assert!(keys(&nodes, "x:").iter().all(|k| k.ends_with(":fence")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_during_a_contended_run() {
    let nodes = RedisServer::start_cluster_with_replicas(3, 1).unwrap();
    // Each replica shows in CLUSTER NODES once the nodes have gossiped about it.
    let started = std::time::Instant::now();
    let replica_port = loop {
        let view = ClusterView::of(&nodes[0]);
        let owner = view.owner(keyslot(&nodes[0], "f:{hot}"));
        if let Some(replica) = view.nodes.iter().find(|n| n.master_id == owner.id) {
            break replica.port;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the master has a replica"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let replica = nodes.iter().find(|n| n.port() == replica_port).unwrap();
    let managers = vec![
        support::cluster_manager(&nodes, "f:").await,
        support::cluster_manager(&nodes, "f:").await,
    ];
    let halfway = Arc::new(tokio::sync::Notify::new());
    let run = support::contend(&managers, 4, 60, true, Some(halfway.clone()));
    let fail_over = async {
        halfway.notified().await;
        assert_eq!(replica.command(&["CLUSTER", "FAILOVER"]).unwrap(), "+OK");
        // The replica takes over a moment later; the run goes on meanwhile.
        let started = std::time::Instant::now();
        while !replica.command(&["ROLE"]).unwrap().starts_with("master") {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the failover happened"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (run, ()) = tokio::join!(run, fail_over);
    assert_eq!(run.entries, 480);
    assert!(
        run.fences.windows(2).all(|w| w[0] < w[1]),
        "fencing tokens kept increasing"
    );
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
    let slot = keyslot(&nodes[0], "m:{hot}");
    let managers = vec![
        support::cluster_manager(&nodes, "m:").await,
        support::cluster_manager(&nodes, "m:").await,
    ];
    let halfway = Arc::new(tokio::sync::Notify::new());
    let run = support::contend(&managers, 4, 25, true, Some(halfway.clone()));
    let target = async {
        halfway.notified().await;
        let view = ClusterView::of(&nodes[0]);
        let owner = view.owner(slot);
        let target = view
            .nodes
            .iter()
            .find(|n| n.master && n.id != owner.id)
            .unwrap();
        migrate(
            &nodes,
            slot,
            (&owner.id, owner.port),
            (&target.id, target.port),
        );
        target.port
    };
    let (run, target) = tokio::join!(run, target);
    assert_eq!(run.entries, 200);
    assert!(run.fences.windows(2).all(|w| w[0] < w[1]));
    let target_node = nodes.iter().find(|n| n.port() == target).unwrap();
    let fence = target_node.command(&["GET", "m:{hot}:fence"]).unwrap();
    assert_eq!(
        fence, "200",
        "the fencing counter moved with the slot and counted every entry"
    );
}

/// The hash slot of `key`, asked of `node`.
pub(crate) fn keyslot(node: &RedisServer, key: &str) -> u16 {
    let reply = node.command(&["CLUSTER", "KEYSLOT", key]).unwrap();
    reply.trim_start_matches(':').parse().unwrap()
}

/// One line of `CLUSTER NODES`.
pub(crate) struct ClusterNode {
    pub(crate) id: String,
    pub(crate) port: u16,
    pub(crate) master: bool,
    pub(crate) master_id: String,
    pub(crate) slots: Vec<(u16, u16)>,
}

/// The cluster as one node sees it.
pub(crate) struct ClusterView {
    pub(crate) nodes: Vec<ClusterNode>,
}

impl ClusterView {
    pub(crate) fn of(node: &RedisServer) -> Self {
        let reply = node.command(&["CLUSTER", "NODES"]).unwrap();
        let nodes = reply
            .lines()
            .map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                let slots = f[8..]
                    .iter()
                    .filter_map(|range| {
                        let mut ends = range.split('-').map(|n| n.parse::<u16>().ok());
                        let first = ends.next()??;
                        Some((first, ends.next().flatten().unwrap_or(first)))
                    })
                    .collect();
                ClusterNode {
                    id: f[0].to_owned(),
                    port: f[1].split(['@', ':']).nth(1).unwrap().parse().unwrap(),
                    master: f[2].contains("master"),
                    master_id: f[3].to_owned(),
                    slots,
                }
            })
            .collect();
        Self { nodes }
    }

    pub(crate) fn owner(&self, slot: u16) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|n| n.master && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .expect("a master owns every slot")
    }
}

/// A release on the node that owns a lock wakes a waiter of another manager, subscribed (with
/// SSUBSCRIBE) on that node.
#[tokio::test]
async fn a_release_wakes_a_waiter_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let holder = support::cluster_manager(&nodes, "wk:").await;
    let waiter = support::cluster_manager(&nodes, "wk:").await;
    let day = Duration::from_secs(24 * 3600);
    let held = holder.lock("k").ttl(day).acquire().await.unwrap();
    let waiting =
        tokio::spawn(async move { waiter.lock("k").retry_delay(day).retries(5).acquire().await });
    // Subscribed (on the lock's own master) before the release.
    let started = std::time::Instant::now();
    while nodes.iter().all(|node| {
        node.command(&["PUBSUB", "SHARDNUMSUB", "wk:{k}:wake"])
            .unwrap()
            .ends_with(":0")
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter never subscribed"
        );
        tokio::task::yield_now().await;
    }
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release, not by a day-long timer")
        .unwrap()
        .unwrap();
    assert!(guard.attempts() >= 2);
    guard.release().await.unwrap();
}

/// `SET` commands the cluster's nodes have run, those inside scripts included.
fn sets(nodes: &[RedisServer]) -> u64 {
    nodes
        .iter()
        .filter_map(|node| {
            let info = node.command(&["INFO", "commandstats"]).unwrap();
            // No line before the node's first SET.
            let calls = info
                .lines()
                .find_map(|line| line.strip_prefix("cmdstat_set:calls="))?;
            calls.split(',').next()?.parse::<u64>().ok()
        })
        .sum()
}

/// A release hands a plain lock to a task of its own manager waiting for it, on whichever
/// master owns the key's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_a_local_waiter_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let locks = support::cluster_manager(&nodes, "ho:").await;
    let day = Duration::from_secs(24 * 3600);
    let names: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    for (handed, name) in names.iter().enumerate() {
        let held = locks.lock(name).ttl(day).acquire().await.unwrap();
        let sets_before = sets(&nodes);
        let waiting = tokio::spawn({
            let (locks, name) = (locks.clone(), name.clone());
            async move { locks.lock(name).retry_delay(day).retries(5).acquire().await }
        });
        // Ready once it has asked twice (when it queued, and again once subscribed, with its
        // offer withdrawn meanwhile) and offers to take the lock again: an offer seen before
        // the second ask may be withdrawn by the time the release looks for it.
        let started = std::time::Instant::now();
        while sets(&nodes) < sets_before + 2 || locks.stats().ready_for_handoff == 0 {
            assert!(started.elapsed() < Duration::from_secs(10), "never ready");
            tokio::task::yield_now().await;
        }
        held.release().await.unwrap();
        let guard = waiting.await.unwrap().unwrap();
        assert_eq!(locks.stats().local_handoffs, handed as u64 + 1);
        assert!(guard.is_held().await.unwrap());
        guard.release().await.unwrap();
    }
    assert!(keys(&nodes, "ho:").is_empty());
}

/// Waiters queued for the fair lock `name` under `prefix`, read on whichever node has them.
fn fair_queue(nodes: &[RedisServer], prefix: &str, name: &str) -> usize {
    let queue = format!("{prefix}{{{name}}}:queue");
    nodes
        .iter()
        .filter_map(|node| node.command(&["LLEN", &queue]).ok())
        .filter_map(|len| len.trim().trim_start_matches(':').parse().ok())
        .max()
        .unwrap_or(0)
}

/// A fair lock's queue lives in the lock's slot: waiters of two managers enter in arrival
/// order on every master, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_locks_keep_arrival_order_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let managers = [
        support::cluster_manager(&nodes, "fq:").await,
        support::cluster_manager(&nodes, "fq:").await,
    ];
    let day = Duration::from_secs(24 * 3600);
    for name in ["k0", "k1", "k2", "k3", "k4", "k5"] {
        let held = managers[0]
            .lock(name)
            .fair(true)
            .ttl(day)
            .acquire()
            .await
            .unwrap();
        let entered = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for n in 0..4 {
            let (locks, entered) = (managers[(n + 1) % 2].clone(), entered.clone());
            waiting.push(tokio::spawn(async move {
                let guard = locks
                    .lock(name)
                    .fair(true)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                entered.lock().unwrap().push(n);
                guard.release().await.unwrap();
            }));
            let started = std::time::Instant::now();
            while fair_queue(&nodes, "fq:", name) != n + 1 {
                assert!(started.elapsed() < Duration::from_secs(10), "never queued");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        held.release().await.unwrap();
        for task in waiting {
            task.await.unwrap();
        }
        assert_eq!(*entered.lock().unwrap(), vec![0, 1, 2, 3], "{name}");
    }
    assert!(keys(&nodes, "fq:").is_empty());
}
