//! Local hand-off: a release passes a plain lock straight to a task of the same manager that
//! waits for it, in the release's own round trip, and never leaves a lock behind when that
//! task gives up at the same moment.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};
use redis::AsyncCommands;

use crate::support::{keys, manager, raw, shared_server, take_soon, unique_prefix};

/// Far longer than any test: a lock with this lease is only ever freed by a release.
const LONG: Duration = Duration::from_secs(600);

/// Commands the server ran since the last `CONFIG RESETSTAT`, by name (those inside scripts
/// included; INFO, CONFIG and the waiter's unsubscribe as it leaves left out).
fn commands(server: &RedisServer) -> Vec<(String, u64)> {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| line.split_once(":calls="))
        .filter(|(name, _)| {
            !(name.starts_with("info") || name.starts_with("config") || name.contains("subscribe"))
        })
        .map(|(name, rest)| {
            let calls = rest.split(',').next().unwrap().parse().unwrap();
            (name.to_owned(), calls)
        })
        .collect()
}

fn calls(commands: &[(String, u64)], name: &str) -> u64 {
    commands
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, c)| c)
        .sum()
}

/// The seed of a randomized test: `DISTLOCK_HANDOFF_SEED` replays a printed one.
fn seed() -> u64 {
    std::env::var("DISTLOCK_HANDOFF_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Waits until `locks` has a task ready to take a hand-off.
async fn ready(locks: &LockManager) {
    ready_unless_done::<()>(locks, None).await;
}

/// Waits until `locks` has a task ready to take a hand-off, or `task` has ended.
async fn ready_unless_done<T>(locks: &LockManager, task: Option<&tokio::task::JoinHandle<T>>) {
    let started = std::time::Instant::now();
    while locks.stats().ready_for_handoff == 0 && !task.is_some_and(|t| t.is_finished()) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter never got ready"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_release_hands_the_lock_to_a_waiting_task_in_one_round_trip() {
    // Its own server: the command counts are server-wide.
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "h:").await;
    // Through the server: without `cohort(false)` the lock would pass with no command at all.
    let holder = locks
        .lock("k")
        .ttl(LONG)
        .cohort(false)
        .acquire()
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let locks = locks.clone();
        async move {
            locks
                .lock("k")
                .ttl(Duration::from_secs(30))
                .retry_delay(LONG)
                .retries(10)
                .acquire()
                .await
        }
    });
    ready(&locks).await;

    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    holder.release().await.unwrap();
    let guard = waiting.await.unwrap().unwrap();
    let ran = commands(&server);

    // The owner swap is the only write: no publish, no attempt (SET NX, PTTL) by the waiter.
    assert_eq!(calls(&ran, "publish"), 0, "{ran:?}");
    assert_eq!(calls(&ran, "pttl"), 0, "{ran:?}");
    assert_eq!(calls(&ran, "set"), 1, "{ran:?}");
    let total: u64 = ran.iter().map(|(_, c)| c).sum();
    assert!(
        total <= 3,
        "one round trip, at most a script around GET and SET: {ran:?}"
    );
    assert_eq!(locks.stats().local_handoffs, 1);

    // The new holder's guard is as good as one from an attempt of its own.
    let mut conn = raw(&server).await;
    let owner: String = conn.get("h:{k}").await.unwrap();
    assert_eq!(owner, guard.token());
    assert!(guard.is_held().await.unwrap());
    let pttl: u64 = conn.pttl("h:{k}").await.unwrap();
    assert!(pttl > 20_000, "the waiter's own lease: {pttl} ms");
    assert!(
        guard.remaining() <= Duration::from_millis(pttl + 1),
        "remaining {:?} must not outlast the server's {pttl} ms",
        guard.remaining()
    );
    guard.release().await.unwrap();
    assert!(keys(&server, "h:").is_empty());
}

#[tokio::test]
async fn a_waiter_cancelled_during_the_hand_off_leaves_no_lock_behind() {
    let server = shared_server();
    let prefix = unique_prefix("cancel");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let seed = seed();
    let mut rng = fastrand::Rng::with_seed(seed);
    for round in 0..40 {
        let holder = locks.lock("k").ttl(LONG).acquire().await.unwrap();
        let waiting = tokio::spawn({
            let locks = locks.clone();
            async move {
                locks
                    .lock("k")
                    .ttl(LONG)
                    .retry_delay(LONG)
                    .retries(10)
                    .acquire()
                    .await
            }
        });
        ready(&locks).await;
        // Cancel the waiter before, during or after the swap.
        let (release, cancel) = (rng.u32(0..4), rng.u32(0..4));
        let releasing = tokio::spawn(async move {
            for _ in 0..release {
                tokio::task::yield_now().await;
            }
            holder.release().await
        });
        for _ in 0..cancel {
            tokio::task::yield_now().await;
        }
        waiting.abort();
        releasing.await.unwrap().unwrap();
        // Either the waiter got the lock (and its guard was dropped with it) or not: the key
        // must come free either way, long before any lease.
        let _ = waiting.await;
        take_soon(
            &other,
            "k",
            &format!("round {round} (seed {seed}, {release}/{cancel} yields)"),
        )
        .await;
    }
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_wait_deadline_passing_mid_hand_off_leaves_no_lock_behind() {
    let server = shared_server();
    let prefix = unique_prefix("deadline");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let seed = seed();
    let mut rng = fastrand::Rng::with_seed(seed);
    let (mut got, mut missed) = (0, 0);
    for round in 0..30 {
        let holder = locks.lock("k").ttl(LONG).acquire().await.unwrap();
        let wait = Duration::from_micros(rng.u64(1_000..5_000));
        let waiting = tokio::spawn({
            let locks = locks.clone();
            async move {
                locks
                    .lock("k")
                    .ttl(LONG)
                    .retry_delay(LONG)
                    .wait(wait)
                    .acquire()
                    .await
            }
        });
        ready_unless_done(&locks, Some(&waiting)).await;
        tokio::time::sleep(Duration::from_micros(rng.u64(0..5_000))).await;
        holder.release().await.unwrap();
        match waiting.await.unwrap() {
            Ok(guard) => {
                got += 1;
                assert!(
                    guard.is_held().await.unwrap(),
                    "round {round} (seed {seed})"
                );
                guard.release().await.unwrap();
            }
            Err(LockError::Busy { .. }) => missed += 1,
            Err(other) => panic!("round {round} (seed {seed}): {other}"),
        }
        take_soon(&other, "k", &format!("round {round} (seed {seed})")).await;
    }
    assert_eq!(got + missed, 30);
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn hand_offs_stop_after_a_few_so_every_process_gets_its_turn() {
    // A server of its own, and enough entries that a passing stall of one process (the other
    // tests of this file run beside it) weighs little on the shares.
    let server = RedisServer::start().unwrap();
    let prefix = unique_prefix("bound");
    let managers = [
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
        manager(&server, &prefix).await,
    ];
    let inside = Arc::new(AtomicBool::new(false));
    let entries: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for (m, locks) in managers.iter().enumerate() {
        for _ in 0..7 {
            let (locks, inside, entries, stop) =
                (locks.clone(), inside.clone(), entries.clone(), stop.clone());
            tasks.spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    // Through the server: runs of local passes have their own bounds
                    // (tests/integration/cohorts.rs).
                    let guard = locks
                        .lock("hot")
                        .ttl(Duration::from_secs(5))
                        .wait(Duration::from_secs(30))
                        .cohort(false)
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    entries[m].fetch_add(1, Ordering::SeqCst);
                    let total: u64 = entries.iter().map(|e| e.load(Ordering::SeqCst)).sum();
                    if total >= 3_000 {
                        stop.store(true, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let counts = entries.each_ref().map(|e| e.load(Ordering::SeqCst));
    let total: u64 = counts.iter().sum();
    for count in counts {
        // A third each, give or take a quarter of a third.
        assert!(
            count * 4 >= total && count * 12 <= total * 5,
            "each manager's share is within 25 % of a third: {counts:?}"
        );
    }
    let handed: u64 = managers.iter().map(|m| m.stats().local_handoffs).sum();
    assert!(
        handed * 2 >= total,
        "most entries were hand-offs: {handed} of {total}"
    );
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_handed_lock_is_renewed_and_nests_like_any_other() {
    let server = shared_server();
    let prefix = unique_prefix("renewed");
    let locks = manager(&server, &prefix).await;
    let holder = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = tokio::spawn({
        let locks = locks.clone();
        async move {
            distlock::scope(async {
                let guard = locks
                    .lock("k")
                    .ttl(Duration::from_millis(900))
                    .watchdog(true)
                    .reentrant(true)
                    .retry_delay(LONG)
                    .retries(10)
                    .acquire()
                    .await
                    .unwrap();
                // Inside the handed hold: counted here, nothing asked of the server.
                let nested = locks.lock("k").reentrant(true).acquire().await.unwrap();
                (guard, nested)
            })
            .await
        }
    });
    ready(&locks).await;
    holder.release().await.unwrap();
    let (guard, nested) = waiting.await.unwrap();
    assert_eq!(locks.stats().local_handoffs, 1);
    // Three leases long: only renewals keep it (leases of 900 ms, so that a renewal made late
    // by a busy machine still comes in time).
    tokio::time::sleep(Duration::from_millis(2_700)).await;
    assert!(guard.is_held().await.unwrap());
    assert!(!guard.is_lost());
    drop(nested);
    guard.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn the_next_waiter_is_not_stalled_by_a_handed_lock_whose_holder_vanished() {
    let server = shared_server();
    let prefix = unique_prefix("vanished");
    let locks = manager(&server, &prefix).await;
    let holder = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let first = tokio::spawn({
        let locks = locks.clone();
        async move {
            let guard = locks
                .lock("k")
                .ttl(Duration::from_millis(300))
                .retry_delay(LONG)
                .retries(10)
                .acquire()
                .await
                .unwrap();
            // A holder that never releases, as a stuck task would: only its lease ends it.
            std::mem::forget(guard);
        }
    });
    ready(&locks).await;
    let second = tokio::spawn({
        let locks = locks.clone();
        async move {
            // Its timer alone would wake it after hours; the vanished holder's lease must not
            // make it wait that long.
            locks
                .lock("k")
                .retry_delay(LONG)
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    holder.release().await.unwrap();
    first.await.unwrap();
    let guard = second.await.unwrap().unwrap();
    assert!(
        guard.waited() < Duration::from_secs(5),
        "{:?}",
        guard.waited()
    );
    guard.release().await.unwrap();
    assert_eq!(locks.stats().local_handoffs, 1);
}

/// A holder whose lock was taken away (here deleted, then taken by another manager) hands
/// nothing over: the hand-off's owner check finds another owner, the release reports the
/// lease lost, and the lock stays with its new owner instead of going to the robbed holder's
/// waiting sibling as well.
#[tokio::test]
async fn a_robbed_holder_hands_nothing_over() {
    let server = shared_server();
    let prefix = unique_prefix("h-robbed");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let holder = locks
        .lock("k")
        .ttl(LONG)
        .cohort(false)
        .acquire()
        .await
        .unwrap();
    let sibling = locks.clone();
    let waiting = tokio::spawn(async move {
        // Its timer never fires within the test: only a hand-off or a release lets it in.
        sibling
            .lock("k")
            .ttl(LONG)
            .cohort(false)
            .retry_delay(LONG)
            .wait(LONG)
            .acquire()
            .await
    });
    // Its first attempt and the look again once queued have been answered (busy): from
    // here on it only waits, ready for a hand-off.
    let started = std::time::Instant::now();
    while locks.stats().attempts < 3 || locks.stats().ready_for_handoff == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            locks.stats()
        );
        tokio::task::yield_now().await;
    }
    // The lock is taken away from the holder and taken by another owner.
    let key = locks.redis_key("k");
    let _: () = raw(&server).await.del(&key).await.unwrap();
    let thief = other.lock("k").ttl(LONG).try_acquire().await.unwrap();
    let thief = thief.expect("the deleted lock is free");
    assert!(matches!(
        holder.release().await,
        Err(LockError::Lost { .. })
    ));
    let owner: String = raw(&server).await.get(&key).await.unwrap();
    assert_eq!(
        owner,
        thief.token(),
        "the lock went to the robbed holder's sibling"
    );
    assert!(thief.is_held().await.unwrap());
    assert!(!waiting.is_finished());
    thief.release().await.unwrap();
    let sibling = waiting.await.unwrap().unwrap();
    sibling.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}
