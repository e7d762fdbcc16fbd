//! Reading and clearing locks from the outside: what the `distlock` command-line inspector
//! shows, read through the same key and data-model code the locks are written with.
//!
//! ```no_run
//! # async fn run(locks: &distlock_runtime::LockManager) -> Result<(), distlock_runtime::LockError> {
//! for lock in locks.list("order:*").await? {
//!     println!("{} {:?} held by {} for {:?}", lock.name, lock.kind, lock.holders.len(), lock.ttl);
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use redis::Value;

use crate::backend::Node;
use crate::key::{Keys, lock_key};
use crate::{LockError, LockManager};

/// What a lock key holds right now.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInfo {
    /// The lock's name, as code asks for it (without the manager's prefix).
    pub name: String,
    /// The Redis key of the lock.
    pub key: String,
    /// Which kind of lock holds the key.
    pub kind: LockKind,
    /// The owners: one for an exclusive or write lock, one per reader or permit holder, none
    /// for the `min_hold` marker.
    pub holders: Vec<Holder>,
    /// What is left of the key's lease (`None`: no expiry, which distlock never sets).
    pub ttl: Option<Duration>,
    /// The last fencing token drawn for this lock, if fencing was ever used on it.
    pub fencing_counter: Option<u64>,
    /// A semaphore's number of permits.
    pub permits: Option<u32>,
}

/// The kind of lock on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LockKind {
    /// An exclusive lock (the string form of a plain lock, or the hash of one with fencing or
    /// `min_hold`).
    Exclusive,
    /// The write side of a read-write lock.
    Write,
    /// The read side of a read-write lock.
    Read,
    /// Semaphore permits.
    Semaphore,
    /// The ownerless marker a released lock leaves until its `min_hold` has passed.
    MinHold,
    /// A key of a form distlock does not write (another program's key under the prefix).
    Foreign,
}

impl LockKind {
    /// A short lower-case name: `exclusive`, `write`, `read`, `semaphore`, `min_hold`,
    /// `foreign`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Exclusive => "exclusive",
            Self::Write => "write",
            Self::Read => "read",
            Self::Semaphore => "semaphore",
            Self::MinHold => "min_hold",
            Self::Foreign => "foreign",
        }
    }
}

/// One owner of a lock.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The owner's token (see [`LockGuard::token`](crate::LockGuard::token)).
    pub token: String,
    /// Holds counted on the server (older versions counted nested holds there; 1 otherwise).
    pub holds: u64,
    /// What is left of this holder's own lease (readers and permit holders have one each).
    pub ttl: Option<Duration>,
    /// The fencing token this holder drew, if any.
    pub fence: Option<u64>,
    /// Who the holder is, from the registration of the manager its token names: `None` when
    /// that registration is gone (the manager crashed or shut down without releasing, and
    /// the lock waits for its lease) — the inspector prints `unknown (gone)`.
    pub identity: Option<crate::HolderIdentity>,
}

impl LockManager {
    /// What holds the lock `name` now, or `None` when it is free.
    pub async fn inspect(&self, name: &str) -> Result<Option<LockInfo>, LockError> {
        let keys = Keys::new(&self.inner.prefix, name.to_owned())?;
        read(self, &keys).await
    }

    /// Every lock under this manager's prefix whose name matches `pattern` (`*` any run of
    /// characters, `?` one character; `*` lists all), sorted by name. Found with `SCAN`
    /// (never `KEYS`), on every master of a Cluster; a RedLock's first master is read.
    pub async fn list(&self, pattern: &str) -> Result<Vec<LockInfo>, LockError> {
        let prefix = &self.inner.prefix;
        let node = self.inner.backend.inspected();
        let scan = format!("{}{{*", glob_escape(prefix));
        let found = node
            .scan(&scan)
            .await
            .map_err(|e| LockError::redis(pattern, e))?;
        let mut locks = Vec::new();
        for key in found {
            let Some(name) = name_of(prefix, &key) else {
                continue;
            };
            if !glob(pattern.as_bytes(), name.as_bytes()) {
                continue;
            }
            let keys = Keys::new(prefix, name)?;
            if let Some(info) = read(self, &keys).await? {
                locks.push(info);
            }
        }
        locks.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(locks)
    }

    /// Removes the lock `name` whatever holds it — every holder loses it — and wakes its
    /// waiters; the fencing counter stays, so tokens keep increasing. Returns what was
    /// removed, or `None` when the lock was free. For stuck locks only: a holder that is still
    /// running is not stopped, and learns of the loss at its next renewal or release.
    pub async fn force_release(&self, name: &str) -> Result<Option<LockInfo>, LockError> {
        let keys = Keys::new(&self.inner.prefix, name.to_owned())?;
        let Some(info) = read(self, &keys).await? else {
            return Ok(None);
        };
        let mut del = redis::cmd("DEL");
        del.arg(&keys.lock)
            .arg(keys.min_hold_timer())
            .arg(keys.write_intent());
        for holder in &info.holders {
            del.arg(keys.share(&holder.token));
        }
        let node = self.inner.backend.inspected();
        let failed = |e| LockError::redis(name, e);
        let _: i64 = node.query(&del).await.map_err(failed)?;
        let wake = redis::cmd("PUBLISH").arg(keys.wake()).arg("").to_owned();
        let _: i64 = node.query(&wake).await.map_err(failed)?;
        for other in self.inner.backend.others() {
            // The other RedLock masters: best effort, the quorum is gone with the first.
            let _: Result<i64, _> = other.query(&del).await;
        }
        Ok(Some(info))
    }
}

/// Reads one lock; `None` when its key does not exist.
async fn read(locks: &LockManager, keys: &Keys) -> Result<Option<LockInfo>, LockError> {
    let node = locks.inner.backend.inspected();
    let failed = |e| LockError::redis(&keys.name, e);
    let form: String = node
        .query(redis::cmd("TYPE").arg(&keys.lock))
        .await
        .map_err(failed)?;
    let pttl: i64 = node
        .query(redis::cmd("PTTL").arg(&keys.lock))
        .await
        .map_err(failed)?;
    let counter: Option<u64> = node
        .query(redis::cmd("GET").arg(keys.fence()))
        .await
        .map_err(failed)?;
    let mut info = LockInfo {
        name: keys.name.clone(),
        key: keys.lock.clone(),
        kind: LockKind::Foreign,
        holders: Vec::new(),
        ttl: ttl_of(pttl),
        fencing_counter: counter,
        permits: None,
    };
    match form.as_str() {
        "none" => return Ok(None),
        "string" => read_string(node, keys, &mut info).await?,
        "hash" => read_hash(node, keys, &mut info).await?,
        _ => {}
    }
    name_holders(locks, &mut info.holders).await;
    Ok(Some(info))
}

/// A key's or a share's `PTTL` as a duration (`None`: no expiry, or no key).
fn ttl_of(millis: i64) -> Option<Duration> {
    u64::try_from(millis).ok().map(Duration::from_millis)
}

/// A plain exclusive lock: its value is the holder's token.
async fn read_string(node: &Node, keys: &Keys, info: &mut LockInfo) -> Result<(), LockError> {
    let token: Option<String> = node
        .query(redis::cmd("GET").arg(&keys.lock))
        .await
        .map_err(|e| LockError::redis(&keys.name, e))?;
    info.kind = LockKind::Exclusive;
    info.holders.extend(token.map(|token| Holder {
        token,
        holds: 1,
        ttl: info.ttl,
        fence: None,
        identity: None,
    }));
    Ok(())
}

/// Every other kind: a hash of its mode, its permits, its fencing token and its holders'
/// tokens (each with its count of holds).
async fn read_hash(node: &Node, keys: &Keys, info: &mut LockInfo) -> Result<(), LockError> {
    let fields: Vec<(String, Value)> = node
        .query(redis::cmd("HGETALL").arg(&keys.lock))
        .await
        .map_err(|e| LockError::redis(&keys.name, e))?;
    let text = |v: &Value| redis::from_redis_value::<String>(v.clone()).ok();
    let field = |name: &str| {
        fields
            .iter()
            .find(|(f, _)| f == name)
            .and_then(|(_, v)| text(v))
    };
    info.kind = match field("mode").as_deref() {
        None => LockKind::Exclusive,
        Some("write") => LockKind::Write,
        Some("read") => LockKind::Read,
        Some("permits") => LockKind::Semaphore,
        Some("min_hold") => LockKind::MinHold,
        Some(_) => LockKind::Foreign,
    };
    info.permits = field("permits").and_then(|n| n.parse().ok());
    let shared = matches!(info.kind, LockKind::Read | LockKind::Semaphore);
    for (name, value) in &fields {
        if matches!(name.as_str(), "mode" | "permits" | "fence" | "min_hold")
            || name.starts_with("h:")
        {
            continue;
        }
        let holds = text(value).and_then(|n| n.parse().ok()).unwrap_or(1);
        let mut holder = Holder {
            token: name.clone(),
            holds,
            ttl: info.ttl,
            fence: field("fence").and_then(|f| f.parse().ok()),
            identity: None,
        };
        if shared && !read_share(node, keys, &mut holder).await? {
            continue; // ended: that reader is gone
        }
        info.holders.push(holder);
    }
    Ok(())
}

/// A share's lease is its own key, whose value is its fencing token: reads both into
/// `holder`. `false` when the share has ended.
async fn read_share(node: &Node, keys: &Keys, holder: &mut Holder) -> Result<bool, LockError> {
    let failed = |e| LockError::redis(&keys.name, e);
    let share = keys.share(&holder.token);
    let left: i64 = node
        .query(redis::cmd("PTTL").arg(&share))
        .await
        .map_err(failed)?;
    if left == -2 {
        return Ok(false);
    }
    holder.ttl = ttl_of(left);
    let fence: Option<u64> = node
        .query(redis::cmd("GET").arg(&share))
        .await
        .map_err(failed)?;
    holder.fence = fence.filter(|f| *f > 0);
    Ok(true)
}

/// Names each holder from the registration of the manager its token names. Best effort: a
/// registration that cannot be read (an ACL user without the rule for it, say) leaves the
/// holder unnamed rather than failing the whole read.
async fn name_holders(locks: &LockManager, holders: &mut [Holder]) {
    let inner = &locks.inner;
    for holder in holders {
        holder.identity = inner
            .registry
            .lookup(&inner.backend, &holder.token)
            .await
            .ok()
            .flatten();
    }
}

/// The lock name behind `key`, if `key` is a lock key (not a companion) under `prefix`.
fn name_of(prefix: &str, key: &str) -> Option<String> {
    let rest = key.strip_prefix(prefix)?.strip_prefix('{')?;
    let (inner, after) = rest.rsplit_once('}')?;
    let name = match after {
        "" if !inner.contains('}') => inner.to_owned(),
        "~" => inner.replace("%7D", "}").replace("%25", "%"),
        _ => return None,
    };
    // Only a name that maps back to this very key (a companion never does).
    (lock_key(prefix, &name) == key).then_some(name)
}

/// `prefix` with the characters that Redis glob patterns (SCAN's `MATCH`, and the key and
/// channel patterns of ACL rules) interpret escaped.
pub(crate) fn glob_escape(prefix: &str) -> String {
    let mut escaped = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Whether `text` matches `pattern` (`*` and `?`).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_keys_map_back_to_names_and_companions_do_not() {
        assert_eq!(name_of("app:", "app:{order:1}").as_deref(), Some("order:1"));
        assert_eq!(
            name_of("app:", &lock_key("app:", "a}b")).as_deref(),
            Some("a}b")
        );
        assert_eq!(name_of("app:", "app:{order:1}:fence"), None);
        assert_eq!(name_of("app:", "app:{order:1}:s:abc"), None);
        assert_eq!(name_of("app:", "other:{x}"), None);
    }

    #[test]
    fn globs() {
        assert!(glob(b"*", b"anything"));
        assert!(glob(b"order:*", b"order:42"));
        assert!(!glob(b"order:*", b"invoice:1"));
        assert!(glob(b"o?der:*2", b"order:42"));
        assert!(!glob(b"order", b"order:1"));
    }
}
