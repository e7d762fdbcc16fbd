//! `LockManager`: the configured connection to Redis that every lock goes through.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::LockError;
use crate::backend::{self, Backend, ConnectOptions};
use crate::driver::Driver;
use crate::holds::Holds;
use crate::identity::Lookup;
use crate::key;
use crate::lease::{MAX_TTL, check_ttl};
use crate::security::{Credentials, Security, Tls};
use crate::waiters::{Releaser, Waiters};
use crate::watchdog::{Through, Watchdog};

static INSTALLED: OnceLock<LockManager> = OnceLock::new();

/// The entry point: a connection to Redis plus the defaults every lock request starts from.
///
/// Build one at startup with [`LockManager::builder`], then either pass it around (it is cheap
/// to clone: an `Arc` inside) or [`install`](Self::install) it as the default that
/// `#[distributed_lock]` uses.
///
/// A manager opens one connection per tokio runtime that uses it (so it works from any
/// runtime, not only the one that built it; the runtime needs its timer enabled, as
/// `#[tokio::main]` and `#[tokio::test]` do), and owns one background thread for the lease
/// watchdog, the pub/sub connection that wakes waiters, and releases made outside any runtime.
/// The thread stops when the last clone (and the last guard) is dropped. Guards dropped while
/// their own runtime shuts down are released from that thread, and
/// [`shutdown`](Self::shutdown) gives back everything the manager holds.
///
/// ```no_run
/// # async fn run() -> Result<(), distlock_runtime::LockError> {
/// use std::time::Duration;
/// use distlock_runtime::LockManager;
///
/// let locks = LockManager::builder()
///     .redis_url("redis://127.0.0.1:6379")
///     .key_prefix("myapp:lock:")
///     .default_ttl(Duration::from_secs(30))
///     .build()
///     .await?;
/// locks.clone().install()?;
///
/// let guard = locks.lock("order:42").ttl(Duration::from_secs(10)).retries(3).acquire().await?;
/// // ... the critical section ...
/// guard.release().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LockManager {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) backend: Backend,
    pub(crate) driver: Arc<Driver>,
    pub(crate) watchdog: Watchdog,
    pub(crate) waiters: Waiters,
    pub(crate) holds: Holds,
    pub(crate) prefix: String,
    pub(crate) defaults: Defaults,
    /// This manager's identity, and the identities of other holders it has read.
    pub(crate) registry: Arc<crate::identity::Registry>,
    target: String,
}

/// What a request uses for each option it does not set.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Defaults {
    pub(crate) ttl: Duration,
    pub(crate) retries: u32,
    pub(crate) retry_delay: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) max_hold: Option<Duration>,
}

/// Counters of a manager's lease renewal, for monitoring and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Renewal script calls sent by the watchdog (each renews a whole batch of leases).
    pub renewal_round_trips: u64,
    /// Leases renewed, counted once per lease per renewal.
    pub leases_renewed: u64,
    /// Leases the watchdog found lost (gone or taken by another owner).
    pub leases_lost: u64,
    /// Renewals the watchdog sent late, with less than half of their lease left: it is
    /// falling behind (the server, the network or this process cannot keep up), and leases
    /// will be lost if it goes on. The first late renewal logs a warning, then at most one
    /// every 10 s; `distlock_renewals_late_total` counts them with the `metrics` feature.
    pub renewals_late: u64,
    /// Keys that have local waiters right now (each with a pub/sub subscription).
    pub waiting_keys: usize,
    /// Leases the watchdog renews right now (0 once every watched guard is gone).
    pub watched_leases: usize,
    /// Locks this manager's releases handed straight to one of its own waiting tasks: in the
    /// release's round trip (see [`LockGuard::release`](crate::LockGuard::release)), or with
    /// no round trip at all by a local pass (counted in `local_passes` too).
    pub local_handoffs: u64,
    /// Waiting tasks ready to take such a hand-off right now (at most one per key: the head
    /// of its local queue, between its attempts).
    pub ready_for_handoff: usize,
    /// Requests queued behind a busy lock right now, over every key (the head of each local
    /// queue included; a first attempt not yet answered is not counted).
    pub waiting_requests: usize,
    /// Acquire attempts (of one key or a set) that the server has answered so far (a request
    /// that waits makes one, then one more per wake-up or timer).
    pub attempts: u64,
    /// Of the local hand-offs, those passed with no server command at all (a cohort's local
    /// passes: see [`LockManagerBuilder::cohort`]).
    pub local_passes: u64,
}

impl LockManager {
    /// Starts configuring a manager.
    pub fn builder() -> LockManagerBuilder {
        LockManagerBuilder::default()
    }

    /// Makes this manager the process-wide default used by `#[distributed_lock]` functions
    /// that name no `manager`. There is one such default per process; a second call fails
    /// with [`LockError::AlreadyInstalled`].
    pub fn install(self) -> Result<(), LockError> {
        INSTALLED.set(self).map_err(|_| LockError::AlreadyInstalled)
    }

    /// The installed manager, if [`install`](Self::install) was called.
    pub fn installed() -> Option<&'static LockManager> {
        INSTALLED.get()
    }

    /// The key prefix every lock of this manager is written under.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The Redis key that holds the lock named `key`: `prefix{key}`, or `prefix{escaped}~`
    /// when `key` contains `}` (see the guide's
    /// [Redis data model](https://docs.rs/distlock/latest/distlock/guide/data_model/index.html)).
    pub fn redis_key(&self, key: &str) -> String {
        key::lock_key(&self.inner.prefix, key)
    }

    /// Renewal counters since the manager was built.
    pub fn stats(&self) -> Stats {
        let counters = self.inner.watchdog.counters();
        Stats {
            renewal_round_trips: counters.round_trips.load(Ordering::Relaxed),
            leases_renewed: counters.renewed.load(Ordering::Relaxed),
            leases_lost: counters.lost.load(Ordering::Acquire),
            renewals_late: self.inner.watchdog.late_renewals(),
            waiting_keys: self.inner.waiters.waiting_keys(),
            watched_leases: self.inner.watchdog.watched(),
            local_handoffs: self.inner.waiters.handoffs(),
            ready_for_handoff: self.inner.waiters.offers(),
            waiting_requests: self.inner.waiters.queued(),
            attempts: self.inner.waiters.attempts(),
            local_passes: self.inner.waiters.passes(),
        }
    }

    /// Gives back every lock this manager holds and stops taking new ones: for a clean exit
    /// (on SIGTERM, say) that frees the keys for other processes at once instead of leaving
    /// them to their leases.
    ///
    /// Every live guard of this manager and its clones is released (a `min_hold` is kept),
    /// and its lease is marked lost first, so [`LockGuard::lost`](crate::LockGuard::lost) completes with
    /// [`LockError::ShutDown`] and `#[distributed_lock]` bodies with `on_lost = "abort"` stop.
    /// The watchdog stops renewing, the pub/sub connection that wakes waiters is closed,
    /// waiting requests end with [`LockError::ShutDown`], and so does every later request.
    /// [`LockGuard::release`](crate::LockGuard::release) of a guard given back this way returns
    /// [`LockError::ShutDown`]; dropping it does nothing.
    ///
    /// Returns once Redis has answered every release (a failed one is logged and left to its
    /// lease). Calling it again does nothing. It works from any runtime, and outside one.
    pub async fn shutdown(&self) {
        let inner = &self.inner;
        if inner.holds.is_shut_down() {
            return;
        }
        inner.holds.shut_down(&inner.releaser()).await;
        inner.watchdog.stop();
        let registry = Arc::clone(&inner.registry);
        let _ = inner
            .exec(move |backend| async move { registry.unregister(&backend).await })
            .await;
        let _ = inner.driver.run(inner.waiters.close()).await;
        tracing::debug!(target = %inner.target, "lock manager shut down");
    }

    pub(crate) fn defaults(&self) -> &Defaults {
        &self.inner.defaults
    }
}

impl Inner {
    /// Runs a Redis operation on the caller's runtime, or on the manager's own runtime when
    /// the caller is not in one.
    pub(crate) async fn exec<T, F, Fut>(&self, op: F) -> Result<T, LockError>
    where
        F: FnOnce(Backend) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let backend = self.backend.clone();
        if tokio::runtime::Handle::try_current().is_ok() {
            Ok(op(backend).await)
        } else {
            self.driver.run(op(backend)).await
        }
    }

    /// Sleeps on the caller's runtime timer, or on the manager's own runtime.
    pub(crate) async fn sleep_until(&self, deadline: std::time::Instant) -> Result<(), LockError> {
        let deadline = tokio::time::Instant::from_std(deadline);
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::time::sleep_until(deadline).await;
            Ok(())
        } else {
            self.driver.run(tokio::time::sleep_until(deadline)).await
        }
    }

    /// What gives this manager's holds back from its own runtime.
    pub(crate) fn releaser(&self) -> Releaser {
        Releaser {
            backend: self.backend.clone(),
            driver: Arc::clone(&self.driver),
            waiters: self.waiters.clone(),
        }
    }
}

impl<'a> From<&'a Arc<Inner>> for Through<'a> {
    fn from(inner: &'a Arc<Inner>) -> Self {
        Self {
            driver: &inner.driver,
            backend: &inner.backend,
        }
    }
}

impl<'a> From<&'a LockManager> for Lookup<'a> {
    fn from(manager: &'a LockManager) -> Self {
        Self {
            registry: &manager.inner.registry,
            backend: &manager.inner.backend,
            driver: &manager.inner.driver,
        }
    }
}

impl fmt::Debug for LockManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManager")
            .field("target", &self.inner.target)
            .field("key_prefix", &self.inner.prefix)
            .field("defaults", &self.inner.defaults)
            .finish_non_exhaustive()
    }
}

/// Which deployment a builder connects to: the last of `redis_url`, `cluster`, `sentinel`
/// and `redlock` called.
#[derive(Debug, Clone)]
enum Topology {
    /// One server (no URL yet: `build` says so).
    Single(Vec<String>),
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
    fn urls(&self) -> &[String] {
        match self {
            Self::Single(urls) | Self::Cluster(urls) | Self::RedLock(urls) => urls,
            Self::Sentinel { sentinels, .. } => sentinels,
        }
    }

    /// The builder method that sets it, as errors name it.
    fn method(&self) -> &'static str {
        match self {
            Self::Single(_) => "redis_url",
            Self::Cluster(_) => "cluster",
            Self::Sentinel { .. } => "sentinel",
            Self::RedLock(_) => "redlock",
        }
    }

    /// Its name in `Debug` output (the master's name included, which is no secret).
    fn name(&self) -> String {
        match self {
            Self::Single(_) => "single".into(),
            Self::Cluster(_) => "cluster".into(),
            Self::Sentinel { master, .. } => format!("sentinel ({master})"),
            Self::RedLock(_) => "redlock".into(),
        }
    }
}

/// Configures a [`LockManager`]; [`build`](Self::build) checks everything and connects.
///
/// Nothing here panics: a bad value is reported by `build` as [`LockError::Config`].
#[derive(Clone)]
#[must_use = "a builder does nothing until `build().await` is called"]
pub struct LockManagerBuilder {
    topology: Topology,
    prefix: String,
    defaults: Defaults,
    connect_timeout: Duration,
    response_timeout: Duration,
    sync_replicas: Option<(u32, Duration)>,
    restart_delay: Option<Duration>,
    security: Security,
    require_noeviction: bool,
    client_name: Option<String>,
    cohort: crate::waiters::CohortBounds,
}

impl Default for LockManagerBuilder {
    fn default() -> Self {
        Self {
            topology: Topology::Single(Vec::new()),
            prefix: "distlock:".to_owned(),
            defaults: Defaults {
                ttl: Duration::from_secs(30),
                retries: 0,
                retry_delay: Duration::from_millis(50),
                wait: None,
                max_hold: Some(Duration::from_secs(3600)),
            },
            connect_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            sync_replicas: None,
            restart_delay: None,
            security: Security::default(),
            require_noeviction: false,
            client_name: None,
            cohort: crate::waiters::CohortBounds::default(),
        }
    }
}

impl fmt::Debug for LockManagerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManagerBuilder")
            .field("topology", &self.topology.name())
            .field(
                "urls",
                &self
                    .topology
                    .urls()
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("key_prefix", &self.prefix)
            .field("defaults", &self.defaults)
            .field("sync_replicas", &self.sync_replicas)
            .field("redlock_restart_delay", &self.restart_delay)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("security", &self.security)
            .field("require_noeviction", &self.require_noeviction)
            .field("client_name", &self.client_name)
            .field("cohort", &self.cohort)
            .finish()
    }
}

impl LockManagerBuilder {
    /// A single Redis server, as a `redis://` or `rediss://` URL (`redis://:password@host:6379/0`).
    /// Credentials in the URL never appear in `Debug` output, errors or logs.
    pub fn redis_url(mut self, url: impl Into<String>) -> Self {
        self.topology = Topology::Single(vec![url.into()]);
        self
    }

    /// A Redis Cluster, reached through one or more of its nodes (`seeds`). Every key of a
    /// lock shares one hash slot, so its scripts run on the node that owns that slot; the
    /// connection follows MOVED and ASK redirections and failovers. Replaces `redis_url`.
    ///
    /// Waiters are woken through classic pub/sub on the first seed (a PUBLISH reaches every
    /// node of a cluster); if that node is down, their fallback timers take over.
    /// `sync_replicas` is not available on Cluster.
    pub fn cluster<I, S>(mut self, seeds: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topology = Topology::Cluster(seeds.into_iter().map(Into::into).collect());
        self
    }

    /// A master managed by Redis Sentinel: the Sentinels at `sentinels` are asked for the
    /// address of `master_name`, and asked again when the master stops answering or answers
    /// READONLY (it was demoted), so the manager follows failovers. Replaces `redis_url`.
    ///
    /// During a failover, requests fail with [`LockError::Redis`] (never succeed against a
    /// read-only replica) until the new master is known. A failover can lose a lock that was
    /// not yet replicated: see [`sync_replicas`](Self::sync_replicas).
    pub fn sentinel<I, S>(mut self, sentinels: I, master_name: impl Into<String>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topology = Topology::Sentinel {
            sentinels: sentinels.into_iter().map(Into::into).collect(),
            master: master_name.into(),
        };
        self
    }

    /// RedLock over independent Redis masters (at least 3; an odd number is best): a lock is
    /// held when a majority of them granted it within its lease. Replaces `redis_url`.
    ///
    /// Each master is a plain server with no replication between them. Locks taken this way
    /// survive the crash of a minority of masters; see the guide's
    /// [topologies](https://docs.rs/distlock/latest/distlock/guide/topologies/index.html) for what RedLock
    /// does and does not promise. Exclusive locks only (also reentrant), without fencing
    /// tokens: the masters' counters are independent, so no single increasing sequence exists.
    pub fn redlock<I, S>(mut self, urls: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topology = Topology::RedLock(urls.into_iter().map(Into::into).collect());
        self
    }

    /// The namespace for every key the manager writes (default `"distlock:"`). It must not
    /// contain braces.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The lease of a lock whose request sets no `ttl` (default 30 s); at most
    /// [`MAX_TTL`](crate::MAX_TTL).
    pub fn default_ttl(mut self, ttl: Duration) -> Self {
        self.defaults.ttl = ttl;
        self
    }

    /// Extra attempts after the first for requests that set no `retries` (default 0).
    pub fn default_retries(mut self, retries: u32) -> Self {
        self.defaults.retries = retries;
        self
    }

    /// The base of the exponential backoff between attempts (default 50 ms).
    pub fn default_retry_delay(mut self, delay: Duration) -> Self {
        self.defaults.retry_delay = delay;
        self
    }

    /// The total time a request that sets no `wait` may spend waiting (default: unbounded by
    /// time, bounded by the number of retries). Longer than [`MAX_TTL`](crate::MAX_TTL)
    /// means no time bound.
    pub fn default_wait(mut self, wait: Duration) -> Self {
        self.defaults.wait = Some(wait);
        self
    }

    /// How long the watchdog keeps renewing a lease whose request sets no `max_hold`
    /// (default 1 hour). `None` (or `Some(Duration::MAX)`) renews for as long as the guard
    /// lives.
    pub fn default_max_hold(mut self, max_hold: Option<Duration>) -> Self {
        self.defaults.max_hold = max_hold;
        self
    }

    /// With `redlock`: how long a master that restarted (its run_id changed, so it may have
    /// lost its data) is kept out of quorums, counted from when the restart is noticed
    /// (default: the default TTL; set it to the longest lease in use). A restart is noticed
    /// when a connection to the master breaks, which a restart always does.
    pub fn redlock_restart_delay(mut self, delay: Duration) -> Self {
        self.restart_delay = Some(delay);
        self
    }

    /// After every grant, wait (Redis `WAIT`) until `replicas` replicas have acknowledged it,
    /// for at most `timeout`; with fewer acknowledgements the lock is given back and the
    /// request fails with [`LockError::NotReplicated`]. This narrows the window in which a
    /// failover to a replica loses a granted lock; it does not close it (WAIT is not
    /// consensus: an acknowledged write can still be lost, and a replica that is promoted may
    /// not be one that acknowledged).
    pub fn sync_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.sync_replicas = Some((replicas, timeout));
        self
    }

    /// How long connecting to Redis may take (default 1 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long one round trip to Redis may take before it fails (default 1 s). A request
    /// that must first wait for a connection to open waits at most the
    /// [`connect_timeout`](Self::connect_timeout) for it. A connection whose answer did not
    /// come in time is dropped, and the next request opens a new one: on a network that drops
    /// packets, it may be half-open.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Connects to the data nodes as the ACL user `username` with `password`, instead of
    /// the user name and password of their URLs (use `"default"` for a server that only sets
    /// `requirepass`). Works on every topology; with [`sentinel`](Self::sentinel) it applies
    /// to the master only, while the Sentinels keep the credentials of their URLs.
    ///
    /// The password never appears in `Debug` output, errors or logs. The guide's
    /// [ACL users](https://docs.rs/distlock/latest/distlock/guide/server_setup/index.html#acl-users) gives
    /// the permissions the user needs ([`LockManager::acl_rules`] prints them).
    pub fn credentials(mut self, username: impl Into<String>, password: impl Into<String>) -> Self {
        self.security.credentials = Some(Credentials {
            username: Some(username.into()),
            password: password.into(),
        });
        self
    }

    /// Trusts the certificate authorities in `pem` (PEM text, one or more certificates)
    /// instead of the system's roots, for every `rediss://` connection. Needs the `tls`
    /// feature.
    pub fn tls_ca_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.security.tls.get_or_insert_with(Tls::default).ca = Some(pem.into());
        self
    }

    /// Presents the certificate chain `cert_pem` and its private key `key_pem` (PEM text) to
    /// servers that ask for a client certificate (`tls-auth-clients yes`), on every `rediss://`
    /// connection. Needs the `tls` feature.
    pub fn tls_client_certificate(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.security.tls.get_or_insert_with(Tls::default).client =
            Some((cert_pem.into(), key_pem.into()));
        self
    }

    /// Refuses to build when a master may evict keys under memory pressure: when its
    /// `maxmemory-policy` is anything but `noeviction`, or cannot be read (default `false`:
    /// build, and warn through `tracing`).
    ///
    /// Lock keys carry a TTL, so every `volatile-*` policy (and every `allkeys-*` one) may
    /// delete a held lock when the server runs out of memory, and hand it to another owner
    /// while the first still works under it.
    pub fn require_noeviction(mut self, require: bool) -> Self {
        self.require_noeviction = require;
        self
    }

    /// The bounds of a cohort's run: when a holder releases a plain exclusive lock that
    /// another task of this manager waits for, the lock passes to that task with no server
    /// command (see [`LockRequest::cohort`](crate::LockRequest::cohort)), at most `passes`
    /// times in a row and for at most `time` (a tenth of the lease when that is shorter);
    /// then the release goes to Redis and the other processes waiting for the key get their
    /// turn before this manager's tasks compete again. Default: 64 passes, 10 ms. `passes`
    /// 0 turns local passes off for every lock of this manager.
    /// A `time` of zero turns them off too.
    pub fn cohort(mut self, passes: u32, time: Duration) -> Self {
        let passes = if time.is_zero() { 0 } else { passes };
        self.cohort = crate::waiters::CohortBounds { passes, time };
        self
    }

    /// The name this manager goes by: shown by the inspector next to every lock it holds, in
    /// [`LockError::Busy`] when it holds what another asked for, and as the name of its Redis
    /// connections (`CLIENT LIST`). One word of printable characters, at most 128 bytes.
    /// Default: `DISTLOCK_CLIENT_NAME` if set (read by `build`, and by
    /// [`from_env`](Self::from_env)), or else the name of the running executable.
    pub fn client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = Some(name.into());
        self
    }

    /// Checks the configuration, connects, and loads the scripts.
    ///
    /// It also reads every master's `maxmemory-policy` (see
    /// [`require_noeviction`](Self::require_noeviction)), and fails with
    /// [`LockError::Config`] naming the command when the user lacks a permission it needs.
    ///
    /// A server that cannot be reached is a [`LockError::Config`] naming it (the address
    /// refuses connections, or is not a Redis server), except a server that does not answer
    /// in time: that is [`LockError::Redis`], as for any call on a network that drops packets,
    /// and building again later may succeed.
    pub async fn build(self) -> Result<LockManager, LockError> {
        if self.topology.urls().is_empty() {
            return Err(LockError::Config(
                "no Redis endpoint: call `redis_url(\"redis://host:6379\")` or `redlock([...])`"
                    .into(),
            ));
        }
        self.check()?;
        let target = self
            .topology
            .urls()
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(", ");
        let driver = Driver::start()?;
        // The manager's id: the first half of every owner token it makes (see `new_token`),
        // drawn from the system's entropy, as a UUID v4 is.
        let tag: Arc<str> = format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0).into();
        // The builder's, or the environment's (checked as `from_env` checks it), or the
        // executable's name.
        let client_name = match (&self.client_name, std::env::var("DISTLOCK_CLIENT_NAME")) {
            (Some(name), _) => name.clone(),
            (None, Ok(name)) => {
                crate::identity::check_client_name(&name).map_err(|reason| {
                    LockError::Config(format!("DISTLOCK_CLIENT_NAME {reason}"))
                })?;
                name
            }
            (None, Err(_)) => crate::identity::default_client_name(),
        };
        let registry = Arc::new(crate::identity::Registry::new(
            &self.prefix,
            crate::identity::HolderIdentity::current(&tag, client_name.clone()),
        ));
        // Longer than any lease is as good as forever, and still fits on a clock.
        let options = ConnectOptions {
            connect_timeout: self.connect_timeout.min(MAX_TTL),
            response_timeout: self.response_timeout.min(MAX_TTL),
            sync_replicas: self
                .sync_replicas
                .map(|(replicas, timeout)| (replicas, timeout.min(MAX_TTL))),
            restart_delay: self.restart_delay.unwrap_or(self.defaults.ttl).min(MAX_TTL),
            security: Arc::new(Security {
                socket: Some(crate::security::socket_timeouts(
                    self.response_timeout.min(MAX_TTL),
                )),
                ..self.security.clone()
            }),
            tag: tag.clone(),
            client_name: format!("{client_name}:{tag}").into(),
            background: driver.handle().clone(),
        };
        let (connect_timeout, response_timeout) =
            (options.connect_timeout, options.response_timeout);
        // Connect from the caller's runtime, which is where its requests will come from.
        if matches!(self.topology, Topology::Cluster(_)) && self.sync_replicas.is_some() {
            return Err(LockError::Config(
                "`sync_replicas` is not available with `cluster`".into(),
            ));
        }
        let topology = self.topology.clone();
        let require_noeviction = self.require_noeviction;
        let target_of_connect = target.clone();
        let registry_of_connect = Arc::clone(&registry);
        let connect = async move {
            let backend = match &topology {
                Topology::Single(urls) => {
                    let url = urls.first().map_or("", String::as_str);
                    Backend::connect(url, options).await
                }
                Topology::Cluster(seeds) => Backend::connect_cluster(seeds, options).await,
                Topology::Sentinel { sentinels, master } => {
                    Backend::connect_sentinel(sentinels, master, options).await
                }
                Topology::RedLock(masters) => Backend::connect_redlock(masters, options).await,
            };
            match backend {
                Ok(backend) => {
                    check_eviction(&backend, require_noeviction).await?;
                    registry_of_connect.register(&backend).await;
                    Ok(backend)
                }
                Err(error) => Err(connect_error(&target_of_connect, error)),
            }
        };
        let connected = if tokio::runtime::Handle::try_current().is_ok() {
            connect.await
        } else {
            driver.run(connect).await?
        };
        let backend = connected?;
        tracing::debug!(target = %target, prefix = %self.prefix, "lock manager connected");
        let manager = LockManager {
            inner: Arc::new(Inner {
                backend,
                driver: Arc::new(driver),
                watchdog: Watchdog::default(),
                waiters: Waiters::new(connect_timeout, response_timeout, tag, self.cohort),
                holds: Holds::default(),
                prefix: self.prefix,
                defaults: self.defaults,
                registry,
                target,
            }),
        };
        let inner = &manager.inner;
        inner.driver.spawn(crate::identity::keep_registered(
            Arc::clone(&inner.registry),
            inner.backend.clone(),
            inner.holds.watch(),
        ));
        Ok(manager)
    }

    /// The checks that need no connection. Each one is a function that
    /// [`from_vars`](Self::from_vars) also runs, so that its errors name the variable.
    fn check(&self) -> Result<(), LockError> {
        let config =
            |subject: &str, reason: String| LockError::Config(format!("{subject} {reason}"));
        if let Topology::RedLock(urls) = &self.topology {
            check_masters(urls.len()).map_err(|reason| config("RedLock", reason))?;
        }
        let method = format!("`{}`", self.topology.method());
        for url in self.topology.urls() {
            check_url(url).map_err(|reason| config(&method, reason))?;
        }
        key::check_prefix(&self.prefix).map_err(|reason| config("key prefix", reason))?;
        self.security.check(self.topology.urls())?;
        check_ttl(self.defaults.ttl).map_err(|reason| config("`default_ttl`", reason))?;
        if let Some((replicas, timeout)) = self.sync_replicas
            && (replicas == 0 || timeout.is_zero())
        {
            return Err(LockError::Config(
                "`sync_replicas` needs at least one replica and a timeout above zero".into(),
            ));
        }
        check_timeout(self.connect_timeout).map_err(|r| config("`connect_timeout`", r))?;
        check_timeout(self.response_timeout).map_err(|r| config("`response_timeout`", r))?;
        if let Some(name) = &self.client_name {
            crate::identity::check_client_name(name)
                .map_err(|reason| config("`client_name`", reason))?;
        }
        Ok(())
    }

    /// Every URL given, for [`from_vars`](Self::from_vars)'s checks.
    pub(crate) fn endpoint_urls(&self) -> &[String] {
        self.topology.urls()
    }
}

/// The schemes of the URLs the redis client connects to.
const SCHEMES: [&str; 7] = [
    "redis",
    "rediss",
    "valkey",
    "valkeys",
    "redis+unix",
    "valkey+unix",
    "unix",
];

/// Checks an endpoint URL before anything connects: a scheme the redis client knows, and a
/// URL it reads. The reason, on failure, follows the name of the setting the URL came from (a
/// builder method or an environment variable); it shows the URL through [`redact_url`] only,
/// and leaves out the client's detail, which may quote part of the URL.
pub(crate) fn check_url(url: &str) -> Result<(), String> {
    use redis::IntoConnectionInfo;

    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    let Some(scheme) = scheme.filter(|scheme| SCHEMES.contains(&scheme.as_str())) else {
        return Err(format!(
            "must hold `redis://` or `rediss://` URLs, got `{}`",
            redact_url(url)
        ));
    };
    // Without the `tls` feature the client reads no `rediss://` URL; `build` says why.
    if !cfg!(feature = "tls") && matches!(scheme.as_str(), "rediss" | "valkeys") {
        return Ok(());
    }
    url.into_connection_info().map(drop).map_err(|error| {
        let hint = if url.contains('@') {
            " (a user name or password must have its `/`, `?`, `#` and `%` percent-encoded)"
        } else {
            ""
        };
        format!(
            "holds a URL the redis client cannot read, `{}`: {}{hint}",
            redact_url(url),
            without_detail(&error)
        )
    })
}

/// The redis client's `error` without its detail: a URL's errors may quote part of it (the
/// `protocol` parameter).
fn without_detail(error: &redis::RedisError) -> String {
    let text = error.to_string();
    match error.detail() {
        None => text,
        Some(detail) => text
            .strip_suffix(detail)
            .and_then(|text| text.strip_suffix(": "))
            .map_or_else(|| error.category().to_owned(), str::to_owned),
    }
}

/// Checks the number of RedLock masters. The reason, on failure, follows `RedLock` or the
/// name of an environment variable.
pub(crate) fn check_masters(count: usize) -> Result<(), String> {
    if count < 3 {
        return Err(format!("needs at least 3 independent masters, got {count}"));
    }
    Ok(())
}

/// Checks a connect or response timeout. The reason, on failure, follows the name of the
/// setting.
pub(crate) fn check_timeout(timeout: Duration) -> Result<(), String> {
    if timeout.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(())
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

/// Reads every master's `maxmemory-policy` (CONFIG GET, else INFO memory) and warns about, or
/// with `require` refuses, any policy that may evict a held lock.
async fn check_eviction(backend: &Backend, require: bool) -> Result<(), LockError> {
    let config = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .to_owned();
    let info = redis::cmd("INFO").arg("memory").to_owned();
    let mut unknown = 0;
    for answer in backend.ask_masters(&[config, info]).await {
        let policies = match answer {
            Ok((0, masters)) => config_policies(masters),
            Ok((_, masters)) => info_policies(masters),
            Err(error) if backend::denied(&error) => {
                unknown += 1;
                continue;
            }
            // An unreachable RedLock minority, or an answer late on a busy server: not knowing
            // its policy is no reason to fail.
            Err(error) => {
                tracing::debug!(%error, "maxmemory-policy not read");
                continue;
            }
        };
        for (master, policy) in policies {
            if policy == "noeviction" {
                continue;
            }
            if require {
                return Err(LockError::Config(format!(
                    "`require_noeviction`: the master at {master} has maxmemory-policy \
                     `{policy}`, which may evict held locks; set it to `noeviction`"
                )));
            }
            tracing::warn!(
                %master,
                %policy,
                "maxmemory-policy may evict held locks under memory pressure: set it to \
                 `noeviction` (or use `require_noeviction` to refuse)"
            );
        }
    }
    if unknown > 0 {
        if require {
            return Err(LockError::Config(
                "`require_noeviction`: maxmemory-policy cannot be read (CONFIG GET and INFO \
                 are denied to this user)"
                    .into(),
            ));
        }
        tracing::warn!(
            "maxmemory-policy could not be checked (CONFIG GET and INFO are denied to this \
             user): under memory pressure, a policy other than `noeviction` may evict held locks"
        );
    }
    Ok(())
}

/// `(master, policy)` from CONFIG GET answers (a map in RESP3, a pair in RESP2).
fn config_policies(masters: Vec<(String, redis::Value)>) -> Vec<(String, String)> {
    masters
        .into_iter()
        .filter_map(|(master, value)| {
            let pairs: std::collections::HashMap<String, String> =
                redis::from_redis_value(value).ok()?;
            Some((master, pairs.get("maxmemory-policy")?.clone()))
        })
        .collect()
}

/// `(master, policy)` from INFO memory answers.
fn info_policies(masters: Vec<(String, redis::Value)>) -> Vec<(String, String)> {
    masters
        .into_iter()
        .filter_map(|(master, value)| {
            let text: String = redis::from_redis_value(value).ok()?;
            let policy = text
                .lines()
                .find_map(|line| line.strip_prefix("maxmemory_policy:"))?;
            Some((master, policy.trim().to_owned()))
        })
        .collect()
}

/// The URL `raw` with its user name and password replaced by `***`, for logs and errors:
/// scheme, host, port and path (the database number, or a socket's path) are kept; the query
/// and fragment are dropped (a query may carry a password: `unix://` URLs take theirs there).
///
/// The URL is read by the `url` crate, the parser the redis client uses. A user name or
/// password with a `/`, `?` or `#` that is not percent-encoded ends the authority early, so
/// part of it would be read as the host, port or path: whenever an `@` is found past the
/// authority, nothing but the scheme is shown (`redis://***`). A URL that does not parse
/// shows nothing of itself (`<redis url>`).
pub(crate) fn redact_url(raw: &str) -> String {
    const UNREADABLE: &str = "<redis url>";
    let Ok(url) = url::Url::parse(raw) else {
        return UNREADABLE.to_owned();
    };
    // The parser ignores leading and trailing controls and spaces.
    let raw = raw.trim_matches(|c: char| c <= ' ');
    let Some((scheme, rest)) = raw.split_once("://") else {
        return UNREADABLE.to_owned();
    };
    if !url.has_authority() || !scheme.eq_ignore_ascii_case(url.scheme()) {
        return UNREADABLE.to_owned();
    }
    // Where the parser ends the authority: at the first `/`, `?` or `#` after the `//` (and
    // `\` for the schemes the URL standard calls special), even inside a password.
    let special = matches!(
        url.scheme(),
        "http" | "https" | "ws" | "wss" | "ftp" | "file"
    );
    let end = rest
        .find(|c| matches!(c, '/' | '?' | '#') || (special && c == '\\'))
        .unwrap_or(rest.len());
    let (authority, after) = rest.split_at(end);
    // The user name and password are what precedes the authority's last `@`.
    let userinfo = authority.rfind('@').map_or("", |at| &authority[..at]);
    let credentials = !url.username().is_empty() || url.password().is_some();
    if after.contains('@') || userinfo.is_empty() == credentials {
        return format!("{}://***", url.scheme());
    }
    let shown = &url[url::Position::BeforeHost..url::Position::AfterPath];
    let hidden = if credentials { "***@" } else { "" };
    format!("{}://{hidden}{shown}", url.scheme())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_lose_their_credentials() {
        assert_eq!(
            redact_url("redis://127.0.0.1:6379"),
            "redis://127.0.0.1:6379"
        );
        assert_eq!(
            redact_url("redis://:hunter2@db:6379/0"),
            "redis://***@db:6379/0"
        );
        assert_eq!(redact_url("rediss://user:p%40ss@db"), "rediss://***@db");
        assert_eq!(
            redact_url("redis://db:6379/1?password=hunter2"),
            "redis://db:6379/1"
        );
        assert_eq!(redact_url("not a url"), "<redis url>");
    }

    #[test]
    fn credentials_that_split_the_url_show_nothing_of_it() {
        // A user name or password with a raw `/`, `?` or `#` ends the authority early, and
        // its pieces would be read as host, port, path, query or fragment: none shows.
        assert_eq!(redact_url("redis://:pa/ss@host"), "<redis url>");
        assert_eq!(redact_url("redis://:1234/ss@host"), "<redis url>");
        assert_eq!(redact_url("redis://u:12?x@db"), "redis://***");
        assert_eq!(redact_url("redis://user:pa@x/y@host:1/0"), "redis://***");
        assert_eq!(redact_url("rediss://:p#w@db"), "<redis url>");
        assert_eq!(redact_url("http://u:p@h\\x@y"), "http://***");
        // Not after a scheme and `//`: nothing shows.
        assert_eq!(redact_url("pass:word@host"), "<redis url>");
        assert_eq!(redact_url("redis:user:pass@host"), "<redis url>");
    }

    #[test]
    fn what_is_no_secret_is_kept() {
        assert_eq!(redact_url("redis://:p@ss@host:1/0"), "redis://***@host:1/0");
        assert_eq!(redact_url("redis://user@db"), "redis://***@db");
        assert_eq!(redact_url("redis://@db"), "redis://db");
        assert_eq!(redact_url("redis://:p\\w@db"), "redis://***@db");
        assert_eq!(
            redact_url("redis://:pw@[::1]:6379/2#insecure"),
            "redis://***@[::1]:6379/2"
        );
        assert_eq!(redact_url("REDIS://db:7000/3"), "redis://db:7000/3");
        assert_eq!(
            redact_url("unix:///run/redis.sock?db=1&user=u&pass=secret"),
            "unix:///run/redis.sock"
        );
        assert_eq!(
            redact_url("redis+unix://u:pw@localhost/run/redis.sock"),
            "redis+unix://***@localhost/run/redis.sock"
        );
        assert_eq!(redact_url("tcp://u:pw@db:1"), "tcp://***@db:1");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Mostly the characters that end or split the parts of a URL, sometimes any
        /// printable one.
        fn secret() -> impl Strategy<Value = String> {
            proptest::collection::vec(
                prop_oneof![
                    3 => proptest::sample::select(vec![
                        '/', '?', '#', '@', ':', '%', '[', ']', '\\', '&', '=', ' ', '2', 'F', 'a',
                        '\u{e9}', '\u{65e5}',
                    ]),
                    1 => any::<char>().prop_filter("printable", |c| !c.is_control()),
                ],
                0..16,
            )
            .prop_map(String::from_iter)
        }

        /// `text` percent-encoded as a URL's user name or password should be.
        fn encoded(text: &str) -> String {
            text.bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                        char::from(b).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect()
        }

        /// Whether `output` shows `secret` (raw or percent-encoded) where `allowed`, what the
        /// redaction may show, does not explain it.
        fn shows(output: &str, secret: &str, allowed: &[String]) -> bool {
            secret.chars().count() >= 3
                && [secret.to_owned(), encoded(secret)].iter().any(|s| {
                    output.contains(s.as_str()) && !allowed.iter().any(|a| a.contains(s.as_str()))
                })
        }

        proptest! {
            #[test]
            fn no_credential_ever_shows(
                scheme in proptest::sample::select(vec!["redis", "rediss", "redis+unix", "unix"]),
                host in proptest::sample::select(vec!["db", "127.0.0.1", "[::1]", "a.example"]),
                port in proptest::sample::select(vec!["", ":6379", ":7000"]),
                db in proptest::option::of(0..16u8),
                socket_host in proptest::sample::select(vec!["", "localhost"]),
                query in proptest::sample::select(vec!["", "?protocol=resp3", "?db=2"]),
                username in proptest::option::of(secret()),
                password in secret(),
                raw in any::<bool>(),
                in_query in any::<bool>(),
            ) {
                let unix = scheme.contains("unix");
                let address = if unix {
                    format!("{socket_host}/run/redis.sock")
                } else {
                    let db = db.map_or_else(String::new, |db| format!("/{db}"));
                    format!("{host}{port}{db}")
                };
                let write = |text: &str| if raw { text.to_owned() } else { encoded(text) };
                let userinfo = match &username {
                    Some(username) => format!("{}:{}", write(username), write(&password)),
                    None => format!(":{}", write(&password)),
                };
                let url = if in_query {
                    let join = if query.is_empty() { '?' } else { '&' };
                    let user = username
                        .as_deref()
                        .map_or_else(String::new, |u| format!("user={}&", write(u)));
                    format!("{scheme}://{address}{query}{join}{user}pass={}", write(&password))
                } else {
                    format!("{scheme}://{userinfo}@{address}{query}")
                };
                let output = redact_url(&url);

                let plain = format!("{scheme}://{address}");
                let hidden = format!("{scheme}://***@{address}");
                let allowed = [
                    plain.clone(),
                    hidden.clone(),
                    format!("{scheme}://***"),
                    "<redis url>".to_owned(),
                ];
                prop_assert!(allowed.contains(&output), "{} shows as {}", url, output);
                if !raw {
                    let expected = if in_query {
                        plain
                    } else if userinfo == ":" {
                        format!("{scheme}://***")
                    } else if unix && socket_host.is_empty() {
                        // Credentials need a host: the URL does not parse.
                        "<redis url>".to_owned()
                    } else {
                        hidden
                    };
                    prop_assert_eq!(&output, &expected, "{}", url);
                }
                for secret in std::iter::once(&password).chain(&username) {
                    prop_assert!(!shows(&output, secret, &allowed), "{} shows as {}", url, output);
                }
            }
        }
    }

    #[tokio::test]
    async fn bad_configuration_is_an_error_not_a_panic() {
        let no_url = LockManager::builder().build().await;
        assert!(matches!(no_url, Err(LockError::Config(_))));
        let bad_url = LockManager::builder().redis_url("http://x").build().await;
        assert!(matches!(bad_url, Err(LockError::Config(_))));
        let zero_ttl = LockManager::builder()
            .redis_url("redis://127.0.0.1:1")
            .default_ttl(Duration::ZERO)
            .build()
            .await;
        assert!(matches!(zero_ttl, Err(LockError::Config(m)) if m.contains("default_ttl")));
        let braces = LockManager::builder()
            .redis_url("redis://127.0.0.1:1")
            .key_prefix("a{")
            .build()
            .await;
        assert!(matches!(braces, Err(LockError::Config(_))));
    }

    #[test]
    fn debug_never_shows_the_password() {
        let builder = LockManager::builder().redis_url("redis://:hunter2@db:6379");
        assert!(!format!("{builder:?}").contains("hunter2"));
    }
}
