//! Fencing enforced: guarded Redis writes run only while the writer holds the lock, on one
//! server, Sentinel and Cluster; a holder paused past its lease has its late write refused
//! while the next holder's lands.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{Batch, LockError, LockGuard, LockManager};
use redis::AsyncCommands;

use crate::support::{self, manager, raw, shared_server, unique_prefix};

const SHORT: Duration = Duration::from_millis(200);

/// Takes `key` with a short lease, fencing on and no watchdog: left alone, the lease lapses.
async fn short_hold(locks: &LockManager, key: &str) -> LockGuard {
    locks
        .lock(key)
        .ttl(SHORT)
        .watchdog(false)
        .fencing(true)
        .acquire()
        .await
        .unwrap()
}

/// Waits (bounded) for `key` and takes it, fencing on.
async fn take_when_free(locks: &LockManager, key: &str) -> LockGuard {
    locks
        .lock(key)
        .ttl(Duration::from_secs(5))
        .fencing(true)
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap()
}

/// A write stamped with the guard's fencing token: `SET value <who>`, `SET fence <token>`.
fn stamped(guard: &LockGuard, who: &str) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(guard.key_in_slot("value"))
        .arg(who)
        .cmd("SET")
        .arg(guard.key_in_slot("fence"))
        .arg(guard.fencing_token().unwrap());
    pipe
}

/// The paused-holder story on `old` and `new` (two managers of one deployment): `old` holds,
/// freezes past its lease, `new` takes the lock and writes, then `old` wakes and writes.
/// Returns what the stored value is afterwards, read under `new`'s guard.
async fn paused_holder(old: &LockManager, new: &LockManager, key: &str) -> String {
    let stale = short_hold(old, key).await;
    let () = stale
        .guarded_write(stamped(&stale, "old-early"))
        .await
        .unwrap();
    // The frozen holder: nothing renews it while it waits out its own lease.
    assert!(stale.lost().await.is_lost());
    let current = take_when_free(new, key).await;
    assert!(current.fencing_token() > stale.fencing_token());
    let () = current
        .guarded_write(stamped(&current, "new"))
        .await
        .unwrap();

    // The old holder wakes up and writes as if it still held the lock.
    let late = stale.guarded_write::<()>(stamped(&stale, "old-late")).await;
    assert!(
        matches!(&late, Err(LockError::Lost { key: k, .. }) if k == key),
        "{late:?}"
    );
    assert!(stale.is_lost());

    let get = redis::cmd("GET")
        .arg(current.key_in_slot("value"))
        .to_owned();
    let (value,): (String,) = current.guarded_write(get).await.unwrap();
    current.release().await.unwrap();
    value
}

#[tokio::test]
async fn a_write_made_while_held_lands_with_typed_replies() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-held");
    let locks = manager(&server, &prefix).await;
    let guard = locks.lock("acct").fencing(true).acquire().await.unwrap();
    let balance = guard.key_in_slot("balance");
    assert_eq!(balance, format!("{prefix}{{acct}}:d:balance"));

    let mut pipe = redis::pipe();
    pipe.cmd("INCRBY")
        .arg(&balance)
        .arg(10)
        .cmd("INCRBY")
        .arg(&balance)
        .arg(5)
        .cmd("GET")
        .arg(guard.key_in_slot("missing"));
    let (first, second, missing): (i64, i64, Option<String>) =
        guard.guarded_write(&pipe).await.unwrap();
    assert_eq!((first, second, missing), (10, 15, None));

    // One command, and one with two keys.
    let (set,): (String,) = guard
        .guarded_write(redis::cmd("SET").arg(guard.key_in_slot("a")).arg(1))
        .await
        .unwrap();
    assert_eq!(set, "OK");
    let mut batch = Batch::new();
    batch.command_with_keys(
        redis::cmd("DEL").arg(guard.key_in_slot("a")).arg(&balance),
        2,
    );
    let (deleted,): (i64,) = guard.guarded_write(&mut batch).await.unwrap();
    assert_eq!(deleted, 2);
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_paused_holders_late_write_is_refused_after_a_steal() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-paused");
    let old = manager(&server, &prefix).await;
    let new = manager(&server, &prefix).await;
    assert_eq!(paused_holder(&old, &new, "acct").await, "new");
}

#[tokio::test]
async fn a_write_after_the_lease_expired_runs_nothing() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-expired");
    let locks = manager(&server, &prefix).await;
    let guard = short_hold(&locks, "acct").await;
    let value = guard.key_in_slot("value");
    assert!(guard.lost().await.is_lost());
    // Until the server's lease ends too (the local one ends first, by its safety margin).
    while guard.is_held().await.unwrap() {
        tokio::task::yield_now().await;
    }
    let late = guard
        .guarded_write::<()>(redis::cmd("SET").arg(&value).arg("late"))
        .await;
    assert!(late.as_ref().is_err_and(LockError::is_lost), "{late:?}");
    let stored: Option<String> = raw(&server).await.get(&value).await.unwrap();
    assert_eq!(stored, None);
}

#[tokio::test]
async fn a_write_after_a_forced_release_runs_nothing() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-forced");
    let locks = manager(&server, &prefix).await;
    let admin = manager(&server, &prefix).await;
    let guard = locks.lock("acct").watchdog(true).acquire().await.unwrap();
    let value = guard.key_in_slot("value");
    assert!(admin.force_release("acct").await.unwrap().is_some());
    let late = guard
        .guarded_write::<()>(redis::cmd("SET").arg(&value).arg("late"))
        .await;
    assert!(late.as_ref().is_err_and(LockError::is_lost), "{late:?}");
    assert!(guard.is_lost(), "a refused write marks the lease lost");
    let stored: Option<String> = raw(&server).await.get(&value).await.unwrap();
    assert_eq!(stored, None);
}

#[tokio::test]
async fn write_and_fair_holds_guard_writes_and_shares_are_refused() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-kinds");
    let locks = manager(&server, &prefix).await;
    let write = locks.write_lock("doc").acquire().await.unwrap();
    let (n,): (i64,) = write
        .guarded_write(redis::cmd("INCR").arg(write.key_in_slot("n")))
        .await
        .unwrap();
    assert_eq!(n, 1);
    write.release().await.unwrap();
    let fair = locks.lock("queue").fair(true).acquire().await.unwrap();
    let (n,): (i64,) = fair
        .guarded_write(redis::cmd("INCR").arg(fair.key_in_slot("n")))
        .await
        .unwrap();
    assert_eq!(n, 1);
    fair.release().await.unwrap();

    let read = locks.read_lock("doc").acquire().await.unwrap();
    let refused = read
        .guarded_write::<()>(redis::cmd("SET").arg(read.key_in_slot("x")).arg(1))
        .await;
    assert!(
        matches!(&refused, Err(LockError::InvalidInput { reason, .. }) if reason.contains("read lock")),
        "{refused:?}"
    );
    read.release().await.unwrap();
    let permit = locks.semaphore("pool", 2).acquire().await.unwrap();
    let refused = permit
        .guarded_write::<()>(redis::cmd("SET").arg(permit.key_in_slot("x")).arg(1))
        .await;
    assert!(matches!(refused, Err(LockError::InvalidInput { .. })));
    permit.release().await.unwrap();
}

#[tokio::test]
async fn a_set_writes_only_while_it_holds_every_key() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-set");
    let locks = manager(&server, &prefix).await;
    let admin = manager(&server, &prefix).await;
    let set = locks.lock_all(["from", "to"]).acquire().await.unwrap();
    let from = set.key_in_slot("from", "balance").unwrap();
    let to = set.key_in_slot("to", "balance").unwrap();
    assert!(set.key_in_slot("elsewhere", "balance").is_err());
    let mut moved = redis::pipe();
    moved
        .cmd("DECRBY")
        .arg(&from)
        .arg(3)
        .cmd("INCRBY")
        .arg(&to)
        .arg(3);
    let (a, b): (i64, i64) = set.guarded_write(&moved).await.unwrap();
    assert_eq!((a, b), (-3, 3));

    assert!(admin.force_release("to").await.unwrap().is_some());
    let late = set.guarded_write::<(i64, i64)>(&moved).await;
    assert!(
        matches!(&late, Err(LockError::Lost { key, .. }) if key == "to"),
        "{late:?}"
    );
    let stored: Option<i64> = raw(&server).await.get(&from).await.unwrap();
    assert_eq!(
        stored,
        Some(-3),
        "the refused batch ran nothing, on any key"
    );
}

#[tokio::test]
async fn a_receipt_tells_whether_a_write_ran_and_withdraws_one_that_did_not() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-receipt");
    let locks = manager(&server, &prefix).await;
    let guard = locks.lock("acct").acquire().await.unwrap();
    let n = guard.key_in_slot("n");
    let mut batch = Batch::new();
    batch.command(redis::cmd("INCR").arg(&n)).receipt("op-1");
    let (one,): (i64,) = guard.guarded_write(&mut batch).await.unwrap();
    assert_eq!(one, 1);
    assert!(guard.receipt_landed("op-1").await.unwrap());
    // Sent again (a retry after a lost answer): refused, runs nothing.
    let again = guard.guarded_write::<(i64,)>(&mut batch).await;
    assert!(
        matches!(
            &again,
            Err(LockError::InvalidInput {
                what: "receipt",
                ..
            })
        ),
        "{again:?}"
    );

    // A batch that never reached the server: the question withdraws it for good.
    assert!(!guard.receipt_landed("op-2").await.unwrap());
    let mut late = Batch::new();
    late.command(redis::cmd("INCR").arg(&n)).receipt("op-2");
    assert!(guard.guarded_write::<(i64,)>(&mut late).await.is_err());
    assert!(!guard.receipt_landed("op-2").await.unwrap());
    let stored: i64 = raw(&server).await.get(&n).await.unwrap();
    assert_eq!(stored, 1);
    guard.release().await.unwrap();
}

#[tokio::test]
async fn bad_batches_are_refused_before_anything_is_sent() {
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("fencing-bad")).await;
    let guard = locks.lock("acct").acquire().await.unwrap();
    let mut batch = Batch::new();
    batch.command_with_keys(redis::cmd("SET").arg("k").arg(1), 3);
    let refused = guard.guarded_write::<()>(&mut batch).await;
    assert!(
        matches!(refused, Err(LockError::InvalidInput { .. })),
        "{refused:?}"
    );
    let mut unnamed = Batch::new();
    unnamed.command(&redis::Cmd::new());
    let refused = guard.guarded_write::<()>(&mut unnamed).await;
    assert!(
        matches!(refused, Err(LockError::InvalidInput { .. })),
        "{refused:?}"
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_batch_may_not_touch_the_locks_own_keys_nor_hide_its_keys() {
    let server = shared_server();
    let prefix = unique_prefix("fencing-own");
    let locks = manager(&server, &prefix).await;
    let guard = locks.lock("acct").acquire().await.unwrap();
    let lock = format!("{prefix}{{acct}}");
    // The lock itself, and its companions (a receipt, the fencing counter): refused.
    for key in [
        lock.clone(),
        format!("{lock}:r:forged"),
        format!("{lock}:f"),
    ] {
        let refused = guard
            .guarded_write::<()>(redis::cmd("PEXPIRE").arg(&key).arg(999_999))
            .await;
        assert!(
            matches!(&refused, Err(LockError::InvalidInput { reason, .. }) if reason.contains("own keys")),
            "{key}: {refused:?}"
        );
    }
    // A command whose keys sit among other arguments must say which they are.
    let (a, b) = (guard.key_in_slot("a"), guard.key_in_slot("b"));
    let refused = guard
        .guarded_write::<()>(redis::cmd("MSET").arg(&a).arg(1).arg(&b).arg(2))
        .await;
    assert!(
        matches!(&refused, Err(LockError::InvalidInput { reason, .. }) if reason.contains("command_with_keys")),
        "{refused:?}"
    );
    // One whose every argument is a key declares them all.
    let set: (String, String) = guard
        .guarded_write(redis::pipe().set(&a, 1).set(&b, 2))
        .await
        .unwrap();
    assert_eq!(set, ("OK".to_owned(), "OK".to_owned()));
    let deleted: (i64,) = guard
        .guarded_write(redis::cmd("DEL").arg(&a).arg(&b))
        .await
        .unwrap();
    assert_eq!(deleted, (2,));
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_writes_on_a_cluster_stay_in_the_locks_slot() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let old = support::cluster_manager(&nodes, "fc:").await;
    let new = support::cluster_manager(&nodes, "fc:").await;
    for i in 0..4 {
        assert_eq!(paused_holder(&old, &new, &format!("acct:{i}")).await, "new");
    }
    let guard = old.lock("acct:9").acquire().await.unwrap();
    let refused = guard
        .guarded_write::<()>(redis::cmd("SET").arg("fc:outside").arg(1))
        .await;
    assert!(
        matches!(&refused, Err(LockError::InvalidInput { reason, .. }) if reason.contains("key_in_slot")),
        "{refused:?}"
    );
    guard.release().await.unwrap();
}

#[tokio::test]
async fn guarded_writes_through_sentinel() {
    let group = support::SentinelGroup::start("fencing");
    group.wait_until_ready();
    let old = support::connect(support::quick(group.builder(), "fs:")).await;
    let new = support::connect(support::quick(group.builder(), "fs:")).await;
    assert_eq!(paused_holder(&old, &new, "acct").await, "new");
}

#[tokio::test]
async fn redlock_refuses_guarded_writes() {
    let masters = support::redlock_masters(3);
    let locks = support::redlock_manager(&masters, "fr:").await;
    let guard = locks.lock("acct").acquire().await.unwrap();
    let refused = guard
        .guarded_write::<()>(redis::cmd("SET").arg(guard.key_in_slot("v")).arg(1))
        .await;
    assert!(
        matches!(&refused, Err(LockError::InvalidInput { reason, .. }) if reason.contains("RedLock")),
        "{refused:?}"
    );
    guard.release().await.unwrap();
}

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
mod race;
