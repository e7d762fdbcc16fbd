//! The deployments the seams are checked on: one server, a Cluster of three masters, a master
//! behind Sentinels, RedLock over three masters; and, for the late attempts, the same behind
//! fault proxies.

use std::sync::Arc;
use std::time::Duration;

use distlock::testing::{Fault, FaultProxy, RedisServer};
use distlock::{LockManager, LockManagerBuilder};

use crate::support::{self, SentinelGroup};

/// The servers of one deployment.
enum Servers {
    Single(Arc<RedisServer>),
    Cluster(Vec<RedisServer>),
    Sentinel(Box<SentinelGroup>),
    RedLock(Vec<RedisServer>),
}

/// A deployment, and what a test needs of it beside its managers: removing a key behind
/// distlock's back, and listing what is left.
pub(super) struct Deployment {
    servers: Servers,
    /// A proxy in front of every data node, for [`through_proxies`](Self::through_proxies).
    proxies: Vec<FaultProxy>,
}

impl Deployment {
    /// The test binary's shared server.
    pub(super) fn single() -> Self {
        Self::of(Servers::Single(support::shared_server()))
    }

    /// One server of its own (its faults reach no other test).
    pub(super) fn own_server() -> Self {
        Self::of(Servers::Single(Arc::new(
            RedisServer::start().expect("redis-server starts"),
        )))
    }

    pub(super) fn cluster() -> Self {
        Self::of(Servers::Cluster(
            RedisServer::start_cluster(3).expect("a cluster starts"),
        ))
    }

    pub(super) fn sentinel() -> Self {
        let group = SentinelGroup::start("seams");
        group.wait_until_ready();
        Self::of(Servers::Sentinel(Box::new(group)))
    }

    pub(super) fn redlock() -> Self {
        Self::of(Servers::RedLock(support::redlock_masters(3)))
    }

    fn of(servers: Servers) -> Self {
        Self {
            servers,
            proxies: Vec::new(),
        }
    }

    /// Puts a fault proxy in front of every data node; managers built by
    /// [`proxied`](Self::proxied) talk through them. A Cluster's nodes announce their proxies
    /// (`cluster-announce-port`), so that the slot map leads there too.
    pub(super) fn through_proxies(mut self) -> Self {
        self.proxies = match &self.servers {
            Servers::Cluster(nodes) => support::announce_proxies(nodes),
            _ => (self.data().iter())
                .map(|node| FaultProxy::start(node.port()).expect("a proxy starts"))
                .collect(),
        };
        self
    }

    /// Holds back by `delay` what goes through the proxies from now on; answers how much each
    /// had held back before.
    pub(super) fn hold_back(&self, delay: Duration) -> Vec<u64> {
        for proxy in &self.proxies {
            proxy.set(Fault::Latency(delay));
        }
        self.proxies.iter().map(FaultProxy::delayed).collect()
    }

    /// Once the proxies have held something back since `before` (`what`, in the failure),
    /// lets everything through: on RedLock every master's proxy (an attempt asks them all,
    /// and a majority answered in time would grant it), elsewhere the one the command went to.
    pub(super) async fn pass_once_held(&self, before: &[u64], what: &str) {
        let every = matches!(self.servers, Servers::RedLock(_));
        let held = || {
            let mut each = self.proxies.iter().zip(before);
            let held = |(p, before): (&FaultProxy, &u64)| p.delayed() > *before;
            if every {
                each.all(held)
            } else {
                each.any(held)
            }
        };
        super::until(Duration::from_secs(5), what, held).await;
        for proxy in &self.proxies {
            proxy.set(Fault::Pass);
        }
    }

    /// Waits until everything the proxies held back has been delivered: whether the lock
    /// `key` under `prefix` was seen in Redis meanwhile, or is there now.
    pub(super) async fn seen_until_delivered(&self, prefix: &str, key: &str) -> bool {
        let mut seen = false;
        let delivered = || {
            seen |= self.keys(prefix).iter().any(|k| k == key);
            self.proxies.iter().all(|p| p.held_back() == 0)
        };
        super::until(
            Duration::from_secs(5),
            "everything held back delivered",
            delivered,
        )
        .await;
        seen || self.keys(prefix).iter().any(|k| k == key)
    }

    /// Where the locks live: the server, every Cluster node, the Sentinels' master, or every
    /// RedLock master.
    pub(super) fn data(&self) -> Vec<&RedisServer> {
        match &self.servers {
            Servers::Single(server) => vec![server.as_ref()],
            Servers::Cluster(nodes) | Servers::RedLock(nodes) => nodes.iter().collect(),
            Servers::Sentinel(group) => vec![group.master.as_ref()],
        }
    }

    /// A builder for this deployment (straight to the servers).
    pub(super) fn builder(&self) -> LockManagerBuilder {
        match &self.servers {
            Servers::Single(server) => support::single(server.url()),
            Servers::Cluster(nodes) => support::cluster(nodes),
            Servers::Sentinel(group) => group.builder(),
            Servers::RedLock(masters) => support::redlock(masters),
        }
    }

    /// A builder whose manager talks through the proxies.
    fn proxied(&self) -> LockManagerBuilder {
        let urls = self.proxies.iter().map(FaultProxy::url);
        match &self.servers {
            Servers::Single(_) => support::single(self.proxies[0].url()),
            Servers::Cluster(_) => LockManager::builder().cluster(urls),
            Servers::RedLock(_) => LockManager::builder().redlock(urls),
            Servers::Sentinel(_) => panic!("a Sentinel deployment has no proxies"),
        }
    }

    /// A manager under `prefix` that talks through the proxies, with a response timeout of
    /// 200 ms: what a proxy holds back for longer goes unanswered.
    pub(super) async fn proxied_manager(&self, prefix: &str) -> LockManager {
        let builder = self.proxied().key_prefix(prefix);
        support::connect(builder.response_timeout(Duration::from_millis(200))).await
    }

    /// A manager under `prefix`, with short timeouts.
    pub(super) async fn manager(&self, prefix: &str) -> LockManager {
        support::connect(support::quick(self.builder(), prefix)).await
    }

    /// Whether locks here can carry fencing tokens (not on RedLock).
    pub(super) fn fences(&self) -> bool {
        !matches!(self.servers, Servers::RedLock(_))
    }

    /// Removes the lock `key` under `prefix` behind distlock's back, as an operator or an
    /// eviction would, wherever it lives.
    pub(super) fn delete(&self, prefix: &str, key: &str) {
        let name = format!("{prefix}{{{key}}}");
        for node in self.data() {
            // A Cluster node that does not own the slot answers with a redirection.
            let _ = node.command(&["DEL", &name]);
        }
        assert!(
            !self.keys(prefix).contains(&name),
            "{name} is still there after DEL"
        );
    }

    /// The keys under `prefix`, on every data node.
    pub(super) fn keys(&self, prefix: &str) -> Vec<String> {
        (self.data().into_iter())
            .flat_map(|node| support::keys(node, prefix))
            .collect()
    }
}
