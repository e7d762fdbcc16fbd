//! How a node reaches the data: its topology (one server, a Sentinel-managed master, or a
//! Cluster), decided when the node is made, and the connection that topology opens for each
//! runtime. Everything that differs between the topologies is decided here, so that the
//! operations on a node never ask which one they run on.

use std::sync::Arc;

use futures_util::future::join_all;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisError, RedisResult, Value};

use super::cluster::by_slot;
use super::link::{Link, Query};
use super::node::{Node, bounded};
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
    pub(super) async fn open(&self, node: &Node) -> RedisResult<Conn> {
        match self {
            Self::Server | Self::Sentinel(_) => Ok(Conn::Server(node.link())),
            Self::Cluster(cluster) => {
                // Boxed: once per runtime, and its state would otherwise weigh on every
                // operation's future.
                let connect = Box::pin(cluster.get_async_connection());
                Ok(Conn::Cluster(
                    bounded(node.pool.connect_timeout * 3, connect).await?,
                ))
            }
        }
    }

    /// Hears of a request that failed: an error that may mean a failover makes a
    /// Sentinel-managed node look for the current master (see [`Sentinel::notice`]).
    pub(super) fn failed(&self, node: &Node, error: &RedisError) {
        if let Self::Sentinel(sentinel) = self {
            sentinel.notice(node, error);
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

    /// Runs `call` on the indices of `keys` (one call for them all; on Cluster one per hash
    /// slot, all slots at once) and puts each answer back at its key's index.
    pub(super) async fn per_slot<'k, F, Fut>(
        &self,
        keys: impl ExactSizeIterator<Item = &'k str>,
        call: F,
    ) -> RedisResult<Vec<bool>>
    where
        F: Fn(&[usize]) -> Fut,
        Fut: Future<Output = RedisResult<Vec<bool>>>,
    {
        let count = keys.len();
        let groups = self
            .slot_groups(keys)
            .unwrap_or_else(|| vec![(0..count).collect()]);
        let answers = join_all(groups.iter().map(|group| call(group))).await;
        let mut each = vec![false; count];
        for (group, answer) in groups.iter().zip(answers) {
            for (&at, yes) in group.iter().zip(answer?) {
                each[at] = yes;
            }
        }
        Ok(each)
    }
}

/// A connection of one runtime, as the node's route opened it: to one server, or to a whole
/// Cluster.
#[derive(Clone)]
pub(super) enum Conn {
    /// To the server, or the master Sentinel named.
    Server(Link),
    /// To the Cluster: each command goes to the master of its key's slot.
    Cluster(ClusterConnection),
}

/// What bounds the wait for an answer on a connection.
#[derive(Debug, Clone, Copy)]
pub(super) enum Bounds {
    /// The connection's own response timeout.
    Itself,
    /// A timer around the request.
    Timer,
}

impl Conn {
    /// What bounds the wait for an answer on this connection.
    pub(super) fn bounds(&self) -> Bounds {
        match self {
            Self::Server(_) => Bounds::Itself,
            Self::Cluster(_) => Bounds::Timer,
        }
    }

    /// Sends `cmd` to every master (the server itself, off Cluster) and returns each answer
    /// with the master's address.
    pub(super) async fn each_master(
        &mut self,
        node: &Node,
        cmd: &Cmd,
    ) -> RedisResult<Vec<(String, Value)>> {
        match self {
            Self::Cluster(conn) => {
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let answers = node.bounded(conn.route_command(cmd.clone(), all)).await;
                answers.and_then(|a| Ok(redis::from_redis_value(a)?))
            }
            Self::Server(_) => {
                let master = node.client().get_connection_info().addr().to_string();
                let answer = node.watch(node.bounded(cmd.query_async(self)).await);
                answer.map(|answer| vec![(master, answer)])
            }
        }
    }

    /// Every key matching `pattern`, by SCAN on the server (on Cluster: on every master, as
    /// [`Node::ask_masters`] lists them); a key may come more than once.
    pub(super) async fn scan(&mut self, node: &Node, pattern: &str) -> RedisResult<Vec<String>> {
        let mut found = Vec::new();
        match self {
            Self::Server(_) => {
                let conn = self.clone();
                walk(pattern, &mut found, |scan| {
                    let mut conn = conn.clone();
                    async move { node.watch(node.bounded(scan.query_async(&mut conn)).await) }
                })
                .await?;
            }
            Self::Cluster(conn) => {
                let (_, masters) = node.ask_masters(&[redis::cmd("PING")]).await?;
                for (address, _) in masters {
                    let Some((host, port)) = address
                        .rsplit_once(':')
                        .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
                    else {
                        continue;
                    };
                    walk(pattern, &mut found, |scan| {
                        let mut conn = conn.clone();
                        let at = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.clone(),
                            port,
                        });
                        async move {
                            let answer = node.bounded(conn.route_command(scan, at)).await?;
                            Ok(redis::from_redis_value(answer)?)
                        }
                    })
                    .await?;
                }
            }
        }
        Ok(found)
    }
}

/// Walks one server's keys with SCAN from cursor 0, each step sent by `send`, and adds those
/// matching `pattern` to `found`.
async fn walk<F, Fut>(pattern: &str, found: &mut Vec<String>, mut send: F) -> RedisResult<()>
where
    F: FnMut(Cmd) -> Fut,
    Fut: Future<Output = RedisResult<(u64, Vec<String>)>>,
{
    let mut cursor = 0u64;
    loop {
        let scan = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .to_owned();
        let (next, keys) = send(scan).await?;
        found.extend(keys);
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        Box::pin(self.send_command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        Box::pin(self.send_commands(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(link) => link.db(),
            Self::Cluster(conn) => conn.get_db(),
        }
    }
}

/// A server's link is awaited in place; the Cluster's connection boxes its requests.
impl Query for Conn {
    async fn send_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            Self::Server(link) => link.send(cmd).await,
            Self::Cluster(conn) => redis::aio::ConnectionLike::req_packed_command(conn, cmd).await,
        }
    }

    async fn send_commands(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Self::Server(link) => link.send_pipeline(pipeline, offset, count).await,
            Self::Cluster(conn) => {
                redis::aio::ConnectionLike::req_packed_commands(conn, pipeline, offset, count).await
            }
        }
    }
}
