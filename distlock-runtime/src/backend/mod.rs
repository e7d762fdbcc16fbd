//! Where locks live: the Redis deployment behind a manager.
//!
//! One room per topology: `node/` is one endpoint (a server, with `sentinel.rs` for a
//! Sentinel-managed master and `cluster.rs` for a Cluster, both reached through one `Node`,
//! whose `route.rs` decides all that differs between the three, over the connections that
//! `pool.rs` keeps), `redlock.rs` the majority rule over independent masters, `messages.rs` what an
//! operation names and sends, and `sets.rs` sets of locks taken together. [`Backend`] picks
//! the room; [`Capabilities`] says, once, what the deployment can do.
//!
//! Every method here runs on the manager's driver runtime (see `driver`) and is bounded by the
//! manager's response timeout, including the time spent waiting for a reconnect.

use std::time::Duration;

use redis::RedisResult;

mod cluster;
mod connect;
mod link;
mod messages;
mod node;
mod pool;
mod redlock;
mod route;
mod sentinel;
mod sets;
mod shard_pubsub;

pub(crate) use cluster::slot_of;
pub(crate) use connect::ConnectOptions;
pub(crate) use messages::{
    AcquireAnswer, AcquireRequest, FAIR_REFRESH, FairQueue, FairRelease, HoldIds, Renewal, Shape,
    token_text,
};
pub(crate) use node::{Node, denied};
pub(crate) use sets::{SetKey, SetRequest};
pub(crate) use shard_pubsub::SlotRanges;

use crate::scripts;
use messages::HoldRef;
use redlock::RedLock;

/// Where locks live: one endpoint (a server, a Sentinel-managed master, a Cluster), or
/// independent masters under the RedLock rules.
#[derive(Clone, Debug)]
pub(crate) struct Backend {
    deployment: Deployment,
}

/// The endpoints behind a backend: one node (a server, a Sentinel-managed master or a
/// Cluster), or independent masters under the RedLock rules.
#[derive(Clone, Debug)]
enum Deployment {
    Node(Node),
    RedLock(RedLock),
}

/// What the deployment behind a manager can do, as far as the lock kinds and the fast paths
/// are concerned. Decided at `build()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// A release may hand a plain lock straight to a local waiter with one conditional swap:
    /// one endpoint, whose grants need nothing more. Not with RedLock (a grant takes a
    /// majority) nor with `sync_replicas` (a grant takes a WAIT).
    pub(crate) hand_off: bool,
    /// Fair locks: one queue per key. Not with RedLock, whose masters would each keep one.
    pub(crate) fair: bool,
    /// Fencing tokens: one counter per key. Not with RedLock, whose masters count apart.
    pub(crate) fencing: bool,
    /// Read-write locks and semaphores. Not with RedLock.
    pub(crate) shared_kinds: bool,
    /// Guarded writes: one server checks the owner and runs the commands. Not with RedLock,
    /// where no single master can decide who holds the lock.
    pub(crate) guarded_writes: bool,
    /// The keys of one script must share a hash slot (Cluster).
    pub(crate) one_slot: bool,
}

/// Runs the arm of the backend's deployment. The RedLock arm is boxed: its fan-out over the
/// masters would otherwise make every caller's future as large as its own.
macro_rules! each {
    ($self:ident, $node:ident => $one:expr, $masters:ident => $redlock:expr) => {
        match &$self.deployment {
            Deployment::Node($node) => $one,
            Deployment::RedLock($masters) => Box::pin(async move { $redlock }).await,
        }
    };
}

impl Backend {
    /// Connects to a Redis Cluster through `seeds`.
    pub(crate) async fn connect_cluster(
        seeds: &[String],
        options: ConnectOptions,
    ) -> RedisResult<Self> {
        let node = Node::cluster(seeds, options)?;
        node.load_scripts().await?;
        Ok(Self::of_node(node))
    }

    /// Connects to the master that the Sentinels at `sentinels` name `master`, and follows it
    /// through failovers.
    pub(crate) async fn connect_sentinel(
        sentinels: &[String],
        master: &str,
        options: ConnectOptions,
    ) -> RedisResult<Self> {
        let node = Node::sentinel(sentinels, master, options).await?;
        node.load_scripts().await?;
        Ok(Self::of_node(node))
    }

    /// Connects to one server.
    pub(crate) async fn connect_server(url: &str, options: ConnectOptions) -> RedisResult<Self> {
        let node = Node::server(url, options)?;
        node.load_scripts().await?;
        Ok(Self::of_node(node))
    }

    /// Connects to independent masters, a majority of which must answer (RedLock).
    pub(crate) async fn connect_redlock(
        urls: &[String],
        options: ConnectOptions,
    ) -> RedisResult<Self> {
        let masters = RedLock::connect(urls, options).await?;
        Ok(Self {
            deployment: Deployment::RedLock(masters),
        })
    }

    fn of_node(node: Node) -> Self {
        Self {
            deployment: Deployment::Node(node),
        }
    }

    /// What this deployment can do.
    pub(crate) fn capabilities(&self) -> Capabilities {
        match &self.deployment {
            Deployment::Node(node) => Capabilities {
                hand_off: !node.syncs_replicas(),
                fair: true,
                fencing: true,
                shared_kinds: true,
                guarded_writes: true,
                one_slot: !node.route.one_server(),
            },
            Deployment::RedLock(_) => Capabilities {
                hand_off: false,
                fair: false,
                fencing: false,
                shared_kinds: false,
                guarded_writes: false,
                one_slot: false,
            },
        }
    }

    /// Every endpoint: the one, or each RedLock master.
    pub(crate) fn nodes(&self) -> &[Node] {
        match &self.deployment {
            Deployment::Node(node) => std::slice::from_ref(node),
            Deployment::RedLock(masters) => &masters.nodes,
        }
    }

    /// The node the inspector reads (the first master of a RedLock).
    pub(crate) fn inspected(&self) -> &Node {
        &self.nodes()[0]
    }

    /// How long after it was sent a request that went unanswered may still reach a server:
    /// until the kernel gives up on its connection (which was dropped when the answer timed
    /// out, and still retransmits what it holds), plus a response timeout.
    pub(crate) fn late_delivery(&self) -> Duration {
        let response = self.nodes()[0].pool.response_timeout;
        crate::security::socket_timeouts(response).unacknowledged + response
    }

    /// The masters after the first (a RedLock's others; none otherwise).
    pub(crate) fn others(&self) -> &[Node] {
        &self.nodes()[1..]
    }

    /// One acquire attempt.
    pub(crate) async fn acquire(&self, req: &AcquireRequest) -> RedisResult<AcquireAnswer> {
        // Boxed: the quorum's future is large, and every single-endpoint lock would carry it.
        each!(self, node => node.acquire(req).await, masters => Box::pin(masters.acquire(req)).await)
    }

    /// Gives back one hold; with RedLock, `false` only when a majority did not hold it.
    pub(crate) async fn release(&self, ids: &HoldIds, keep: Duration) -> RedisResult<bool> {
        each!(self,
            node => node.release(ids, keep).await,
            masters => masters.release(ids, keep).await)
    }

    /// Gives back a plain lock: `None` when the token did not hold it, otherwise how many
    /// subscribers (managers with waiters) heard the wake-up (0 with RedLock, which does not
    /// count them).
    pub(crate) async fn release_plain(&self, ids: &HoldIds) -> RedisResult<Option<u64>> {
        each!(self,
            node => node.release_plain(ids).await,
            masters => Ok(masters.release(ids, Duration::ZERO).await?.then_some(0)))
    }

    /// Releases a fair lock, and leaves its queue (see [`Node::release_fair`]). Fair locks
    /// live on one endpoint: RedLock refuses them.
    pub(crate) async fn release_fair(&self, ids: &HoldIds) -> RedisResult<FairRelease> {
        each!(self,
            node => node.release_fair(ids).await,
            _masters => Ok(FairRelease::NotHeld))
    }

    /// Passes a plain lock to the owner `next` (see [`Capabilities::hand_off`]): `false`
    /// when it did not own it.
    pub(crate) async fn hand_off(
        &self,
        ids: &HoldIds,
        next: &str,
        lease: Duration,
    ) -> RedisResult<bool> {
        let hand_off = scripts::HandOff {
            lock: &ids.lock,
            token: &ids.token,
            next,
            lease,
        };
        each!(self,
            node => node.hand_off(&hand_off).await,
            _masters => Ok(false))
    }

    /// Sets the lease; with RedLock, `true` when a majority set it.
    pub(crate) async fn extend(
        &self,
        lock: &str,
        shared: bool,
        token: &str,
        lease: Duration,
    ) -> RedisResult<bool> {
        let hold = HoldRef {
            lock,
            shared,
            token,
        };
        each!(self,
            node => node.extend(hold, lease).await,
            masters => masters.extend(hold, lease).await)
    }

    /// Renews a batch; with RedLock, a lease counts as renewed on a majority. On Cluster,
    /// `None` for the items of a slot whose master did not answer while other slots did: a
    /// lease on a healthy master is decided by its own master alone.
    pub(crate) async fn renew(&self, items: &[Renewal<'_>]) -> RedisResult<Vec<Option<bool>>> {
        each!(self,
            node => node.renew(items).await,
            masters => Ok(masters.renew(items).await?.into_iter().map(Some).collect()))
    }

    /// Whether the token holds the lock (on a majority).
    pub(crate) async fn is_held(&self, lock: &str, shared: bool, token: &str) -> RedisResult<bool> {
        let hold = HoldRef {
            lock,
            shared,
            token,
        };
        each!(self,
            node => node.is_held(hold).await,
            masters => masters.is_held(hold).await)
    }

    /// Whether the token of `ids` holds its plain lock (the string form; on a majority): the
    /// check of a cohort's run, one `GET` per endpoint.
    pub(crate) async fn is_held_plain(&self, ids: &HoldIds) -> RedisResult<bool> {
        let (lock, token) = (&ids.lock, &ids.token);
        each!(self,
            node => node.is_held_plain(lock, token).await,
            masters => masters.is_held_plain(lock, token).await)
    }

    /// Takes back a waiting writer's intent (see [`Node::withdraw_intent`]). RedLock has no
    /// read-write locks, hence no intents.
    pub(crate) async fn withdraw_intent(
        &self,
        intent: &str,
        wake: &str,
        token: &str,
    ) -> RedisResult<bool> {
        let withdraw = scripts::WithdrawIntent {
            intent,
            wake,
            token,
        };
        each!(self,
            node => node.withdraw_intent(&withdraw).await,
            _masters => Ok(false))
    }

    /// One attempt at a set of locks taken together.
    pub(crate) async fn acquire_set(
        &self,
        req: &SetRequest,
    ) -> RedisResult<AcquireAnswer<Vec<u64>>> {
        each!(self,
            node => node.acquire_set(req).await,
            masters => masters.acquire_set(req).await)
    }

    /// Gives back a set: one answer per lock.
    pub(crate) async fn release_set(&self, req: &SetRequest) -> RedisResult<Vec<bool>> {
        each!(self,
            node => node.release_set(req).await,
            masters => masters.release_set(req).await)
    }

    /// A pub/sub connection for wake-ups (on the first master of a RedLock).
    pub(crate) async fn pubsub(&self) -> RedisResult<redis::aio::PubSub> {
        self.nodes()[0].pubsub().await
    }

    /// Whether wake-ups go per shard (`SPUBLISH`, `SSUBSCRIBE`): on a Cluster whose servers
    /// have them.
    pub(crate) fn sharded_wakes(&self) -> bool {
        match &self.deployment {
            Deployment::Node(node) => node.wakes() == scripts::Wakes::Sharded,
            Deployment::RedLock(_) => false,
        }
    }

    /// The master of each slot range of the Cluster (see [`Node::slot_masters`]).
    pub(crate) async fn slot_masters(&self, masters: &[String]) -> RedisResult<SlotRanges> {
        self.nodes()[0].slot_masters(masters).await
    }

    /// A subscription connection to the Cluster master at `master` (see
    /// [`Node::shard_pubsub`]).
    pub(crate) async fn shard_pubsub(
        &self,
        master: &str,
        pushes: tokio::sync::mpsc::UnboundedSender<redis::PushInfo>,
    ) -> RedisResult<redis::aio::MultiplexedConnection> {
        self.nodes()[0].shard_pubsub(master, pushes).await
    }

    /// Sends `cmd` to every master and returns each node's answers (see
    /// [`Node::ask_masters`]).
    pub(crate) async fn ask_masters(
        &self,
        cmds: &[redis::Cmd],
    ) -> Vec<RedisResult<(usize, Vec<(String, redis::Value)>)>> {
        each!(self,
            node => vec![node.ask_masters(cmds).await],
            masters => masters.ask_masters(cmds).await)
    }
}
