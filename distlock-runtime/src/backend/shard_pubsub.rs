//! Sharded pub/sub on a Cluster (the waiting side is `waiters::shards`): which master owns
//! each slot, as the Cluster says now, and a subscription connection to one master.

use std::io;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ProtocolVersion, PushInfo, RedisError, RedisResult,
    Value,
};
use tokio::sync::mpsc::UnboundedSender;

use super::cluster::slot_ranges;
use super::connect::same_transport;
use super::node::Node;
use super::pool::{Conn, bounded};

/// The `(first, last, master address)` of each slot range of a Cluster.
pub(crate) type SlotRanges = Vec<(u16, u16, String)>;

impl Node {
    /// The master of each slot range, from `CLUSTER SLOTS`: asked of each of `masters` in
    /// turn on a connection of its own, closed after (the masters of the last map, those
    /// reachable lately first), then of the first seed; each bounded by the response timeout,
    /// so a master that does not answer holds up only its own turn. Not on a subscription
    /// connection, where the client could take a push for the answer. Only when none answers
    /// is the Cluster connection asked (which opens this runtime's lanes if it had none).
    pub(crate) async fn slot_masters(&self, masters: &[String]) -> RedisResult<SlotRanges> {
        let slots = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let mut last = None;
        let seed = self.seed_address();
        for master in masters.iter().map(String::as_str).chain(seed.as_deref()) {
            let asked = async {
                let mut conn = self.connect_to(master, None).await?;
                self.bounded(slots.query_async::<Value>(&mut conn)).await
            };
            match asked.await {
                Ok(answer) => match slot_ranges(&answer) {
                    ranges if !ranges.is_empty() => return Ok(ranges),
                    _ => continue,
                },
                Err(error) => last = Some(error),
            }
        }
        // None of them: the Cluster connection knows every seed, and finds a node that answers
        // (its lanes are opened on this runtime if they were not yet).
        let Conn::Cluster(mut lanes) = self.conn().await? else {
            return Err(last.unwrap_or_else(|| io::Error::other("not a Cluster").into()));
        };
        match self.bounded(lanes.send(&slots)).await {
            Ok(answer) => Ok(slot_ranges(&answer)),
            Err(error) => Err(last.unwrap_or(error)),
        }
    }

    /// `host:port` of the first seed.
    fn seed_address(&self) -> Option<String> {
        match self.pool.client().get_connection_info().addr() {
            ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
                Some(format!("{host}:{port}"))
            }
            _ => None,
        }
    }

    /// A connection to the master at `master` (`host:port`, as the slot map names it) for
    /// `SSUBSCRIBE`: RESP3, whose pushes (messages, `sunsubscribe` when the master gives a
    /// slot away, the connection's end) go to `pushes`; with the credentials, TLS material
    /// and socket settings of every other connection. Bounded by the connect timeout.
    pub(crate) async fn shard_pubsub(
        &self,
        master: &str,
        pushes: UnboundedSender<PushInfo>,
    ) -> RedisResult<MultiplexedConnection> {
        self.connect_to(master, Some(pushes)).await
    }

    /// A RESP3 connection to the node at `master` (`host:port`), whose pushes go to `pushes`
    /// if given; with the credentials, TLS material and socket settings of every other
    /// connection, named as they are. Bounded by the connect timeout.
    async fn connect_to(
        &self,
        master: &str,
        pushes: Option<UnboundedSender<PushInfo>>,
    ) -> RedisResult<MultiplexedConnection> {
        let (host, port) = master
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_owned(), port.parse::<u16>().ok()?)))
            .ok_or_else(|| RedisError::from(io::Error::other("a master without a port")))?;
        let info = self.pool.client().get_connection_info().clone();
        let addr = same_transport(info.addr(), host, port);
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = self
            .pool
            .security
            .client_for(info.set_addr(addr).set_redis_settings(settings))?;
        let mut config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.pool.connect_timeout))
            .set_response_timeout(Some(self.pool.response_timeout));
        if let Some(pushes) = pushes {
            config = config.set_push_sender(pushes);
        }
        let connect = client.get_multiplexed_async_connection_with_config(&config);
        let mut conn = bounded(self.pool.connect_timeout, connect).await?;
        // Named, as every connection of the manager; a refusal costs nothing more.
        let setname = redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&*self.pool.client_name)
            .to_owned();
        if let Err(error) = self
            .bounded(setname.query_async::<redis::Value>(&mut conn))
            .await
        {
            tracing::debug!(%error, "the subscription connection could not be named");
        }
        Ok(conn)
    }
}
