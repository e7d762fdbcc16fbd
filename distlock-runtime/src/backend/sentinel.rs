//! Sentinel: the master that the Sentinels name, followed through failovers.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::{ConnectionInfo, IntoConnectionInfo, RedisError, RedisResult};
use tokio::runtime;

use super::connect::{ConnectOptions, same_transport};
use super::pool::{Pool, bounded};
use crate::security::Security;

/// Where a Sentinel-managed master is found.
pub(super) struct Sentinel {
    pub(super) sentinels: Vec<String>,
    pub(super) master: String,
    pub(super) refreshing: AtomicBool,
    pub(super) security: Arc<Security>,
}

impl Sentinel {
    /// Where the Sentinels at `sentinels` find the master they name `master`, and the master
    /// they name now, reached with `options`.
    pub(super) async fn find(
        sentinels: &[String],
        master: &str,
        options: &ConnectOptions,
    ) -> RedisResult<(ConnectionInfo, Self)> {
        let source = Self {
            sentinels: sentinels.to_vec(),
            master: master.to_owned(),
            refreshing: AtomicBool::new(false),
            security: options.security.clone(),
        };
        let master = source.resolve(options.connect_timeout).await?;
        Ok((master, source))
    }

    /// Hears of a failed request on the connections of `pool`: an error that may mean a
    /// failover makes it ask the Sentinels for the current master, in the background, unless
    /// it is asking already.
    pub(super) fn notice(self: &Arc<Self>, pool: &Arc<Pool>, error: &RedisError) {
        let failover = error.is_io_error()
            || error.is_timeout()
            || error.is_connection_refusal()
            || error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly);
        if failover && !self.refreshing.swap(true, Ordering::AcqRel) {
            let (sentinel, pool) = (Arc::clone(self), Arc::clone(pool));
            if let Ok(runtime) = runtime::Handle::try_current() {
                drop(runtime.spawn(async move { sentinel.follow(&pool).await }));
            } else {
                self.refreshing.store(false, Ordering::Release);
            }
        }
    }

    /// Asks the Sentinels for the master and, if it moved, points `pool` at it: the
    /// connections to the old one are dropped, and the next request opens one to the new.
    async fn follow(&self, pool: &Pool) {
        match self.resolve(pool.connect_timeout).await {
            Ok(master) => match pool.security.client(master) {
                Ok(client) => {
                    let master = client.get_connection_info().addr().to_string();
                    let moved = {
                        let mut current = pool.client.lock().unwrap_or_else(|e| e.into_inner());
                        let moved = current.get_connection_info().addr()
                            != client.get_connection_info().addr();
                        if moved {
                            *current = client;
                        }
                        moved
                    };
                    if moved {
                        tracing::info!(%master, "following the new master");
                        pool.lock_conns().clear();
                        pool.lock_replicated().clear();
                    }
                }
                Err(error) => tracing::warn!(%error, "bad master address from Sentinel"),
            },
            Err(error) => tracing::debug!(%error, "no master from Sentinel yet"),
        }
        self.refreshing.store(false, Ordering::Release);
    }

    /// Asks the Sentinels, in turn, for the master's address. The master is reached with the
    /// answering Sentinel's URL settings (user name, password, database, TLS) at that address.
    async fn resolve(&self, limit: Duration) -> RedisResult<ConnectionInfo> {
        let mut last = None;
        for url in &self.sentinels {
            let info = match url.as_str().into_connection_info() {
                Ok(info) => info,
                Err(error) => {
                    last = Some(error);
                    continue;
                }
            };
            let ask = async {
                let client = self.security.client_for(info.clone())?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query_async(&mut conn)
                    .await?;
                addr.ok_or_else(|| {
                    RedisError::from(io::Error::other(format!(
                        "Sentinel knows no master named `{}`",
                        self.master
                    )))
                })
            };
            match bounded(limit, ask).await {
                Ok((host, port)) => {
                    let addr = same_transport(info.addr(), host, port);
                    return Ok(info.set_addr(addr));
                }
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no Sentinel given").into()))
    }
}
