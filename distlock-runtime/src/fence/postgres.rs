//! Fenced writes to PostgreSQL (feature `postgres`, through `tokio-postgres`).
//!
//! [`Fence::check`] runs inside the caller's own transaction, before the writes it fences:
//! it records the fencing token for the resource in a small table (`resource text primary
//! key, fence bigint`) if no higher token was recorded, and fails with
//! [`FenceError::Stale`] otherwise. The statement is one
//! `INSERT … ON CONFLICT (resource) DO UPDATE … WHERE fence <= EXCLUDED.fence`: it locks the
//! resource's row until the transaction ends, so two holders' transactions on one resource
//! run one after the other, and one that carries a lower token than a committed one fails.
//! A holder paused past its lease can therefore never commit a write after the next
//! holder's: either it committed before the newer token was recorded, or its check fails.
//!
//! ```no_run
//! # async fn run(
//! #     client: &mut tokio_postgres::Client,
//! #     guard: &distlock_runtime::LockGuard,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! use distlock_runtime::fence::postgres::Fence;
//!
//! let fence = Fence::new();
//! fence.create_table(&*client).await?; // once, at startup
//! let tx = client.transaction().await?;
//! fence.check_guard(&tx, guard).await?; // fails, and nothing commits, for a stale holder
//! tx.execute("UPDATE accounts SET balance = balance + 10 WHERE id = 1", &[]).await?;
//! tx.commit().await?;
//! # Ok(())
//! # }
//! ```
//!
//! What it does not protect: writes that skip the check (another transaction, another
//! program), and a transaction that goes on after the check failed (the error is the
//! caller's to return; dropping the `Transaction` rolls it back).

use tokio_postgres::{GenericClient, Transaction};

use crate::guard::LockGuard;

/// The table [`Fence::new`] keeps its tokens in.
pub const DEFAULT_TABLE: &str = "distlock_fences";

/// Why a fenced write may not go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// A higher fencing token than this one was already accepted for the resource: the
    /// writer's lock has passed to a newer holder. Roll the transaction back.
    #[error("stale fencing token {token} for `{resource}`: token {highest} was already accepted")]
    #[non_exhaustive]
    Stale {
        /// The resource (by default, the lock's key).
        resource: String,
        /// The token this write carried.
        token: u64,
        /// The highest token accepted so far.
        highest: u64,
    },

    /// The guard carries no fencing token: take the lock with `.fencing(true)`.
    #[error("lock `{key}` was taken without a fencing token: request it with `.fencing(true)`")]
    #[non_exhaustive]
    NoToken {
        /// The lock's key.
        key: String,
    },

    /// A token or a table name that cannot be used.
    #[error("invalid {what}: {reason}")]
    #[non_exhaustive]
    InvalidInput {
        /// What was rejected.
        what: &'static str,
        /// Why, and what would be accepted.
        reason: String,
    },

    /// PostgreSQL could not be reached or refused the statement.
    #[error("postgres error: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// Checks fencing tokens against the highest accepted per resource, in a table of its own.
#[derive(Debug, Clone)]
pub struct Fence {
    table: String,
    upsert: String,
    highest: String,
}

impl Default for Fence {
    fn default() -> Self {
        Self::new()
    }
}

impl Fence {
    /// Keeps tokens in [`DEFAULT_TABLE`].
    pub fn new() -> Self {
        Self::in_table(DEFAULT_TABLE.to_owned())
    }

    /// Keeps tokens in `table`: a plain name (letters, digits, `_`, not starting with a digit,
    /// at most 63 bytes), optionally after a schema name and a dot.
    pub fn with_table(table: &str) -> Result<Self, FenceError> {
        let valid = |part: &str| {
            !part.is_empty()
                && part.len() <= 63
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !part.as_bytes()[0].is_ascii_digit()
        };
        let parts: Vec<&str> = table.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|part| valid(part)) {
            return Err(FenceError::InvalidInput {
                what: "table",
                reason: format!(
                    "`{table}` is not a plain table name: use letters, digits and `_` \
                     (at most 63 bytes, not starting with a digit), as `schema.table` or `table`"
                ),
            });
        }
        Ok(Self::in_table(table.to_owned()))
    }

    fn in_table(table: String) -> Self {
        let upsert = format!(
            "INSERT INTO {table} AS f (resource, fence, owner) VALUES ($1, $2, $3) \
             ON CONFLICT (resource) DO UPDATE SET fence = EXCLUDED.fence, owner = EXCLUDED.owner \
             WHERE f.fence < EXCLUDED.fence \
             OR (f.fence = EXCLUDED.fence AND f.owner = EXCLUDED.owner) RETURNING f.fence"
        );
        let highest = format!("SELECT fence FROM {table} WHERE resource = $1");
        Self {
            table,
            upsert,
            highest,
        }
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates the table if it does not exist.
    pub async fn create_table<C: GenericClient + Sync>(
        &self,
        client: &C,
    ) -> Result<(), FenceError> {
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {} (resource text PRIMARY KEY, fence bigint NOT NULL, \
             owner text NOT NULL DEFAULT '')",
            self.table
        );
        client.batch_execute(&create).await?;
        Ok(())
    }

    /// Records `token` for `resource` inside the caller's transaction `tx`, unless a higher
    /// token was accepted: then [`FenceError::Stale`]. A token equal to the highest passes
    /// (the same holder writing again; [`check_guard`](Self::check_guard) also ties it to the
    /// holder's owner token, so two owners that drew one token after a failover do not both
    /// pass). Call it first in the transaction: the resource's row stays locked until the
    /// transaction ends, so holders' transactions take turns.
    ///
    /// Under `READ COMMITTED` (PostgreSQL's default) a newer holder's check waits for an
    /// older holder's open transaction and then passes; under `REPEATABLE READ` or
    /// `SERIALIZABLE` it fails with a serialization error (SQLSTATE 40001) instead, to be
    /// retried. Either way a stale token never commits after a newer one. A paused older
    /// holder keeps the row locked while it is paused: set `lock_timeout` to bound the wait.
    pub async fn check(
        &self,
        tx: &Transaction<'_>,
        resource: &str,
        token: u64,
    ) -> Result<(), FenceError> {
        self.check_as(tx, resource, token, "").await
    }

    async fn check_as(
        &self,
        tx: &Transaction<'_>,
        resource: &str,
        token: u64,
        owner: &str,
    ) -> Result<(), FenceError> {
        let fence = i64::try_from(token).map_err(|_| FenceError::InvalidInput {
            what: "fencing token",
            reason: format!("{token} does not fit a PostgreSQL bigint"),
        })?;
        if tx
            .query_opt(&self.upsert, &[&resource, &fence, &owner])
            .await?
            .is_some()
        {
            return Ok(());
        }
        // Refused: the row exists (and is locked by this statement's check) with a higher
        // token, or the same token of another owner.
        let highest: i64 = tx.query_one(&self.highest, &[&resource]).await?.get(0);
        Err(FenceError::Stale {
            resource: resource.to_owned(),
            token,
            highest: u64::try_from(highest).unwrap_or(0),
        })
    }

    /// [`check`](Self::check) with the guard's fencing token and owner token. The row is the
    /// lock's full key (with the manager's prefix: two applications with other prefixes
    /// draw their tokens from other counters); a refusal names the key as the guard does.
    pub async fn check_guard(
        &self,
        tx: &Transaction<'_>,
        guard: &LockGuard,
    ) -> Result<(), FenceError> {
        let token = guard.fencing_token().ok_or_else(|| FenceError::NoToken {
            key: guard.key().to_owned(),
        })?;
        let ids = &guard.held().ids;
        match self.check_as(tx, &ids.lock, token, &ids.token).await {
            Err(FenceError::Stale { token, highest, .. }) => Err(FenceError::Stale {
                resource: guard.key().to_owned(),
                token,
                highest,
            }),
            other => other,
        }
    }
}
