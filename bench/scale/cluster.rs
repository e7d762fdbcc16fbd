//! The Cluster tables of `--scale`: one server beside Clusters of 3 and 6 masters with a
//! replica each. For one contended key handed between two managers: the commands and the
//! bytes each node handled per hand-over (`INFO commandstats`, `INFO stats`' net counters,
//! `CLUSTER INFO`'s bus messages that carried a publish), the wake-up latency, the
//! connections and pub/sub subscriptions on each node; uncontended throughput; and what a
//! master's crash (SIGKILL, its replica taking over) costs waiters on its shard and on the
//! others.
//!
//! Both classic and sharded pub/sub are counted (`publish` and `spublish`, `NUMSUB` and
//! `SHARDNUMSUB`), so that the tables show whichever the library uses.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

use super::deployment::Deployment;
use super::failover;
use super::handover::{self, Counts, Handed};
use super::{Options, PREFIX, info, left, median, percentile, row_time};
use crate::harness;

/// Pub/sub on one node: channels under the prefix and their subscribers, classic and
/// sharded.
#[derive(Debug, Default, Clone, Copy)]
struct PubSub {
    channels: usize,
    subscribers: u64,
    shard_channels: usize,
    shard_subscribers: u64,
}

/// Channels listed by `PUBSUB <list>` under the prefix, and their subscribers by
/// `PUBSUB <count>`.
fn listed(node: &RedisServer, list: &str, count: &str) -> (usize, u64) {
    let reply = node
        .command(&["PUBSUB", list, &format!("{PREFIX}*")])
        .unwrap_or_default();
    let channels: Vec<&str> = reply.lines().filter(|l| !l.is_empty()).collect();
    if channels.is_empty() {
        return (0, 0);
    }
    let mut args = vec!["PUBSUB", count];
    args.extend(&channels);
    let reply = node.command(&args).unwrap_or_default();
    let subscribers = reply
        .lines()
        .skip(1)
        .step_by(2)
        .filter_map(|n| n.trim_start_matches(':').parse::<u64>().ok())
        .sum();
    (channels.len(), subscribers)
}

fn pubsub(node: &RedisServer) -> PubSub {
    let (channels, subscribers) = listed(node, "CHANNELS", "NUMSUB");
    let (shard_channels, shard_subscribers) = listed(node, "SHARDCHANNELS", "SHARDNUMSUB");
    PubSub {
        channels,
        subscribers,
        shard_channels,
        shard_subscribers,
    }
}

/// What one contended key cost a deployment.
struct Costs {
    /// Each node's counters over the counted rounds (masters first).
    nodes: Vec<Counts>,
    rounds: usize,
    wake_p50: Duration,
    wake_p99: Duration,
    errors: u64,
    /// Client connections the two managers added on each node, mid-wait.
    clients: Vec<f64>,
    /// Pub/sub on each node while one manager waits for the key the other holds.
    pubsub: Vec<PubSub>,
}

/// Connections and pub/sub on every node while `pair[1]` waits for `key`, held by `pair[0]`.
async fn probe(
    deployment: &Deployment<'_>,
    pair: &[LockManager; 2],
    key: &str,
    baseline: &[f64],
) -> (Vec<f64>, Vec<PubSub>) {
    let held = pair[0].lock(key).acquire().await.expect("probe hold");
    let waiter = {
        let (locks, key) = (pair[1].clone(), key.to_owned());
        tokio::spawn(async move {
            let request = locks.lock(key).wait(Duration::from_secs(30));
            request.acquire().await.expect("probe wait").release().await
        })
    };
    let queued_by = std::time::Instant::now() + Duration::from_secs(5);
    while pair[1].stats().waiting_requests == 0 && std::time::Instant::now() < queued_by {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The subscription, made right after the request is queued, settles.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let nodes = deployment.nodes;
    let clients = nodes
        .iter()
        .zip(baseline)
        .map(|(node, before)| info(node, "clients", "connected_clients") - before)
        .collect();
    let subscriptions = nodes.iter().map(pubsub).collect();
    held.release().await.expect("probe release");
    let _ = waiter.await.expect("probe waiter");
    (clients, subscriptions)
}

/// One key (on the last master) handed between two managers `rounds` times.
async fn costs(deployment: &Deployment<'_>, rounds: usize) -> Costs {
    let baseline: Vec<f64> = deployment
        .nodes
        .iter()
        .map(|node| info(node, "clients", "connected_clients"))
        .collect();
    let pair = [deployment.manager().await, deployment.manager().await];
    let key = deployment.key_on(&pair[0], "c", deployment.own());
    let never = Arc::new(AtomicBool::new(false));
    // Warm-up: scripts loaded, lanes opened, the key followed.
    let warm = Arc::new(Handed::default());
    handover::alternate(pair.clone(), key.clone(), 20, never.clone(), warm).await;
    let (clients, pubsub) = probe(deployment, &pair, &key, &baseline).await;
    let handed = Arc::new(Handed::default());
    let nodes = Counts::window(deployment.nodes, async || {
        handover::alternate(pair.clone(), key.clone(), rounds, never, handed.clone()).await;
    })
    .await;
    for locks in &pair {
        locks.shutdown().await;
    }
    let mut wakes = handed.wakes.lock().unwrap().clone();
    wakes.sort();
    Costs {
        nodes,
        rounds,
        wake_p50: percentile(&wakes, 0.5),
        wake_p99: percentile(&wakes, 0.99),
        errors: handed.errors.load(std::sync::atomic::Ordering::Relaxed),
        clients,
        pubsub,
    }
}

/// The index of the node among `range` with the most commands, and its counters.
fn busiest(nodes: &[Counts], range: std::ops::Range<usize>) -> Option<(usize, &Counts)> {
    range
        .filter_map(|i| Some((i, nodes.get(i)?)))
        .max_by_key(|(_, c)| c.commands.total())
}

/// `cmds in/out`, per round, of one node's counters ("-" for none).
fn per_round(counts: Option<&Counts>, rounds: usize) -> String {
    let Some(c) = counts else {
        return "-".to_owned();
    };
    let r = rounds as f64;
    format!(
        "{} {:.0}/{:.0}",
        harness::short(c.commands.total() as f64 / r),
        c.net_in / r,
        c.net_out / r
    )
}

fn print_costs(deployments: &[Deployment<'_>], all: &[Costs]) {
    println!(
        "{:<16} {:>18} {:>18} {:>18} {:>9} {:>9} {:>7} {:>9} {:>9} {:>6}",
        "deployment",
        "own master",
        "other masters",
        "replicas",
        "publish",
        "spublish",
        "bus",
        "wake p50",
        "wake p99",
        "errors"
    );
    for (deployment, costs) in deployments.iter().zip(all) {
        let (m, r) = (deployment.masters, costs.rounds);
        let own = costs.nodes.get(deployment.own());
        let other = busiest(&costs.nodes, 0..m - 1).map(|(_, c)| c);
        let replica = busiest(&costs.nodes, m..costs.nodes.len()).map(|(_, c)| c);
        let total = |f: &dyn Fn(&Counts) -> f64| costs.nodes.iter().map(f).sum::<f64>() / r as f64;
        println!(
            "{:<16} {:>18} {:>18} {:>18} {:>9} {:>9} {:>7} {:>9.2?} {:>9.2?} {:>6}",
            deployment.name,
            per_round(own, r),
            per_round(other, r),
            per_round(replica, r),
            harness::short(total(&|c| c.calls("publish") as f64)),
            harness::short(total(&|c| c.calls("spublish") as f64)),
            harness::short(total(&|c| c.bus_publish)),
            costs.wake_p50,
            costs.wake_p99,
            costs.errors
        );
    }
    println!("commands per hand-over on the key's master, and on the busiest other master:");
    for (deployment, costs) in deployments.iter().zip(all) {
        let r = costs.rounds as u64;
        let own = costs.nodes.get(deployment.own()).map(|c| c.commands.per(r));
        let other =
            busiest(&costs.nodes, 0..deployment.masters - 1).map(|(_, c)| c.commands.per(r));
        println!(
            "  {:<14} own: {}; other: {}",
            deployment.name,
            own.filter(|s| !s.is_empty()).unwrap_or("none".into()),
            other
                .map(|s| if s.is_empty() { "none".into() } else { s })
                .unwrap_or("-".into())
        );
    }
}

fn print_connections(deployments: &[Deployment<'_>], all: &[Costs]) {
    println!(
        "{:<16} {:>9} {:>22} {:>22} {:>22}",
        "deployment",
        "conns/mgr",
        "conns own/other/repl",
        "ch/subs own/other",
        "shard ch/subs own/other"
    );
    for (deployment, costs) in deployments.iter().zip(all) {
        let m = deployment.masters;
        let max = |range: std::ops::Range<usize>, f: &dyn Fn(usize) -> f64| {
            range
                .map(f)
                .fold(None, |a: Option<f64>, x| Some(a.map_or(x, |a| a.max(x))))
        };
        let show = |x: Option<f64>| x.map_or("-".to_owned(), |x| format!("{x:.0}"));
        let conns = |range: std::ops::Range<usize>| show(max(range, &|i| costs.clients[i]));
        let n = costs.clients.len();
        let ps = &costs.pubsub;
        let classic = |range: std::ops::Range<usize>| {
            let c = show(max(range.clone(), &|i| ps[i].channels as f64));
            format!("{c}/{}", show(max(range, &|i| ps[i].subscribers as f64)))
        };
        let sharded = |range: std::ops::Range<usize>| {
            let c = show(max(range.clone(), &|i| ps[i].shard_channels as f64));
            format!(
                "{c}/{}",
                show(max(range, &|i| ps[i].shard_subscribers as f64))
            )
        };
        println!(
            "{:<16} {:>9.1} {:>22} {:>22} {:>22}",
            deployment.name,
            costs.clients.iter().sum::<f64>() / 2.0,
            format!("{} {} {}", conns(m - 1..m), conns(0..m - 1), conns(m..n)),
            format!("{} {}", classic(m - 1..m), classic(0..m - 1)),
            format!("{} {}", sharded(m - 1..m), sharded(0..m - 1)),
        );
    }
}

/// Whether `node` runs and is a master now.
fn is_master(node: &RedisServer) -> bool {
    node.is_running()
        && node
            .command(&["INFO", "replication"])
            .is_ok_and(|info| info.contains("role:master"))
}

/// Uncontended pairs per second on each deployment, taking turns.
async fn uncontended(deployments: &[Deployment<'_>], options: &Options) -> Vec<f64> {
    let mut managers = Vec::new();
    for deployment in deployments {
        managers.push(deployment.manager().await);
    }
    let mut runs = Vec::new();
    for _ in 0..options.runs {
        runs.push(
            harness::in_turns::<3>(row_time(options), async |i, slice| {
                harness::uncontended(&harness::Manual(managers[i].clone()), 64, slice)
                    .await
                    .rate()
            })
            .await,
        );
    }
    for locks in &managers {
        locks.shutdown().await;
    }
    (0..3).map(|i| median(&runs, |r| r[i])).collect()
}

/// The uncontended throughput table.
async fn print_uncontended(deployments: &[Deployment<'_>], options: &Options) {
    let run = row_time(options);
    println!(
        "\ncluster: uncontended acquire+release pairs/s on distinct keys, 64 tasks, {run:?} each"
    );
    let rates = uncontended(deployments, options).await;
    println!(
        "{:>10} {:>16} {:>16}",
        "1 server", "3 masters +3 r", "6 masters +6 r"
    );
    println!(
        "{:>10.0} {:>10.0} {:>4.2}x {:>10.0} {:>4.2}x",
        rates[0],
        rates[1],
        rates[1] / rates[0],
        rates[2],
        rates[2] / rates[0]
    );
}

/// The Cluster tables, beside `server`.
pub(super) async fn run(
    server: &RedisServer,
    options: &Options,
) -> Result<(), Box<dyn std::error::Error>> {
    let three = RedisServer::start_cluster_with_replicas(3, 1)?;
    let six = RedisServer::start_cluster_with_replicas(6, 1)?;
    let deployments = [
        Deployment {
            name: "1 server".into(),
            nodes: std::slice::from_ref(server),
            masters: 1,
            cluster: false,
        },
        Deployment {
            name: "3 masters +3 r".into(),
            nodes: &three,
            masters: 3,
            cluster: true,
        },
        Deployment {
            name: "6 masters +6 r".into(),
            nodes: &six,
            masters: 6,
            cluster: true,
        },
    ];
    let rounds = if options.quick { 200 } else { 500 };
    println!(
        "\ncluster, one contended key: handed between two managers {rounds} times (each time \
         the holder waits until the other's request is queued, then releases); per hand-over \
         (a release and the other manager's grant): commands and bytes in/out on the key's own \
         master (the last; the first seed is among the others), the most on any other \
         master and on any replica; publish/spublish calls and cluster-bus publish messages \
         over all nodes; wake: release to grant in the other manager. One run each; Clusters \
         have one replica per master; client and {} servers share the machine's cores.",
        1 + three.len() + six.len()
    );
    let mut all = Vec::new();
    for deployment in &deployments {
        all.push(costs(deployment, rounds).await);
    }
    print_costs(&deployments, &all);
    println!(
        "\nconnections and subscriptions while one manager waits for the key the other holds: \
         client connections the two managers opened, per manager and on each node (the key's \
         master, the most on another master, the most on a replica); channels/subscribers under \
         the prefix, classic and sharded (the key's master, the most on another)"
    );
    print_connections(&deployments, &all);

    print_uncontended(&deployments, options).await;

    failover::run(&deployments[1..], options).await;
    let mut lefts = Vec::new();
    for deployment in &deployments {
        let mut each = Vec::new();
        // The masters now: a killed one is gone, its replica took over.
        for node in deployment.nodes.iter().filter(|n| is_master(n)) {
            each.push(left(node).await);
        }
        lefts.push(format!("{}: {}", deployment.name, each.join(" ")));
    }
    println!("\nleft (keys/channels, each master): {}", lefts.join(" | "));
    Ok(())
}
