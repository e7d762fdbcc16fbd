//! [`LockManagerBuilder`]: the options of a manager, the checks they pass, and `build`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Backend, ConnectOptions};
use crate::driver::Driver;
use crate::error::LockError;
use crate::holds::HoldList;
use crate::key;
use crate::lease::{MAX_TTL, check_ttl};
use crate::release::Releaser;
use crate::security::{Credentials, Security, Tls};
use crate::waiters::{CohortBounds, Waiters};
use crate::watchdog::Watchdog;

use super::eviction::check_eviction;
use super::topology::Topology;
use super::{Defaults, Inner, LockManager, check_masters, check_timeout, check_url};

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
    sync_aof: bool,
    restart_delay: Option<Duration>,
    security: Security,
    require_noeviction: bool,
    client_name: Option<String>,
    cohort: CohortBounds,
}

impl Default for LockManagerBuilder {
    fn default() -> Self {
        Self {
            topology: Topology::Server(Vec::new()),
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
            sync_aof: false,
            restart_delay: None,
            security: Security::default(),
            require_noeviction: false,
            client_name: None,
            cohort: CohortBounds::default(),
        }
    }
}

impl fmt::Debug for LockManagerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockManagerBuilder")
            .field("topology", &self.topology.name())
            .field("urls", &self.topology.redacted_urls())
            .field("key_prefix", &self.prefix)
            .field("defaults", &self.defaults)
            .field("sync_replicas", &self.sync_replicas)
            .field("sync_aof", &self.sync_aof)
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
        self.topology = Topology::Server(vec![url.into()]);
        self
    }

    /// A Redis Cluster, reached through one or more of its nodes (`seeds`). Every key of a
    /// lock shares one hash slot, so its scripts run on the node that owns that slot; the
    /// connection follows MOVED and ASK redirections and failovers. Replaces `redis_url`.
    ///
    /// Waiters are woken per shard where the servers have sharded pub/sub (Redis 7.0 and
    /// later, Valkey): releases publish with `SPUBLISH`, and waiters follow each lock's wake
    /// channel with `SSUBSCRIBE` on the master of its slot, so a master that is down costs
    /// only its own keys' wake-ups (their fallback timers take over). On older servers, through
    /// classic pub/sub on the first seed.
    /// With `sync_replicas`, each grant's `WAIT` goes to the master that granted it (for a
    /// set, to each slot group's master).
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

    /// With [`sync_replicas`](Self::sync_replicas): wait with `WAITAOF 0 replicas timeout`
    /// instead of `WAIT`, so that a replica counts once the grant is fsynced to its
    /// append-only file (replicas need `appendonly yes`). `WAITAOF` needs Redis 7.2 or
    /// Valkey 8; `build()` asks the server and fails with [`LockError::Config`] where it is
    /// missing (Redis 7.0, some managed services).
    pub fn sync_replicas_aof(mut self, aof: bool) -> Self {
        self.sync_aof = aof;
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
        self.cohort = CohortBounds { passes, time };
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
        let target = self.topology.redacted_urls().join(", ");
        let driver = Driver::start()?;
        let manager_id = new_manager_id();
        let client_name = self.resolved_client_name()?;
        let registry = Arc::new(crate::identity::Registry::new(
            &self.prefix,
            crate::holder::HolderIdentity::current(&manager_id, client_name.clone()),
        ));
        let options = self.connect_options(&manager_id, &client_name, &driver);
        let timeouts = (options.connect_timeout, options.response_timeout);
        let backend = self.connect(options, &target, &registry, &driver).await?;
        tracing::debug!(target = %target, prefix = %self.prefix, "lock manager connected");
        let manager = LockManager {
            inner: Arc::new({
                let driver = Arc::new(driver);
                let waiters = Waiters::new(timeouts.0, timeouts.1, manager_id, self.cohort);
                let giver = Arc::new(Releaser {
                    backend: backend.clone(),
                    driver: driver.clone(),
                    waiters: waiters.clone(),
                });
                Inner {
                    backend,
                    driver,
                    watchdog: Watchdog::default(),
                    waiters,
                    holds: HoldList::default(),
                    prefix: self.prefix,
                    defaults: self.defaults,
                    registry,
                    target,
                    giver,
                }
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

    /// The name the manager goes by: the builder's, or the environment's (checked as
    /// `from_env` checks it), or the executable's.
    fn resolved_client_name(&self) -> Result<String, LockError> {
        match (&self.client_name, std::env::var("DISTLOCK_CLIENT_NAME")) {
            (Some(name), _) => Ok(name.clone()),
            (None, Ok(name)) => {
                crate::holder::check_client_name(&name).map_err(|reason| {
                    LockError::Config(format!("DISTLOCK_CLIENT_NAME {reason}"))
                })?;
                Ok(name)
            }
            (None, Err(_)) => Ok(crate::holder::default_client_name()),
        }
    }

    /// What the connections are opened with. Longer than any lease is as good as forever,
    /// and still fits on a clock.
    fn connect_options(
        &self,
        manager_id: &Arc<str>,
        client_name: &str,
        driver: &Driver,
    ) -> ConnectOptions {
        ConnectOptions {
            connect_timeout: self.connect_timeout.min(MAX_TTL),
            response_timeout: self.response_timeout.min(MAX_TTL),
            sync_replicas: self
                .sync_replicas
                .map(|(replicas, timeout)| (replicas, timeout.min(MAX_TTL))),
            sync_aof: self.sync_aof,
            restart_delay: self.restart_delay.unwrap_or(self.defaults.ttl).min(MAX_TTL),
            security: Arc::new(Security {
                socket: Some(crate::security::socket_timeouts(
                    self.response_timeout.min(MAX_TTL),
                )),
                ..self.security.clone()
            }),
            manager_id: manager_id.clone(),
            client_name: format!("{client_name}:{manager_id}").into(),
            background: driver.handle().clone(),
        }
    }

    /// Connects, checks the masters' eviction policy and registers the manager's identity:
    /// from the caller's runtime, which is where its requests will come from, or from the
    /// manager's own when the caller is not in one.
    async fn connect(
        &self,
        options: ConnectOptions,
        target: &str,
        registry: &Arc<crate::identity::Registry>,
        driver: &Driver,
    ) -> Result<Backend, LockError> {
        let topology = self.topology.clone();
        let require_noeviction = self.require_noeviction;
        let target = target.to_owned();
        let registry = Arc::clone(registry);
        let connect = async move {
            let backend = topology.connect(options, &target).await?;
            check_eviction(&backend, require_noeviction).await?;
            registry.register(&backend).await;
            Ok(backend)
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            connect.await
        } else {
            driver.run(connect).await?
        }
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
            crate::holder::check_client_name(name)
                .map_err(|reason| config("`client_name`", reason))?;
        }
        Ok(())
    }

    /// Every URL given, for [`from_vars`](Self::from_vars)'s checks.
    pub(crate) fn endpoint_urls(&self) -> &[String] {
        self.topology.urls()
    }
}

/// A new manager's id: 64 bits drawn from the system's entropy (as a UUID v4 is), in hex.
/// It names the manager's registration and its Redis connections, and is the first half of
/// every owner token the manager makes (see `token::new_token`).
fn new_manager_id() -> Arc<str> {
    format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0).into()
}

#[cfg(test)]
mod tests {
    use super::*;

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
