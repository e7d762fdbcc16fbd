//! The Lua scripts that make every state change atomic on the server.
//!
//! Each script lives in its own `.lua` file beside this module and is built once into a
//! [`redis::Script`], which runs with EVALSHA and loads itself again on NOSCRIPT (after a
//! server restart or `SCRIPT FLUSH`). Keys and values travel in KEYS/ARGV, never in the text.
//!
//! One key may be used through several lock kinds; `kind.lua`, shared by the scripts that
//! take locks and give shares back, tells them apart, so that only readers together and
//! permits up to N overlap, and no script rewrites or deletes what another kind wrote.
//!
//! The scripts that wake waiters come in two variants, told apart by one line put before
//! their text: `publish` names the command they publish with, classic `PUBLISH`, or on a
//! Cluster whose servers have it (Redis 7.0, Valkey) `SPUBLISH`, which keeps the wake-up on
//! the shard that owns the lock's slot instead of sending it to every node (see [`Wakes`]).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, OnceLock};

use std::time::Duration;

use redis::{Script, ScriptInvocation};

/// How the scripts publish wake-ups, and the waiters follow them: decided per deployment at
/// `build()` (see `backend::Node::load_scripts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Wakes {
    /// `PUBLISH` and `SUBSCRIBE` (one server, Sentinel, RedLock, and a Cluster without
    /// sharded pub/sub): on a Cluster, every node hears every wake-up.
    #[default]
    Classic,
    /// `SPUBLISH` and `SSUBSCRIBE` on a Cluster: a wake-up stays on the shard of its lock.
    Sharded,
}

impl Wakes {
    /// The command that publishes a wake-up.
    pub(crate) fn command(self) -> &'static str {
        match self {
            Self::Classic => "PUBLISH",
            Self::Sharded => "SPUBLISH",
        }
    }
}

/// The text of every script made so far, by its SHA1: what an `EVAL` sends when a node
/// does not know a script's hash (see [`source_of`]).
static SOURCES: LazyLock<Mutex<HashMap<String, &'static str>>> = LazyLock::new(Mutex::default);

/// The script of `code`, its text kept for [`source_of`].
fn script(code: &'static str) -> Script {
    let script = Script::new(code);
    let mut sources = SOURCES.lock().unwrap_or_else(|e| e.into_inner());
    sources.insert(script.get_hash().to_owned(), code);
    script
}

/// The text of the script whose SHA1 is `sha`, if this process made it: a node that answers
/// `NOSCRIPT` (a master just promoted, a node the slot just moved to) is sent the text itself
/// with the same keys and arguments, on the connection that reaches it.
pub(crate) fn source_of(sha: &[u8]) -> Option<&'static str> {
    let sha = std::str::from_utf8(sha).ok()?;
    let sources = SOURCES.lock().unwrap_or_else(|e| e.into_inner());
    sources.get(sha).copied()
}

/// A script that publishes wake-ups, in both variants (see the module's text).
pub(crate) struct Published {
    texts: [&'static str; 2],
    scripts: [OnceLock<Script>; 2],
}

impl Published {
    const fn new(classic: &'static str, sharded: &'static str) -> Self {
        Self {
            texts: [classic, sharded],
            scripts: [OnceLock::new(), OnceLock::new()],
        }
    }

    /// The variant that publishes as `wakes` says.
    pub(crate) fn get(&self, wakes: Wakes) -> &Script {
        let at = wakes as usize;
        self.scripts[at].get_or_init(|| script(self.texts[at]))
    }

    /// The text of that variant (for `EVAL`).
    fn text(&self, wakes: Wakes) -> &'static str {
        self.texts[wakes as usize]
    }
}

/// The two variants of a script made of the given parts, each after its `publish` line.
macro_rules! published {
    ($($part:tt)+) => {
        Published::new(
            concat!("local publish = 'publish'\n", include_str!("scripts/announce.lua"), $($part)+),
            concat!("local publish = 'spublish'\n", include_str!("scripts/announce.lua"), $($part)+),
        )
    };
}

/// Take (or re-enter) an exclusive lock: `{1, fence}` when held, `{0, pttl}` when busy.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/kind.lua"),
        include_str!("scripts/acquire.lua")
    ))
});

/// Give back one hold of an exclusive lock if the token still owns it: 1 released, 0 not held.
pub(crate) static RELEASE: Published = published!(
    include_str!("scripts/release_hold.lua"),
    include_str!("scripts/release.lua")
);

/// Set the lease of a held lock: 1 set, 0 not held.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/extend.lua")
    ))
});

/// Renew a batch of leases, each checked against its token: one 1/0 per key.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/renew.lua")
    ))
});

/// Give back a plain exclusive lock (string form) if the token still owns it: 1 released,
/// 0 not held. Used where the server has no native compare-and-delete, or with `min_hold`.
pub(crate) static UNLOCK: Published = published!(include_str!("scripts/unlock.lua"));

/// Pass a plain exclusive lock from its owner to the next one: 1 handed over, 0 not held.
/// Used where the server has no conditional `SET … IFEQ`.
pub(crate) static HANDOFF: LazyLock<Script> =
    LazyLock::new(|| script(include_str!("scripts/handoff.lua")));

/// A fair lock: take it in queue order, release it to the queue's head, or leave the queue
/// (see the script for the answers).
pub(crate) static FAIR: Published = published!(include_str!("scripts/fair.lua"));

/// Take the write side of a read-write lock: `{1, fence}` or `{0, pttl}`.
pub(crate) static WRITE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/kind.lua"),
        include_str!("scripts/write_acquire.lua")
    ))
});

/// Take back a waiting writer's intent if it is still that writer's, and wake the readers
/// it kept out: 1 taken back, 0 not its intent.
pub(crate) static WITHDRAW_INTENT: Published =
    published!(include_str!("scripts/withdraw_intent.lua"));

/// Take a read share or a semaphore permit: `{1, fence}`, `{0, pttl}`, or `{-1, permits}`
/// when the semaphore is in use with another number of permits.
pub(crate) static SHARE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/kind.lua"),
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/share_acquire.lua")
    ))
});

/// Give back one hold of a share: 1 released, 0 not held.
pub(crate) static SHARE_RELEASE: Published = published!(
    include_str!("scripts/clock.lua"),
    include_str!("scripts/kind.lua"),
    include_str!("scripts/share_release.lua")
);

/// Take a set of exclusive locks, all or none: `{1, fence…}` or `{0, index, pttl}`.
pub(crate) static SET_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/kind.lua"),
        include_str!("scripts/set_acquire.lua")
    ))
});

/// Give back a set of exclusive locks taken together: one 1/0 per lock.
pub(crate) static SET_RELEASE: Published = published!(
    include_str!("scripts/release_hold.lua"),
    include_str!("scripts/set_release.lua")
);

/// Remove a lock whatever holds it, reporting what it removed (the inspector's forced
/// release; not loaded up front: it loads itself on first use).
pub(crate) static FORCE_RELEASE: Published = published!(
    include_str!("scripts/clock.lua"),
    include_str!("scripts/force_release.lua")
);

/// Whether a token holds its lock, a read share's or permit's lease included: 1 or 0.
pub(crate) static SHARE_HELD: LazyLock<Script> = LazyLock::new(|| {
    script(concat!(
        include_str!("scripts/clock.lua"),
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/share_held.lua")
    ))
});

/// Run a caller's commands only while its locks are held (see `guarded.rs` for the call):
/// `{1, replies}`, `{0, index}` not held, `{-1, state}` receipt already used.
pub(crate) static GUARDED_WRITE: LazyLock<Script> = LazyLock::new(|| {
    // `#!lua`: the server refuses keys of other slots (the caller's keys are declared).
    script(concat!(
        "#!lua\n",
        include_str!("scripts/clock.lua"),
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/guarded_write.lua")
    ))
});

/// Every script a deployment that publishes as `wakes` says runs, for loading them all when
/// a manager connects.
pub(crate) fn all(wakes: Wakes) -> [&'static Script; 15] {
    [
        &SHARE_HELD,
        &GUARDED_WRITE,
        UNLOCK.get(wakes),
        WITHDRAW_INTENT.get(wakes),
        FAIR.get(wakes),
        &HANDOFF,
        &ACQUIRE,
        RELEASE.get(wakes),
        &EXTEND,
        &RENEW,
        &WRITE_ACQUIRE,
        &SHARE_ACQUIRE,
        SHARE_RELEASE.get(wakes),
        &SET_ACQUIRE,
        SET_RELEASE.get(wakes),
    ]
}

/// A lease in whole milliseconds, at least 1 (what `PX` and `PEXPIRE` take).
pub(crate) fn millis(lease: Duration) -> u64 {
    whole_millis(lease).max(1)
}

/// A duration in whole milliseconds, 0 included (a window that may be empty).
fn whole_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn flag(on: bool) -> &'static str {
    if on { "1" } else { "0" }
}

// Each script's KEYS and ARGV, by name and in the order its `.lua` file reads them: every
// call site (and every test) fills these, never the positions.

/// A call of `acquire.lua`.
pub(crate) struct Acquire<'a> {
    pub(crate) lock: &'a str,
    pub(crate) fence: &'a str,
    pub(crate) token: &'a str,
    pub(crate) lease: Duration,
    pub(crate) fencing: bool,
    pub(crate) hold: &'a str,
    pub(crate) reentrant: bool,
    /// The native `SET` found a hash at the key: this takes over from it.
    pub(crate) after_set: bool,
}

impl Acquire<'_> {
    pub(crate) fn call(&self) -> ScriptInvocation<'static> {
        let mut call = ACQUIRE.key(self.lock);
        call.key(self.fence)
            .arg(self.token)
            .arg(millis(self.lease))
            .arg(flag(self.fencing))
            .arg(self.hold)
            .arg(flag(self.reentrant))
            .arg(flag(self.after_set));
        call
    }
}

/// A call of `write_acquire.lua`.
pub(crate) struct WriteAcquire<'a> {
    pub(crate) lock: &'a str,
    pub(crate) fence: &'a str,
    pub(crate) intent: &'a str,
    pub(crate) token: &'a str,
    pub(crate) lease: Duration,
    pub(crate) fencing: bool,
    pub(crate) hold: &'a str,
    pub(crate) reentrant: bool,
    /// How long the writer's intent keeps new readers out (0: leave none).
    pub(crate) intent_lease: Duration,
}

impl WriteAcquire<'_> {
    pub(crate) fn call(&self) -> ScriptInvocation<'static> {
        let mut call = WRITE_ACQUIRE.key(self.lock);
        call.key(self.fence)
            .key(self.intent)
            .arg(self.token)
            .arg(millis(self.lease))
            .arg(flag(self.fencing))
            .arg(self.hold)
            .arg(flag(self.reentrant))
            .arg(whole_millis(self.intent_lease));
        call
    }
}

/// A call of `share_acquire.lua`: a read share, or a permit of `permits`.
pub(crate) struct ShareAcquire<'a> {
    pub(crate) lock: &'a str,
    pub(crate) intent: &'a str,
    pub(crate) fence: &'a str,
    pub(crate) token: &'a str,
    pub(crate) lease: Duration,
    pub(crate) hold: &'a str,
    pub(crate) permits: Option<u32>,
    pub(crate) fencing: bool,
}

impl ShareAcquire<'_> {
    pub(crate) fn call(&self) -> ScriptInvocation<'static> {
        let mut call = SHARE_ACQUIRE.key(self.lock);
        call.key(self.intent)
            .key(self.fence)
            .arg(self.token)
            .arg(millis(self.lease))
            .arg(self.hold);
        match self.permits {
            Some(permits) => call.arg(permits),
            None => call.arg("read"),
        };
        call.arg(flag(self.fencing));
        call
    }
}

/// A call of `release.lua`: one hold of an exclusive (hash) lock; `keep` for a `min_hold`.
pub(crate) struct Release<'a> {
    pub(crate) lock: &'a str,
    pub(crate) wake: &'a str,
    pub(crate) token: &'a str,
    pub(crate) hold: &'a str,
    pub(crate) keep: Duration,
}

impl Release<'_> {
    pub(crate) fn call(&self, wakes: Wakes) -> ScriptInvocation<'static> {
        let mut call = RELEASE.get(wakes).key(self.lock);
        call.key(self.wake)
            .key(crate::key::min_hold_timer_key(self.lock))
            .arg(self.token)
            .arg(self.hold)
            .arg(whole_millis(self.keep));
        call
    }
}

/// A call of `share_release.lua`.
pub(crate) struct ShareRelease<'a> {
    pub(crate) lock: &'a str,
    pub(crate) wake: &'a str,
    pub(crate) token: &'a str,
    pub(crate) hold: &'a str,
}

impl ShareRelease<'_> {
    pub(crate) fn call(&self, wakes: Wakes) -> ScriptInvocation<'static> {
        let mut call = SHARE_RELEASE.get(wakes).key(self.lock);
        call.key(self.wake).arg(self.token).arg(self.hold);
        call
    }
}

/// A call of `unlock.lua`: a plain lock, given back with the wake-up `message`.
pub(crate) struct Unlock<'a> {
    pub(crate) lock: &'a str,
    pub(crate) wake: &'a str,
    pub(crate) token: &'a str,
    pub(crate) keep: Duration,
    pub(crate) message: &'a str,
}

impl Unlock<'_> {
    /// The call as one `EVALSHA` command, sized up front (a `ScriptInvocation` would copy
    /// every argument once more): the release of every plain lock on a server without a
    /// native compare-and-delete. A server that lost the script answers NOSCRIPT: send
    /// [`eval_command`](Self::eval_command) instead.
    pub(crate) fn command(&self, wakes: Wakes) -> redis::Cmd {
        self.build("EVALSHA", UNLOCK.get(wakes).get_hash())
    }

    /// The same call with the script's text (`EVAL`), for a server that lost the script: one
    /// round trip to the node that owns the key, which keeps the script for the next
    /// `EVALSHA` (unlike `SCRIPT LOAD`, which a Cluster connection sends to every node).
    pub(crate) fn eval_command(&self, wakes: Wakes) -> redis::Cmd {
        self.build("EVAL", UNLOCK.text(wakes))
    }

    fn build(&self, verb: &str, script: &str) -> redis::Cmd {
        let data = self.lock.len() + self.wake.len() + self.token.len() + self.message.len();
        // The verb and the numbers take at most 40 bytes more.
        let mut cmd = redis::Cmd::with_capacity(8, data + script.len() + 40);
        cmd.arg(verb)
            .arg(script)
            .arg(2)
            .arg(self.lock)
            .arg(self.wake)
            .arg(self.token)
            .arg(whole_millis(self.keep))
            .arg(self.message);
        cmd
    }
}

/// A call of `withdraw_intent.lua`: the write intent `intent` of `token`, and the lock's
/// `wake` channel.
pub(crate) struct WithdrawIntent<'a> {
    pub(crate) intent: &'a str,
    pub(crate) wake: &'a str,
    pub(crate) token: &'a str,
}

impl WithdrawIntent<'_> {
    pub(crate) fn call(&self, wakes: Wakes) -> ScriptInvocation<'static> {
        let mut call = WITHDRAW_INTENT.get(wakes).key(self.intent);
        call.key(self.wake).arg(self.token);
        call
    }
}

/// A call of `force_release.lua`: the lock and every companion a holder leaves.
pub(crate) struct ForceRelease<'a> {
    pub(crate) lock: &'a str,
    pub(crate) fence: &'a str,
    pub(crate) min_hold_timer: &'a str,
    pub(crate) write_intent: &'a str,
    pub(crate) wake: &'a str,
    /// Remove only if these are exactly the lock's holders (`None`: whatever holds it).
    pub(crate) only_if_held_by: Option<&'a [&'a str]>,
}

impl ForceRelease<'_> {
    pub(crate) fn call(&self, wakes: Wakes) -> ScriptInvocation<'static> {
        let mut call = FORCE_RELEASE.get(wakes).key(self.lock);
        call.key(self.fence)
            .key(self.min_hold_timer)
            .key(self.write_intent)
            .key(self.wake)
            .arg(flag(self.only_if_held_by.is_some()));
        for token in self.only_if_held_by.unwrap_or_default() {
            call.arg(*token);
        }
        call
    }
}

/// A call of `handoff.lua`: a plain lock from `token` to `next`, with `lease`.
pub(crate) struct HandOff<'a> {
    pub(crate) lock: &'a str,
    pub(crate) token: &'a str,
    pub(crate) next: &'a str,
    pub(crate) lease: Duration,
}

impl HandOff<'_> {
    pub(crate) fn call(&self) -> ScriptInvocation<'static> {
        let mut call = HANDOFF.key(self.lock);
        call.arg(self.token).arg(self.next).arg(millis(self.lease));
        call
    }
}

/// A call of `extend.lua`: the lease of a lock (and of the token's share, for shares).
pub(crate) struct Extend<'a> {
    pub(crate) lock: &'a str,
    pub(crate) token: &'a str,
    pub(crate) lease: Duration,
}

impl Extend<'_> {
    pub(crate) fn call(&self) -> ScriptInvocation<'static> {
        let mut call = EXTEND.key(self.lock);
        call.arg(self.token).arg(millis(self.lease));
        call
    }
}

/// A call of `renew.lua`: a batch of `(lock, token, lease)` (a share's lease is renewed
/// with its lock).
pub(crate) fn renew<'a>(
    items: impl IntoIterator<Item = (&'a str, &'a str, Duration)>,
) -> ScriptInvocation<'static> {
    let mut call = RENEW.prepare_invoke();
    for (lock, token, lease) in items {
        call.key(lock).arg(token).arg(millis(lease));
    }
    call
}

/// A call of `share_held.lua`: whether `token` holds `lock` (a share: whether its lease lives).
pub(crate) fn share_held(lock: &str, token: &str) -> ScriptInvocation<'static> {
    let mut call = SHARE_HELD.key(lock);
    call.arg(token);
    call
}

/// A call of `fair.lua`.
pub(crate) struct Fair<'a> {
    pub(crate) lock: &'a str,
    pub(crate) queue: &'a str,
    pub(crate) leases: &'a str,
    pub(crate) wake: &'a str,
    pub(crate) token: &'a str,
    /// The caller's queue entry.
    pub(crate) entry: &'a str,
    /// The caller's manager id.
    pub(crate) manager_id: &'a str,
    /// How long a lock granted to another manager's waiter stays held unclaimed.
    pub(crate) unclaimed: Duration,
    pub(crate) op: FairOp,
}

/// What a `fair.lua` call does.
pub(crate) enum FairOp {
    /// Take the lock in queue order; `join`: queue up (or renew the entry) when not granted.
    Take {
        lease: Duration,
        entry_lease: Duration,
        join: bool,
    },
    /// Give it to the queue's head (or free it), and leave the queue.
    Release,
}

impl Fair<'_> {
    pub(crate) fn call(&self, wakes: Wakes) -> ScriptInvocation<'static> {
        let mut call = FAIR.get(wakes).key(self.lock);
        call.key(self.queue).key(self.leases).key(self.wake);
        let op = match self.op {
            FairOp::Take { .. } => "take",
            FairOp::Release => "release",
        };
        call.arg(op)
            .arg(self.token)
            .arg(self.entry)
            .arg(self.manager_id)
            .arg(millis(self.unclaimed));
        if let FairOp::Take {
            lease,
            entry_lease,
            join,
        } = self.op
        {
            call.arg(millis(lease))
                .arg(millis(entry_lease))
                .arg(flag(join));
        }
        call
    }
}

/// A call of `set_acquire.lua`: every `(lock, fence)` of a set, all or none.
pub(crate) fn set_acquire<'a>(
    keys: impl IntoIterator<Item = (&'a str, &'a str)>,
    token: &str,
    lease: Duration,
    fencing: bool,
) -> ScriptInvocation<'static> {
    let mut call = SET_ACQUIRE.prepare_invoke();
    for (lock, fence) in keys {
        call.key(lock).key(fence);
    }
    call.arg(token).arg(millis(lease)).arg(flag(fencing));
    call
}

/// A call of `set_release.lua`: every `(lock, wake, keep)` of a set (`keep`: how much
/// longer that key must live, for a `min_hold` of a hold nested in the set's).
pub(crate) fn set_release<'a>(
    keys: impl IntoIterator<Item = (&'a str, &'a str, Duration)>,
    token: &str,
    wakes: Wakes,
) -> ScriptInvocation<'static> {
    let mut call = SET_RELEASE.get(wakes).prepare_invoke();
    call.arg(token);
    for (lock, wake, keep) in keys {
        call.key(lock)
            .key(crate::key::min_hold_timer_key(lock))
            .key(wake);
        call.arg(whole_millis(keep));
    }
    call
}

#[cfg(all(test, feature = "test-util"))]
mod tests {
    use redis::AsyncCommands;
    use redis::aio::MultiplexedConnection;

    use super::*;
    use crate::testing::RedisServer;

    async fn connect(server: &RedisServer) -> MultiplexedConnection {
        let client = redis::Client::open(server.url()).unwrap();
        client.get_multiplexed_async_connection().await.unwrap()
    }

    /// One acquire: (lock, token, hold, fencing, reentrant) -> (held, fence or pttl).
    async fn acquire(
        conn: &mut MultiplexedConnection,
        lock: &str,
        token: &str,
        hold: &str,
        fencing: bool,
        reentrant: bool,
    ) -> (i64, i64) {
        let fence = format!("{lock}:fence");
        let call = Acquire {
            lock,
            fence: &fence,
            token,
            lease: Duration::from_secs(10),
            fencing,
            hold,
            reentrant,
            after_set: false,
        };
        call.call().invoke_async(conn).await.unwrap()
    }

    async fn release(conn: &mut MultiplexedConnection, lock: &str, token: &str, hold: &str) -> i64 {
        let wake = format!("{lock}:wake");
        let call = Release {
            lock,
            wake: &wake,
            token,
            hold,
            keep: Duration::ZERO,
        };
        call.call(Wakes::Classic).invoke_async(conn).await.unwrap()
    }

    #[tokio::test]
    async fn unlock_frees_only_its_owners_lock_and_counts_who_heard() {
        // A server of its own: it flushes the script cache.
        let server = RedisServer::start().unwrap();
        let mut conn = connect(&server).await;
        let (lock, wake) = ("l{unlock}", "l{unlock}:wake");
        let flushed: String = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(flushed, "OK");
        let bare = Unlock {
            lock,
            wake,
            token: "a",
            keep: Duration::ZERO,
            message: "tag",
        };
        // A bare EVALSHA finds no script; the EVAL form runs it and leaves it for the next.
        let missing = bare
            .command(Wakes::Classic)
            .query_async::<i64>(&mut conn)
            .await;
        assert_eq!(
            missing.unwrap_err().kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        );
        let released: i64 = bare
            .eval_command(Wakes::Classic)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 0, "nothing was held");
        let unlock = |token: &'static str, keep: Duration| {
            Unlock {
                lock,
                wake,
                token,
                keep,
                message: "tag",
            }
            .command(Wakes::Classic)
        };
        let _: () = conn.set(lock, "a").await.unwrap();
        // Another owner's token: nothing happens.
        let released: i64 = unlock("b", Duration::ZERO)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 0);
        assert_eq!(conn.get::<_, String>(lock).await.unwrap(), "a");
        // Its owner's: freed, and 1 + the number of subscribers told (none here).
        let released: i64 = unlock("a", Duration::ZERO)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 1);
        assert!(!conn.exists::<_, bool>(lock).await.unwrap());
        // With a `min_hold` still to run: the ownerless marker stays that long.
        let _: () = conn.set(lock, "a").await.unwrap();
        let released: i64 = unlock("a", Duration::from_secs(30))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 1);
        let mode: String = conn.hget(lock, "mode").await.unwrap();
        assert_eq!(mode, "min_hold");
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl > 29_000 && pttl <= 30_000, "{pttl}");
        let _: () = conn.del(lock).await.unwrap();
    }

    #[tokio::test]
    async fn acquire_is_exclusive_and_a_resend_is_idempotent() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{excl}";
        assert_eq!(
            acquire(&mut conn, lock, "a", "a", true, false).await,
            (1, 1)
        );
        // A resend after a lost reply: still held, same fencing token, count unchanged.
        assert_eq!(
            acquire(&mut conn, lock, "a", "a", true, false).await,
            (1, 1)
        );
        let count: String = conn.hget(lock, "a").await.unwrap();
        assert_eq!(count, "1");
        let (held, pttl) = acquire(&mut conn, lock, "b", "b", true, false).await;
        assert_eq!(held, 0);
        assert!(pttl > 9_000 && pttl <= 10_000, "{pttl}");
        let fence: i64 = conn.get("l{excl}:fence").await.unwrap();
        assert_eq!(fence, 1, "a busy attempt draws no token");
        // Not reentrant: the same owner with a new hold is refused.
        assert_eq!(acquire(&mut conn, lock, "a", "a2", false, false).await.0, 0);
        let _: () = conn.del(&[lock, "l{excl}:fence"]).await.unwrap();
    }

    #[tokio::test]
    async fn reentrant_holds_count_up_and_down_once_per_request() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{reent}";
        assert_eq!(acquire(&mut conn, lock, "a", "a", false, true).await.0, 1);
        assert_eq!(acquire(&mut conn, lock, "a", "h2", false, true).await.0, 1);
        // The nested request resent: no second count.
        assert_eq!(acquire(&mut conn, lock, "a", "h2", false, true).await.0, 1);
        let count: String = conn.hget(lock, "a").await.unwrap();
        assert_eq!(count, "2");
        // Another owner stays out, reentrant or not.
        assert_eq!(acquire(&mut conn, lock, "b", "b", false, true).await.0, 0);

        assert_eq!(release(&mut conn, lock, "a", "h2").await, 1);
        // The nested release resent: counted once, the lock still held.
        assert_eq!(release(&mut conn, lock, "a", "h2").await, 1);
        let count: String = conn.hget(lock, "a").await.unwrap();
        assert_eq!(count, "1");
        assert_eq!(release(&mut conn, lock, "a", "a").await, 1);
        assert!(!conn.exists::<_, bool>(lock).await.unwrap());
        assert_eq!(release(&mut conn, lock, "a", "a").await, 0);
    }

    #[tokio::test]
    async fn a_resent_release_of_the_outer_hold_leaves_the_inner_one() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{outer-first}";
        assert_eq!(acquire(&mut conn, lock, "a", "a", false, true).await.0, 1);
        assert_eq!(acquire(&mut conn, lock, "a", "h2", false, true).await.0, 1);
        // The outer hold goes first; its release is resent (a lost reply, a retry).
        assert_eq!(release(&mut conn, lock, "a", "a").await, 1);
        assert_eq!(release(&mut conn, lock, "a", "a").await, 1);
        // The inner hold still holds the lock: nobody else gets it.
        assert_eq!(acquire(&mut conn, lock, "b", "b", false, true).await.0, 0);
        let count: String = conn.hget(lock, "a").await.unwrap();
        assert_eq!(count, "1");
        assert_eq!(release(&mut conn, lock, "a", "h2").await, 1);
        assert!(!conn.exists::<_, bool>(lock).await.unwrap());
    }

    #[tokio::test]
    async fn release_and_extend_only_for_the_owner() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{owner}";
        acquire(&mut conn, lock, "a", "a", false, false).await;
        let _: () = conn.pexpire(lock, 1_000).await.unwrap();

        let stranger: i64 = Extend {
            lock,
            token: "b",
            lease: Duration::from_millis(60_000),
        }
        .call()
        .invoke_async(&mut conn)
        .await
        .unwrap();
        assert_eq!(stranger, 0);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl <= 1_000, "a stranger's extend changed nothing");
        let owner: i64 = Extend {
            lock,
            token: "a",
            lease: Duration::from_millis(60_000),
        }
        .call()
        .invoke_async(&mut conn)
        .await
        .unwrap();
        assert_eq!(owner, 1);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl > 50_000);
        let shorter: i64 = Extend {
            lock,
            token: "a",
            lease: Duration::from_millis(1_000),
        }
        .call()
        .invoke_async(&mut conn)
        .await
        .unwrap();
        assert_eq!(shorter, 1);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl > 50_000, "extend never shortens a lease");

        assert_eq!(release(&mut conn, lock, "b", "b").await, 0);
        assert!(conn.exists::<_, bool>(lock).await.unwrap());
        assert_eq!(release(&mut conn, lock, "a", "a").await, 1);
        assert!(!conn.exists::<_, bool>(lock).await.unwrap());
    }

    #[tokio::test]
    async fn renew_extends_only_what_each_token_holds() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        acquire(&mut conn, "l{r1}", "a", "a", false, false).await;
        acquire(&mut conn, "l{r2}", "b", "b", false, false).await;
        let minute = Duration::from_secs(60);
        let call = renew([
            ("l{r1}", "a", minute),
            ("l{r2}", "not-b", minute),
            ("l{r3}", "c", minute),
        ]);
        let renewed: Vec<i64> = call.invoke_async(&mut conn).await.unwrap();
        assert_eq!(renewed, vec![1, 0, 0]);
        let pttl: i64 = conn.pttl("l{r1}").await.unwrap();
        assert!(pttl > 50_000);
        let pttl: i64 = conn.pttl("l{r2}").await.unwrap();
        assert!(pttl <= 10_000, "a stolen lock is never extended");
        assert!(!conn.exists::<_, bool>("l{r3}").await.unwrap());
        let _: () = conn.del(&["l{r1}", "l{r2}"]).await.unwrap();
    }

    #[tokio::test]
    async fn min_hold_keeps_the_key_without_an_owner() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{min}";
        acquire(&mut conn, lock, "a", "a", false, false).await;
        let call = Release {
            lock,
            wake: "l{min}:wake",
            token: "a",
            hold: "a",
            keep: Duration::from_secs(5),
        }
        .call(Wakes::Classic);
        let released: i64 = call.invoke_async(&mut conn).await.unwrap();
        assert_eq!(released, 1);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl > 4_000 && pttl <= 5_000, "{pttl}");
        assert!(
            !conn.hexists::<_, _, bool>(lock, "a").await.unwrap(),
            "no owner left"
        );
        assert_eq!(acquire(&mut conn, lock, "b", "b", false, false).await.0, 0);
        let _: () = conn.del(lock).await.unwrap();
    }

    /// One `fair.lua` call on lock `l{fair}` by owner `token` of manager `manager_id`.
    async fn fair(
        conn: &mut MultiplexedConnection,
        token: &str,
        manager_id: &str,
        op: FairOp,
    ) -> (i64, redis::Value) {
        let entry = format!("{manager_id}:10000:{token}");
        let call = Fair {
            lock: "l{fair}",
            queue: "l{fair}:queue",
            leases: "l{fair}:queue:leases",
            wake: "l{fair}:wake",
            token,
            entry: &entry,
            manager_id,
            unclaimed: Duration::from_secs(2),
            op,
        };
        call.call(Wakes::Classic).invoke_async(conn).await.unwrap()
    }

    fn take(join: bool) -> FairOp {
        FairOp::Take {
            lease: Duration::from_secs(10),
            entry_lease: Duration::from_secs(3),
            join,
        }
    }

    #[tokio::test]
    async fn a_fair_release_grants_the_oldest_waiter_with_the_right_lease() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        assert_eq!(fair(&mut conn, "a", "m1", take(true)).await.0, 1);
        // Two waiters queue, of two managers; one that does not join stays out of the queue.
        assert_eq!(fair(&mut conn, "b", "m2", take(true)).await.0, 0);
        assert_eq!(fair(&mut conn, "c", "m1", take(true)).await.0, 0);
        assert_eq!(fair(&mut conn, "d", "m1", take(false)).await.0, 0);
        // Asking again renews an entry and keeps its place.
        assert_eq!(fair(&mut conn, "b", "m2", take(true)).await.0, 0);
        let queued: Vec<String> = conn.lrange("l{fair}:queue", 0, -1).await.unwrap();
        assert_eq!(queued, ["m2:10000:b", "m1:10000:c"]);

        // Released by a manager other than the head's: granted for the unclaimed window.
        let (status, owner) = fair(&mut conn, "a", "m1", FairOp::Release).await;
        assert_eq!(
            (status, redis::from_redis_value::<String>(owner).unwrap()),
            (2, "b".into())
        );
        let held: String = conn.get("l{fair}").await.unwrap();
        assert_eq!(held, "b");
        let pttl: i64 = conn.pttl("l{fair}").await.unwrap();
        assert!(pttl <= 2_000, "{pttl}");
        // Claimed: the whole lease.
        assert_eq!(fair(&mut conn, "b", "m2", take(true)).await.0, 1);
        let pttl: i64 = conn.pttl("l{fair}").await.unwrap();
        assert!(pttl > 9_000, "{pttl}");

        // Released by the head's own manager: granted with the head's whole lease at once.
        let (status, owner) = fair(&mut conn, "b", "m1", FairOp::Release).await;
        assert_eq!(
            (status, redis::from_redis_value::<String>(owner).unwrap()),
            (2, "c".into())
        );
        let pttl: i64 = conn.pttl("l{fair}").await.unwrap();
        assert!(pttl > 9_000, "{pttl}");
        // A resent release finds it gone; the last release frees the lock and the queue.
        assert_eq!(fair(&mut conn, "b", "m1", FairOp::Release).await.0, 0);
        assert_eq!(fair(&mut conn, "c", "m1", FairOp::Release).await.0, 1);
        let left: i64 = conn
            .exists(&["l{fair}", "l{fair}:queue", "l{fair}:queue:leases"])
            .await
            .unwrap();
        assert_eq!(left, 0);
    }

    #[tokio::test]
    async fn each_variant_publishes_with_its_own_command() {
        // Sharded pub/sub works on one server too (Redis 7.0, Valkey): a sharded subscriber
        // hears only the sharded variant, a classic one only the classic.
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let (lock, wake) = ("l{variants}", "l{variants}:wake");
        let client = redis::Client::open(format!("{}?protocol=resp3", server.url())).unwrap();
        let (pushes, mut heard) = tokio::sync::mpsc::unbounded_channel();
        let config = redis::AsyncConnectionConfig::new().set_push_sender(pushes);
        let mut listener = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap();
        let _: redis::Value = redis::cmd("SSUBSCRIBE")
            .arg(wake)
            .query_async(&mut listener)
            .await
            .unwrap();
        let unlock = |wakes: Wakes| {
            Unlock {
                lock,
                wake,
                token: "a",
                keep: Duration::ZERO,
                message: "tag",
            }
            .eval_command(wakes)
        };
        for (wakes, told) in [(Wakes::Classic, 0), (Wakes::Sharded, 1)] {
            let _: () = conn.set(lock, "a").await.unwrap();
            let released: i64 = unlock(wakes).query_async(&mut conn).await.unwrap();
            assert_eq!(released, 1 + told, "{wakes:?}: 1 + the subscribers told");
        }
        let message = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let push = heard.recv().await.unwrap();
                if push.kind == redis::PushKind::SMessage {
                    break push;
                }
            }
        });
        let message = message.await.expect("the sharded message came");
        assert_eq!(
            message.data.get(1),
            Some(&redis::Value::BulkString(b"tag".to_vec()))
        );
        let hash = |wakes| RELEASE.get(wakes).get_hash().to_owned();
        assert_ne!(hash(Wakes::Classic), hash(Wakes::Sharded));
    }

    #[tokio::test]
    async fn scripts_reload_after_a_flush() {
        // Its own server: a flush would race the other tests' scripts.
        let server = RedisServer::start().unwrap();
        let mut conn = connect(&server).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(release(&mut conn, "l{flush}", "a", "a").await, 0);
    }
}

/// Every script reads and writes only the keys it is given: Redis routes a script, moves a
/// slot key by key and guarantees atomicity by its declared KEYS, and some compatible
/// servers refuse any other key. Checked on the sources, without a server.
#[cfg(test)]
mod declared_keys {
    /// Every `.lua` file, shared fragments included.
    const SOURCES: &[(&str, &str)] = &[
        ("acquire", include_str!("scripts/acquire.lua")),
        ("announce", include_str!("scripts/announce.lua")),
        ("clock", include_str!("scripts/clock.lua")),
        ("extend", include_str!("scripts/extend.lua")),
        ("fair", include_str!("scripts/fair.lua")),
        ("force_release", include_str!("scripts/force_release.lua")),
        ("guarded_write", include_str!("scripts/guarded_write.lua")),
        ("handoff", include_str!("scripts/handoff.lua")),
        ("held_by", include_str!("scripts/held_by.lua")),
        ("share_held", include_str!("scripts/share_held.lua")),
        ("kind", include_str!("scripts/kind.lua")),
        ("set_acquire", include_str!("scripts/set_acquire.lua")),
        ("set_release", include_str!("scripts/set_release.lua")),
        ("release", include_str!("scripts/release.lua")),
        ("release_hold", include_str!("scripts/release_hold.lua")),
        ("renew", include_str!("scripts/renew.lua")),
        ("share_acquire", include_str!("scripts/share_acquire.lua")),
        ("share_release", include_str!("scripts/share_release.lua")),
        ("unlock", include_str!("scripts/unlock.lua")),
        (
            "withdraw_intent",
            include_str!("scripts/withdraw_intent.lua"),
        ),
        ("write_acquire", include_str!("scripts/write_acquire.lua")),
    ];

    /// The commands the scripts send that take no key, and those whose every argument is a
    /// key.
    const KEYLESS: &[&str] = &["time"];
    const ALL_KEYS: &[&str] = &["del", "exists"];

    /// The code of `source` without its comments (every `--` to the end of its line; no
    /// script has `--` inside a string).
    fn code(source: &str) -> String {
        source
            .lines()
            .map(|line| line.split("--").next().unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The arguments of every `redis.call(…)` and `redis.pcall(…)` of `code`, split at the
    /// top-level commas.
    fn calls(code: &str) -> Vec<Vec<String>> {
        let mut found = Vec::new();
        for (at, _) in code.match_indices("redis.") {
            let rest = &code[at + "redis.".len()..];
            let Some(rest) = rest
                .strip_prefix("call(")
                .or_else(|| rest.strip_prefix("pcall("))
            else {
                continue;
            };
            let (mut depth, mut args, mut arg) = (0, Vec::new(), String::new());
            for c in rest.chars() {
                match c {
                    '(' | '[' | '{' => depth += 1,
                    ')' if depth == 0 => break,
                    ')' | ']' | '}' => depth -= 1,
                    ',' if depth == 0 => {
                        args.push(std::mem::take(&mut arg).trim().to_owned());
                        continue;
                    }
                    _ => {}
                }
                arg.push(c);
            }
            args.push(arg.trim().to_owned());
            found.push(args);
        }
        found
    }

    /// Whether `arg` names a key without building one: `KEYS[…]`, or a plain name (a local
    /// or a parameter holding a declared key).
    fn names_a_declared_key(arg: &str) -> bool {
        let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_');
        plain(arg)
            || arg
                .strip_prefix("KEYS[")
                .and_then(|rest| rest.strip_suffix(']'))
                .is_some_and(|index| !index.contains(".."))
    }

    #[test]
    fn no_script_builds_a_key_name() {
        let mut checked = 0;
        for (name, source) in SOURCES {
            let code = code(source);
            // A companion key is `<lock>:suffix`: no script appends a suffix to anything.
            for quote in ['\'', '"'] {
                let suffix = format!("..{quote}:");
                let squeezed: String = code.chars().filter(|c| !c.is_whitespace()).collect();
                assert!(!squeezed.contains(&suffix), "{name}.lua builds a key name");
            }
            for args in calls(&code) {
                let command = args[0].trim_matches('\'');
                if args[0].starts_with("unpack(") {
                    // guarded_write.lua's own commands: their keys are KEYS, in order.
                    assert_eq!(*name, "guarded_write");
                    continue;
                }
                // `publish` names the command the deployment publishes with (`published!`).
                assert!(
                    args[0].starts_with('\'') || args[0] == "publish",
                    "{name}.lua: {args:?}"
                );
                if KEYLESS.contains(&command) {
                    continue;
                }
                let keys = if ALL_KEYS.contains(&command) {
                    &args[1..]
                } else {
                    &args[1..2]
                };
                for key in keys {
                    assert!(
                        names_a_declared_key(key),
                        "{name}.lua: `{command}` on `{key}`, not a declared key"
                    );
                }
                checked += 1;
            }
        }
        assert!(
            checked > 100,
            "only {checked} calls found: the parser lost its way"
        );
    }

    #[test]
    fn the_check_finds_a_built_key() {
        let built = code("redis.call('exists', lock .. ':s:' .. field)");
        let args = &calls(&built)[0];
        assert!(!names_a_declared_key(&args[1]), "{args:?}");
        let declared =
            code("redis.call('hget', KEYS[2 * i - 1], 'mode') -- a comment, lock .. ':x'");
        let args = &calls(&declared)[0];
        assert_eq!(args.len(), 3);
        assert!(names_a_declared_key(&args[1]), "{args:?}");
    }
}
