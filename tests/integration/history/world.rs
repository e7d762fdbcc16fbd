//! One program's world: the history, raw connections to where the lock keys live, and the
//! lease checks made through them.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::{LockGuard, LockManager, MultiGuard};

use super::checker::History;
use super::model::{BOUND, Features, Kind};

/// One program's world: where it runs and what it may use.
#[derive(Clone)]
pub(super) struct World {
    pub(super) history: Arc<History>,
    pub(super) raw: redis::aio::MultiplexedConnection,
    pub(super) features: Features,
    /// A raw connection reaches the lease keys (not on RedLock or Cluster).
    pub(super) check_leases: bool,
    /// Reaches the lock keys themselves, for the liveness monitor and for steals.
    pub(super) probe: Probe,
}

/// Raw connections to where the lock keys live.
#[derive(Clone)]
pub(super) enum Probe {
    /// One server (or Sentinel's master).
    One(redis::aio::MultiplexedConnection),
    /// Cluster masters: the one that owns a key answers, the others redirect.
    Cluster(Vec<redis::aio::MultiplexedConnection>),
    /// RedLock's independent masters.
    Masters(Vec<redis::aio::MultiplexedConnection>),
}

impl Probe {
    pub(super) fn connections(&self) -> &[redis::aio::MultiplexedConnection] {
        match self {
            Self::One(conn) => std::slice::from_ref(conn),
            Self::Cluster(conns) | Self::Masters(conns) => conns,
        }
    }

    /// `cmd key` on every connection, each bounded; the answers that came.
    pub(super) async fn ask(&self, cmd: &str, key: &str) -> Vec<i64> {
        let asks = self.connections().iter().map(|conn| {
            let mut conn = conn.clone();
            let mut command = redis::cmd(cmd);
            command.arg(key);
            async move {
                let answer = tokio::time::timeout(
                    Duration::from_millis(200),
                    command.query_async::<i64>(&mut conn),
                )
                .await;
                answer.ok().and_then(Result::ok)
            }
        });
        futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// What the server has left of the lock's lease (-2: no key), if it can be told: on
    /// RedLock, the longest any master has, and only when a majority answered.
    pub(super) async fn pttl(&self, key: &str) -> Option<i64> {
        let answers = self.ask("PTTL", key).await;
        match self {
            Self::One(_) | Self::Cluster(_) => answers.first().copied(),
            Self::Masters(conns) if answers.len() * 2 > conns.len() => answers.into_iter().max(),
            Self::Masters(_) => None,
        }
    }

    /// The owners of the exclusive or write lock at `key` (see `owner_of`), on every master
    /// that answers within 200 ms and has one (a Cluster master that does not own the key
    /// redirects, and has none).
    pub(super) async fn owners(&self, key: &str) -> Vec<String> {
        let asks = self.connections().iter().map(|conn| {
            let mut conn = conn.clone();
            async move {
                let owner = owner_of(&mut conn, key);
                (tokio::time::timeout(Duration::from_millis(200), owner).await).unwrap_or(None)
            }
        });
        let mut owners: Vec<String> = (futures_util::future::join_all(asks).await)
            .into_iter()
            .flatten()
            .collect();
        owners.dedup();
        owners
    }

    /// Deletes the lock key wherever `owner` still holds it, and wakes its waiters (as an
    /// operator's `DEL` followed by a `PUBLISH`): whether the lock was taken away (on RedLock,
    /// from a majority of the masters).
    pub(super) async fn steal(&self, key: &str, wake: &str, owner: &str) -> bool {
        let script = redis::Script::new(
            "local t = redis.call('type', KEYS[1])['ok'] \
             if (t == 'string' and redis.call('get', KEYS[1]) == ARGV[1]) \
                or (t == 'hash' and redis.call('hexists', KEYS[1], ARGV[1]) == 1) then \
               redis.call('del', KEYS[1]) redis.call('publish', KEYS[2], '') return 1 \
             end return 0",
        );
        let steals = self.connections().iter().map(|conn| {
            let mut conn = conn.clone();
            let mut call = script.key(key);
            call.key(wake).arg(owner);
            async move {
                let answer = tokio::time::timeout(
                    Duration::from_millis(200),
                    call.invoke_async::<i64>(&mut conn),
                )
                .await;
                answer.ok().and_then(Result::ok).unwrap_or(0)
            }
        });
        let deleted = futures_util::future::join_all(steals)
            .await
            .into_iter()
            .filter(|deleted| *deleted > 0)
            .count();
        match self {
            // The robbed owner still holds the lock while a majority keeps its copies (a
            // master paused or restarting missed the DEL).
            Self::Masters(conns) => deleted * 2 > conns.len(),
            _ => deleted > 0,
        }
    }
}

impl World {
    /// Runs `op`, recording a hang if it does not end within `BOUND`.
    pub(super) async fn bounded<T>(&self, what: &str, op: impl Future<Output = T>) -> Option<T> {
        match tokio::time::timeout(BOUND, op).await {
            Ok(value) => Some(value),
            Err(_) => {
                self.history
                    .violation(format!("hang: {what} did not end within {BOUND:?}"));
                None
            }
        }
    }

    /// `remaining()` must never promise more than the server still has.
    pub(super) async fn check_lease(
        &self,
        locks: &LockManager,
        key: &str,
        kind: Kind,
        guard: &LockGuard,
    ) {
        if !self.check_leases {
            return;
        }
        if guard.local_passes() > 0 && self.history.lock().robbed.contains_key(guard.token()) {
            return; // a robbed hold, passed on (see `History::enter`)
        }
        let lease_left = kind.lease_left(locks, key, guard.token());
        let what = format!("{key} as {kind:?}");
        self.check_pttl(&what, &lease_left, || guard.remaining(), || guard.is_lost())
            .await;
    }

    /// A set's `remaining()` must never promise more than the server still has of any lock
    /// the set took itself (`keys`).
    pub(super) async fn check_set_lease(
        &self,
        locks: &LockManager,
        keys: &[&str],
        guard: &MultiGuard,
    ) {
        if !self.check_leases {
            return;
        }
        for key in keys {
            let what = format!("{key} in the set {:?}", guard.keys());
            let lease_left = Kind::Exclusive.lease_left(locks, key, guard.token());
            self.check_pttl(&what, &lease_left, || guard.remaining(), || guard.is_lost())
                .await;
        }
    }

    /// What a guard says is `remaining` of its lease is no more than what `lease_left`
    /// answers (see `support::lease_left`; unless the lease is `lost` by the time the answer
    /// is in).
    pub(super) async fn check_pttl(
        &self,
        what: &str,
        lease_left: &redis::Cmd,
        remaining: impl Fn() -> Duration,
        lost: impl Fn() -> bool,
    ) {
        let started = Instant::now();
        let remaining = remaining();
        let mut raw = self.raw.clone();
        let pttl: Result<i64, _> = lease_left.query_async(&mut raw).await;
        let Ok(pttl) = pttl else {
            return; // a fault: nothing to compare with
        };
        self.history.lock().lease_checks += 1;
        let slack = started.elapsed() + Duration::from_millis(1);
        let server = u64::try_from(pttl).ok().map(Duration::from_millis);
        match server {
            _ if remaining.is_zero() || lost() => {}
            None => self.history.violation(format!(
                "lease: {what} reports {remaining:?} left but the server has PTTL {pttl}"
            )),
            Some(server) if remaining > server + slack => self.history.violation(format!(
                "lease: {what} reports {remaining:?} left, the server only {server:?}"
            )),
            Some(_) => {}
        }
    }
}

/// The owner of the exclusive or write lock at `lock`, in either form (a plain lock's
/// string, or a hash whose field is the owner token); `None` for any other kind (whose
/// shares have leases of their own) or a marker.
pub(super) async fn owner_of(
    conn: &mut redis::aio::MultiplexedConnection,
    lock: &str,
) -> Option<String> {
    let plain = redis::cmd("GET")
        .arg(lock)
        .query_async::<Option<String>>(conn)
        .await;
    if let Ok(owner) = plain {
        return owner;
    }
    let fields: Vec<String> = redis::cmd("HKEYS").arg(lock).query_async(conn).await.ok()?;
    if fields.iter().any(|f| f == "mode") {
        let mode: Option<String> = redis::cmd("HGET")
            .arg(lock)
            .arg("mode")
            .query_async(conn)
            .await
            .ok()?;
        if mode.as_deref() != Some("write") {
            return None;
        }
    }
    fields
        .into_iter()
        .find(|f| !matches!(f.as_str(), "mode" | "fence" | "permits") && !f.contains(':'))
}
