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
    without_full_coverage(&nodes);
    trouble_on_one_master(&nodes, Trouble::Pause, || nodes[2].pause().unwrap()).await;
    nodes[2].resume().unwrap();
}

// Wake-ups per shard: each release publishes with SPUBLISH on its own shard, and each waiter
// follows its key's channel with SSUBSCRIBE on the master that owns the key's slot.

/// Far longer than any test: a waiter whose fallback timer is this far away was woken.
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The subscribers of `channel` on `node`: classic (`NUMSUB`), and sharded (`SHARDNUMSUB`).
fn subscribers(node: &RedisServer, channel: &str) -> (u64, u64) {
    let count = |verb: &str| -> u64 {
        let reply = node.command(&["PUBSUB", verb, channel]).unwrap();
        let last = reply.lines().last().unwrap_or_default();
        last.trim_start_matches(':').parse().unwrap()
    };
    (count("NUMSUB"), count("SHARDNUMSUB"))
}

/// Waits until `channel` has a sharded subscriber on one of `nodes`.
async fn shard_subscribed(nodes: &[&RedisServer], channel: &str) {
    let started = std::time::Instant::now();
    while nodes.iter().all(|node| subscribers(node, channel).1 == 0) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{channel}: the waiter never subscribed on its shard"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lock `name` held for a day by `holder`, and a request of `waiter` for it whose fallback
/// timer is a day away, subscribed on its shard's master among `owners`: only a wake-up lets
/// it in soon.
async fn held_and_waited_for(
    holder: &LockManager,
    waiter: &LockManager,
    prefix: &str,
    name: &str,
    owners: &[&RedisServer],
) -> (
    distlock::LockGuard,
    tokio::task::JoinHandle<Result<distlock::LockGuard, distlock::LockError>>,
) {
    let held = holder.lock(name).ttl(DAY).acquire().await.unwrap();
    let waiting = {
        let (waiter, name) = (waiter.clone(), name.to_owned());
        tokio::spawn(async move {
            waiter
                .lock(name)
                .retry_delay(DAY)
                .retries(20)
                .acquire()
                .await
        })
    };
    shard_subscribed(owners, &format!("{prefix}{{{name}}}:wake")).await;
    (held, waiting)
}

/// The waiter's guard, once a wake-up let it in: within 10 s where its timer takes a day,
/// and after at least one busy attempt (it waited, and was woken).
async fn woken(
    waiting: tokio::task::JoinHandle<Result<distlock::LockGuard, distlock::LockError>>,
    why: &str,
) -> distlock::LockGuard {
    let guard = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .unwrap_or_else(|_| panic!("{why}: not woken by the release"))
        .unwrap()
        .unwrap_or_else(|e| panic!("{why}: {e}"));
    assert!(
        guard.attempts() >= 2,
        "{why}: {} attempts",
        guard.attempts()
    );
    guard
}

#[tokio::test]
async fn a_release_wakes_a_waiter_of_another_manager_through_its_shard_alone() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let prefix = "sw:";
    let holder = support::cluster_manager(&nodes, prefix).await;
    let waiter = support::cluster_manager(&nodes, prefix).await;
    let name = names_on(&nodes[1], 1).remove(0);
    let (held, waiting) = held_and_waited_for(&holder, &waiter, prefix, &name, &[&nodes[1]]).await;
    // Followed on the key's own master, sharded; by nobody anywhere else, nor classically.
    let channel = format!("{prefix}{{{name}}}:wake");
    assert_eq!(subscribers(&nodes[1], &channel), (0, 1));
    for other in [&nodes[0], &nodes[2]] {
        assert_eq!(subscribers(other, &channel), (0, 0));
    }
    held.release().await.unwrap();
    woken(waiting, "on its shard")
        .await
        .release()
        .await
        .unwrap();
}

/// What `node` has counted of publishing: the `PUBLISH` and `SPUBLISH` it ran (scripts'
/// included), and the publish messages the cluster bus brought it, classic and sharded.
fn publish_counts(node: &RedisServer) -> [u64; 4] {
    let stats = node.command(&["INFO", "commandstats"]).unwrap();
    let calls = |command: &str| -> u64 {
        let line = stats
            .lines()
            .find(|line| line.starts_with(&format!("cmdstat_{command}:")));
        line.and_then(|line| line.split("calls=").nth(1))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    };
    let info = node.command(&["CLUSTER", "INFO"]).unwrap();
    let received = |field: &str| -> u64 {
        let line = info.lines().find(|line| line.starts_with(field));
        line.and_then(|line| line.split(':').nth(1))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    [
        calls("publish"),
        calls("spublish"),
        received("cluster_stats_messages_publish_received"),
        received("cluster_stats_messages_publishshard_received"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_contended_key_costs_the_other_masters_no_publish() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let prefix = "cs:";
    let managers = vec![
        support::cluster_manager(&nodes, prefix).await,
        support::cluster_manager(&nodes, prefix).await,
    ];
    let slot = crate::cluster::keyslot(&nodes[0], "hot");
    let owner_port = crate::cluster::ClusterView::of(&nodes[0]).owner(slot).port;
    let (owner, others): (Vec<&RedisServer>, Vec<&RedisServer>) =
        nodes.iter().partition(|node| node.port() == owner_port);
    let before: Vec<[u64; 4]> = others.iter().map(|node| publish_counts(node)).collect();
    let owner_before = publish_counts(owner[0]);
    let run = support::contend(&managers, 3, 40, false, None).await;
    assert_eq!(run.entries, 240);
    let after: Vec<[u64; 4]> = others.iter().map(|node| publish_counts(node)).collect();
    assert_eq!(
        before, after,
        "the other masters published or heard a wake-up"
    );
    let owner_after = publish_counts(owner[0]);
    assert!(
        owner_after[1] > owner_before[1],
        "the owner published with SPUBLISH: {owner_before:?} -> {owner_after:?}"
    );
    assert_eq!(owner_after[0], owner_before[0], "no classic PUBLISH");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_the_other_shards_are_woken_with_the_first_seeds_master_killed() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    // The other masters keep serving their slots once the dead one is marked failed.
    without_full_coverage(&nodes);
    let prefix = "sk:";
    let holder = support::connect(support::quick(support::cluster(&nodes), prefix)).await;
    let waiter = support::connect(support::quick(support::cluster(&nodes), prefix)).await;
    let names = [
        names_on(&nodes[1], 1).remove(0),
        names_on(&nodes[2], 1).remove(0),
    ];
    // Each runtime opens its connections (one per master) before the kill.
    for name in &names {
        for locks in [&holder, &waiter] {
            let guard = locks.lock(name.clone()).try_acquire().await.unwrap();
            guard.unwrap().release().await.unwrap();
        }
    }
    nodes[0].kill().unwrap();
    for (name, owner) in names.iter().zip([&nodes[1], &nodes[2]]) {
        let (held, waiting) = held_and_waited_for(&holder, &waiter, prefix, name, &[owner]).await;
        held.release().await.unwrap();
        let why = format!("{name}, with the first seed down");
        woken(waiting, &why).await.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_shards_waiters_are_woken_again() {
    let nodes = RedisServer::start_cluster_with_replicas(3, 1).unwrap();
    let prefix = "sf:";
    let name = "moved";
    let slot = crate::cluster::keyslot(&nodes[0], name);
    // Each replica shows in CLUSTER NODES once the nodes have gossiped about it.
    let started = std::time::Instant::now();
    let (master_port, replica_port) = loop {
        let view = crate::cluster::ClusterView::of(&nodes[0]);
        let owner = view.owner(slot);
        if let Some(replica) = view.nodes.iter().find(|n| n.master_id == owner.id) {
            break (owner.port, replica.port);
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no replica");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let by_port = |port: u16| nodes.iter().find(|n| n.port() == port).unwrap();
    let (master, replica) = (by_port(master_port), by_port(replica_port));
    let holder = support::cluster_manager(&nodes, prefix).await;
    let waiter = support::cluster_manager(&nodes, prefix).await;
    // Woken once before the failover, on the shard's first master.
    let (held, waiting) = held_and_waited_for(&holder, &waiter, prefix, name, &[master]).await;
    held.release().await.unwrap();
    woken(waiting, "before the failover")
        .await
        .release()
        .await
        .unwrap();
    let (held, waiting) = held_and_waited_for(&holder, &waiter, prefix, name, &[master]).await;
    assert_eq!(replica.command(&["CLUSTER", "FAILOVER"]).unwrap(), "+OK");
    let started = std::time::Instant::now();
    while !replica.command(&["ROLE"]).unwrap().starts_with("master")
        || !master.command(&["ROLE"]).unwrap().starts_with("slave")
    {
        assert!(started.elapsed() < Duration::from_secs(20), "no failover");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The old master is gone for good: the waiter's subscription connection to it is lost,
    // and the waiter follows the channel on the new master.
    master.kill().unwrap();
    shard_subscribed(&[replica], &format!("{prefix}{{{name}}}:wake")).await;
    held.release().await.unwrap();
    woken(waiting, "after the failover")
        .await
        .release()
        .await
        .unwrap();
}

/// A Cluster whose every node has the user `locker` with `rules`.
fn cluster_with_user(rules: &str) -> Vec<RedisServer> {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let rules: Vec<&str> = rules.split(' ').collect();
    for node in &nodes {
        node.acl_setuser("locker", "locker-secret", &rules).unwrap();
    }
    nodes
}

/// A holder and a waiter as `locker` on `nodes` woken by a release; `(classic, sharded)`
/// subscribers of the channel on every node while the waiter waited.
async fn woken_as_locker(nodes: &[RedisServer], prefix: &str) -> (u64, u64) {
    let locker = || {
        support::cluster(nodes)
            .credentials("locker", "locker-secret")
            .key_prefix(prefix)
            .build()
    };
    let (holder, waiter) = (locker().await.unwrap(), locker().await.unwrap());
    let name = names_on(&nodes[1], 1).remove(0);
    let held = holder.lock(name.as_str()).ttl(DAY).acquire().await.unwrap();
    let waiting = {
        let (waiter, name) = (waiter.clone(), name.clone());
        tokio::spawn(async move {
            waiter
                .lock(name)
                .retry_delay(DAY)
                .retries(20)
                .acquire()
                .await
        })
    };
    let channel = format!("{prefix}{{{name}}}:wake");
    let total = || {
        nodes.iter().fold((0, 0), |(c, s), node| {
            let (classic, sharded) = subscribers(node, &channel);
            (c + classic, s + sharded)
        })
    };
    let started = std::time::Instant::now();
    while total() == (0, 0) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let followed = total();
    held.release().await.unwrap();
    woken(waiting, "as locker").await.release().await.unwrap();
    followed
}

#[tokio::test]
async fn the_acl_rules_are_enough_for_sharded_wake_ups() {
    let prefix = "sa:";
    let nodes = cluster_with_user(&LockManager::acl_rules(prefix));
    assert_eq!(woken_as_locker(&nodes, prefix).await, (0, 1));
}

/// A user who may not ask `COMMAND INFO` cannot tell whether the servers have sharded
/// pub/sub: classic pub/sub, as on a server without it, and the wake-ups still come.
#[tokio::test]
async fn without_command_info_a_cluster_falls_back_to_classic_wake_ups() {
    let prefix = "sc:";
    let rules = LockManager::acl_rules(prefix).replace(" +command|info", "");
    let nodes = cluster_with_user(&rules);
    assert_eq!(woken_as_locker(&nodes, prefix).await, (1, 0));
}

/// Lets every master of `nodes` serve its slots while another is down (Redis's default,
/// `cluster-require-full-coverage yes`, has every master refuse every slot then: no client
/// can keep that in one shard).
fn without_full_coverage(nodes: &[RedisServer]) {
    for node in nodes {
        node.command(&["CONFIG", "SET", "cluster-require-full-coverage", "no"])
            .unwrap();
    }
}
