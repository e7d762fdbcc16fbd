//! One endpoint: a single server, a Sentinel-managed master (see `sentinel.rs`) or a whole
//! Cluster behind one slot-aware connection (see `cluster.rs`); what differs between them is
//! its route's (see `route.rs`). It keeps a connection per tokio runtime (in its pool, see
//! `pool.rs`), loads the scripts, finds the server's native commands at `build()`, and runs
//! every operation on a lock.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime;

use redis::aio::MultiplexedConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, IntoConnectionInfo, RedisError, RedisResult,
    ServerErrorKind, Value,
};

use crate::scripts;

use super::cluster;
use super::connect::ConnectOptions;
use super::link::Query;
use super::messages::{
    AcquireAnswer, AcquireCall, AcquireRequest, FAIR_ENTRY_LEASE, FAIR_UNCLAIMED, FairQueue,
    FairRelease, HoldIds, HoldRef, Renewal, Shape, millis,
};
use super::pool::{AnswerBound, Conn, NativeDelete, Pool, bounded};
use super::route::Route;
use super::sentinel::Sentinel;

/// Awaits `op`, a request on a connection whose [`AnswerBound`] are `bounds`, within the
/// response timeout of `node`: in place where the connection bounds it itself, under a timer
/// elsewhere. A macro rather than a function or a combinator: those take the request's future
/// by value, and every move of it (over a kilobyte, with the connection's own timeout inside)
/// is a copy on every lock.
macro_rules! answer {
    ($node:expr, $bounds:expr, $op:expr) => {
        match $bounds {
            AnswerBound::Itself => $op.await,
            AnswerBound::Timer => $node.bounded($op).await,
        }
    };
}

mod acquire;
mod release;

/// One Redis server (or anything that speaks to one endpoint).
///
/// Connections are kept per tokio runtime: a multiplexed connection's I/O task lives on the
/// runtime that opened it, so each runtime that uses the manager gets its own, and a runtime
/// that shuts down takes only its own connection with it. Requests then never hop to another
/// thread on their way to the socket.
#[derive(Clone)]
pub(crate) struct Node {
    /// The connections, and what is known of the server behind them.
    pub(super) pool: Arc<Pool>,
    /// The topology: how a runtime's connection is opened and where commands go.
    pub(super) route: Arc<Route>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("response_timeout", &self.pool.response_timeout)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// A node for the one server at `url`; nothing is sent until it is used.
    pub(crate) fn server(url: &str, options: ConnectOptions) -> RedisResult<Self> {
        Self::with(url, options, Route::Server)
    }

    /// A Redis Cluster reached through `seeds`; nothing is sent until it is used.
    pub(crate) fn cluster(seeds: &[String], options: ConnectOptions) -> RedisResult<Self> {
        let (first, cluster) = cluster::client(seeds, &options)?;
        Self::with(first, options, Route::Cluster(Box::new(cluster)))
    }

    /// The master that the Sentinels at `sentinels` name `master`; it follows failovers: a
    /// connection error or a READONLY answer makes it ask the Sentinels again.
    pub(crate) async fn sentinel(
        sentinels: &[String],
        master: &str,
        options: ConnectOptions,
    ) -> RedisResult<Self> {
        let (master, source) = Sentinel::find(sentinels, master, &options).await?;
        Self::with(master, options, Route::Sentinel(Arc::new(source)))
    }

    /// A node that reaches `url` (the server, the master, or a Cluster's first seed) by
    /// `route`; nothing is sent until it is used.
    fn with(
        url: impl IntoConnectionInfo,
        options: ConnectOptions,
        route: Route,
    ) -> RedisResult<Self> {
        Ok(Self {
            pool: Arc::new(Pool::new(url, options)?),
            route: Arc::new(route),
        })
    }

    /// Passes `result` through. An error that may mean a failover makes a Sentinel-managed
    /// node look for the current master in the background; a lost connection makes a node
    /// suspect of having restarted until its run_id is checked.
    pub(super) fn watch<T>(&self, result: RedisResult<T>) -> RedisResult<T> {
        if let Err(error) = &result {
            if error.is_io_error() || error.is_connection_dropped() || error.is_connection_refusal()
            {
                self.pool.lock_server_run().suspect = true;
            }
            self.route.failed(&self.pool, error);
        }
        result
    }

    /// Connects from the current runtime, loads every script and notes the server's run_id.
    pub(crate) async fn load_scripts(&self) -> RedisResult<()> {
        let mut conn = self.conn().await?;
        let limit = self.pool.connect_timeout * 3;
        let wakes = self.find_wakes(&mut conn).await;
        *self.pool.wakes.lock().unwrap_or_else(|e| e.into_inner()) = wakes;
        for script in scripts::all(wakes) {
            bounded(limit, script.prepare_invoke().load_async(&mut conn)).await?;
        }
        if self.pool.sync_replicas.is_some() && self.pool.sync_aof {
            let info = redis::cmd("COMMAND").arg("INFO").arg("WAITAOF").to_owned();
            let answer: Vec<redis::Value> = self.bounded(info.query_async(&mut conn)).await?;
            if answer.iter().all(|v| matches!(v, redis::Value::Nil)) {
                return Err(io::Error::other(WAITAOF_MISSING).into());
            }
        }
        let delete = self.native_delete(&mut conn).await;
        *self.pool.delete.lock().unwrap_or_else(|e| e.into_inner()) = delete;
        if self.route.one_server() {
            match self.run_id().await {
                Ok(run_id) => {
                    // Just read: the connection that read it needs no second look.
                    let mut server = self.pool.lock_server_run();
                    server.run_id = Some(run_id);
                    server.suspect = false;
                }
                // INFO is `@dangerous`: a user without it works, unchecked for restarts.
                Err(error) if denied(&error) => self.pool.lock_server_run().unchecked = true,
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Asks the server which native compare-and-delete it has (`COMMAND INFO`). A server
    /// that does not answer (an ACL that forbids `COMMAND`, say) gets the script.
    async fn native_delete(&self, conn: &mut Conn) -> NativeDelete {
        for (name, delete) in [
            ("DELIFEQ", NativeDelete::DelIfEq),
            ("DELEX", NativeDelete::DelEx),
        ] {
            let info = redis::cmd("COMMAND").arg("INFO").arg(name).to_owned();
            let answer: RedisResult<Vec<redis::Value>> = self.bounded(info.query_async(conn)).await;
            if let Ok(answer) = answer
                && answer.iter().any(|v| !matches!(v, redis::Value::Nil))
            {
                return delete;
            }
        }
        NativeDelete::Script
    }

    /// How wake-ups go on this deployment: sharded on a Cluster whose every master has
    /// `SPUBLISH` (Redis 7.0, Valkey; asked with `COMMAND INFO`), classic everywhere else, and
    /// where a master will not say (said in the log: a manager that publishes the other way
    /// is not heard by this one's waiters, who then wait on their timers).
    async fn find_wakes(&self, conn: &mut Conn) -> scripts::Wakes {
        if self.route.one_server() {
            return scripts::Wakes::Classic;
        }
        let info = redis::cmd("COMMAND").arg("INFO").arg("SPUBLISH").to_owned();
        let has = |answer: &redis::Value| match answer {
            redis::Value::Array(entries) => entries.iter().any(|v| !matches!(v, redis::Value::Nil)),
            _ => false,
        };
        match self.bounded(self.each_master(conn, &info)).await {
            Ok(answers) if !answers.is_empty() && answers.iter().all(|(_, a)| has(a)) => {
                scripts::Wakes::Sharded
            }
            Ok(_) => scripts::Wakes::Classic,
            Err(error) => {
                tracing::warn!(
                    %error,
                    "could not learn whether every Cluster master has SPUBLISH: wake-ups use \
                     classic pub/sub"
                );
                scripts::Wakes::Classic
            }
        }
    }

    /// How wake-ups are published and followed (found at `build()`).
    pub(crate) fn wakes(&self) -> scripts::Wakes {
        *self.pool.wakes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The native compare-and-delete found at `build()`.
    pub(crate) fn delete(&self) -> NativeDelete {
        *self.pool.delete.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether each grant WAITs for replicas (`sync_replicas`).
    pub(crate) fn syncs_replicas(&self) -> bool {
        self.pool.sync_replicas.is_some()
    }

    /// Whether INFO was denied at `load_scripts`, so that a restart cannot be noticed.
    pub(crate) fn restarts_unchecked(&self) -> bool {
        self.pool.lock_server_run().unchecked
    }

    /// Sends the first of `cmds` that the user may run to the master behind this node (on
    /// Cluster: to every master), and returns its index and each answer with the master's
    /// address; the error of the last one when every one is denied.
    pub(crate) async fn ask_masters(
        &self,
        cmds: &[redis::Cmd],
    ) -> RedisResult<(usize, Vec<(String, redis::Value)>)> {
        let mut last = None;
        for (at, cmd) in cmds.iter().enumerate() {
            match self.each_master(&mut self.conn().await?, cmd).await {
                Ok(answers) => return Ok((at, answers)),
                Err(error) if denied(&error) => last = Some(error),
                Err(error) => return Err(error),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no command to send").into()))
    }

    /// Runs one command (for the inspector), routed by its key on Cluster.
    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let mut conn = self.conn().await?;
        self.watch(self.bounded(cmd.query_async(&mut conn)).await)
    }

    /// Runs one script call (for the inspector), routed by its first key on Cluster.
    pub(crate) async fn invoke<T: redis::FromRedisValue>(
        &self,
        call: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        let mut conn = self.conn().await?;
        self.watch(self.bounded(call.invoke_async(&mut conn)).await)
    }

    /// Every key matching `pattern`, by SCAN on the server (on Cluster: on every master).
    pub(crate) async fn scan(&self, pattern: &str) -> RedisResult<Vec<String>> {
        let mut found = self.scan_masters(&self.conn().await?, pattern).await?;
        found.sort();
        found.dedup();
        Ok(found)
    }

    /// Sends `cmd` on `conn` to every master (the server itself, off Cluster) and returns
    /// each answer with the master's address.
    async fn each_master(&self, conn: &mut Conn, cmd: &Cmd) -> RedisResult<Vec<(String, Value)>> {
        match conn {
            Conn::Cluster(lanes) => {
                let mut cluster = lanes.any();
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let answers = self.bounded(cluster.route_command(cmd.clone(), all)).await;
                answers.and_then(|a| Ok(redis::from_redis_value(a)?))
            }
            Conn::Server(_) => {
                let master = self.pool.client().get_connection_info().addr().to_string();
                let answer = self.watch(self.bounded(cmd.query_async(conn)).await);
                answer.map(|answer| vec![(master, answer)])
            }
        }
    }

    /// Every key matching `pattern`, by SCAN on `conn`'s server (on Cluster: on every
    /// master, as [`Node::ask_masters`] lists them); a key may come more than once.
    async fn scan_masters(&self, conn: &Conn, pattern: &str) -> RedisResult<Vec<String>> {
        let mut found = Vec::new();
        match conn {
            Conn::Server(_) => {
                let conn = conn.clone();
                walk(pattern, &mut found, |scan| {
                    let mut conn = conn.clone();
                    async move { self.watch(self.bounded(scan.query_async(&mut conn)).await) }
                })
                .await?;
            }
            Conn::Cluster(lanes) => {
                let conn = lanes.any();
                let (_, masters) = self.ask_masters(&[redis::cmd("PING")]).await?;
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
                            let answer = self.bounded(conn.route_command(scan, at)).await?;
                            Ok(redis::from_redis_value(answer)?)
                        }
                    })
                    .await?;
                }
            }
        }
        Ok(found)
    }

    pub(super) async fn run_id(&self) -> RedisResult<String> {
        let mut conn = self.conn().await?;
        let info: String = self.watch(
            bounded(
                self.pool.response_timeout,
                redis::cmd("INFO").arg("server").query_async(&mut conn),
            )
            .await,
        )?;
        info.lines()
            .find_map(|line| line.strip_prefix("run_id:"))
            .map(|id| id.trim().to_owned())
            .ok_or_else(|| io::Error::other("INFO server without run_id").into())
    }

    /// Whether this RedLock master may count towards a quorum now. A master that lost its
    /// connection is checked first: if it restarted (new run_id, so possibly empty), it stays
    /// out for the restart delay, so that it cannot grant again a lock it has forgotten while
    /// that lock's lease may still run elsewhere.
    pub(crate) async fn eligible(&self) -> bool {
        let (suspect, known) = {
            let server = self.pool.lock_server_run();
            if server.unchecked {
                return true;
            }
            if server
                .excluded_until
                .is_some_and(|until| std::time::Instant::now() < until)
            {
                return false;
            }
            (server.suspect, server.run_id.clone())
        };
        if !suspect && known.is_some() {
            return true;
        }
        let Ok(current) = self.run_id().await else {
            return false;
        };
        let mut server = self.pool.lock_server_run();
        server.suspect = false;
        if known.is_some_and(|known| known != current) {
            tracing::warn!(delay = ?self.pool.restart_delay, "a RedLock master restarted: kept out of quorums");
            server.excluded_until = Some(std::time::Instant::now() + self.pool.restart_delay);
        }
        server.run_id = Some(current);
        server
            .excluded_until
            .is_none_or(|until| std::time::Instant::now() >= until)
    }

    /// The connection of the current tokio runtime, opened (lazily) on first use.
    pub(super) async fn conn(&self) -> RedisResult<Conn> {
        let runtime = runtime::Handle::try_current()
            .map_err(|_| RedisError::from(io::Error::other("no tokio runtime")))?;
        let id = runtime.id();
        if let Some(conn) = self.pool.known_conn(id) {
            return Ok(conn);
        }
        let conn = self.route.open(&self.pool).await?;
        let conn = self.pool.lock_conns().entry(id).or_insert(conn).clone();
        // Spawned with no lock held: on a runtime already shutting down, the task is dropped
        // at once, and forgets what was just inserted.
        if self.pool.forget_on_shutdown(&runtime, id) {
            // A runtime's first connection may reach a server that restarted since the last
            // look, which no connection of this manager saw end: a RedLock master is checked
            // again before it counts towards a quorum. (A connection that replaces a dropped
            // one follows an error, which made the server suspect already.) When this runtime
            // shuts down it drops its tasks, the watching one among them, and the runtime's
            // connections go with it (each holds resources of that runtime).
            self.pool.lock_server_run().suspect = true;
        }
        Ok(conn)
    }

    /// Sets the lease of the lock of `hold` (and of the token's share, for shares) if its
    /// token owns it; `false` when it did not.
    pub(crate) async fn extend(&self, hold: HoldRef<'_>, lease: Duration) -> RedisResult<bool> {
        let mut conn = self.conn().await?;
        let call = scripts::Extend {
            lock: hold.lock,
            token: hold.token,
            lease,
        }
        .call();
        let extended: i64 = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        Ok(extended == 1)
    }

    /// Renews every `(lock, token, lease)` still held by its token, in one round trip
    /// (on Cluster, one per hash slot, all at once). `None` for the items of a slot whose
    /// call failed while others answered (see [`Route::per_slot_each`]).
    pub(crate) async fn renew(&self, items: &[Renewal<'_>]) -> RedisResult<Vec<Option<bool>>> {
        let locks = items.iter().map(|item| item.lock);
        let renew = |group: &[usize]| {
            let batch: Vec<Renewal<'_>> = group.iter().map(|&at| items[at]).collect();
            async move { self.renew_together(&batch).await }
        };
        self.route.per_slot_each(locks, renew).await
    }

    /// Renews leases that all live in one hash slot (any leases, off Cluster) in one call.
    async fn renew_together(&self, items: &[Renewal<'_>]) -> RedisResult<Vec<bool>> {
        let mut conn = self.conn().await?;
        let call = scripts::renew(items.iter().map(|item| (item.lock, item.token, item.lease)));
        let renewed: Vec<i64> = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        Ok(renewed.into_iter().map(|r| r == 1).collect())
    }

    /// A new pub/sub connection, opened from the current runtime.
    pub(crate) async fn pubsub(&self) -> RedisResult<redis::aio::PubSub> {
        // On Cluster, classic pub/sub is cluster-wide: a PUBLISH on the node that owns a lock
        // reaches subscribers on any node, so the first seed serves (elections, and waiters
        // where the servers have no sharded pub/sub; see `shard_pubsub.rs`).
        bounded(
            self.pool.connect_timeout,
            self.pool.client().get_async_pubsub(),
        )
        .await
    }

    /// Whether the token of `hold` still owns its lock (for a share: whether the share's
    /// lease lives, which only a script can compare with the server's clock).
    pub(crate) async fn is_held(&self, hold: HoldRef<'_>) -> RedisResult<bool> {
        let HoldRef {
            lock,
            shared,
            token,
        } = hold;
        let mut conn = self.conn().await?;
        if shared {
            let call = scripts::share_held(lock, token);
            let held: i64 = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
            return Ok(held == 1);
        }
        let cmd = redis::cmd("HEXISTS").arg(lock).arg(token).to_owned();
        match self.bounded(cmd.query_async(&mut conn)).await {
            // Not a hash: the string form of a plain lock, held when its value is the token.
            Err(error) if error.code() == Some("WRONGTYPE") => {
                let get = redis::cmd("GET").arg(lock).to_owned();
                match self
                    .bounded(get.query_async::<Option<String>>(&mut conn))
                    .await
                {
                    Ok(value) => Ok(value.as_deref() == Some(token)),
                    Err(error) if error.code() == Some("WRONGTYPE") => Ok(false),
                    Err(error) => self.watch(Err(error)),
                }
            }
            answer => self.watch(answer),
        }
    }

    /// Whether `token` holds the plain lock `lock` (the string form): one `GET`, compared
    /// here. Another kind's hash at the key is not this owner's plain lock.
    pub(crate) async fn is_held_plain(&self, lock: &str, token: &str) -> RedisResult<bool> {
        let mut conn = self.conn().await?;
        let mut get = command("GET", 1, lock.len());
        get.arg(lock);
        match self
            .bounded(get.query_async::<Option<Vec<u8>>>(&mut conn))
            .await
        {
            Ok(value) => Ok(value.as_deref() == Some(token.as_bytes())),
            Err(error) if error.code() == Some("WRONGTYPE") => Ok(false),
            Err(error) => self.watch(Err(error)),
        }
    }

    /// Takes back a waiting writer's intent and wakes the lock's waiters, if the intent is
    /// still that writer's: whether it was.
    pub(crate) async fn withdraw_intent(
        &self,
        withdraw: &scripts::WithdrawIntent<'_>,
    ) -> RedisResult<bool> {
        let mut conn = self.conn().await?;
        let call = withdraw.call(self.wakes());
        let withdrawn: i64 = self.watch(self.bounded(call.invoke_async(&mut conn)).await)?;
        Ok(withdrawn == 1)
    }

    pub(super) fn bounded<T>(
        &self,
        op: impl Future<Output = RedisResult<T>>,
    ) -> impl Future<Output = RedisResult<T>> {
        // A little past the connection's own response timeout, which then fires first and
        // drops the connection it timed out on (see `Link::check`).
        bounded(self.pool.response_timeout + ANSWER_SLACK, op)
    }
}

/// How much longer than the response timeout a request bounded by a timer may take.
/// Why `build()` fails with `sync_replicas_aof` on a server without `WAITAOF`.
pub(crate) const WAITAOF_MISSING: &str = "`sync_replicas_aof` needs WAITAOF (Redis 7.2 or later, Valkey 8 or later), which this \
     server does not have";

const ANSWER_SLACK: Duration = Duration::from_millis(50);

/// A command named `name` with room for `args` more arguments of `bytes` in all, so that
/// adding them allocates nothing more: the commands of every plain lock are built this way.
fn command(name: &str, args: usize, bytes: usize) -> redis::Cmd {
    let mut cmd = redis::Cmd::with_capacity(args + 1, name.len() + bytes);
    cmd.arg(name);
    cmd
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

/// Whether the server refused a command to this user (NOPERM), or does not know it (renamed
/// away, as managed services do).
pub(crate) fn denied(error: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            let text = error.to_string();
            text.contains("unknown command") || text.contains("NOPERM")
        }
        _ => false,
    }
}
