//! A deployment the scale tables measure: one server, or a Cluster's nodes, and how a row
//! finds a manager and a key on a given master.

use distlock::LockManager;
use distlock::testing::RedisServer;

use super::PREFIX;

/// The slots a Cluster shares out.
const SLOTS: usize = 16384;

/// A deployment measured: one server, or a Cluster's nodes, its masters first and then their
/// replicas (as [`RedisServer::start_cluster_with_replicas`] returns them).
pub(super) struct Deployment<'a> {
    pub(super) name: String,
    pub(super) nodes: &'a [RedisServer],
    pub(super) masters: usize,
    pub(super) cluster: bool,
}

impl Deployment<'_> {
    /// A manager of this deployment, seeded with every master.
    pub(super) async fn manager(&self) -> LockManager {
        let builder = LockManager::builder().key_prefix(PREFIX);
        let builder = if self.cluster {
            builder.cluster(self.nodes[..self.masters].iter().map(RedisServer::url))
        } else {
            builder.redis_url(self.nodes[0].url())
        };
        builder.build().await.expect("manager")
    }

    /// The master whose key the contended rows hand around: the last one, so that the first
    /// seed (where a manager's first connections go) is among the others.
    pub(super) fn own(&self) -> usize {
        self.masters - 1
    }

    /// A lock name starting with `stem` whose key lives on master `master`, as the slots
    /// were first shared out (even ranges in master order).
    pub(super) fn key_on(&self, locks: &LockManager, stem: &str, master: usize) -> String {
        if !self.cluster {
            return format!("{stem}0");
        }
        (0..)
            .map(|n| format!("{stem}{n}"))
            .find(|name| {
                let reply = self.nodes[0]
                    .command(&["CLUSTER", "KEYSLOT", &locks.redis_key(name)])
                    .unwrap_or_default();
                let slot: usize = reply.trim().trim_start_matches(':').parse().unwrap_or(0);
                (0..self.masters).find(|&i| slot < (i + 1) * SLOTS / self.masters) == Some(master)
            })
            .expect("some name lands on every master")
    }
}
