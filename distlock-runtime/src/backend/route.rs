//! How a node reaches the data: its topology (one server, a Sentinel-managed master, or a
//! Cluster), decided when the node is made, and the connection that topology opens for each
//! runtime (a [`Conn`], kept by the node's pool). Everything that differs between the
//! topologies is decided here, so that the operations on a lock never ask which one they run
//! on; only the inspector's look at every master (in `node/`) does.

use std::sync::Arc;

use futures_util::future::join_all;
use redis::cluster::ClusterClient;
use redis::{RedisError, RedisResult};

use super::cluster::{Lanes, by_slot};
use super::pool::{Conn, Pool, bounded};
use super::sentinel::Sentinel;

/// Where a node's commands go.
pub(super) enum Route {
    /// One server, at the node's address.
    Server,
    /// The master that the Sentinels name; the node's address follows it through failovers.
    Sentinel(Arc<Sentinel>),
    /// A Redis Cluster: connections follow the slot map (MOVED, ASK, failovers). The node's
    /// address is the first seed, which serves pub/sub.
    Cluster(Box<ClusterClient>),
}

impl Route {
    /// Opens the connection of the current runtime: a reconnecting link to the server, or a
    /// slot-aware connection to the Cluster.
    pub(super) async fn open(&self, pool: &Arc<Pool>) -> RedisResult<Conn> {
        match self {
            Self::Server | Self::Sentinel(_) => Ok(Conn::Server(pool.link())),
            Self::Cluster(cluster) => {
                // Boxed: once per runtime, and its state would otherwise weigh on every
                // operation's future.
                let connect = Box::pin(Lanes::open(cluster));
                Ok(Conn::Cluster(
                    bounded(pool.connect_timeout * 3, connect).await?,
                ))
            }
        }
    }

    /// Hears of a request that failed: an error that may mean a failover makes a
    /// Sentinel-managed node look for the current master (see [`Sentinel::notice`]).
    pub(super) fn failed(&self, pool: &Arc<Pool>, error: &RedisError) {
        if let Self::Sentinel(sentinel) = self {
            sentinel.notice(pool, error);
        }
    }

    /// Whether the route leads to one server, whose run_id tells when it restarted (a
    /// Cluster is many servers).
    pub(super) fn one_server(&self) -> bool {
        !matches!(self, Self::Cluster(_))
    }

    /// On Cluster, the indices of `keys` grouped by hash slot, in the one order every client
    /// takes them in (see [`by_slot`]): a script touches one slot. `None` elsewhere: one call
    /// takes every key.
    pub(super) fn slot_groups<'k>(
        &self,
        keys: impl Iterator<Item = &'k str>,
    ) -> Option<Vec<Vec<usize>>> {
        matches!(self, Self::Cluster(_)).then(|| by_slot(keys))
    }

    /// Makes `call` once per slot group of `keys` (once for them all off Cluster), all at
    /// once: how many keys there are, the groups, and each group's answer.
    async fn each_slot<'k, F, Fut>(
        &self,
        keys: impl ExactSizeIterator<Item = &'k str>,
        call: F,
    ) -> (usize, Vec<Vec<usize>>, Vec<RedisResult<Vec<bool>>>)
    where
        F: Fn(&[usize]) -> Fut,
        Fut: Future<Output = RedisResult<Vec<bool>>>,
    {
        let count = keys.len();
        let groups = self
            .slot_groups(keys)
            .unwrap_or_else(|| vec![(0..count).collect()]);
        let answers = join_all(groups.iter().map(|group| call(group))).await;
        (count, groups, answers)
    }

    /// Runs `call` on the indices of `keys` (one call for them all; on Cluster one per hash
    /// slot, all slots at once) and puts each answer back at its key's index. Every slot's call
    /// is made, and each one's work is done on its master, but one slot's failure is the
    /// answer: a set given back in part reports the error (see
    /// [`per_slot_each`](Self::per_slot_each) for answers kept per slot).
    pub(super) async fn per_slot<'k, F, Fut>(
        &self,
        keys: impl ExactSizeIterator<Item = &'k str>,
        call: F,
    ) -> RedisResult<Vec<bool>>
    where
        F: Fn(&[usize]) -> Fut,
        Fut: Future<Output = RedisResult<Vec<bool>>>,
    {
        let (count, groups, answers) = self.each_slot(keys, call).await;
        let mut each = vec![false; count];
        for (group, answer) in groups.iter().zip(answers) {
            for (&at, yes) in group.iter().zip(answer?) {
                each[at] = yes;
            }
        }
        Ok(each)
    }

    /// What [`per_slot`](Self::per_slot) does, with each slot's answer kept apart: `None` at
    /// the keys of a slot whose call failed (its master cut off or frozen), the answers of
    /// the other slots as they came. An error only when every call failed (the first one's),
    /// so that one master's trouble never decides the keys of another.
    pub(super) async fn per_slot_each<'k, F, Fut>(
        &self,
        keys: impl ExactSizeIterator<Item = &'k str>,
        call: F,
    ) -> RedisResult<Vec<Option<bool>>>
    where
        F: Fn(&[usize]) -> Fut,
        Fut: Future<Output = RedisResult<Vec<bool>>>,
    {
        let (count, groups, answers) = self.each_slot(keys, call).await;
        let mut each = vec![None; count];
        let mut first_error = None;
        let mut answered = false;
        for (group, answer) in groups.iter().zip(answers) {
            match answer {
                Ok(answer) => {
                    answered = true;
                    for (&at, yes) in group.iter().zip(answer) {
                        each[at] = Some(yes);
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, keys = group.len(), "one slot's call failed");
                    first_error.get_or_insert(error);
                }
            }
        }
        match first_error {
            Some(error) if !answered => Err(error),
            _ => Ok(each),
        }
    }
}
