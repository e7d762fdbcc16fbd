//! The Lua scripts that make every state change atomic on the server.
//!
//! Each script lives in its own `.lua` file beside this module and is built once into a
//! [`redis::Script`], which runs with EVALSHA and loads itself again on NOSCRIPT (after a
//! server restart or `SCRIPT FLUSH`). Keys and values travel in KEYS/ARGV, never in the text.

use std::sync::LazyLock;

use redis::Script;

/// Take an exclusive lock: `{1, fence}` when held, `{0, pttl}` when busy.
pub(crate) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/acquire.lua")));

/// Give back an exclusive lock if the token still owns it: 1 released, 0 not held.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/release.lua")));

/// Set the lease of a held lock: 1 set, 0 not held.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("scripts/extend.lua")));

/// Every script, for loading them all when a manager connects.
pub(crate) fn all() -> [&'static Script; 3] {
    [&ACQUIRE, &RELEASE, &EXTEND]
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

    async fn acquire(conn: &mut MultiplexedConnection, token: &str, fencing: bool) -> (i64, i64) {
        let mut call = ACQUIRE.key("l{k}");
        call.key("l{k}:fence")
            .arg(token)
            .arg(10_000)
            .arg(if fencing { "1" } else { "0" });
        call.invoke_async(conn).await.unwrap()
    }

    #[tokio::test]
    async fn acquire_is_exclusive_and_a_resend_is_idempotent() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        assert_eq!(acquire(&mut conn, "a", true).await, (1, 1));
        // A resend after a lost reply: still held, same fencing token, count unchanged.
        assert_eq!(acquire(&mut conn, "a", true).await, (1, 1));
        let count: String = conn.hget("l{k}", "a").await.unwrap();
        assert_eq!(count, "1");
        let (held, pttl) = acquire(&mut conn, "b", true).await;
        assert_eq!(held, 0);
        assert!(pttl > 9_000 && pttl <= 10_000, "{pttl}");
        let fence: i64 = conn.get("l{k}:fence").await.unwrap();
        assert_eq!(fence, 1, "a busy attempt draws no token");
        let _: () = conn.del(&["l{k}", "l{k}:fence"]).await.unwrap();
    }

    #[tokio::test]
    async fn release_and_extend_only_for_the_owner() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let lock = "l{owner}";
        let mut call = ACQUIRE.key(lock);
        call.key("l{owner}:fence").arg("a").arg(1_000).arg("0");
        let _: (i64, i64) = call.invoke_async(&mut conn).await.unwrap();

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

        let stranger: i64 = RELEASE
            .key(lock)
            .arg("b")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(stranger, 0);
        assert!(conn.exists::<_, bool>(lock).await.unwrap());
        let owner: i64 = RELEASE
            .key(lock)
            .arg("a")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(owner, 1);
        assert!(!conn.exists::<_, bool>(lock).await.unwrap());
        let again: i64 = RELEASE
            .key(lock)
            .arg("a")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(again, 0);
    }

    #[tokio::test]
    async fn scripts_reload_after_a_flush() {
        let server = RedisServer::shared().unwrap();
        let mut conn = connect(&server).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
        let released: i64 = RELEASE
            .key("l{flush}")
            .arg("a")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(released, 0);
    }
}
