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
use crate::error::LockError;
use crate::key::{Keys, lock_key};
use crate::manager::LockManager;
use crate::scripts;

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
    pub identity: Option<crate::holder::HolderIdentity>,
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
    /// removed, or `None` when the lock was free. The removal is one atomic step on the
    /// server: what it returns is exactly what it removed, even while holders come and go
    /// (with RedLock, on every master that answered, a majority at least). For stuck locks
    /// only: a holder that is still running is not stopped, and learns of the loss at its
    /// next renewal or release.
    pub async fn force_release(&self, name: &str) -> Result<Option<LockInfo>, LockError> {
        match self.forced(name, None).await? {
            ForcedRelease::Removed(info) => Ok(Some(info)),
            ForcedRelease::Free | ForcedRelease::Changed(_) => Ok(None),
        }
    }

    /// As [`force_release`](Self::force_release), but only while the lock's holders are
    /// exactly `holders` (their tokens, as [`inspect`](Self::inspect) showed them): what an
    /// operator confirmed is what goes. A lock whose holders changed meanwhile is left as it
    /// is and reported ([`ForcedRelease::Changed`]).
    pub async fn force_release_if_held_by(
        &self,
        name: &str,
        holders: &[&str],
    ) -> Result<ForcedRelease, LockError> {
        // Each holder once: the script compares how many there are.
        let mut holders = holders.to_vec();
        holders.sort_unstable();
        holders.dedup();
        self.forced(name, Some(&holders)).await
    }

    /// One forced release, on every node (a RedLock's masters all at once).
    async fn forced(
        &self,
        name: &str,
        only_if_held_by: Option<&[&str]>,
    ) -> Result<ForcedRelease, LockError> {
        let keys = Keys::new(&self.inner.prefix, name.to_owned())?;
        let (fence, min_hold_timer) = (keys.fence(), keys.min_hold_timer());
        let (write_intent, wake) = (keys.write_intent(), keys.wake());
        let call = scripts::ForceRelease {
            lock: &keys.lock,
            fence: &fence,
            min_hold_timer: &min_hold_timer,
            write_intent: &write_intent,
            wake: &wake,
            only_if_held_by,
        }
        .call(self.inner.backend.inspected().wakes());
        let backend = &self.inner.backend;
        let nodes = std::iter::once(backend.inspected()).chain(backend.others());
        let replies = futures_util::future::join_all(nodes.map(|node| node.invoke::<Value>(&call)));
        let mut answered = Vec::new();
        let mut failure = None;
        for reply in replies.await {
            match reply.and_then(Snapshot::from_reply) {
                Ok(snapshot) => answered.push(snapshot),
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        // With RedLock, a removal a majority did not confirm may leave the holder its lock.
        let masters = 1 + backend.others().len();
        if answered.len() * 2 <= masters {
            let error = failure.unwrap_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Io, "no master answered"))
            });
            return Err(LockError::redis(name, error));
        }
        let mut outcome = forced_outcome(&answered, masters, &keys);
        if let ForcedRelease::Removed(_) = outcome {
            // This manager's own waiters look at once (others hear the script's wake-up),
            // even those queued behind a holder of this manager that the removal robbed.
            self.inner.waiters.released(&wake);
        }
        if let ForcedRelease::Removed(info) | ForcedRelease::Changed(info) = &mut outcome {
            name_holders(self, &mut info.holders).await;
        }
        Ok(outcome)
    }
}

/// What a forced release did, from the answers of the nodes (a majority of `masters` at
/// least): `Removed`, naming every holder removed, where some node removed it and it is gone
/// from a majority; `Changed`, with what holds it, where a node kept it (its holders were not
/// the ones expected) and it is not gone from a majority; `Free` when no node had it.
fn forced_outcome(answered: &[Snapshot], masters: usize, keys: &Keys) -> ForcedRelease {
    debug_assert!(
        answered.len() * 2 > masters,
        "settled without a majority's answers"
    );
    let removed: Vec<LockInfo> = (answered.iter())
        .filter(|snapshot| snapshot.removed)
        .filter_map(|snapshot| snapshot.describe(keys))
        .collect();
    let kept = (answered.iter())
        .filter(|snapshot| !snapshot.removed)
        .find_map(|snapshot| snapshot.describe(keys));
    let gone = (answered.iter())
        .filter(|snapshot| snapshot.removed || snapshot.form == "none")
        .count();
    match (removed.split_first(), kept) {
        (_, Some(kept)) if gone * 2 <= masters => ForcedRelease::Changed(kept),
        (Some((first, others)), _) => {
            let mut all = first.clone();
            for holder in others.iter().flat_map(|info| &info.holders) {
                // A holder another node had too is named once.
                if all.holders.iter().all(|h| h.token != holder.token) {
                    all.holders.push(holder.clone());
                }
            }
            ForcedRelease::Removed(all)
        }
        (None, Some(kept)) => ForcedRelease::Changed(kept),
        (None, None) => ForcedRelease::Free,
    }
}

/// What [`LockManager::force_release_if_held_by`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForcedRelease {
    /// The lock was held by exactly the holders expected, and is gone: what was removed.
    Removed(LockInfo),
    /// The lock was free: nothing was removed.
    Free,
    /// The lock's holders were not the ones expected: nothing was removed. What holds it now.
    Changed(LockInfo),
}

/// Reads one lock; `None` when its key does not exist.
async fn read(locks: &LockManager, keys: &Keys) -> Result<Option<LockInfo>, LockError> {
    let node = locks.inner.backend.inspected();
    let snapshot = Snapshot::read(node, keys)
        .await
        .map_err(|e| LockError::redis(&keys.name, e))?;
    let Some(mut info) = snapshot.describe(keys) else {
        return Ok(None);
    };
    name_holders(locks, &mut info.holders).await;
    Ok(Some(info))
}

/// A lock key as the server had it: read command by command for the inspector, or returned
/// by `force_release.lua` in the step that removed it.
#[derive(Debug, Default)]
struct Snapshot {
    /// The key's type (`none`: no key).
    form: String,
    /// The key's `PTTL`.
    pttl: i64,
    /// The fencing counter, if one was ever drawn.
    counter: Option<u64>,
    /// The string's value, or the hash's fields and values in turn.
    fields: Vec<String>,
    /// Every live share: its token, its lease's `PTTL`, and its fencing token.
    shares: Vec<(String, i64, Option<u64>)>,
    /// The forced release removed the lock.
    removed: bool,
}

impl Snapshot {
    /// Reads `keys`' lock from `node`, one command at a time (each consistent on its own).
    async fn read(node: &Node, keys: &Keys) -> redis::RedisResult<Self> {
        let mut snapshot = Snapshot {
            form: node.query(redis::cmd("TYPE").arg(&keys.lock)).await?,
            pttl: node.query(redis::cmd("PTTL").arg(&keys.lock)).await?,
            counter: node.query(redis::cmd("GET").arg(keys.fence())).await?,
            ..Snapshot::default()
        };
        match snapshot.form.as_str() {
            "string" => {
                let value: Option<String> = node.query(redis::cmd("GET").arg(&keys.lock)).await?;
                snapshot.fields.extend(value);
            }
            "hash" => {
                snapshot.fields = node.query(redis::cmd("HGETALL").arg(&keys.lock)).await?;
                let shared = snapshot
                    .pairs()
                    .any(|(field, value)| field == "mode" && matches!(value, "read" | "permits"));
                if shared {
                    // The shares' ends are server times: compared with the server's clock
                    // (on Cluster, any node's: they keep one time to within their sync).
                    let (secs, micros): (u64, u64) = node.query(&redis::cmd("TIME")).await?;
                    snapshot.shares = snapshot.live_shares(secs * 1_000 + micros / 1_000);
                }
            }
            _ => {}
        }
        Ok(snapshot)
    }

    /// The script's reply: `{form, pttl, counter, fields, shares, removed}`, the shares
    /// flattened. Read leniently: a value that is not UTF-8 text, or not a number (another
    /// program's key under the prefix), is shown as far as it can be, never an error after
    /// the removal.
    fn from_reply(reply: Value) -> redis::RedisResult<Self> {
        let unexpected = || {
            redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "an answer of another shape from the forced release",
            ))
        };
        let Value::Array(parts) = reply else {
            return Err(unexpected());
        };
        let [form, pttl, counter, fields, shares, removed] = parts.as_slice() else {
            return Err(unexpected());
        };
        let (Value::Array(fields), Value::Array(shares)) = (fields, shares) else {
            return Err(unexpected());
        };
        Ok(Snapshot {
            form: text(form).ok_or_else(unexpected)?,
            pttl: number(pttl).ok_or_else(unexpected)?,
            counter: text(counter).and_then(|c| c.parse().ok()),
            fields: fields.iter().map(|f| text(f).unwrap_or_default()).collect(),
            shares: shares
                .chunks_exact(3)
                .map(|share| {
                    let token = text(&share[0]).unwrap_or_default();
                    let left = number(&share[1]).unwrap_or(-1);
                    (token, left, text(&share[2]).and_then(|f| f.parse().ok()))
                })
                .collect(),
            removed: number(removed) == Some(1),
        })
    }

    /// A hash's fields with their values.
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        self.fields
            .chunks_exact(2)
            .map(|pair| (pair[0].as_str(), pair[1].as_str()))
    }

    /// The shares of a read or permits lock whose lease (the field `s:<token>`, the server
    /// time it ends at) has not ended at server time `now_ms`: token, milliseconds left and
    /// fencing token (field `f:<token>`), as `force_release.lua` reports them.
    fn live_shares(&self, now_ms: u64) -> Vec<(String, i64, Option<u64>)> {
        let value = |name: &str| self.pairs().find(|(f, _)| *f == name).map(|(_, v)| v);
        self.pairs()
            .filter_map(|(field, ends)| {
                let token = field.strip_prefix("s:")?;
                let left = i64::try_from(ends.parse::<u64>().ok()?.checked_sub(now_ms)?).ok()?;
                let fence = value(&format!("f:{token}")).and_then(|f| f.parse().ok());
                (left > 0).then(|| (token.to_owned(), left, fence))
            })
            .collect()
    }

    /// What the snapshot says of the lock; `None` when there was no key.
    fn describe(&self, keys: &Keys) -> Option<LockInfo> {
        let mut info = LockInfo {
            name: keys.name.clone(),
            key: keys.lock.clone(),
            kind: LockKind::Foreign,
            holders: Vec::new(),
            ttl: ttl_of(self.pttl),
            fencing_counter: self.counter,
            permits: None,
        };
        match self.form.as_str() {
            "none" => return None,
            "string" => {
                info.kind = LockKind::Exclusive;
                info.holders.extend(self.fields.first().map(|token| Holder {
                    token: token.clone(),
                    holds: 1,
                    ttl: info.ttl,
                    fence: None,
                    identity: None,
                }));
            }
            "hash" => self.describe_hash(&mut info),
            _ => {}
        }
        Some(info)
    }

    /// Every other kind than the plain lock: a hash of its mode, its permits, its fencing
    /// token and its holders' tokens (each with its count of holds); readers and permit
    /// holders each with a share of their own.
    fn describe_hash(&self, info: &mut LockInfo) {
        let field = |name: &str| {
            self.pairs()
                .find(|(f, _)| *f == name)
                .map(|(_, value)| value)
        };
        info.kind = match field("mode") {
            None => LockKind::Exclusive,
            Some("write") => LockKind::Write,
            Some("read") => LockKind::Read,
            Some("permits") => LockKind::Semaphore,
            Some("min_hold") => LockKind::MinHold,
            Some(_) => LockKind::Foreign,
        };
        info.permits = field("permits").and_then(|n| n.parse().ok());
        let shared = matches!(info.kind, LockKind::Read | LockKind::Semaphore);
        let fence = field("fence").and_then(|f| f.parse().ok());
        for (token, holds) in self.pairs().filter(|(field, _)| names_holder(field)) {
            let mut holder = Holder {
                token: token.to_owned(),
                holds: holds.parse().unwrap_or(1),
                ttl: info.ttl,
                fence,
                identity: None,
            };
            if shared {
                // A share whose lease ended: that reader is gone.
                let Some((_, left, share_fence)) = self.shares.iter().find(|s| s.0 == token) else {
                    continue;
                };
                holder.ttl = ttl_of(*left);
                holder.fence = share_fence.filter(|f| *f > 0);
            }
            info.holders.push(holder);
        }
    }
}

/// A reply's text, as far as it is text (lossy), or its number written out.
fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        Value::SimpleString(text) => Some(text.clone()),
        Value::Int(number) => Some(number.to_string()),
        _ => None,
    }
}

/// A reply's number.
fn number(value: &Value) -> Option<i64> {
    match value {
        Value::Int(number) => Some(*number),
        other => text(other)?.parse().ok(),
    }
}

/// Whether a lock hash's field names a holder: every field but the lock's own, the
/// first-hold markers (`h:<token>`) and a share's lease and fencing token (`s:<token>`,
/// `f:<token>`).
fn names_holder(field: &str) -> bool {
    !matches!(field, "mode" | "permits" | "fence" | "min_hold")
        && !["h:", "s:", "f:"].iter().any(|p| field.starts_with(p))
}

/// A key's or a share's `PTTL` as a duration (`None`: no expiry, or no key).
fn ttl_of(millis: i64) -> Option<Duration> {
    u64::try_from(millis).ok().map(Duration::from_millis)
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

    /// A node's answer: a plain lock held by `token` (`None`: no key), removed or kept.
    fn answer(token: Option<&str>, removed: bool) -> Snapshot {
        Snapshot {
            form: if token.is_some() { "string" } else { "none" }.to_owned(),
            pttl: token.map_or(-2, |_| 1_000),
            fields: token.into_iter().map(str::to_owned).collect(),
            removed,
            ..Snapshot::default()
        }
    }

    fn holders(outcome: &ForcedRelease) -> Vec<&str> {
        match outcome {
            ForcedRelease::Removed(info) | ForcedRelease::Changed(info) => {
                info.holders.iter().map(|h| h.token.as_str()).collect()
            }
            ForcedRelease::Free => Vec::new(),
        }
    }

    #[test]
    fn a_forced_release_answers_for_what_a_majority_of_nodes_did() {
        let keys = Keys::new("p:", "k".to_owned()).unwrap();
        let one = |a| forced_outcome(&[a], 1, &keys);
        assert!(matches!(
            one(answer(Some("a"), true)),
            ForcedRelease::Removed(_)
        ));
        assert!(matches!(
            one(answer(Some("b"), false)),
            ForcedRelease::Changed(_)
        ));
        assert_eq!(one(answer(None, false)), ForcedRelease::Free);
        // RedLock: a stale copy removed on one master, the holder a majority has kept.
        let split = [
            answer(Some("a"), true),
            answer(Some("b"), false),
            answer(Some("b"), false),
        ];
        let outcome = forced_outcome(&split, 3, &keys);
        assert!(matches!(outcome, ForcedRelease::Changed(_)), "{outcome:?}");
        assert_eq!(holders(&outcome), ["b"]);
        // Gone from a majority: every holder removed is named, each once.
        let gone = [
            answer(Some("a"), true),
            answer(Some("b"), true),
            answer(Some("b"), true),
        ];
        let outcome = forced_outcome(&gone, 3, &keys);
        assert!(matches!(outcome, ForcedRelease::Removed(_)), "{outcome:?}");
        assert_eq!(holders(&outcome), ["a", "b"]);
        // Removed where it was; one master that never had it counts as gone.
        let most = [answer(None, false), answer(Some("a"), true)];
        assert_eq!(holders(&forced_outcome(&most, 3, &keys)), ["a"]);
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
