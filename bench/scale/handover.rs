//! One contended key handed back and forth between two managers, and what each node counted
//! while it was: the unit the Cluster tables measure a release by.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockGuard, LockManager};

use crate::harness::Commands;

/// The lease of a handed key: short, so that a lease left behind by a killed master's
/// release ends soon.
const TTL: Duration = Duration::from_secs(2);

/// After the other manager's request is queued, the moment given to its subscription to
/// land before the release (it lands in well under a millisecond on loopback; once the
/// manager follows the key, it keeps following it between rounds).
const SETTLE: Duration = Duration::from_millis(2);

/// What one node's counters said, for one window.
#[derive(Debug, Default, Clone)]
pub(super) struct Counts {
    pub(super) commands: Commands,
    pub(super) net_in: f64,
    pub(super) net_out: f64,
    /// Cluster bus messages that carried a publish (`cluster_stats_messages_publish_sent`
    /// and `…_publishshard_sent`).
    pub(super) bus_publish: f64,
}

fn field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

impl Counts {
    /// The node's counters now (0 for a node that does not answer, such as a killed one).
    pub(super) fn read(node: &RedisServer) -> Self {
        let stats = node.command(&["INFO", "stats"]).unwrap_or_default();
        let commands = Commands::read(node);
        let bus = node.command(&["CLUSTER", "INFO"]).unwrap_or_default();
        Self {
            commands,
            net_in: field(&stats, "total_net_input_bytes"),
            net_out: field(&stats, "total_net_output_bytes"),
            bus_publish: field(&bus, "cluster_stats_messages_publish_sent")
                + field(&bus, "cluster_stats_messages_publishshard_sent"),
        }
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            commands: self.commands.since(&before.commands),
            net_in: self.net_in - before.net_in,
            net_out: self.net_out - before.net_out,
            bus_publish: self.bus_publish - before.bus_publish,
        }
    }

    /// Counters over a window of work, less what reading them costs (measured over an empty
    /// window right before): `INFO` and `CLUSTER INFO` replies are bytes too.
    pub(super) async fn window(nodes: &[RedisServer], work: impl AsyncFnOnce()) -> Vec<Self> {
        let first: Vec<Self> = nodes.iter().map(Self::read).collect();
        let second: Vec<Self> = nodes.iter().map(Self::read).collect();
        work().await;
        let third: Vec<Self> = nodes.iter().map(Self::read).collect();
        first
            .iter()
            .zip(&second)
            .zip(&third)
            .map(|((a, b), c)| {
                let (reading, worked) = (b.since(a), c.since(b));
                Self {
                    commands: worked.commands.since(&reading.commands),
                    net_in: (worked.net_in - reading.net_in).max(0.0),
                    net_out: (worked.net_out - reading.net_out).max(0.0),
                    bus_publish: (worked.bus_publish - reading.bus_publish).max(0.0),
                }
            })
            .collect()
    }

    /// Calls of `name` in the window.
    pub(super) fn calls(&self, name: &str) -> u64 {
        self.commands.calls(name)
    }
}

/// Grants seen on one handed key, and what went wrong on the way.
#[derive(Debug, Default)]
pub(super) struct Handed {
    /// When each grant came (to the other manager's waiter).
    pub(super) grants: Mutex<Vec<Instant>>,
    /// Release to grant, for each round whose release answered.
    pub(super) wakes: Mutex<Vec<Duration>>,
    /// Requests and releases that failed (each request is made again).
    pub(super) errors: AtomicU64,
}

/// Waits for the lock with `locks` until it is granted, making the request again after an
/// error; the guard and when it came.
async fn take(locks: &LockManager, key: &str, handed: &Handed) -> (LockGuard, Instant) {
    loop {
        let request = locks
            .lock(key)
            .ttl(TTL)
            .watchdog(false)
            .wait(Duration::from_secs(30));
        match request.acquire().await {
            Ok(guard) => return (guard, Instant::now()),
            Err(_) => {
                handed.errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Hands `key` between the two managers for `rounds` rounds, or until `stop` is set: each
/// round the holder waits until the other manager's request is queued (for at most a
/// second), then releases, and the other's waiter is granted.
pub(super) async fn alternate(
    pair: [LockManager; 2],
    key: String,
    rounds: usize,
    stop: Arc<AtomicBool>,
    handed: Arc<Handed>,
) {
    let (mut holder, _) = take(&pair[0], &key, &handed).await;
    for round in 0..rounds {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let next = pair[(round + 1) % 2].clone();
        let waiter = {
            let (key, handed) = (key.clone(), handed.clone());
            tokio::spawn(async move { take(&next, &key, &handed).await })
        };
        let other = &pair[(round + 1) % 2];
        let queued_by = Instant::now() + Duration::from_secs(1);
        while other.stats().waiting_requests == 0
            && !waiter.is_finished()
            && Instant::now() < queued_by
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::time::sleep(SETTLE).await;
        let released = Instant::now();
        let answered = holder.release().await.is_ok();
        if !answered {
            handed.errors.fetch_add(1, Ordering::Relaxed);
        }
        let (guard, granted) = waiter.await.expect("waiter");
        handed.grants.lock().unwrap().push(granted);
        if answered {
            let wake = granted.saturating_duration_since(released);
            handed.wakes.lock().unwrap().push(wake);
        }
        holder = guard;
    }
    let _ = holder.release().await;
}
