//! ACL users: distlock works for a user restricted to its prefix, with the guide's rule or
//! with `+@all -@dangerous`, and a missing permission is a clear error at `build()`.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};

use crate::support;
use crate::support::logs::Logs;

const PASSWORD: &str = "locker-pw";

/// A fresh server with the user `locker`, allowed exactly `rules`.
fn server_with_user(rules: &str) -> RedisServer {
    let server = RedisServer::start().unwrap();
    let rules: Vec<&str> = rules.split(' ').collect();
    server.acl_setuser("locker", PASSWORD, &rules).unwrap();
    server
}

/// A manager as the user `locker`. Generous timeouts: these tests are about permissions, and on a busy machine a read of the
/// eviction policy that times out is skipped (nothing to say about it once), not denied.
async fn manager_as_locker(server: &RedisServer, prefix: &str) -> Result<LockManager, LockError> {
    support::single(server.url_as("locker", PASSWORD))
        .key_prefix(prefix)
        .response_timeout(std::time::Duration::from_secs(10))
        .connect_timeout(std::time::Duration::from_secs(10))
        .build()
        .await
}

/// Exclusive, fencing, reentrant, shared, semaphore, waiting and lease behaviours, through the
/// public API.
async fn every_kind_works(locks: &LockManager) {
    // exclusive, with fencing
    let first = locks.lock("order").fencing(true).acquire().await.unwrap();
    let fence = first.fencing_token().unwrap();
    assert!(locks.lock("order").try_acquire().await.unwrap().is_none());
    first.release().await.unwrap();
    let second = locks.lock("order").fencing(true).acquire().await.unwrap();
    assert!(second.fencing_token().unwrap() > fence);
    second.release().await.unwrap();

    // reentrant nesting in one scope
    distlock::scope(async {
        let outer = locks.lock("nest").reentrant(true).acquire().await.unwrap();
        let inner = locks.lock("nest").reentrant(true).acquire().await.unwrap();
        inner.release().await.unwrap();
        assert!(outer.is_held().await.unwrap());
        outer.release().await.unwrap();
    })
    .await;

    // readers share, a writer waits for them
    let r1 = locks.read_lock("doc").acquire().await.unwrap();
    let r2 = locks.read_lock("doc").acquire().await.unwrap();
    assert!(
        locks
            .write_lock("doc")
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let writer = locks.write_lock("doc").acquire().await.unwrap();
    assert!(
        locks
            .read_lock("doc")
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    writer.release().await.unwrap();

    // a semaphore of two
    let p1 = locks.semaphore("pool", 2).acquire().await.unwrap();
    let p2 = locks.semaphore("pool", 2).acquire().await.unwrap();
    assert!(
        locks
            .semaphore("pool", 2)
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    p1.release().await.unwrap();
    p2.release().await.unwrap();

    // a waiter is woken by the release (pub/sub): the holder's lease is far longer than the
    // waiter's bound, so only the wake-up can let it in
    let holder = locks
        .lock("queue")
        .ttl(Duration::from_secs(120))
        .acquire()
        .await
        .unwrap();
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .lock("queue")
                .wait(Duration::from_secs(60))
                .retry_delay(Duration::from_secs(30))
                .acquire()
                .await
        })
    };
    while locks.stats().waiting_keys == 0 {
        tokio::task::yield_now().await;
    }
    holder.release().await.unwrap();
    waiter
        .await
        .unwrap()
        .expect("woken by the release")
        .release()
        .await
        .unwrap();

    // leases: extend, and the watchdog renews past the TTL
    // Long enough that a renewal a third of the way in is on time on a busy machine too.
    let ttl = Duration::from_millis(900);
    let lease = locks.lock("lease").ttl(ttl).acquire().await.unwrap();
    lease.extend(Duration::from_secs(5)).await.unwrap();
    lease.release().await.unwrap();
    let watched = locks
        .lock("watched")
        .ttl(ttl)
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(ttl * 3).await;
    assert!(watched.is_held().await.unwrap(), "renewed past its TTL");
    assert!(locks.stats().leases_renewed > 0);
    watched.release().await.unwrap();
}

#[tokio::test]
async fn the_readme_rule_is_enough() {
    let prefix = "app:lock:";
    let server = server_with_user(&LockManager::acl_rules(prefix));
    let locks = manager_as_locker(&server, prefix)
        .await
        .expect("builds with exactly the guide's rule");
    every_kind_works(&locks).await;
}

/// A user who may ask `COMMAND INFO` but not run the native compare-and-delete it finds
/// (Valkey's DELIFEQ): releases fall back to the script and still work.
#[tokio::test]
async fn a_denied_native_delete_falls_back_to_the_script() {
    let rules = format!("{} +command|info", LockManager::acl_rules("acl:"));
    let server = server_with_user(&rules);
    let locks = manager_as_locker(&server, "acl:").await.unwrap();
    for _ in 0..3 {
        let guard = locks.lock("native").acquire().await.unwrap();
        guard.release().await.unwrap();
    }
    let other = manager_as_locker(&server, "acl:").await.unwrap();
    let free = other.lock("native").try_acquire().await.unwrap();
    assert!(free.is_some(), "the lock was given back");
}

#[tokio::test]
async fn the_rule_denies_other_keys() {
    let prefix = "app:lock:";
    let server = server_with_user(&LockManager::acl_rules(prefix));
    let elsewhere = manager_as_locker(&server, "other:").await.unwrap();
    let error = elsewhere.lock("x").try_acquire().await.unwrap_err();
    assert!(error.to_string().contains("NoPerm"), "{error}");
}

#[tokio::test(flavor = "current_thread")]
async fn without_dangerous_commands_it_works_and_says_so_once() {
    let prefix = "app:lock:";
    let server = server_with_user("~app:lock:* &app:lock:* +@all -@dangerous");
    let (logs, _guard) = Logs::capture_here();
    let locks = manager_as_locker(&server, prefix)
        .await
        .expect("builds although INFO and CONFIG are denied");
    assert_eq!(
        logs.matching("could not be checked").len(),
        1,
        "{:?}",
        logs.lines()
    );
    every_kind_works(&locks).await;
}

#[tokio::test(flavor = "current_thread")]
async fn redlock_without_info_says_so_once() {
    let servers: Vec<RedisServer> = (0..3)
        .map(|_| server_with_user("~app:lock:* &app:lock:* +@all -@dangerous"))
        .collect();
    let (logs, _guard) = Logs::capture_here();
    let locks = LockManager::builder()
        .redlock(servers.iter().map(|s| s.url_as("locker", PASSWORD)))
        .key_prefix("app:lock:")
        .build()
        .await
        .expect("builds although INFO is denied");
    assert_eq!(
        logs.matching("INFO is denied").len(),
        1,
        "{:?}",
        logs.lines()
    );
    let guard = locks.lock("job").acquire().await.unwrap();
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_missing_permission_names_the_command_at_build() {
    let prefix = "app:lock:";
    let rules = LockManager::acl_rules(prefix).replace(" +script|load", "");
    let server = server_with_user(&rules);
    let error = manager_as_locker(&server, prefix).await.unwrap_err();
    let message = error.to_string();
    assert!(matches!(error, LockError::Config(_)), "{error:?}");
    assert!(message.contains("script|load"), "{message}");
    assert!(message.contains("ACL"), "{message}");
}

#[tokio::test]
async fn builder_credentials_replace_the_urls() {
    let prefix = "app:lock:";
    let server = server_with_user(&LockManager::acl_rules(prefix));
    let locks = LockManager::builder()
        .redis_url(server.url())
        .credentials("locker", PASSWORD)
        .key_prefix(prefix)
        .build()
        .await
        .expect("builds with the builder's credentials");
    let guard = locks.lock("job").acquire().await.unwrap();
    guard.release().await.unwrap();
    let wrong = LockManager::builder()
        .redis_url(server.url())
        .credentials("locker", "not-the-password")
        .key_prefix(prefix)
        .build()
        .await
        .unwrap_err();
    assert!(matches!(wrong, LockError::Config(_)), "{wrong:?}");
}

/// A user without the locks' channels: its waiters cannot follow releases, so they keep the
/// timed look (backoff, bounded by the holder's lease) and get in soon after a release,
/// however long the holder's lease.
#[tokio::test]
async fn a_waiter_that_cannot_subscribe_is_let_in_by_its_timer() {
    let prefix = "acl:";
    let rules = LockManager::acl_rules(prefix).replace("resetchannels &acl:*", "resetchannels");
    assert!(!rules.contains('&'), "{rules}");
    let server = server_with_user(&rules);
    let holder = support::manager(&server, prefix).await;
    let waiter = manager_as_locker(&server, prefix).await.unwrap();
    let held = holder
        .lock("k")
        .ttl(Duration::from_secs(3600))
        .acquire()
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .lock("k")
            .wait(Duration::from_secs(60))
            .acquire()
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    held.release().await.unwrap();
    // Its timer looks within 1.6 s (50 ms doubling to 32 times that); a failed subscription is
    // tried again only every connect timeout (10 s here).
    let guard = tokio::time::timeout(Duration::from_secs(8), waiting)
        .await
        .expect("let in by its timer")
        .unwrap()
        .unwrap();
    // Its release cannot publish on the channel either (the script fails): the lease ends it.
    drop(guard);
}
