//! Sharded pub/sub on a Cluster (the waiting side is `waiters::shards`): which master owns
//! each slot, as the Cluster says now, and a subscription connection to one master.

use std::io;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ProtocolVersion, PushInfo, RedisError, RedisResult,
};
use tokio::sync::mpsc::UnboundedSender;

use super::cluster::slot_ranges;
use super::node::Node;
use super::pool::{Conn, bounded};

/// The `(first, last, master address)` of each slot range of a Cluster.
pub(crate) type SlotRanges = Vec<(u16, u16, String)>;

impl Node {
    /// The master of each slot range, from `CLUSTER SLOTS`: asked of the master of each of
    /// `ask` in turn (a slot each, on that slot's own connection, so that a master that does
    /// not answer holds up only its own turn, within the response timeout), then of each
    /// master as the connections were opened, then of any node.
    pub(crate) async fn slot_masters(&self, ask: &[u16]) -> RedisResult<SlotRanges> {
        let Conn::Cluster(mut lanes) = self.conn().await? else {
            return Err(
                io::Error::other("slot masters asked of a node that is not a Cluster").into(),
            );
        };
        let slots = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
        let mut last = None;
        let firsts = lanes.first_slots();
        for &slot in ask.iter().chain(firsts.iter()) {
            match self.bounded(lanes.send_to_slot(slot, &slots)).await {
                Ok(answer) => match slot_ranges(&answer) {
                    ranges if !ranges.is_empty() => return Ok(ranges),
                    _ => continue,
                },
                Err(error) => last = Some(error),
            }
        }
        match self.bounded(lanes.send(&slots)).await {
            Ok(answer) => Ok(slot_ranges(&answer)),
            Err(error) => Err(last.unwrap_or(error)),
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
        let (host, port) = master
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_owned(), port.parse::<u16>().ok()?)))
            .ok_or_else(|| RedisError::from(io::Error::other("a master without a port")))?;
        let info = self.pool.client().get_connection_info().clone();
        let addr = match info.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = self
            .pool
            .security
            .tls_client(info.set_addr(addr).set_redis_settings(settings))?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.pool.connect_timeout))
            .set_response_timeout(Some(self.pool.response_timeout))
            .set_push_sender(pushes);
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
