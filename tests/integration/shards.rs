//! A shard's trouble stays in its shard: with one Cluster master cut off (a real partition,
//! see `partitions.rs`) or frozen (SIGSTOP), leases, sets and waiters whose keys live on the
//! other masters carry on. Renewal batches span slots; each slot's answer decides its own
//! leases.

use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

use crate::partitions::network;
use crate::support;

/// The leases of the test: several renewals fit in each trouble window.
const LEASE: Duration = Duration::from_millis(1500);

/// How long the trouble lasts: past two whole leases, which only renewals can outlive.
const TROUBLE: Duration = Duration::from_millis(3500);

/// The slot ranges that `node` serves, from its own `CLUSTER NODES`.
fn ranges_of(node: &RedisServer) -> Vec<(u32, u32)> {
    let listing = node.command(&["CLUSTER", "NODES"]).unwrap();
    listing
        .lines()
        .find(|line| line.contains("myself"))
        .unwrap()
        .split_whitespace()
        .skip(8)
        .filter_map(|range| match range.split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
            None => range.parse().ok().map(|one| (one, one)),
        })
        .collect()
}

/// `count` lock names whose slots (the name is the hash tag) `node` serves.
fn names_on(node: &RedisServer, count: usize) -> Vec<String> {
    let ranges = ranges_of(node);
    (0..)
        .map(|n| format!("s{n}"))
        .filter(|name| {
            let slot: u32 = node
                .command(&["CLUSTER", "KEYSLOT", name])
                .unwrap()
                .trim_start_matches(':')
                .parse()
                .unwrap();
            ranges.iter().any(|&(a, b)| (a..=b).contains(&slot))
        })
        .take(count)
        .collect()
}

/// What the trouble does to the troubled master, and how it ends.
#[derive(Clone, Copy, Debug)]
enum Trouble {
    /// The master's path is cut (packets dropped).
    Cut,
    /// The master is frozen with SIGSTOP.
    Pause,
}

/// On a three-master cluster, leases on masters 0 and 1 and one on master 2 renewed in the
/// same batches; master 2 is troubled for two leases' time: the others stay held, a set on
/// masters 0 and 1 is given back, and a waiter on master 1 is woken by a release.
async fn trouble_on_one_master(nodes: &[RedisServer], trouble: Trouble, start: impl Fn()) {
    let prefix = format!("shard-{trouble:?}:");
    let locks = support::connect(support::quick(support::cluster(nodes), &prefix)).await;
    let waiter = support::connect(support::quick(support::cluster(nodes), &prefix)).await;
    let healthy: Vec<String> = names_on(&nodes[0], 2)
        .into_iter()
        .chain(names_on(&nodes[1], 3))
        .collect();
    let troubled = names_on(&nodes[2], 1).remove(0);
    let lease = |locks: &LockManager, name: String| {
        let locks = locks.clone();
        async move {
            locks
                .lock(name)
                .ttl(LEASE)
                .watchdog(true)
                .acquire()
                .await
                .unwrap()
        }
    };
    let kept = lease(&locks, healthy[0].clone()).await;
    let kept_too = lease(&locks, healthy[2].clone()).await;
    let _on_troubled = lease(&locks, troubled).await;
    let set = locks
        .lock_all([healthy[1].clone(), healthy[3].clone()])
        .ttl(LEASE)
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    // Every connection the test relies on is open before the trouble (a runtime opens its
    // lanes on first use, which needs every master), and every lease renewed once.
    drop(waiter.lock(healthy[4].clone()).try_acquire().await.unwrap());
    renewed_at_least(&locks, 5).await;
    start();
    // A waiter on master 1, behind a holder whose lease outlasts the test: only the
    // holder's release, during the trouble, can let it in before its wait ends.
    let behind = healthy[4].clone();
    let held_on_1 = locks
        .lock(behind.clone())
        .ttl(Duration::from_secs(60))
        .acquire()
        .await;
    let wait = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let request = waiter.lock(behind).ttl(LEASE);
            request
                .wait(TROUBLE + Duration::from_secs(8))
                .acquire()
                .await
        })
    };
    tokio::time::sleep(TROUBLE).await;
    assert!(
        !kept.is_lost() && !kept_too.is_lost(),
        "{trouble:?}: a lease on a healthy master was reported lost"
    );
    assert!(!set.is_lost(), "{trouble:?}: a set on healthy masters lost");
    assert!(kept.is_held().await.unwrap(), "{trouble:?}: not held");
    assert!(kept_too.is_held().await.unwrap(), "{trouble:?}: not held");
    set.release()
        .await
        .unwrap_or_else(|e| panic!("{trouble:?}: set on healthy masters not given back: {e}"));
    let held_on_1 = held_on_1.unwrap_or_else(|e| panic!("{trouble:?}: no lock on master 1: {e}"));
    held_on_1.release().await.unwrap();
    let woken = wait.await.unwrap();
    let woken = woken.unwrap_or_else(|e| panic!("{trouble:?}: the waiter was not woken: {e}"));
    woken.release().await.unwrap();
    kept.release().await.unwrap();
    kept_too.release().await.unwrap();
}

/// Waits until `locks` has renewed `count` leases.
async fn renewed_at_least(locks: &LockManager, count: u64) {
    let within = tokio::time::Instant::now() + Duration::from_secs(10);
    while locks.stats().leases_renewed < count {
        assert!(tokio::time::Instant::now() < within, "no renewals");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_master_costs_no_lease_set_or_waiter_on_the_other_masters() {
    let Some(network) = network() else { return };
    let nodes = network.start_cluster(3).unwrap();
    trouble_on_one_master(&nodes, Trouble::Cut, || network.cut(&nodes[2]).unwrap()).await;
    network.heal(&nodes[2]).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_costs_no_lease_set_or_waiter_on_the_other_masters() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    // A frozen master is soon marked failed over the cluster bus; with full coverage
    // required (the default) the other masters then refuse every slot themselves, which no
    // client can keep in one shard. A cluster run for shard isolation says so.
    for node in &nodes {
        node.command(&["CONFIG", "SET", "cluster-require-full-coverage", "no"])
            .unwrap();
    }
    trouble_on_one_master(&nodes, Trouble::Pause, || nodes[2].pause().unwrap()).await;
    nodes[2].resume().unwrap();
}
