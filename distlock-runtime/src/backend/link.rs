//! One runtime's connection to one server: a multiplexed connection, opened on first use and
//! again after it breaks.
//!
//! Every plain lock sends its commands through here, so the way in is short: a mutex held
//! for a clone of the open connection, then the connection's own send, awaited in place (no
//! boxed future on the way, no shared future polled per command). Opening is shared: the
//! requests that arrive while a connection is being opened wait for that one.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, Shared};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Cmd, Pipeline, PushInfo, PushKind, RedisResult, Value};

/// How long to pause before the second try of an opening that failed (plus up to as much
/// again, at random, so that many clients do not come back at once).
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// A connection being opened (and its generation), which every request that needs it awaits.
type Opening = Shared<BoxFuture<'static, RedisResult<(MultiplexedConnection, u64)>>>;

/// Told when the server ended a connection on its own (RESP3 says so as it happens): the
/// server may have restarted, and whoever checks its identity must look again.
pub(super) type Lost = Arc<dyn Fn() + Send + Sync>;

/// A reconnecting multiplexed connection; clones share it.
#[derive(Clone)]
pub(super) struct Link {
    inner: Arc<LinkState>,
}

struct LinkState {
    client: Client,
    config: AsyncConnectionConfig,
    /// How long a request waits for a connection being opened.
    connect_timeout: Duration,
    /// What each connection calls itself on the server (`CLIENT SETNAME`).
    name: Arc<str>,
    lost: Lost,
    state: Mutex<State>,
}

enum State {
    /// Not opened yet, or broken: the next request opens one.
    Closed,
    /// Being opened.
    Opening(Opening),
    /// Open; `generation` tells it from the connections before and after it.
    Open {
        conn: MultiplexedConnection,
        generation: u64,
    },
}

impl Link {
    /// A link to the server of `client`; nothing is sent until it is used. `config` bounds
    /// each connect and each answer; `name` is what each connection calls itself on the
    /// server; `lost` hears of connections the server ended.
    pub(super) fn new(
        client: Client,
        config: AsyncConnectionConfig,
        connect_timeout: Duration,
        name: Arc<str>,
        lost: Lost,
    ) -> Self {
        Self {
            inner: Arc::new(LinkState {
                client,
                config,
                connect_timeout,
                name,
                lost,
                state: Mutex::new(State::Closed),
            }),
        }
    }

    /// Sends one command and returns the server's answer (errors included as values, as the
    /// connection gives them). A connection that broke is opened again by the next request.
    pub(super) async fn send(&self, cmd: &Cmd) -> RedisResult<Value> {
        let Some((mut conn, generation)) = self.open_now() else {
            // Boxed: rare, and its state would otherwise weigh on every request's future.
            let send = |mut conn: MultiplexedConnection| async move {
                conn.send_packed_command(cmd).await
            };
            return Box::pin(self.after_opening(send)).await;
        };
        let answer = conn.send_packed_command(cmd).await;
        self.check(&answer, generation);
        answer
    }

    /// Sends `count` commands of `pipeline` from `offset`, as [`send`](Self::send) does one.
    pub(super) async fn send_pipeline(
        &self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let Some((mut conn, generation)) = self.open_now() else {
            let send = |mut conn: MultiplexedConnection| async move {
                conn.send_packed_commands(pipeline, offset, count).await
            };
            return Box::pin(self.after_opening(send)).await;
        };
        let answers = conn.send_packed_commands(pipeline, offset, count).await;
        self.check(&answers, generation);
        answers
    }

    /// Waits for a connection to be opened (at most the connect timeout, which an opening
    /// tries twice), then sends with `send`, which the connection's response timeout bounds
    /// as any request.
    async fn after_opening<T, F>(
        &self,
        send: impl FnOnce(MultiplexedConnection) -> F,
    ) -> RedisResult<T>
    where
        F: Future<Output = RedisResult<T>>,
    {
        let limit = self.inner.connect_timeout;
        let (conn, generation) = tokio::time::timeout(limit, self.opened())
            .await
            .map_err(|_| timed_out(limit))??;
        let answer = send(conn).await;
        self.check(&answer, generation);
        answer
    }

    /// The database the connection selects.
    pub(super) fn db(&self) -> i64 {
        self.inner
            .client
            .get_connection_info()
            .redis_settings()
            .db()
    }

    /// The open connection, if there is one.
    fn open_now(&self) -> Option<(MultiplexedConnection, u64)> {
        match &*self.state() {
            State::Open { conn, generation } => Some((conn.clone(), *generation)),
            _ => None,
        }
    }

    /// The open connection, or else the one being opened (opening it if none is), once open.
    async fn opened(&self) -> RedisResult<(MultiplexedConnection, u64)> {
        let opening = {
            let mut state = self.state();
            match &*state {
                State::Open { conn, generation } => return Ok((conn.clone(), *generation)),
                // An opening that failed while nobody waited (during a partition, say) is
                // not waited for: a new one starts.
                State::Opening(opening) if !opening.peek().is_some_and(Result::is_err) => {
                    opening.clone()
                }
                _ => {
                    let opening = self.open();
                    *state = State::Opening(opening.clone());
                    opening
                }
            }
        };
        let opened = opening.clone().await;
        let mut state = self.state();
        // The first waiter back records the outcome; the others find it recorded, or a newer
        // state, which they leave alone.
        if matches!(&*state, State::Opening(now) if now.ptr_eq(&opening)) {
            *state = match &opened {
                Ok((conn, generation)) => State::Open {
                    conn: conn.clone(),
                    generation: *generation,
                },
                Err(_) => State::Closed,
            };
        }
        opened
    }

    /// Opens a connection, trying twice. On RESP3 the connection tells when the server ends
    /// it, and the link closes it then, so the next request opens a new one instead of
    /// failing on the dead one.
    fn open(&self) -> Opening {
        let generation = GENERATION.next();
        let client = self.inner.client.clone();
        let name = self.inner.name.clone();
        let mut config = self.inner.config.clone();
        if client
            .get_connection_info()
            .redis_settings()
            .protocol()
            .supports_resp3()
        {
            let link = Arc::downgrade(&self.inner);
            config = config.set_push_sender(move |push: PushInfo| {
                if push.kind == PushKind::Disconnection
                    && let Some(link) = link.upgrade()
                {
                    close(&link, generation);
                    (link.lost)();
                }
                Ok::<(), std::convert::Infallible>(())
            });
        }
        let opening = async move {
            let conn = match client
                .get_multiplexed_async_connection_with_config(&config)
                .await
            {
                Ok(conn) => conn,
                Err(error) if !error.is_io_error() => return Err(error),
                Err(_) => {
                    let jitter = RETRY_PAUSE.mul_f64(fastrand::f64());
                    tokio::time::sleep(RETRY_PAUSE + jitter).await;
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?
                }
            };
            // Named, so that `CLIENT LIST` shows whose connection it is. A server or user that
            // refuses the name costs nothing more: the connection serves as it is.
            let mut named = conn.clone();
            let setname = redis::cmd("CLIENT")
                .arg("SETNAME")
                .arg(&*name)
                .query_async::<redis::Value>(&mut named)
                .await;
            if let Err(error) = setname {
                tracing::debug!(%error, "the connection could not be named");
            }
            Ok((conn, generation))
        };
        // A task of its own: the opening goes on (and fails in time) without waiters, so that
        // a request that comes later finds its outcome, not a connect begun long ago.
        let task = tokio::spawn(opening);
        async move {
            task.await
                .unwrap_or_else(|_| Err(std::io::Error::other("connection opening stopped").into()))
        }
        .boxed()
        .shared()
    }

    /// After an answer: a connection that can no longer be trusted (dropped, out of step
    /// after an error, or silent past the response timeout: perhaps half-open behind a
    /// partition) is closed, unless a newer one already replaced it.
    fn check<T>(&self, answer: &RedisResult<T>, generation: u64) {
        let Err(error) = answer else {
            return;
        };
        if !(error.is_unrecoverable_error() || error.is_timeout()) {
            return;
        }
        close(&self.inner, generation);
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The error of a request that got no connection within `limit`.
fn timed_out(limit: Duration) -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("no connection to redis within {limit:?}"),
    ))
}

/// Closes the connection of `generation`, if it is still the open one.
fn close(link: &LinkState, generation: u64) {
    let mut state = link.state.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(&*state, State::Open { generation: now, .. } if *now == generation) {
        *state = State::Closed;
    }
}

/// Numbers connections across links, from 1.
struct Generations(std::sync::atomic::AtomicU64);

impl Generations {
    fn next(&self) -> u64 {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }
}

static GENERATION: Generations = Generations(std::sync::atomic::AtomicU64::new(0));

/// A connection that answers one command in place, converted to `T`: as
/// `cmd.query_async(conn)`, but without the boxed future of `ConnectionLike` where the
/// connection can avoid it.
pub(super) trait Query: redis::aio::ConnectionLike + Send {
    /// Sends one command and returns the server's answer, a server error as a value.
    fn send_command(&mut self, cmd: &Cmd) -> impl Future<Output = RedisResult<Value>> + Send;

    /// Sends `count` commands of `pipeline` from `offset` back to back, as
    /// [`send_command`](Self::send_command) does one: by default through `ConnectionLike`,
    /// boxed.
    fn send_commands(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> impl Future<Output = RedisResult<Vec<Value>>> + Send {
        async move { self.req_packed_commands(pipeline, offset, count).await }
    }

    /// Sends `cmd` and converts its answer; a server error is an `Err`.
    fn query<T: redis::FromRedisValue>(
        &mut self,
        cmd: &Cmd,
    ) -> impl Future<Output = RedisResult<T>> + Send {
        async move {
            let value = self.send_command(cmd).await?;
            Ok(redis::from_redis_value(value.extract_error()?)?)
        }
    }

    /// Sends every command of `pipeline` back to back and returns their answers, a server
    /// error as a value among them. Not for transactions (`atomic()`), whose answers come
    /// wrapped in `MULTI` and `EXEC`.
    fn query_each(
        &mut self,
        pipeline: &Pipeline,
    ) -> impl Future<Output = RedisResult<Vec<Value>>> + Send {
        debug_assert!(
            !pipeline.is_transaction(),
            "a transaction's answers are wrapped"
        );
        self.send_commands(pipeline, 0, pipeline.len())
    }
}

/// The connections of grants that WAIT for replicas: one command in place.
impl Query for MultiplexedConnection {
    async fn send_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        self.send_packed_command(cmd).await
    }
}
