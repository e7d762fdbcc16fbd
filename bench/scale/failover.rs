//! What a master's crash costs waiters: while key A (on the master that is killed) and key B
//! (on another) are each handed between two managers, the master is killed with SIGKILL and
//! its replica takes over (`cluster-node-timeout` 1 s). Measured for each key: its longest
//! gap between grants from the kill on (for A, the outage of its shard), beside its p99 gap
//! before the kill.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distlock::LockManager;

use super::deployment::Deployment;
use super::handover::{self, Handed};
use super::{Options, percentile};

/// What one crash cost.
struct Crash {
    a_p99_before: Duration,
    a_longest_after: Duration,
    /// Whether A was granted again (three times) within a minute of the kill.
    back: bool,
    b_p99_before: Duration,
    b_longest_after: Duration,
    a_errors: u64,
    b_errors: u64,
}

/// The gaps between `grants` (in order): the p99 of those before `at`, and the longest of
/// those that end after it.
fn gaps(grants: &[Instant], at: Instant) -> (Duration, Duration) {
    let mut before = Vec::new();
    let mut longest = Duration::ZERO;
    for pair in grants.windows(2) {
        let gap = pair[1].saturating_duration_since(pair[0]);
        if pair[1] <= at {
            before.push(gap);
        } else {
            longest = longest.max(gap);
        }
    }
    before.sort();
    (percentile(&before, 0.99), longest)
}

/// Kills master `victim` of `cluster` while keys on it and on master `other` are handed
/// around, each between two of `managers`.
async fn crash(
    cluster: &Deployment<'_>,
    managers: &[LockManager; 4],
    victim: usize,
    other: usize,
    steady: Duration,
) -> Crash {
    let key_a = cluster.key_on(&managers[0], &format!("f{victim}a"), victim);
    let key_b = cluster.key_on(&managers[0], &format!("f{victim}b"), other);
    let stop = Arc::new(AtomicBool::new(false));
    let (a, b) = (Arc::new(Handed::default()), Arc::new(Handed::default()));
    let mut tasks = tokio::task::JoinSet::new();
    for (pair, key, handed) in [
        ([managers[0].clone(), managers[1].clone()], key_a, a.clone()),
        ([managers[2].clone(), managers[3].clone()], key_b, b.clone()),
    ] {
        let stop = stop.clone();
        tasks.spawn(handover::alternate(pair, key, usize::MAX, stop, handed));
    }
    tokio::time::sleep(steady).await;
    let killed = Instant::now();
    cluster.nodes[victim].kill().expect("kill the master");
    let deadline = killed + Duration::from_secs(60);
    // A grant in flight at the kill may still come; the second after it needs the replica.
    let back = loop {
        let after = a
            .grants
            .lock()
            .unwrap()
            .iter()
            .filter(|&&t| t > killed)
            .count();
        if after >= 3 {
            break true;
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    tokio::time::sleep(steady).await;
    stop.store(true, Ordering::Relaxed);
    while tasks.join_next().await.is_some() {}
    let (a_p99_before, a_longest_after) = gaps(&a.grants.lock().unwrap(), killed);
    let (b_p99_before, b_longest_after) = gaps(&b.grants.lock().unwrap(), killed);
    Crash {
        a_p99_before,
        a_longest_after,
        back,
        b_p99_before,
        b_longest_after,
        a_errors: a.errors.load(Ordering::Relaxed),
        b_errors: b.errors.load(Ordering::Relaxed),
    }
}

/// The failover table: on each cluster, a master that is not the first seed is killed, then
/// with `cluster-require-full-coverage no` another one, then the first seed (which the
/// managers were built with first).
pub(super) async fn run(clusters: &[Deployment<'_>], options: &Options) {
    let steady = Duration::from_secs(if options.quick { 1 } else { 2 });
    println!(
        "\nfailover: key A on the master killed (SIGKILL; its replica takes over, \
         cluster-node-timeout 1 s, lease 2 s) and key B on another master, each handed between \
         two managers; for each key, its p99 gap between grants before the kill, and its \
         longest gap from the kill on (until {steady:?} after A was granted again); coverage: \
         `cluster-require-full-coverage` (Redis's default, yes: every master refuses every \
         slot while one is down); errors: requests or releases that failed (each made again)"
    );
    println!(
        "{:<16} {:>8} {:<20} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "deployment",
        "coverage",
        "master killed",
        "A p99 gap",
        "A longest",
        "B p99 gap",
        "B longest",
        "errors A/B"
    );
    for cluster in clusters {
        let mut managers = Vec::new();
        for _ in 0..4 {
            managers.push(cluster.manager().await);
        }
        let managers: [LockManager; 4] = managers.try_into().expect("four managers");
        let (last, next) = (cluster.masters - 1, cluster.masters - 2);
        let crashes = [
            (true, "not the first seed", last, 0),
            (false, "not the first seed", next, 0),
            (false, "the first seed", 0, 1),
        ];
        for (coverage, what, victim, other) in crashes {
            if !coverage {
                full_coverage(cluster, false);
            }
            let c = crash(cluster, &managers, victim, other, steady).await;
            println!(
                "{:<16} {:>8} {:<20} {:>10.2?} {:>10} {:>10.2?} {:>10.2?} {:>10}",
                cluster.name,
                if coverage { "yes" } else { "no" },
                what,
                c.a_p99_before,
                if c.back {
                    format!("{:.2?}", c.a_longest_after)
                } else {
                    "not back".to_owned()
                },
                c.b_p99_before,
                c.b_longest_after,
                format!("{}/{}", c.a_errors, c.b_errors)
            );
        }
        for locks in &managers {
            locks.shutdown().await;
        }
    }
}

/// Sets `cluster-require-full-coverage` on every running node of `cluster`.
fn full_coverage(cluster: &Deployment<'_>, required: bool) {
    let value = if required { "yes" } else { "no" };
    for node in cluster.nodes.iter().filter(|n| n.is_running()) {
        let reply = node
            .command(&["CONFIG", "SET", "cluster-require-full-coverage", value])
            .unwrap_or_default();
        assert!(reply.starts_with('+'), "CONFIG SET: {reply}");
    }
}
