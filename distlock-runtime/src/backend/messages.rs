//! What one operation on a lock names and sends: the hold's identity, the shape of an
//! acquire attempt and its answer, a fair lock's queue, a renewal.

use std::time::{Duration, Instant};

use redis::RedisResult;

use super::link::Query;
use crate::scripts;
pub(crate) use crate::scripts::millis;

/// The server's answer to one acquire attempt: at one lock (`F`, its fencing token) or at a
/// set (`F`, one token per lock, in the request's order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AcquireAnswer<F = u64> {
    /// The caller holds the lock (every lock of the set); the fencing token(s), 0 without
    /// fencing.
    Held(F),
    /// Another owner holds lock `at` (0 for one lock; an index into a set's request) for
    /// about `holder_ttl` more (`None`: no expiry was reported); `holder` is that owner's
    /// token (as two numbers), when the server named it.
    Busy {
        at: usize,
        holder_ttl: Option<Duration>,
        holder: Option<[u64; 2]>,
    },
    /// Granted, but fewer replicas than asked acknowledged it: already given back.
    Unreplicated { acked: u32, wanted: u32 },
    /// Not granted: the semaphore is in use with `stored` permits, not the number asked for.
    PermitsMismatch { stored: u32 },
}

/// What names one hold of a lock, for releasing it.
#[derive(Debug, Clone)]
pub(crate) struct HoldIds {
    pub(crate) lock: String,
    pub(crate) wake: String,
    /// The owner token, which also names its hold in the scripts' hold counts.
    pub(crate) token: String,
    /// A read share or a permit: its lease is a field of the lock's hash (see `kind.lua`).
    pub(crate) shared: bool,
    /// The string form of a plain exclusive lock (value = token), not a hash.
    pub(crate) plain: bool,
    /// A fair lock's queue, whose head a release grants the lock to.
    pub(crate) fair: Option<FairQueue>,
    /// Until when an attempt of this token whose answer never came may still reach the
    /// server (see `Backend::late_delivery`): such an attempt, landing after the release,
    /// would take the lock again for nobody, so a release sent before then is sent once
    /// more then. `None` when every attempt was answered.
    pub(crate) late_until: Option<Instant>,
}

/// A fair lock's queue keys, and the entry one owner waits (or waited) in it under.
#[derive(Debug, Clone)]
pub(crate) struct FairQueue {
    pub(crate) queue: String,
    pub(crate) leases: String,
    /// `<manager id>:<lease ms>:<token>`, as `fair.lua` reads it.
    pub(crate) entry: String,
}

impl FairQueue {
    /// The queue keys of `lock`, with the entry of `token` waiting with `lease` for the
    /// manager `manager_id`.
    pub(crate) fn new(lock: &str, manager_id: &str, lease: Duration, token: &str) -> Self {
        Self {
            queue: crate::key::queue_key(lock),
            leases: crate::key::queue_leases_key(lock),
            entry: format!("{manager_id}:{}:{token}", millis(lease)),
        }
    }

    /// The same queue, with the entry of another owner.
    pub(crate) fn for_owner(&self, manager_id: &str, lease: Duration, token: &str) -> Self {
        Self {
            entry: format!("{manager_id}:{}:{token}", millis(lease)),
            ..self.clone()
        }
    }
}

/// What a fair lock's release (or a waiter's leaving) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FairRelease {
    /// The caller did not hold the lock: left alone.
    NotHeld,
    /// Nobody waited: the lock is free, and the wake-up was sent.
    Freed,
    /// The lock now belongs to the queue's head, the owner of this token (told by publish).
    Granted(String),
}

/// How long a fair lock granted to a waiter of another manager stays held until that waiter
/// claims it (it hears the grant at once; a dead one holds the queue up no longer than this).
pub(crate) const FAIR_UNCLAIMED: Duration = Duration::from_secs(2);
/// How long a fair queue entry stays without its waiter asking again; waiters ask at least
/// every [`FAIR_REFRESH`].
pub(crate) const FAIR_ENTRY_LEASE: Duration = Duration::from_secs(3);
/// The longest a fair waiter goes without asking (and renewing its entry).
pub(crate) const FAIR_REFRESH: Duration = Duration::from_secs(1);

/// One hold, named by borrowed strings: what a check or an extension of it sends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HoldRef<'a> {
    pub(crate) lock: &'a str,
    /// A read share or a permit, whose own lease is checked too.
    pub(crate) shared: bool,
    /// The owner token.
    pub(crate) token: &'a str,
}

/// One lease in a watchdog batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Renewal<'a> {
    pub(crate) lock: &'a str,
    pub(crate) token: &'a str,
    pub(crate) lease: Duration,
}

/// Which script an acquire attempt runs, with what it needs beyond the common fields.
#[derive(Debug, Clone)]
pub(crate) enum Shape {
    /// A plain exclusive lock (no fencing, no `min_hold`): the string form, one `SET`.
    Plain,
    /// A plain exclusive lock taken in the order of a queue shared by every process; `join`:
    /// enter the queue when not granted at once.
    Fair {
        queue: FairQueue,
        join: bool,
    },
    Exclusive,
    Write {
        intent: String,
        intent_lease: Duration,
    },
    Share {
        intent: String,
        permits: Option<u32>,
    },
}

/// Everything one acquire attempt sends.
#[derive(Debug, Clone)]
pub(crate) struct AcquireRequest {
    pub(crate) shape: Shape,
    pub(crate) lock: String,
    pub(crate) wake: String,
    pub(crate) token: String,
    pub(crate) lease: Duration,
    pub(crate) fencing: bool,
    pub(crate) reentrant: bool,
}

impl AcquireRequest {
    /// What names this request's hold, for giving it back.
    pub(crate) fn hold_ids(&self) -> HoldIds {
        self.clone().into_hold_ids()
    }

    /// The same, taking the request's own strings: what a granted request becomes.
    pub(crate) fn into_hold_ids(self) -> HoldIds {
        let plain = matches!(self.shape, Shape::Plain | Shape::Fair { .. });
        let shared = matches!(self.shape, Shape::Share { .. });
        let fair = match self.shape {
            Shape::Fair { queue, .. } => Some(queue),
            _ => None,
        };
        HoldIds {
            lock: self.lock,
            wake: self.wake,
            token: self.token,
            shared,
            plain,
            fair,
            late_until: None,
        }
    }

    /// The lock's fencing counter, for the scripts that may draw from it.
    pub(crate) fn fence(&self) -> String {
        crate::key::fence_key(&self.lock)
    }
}

/// One acquire attempt as sent: a script, or the native `SET … NX PX … GET` of a plain lock.
pub(super) enum AcquireCall<'a> {
    Script(redis::ScriptInvocation<'a>),
    /// The `SET`; then, only when needed, `PTTL` (it found another owner, whose lease the
    /// fallback timer must not outlast) or the script (it found a hash at the key).
    Set {
        set: redis::Cmd,
        req: &'a AcquireRequest,
    },
}

impl AcquireCall<'_> {
    /// The scripts' calls are boxed: their futures are large, and the native `SET` of
    /// every plain lock would carry them.
    pub(super) async fn run<C: Query>(
        &self,
        conn: &mut C,
        token: &str,
    ) -> RedisResult<AcquireAnswer> {
        match self {
            Self::Script(call) => {
                let (held, value): (i64, i64) = Box::pin(call.invoke_async(conn)).await?;
                Ok(attempt(held, value))
            }
            // Nothing there: set. Our own token: an earlier send of this attempt won (its
            // reply was lost). Another value: busy. A hash (another lock kind, or a lock with
            // fencing or min_hold) answers WRONGTYPE: the script decides, as it alone can
            // clear read shares or permits whose leases have ended.
            Self::Set { set, req } => match conn.query::<Option<String>>(set).await {
                Ok(None) => Ok(AcquireAnswer::Held(0)),
                // The lease must count from this attempt, as the caller's deadline will: the
                // earlier send set it from then. Lengthened only if still this owner's.
                Ok(Some(value)) if value == token => {
                    let extend = scripts::Extend {
                        lock: &req.lock,
                        token: &req.token,
                        lease: req.lease,
                    };
                    let extended: i64 = Box::pin(extend.call().invoke_async(conn)).await?;
                    Ok(if extended == 1 {
                        AcquireAnswer::Held(0)
                    } else {
                        AcquireAnswer::Busy {
                            at: 0,
                            holder_ttl: None,
                            holder: None,
                        }
                    })
                }
                Ok(Some(holder)) => {
                    let left: i64 = conn.query(redis::cmd("PTTL").arg(&req.lock)).await?;
                    Ok(AcquireAnswer::Busy {
                        at: 0,
                        holder_ttl: holder_ttl(left),
                        holder: token_words(&holder),
                    })
                }
                Err(error) if error.code() == Some("WRONGTYPE") => {
                    let script = scripts::Acquire {
                        lock: &req.lock,
                        fence: &req.fence(),
                        token: &req.token,
                        lease: req.lease,
                        fencing: false,
                        hold: &req.token,
                        reentrant: req.reentrant,
                        after_set: true,
                    };
                    let (held, value): (i64, i64) =
                        Box::pin(script.call().invoke_async(conn)).await?;
                    Ok(attempt(held, value))
                }
                Err(error) => Err(error),
            },
        }
    }
}

/// A token as two numbers, if `value` is one as distlock writes them: 32 lower-case hex
/// digits (see [`token_text`]).
pub(crate) fn token_words(value: &str) -> Option<[u64; 2]> {
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    if value.len() != 32 || !value.bytes().all(hex) {
        return None;
    }
    let high = u64::from_str_radix(&value[..16], 16).ok()?;
    let low = u64::from_str_radix(&value[16..], 16).ok()?;
    Some([high, low])
}

/// The token [`token_words`] read.
pub(crate) fn token_text([high, low]: [u64; 2]) -> String {
    format!("{high:016x}{low:016x}")
}

/// How much longer the holder has, from a `PTTL` sent after the attempt found the lock held:
/// `-2`, the key is gone since (its lease ended between the two), is no time at all, so the
/// waiter asks again at once; a lease that ends as the waiter looks would otherwise leave it
/// to its slowest timer, as nobody announces an expiry. `-1` (a key without expiry) reports
/// nothing.
fn holder_ttl(pttl: i64) -> Option<Duration> {
    match pttl {
        -2 => Some(Duration::ZERO),
        left => u64::try_from(left).ok().map(Duration::from_millis),
    }
}

/// The answer of an acquire script: `(1, fence)` when granted, `(0, holder's pttl)` when not.
pub(super) fn attempt(held: i64, value: i64) -> AcquireAnswer {
    match held {
        1 => AcquireAnswer::Held(u64::try_from(value).unwrap_or(0)),
        -1 => AcquireAnswer::PermitsMismatch {
            stored: u32::try_from(value).unwrap_or(u32::MAX),
        },
        _ => AcquireAnswer::Busy {
            at: 0,
            holder_ttl: u64::try_from(value).ok().map(Duration::from_millis),
            holder: None,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_read_back_as_written_and_nothing_else_reads_as_one() {
        let token = "0123456789abcdef00000000000000ff";
        assert_eq!(token_words(token).map(token_text).as_deref(), Some(token));
        for value in [
            "",
            "+123456789abcdef00000000000000ff",
            "0123456789ABCDEF00000000000000FF",
            "abc",
        ] {
            assert_eq!(token_words(value), None, "{value:?}");
        }
    }

    #[test]
    fn a_holder_whose_key_is_gone_leaves_no_time_to_wait() {
        assert_eq!(holder_ttl(-2), Some(Duration::ZERO));
        assert_eq!(holder_ttl(-1), None);
        assert_eq!(holder_ttl(250), Some(Duration::from_millis(250)));
    }
}
