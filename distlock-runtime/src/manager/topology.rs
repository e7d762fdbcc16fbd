//! Which deployment a builder connects to, and connecting to it.

use crate::backend::{self, Backend, ConnectOptions};
use crate::error::LockError;

use super::redact_url;

/// Which deployment a builder connects to: the last of `redis_url`, `cluster`, `sentinel`
/// and `redlock` called.
#[derive(Debug, Clone)]
pub(super) enum Topology {
    /// One server (no URL yet: `build` says so).
    Server(Vec<String>),
    /// A Redis Cluster, through these seeds.
    Cluster(Vec<String>),
    /// The master these Sentinels name.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
    /// Independent masters under the majority rule.
    RedLock(Vec<String>),
}

impl Topology {
    /// Every URL given for it.
    pub(super) fn urls(&self) -> &[String] {
        match self {
            Self::Server(urls) | Self::Cluster(urls) | Self::RedLock(urls) => urls,
            Self::Sentinel { sentinels, .. } => sentinels,
        }
    }

    /// Every URL given for it, as logs and errors show them (see [`redact_url`]).
    pub(super) fn redacted_urls(&self) -> Vec<String> {
        self.urls().iter().map(|u| redact_url(u)).collect()
    }

    /// The builder method that sets it, as errors name it.
    pub(super) fn method(&self) -> &'static str {
        match self {
            Self::Server(_) => "redis_url",
            Self::Cluster(_) => "cluster",
            Self::Sentinel { .. } => "sentinel",
            Self::RedLock(_) => "redlock",
        }
    }

    /// Its name in `Debug` output (the master's name included, which is no secret).
    pub(super) fn name(&self) -> String {
        match self {
            Self::Server(_) => "single".into(),
            Self::Cluster(_) => "cluster".into(),
            Self::Sentinel { master, .. } => format!("sentinel ({master})"),
            Self::RedLock(_) => "redlock".into(),
        }
    }

    /// Connects to the deployment and loads the scripts. A failure is a
    /// [`LockError`] that names `target`, the deployment's redacted URLs.
    pub(super) async fn connect(
        &self,
        options: ConnectOptions,
        target: &str,
    ) -> Result<Backend, LockError> {
        let backend = match self {
            Self::Server(urls) => {
                let url = urls.first().map_or("", String::as_str);
                Backend::connect_server(url, options).await
            }
            Self::Cluster(seeds) => Backend::connect_cluster(seeds, options).await,
            Self::Sentinel { sentinels, master } => {
                Backend::connect_sentinel(sentinels, master, options).await
            }
            Self::RedLock(masters) => Backend::connect_redlock(masters, options).await,
        };
        backend.map_err(|error| connect_error(target, error))
    }
}

/// A connection failure at `build`, as a [`LockError::Config`]; a missing permission says so
/// (the server's message names the command).
fn connect_error(target: &str, error: redis::RedisError) -> LockError {
    if error.is_timeout() {
        LockError::redis("", error)
    } else if backend::denied(&error) {
        LockError::Config(format!(
            "the Redis user at {target} lacks a permission distlock needs ({error}); see \
             `LockManager::acl_rules` and the guide's ACL users (distlock::guide::server_setup) \
             for the rule to grant"
        ))
    } else {
        LockError::Config(format!("cannot connect to {target}: {error}"))
    }
}
