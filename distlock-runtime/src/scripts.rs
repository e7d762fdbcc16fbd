//! The Lua scripts that make every state change atomic on the server.
//!
//! Each script lives in its own `.lua` file beside this module and is built once into a
//! [`redis::Script`], which runs with EVALSHA and loads itself again on NOSCRIPT (after a
//! server restart or `SCRIPT FLUSH`). Keys and values travel in KEYS/ARGV, never in the text.
//!
//! One key may be used through several lock kinds; `kind.lua`, shared by the scripts that
//! take locks and give shares back, tells them apart, so that only readers together and
//! permits up to N overlap, and no script rewrites or deletes what another kind wrote.

use std::sync::LazyLock;

use redis::Script;

/// Take (or re-enter) an exclusive lock: `{1, fence}` when held, `{0, pttl}` when busy.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/kind.lua"),
        include_str!("scripts/acquire.lua")
    ))
});

/// Give back one hold of an exclusive lock if the token still owns it: 1 released, 0 not held.
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/release_hold.lua"),
        include_str!("scripts/release.lua")
    ))
});

/// Set the lease of a held lock: 1 set, 0 not held.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/extend.lua")
    ))
});

/// Renew a batch of leases, each checked against its token: one 1/0 per key.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/held_by.lua"),
        include_str!("scripts/renew.lua")
    ))
});

/// Give back a plain exclusive lock (string form) if the token still owns it: 1 released,
/// 0 not held. Used where the server has no native compare-and-delete, or with `min_hold`.
pub(crate) static UNLOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/unlock.lua")));

/// Pass a plain exclusive lock from its owner to the next one: 1 handed over, 0 not held.
/// Used where the server has no conditional `SET … IFEQ`.
pub(crate) static HANDOFF: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/handoff.lua")));

/// A fair lock: take it in queue order, release it to the queue's head, or leave the queue
/// (see the script for the answers).
pub(crate) static FAIR: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/fair.lua")));

/// Take the write side of a read-write lock: `{1, fence}` or `{0, pttl}`.
pub(crate) static WRITE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/kind.lua"),
        include_str!("scripts/write_acquire.lua")
    ))
});

/// Take a read share or a semaphore permit: `{1, fence}`, `{0, pttl}`, or `{-1, permits}`
/// when the semaphore is in use with another number of permits.
pub(crate) static SHARE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/kind.lua"),
        include_str!("scripts/share_acquire.lua")
    ))
});

/// Give back one hold of a share: 1 released, 0 not held.
pub(crate) static SHARE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/kind.lua"),
        include_str!("scripts/share_release.lua")
    ))
});

/// Take a set of exclusive locks, all or none: `{1, fence…}` or `{0, index, pttl}`.
pub(crate) static MULTI_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/kind.lua"),
        include_str!("scripts/multi_acquire.lua")
    ))
});

/// Give back a set of exclusive locks taken together: one 1/0 per lock.
pub(crate) static MULTI_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("scripts/release_hold.lua"),
        include_str!("scripts/multi_release.lua")
    ))
});

/// Every script, for loading them all when a manager connects.
pub(crate) fn all() -> [&'static Script; 12] {
    [
        &UNLOCK,
        &FAIR,
        &HANDOFF,
        &ACQUIRE,
        &RELEASE,
        &EXTEND,
        &RENEW,
        &WRITE_ACQUIRE,
        &SHARE_ACQUIRE,
        &SHARE_RELEASE,
        &MULTI_ACQUIRE,
        &MULTI_RELEASE,
    ]
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
        let mut call = ACQUIRE.key(lock);
        call.key(format!("{lock}:fence"))
            .arg(token)
            .arg(10_000)
            .arg(if fencing { "1" } else { "0" })
            .arg(hold)
            .arg(if reentrant { "1" } else { "0" });
        call.invoke_async(conn).await.unwrap()
    }

    async fn release(conn: &mut MultiplexedConnection, lock: &str, token: &str, hold: &str) -> i64 {
        let mut call = RELEASE.key(lock);
        call.key(format!("{lock}:wake")).arg(token).arg(hold).arg(0);
        call.invoke_async(conn).await.unwrap()
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

        let stranger: i64 = EXTEND
            .key(lock)
            .arg("b")
            .arg(60_000)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(stranger, 0);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl <= 1_000, "a stranger's extend changed nothing");
        let owner: i64 = EXTEND
            .key(lock)
            .arg("a")
            .arg(60_000)
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(owner, 1);
        let pttl: i64 = conn.pttl(lock).await.unwrap();
        assert!(pttl > 50_000);
        let shorter: i64 = EXTEND
            .key(lock)
            .arg("a")
            .arg(1_000)
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
        let mut call = RENEW.prepare_invoke();
        call.key("l{r1}").key("l{r1}").arg("a").arg(60_000);
        call.key("l{r2}").key("l{r2}").arg("not-b").arg(60_000);
        call.key("l{r3}").key("l{r3}").arg("c").arg(60_000);
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
        let mut call = RELEASE.key(lock);
        call.key("l{min}:wake").arg("a").arg("a").arg(5_000);
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
