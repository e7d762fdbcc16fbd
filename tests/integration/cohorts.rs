//! Cohorts: a plain lock passes among one manager's own tasks with no server command, within
//! bounds, then goes back to Redis so that other processes get their turn.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::{connect, keys, manager, quick, raw, shared_server, single, unique_prefix};
use distlock::testing::RedisServer;
use distlock::{LockError, LockGuard, LockManager, LockRequest};
use redis::AsyncCommands;

/// A lease only a release ends within a test.
const LONG: Duration = Duration::from_secs(600);

/// Commands a lock's take, release or hand-off would run that the server ran since the last
/// `CONFIG RESETSTAT`, with its `SET`s apart (the manager's registration refresh may run one)
/// and its `GET`s apart (a cohort's run checks its hold with one).
fn lock_commands(server: &RedisServer) -> (u64, u64, u64) {
    let info = server.command(&["INFO", "commandstats"]).unwrap();
    let mut counts = (0, 0, 0);
    for (name, rest) in info
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| line.split_once(":calls="))
    {
        let calls: u64 = rest.split(',').next().unwrap().parse().unwrap();
        match name {
            "set" => counts.1 += calls,
            "get" => counts.2 += calls,
            "del" | "delifeq" | "delex" | "evalsha" | "eval" | "publish" | "pttl" | "exists"
            | "pexpire" => counts.0 += calls,
            _ => {}
        }
    }
    counts
}

/// Waits until `locks` has a task ready to take the lock as it is released.
async fn ready(locks: &LockManager) {
    let started = Instant::now();
    while locks.stats().ready_for_handoff == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no waiter got ready"
        );
        tokio::task::yield_now().await;
    }
}

/// A task of `locks` that waits for `key` (its timer alone would take an hour).
fn waiter(locks: &LockManager, key: &str, ttl: Duration) -> tokio::task::JoinHandle<LockGuard> {
    waiter_with(locks, key, ttl, |request| request)
}

/// The same, with more options on its request.
fn waiter_with(
    locks: &LockManager,
    key: &str,
    ttl: Duration,
    options: impl for<'m> FnOnce(LockRequest<'m>) -> LockRequest<'m> + Send + 'static,
) -> tokio::task::JoinHandle<LockGuard> {
    let (locks, key) = (locks.clone(), key.to_owned());
    tokio::spawn(async move {
        let request = locks
            .lock(key)
            .ttl(ttl)
            .retry_delay(Duration::from_secs(3600))
            .wait(Duration::from_secs(30));
        options(request).acquire().await.unwrap()
    })
}

#[tokio::test]
async fn a_local_pass_sends_no_server_command_and_shares_the_server_hold() {
    // Its own server: the command counts are server-wide.
    let server = RedisServer::start().unwrap();
    let locks = manager(&server, "c:").await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;

    server.command(&["CONFIG", "RESETSTAT"]).unwrap();
    let (token, remaining) = (first.token().to_owned(), first.remaining());
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    // No command of a lock's; at most the registration refresh's SET (every 3 s). The
    // release waited for the run's check (one GET), the pass did not.
    let (lock, set, get) = lock_commands(&server);
    let stats = server.command(&["INFO", "commandstats"]).unwrap();
    assert!(lock == 0 && set <= 1 && get == 1, "{stats}");
    assert_eq!(locks.stats().local_passes, 1);
    assert_eq!(second.local_passes(), 1);
    // The same server hold: its token and its lease.
    assert_eq!(second.token(), token);
    assert!(second.remaining() <= remaining);
    let mut conn = raw(&server).await;
    let owner: String = conn.get("c:{k}").await.unwrap();
    assert_eq!(owner, second.token());
    assert!(second.is_held().await.unwrap());
    // The inspector shows the server hold.
    let info = locks.inspect("k").await.unwrap().unwrap();
    assert_eq!(info.holders[0].token, token);
    second.release().await.unwrap();
    assert!(keys(&server, "c:").is_empty());
}

#[tokio::test]
async fn cohort_false_and_fencing_go_through_the_server() {
    let server = shared_server();
    let prefix = unique_prefix("no-cohort");
    let locks = manager(&server, &prefix).await;
    // The holder says no.
    let first = locks
        .lock("k")
        .ttl(LONG)
        .cohort(false)
        .acquire()
        .await
        .unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;
    let token = first.token().to_owned();
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 0);
    assert_ne!(second.token(), token);
    // The waiter says no.
    let waiting = waiter_with(&locks, "k", LONG, |request| request.cohort(false));
    ready(&locks).await;
    let token = second.token().to_owned();
    second.release().await.unwrap();
    let third = waiting.await.unwrap();
    assert_eq!(third.local_passes(), 0);
    assert_ne!(third.token(), token);
    third.release().await.unwrap();
    assert_eq!(locks.stats().local_passes, 0);

    // Fenced locks: every holder draws a larger token from the server.
    let mut last = 0;
    let inside = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (locks, inside) = (locks.clone(), inside.clone());
        tasks.push(tokio::spawn(async move {
            let mut fences = Vec::new();
            for _ in 0..10 {
                let guard = locks
                    .lock("fenced")
                    .fencing(true)
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                assert!(!inside.swap(true, Ordering::SeqCst));
                assert_eq!(guard.local_passes(), 0);
                fences.push((Instant::now(), guard.fencing_token().unwrap()));
                inside.store(false, Ordering::SeqCst);
                guard.release().await.unwrap();
            }
            fences
        }));
    }
    let mut fences = Vec::new();
    for task in tasks {
        fences.extend(task.await.unwrap());
    }
    fences.sort();
    for (_, fence) in fences {
        assert!(fence > last, "fencing tokens grow with every holder");
        last = fence;
    }
    assert_eq!(locks.stats().local_passes, 0);
}

#[tokio::test]
async fn a_lease_lost_during_a_run_is_lost_for_the_holder_it_reached() {
    let server = shared_server();
    let prefix = unique_prefix("lost-run");
    let locks = manager(&server, &prefix).await;
    let lease = Duration::from_millis(600);
    let first = locks.lock("k").ttl(lease).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", lease);
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    // Nobody renews the shared lease: it runs out for the holder that has it now.
    let lost = tokio::time::timeout(Duration::from_secs(5), second.lost())
        .await
        .expect("the shared lease runs out");
    assert!(matches!(lost, LockError::Lost { .. }), "{lost:?}");
    // The local deadline keeps a margin: the key ends on the server a moment later.
    let mut conn = raw(&server).await;
    let started = Instant::now();
    while conn
        .exists::<_, bool>(format!("{prefix}{{k}}"))
        .await
        .unwrap()
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the key never expired"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let released = second.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );
}

#[tokio::test]
async fn a_passed_lock_is_renewed_by_its_new_holders_watchdog() {
    let server = shared_server();
    let prefix = unique_prefix("renewed-run");
    let locks = manager(&server, &prefix).await;
    let lease = Duration::from_millis(300);
    let first = locks.lock("k").ttl(lease).acquire().await.unwrap();
    let waiting = waiter_with(&locks, "k", lease, |request| request.watchdog(true));
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    // Three leases long: only renewals keep it, at the lease the holder asked for.
    tokio::time::sleep(lease * 3).await;
    assert!(!second.is_lost());
    assert!(second.is_held().await.unwrap());
    let mut conn = raw(&server).await;
    let pttl: u64 = conn.pttl(format!("{prefix}{{k}}")).await.unwrap();
    assert!(
        pttl <= 300,
        "renewed to {pttl} ms, more than the 300 ms asked for"
    );
    second.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_waiter_that_asked_for_a_shorter_lease_gets_its_own_through_the_server() {
    let server = shared_server();
    let prefix = unique_prefix("short-lease");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", Duration::from_millis(300));
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    // Passed as it is, the lock would outlive this holder by ten minutes if it stopped.
    assert_eq!(second.local_passes(), 0);
    assert!(second.remaining() <= Duration::from_millis(300));
    second.release().await.unwrap();
}

#[tokio::test]
async fn shutdown_during_a_run_gives_the_lock_back() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown-run");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;
    first.release().await.unwrap();
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    locks.shutdown().await;
    assert!(matches!(second.lost().await, LockError::ShutDown));
    assert!(matches!(second.release().await, Err(LockError::ShutDown)));
    assert!(keys(&server, &prefix).is_empty());
}

/// The entries the shares of `runs_stop_at_their_bounds_and_every_manager_gets_its_turns`
/// are judged on, at least (an idle machine makes about 9,000 in its two seconds).
const ENOUGH_TURNS: u64 = 1_500;

/// Tasks of several managers take one hot lock in turn: nobody is ever inside with another,
/// runs stop at their bounds, and every manager gets a share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_stop_at_their_bounds_and_every_manager_gets_its_turns() {
    let server = shared_server();
    let prefix = unique_prefix("shares");
    let mut managers = Vec::new();
    for _ in 0..3 {
        let locks = LockManager::builder()
            .redis_url(server.url())
            .key_prefix(&prefix)
            .cohort(5, Duration::from_secs(1))
            .build()
            .await
            .unwrap();
        managers.push(locks);
    }
    let inside = Arc::new(AtomicBool::new(false));
    let longest = Arc::new(AtomicU32::new(0));
    let entries: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::new(AtomicU64::new(0))).collect();
    // Two seconds, and on until the shares rest on enough entries (a loaded machine may stall
    // the first seconds): a share is a claim about many turns, not a few.
    let (deadline, cap) = (
        Instant::now() + Duration::from_secs(2),
        Instant::now() + Duration::from_secs(20),
    );
    let total = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (at, locks) in managers.iter().enumerate() {
        for _ in 0..6 {
            let (locks, inside, longest, entries, total) = (
                locks.clone(),
                inside.clone(),
                longest.clone(),
                entries[at].clone(),
                total.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let more = || {
                    let now = Instant::now();
                    now < deadline || (now < cap && total.load(Ordering::SeqCst) < ENOUGH_TURNS)
                };
                while more() {
                    let guard = locks
                        .lock("hot")
                        .wait(Duration::from_secs(10))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    longest.fetch_max(guard.local_passes(), Ordering::SeqCst);
                    entries.fetch_add(1, Ordering::SeqCst);
                    total.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let counts: Vec<u64> = entries.iter().map(|e| e.load(Ordering::SeqCst)).collect();
    let passes: u64 = managers.iter().map(|m| m.stats().local_passes).sum();
    assert!(passes > 0, "no local pass in {counts:?}");
    assert!(
        longest.load(Ordering::SeqCst) <= 5,
        "a run went past its bound"
    );
    let total: u64 = counts.iter().sum();
    for count in &counts {
        assert!(
            *count * 10 >= total,
            "a manager had less than a tenth of the entries: {counts:?}"
        );
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// How a test takes a busy run's hold away.
#[derive(Debug, Clone, Copy)]
enum Steal {
    /// A plain `GETDEL` of the key from another connection: nothing is published.
    Del,
    /// Another manager's forced release (as `distlock release --force`), which wakes the
    /// waiters.
    Forced,
}

/// One holder's turn in `steal_during_a_busy_run`.
#[derive(Debug)]
struct Turn {
    entered: Instant,
    token: String,
    passes: u32,
    /// Held after the steal: `lost()` fired within a second (before it: whether it had).
    lost: bool,
    release_began: Instant,
    released: Result<(), LockError>,
}

/// How long past the steal's round trip a run may still pass a stolen hold on: its own round
/// trip to learn of it, on a machine that runs other tests meanwhile.
const STEAL_SLACK: Duration = Duration::from_millis(10);

/// A holder inside when its lock is taken away passes it on: its release answers `Lost`, and
/// the waiter it passed to sees `lost()` fire within a round trip, and its release answers
/// `Lost` too.
#[tokio::test]
async fn a_pass_after_a_steal_is_lost_for_its_holder() {
    let server = shared_server();
    let prefix = unique_prefix("pass-after-steal");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("k").ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&locks, "k", LONG);
    ready(&locks).await;
    // Its first look at the server behind it (the offer stands from before it).
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut conn = raw(&server).await;
    let deleted: i64 = conn.del(format!("{prefix}{{k}}")).await.unwrap();
    assert_eq!(deleted, 1);
    let released = first.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );
    let second = waiting.await.unwrap();
    assert_eq!(second.local_passes(), 1);
    let lost = tokio::time::timeout(Duration::from_secs(1), second.lost())
        .await
        .expect("lost() fires for a holder by a pass of a stolen hold");
    assert!(matches!(lost, LockError::Lost { .. }), "{lost:?}");
    let released = second.release().await;
    assert!(
        matches!(released, Err(LockError::Lost { .. })),
        "{released:?}"
    );
    // Nobody holds it: another task takes it from the server at once.
    let third = locks.lock("k").try_acquire().await.unwrap().unwrap();
    assert_eq!(third.local_passes(), 0);
    third.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

/// Tasks of one manager pass a hot lock around in a run that only a check can stop (its
/// bounds are far past the test), until the hold is taken away on the server.
async fn steal_during_a_busy_run(how: Steal) {
    let server = shared_server();
    let prefix = unique_prefix("steal-run");
    let builder = quick(single(server.url()), &prefix).cohort(1_000_000, Duration::from_secs(60));
    let locks = connect(builder).await;
    let other = manager(&server, &prefix).await;
    // When the steal was answered, and the token it took the lock from.
    let stolen: Arc<Mutex<Option<(Instant, String)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let turns: Arc<Mutex<Vec<Turn>>> = Arc::default();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (locks, stolen, stop, turns) =
            (locks.clone(), stolen.clone(), stop.clone(), turns.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let guard = locks
                    .lock("k")
                    .ttl(LONG)
                    .retry_delay(Duration::from_millis(10))
                    .wait(Duration::from_secs(10))
                    .acquire()
                    .await
                    .unwrap();
                let entered = Instant::now();
                let robbed = guard.local_passes() > 0
                    && stolen
                        .lock()
                        .unwrap()
                        .as_ref()
                        .is_some_and(|(at, token)| entered > *at && guard.token() == token);
                let lost = if robbed {
                    tokio::time::timeout(Duration::from_secs(1), guard.lost())
                        .await
                        .is_ok()
                } else {
                    tokio::task::yield_now().await;
                    guard.is_lost()
                };
                let (token, passes) = (guard.token().to_owned(), guard.local_passes());
                let release_began = Instant::now();
                let released = guard.release().await;
                turns.lock().unwrap().push(Turn {
                    entered,
                    token,
                    passes,
                    lost,
                    release_began,
                    released,
                });
            }
        }));
    }
    // A run going on: many passes of one server hold.
    let started = Instant::now();
    while locks.stats().local_passes < 500 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no run got going"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Taken away while some task holds it (between two runs, nobody does).
    let mut conn = raw(&server).await;
    let (token, sent, answered) = loop {
        assert!(started.elapsed() < Duration::from_secs(10), "never held");
        let sent = Instant::now();
        let token = match how {
            Steal::Del => redis::cmd("GETDEL")
                .arg(format!("{prefix}{{k}}"))
                .query_async::<Option<String>>(&mut conn)
                .await
                .unwrap(),
            // (A key whose holder went between the read and the DEL names none.)
            Steal::Forced => other
                .force_release("k")
                .await
                .unwrap()
                .and_then(|info| Some(info.holders.first()?.token.clone())),
        };
        if let Some(token) = token {
            break (token, sent, Instant::now());
        }
    };
    let round_trip = answered - sent;
    *stolen.lock().unwrap() = Some((answered, token.clone()));
    // Another manager gets the key.
    let theirs = other
        .lock("k")
        .ttl(LONG)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    let (theirs_from, got_it) = (Instant::now(), Instant::now() - answered);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let theirs_until = Instant::now();
    theirs.release().await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }

    let turns = std::mem::take(&mut *turns.lock().unwrap());
    let robbed: Vec<&Turn> = turns.iter().filter(|turn| turn.token == token).collect();
    let passed_after = robbed
        .iter()
        .filter(|turn| turn.passes > 0 && turn.entered > answered)
        .count();
    let summary = format!(
        "{how:?}: steal round trip {round_trip:?}, the other manager got the key {got_it:?} \
         after; {} turns, {} of the robbed hold, {passed_after} entered by a pass after the steal",
        turns.len(),
        robbed.len(),
    );
    println!("{summary}");
    // After the steal's round trip (and the check's), no pass of the robbed hold.
    let bound = answered + round_trip + STEAL_SLACK;
    for turn in &robbed {
        assert!(
            turn.passes == 0 || turn.entered <= bound,
            "{summary}: a pass of the robbed hold {:?} after the steal",
            turn.entered - answered
        );
    }
    // Its holders by a pass after the steal see lost() fire (a pass just before it, seen
    // entering after it, need not: `a_pass_after_a_steal_is_lost_for_its_holder`).
    let lost_after = robbed
        .iter()
        .filter(|turn| turn.passes > 0 && turn.entered > answered && turn.lost)
        .count();
    println!("{summary}; lost() fired for {lost_after}");
    for turn in robbed.iter().filter(|turn| turn.release_began > answered) {
        assert!(
            matches!(turn.released, Err(LockError::Lost { .. })),
            "{summary}: a release of the robbed hold answered {:?}",
            turn.released
        );
    }
    // Nobody of this manager was inside with the other manager.
    for turn in turns.iter().filter(|turn| turn.token != token) {
        assert!(
            turn.entered < theirs_from || turn.entered > theirs_until,
            "{summary}: entered {:?} while the other manager held the key",
            turn.entered - theirs_from
        );
    }
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_del_stops_a_run_within_a_round_trip() {
    steal_during_a_busy_run(Steal::Del).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_stops_a_run_within_a_round_trip() {
    steal_during_a_busy_run(Steal::Forced).await;
}
