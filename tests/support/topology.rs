//! The topologies the tests run on — one server, a Sentinel group, a Cluster, a RedLock set —
//! and managers on them. Each topology has a function that gives its `LockManagerBuilder`,
//! for a test to add options of its own, and one that builds a manager with the options most
//! tests use.

use std::borrow::Borrow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::testing::{FaultProxy, RedisServer};
use distlock::{LockManager, LockManagerBuilder};

/// The connect and response timeouts of `quick`: short, so that faults show quickly.
pub const QUICK: Duration = Duration::from_millis(500);

/// `builder` under `prefix`, with `QUICK` timeouts.
pub fn quick(builder: LockManagerBuilder, prefix: &str) -> LockManagerBuilder {
    builder
        .key_prefix(prefix)
        .response_timeout(QUICK)
        .connect_timeout(QUICK)
}

/// Builds `builder`, failing the test if the manager does not connect.
pub async fn connect(builder: LockManagerBuilder) -> LockManager {
    builder
        .build()
        .await
        .expect("manager connects to the test servers")
}

/// One server (or a proxy in front of one) at `url`.
pub fn single(url: impl Into<String>) -> LockManagerBuilder {
    LockManager::builder().redis_url(url)
}

/// A manager on the server (or proxy) at `url` under `prefix`, with `QUICK` timeouts.
pub async fn manager_at(url: impl Into<String>, prefix: &str) -> LockManager {
    connect(quick(single(url), prefix)).await
}

/// `n` independent masters, for RedLock.
pub fn redlock_masters(n: usize) -> Vec<RedisServer> {
    (0..n)
        .map(|_| RedisServer::start().expect("redis-server starts"))
        .collect()
}

/// RedLock over `masters`.
pub fn redlock<S: Borrow<RedisServer>>(masters: &[S]) -> LockManagerBuilder {
    LockManager::builder().redlock(masters.iter().map(|m| m.borrow().url()))
}

/// A manager on RedLock over `masters` under `prefix`, with the default timeouts.
pub async fn redlock_manager<S: Borrow<RedisServer>>(masters: &[S], prefix: &str) -> LockManager {
    connect(redlock(masters).key_prefix(prefix)).await
}

/// The cluster of `nodes`, every one of them a seed.
pub fn cluster<S: Borrow<RedisServer>>(nodes: &[S]) -> LockManagerBuilder {
    LockManager::builder().cluster(nodes.iter().map(|n| n.borrow().url()))
}

/// A manager on the cluster of `nodes` under `prefix`, with the default timeouts.
pub async fn cluster_manager<S: Borrow<RedisServer>>(nodes: &[S], prefix: &str) -> LockManager {
    connect(cluster(nodes).key_prefix(prefix)).await
}

/// A fault proxy in front of each of a cluster's `nodes`, which announce it
/// (`cluster-announce-port`): once this returns, every node's slot map names the proxies,
/// so that every client of the cluster, whichever seeds it was given, talks through them.
pub fn announce_proxies(nodes: &[RedisServer]) -> Vec<FaultProxy> {
    let proxies: Vec<FaultProxy> = (nodes.iter())
        .map(|node| FaultProxy::start(node.port()).expect("a proxy starts"))
        .collect();
    for (node, proxy) in nodes.iter().zip(&proxies) {
        let port = proxy.port().to_string();
        node.command(&["CONFIG", "SET", "cluster-announce-port", &port])
            .expect("CONFIG SET cluster-announce-port");
    }
    let ports: Vec<String> = proxies.iter().map(|p| format!(":{}", p.port())).collect();
    let started = Instant::now();
    // Every node's slot map names the proxies once the change has been gossiped.
    while !nodes.iter().all(|node| {
        let slots = node.command(&["CLUSTER", "SLOTS"]).unwrap_or_default();
        ports
            .iter()
            .all(|port| slots.lines().any(|l| l.trim() == port))
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the cluster's slot map never named the proxies"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    proxies
}

/// The master that the Sentinels at `sentinels` know as `name`.
pub fn sentinel<S: Borrow<RedisServer>>(sentinels: &[S], name: &str) -> LockManagerBuilder {
    LockManager::builder().sentinel(sentinels.iter().map(|s| s.borrow().url()), name)
}

/// A master with one replica, watched by three Sentinels (quorum 2) that know it as `name`.
pub struct SentinelGroup {
    pub master: Arc<RedisServer>,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
    pub name: &'static str,
}

impl SentinelGroup {
    /// Starts the master, its replica and the Sentinels. They have not necessarily found each
    /// other yet: see `wait_until_ready`.
    pub fn start(name: &'static str) -> Self {
        let master = Arc::new(RedisServer::start().expect("redis-server starts"));
        let replica = RedisServer::start_replica_of(&master).expect("the replica starts");
        let sentinels = (0..3)
            .map(|_| RedisServer::start_sentinel(&master, name, 2).expect("a Sentinel starts"))
            .collect();
        Self {
            master,
            replica,
            sentinels,
            name,
        }
    }

    /// Waits (bounded) until every Sentinel knows the replica and the other Sentinels, which a
    /// failover needs.
    pub fn wait_until_ready(&self) {
        let started = Instant::now();
        loop {
            let ready = self.sentinels.iter().all(|s| {
                let others = s
                    .command(&["SENTINEL", "SENTINELS", self.name])
                    .unwrap_or_default();
                let replicas = s
                    .command(&["SENTINEL", "REPLICAS", self.name])
                    .unwrap_or_default();
                others.matches("runid").count() == self.sentinels.len() - 1
                    && replicas.contains("slave")
            });
            if ready {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "Sentinels did not find each other"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master, through every Sentinel of the group.
    pub fn builder(&self) -> LockManagerBuilder {
        sentinel(&self.sentinels, self.name)
    }
}
