//! What a backend's connections are opened with: the options every topology shares, and the
//! address of a node that another node named (reached over the same transport).

use std::sync::Arc;
use std::time::Duration;

use redis::ConnectionAddr;
use tokio::runtime;

use crate::security::Security;

/// How a backend connects.
#[derive(Debug, Clone)]
pub(crate) struct ConnectOptions {
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    /// After each grant, WAIT for this many replicas, this long.
    pub(crate) sync_replicas: Option<(u32, Duration)>,
    /// With `sync_replicas`: WAITAOF (the grant fsynced to the replicas' append-only files)
    /// instead of WAIT.
    pub(crate) sync_aof: bool,
    /// How long a RedLock master that restarted stays out of quorums.
    pub(crate) restart_delay: Duration,
    /// Credentials and TLS material beyond what the URLs say.
    pub(crate) security: Arc<Security>,
    /// This manager's id (see `identity`): what its releases of plain locks publish on the
    /// wake channel, so that its own waiters can tell them from other processes' releases.
    pub(crate) manager_id: Arc<str>,
    /// The name this manager's connections give themselves (`CLIENT SETNAME`).
    pub(crate) client_name: Arc<str>,
    /// The manager's own runtime, which outlives any caller's: what must reach the server
    /// after the caller's runtime is gone is sent from there.
    pub(crate) background: runtime::Handle,
}

/// The address `host:port`, reached as `like` is: over TLS with its settings, or plain TCP.
pub(super) fn same_transport(like: &ConnectionAddr, host: String, port: u16) -> ConnectionAddr {
    match like {
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
    }
}
