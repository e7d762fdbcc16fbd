//! The connections of one endpoint, whatever its topology: the client they reach, one
//! connection per tokio runtime ([`Conn`]), the idle ones kept for a grant and its WAIT, and
//! what is known of the server behind them. The node's route (see `route.rs`) opens the
//! connections, with the options of `connect.rs`; the node (see `node/`) runs the operations
//! on them.

use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockWriteGuard, Weak};
use std::time::Duration;

use futures_util::FutureExt;
use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, Cmd, IntoConnectionInfo, Pipeline, RedisError, RedisResult,
    Value,
};
use tokio::runtime;

use super::connect::ConnectOptions;
use super::link::{Link, Query};
use crate::id_map::IdMap;
use crate::security::Security;

/// The connections of one endpoint, and what is known of the server behind them.
pub(super) struct Pool {
    /// Where the connections go: the server, the master that Sentinel named last (replaced
    /// when it names a new one), or a Cluster's first seed (for pub/sub).
    pub(super) client: Mutex<Client>,
    /// For RedLock masters: is this still the server we knew (its run_id)?
    pub(super) server_run: Mutex<ServerRun>,
    /// How long a RedLock master that restarted stays out of quorums.
    pub(super) restart_delay: Duration,
    /// What bounds each connect and each answer of the shared connections.
    pub(super) config: AsyncConnectionConfig,
    /// How long an answer may take.
    pub(super) response_timeout: Duration,
    /// How long opening a connection may take.
    pub(super) connect_timeout: Duration,
    /// After each grant, WAIT for this many replicas, this long.
    pub(super) sync_replicas: Option<(u32, Duration)>,
    /// With `sync_replicas`: WAITAOF instead of WAIT.
    pub(super) sync_aof: bool,
    /// The connection of each runtime that used the endpoint.
    pub(super) by_runtime: RwLock<IdMap<runtime::Id, Conn>>,
    /// The runtimes whose shutdown is watched (see [`forget_on_shutdown`]): a runtime whose
    /// connection was replaced is watched once, not once per connection.
    ///
    /// [`forget_on_shutdown`]: Self::forget_on_shutdown
    pub(super) watched: Mutex<HashSet<runtime::Id>>,
    /// With `sync_replicas`: idle connections of each runtime for a grant and its WAIT, which
    /// blocks the connection it runs on (and must run on the one that wrote the grant).
    pub(super) replicated: Mutex<HashMap<runtime::Id, Vec<MultiplexedConnection>>>,
    /// The server's native compare-and-delete, as found at `build()`.
    pub(super) delete: Mutex<NativeDelete>,
    /// How wake-ups are published and followed, as found at `build()`.
    pub(super) wakes: Mutex<crate::scripts::Wakes>,
    /// Credentials and TLS material beyond what the URLs say.
    pub(super) security: Arc<Security>,
    /// This manager's id: what its releases of plain locks publish on the wake channel.
    pub(super) manager_id: Arc<str>,
    /// The name the connections give themselves (`CLIENT SETNAME`).
    pub(super) client_name: Arc<str>,
}

/// A server's native compare-and-delete, if it has one; without, a small script does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum NativeDelete {
    /// None found (or the server would not say): the `unlock.lua` script.
    #[default]
    Script,
    /// Valkey's `DELIFEQ key value`.
    DelIfEq,
    /// Redis 8.4's `DELEX key IFEQ value`.
    DelEx,
}

/// Which run of the server a node reaches (its run_id), and whether it may have restarted.
#[derive(Debug, Default)]
pub(super) struct ServerRun {
    /// The server's run_id, as last read.
    pub(super) run_id: Option<String>,
    /// The connection was lost: the server may have restarted.
    pub(super) suspect: bool,
    /// Restarted: not counted in quorums until then.
    pub(super) excluded_until: Option<std::time::Instant>,
    /// INFO is denied to the user: restarts cannot be noticed.
    pub(super) unchecked: bool,
}

impl Pool {
    /// The connections that `url` (the server, the master, or a Cluster's first seed) leads
    /// to, made with `options`; nothing is sent until one is used.
    pub(super) fn new(url: impl IntoConnectionInfo, options: ConnectOptions) -> RedisResult<Self> {
        let client = options.security.client(url)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(options.connect_timeout))
            .set_response_timeout(Some(options.response_timeout));
        Ok(Self {
            client: Mutex::new(client),
            server_run: Mutex::new(ServerRun::default()),
            restart_delay: options.restart_delay,
            config,
            response_timeout: options.response_timeout,
            connect_timeout: options.connect_timeout,
            sync_replicas: options.sync_replicas,
            sync_aof: options.sync_aof,
            by_runtime: RwLock::new(IdMap::default()),
            watched: Mutex::new(HashSet::new()),
            replicated: Mutex::new(HashMap::new()),
            delete: Mutex::new(NativeDelete::Script),
            wakes: Mutex::new(crate::scripts::Wakes::Classic),
            security: options.security,
            manager_id: options.manager_id,
            client_name: options.client_name,
        })
    }

    /// The client of the server the connections go to now.
    pub(super) fn client(&self) -> Client {
        self.client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// What is known of the server behind the connections.
    pub(super) fn lock_server_run(&self) -> MutexGuard<'_, ServerRun> {
        self.server_run.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new link to the server, for the current runtime. A connection the server ended may
    /// mean a restart: the server's identity is checked again, as after a failed request.
    pub(super) fn link(self: &Arc<Self>) -> Link {
        let pool = Arc::downgrade(self);
        let lost = Arc::new(move || {
            if let Some(pool) = pool.upgrade() {
                pool.server_run
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .suspect = true;
            }
        });
        Link::new(
            self.client(),
            self.config.clone(),
            self.connect_timeout,
            self.client_name.clone(),
            lost,
        )
    }

    /// The connection already opened for the runtime `id`, if any.
    pub(super) fn known_conn(&self, id: runtime::Id) -> Option<Conn> {
        let known = self.by_runtime.read().unwrap_or_else(|e| e.into_inner());
        known.get(&id).cloned()
    }

    /// The connections of each runtime, for a change.
    pub(super) fn lock_conns(&self) -> RwLockWriteGuard<'_, IdMap<runtime::Id, Conn>> {
        self.by_runtime.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Spawns on `runtime` (whose id is `id`) a task that never ends and, when the runtime
    /// drops it, forgets the runtime's connections; once per runtime. Returns whether this
    /// was the runtime's first connection.
    pub(super) fn forget_on_shutdown(
        self: &Arc<Self>,
        runtime: &runtime::Handle,
        id: runtime::Id,
    ) -> bool {
        if !self
            .watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id)
        {
            return false;
        }
        let forget = Forget {
            pool: Arc::downgrade(self),
            id,
        };
        drop(runtime.spawn(async move {
            let _forget = forget;
            std::future::pending::<()>().await;
        }));
        true
    }

    /// Keeps a connection that answered for the next grant (a few per runtime at most); one
    /// that failed is dropped instead, as its state is unknown.
    pub(super) fn put_back(&self, conn: MultiplexedConnection) {
        const IDLE: usize = 4;
        let Ok(handle) = runtime::Handle::try_current() else {
            return;
        };
        let mut idle = self.lock_replicated();
        let idle = idle.entry(handle.id()).or_default();
        if idle.len() < IDLE {
            idle.push(conn);
        }
    }

    /// The idle connections of each runtime for a grant and its WAIT.
    pub(super) fn lock_replicated(
        &self,
    ) -> MutexGuard<'_, HashMap<runtime::Id, Vec<MultiplexedConnection>>> {
        self.replicated.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Forgets the connections of one runtime when dropped: by the runtime, as it shuts down.
struct Forget {
    pool: Weak<Pool>,
    id: runtime::Id,
}

impl Drop for Forget {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        // `watched` first: a connection opened meanwhile by this runtime then finds it
        // unwatched and watches it again, instead of staying behind in `by_runtime`.
        pool.watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        pool.by_runtime
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        pool.replicated
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
    }
}

/// AnswerBound `op`, reconnect waits included, by `limit`.
pub(super) fn bounded<T>(
    limit: Duration,
    op: impl Future<Output = RedisResult<T>>,
) -> impl Future<Output = RedisResult<T>> {
    // A combinator, not an `async fn`: that would keep `op` twice in its state (as the
    // argument, and inside the timeout).
    tokio::time::timeout(limit, op).map(move |answer| {
        answer.unwrap_or_else(|_| {
            Err(RedisError::from(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer from redis within {limit:?}"),
            )))
        })
    })
}

/// A connection of one runtime, as the node's route opened it: to one server, or to a whole
/// Cluster.
#[derive(Clone)]
pub(super) enum Conn {
    /// To the server, or the master Sentinel named.
    Server(Link),
    /// To the Cluster: each command goes to the master of its key's slot.
    Cluster(super::cluster::Lanes),
}

/// What bounds the wait for an answer on a connection.
#[derive(Debug, Clone, Copy)]
pub(super) enum AnswerBound {
    /// The connection's own response timeout.
    Itself,
    /// A timer around the request.
    Timer,
}

impl Conn {
    /// What bounds the wait for an answer on this connection.
    pub(super) fn bounds(&self) -> AnswerBound {
        match self {
            Self::Server(_) => AnswerBound::Itself,
            Self::Cluster(_) => AnswerBound::Timer,
        }
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
            Self::Cluster(_) => 0,
        }
    }
}

/// A server's link is awaited in place; the Cluster's connection boxes its requests.
impl Query for Conn {
    async fn send_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            Self::Server(link) => link.send(cmd).await,
            // Boxed: the lane's routing state stays out of every server's future.
            Self::Cluster(lanes) => Box::pin(lanes.send(cmd)).await,
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
            Self::Cluster(lanes) => Box::pin(lanes.send_pipeline(pipeline, offset, count)).await,
        }
    }
}
