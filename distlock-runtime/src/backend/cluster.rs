//! Redis Cluster: one slot-aware connection per runtime; every lock's keys share its hash
//! slot, so each operation goes to the master of that slot.

use std::io;

use redis::cluster::ClusterClient;
use redis::{RedisError, RedisResult};

use super::node::{ConnectOptions, Node};

impl Node {
    /// A Redis Cluster reached through `seeds`; nothing is sent until it is used.
    pub(crate) fn cluster(seeds: &[String], options: ConnectOptions) -> RedisResult<Self> {
        let first = seeds
            .first()
            .ok_or_else(|| RedisError::from(io::Error::other("no Cluster seed given")))?;
        let builder = ClusterClient::builder(seeds.to_vec())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.response_timeout);
        let cluster = options.security.cluster(builder).build()?;
        Self::with(first.as_str(), options, None, Some(cluster))
    }
}
