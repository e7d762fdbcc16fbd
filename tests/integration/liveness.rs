//! Liveness at the seams between processes: a lock that is free in Redis never stays untaken
//! while another process's waiter sleeps. Other processes are told to stand aside only for a
//! hand-off that landed; a release whose local taker cannot or will not take the lock is a
//! release to everyone, with its wake-up.
//!
//! Each test has a waiter of manager B (as another process) whose fallback timer would fire
//! in a day: only the release's wake-up can let it in within the test's bound.

use std::time::Duration;

use distlock::testing::RedisServer;
use distlock::{LockError, LockGuard, LockManager, LockRequest};

use crate::support::{keys, manager, shared_server, unique_prefix};

/// Far longer than any test: a waiter that sleeps this long was not woken.
const NEVER: Duration = Duration::from_secs(24 * 3600);
/// A lease only a release ends within the test.
const LONG: Duration = Duration::from_secs(600);
/// How long a woken waiter may take to get in (a loaded machine included).
const SOON: Duration = Duration::from_secs(10);

/// Waits until the server has a subscriber on `channel`.
async fn subscribed(server: &RedisServer, channel: &str) {
    let started = std::time::Instant::now();
    loop {
        let reply = server
            .command(&["PUBSUB", "NUMSUB", channel])
            .unwrap_or_default();
        if reply.lines().nth(1).is_some_and(|n| n.trim() != "0") {
            return;
        }
        assert!(
            started.elapsed() < SOON,
            "nobody subscribed to {channel}: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until the server has answered `attempts` acquire attempts of `locks`: a waiter that
/// asked, queued, followed the wake channel and asked again (two answers) now sleeps until a
/// wake-up or its timer.
async fn asleep(locks: &LockManager, attempts: u64) {
    let started = std::time::Instant::now();
    while locks.stats().attempts < attempts {
        assert!(started.elapsed() < SOON, "the waiter never asked twice");
        tokio::task::yield_now().await;
    }
}

/// Waits until `locks` has a request queued for `key` (the head of its local queue, or one
/// behind it).
async fn queued(locks: &LockManager) {
    let started = std::time::Instant::now();
    while locks.stats().waiting_keys == 0 {
        assert!(started.elapsed() < SOON, "the local waiter never queued");
        tokio::task::yield_now().await;
    }
}

/// Waits until `locks` has a waiter ready to take a hand-off.
async fn ready_for_handoff(locks: &LockManager) {
    let started = std::time::Instant::now();
    while locks.stats().ready_for_handoff == 0 {
        assert!(started.elapsed() < SOON, "the local waiter never got ready");
        tokio::task::yield_now().await;
    }
}

/// A request waiting in its own task.
type Waiting = tokio::task::JoinHandle<Result<LockGuard, LockError>>;

/// A task of `locks` waiting for what `request` asks (with its own options: kind, fencing, a
/// `wait`), with a lease only a release ends and a fallback timer that would fire in a day:
/// only a wake-up gets it in soon.
fn waiter(
    locks: &LockManager,
    request: impl for<'m> FnOnce(&'m LockManager) -> LockRequest<'m> + Send + 'static,
) -> Waiting {
    let locks = locks.clone();
    tokio::spawn(async move {
        request(&locks)
            .ttl(LONG)
            .retry_delay(NEVER)
            .retries(5)
            .acquire()
            .await
    })
}

/// A waiter of `locks` for the exclusive lock `key` that only a wake-up gets in soon.
fn other_process_waits(locks: &LockManager, key: &'static str) -> Waiting {
    waiter(locks, move |locks| locks.lock(key))
}

/// B's waiter gets the lock within `SOON`: it was woken.
async fn gets_in(waiting: Waiting, what: &str) -> LockGuard {
    match tokio::time::timeout(SOON, waiting).await {
        Ok(joined) => joined.unwrap().unwrap(),
        Err(_) => panic!("{what}: the lock was free, and the other process's waiter slept on"),
    }
}

/// Two managers on a fresh prefix of the shared server: A (`here`) and B (`there`).
async fn two_processes(
    test: &str,
) -> (
    std::sync::Arc<RedisServer>,
    String,
    LockManager,
    LockManager,
) {
    let server = shared_server();
    let prefix = unique_prefix(test);
    let here = manager(&server, &prefix).await;
    let there = manager(&server, &prefix).await;
    (server, prefix, here, there)
}

#[tokio::test]
async fn a_local_waiter_cancelled_as_the_lock_is_released_leaves_it_to_everyone() {
    let (server, prefix, here, there) = two_processes("cancelled").await;
    let held = here.lock("k").ttl(LONG).acquire().await.unwrap();
    let b = other_process_waits(&there, "k");
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    // A's own waiter for the same plain lock, ready to take a hand-off.
    let local = waiter(&here, |locks| locks.lock("k"));
    ready_for_handoff(&here).await;
    held.release().await.unwrap();
    // This single-threaded runtime runs nothing else between the release's answer and the
    // abort: the local waiter never takes what was handed to it.
    local.abort();
    if let Ok(Ok(guard)) = local.await {
        guard.release().await.unwrap();
    }
    let guard = gets_in(b, "a local waiter cancelled at the hand-off").await;
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_local_waiter_that_cannot_take_a_hand_off_and_is_cancelled_leaves_it_to_everyone() {
    let (server, prefix, here, there) = two_processes("no-offer").await;
    let held = here.lock("k").ttl(LONG).acquire().await.unwrap();
    let b = other_process_waits(&there, "k");
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    // A's own waiter wants a fencing token, which only the script gives: no hand-off.
    let local = waiter(&here, |locks| locks.lock("k").fencing(true));
    // Its own acquisition of the held lock, then this waiter's two looks.
    asleep(&here, 3).await;
    held.release().await.unwrap();
    // This single-threaded runtime runs nothing else between the release's answer and the
    // abort: the local waiter never takes its turn.
    local.abort();
    // Woken by the release's own publish (heard on the manager's runtime), it may have
    // taken the lock first: then it gives it back.
    if let Ok(Ok(guard)) = local.await {
        guard.release().await.unwrap();
    }
    let guard = gets_in(b, "a local waiter without an offer, cancelled").await;
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_local_waiter_whose_wait_runs_out_at_the_release_leaves_it_to_everyone() {
    let (server, prefix, here, there) = two_processes("ran-out").await;
    let held = here.lock("k").ttl(LONG).acquire().await.unwrap();
    let b = other_process_waits(&there, "k");
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    // A's own waiter (a reader: it takes no hand-off) gives up at its deadline, which the
    // release below meets: the release is answered, then the deadline passes before the
    // waiter runs again.
    let wait = Duration::from_millis(300);
    let local = {
        let here = here.clone();
        tokio::spawn(async move {
            here.read_lock("k")
                .retry_delay(NEVER)
                .wait(wait)
                .acquire()
                .await
        })
    };
    queued(&here).await;
    let started = std::time::Instant::now();
    tokio::time::sleep(wait - Duration::from_millis(20)).await;
    held.release().await.unwrap();
    // Block this thread (the runtime's only one) past the waiter's deadline.
    std::thread::sleep(
        (started + wait + Duration::from_millis(30))
            .saturating_duration_since(std::time::Instant::now()),
    );
    // Woken by the release's own publish (heard on the manager's runtime), the reader may
    // have got in before its deadline: then it gives the lock back.
    if let Ok(read) = local.await.unwrap() {
        read.release().await.unwrap();
    }
    let guard = gets_in(b, "a local waiter whose wait ran out").await;
    guard.release().await.unwrap();
}

/// A's holder releases while A's next local waiter is a reader that B's waiting writer keeps
/// out (its write intent): the reader cannot take the lock, so the release is to everyone.
async fn reader_kept_out_by_another_process_writer(holder_kind: &str) {
    let (server, prefix, here, there) = two_processes(holder_kind).await;
    let held = match holder_kind {
        "write" => here.write_lock("k").ttl(LONG).acquire().await.unwrap(),
        _ => here.lock("k").ttl(LONG).acquire().await.unwrap(),
    };
    let writer = waiter(&there, |locks| locks.write_lock("k"));
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    let intent = format!("{prefix}{{k}}:wi");
    let started = std::time::Instant::now();
    while server.command(&["EXISTS", &intent]).unwrap().trim() != ":1" {
        assert!(started.elapsed() < SOON, "the writer left no intent");
        tokio::task::yield_now().await;
    }
    let reader = waiter(&here, |locks| locks.read_lock("k"));
    // The holder's acquisition, then the reader's two looks.
    asleep(&here, 3).await;
    held.release().await.unwrap();
    let guard = gets_in(writer, "a local reader kept out by the write intent").await;
    assert!(!reader.is_finished(), "a reader got in beside the writer");
    guard.release().await.unwrap();
    let read = gets_in(reader, "the reader after the writer").await;
    read.release().await.unwrap();
    assert!(keys(&server, &prefix).iter().all(|k| k.ends_with(":fence")));
}

#[tokio::test]
async fn a_release_whose_local_reader_is_kept_out_wakes_the_other_process_writer() {
    reader_kept_out_by_another_process_writer("exclusive").await;
}

#[tokio::test]
async fn a_write_release_whose_local_reader_is_kept_out_wakes_the_other_process_writer() {
    reader_kept_out_by_another_process_writer("write").await;
}

#[tokio::test]
async fn a_release_of_a_key_a_local_set_waits_on_wakes_the_other_process() {
    let (server, prefix, here, there) = two_processes("set").await;
    let third = manager(&server, &prefix).await;
    // `a` stays busy (another process holds it); A holds `b`.
    let a = third.lock("a").ttl(LONG).acquire().await.unwrap();
    let held = here.lock("b").ttl(LONG).acquire().await.unwrap();
    let b = other_process_waits(&there, "b");
    subscribed(&server, &format!("{prefix}{{b}}:wake")).await;
    asleep(&there, 2).await;
    // A's set waits on `b` (its first busy key), and will move on to `a`.
    let set = {
        let here = here.clone();
        tokio::spawn(async move {
            here.lock_all(["b", "a"])
                .ttl(LONG)
                .retry_delay(Duration::from_millis(20))
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        })
    };
    // The holder's acquisition, then the set's two looks: it now waits on `b`.
    asleep(&here, 3).await;
    held.release().await.unwrap();
    let guard = gets_in(b, "a local set waiting on the key").await;
    assert!(!set.is_finished(), "the set got in while `b` was held");
    guard.release().await.unwrap();
    a.release().await.unwrap();
    let all = match tokio::time::timeout(SOON, set).await {
        Ok(joined) => joined.unwrap().unwrap(),
        Err(_) => panic!("the set never got in"),
    };
    all.release().await.unwrap();
}

#[tokio::test]
async fn a_writer_that_gives_up_takes_back_the_intent_that_kept_readers_out() {
    writer_leaves_without_the_lock(false).await;
}

#[tokio::test]
async fn a_writer_cancelled_while_waiting_takes_back_the_intent_that_kept_readers_out() {
    writer_leaves_without_the_lock(true).await;
}

/// A writer waits behind a reader and leaves its intent; it gives up (or, `cancelled`, its
/// task is aborted), and a reader of a third process that the intent kept out gets in.
async fn writer_leaves_without_the_lock(cancelled: bool) {
    let (server, prefix, here, there) = two_processes("intent").await;
    // Readers inside: a writer must wait, and its intent keeps new readers out meanwhile.
    let inside = here.read_lock("k").ttl(LONG).acquire().await.unwrap();
    let intent = format!("{prefix}{{k}}:wi");
    let wait = if cancelled {
        LONG
    } else {
        Duration::from_millis(300)
    };
    let writer = waiter(&there, move |locks| locks.write_lock("k").wait(wait));
    let started = std::time::Instant::now();
    while server.command(&["EXISTS", &intent]).unwrap().trim() != ":1" {
        assert!(started.elapsed() < SOON, "the writer left no intent");
        tokio::task::yield_now().await;
    }
    // A reader of a third process finds the intent and sleeps; only a wake-up lets it in
    // before the intent (as long as the writer's lease) expires.
    let third = manager(&server, &prefix).await;
    let reader = waiter(&third, |locks| locks.read_lock("k"));
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&third, 2).await;
    if cancelled {
        writer.abort();
        assert!(writer.await.unwrap_err().is_cancelled());
    } else {
        assert!(matches!(writer.await.unwrap(), Err(LockError::Busy { .. })));
    }
    let read = gets_in(
        reader,
        "a reader behind the intent of a writer that gave up",
    )
    .await;
    assert_eq!(server.command(&["EXISTS", &intent]).unwrap().trim(), ":0");
    read.release().await.unwrap();
    inside.release().await.unwrap();
}

#[tokio::test]
async fn the_release_of_a_fenced_lock_wakes_the_other_process() {
    let (server, prefix, here, there) = two_processes("fenced").await;
    // A fencing token makes the lock a hash, given back by its own script.
    let held = here
        .lock("k")
        .fencing(true)
        .ttl(LONG)
        .acquire()
        .await
        .unwrap();
    let b = other_process_waits(&there, "k");
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    held.release().await.unwrap();
    let guard = gets_in(b, "the release of a fenced lock").await;
    guard.release().await.unwrap();
}

#[tokio::test]
async fn the_last_reader_release_wakes_the_other_process_writer() {
    let (server, prefix, here, there) = two_processes("last-reader").await;
    let read = here.read_lock("k").ttl(LONG).acquire().await.unwrap();
    let writer = waiter(&there, |locks| locks.write_lock("k"));
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    read.release().await.unwrap();
    let guard = gets_in(writer, "the last reader's release").await;
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_fair_grant_to_another_process_is_announced_not_found_by_its_refresh() {
    let (server, prefix, here, there) = two_processes("fair-grant").await;
    let held = here.lock("k").fair(true).ttl(LONG).acquire().await.unwrap();
    let waiting = waiter(&there, |locks| locks.lock("k").fair(true).wait(SOON));
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    asleep(&there, 2).await;
    let released = std::time::Instant::now();
    held.release().await.unwrap();
    let guard = waiting.await.unwrap();
    // Without the grant's announcement the waiter would find it only at its queue entry's
    // refresh, a second later.
    let took = released.elapsed();
    assert!(
        took < Duration::from_millis(900),
        "the grant was found after {took:?}, not announced"
    );
    guard.unwrap().release().await.unwrap();
}

#[tokio::test]
async fn a_reader_and_a_writer_of_one_process_queued_in_that_order_both_get_in() {
    let (server, prefix, here, there) = two_processes("own-writer").await;
    // Another process holds the lock; this one's reader waits first (the head of its queue).
    let held = there.lock("k").ttl(LONG).acquire().await.unwrap();
    let reader = waiter(&here, |locks| locks.read_lock("k"));
    queued(&here).await;
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    // Then this process's writer, which queues behind the reader. (Had its own first attempt
    // been refused before the reader queued, its intent would keep the reader out of the
    // free lock with nobody to take it: a writer that queues behind its own process's
    // waiters takes its intent back.)
    let writer = waiter(&here, |locks| locks.write_lock("k"));
    let started = std::time::Instant::now();
    while here.stats().waiting_requests < 2 {
        assert!(started.elapsed() < SOON, "the writer never queued");
        tokio::task::yield_now().await;
    }
    held.release().await.unwrap();
    let read = gets_in(reader, "a reader ahead of its own process's writer").await;
    read.release().await.unwrap();
    let write = gets_in(writer, "the writer after the reader").await;
    write.release().await.unwrap();
}

/// A run of hand-offs that yields to other processes, where those that hear the release do
/// not take the lock (here, listeners on its wake channel, as `distlock watch` is; in
/// general, processes whose own waiters are sitting out turns of their own): the local
/// waiters let the free lock go untaken for one turn at most, not for a turn per listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_yield_that_nobody_takes_up_leaves_the_lock_free_for_one_turn_at_most() {
    let server = shared_server();
    let prefix = unique_prefix("yield-untaken");
    let locks = manager(&server, &prefix).await;
    let channel = format!("{}:wake", locks.redis_key("k"));
    // Two hundred listeners: a turn each would keep the lock free for 20 s.
    let client = redis::Client::open(server.url()).unwrap();
    let mut listeners = Vec::new();
    for _ in 0..200 {
        let mut listener = client.get_async_pubsub().await.unwrap();
        listener.subscribe(&channel).await.unwrap();
        listeners.push(listener);
    }
    let request = |locks: &LockManager| {
        let locks = locks.clone();
        async move {
            locks
                .lock("k")
                .ttl(LONG)
                .cohort(false)
                .wait(Duration::from_secs(60))
                .acquire()
                .await
        }
    };
    let holder = request(&locks).await.unwrap();
    // Local waiters, each holding long enough for the next to stand ready: hand-offs until
    // the run's slice is spent, then a release to everyone.
    let mut waiting = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let take = request(&locks);
        waiting.spawn(async move {
            let guard = take.await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
            guard.release().await.unwrap();
        });
    }
    while locks.stats().waiting_requests < 8 || locks.stats().ready_for_handoff == 0 {
        tokio::task::yield_now().await;
    }
    holder.release().await.unwrap();
    let all_in = async {
        while let Some(done) = waiting.join_next().await {
            done.unwrap();
        }
    };
    tokio::time::timeout(SOON, all_in)
        .await
        .expect("the lock was left free while the local waiters sat out a turn per listener");
    assert!(
        locks.stats().local_handoffs > 0,
        "no run of hand-offs, so no yield: the test tested nothing"
    );
    drop(listeners);
    assert!(keys(&server, &prefix).is_empty());
}
