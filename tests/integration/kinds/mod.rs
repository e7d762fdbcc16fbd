//! One key used through several lock kinds, against a real redis-server: only readers
//! together and permits up to N overlap; everything else waits, and no kind's request or
//! release ever frees the key for another kind's owner.

use std::time::Duration;

use distlock::{LockError, LockGuard, LockManager, LockRequest};
use redis::AsyncCommands;

use crate::support::{keys, manager, raw, shared_server, unique_prefix};

mod nesting;

/// A `min_hold` window long enough for a handful of attempts inside it, on a loaded machine.
const MIN_HOLD: Duration = Duration::from_secs(1);

/// The lock kinds a key can be used through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Exclusive,
    Read,
    Write,
    Permit(u32),
}

use Kind::{Exclusive, Permit, Read, Write};

fn request<'m>(locks: &'m LockManager, kind: Kind, key: &str) -> LockRequest<'m> {
    let request = match kind {
        Exclusive => locks.lock(key),
        Read => locks.read_lock(key),
        Write => locks.write_lock(key),
        Permit(n) => locks.semaphore(key, n),
    };
    request.ttl(Duration::from_secs(30))
}

/// One attempt by a new owner; a refusal is `None`, never an error.
async fn try_take(locks: &LockManager, kind: Kind, key: &str) -> Option<LockGuard> {
    request(locks, kind, key)
        .try_acquire()
        .await
        .unwrap_or_else(|e| panic!("{kind:?} on `{key}`: {e}"))
}

/// `first` is held; a `second` owner is refused, and its attempt (and the release that
/// would follow a wrong grant) leaves `first` the only holder: an exclusive lock still
/// stays out. Once `first` is released, `second` gets the key at once.
async fn excludes(first: Kind, second: Kind, test: &str) {
    let server = shared_server();
    let prefix = unique_prefix(test);
    let locks = manager(&server, &prefix).await;
    let held = try_take(&locks, first, "k").await.expect("the key is free");

    let granted = try_take(&locks, second, "k").await;
    let wrongly_granted = granted.is_some();
    if let Some(guard) = granted {
        let _ = guard.release().await;
    }
    assert!(
        held.is_held().await.unwrap(),
        "{first:?} holder lost the key"
    );
    let intruder = try_take(&locks, Exclusive, "k").await;
    assert!(
        intruder.is_none(),
        "an exclusive lock was granted while a {first:?} holder was inside \
         (after a {second:?} attempt)"
    );
    assert!(
        !wrongly_granted,
        "{second:?} was granted while {first:?} was held"
    );

    held.release().await.unwrap();
    let after = try_take(&locks, second, "k").await;
    after.expect("free once released").release().await.unwrap();
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

macro_rules! excludes {
    ($($name:ident: $first:expr => $second:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            excludes($first, $second, stringify!($name)).await;
        }
    )*};
}

excludes! {
    exclusive_keeps_out_exclusive: Exclusive => Exclusive;
    exclusive_keeps_out_read: Exclusive => Read;
    exclusive_keeps_out_write: Exclusive => Write;
    exclusive_keeps_out_permit: Exclusive => Permit(3);
    write_keeps_out_exclusive: Write => Exclusive;
    write_keeps_out_read: Write => Read;
    write_keeps_out_write: Write => Write;
    write_keeps_out_permit: Write => Permit(3);
    read_keeps_out_exclusive: Read => Exclusive;
    read_keeps_out_write: Read => Write;
    read_keeps_out_permit: Read => Permit(3);
    permit_keeps_out_exclusive: Permit(3) => Exclusive;
    permit_keeps_out_write: Permit(3) => Write;
    permit_keeps_out_read: Permit(3) => Read;
}

#[tokio::test]
async fn readers_overlap_and_permits_overlap_up_to_n() {
    let server = shared_server();
    let prefix = unique_prefix("overlap");
    let locks = manager(&server, &prefix).await;
    let first = try_take(&locks, Read, "doc").await.expect("free");
    let second = try_take(&locks, Read, "doc")
        .await
        .expect("readers overlap");
    assert!(try_take(&locks, Exclusive, "doc").await.is_none());
    first.release().await.unwrap();
    second.release().await.unwrap();

    let mut permits = Vec::new();
    for _ in 0..2 {
        permits.push(try_take(&locks, Permit(2), "pool").await.expect("a permit"));
    }
    assert!(
        try_take(&locks, Permit(2), "pool").await.is_none(),
        "only 2"
    );
    for permit in permits {
        permit.release().await.unwrap();
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// After a `first` holder with `min_hold` releases, the key is kept by nobody: every kind
/// stays out (and an attempt does not remove the marker for the next one) until the window
/// ends.
async fn marker_keeps_every_kind_out(first: Kind, test: &str) {
    let server = shared_server();
    let prefix = unique_prefix(test);
    let locks = manager(&server, &prefix).await;
    let job = request(&locks, first, "nightly")
        .min_hold(MIN_HOLD)
        .acquire()
        .await
        .unwrap();
    job.release().await.unwrap();

    let mut granted = Vec::new();
    for kind in [Read, Permit(3), Write, Exclusive, Read] {
        if let Some(guard) = try_take(&locks, kind, "nightly").await {
            granted.push(kind);
            let _ = guard.release().await;
        }
    }
    assert!(granted.is_empty(), "granted within min_hold: {granted:?}");

    // The window ends by itself; then the key is free for anyone.
    let next = request(&locks, Write, "nightly")
        .wait(Duration::from_secs(10))
        .retry_delay(Duration::from_millis(20))
        .acquire()
        .await
        .unwrap();
    next.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn the_min_hold_of_a_writer_keeps_every_kind_out() {
    marker_keeps_every_kind_out(Write, "markerw").await;
}

#[tokio::test]
async fn the_min_hold_of_an_exclusive_lock_keeps_every_kind_out() {
    marker_keeps_every_kind_out(Exclusive, "markerx").await;
}

#[tokio::test]
async fn a_semaphore_in_use_rejects_another_permit_count() {
    let server = shared_server();
    let prefix = unique_prefix("permitsn");
    let locks = manager(&server, &prefix).await;
    let only = try_take(&locks, Permit(1), "pool").await.expect("free");

    // Asked with a higher count: an error at once, neither busy nor retried.
    let more = locks
        .semaphore("pool", 3)
        .wait(Duration::from_secs(10))
        .acquire()
        .await;
    match more {
        Err(LockError::PermitsMismatch {
            ref key,
            stored,
            requested,
            ..
        }) => {
            assert_eq!((key.as_str(), stored, requested), ("pool", 1, 3));
        }
        other => panic!("expected a permits mismatch, got {other:?}"),
    }
    let error = more.unwrap_err();
    assert!(!error.is_busy());
    assert_eq!(error.key(), Some("pool"));
    assert!(error.to_string().contains("same `permits`"), "{error}");
    let tried = locks.semaphore("pool", 3).try_acquire().await;
    assert!(
        matches!(tried, Err(LockError::PermitsMismatch { stored: 1, .. })),
        "{tried:?}"
    );
    // The count the key is in use with still holds: one holder.
    assert!(try_take(&locks, Permit(1), "pool").await.is_none());
    assert!(only.is_held().await.unwrap());

    // Free again: another count may be used.
    only.release().await.unwrap();
    let mut three = Vec::new();
    for _ in 0..3 {
        three.push(
            try_take(&locks, Permit(3), "pool")
                .await
                .expect("3 permits"),
        );
    }
    assert!(try_take(&locks, Permit(3), "pool").await.is_none());
    assert!(matches!(
        locks.semaphore("pool", 1).try_acquire().await,
        Err(LockError::PermitsMismatch {
            stored: 3,
            requested: 1,
            ..
        })
    ));
    for permit in three {
        permit.release().await.unwrap();
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// A share whose holder died (its lease key ended) does not keep other kinds out, nor the
/// key's permit count, for the rest of the longest lease the lock ever had.
#[tokio::test]
async fn dead_shares_do_not_keep_other_kinds_out() {
    let server = shared_server();
    let prefix = unique_prefix("deadshares");
    let locks = manager(&server, &prefix).await;
    for first in [Read, Permit(2)] {
        let long = request(&locks, first, "k")
            .ttl(Duration::from_secs(60))
            .acquire()
            .await
            .unwrap();
        // A holder that dies: short lease, never released.
        std::mem::forget(
            request(&locks, first, "k")
                .ttl(Duration::from_millis(300))
                .acquire()
                .await
                .unwrap(),
        );
        // The lock itself keeps the long lease after the long holder leaves.
        long.release().await.unwrap();
        let exclusive = locks
            .lock("k")
            .wait(Duration::from_secs(10))
            .retry_delay(Duration::from_millis(20))
            .acquire()
            .await
            .unwrap_or_else(|e| panic!("after a dead {first:?}: {e}"));
        exclusive.release().await.unwrap();
    }

    // A dead permit holder alone: once its lease has ended the key is free, so another
    // count may be used although the lock hash has not expired yet.
    let long = request(&locks, Permit(2), "pool")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let dying = request(&locks, Permit(2), "pool")
        .ttl(Duration::from_millis(300))
        .acquire()
        .await
        .unwrap();
    long.release().await.unwrap();
    dying.lost().await;
    // The local deadline comes a drift margin before the server's.
    while dying.is_held().await.unwrap() {
        tokio::task::yield_now().await;
    }
    std::mem::forget(dying);
    let other_count = try_take(&locks, Permit(5), "pool").await;
    other_count
        .expect("every permit holder is gone")
        .release()
        .await
        .unwrap();
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

/// A key of another type at the lock's name (a foreign value, or a lock written by a plain
/// `SET … NX PX`) is busy for every kind, never an error, and nothing touches it.
#[tokio::test]
async fn a_key_of_another_form_is_busy_for_every_kind() {
    let server = shared_server();
    let prefix = unique_prefix("foreign");
    let locks = manager(&server, &prefix).await;
    let name = format!("{prefix}{{k}}");
    let mut conn = raw(&server).await;
    let _: () = redis::cmd("SET")
        .arg(&name)
        .arg("someone")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .unwrap();
    for kind in [Exclusive, Read, Write, Permit(2)] {
        let attempt = request(&locks, kind, "k").try_acquire().await;
        assert!(matches!(attempt, Ok(None)), "{kind:?}: {attempt:?}");
    }
    let value: String = conn.get(&name).await.unwrap();
    assert_eq!(value, "someone");
    let _: () = conn.del(&name).await.unwrap();
}

/// A reader whose lease ended and whose key was then taken exclusively learns that it lost
/// the share; its release leaves the new holder alone.
#[tokio::test]
async fn a_stale_share_release_leaves_the_next_kind_alone() {
    let server = shared_server();
    let prefix = unique_prefix("stale");
    let locks = manager(&server, &prefix).await;
    for first in [Read, Permit(2)] {
        let stale = request(&locks, first, "k")
            .ttl(Duration::from_millis(200))
            .acquire()
            .await
            .unwrap();
        let next = locks
            .lock("k")
            .wait(Duration::from_secs(10))
            .retry_delay(Duration::from_millis(20))
            .acquire()
            .await
            .unwrap();
        assert!(matches!(stale.release().await, Err(LockError::Lost { .. })));
        assert!(next.is_held().await.unwrap());
        assert!(try_take(&locks, Exclusive, "k").await.is_none());
        next.release().await.unwrap();
    }
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_free_permit_is_not_queued_behind_a_local_waiter_for_another_kind() {
    let server = shared_server();
    let prefix = unique_prefix("permitq");
    let locks = manager(&server, &prefix).await;
    let first = locks
        .semaphore("k", 2)
        .try_acquire()
        .await
        .unwrap()
        .unwrap();
    // An exclusive request of the same manager waits for the permit holder.
    let waiter = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .lock("k")
                .wait(Duration::from_secs(10))
                .acquire()
                .await
                .map(drop)
        })
    };
    while locks.stats().waiting_keys == 0 {
        tokio::task::yield_now().await;
    }
    // The second permit is free: taking it does not wait behind the exclusive waiter (which
    // waits for the first permit, which may be released only once this one is taken).
    let second = locks
        .semaphore("k", 2)
        .wait(Duration::from_secs(2))
        .acquire()
        .await
        .expect("a free permit is granted");
    assert_eq!(second.attempts(), 1);
    second.release().await.unwrap();
    first.release().await.unwrap();
    waiter.await.unwrap().unwrap();
}

#[tokio::test]
async fn asking_for_a_permit_while_holding_every_permit_is_a_self_deadlock() {
    let server = shared_server();
    let prefix = unique_prefix("permitself");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let only = locks.semaphore("one", 1).acquire().await.unwrap();
        let again = locks
            .semaphore("one", 1)
            .wait(Duration::from_secs(30))
            .acquire()
            .await;
        assert!(
            matches!(again, Err(LockError::WouldDeadlock { .. })),
            "{again:?}"
        );
        // With permits to spare, a second permit is another holder.
        let a = locks.semaphore("two", 2).acquire().await.unwrap();
        let b = locks.semaphore("two", 2).acquire().await.unwrap();
        assert_ne!(a.token(), b.token());
        let c = locks
            .semaphore("two", 2)
            .wait(Duration::from_secs(30))
            .acquire()
            .await;
        assert!(matches!(c, Err(LockError::WouldDeadlock { .. })), "{c:?}");
        for guard in [only, a, b] {
            guard.release().await.unwrap();
        }
    })
    .await;
}

/// A forced release removes exactly the holders it reports, while holders of every kind
/// come and go around it: each reported holder's release answers `Lost`, and no other
/// holder's does (a read followed by a separate delete would report one holder and remove
/// the next).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_removes_exactly_the_holders_it_reports() {
    let server = shared_server();
    for (label, kind, fencing) in [
        ("plain", Exclusive, false),
        ("fenced", Exclusive, true),
        ("write", Write, false),
        ("read", Read, false),
        ("permit", Permit(2), false),
    ] {
        let prefix = unique_prefix(&format!("forced-{label}"));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut churn = Vec::new();
        // One task per manager: every change of holder goes through the server.
        for _ in 0..3 {
            let locks = manager(&server, &prefix).await;
            let stop = stop.clone();
            churn.push(tokio::spawn(async move {
                let mut released = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let guard = request(&locks, kind, "k")
                        .fencing(fencing)
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                        .unwrap_or_else(|e| panic!("{label}: {e}"));
                    tokio::task::yield_now().await;
                    let token = guard.token().to_owned();
                    let answer = guard.release().await;
                    assert!(
                        matches!(answer, Ok(()) | Err(LockError::Lost { .. })),
                        "{label}: {answer:?}"
                    );
                    released.push((token, answer.is_err()));
                }
                released
            }));
        }
        let forcing = manager(&server, &prefix).await;
        let mut reported = std::collections::BTreeSet::new();
        for _ in 0..60 {
            if let Some(info) = forcing.force_release("k").await.unwrap() {
                reported.extend(info.holders.into_iter().map(|holder| holder.token));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut lost = std::collections::BTreeSet::new();
        let mut holds = 0;
        for task in churn {
            for (token, was_lost) in task.await.unwrap() {
                holds += 1;
                if was_lost {
                    lost.insert(token);
                }
            }
        }
        assert!(!reported.is_empty(), "{label}: never found a holder");
        let unreported: Vec<_> = lost.difference(&reported).collect();
        let kept: Vec<_> = reported.difference(&lost).collect();
        assert!(
            unreported.is_empty() && kept.is_empty(),
            "{label}, of {holds} holds: lost but not reported {unreported:?}; reported but \
             released {kept:?}"
        );
        // Nothing is left but the fencing counter, which a forced release keeps.
        let left = keys(&server, &prefix);
        assert!(
            left.iter().all(|key| key.ends_with(":fence")),
            "{label}: {left:?}"
        );
    }
}

/// A forced release made on the holders an operator confirmed removes the lock only while
/// those are its holders: a lock that changed hands meanwhile stays with its new holder, and
/// is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_forced_release_leaves_a_lock_that_changed_hands() {
    use distlock::inspect::ForcedRelease;
    let server = shared_server();
    let prefix = unique_prefix("forced-confirmed");
    let locks = manager(&server, &prefix).await;
    let forcing = manager(&server, &prefix).await;
    for kind in [Exclusive, Write, Read, Permit(2)] {
        let key = format!("{kind:?}");
        let first = request(&locks, kind, &key).acquire().await.unwrap();
        let shown = forcing.inspect(&key).await.unwrap().unwrap();
        let confirmed: Vec<&str> = shown.holders.iter().map(|h| h.token.as_str()).collect();
        assert_eq!(confirmed, [first.token()], "{kind:?}");
        // The holder leaves and another takes the lock before the operator says yes.
        first.release().await.unwrap();
        let second = request(&locks, kind, &key).acquire().await.unwrap();
        match forcing
            .force_release_if_held_by(&key, &confirmed)
            .await
            .unwrap()
        {
            ForcedRelease::Changed(now) => {
                let tokens: Vec<&str> = now.holders.iter().map(|h| h.token.as_str()).collect();
                assert_eq!(tokens, [second.token()], "{kind:?}");
            }
            other => panic!("{kind:?}: {other:?}"),
        }
        assert!(
            second.is_held().await.unwrap(),
            "{kind:?}: the new holder kept it"
        );
        // Confirmed on the holders it has, it goes.
        match forcing
            .force_release_if_held_by(&key, &[second.token()])
            .await
            .unwrap()
        {
            ForcedRelease::Removed(gone) => assert_eq!(gone.holders.len(), 1, "{kind:?}"),
            other => panic!("{kind:?}: {other:?}"),
        }
        let token = second.token().to_owned();
        assert!(
            matches!(second.release().await, Err(LockError::Lost { .. })),
            "{kind:?}"
        );
        let free = forcing
            .force_release_if_held_by(&key, &[token.as_str()])
            .await
            .unwrap();
        assert_eq!(free, ForcedRelease::Free, "{kind:?}");
    }
    assert!(keys(&server, &prefix).is_empty());
}
