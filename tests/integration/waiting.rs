//! Waiting for a busy lock: waiters are woken by the release itself, an expiry is still
//! caught by the fallback timer, and nothing is left behind once waiting ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use distlock::testing::{Fault, FaultProxy, RedisServer};
use distlock::{LockError, LockManager, distributed_lock};

use crate::support;
use crate::support::{keys, manager, raw, shared_server, unique_prefix};

/// Far longer than any test: a waiter that sleeps this long was not woken.
const NEVER: Duration = Duration::from_secs(24 * 3600);

/// Channels the server has subscribers for, under `prefix`.
fn channels(server: &RedisServer, prefix: &str) -> Vec<String> {
    let reply = server
        .command(&["PUBSUB", "CHANNELS", &format!("{prefix}*")])
        .unwrap();
    reply
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The unsubscribe of a key nobody waits for any more is sent in the background; give it a
/// bounded time to reach the server.
async fn no_channels_left(server: &RedisServer, prefix: &str) -> bool {
    for _ in 0..200 {
        if channels(server, prefix).is_empty() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

async fn subscribed(server: &RedisServer, channel: &str) {
    let started = std::time::Instant::now();
    while channels(server, channel).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the waiter never subscribed"
        );
        tokio::task::yield_now().await;
    }
}

/// Key `k` held for a day by one manager, and a request of another manager waiting for it,
/// subscribed to its wake channel. The waiter's fallback timer would fire at a random point
/// of a day: only a wake-up gets it in soon.
async fn held_and_waited_for(
    server: &RedisServer,
    prefix: &str,
) -> (
    distlock::LockGuard,
    tokio::task::JoinHandle<Result<distlock::LockGuard, LockError>>,
) {
    let holder = manager(server, prefix).await;
    let waiter = manager(server, prefix).await;
    let held = holder.lock("k").ttl(NEVER).acquire().await.unwrap();
    let waiting = tokio::spawn(async move {
        waiter
            .lock("k")
            .retry_delay(NEVER)
            .retries(5)
            .acquire()
            .await
    });
    subscribed(server, &format!("{prefix}{{k}}:wake")).await;
    (held, waiting)
}

/// The waiter's guard, once a wake-up has let it in: within 10 s, where its fallback timer
/// would take hours.
async fn woken(
    waiting: tokio::task::JoinHandle<Result<distlock::LockGuard, LockError>>,
) -> distlock::LockGuard {
    tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("woken by the release")
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn a_release_wakes_the_waiter_long_before_its_fallback_timer() {
    let server = shared_server();
    let prefix = unique_prefix("wake");
    let (held, waiting) = held_and_waited_for(&server, &prefix).await;
    held.release().await.unwrap();
    let guard = woken(waiting).await;
    assert!(
        guard.attempts() >= 2,
        "it waited: {} attempts",
        guard.attempts()
    );
    assert!(guard.waited() < Duration::from_secs(10));
    guard.release().await.unwrap();
}

#[tokio::test]
async fn a_release_after_the_server_lost_its_scripts_still_frees_and_wakes() {
    // A server of its own: the flush must not reach other tests' scripts mid-call.
    let server = RedisServer::start().unwrap();
    let prefix = unique_prefix("noscript");
    let (held, waiting) = held_and_waited_for(&server, &prefix).await;
    // As after a restart with persistence, or `SCRIPT FLUSH`: every EVALSHA answers NOSCRIPT.
    assert_eq!(server.command(&["SCRIPT", "FLUSH"]).unwrap(), "+OK");
    held.release().await.unwrap();
    // Its lease is a day long: only the release can have freed the key for the waiter.
    let guard = woken(waiting).await;
    guard.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn an_expired_lock_is_taken_over_by_the_fallback_timer() {
    let server = shared_server();
    let prefix = unique_prefix("expiry");
    let holder = manager(&server, &prefix).await;
    let waiter = manager(&server, &prefix).await;
    // A holder that dies without releasing: nothing is published when its lease runs out.
    std::mem::forget(
        holder
            .lock("k")
            .ttl(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap(),
    );
    let guard = tokio::time::timeout(
        Duration::from_secs(10),
        waiter.lock("k").retry_delay(NEVER).retries(5).acquire(),
    )
    .await
    .expect("the fallback is capped by the holder's lease")
    .unwrap();
    guard.release().await.unwrap();
}

/// A waiter that follows the wake channel and waits by time looks again when the holder's
/// lease ends, not before: only a release could free the lock sooner, and a release wakes
/// it. A holder that died is taken over at once then.
#[tokio::test]
async fn a_subscribed_waiter_looks_again_when_the_lease_ends_not_before() {
    let server = shared_server();
    let prefix = unique_prefix("lease-end");
    let holder = manager(&server, &prefix).await;
    let waiter = manager(&server, &prefix).await;
    std::mem::forget(
        holder
            .lock("k")
            .ttl(Duration::from_millis(1500))
            .acquire()
            .await
            .unwrap(),
    );
    let guard = tokio::time::timeout(
        Duration::from_secs(10),
        waiter
            .lock("k")
            .retry_delay(Duration::from_millis(1))
            .wait(Duration::from_secs(60))
            .acquire(),
    )
    .await
    .expect("taken when the holder's lease ended")
    .unwrap();
    // The first look, the look again after joining the queue, the look at the lease's end
    // (and one spare, for a subscription that came late): a backoff of 1 ms to 32 ms would
    // have looked dozens of times in 1.5 s.
    assert!(guard.attempts() <= 4, "{} attempts", guard.attempts());
    guard.release().await.unwrap();
}

/// A permit whose holder died frees when its own lease ends, although the other permit is
/// held for a minute: a waiter that follows the wake channel looks again then, not at the end
/// of the lock's longest lease.
#[tokio::test]
async fn a_subscribed_semaphore_waiter_looks_again_when_the_first_permit_ends() {
    let server = shared_server();
    let prefix = unique_prefix("permit-end");
    let holder = manager(&server, &prefix).await;
    let waiter = manager(&server, &prefix).await;
    let kept = holder
        .semaphore("pool", 2)
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    std::mem::forget(
        holder
            .semaphore("pool", 2)
            .ttl(Duration::from_millis(1000))
            .acquire()
            .await
            .unwrap(),
    );
    let guard = tokio::time::timeout(
        Duration::from_secs(10),
        waiter
            .semaphore("pool", 2)
            .wait(Duration::from_secs(30))
            .acquire(),
    )
    .await
    .expect("a permit was taken when the dead holder's lease ended")
    .unwrap();
    guard.release().await.unwrap();
    kept.release().await.unwrap();
}

#[tokio::test]
async fn nothing_is_left_after_waiters_time_out_are_cancelled_or_succeed() {
    let server = shared_server();
    let prefix = unique_prefix("leftovers");
    let holder = manager(&server, &prefix).await;
    let locks = manager(&server, &prefix).await;
    let held = holder.lock("k").ttl(NEVER).acquire().await.unwrap();

    // Timed out.
    let outcome = locks
        .lock("k")
        .wait(Duration::from_millis(100))
        .acquire()
        .await;
    assert!(
        matches!(outcome, Err(LockError::Busy { .. })),
        "{outcome:?}"
    );
    // Cancelled.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(100),
        locks.lock("k").retries(100).acquire(),
    )
    .await;
    assert!(cancelled.is_err());
    assert_eq!(locks.stats().waiting_keys, 0);
    // Succeeded, several waiters at once.
    let mut waiting = Vec::new();
    for _ in 0..5 {
        let locks = locks.clone();
        waiting.push(tokio::spawn(async move {
            let guard = locks
                .lock("k")
                .retries(100)
                .retry_delay(NEVER)
                .acquire()
                .await?;
            guard.release().await
        }));
    }
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    held.release().await.unwrap();
    for waiter in waiting {
        waiter.await.unwrap().unwrap();
    }
    assert_eq!(locks.stats().waiting_keys, 0);
    assert!(
        no_channels_left(&server, &prefix).await,
        "{:?}",
        channels(&server, &prefix)
    );
    assert!(keys(&server, &prefix).is_empty());
}

/// Tasks on three managers take one key in turn through the wake-up path; a history of entries
/// and exits shows no overlap, and waiting leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_on_the_wake_up_path() {
    let server = RedisServer::start().unwrap();
    let prefix = "history:";
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicU64::new(0));
    let history = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut managers = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let locks = manager(&server, prefix).await;
        managers.push(locks.clone());
        for task in 0..8u32 {
            let (locks, inside, entries, history) = (
                locks.clone(),
                inside.clone(),
                entries.clone(),
                history.clone(),
            );
            tasks.spawn(async move {
                for _ in 0..25 {
                    let guard = locks
                        .lock("hot")
                        .wait(Duration::from_secs(30))
                        .acquire()
                        .await
                        .unwrap();
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders inside");
                    history.lock().unwrap().push((task, true));
                    entries.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    history.lock().unwrap().push((task, false));
                    inside.store(false, Ordering::SeqCst);
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(entries.load(Ordering::SeqCst), 600);
    let history = std::mem::take(&mut *history.lock().unwrap());
    assert!(
        history
            .chunks(2)
            .all(|pair| pair[0].0 == pair[1].0 && pair[0].1 && !pair[1].1)
    );
    assert!(managers.iter().all(|m| m.stats().waiting_keys == 0));
    assert!(no_channels_left(&server, prefix).await);
    let mut conn = raw(&server).await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    // Nothing but the live managers' registrations (who they are), one key each.
    let left: Vec<&String> = left
        .iter()
        .filter(|k| !k.starts_with("distlock-manager:"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A manager that reaches `server` through a fault proxy, with the test timeouts.
async fn behind(proxy: &FaultProxy, prefix: &str) -> LockManager {
    support::manager_at(proxy.url(), prefix).await
}

/// The lease of requests made through a blackholed proxy. The proxy buffers what it is sent
/// (as a middlebox would) and delivers it when it heals: an attempt abandoned during the
/// fault may then land after the release behind it, which went on a new connection (the
/// timed-out one is dropped), and after that release's late resend, and so hold its key
/// until this lease ends. (On a real network the kernel drops what it could not deliver, and
/// the late resend covers it: see `partitions`.)
const ORPHAN: Duration = Duration::from_secs(2);

/// Waits until nothing is left under `prefix`: within [`ORPHAN`] and a little more.
async fn no_keys_left_soon(server: &RedisServer, prefix: &str) {
    let started = std::time::Instant::now();
    while !keys(server, prefix).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "left behind: {:?}",
            keys(server, prefix)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Generous: a request bounded by a second or two that has not ended by then is stuck.
const STUCK: Duration = Duration::from_secs(30);

#[tokio::test]
async fn a_stuck_pubsub_connection_stalls_no_waiter() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.port()).unwrap();
    let prefix = unique_prefix("stuck");
    let holder = manager(&server, &prefix).await;
    let locks = behind(&proxy, &prefix).await;
    let held_a = holder.lock("a").ttl(NEVER).acquire().await.unwrap();
    let held_b = holder.lock("b").ttl(NEVER).acquire().await.unwrap();

    // A waiter on `a` opens the pub/sub connection, which then stops answering.
    let first = {
        let locks = locks.clone();
        tokio::spawn(async move { locks.lock("a").ttl(ORPHAN).wait(STUCK).acquire().await })
    };
    subscribed(&server, &format!("{prefix}{{a}}:wake")).await;
    proxy.set(Fault::Blackhole);

    // A waiter on `b` needs that connection to subscribe: it still ends within its bound,
    // and says why it could not take the lock.
    let outcome = tokio::time::timeout(
        STUCK,
        locks
            .lock("b")
            .ttl(ORPHAN)
            .wait(Duration::from_secs(1))
            .retry_delay(Duration::from_millis(20))
            .acquire(),
    )
    .await
    .expect("the request ended within its wait");
    assert!(
        matches!(outcome, Err(LockError::Redis { .. })),
        "{outcome:?}"
    );

    // Once the fault heals, the first waiter gets the lock, by a new subscription or its
    // fallback timer.
    proxy.set(Fault::Pass);
    held_a.release().await.unwrap();
    let guard = tokio::time::timeout(STUCK, first)
        .await
        .expect("the first waiter got the lock")
        .unwrap()
        .unwrap();
    guard.release().await.unwrap();
    held_b.release().await.unwrap();
    assert_eq!(locks.stats().waiting_keys, 0);
    assert!(
        no_channels_left(&server, &prefix).await,
        "still subscribed: {:?}",
        channels(&server, &prefix)
    );
    no_keys_left_soon(&server, &prefix).await;
}

#[derive(Debug)]
enum AppError {
    Lock(LockError),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        Self::Lock(error)
    }
}

#[distributed_lock(key = "k", on_busy = "skip", wait = "1500ms", ttl = "2s", manager = locks)]
async fn scheduled_job(locks: &LockManager) -> Result<bool, AppError> {
    let _ = locks;
    Ok(true)
}

/// Polls `future` once: enough for a request to join the queue of its key.
async fn poll_once<F: Future + Unpin>(future: &mut F)
where
    F::Output: std::fmt::Debug,
{
    tokio::select! {
        biased;
        done = future => panic!("ended before the fault: {done:?}"),
        () = std::future::ready(()) => {}
    }
}

#[tokio::test]
async fn waiters_queued_through_an_outage_report_it_instead_of_busy() {
    let server = shared_server();
    let proxy = FaultProxy::start(server.port()).unwrap();
    let prefix = unique_prefix("outage");
    let holder = manager(&server, &prefix).await;
    let locks = behind(&proxy, &prefix).await;
    let held = holder.lock("k").ttl(NEVER).acquire().await.unwrap();

    // The head of the queue keeps trying; two more wait behind it.
    let head = {
        let locks = locks.clone();
        tokio::spawn(async move {
            locks
                .lock("k")
                .ttl(ORPHAN)
                .wait(STUCK)
                .retry_delay(Duration::from_millis(20))
                .acquire()
                .await
        })
    };
    subscribed(&server, &format!("{prefix}{{k}}:wake")).await;
    let mut by_hand = Box::pin(
        locks
            .lock("k")
            .ttl(ORPHAN)
            .wait(Duration::from_millis(1500))
            .acquire(),
    );
    let mut job = Box::pin(scheduled_job(&locks));
    poll_once(&mut by_hand).await;
    poll_once(&mut job).await;
    proxy.set(Fault::Blackhole);

    let by_hand = tokio::time::timeout(STUCK, by_hand).await.expect("ended");
    assert!(
        matches!(by_hand, Err(LockError::Redis { .. })),
        "{by_hand:?}"
    );
    let job = tokio::time::timeout(STUCK, job).await.expect("ended");
    assert!(
        matches!(job, Err(AppError::Lock(LockError::Redis { .. }))),
        "not skipped during an outage: {job:?}"
    );

    proxy.set(Fault::Pass);
    held.release().await.unwrap();
    let guard = tokio::time::timeout(STUCK, head)
        .await
        .expect("the head got the lock")
        .unwrap()
        .unwrap();
    guard.release().await.unwrap();
    assert_eq!(locks.stats().waiting_keys, 0);
    assert!(no_channels_left(&server, &prefix).await);
    no_keys_left_soon(&server, &prefix).await;
}
