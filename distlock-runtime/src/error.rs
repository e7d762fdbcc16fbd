//! The one error type of the library.

use std::time::Duration;

use crate::holder::HolderIdentity;

/// What went wrong while taking, holding or giving back a lock.
///
/// Match on the variant to tell the cases apart: [`Busy`](Self::Busy) means another owner
/// holds the key (try later), [`Lost`](Self::Lost) means this owner no longer holds what it
/// thought it held, [`Redis`](Self::Redis) is a connection or server failure, and the rest are
/// mistakes in input or setup that no retry can fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lock is held by another owner and was not acquired within the request's bounds.
    #[error(
        "lock `{key}` is busy: not acquired after {attempts} attempt(s) in {waited:?}{}",
        held_by(holder.as_deref(), holder_token.as_deref())
    )]
    #[non_exhaustive]
    Busy {
        /// The key as the caller named it (without the manager's prefix).
        key: String,
        /// How many times acquisition was tried.
        attempts: u32,
        /// How long the request spent, from its first attempt to giving up.
        waited: Duration,
        /// The owner token of the holder, when the server named it: the last attempt of a
        /// plain exclusive lock gets it back (`SET … GET`); other kinds leave it `None`.
        holder_token: Option<String>,
        /// Who the holder is (`orders-api on host-3, pid 4242`), when the server named the
        /// holder and its manager's registration was there to read.
        holder: Option<Box<HolderIdentity>>,
    },

    /// The lease is no longer held by this owner: it expired, or the key was deleted or taken
    /// by another owner. Reported by release, extend and the lease-lost signal.
    #[error("lock `{key}` is no longer held: its lease expired or another owner took it")]
    #[non_exhaustive]
    Lost {
        /// The key as the caller named it.
        key: String,
    },

    /// The current task already holds this key through a non-reentrant lock; waiting for it
    /// would wait for itself forever.
    #[error(
        "lock `{key}` is already held by this task; waiting for it would deadlock \
         (use `reentrant` to allow nested acquisition)"
    )]
    #[non_exhaustive]
    WouldDeadlock {
        /// The key as the caller named it.
        key: String,
    },

    /// The current task holds a read lock on this key and asked for the write lock: waiting
    /// would wait for its own read lock. Release the read lock first.
    #[error(
        "lock `{key}`: this task holds the read lock and asked for the write lock; \
         upgrading would deadlock, so release the read lock first"
    )]
    #[non_exhaustive]
    Upgrade {
        /// The key as the caller named it.
        key: String,
    },

    /// The lock was granted, but fewer replicas than `sync_replicas` asked for acknowledged
    /// it in time, so it was given back: a failover could have lost it.
    #[error(
        "lock `{key}` was not acknowledged by enough replicas ({acked} of {wanted}) and was released"
    )]
    #[non_exhaustive]
    NotReplicated {
        /// The key as the caller named it.
        key: String,
        /// Replicas that acknowledged the write.
        acked: u32,
        /// Replicas asked for.
        wanted: u32,
    },

    /// The semaphore is in use with a different number of permits than this request asked
    /// for. Every user of one key must pass the same `permits`; waiting would not help, so
    /// this is not retried. Another count can be used once every permit has been returned.
    #[error(
        "semaphore `{key}` is in use with {stored} permit(s), but this request asked for \
         {requested}: every user of one key must pass the same `permits` (another count can \
         be used once all its permits are returned)"
    )]
    #[non_exhaustive]
    PermitsMismatch {
        /// The key as the caller named it.
        key: String,
        /// The number of permits the key is in use with.
        stored: u32,
        /// The number of permits this request asked for.
        requested: u32,
    },

    /// Redis could not be reached or answered with an error.
    #[error("redis error on lock `{key}`: {source}")]
    #[non_exhaustive]
    Redis {
        /// The key the operation was for (empty for manager-wide operations).
        key: String,
        /// The error reported by the Redis client.
        #[source]
        source: redis::RedisError,
    },

    /// An argument was rejected before anything was sent to Redis.
    #[error("invalid {what}: {reason}")]
    #[non_exhaustive]
    InvalidInput {
        /// The argument that was rejected, such as `key` or `ttl`.
        what: &'static str,
        /// Why it was rejected, and what would be accepted.
        reason: String,
    },

    /// The manager was configured in a way that cannot work.
    #[error("invalid lock manager configuration: {0}")]
    Config(String),

    /// The macro needed the installed manager and none was installed.
    #[error(
        "no LockManager is installed: call `LockManager::install()` once at startup, \
         or pass `manager = …` to `#[distributed_lock]`"
    )]
    NotInstalled,

    /// `install()` was called when a manager was already installed.
    #[error("a LockManager is already installed; install one manager per process")]
    AlreadyInstalled,

    /// The manager's background driver has stopped, so nothing can reach Redis through it.
    #[error("the lock manager's background driver has stopped")]
    DriverStopped,

    /// [`LockManager::shutdown`](crate::LockManager::shutdown) was called: the manager
    /// released what it held and takes no more locks.
    #[error("the lock manager was shut down: it takes no more locks")]
    ShutDown,
}

/// The end of a busy error's message: who holds the lock, when known.
fn held_by(holder: Option<&HolderIdentity>, token: Option<&str>) -> String {
    match (holder, token) {
        (Some(holder), _) => format!(" (held by {holder})"),
        (None, Some(token)) => format!(" (held by {token}, an unknown or gone manager)"),
        (None, None) => String::new(),
    }
}

impl LockError {
    /// Whether this error means the lock is held by someone else (as opposed to a failure).
    pub fn is_busy(&self) -> bool {
        matches!(self, Self::Busy { .. })
    }

    /// Whether this error means this owner lost a lease it held.
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Lost { .. })
    }

    /// The key the error is about, when it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Busy { key, .. }
            | Self::Lost { key }
            | Self::WouldDeadlock { key }
            | Self::Upgrade { key }
            | Self::NotReplicated { key, .. }
            | Self::PermitsMismatch { key, .. }
            | Self::Redis { key, .. } => Some(key),
            _ => None,
        }
    }

    pub(crate) fn redis(key: &str, source: redis::RedisError) -> Self {
        Self::Redis {
            key: key.to_owned(),
            source,
        }
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidInput {
            what,
            reason: reason.into(),
        }
    }
}
