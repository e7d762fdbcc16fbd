//! A release whose caller gives up at any point still gives everything back, once: the
//! release of a lock, a read lock, a semaphore permit and a set, each polled `n` times and
//! then dropped, for every `n` until it completes, on one server, a Cluster and RedLock.
//!
//! Each release is cancelled twice over: on the runtime that took the lock, whose connections
//! are open (the command goes out on the first poll), and on a runtime of its own that has no
//! connection yet (the release first opens one, and every step of that is an await point
//! where nothing has been sent). After each cancellation every key the release gave back is
//! free within `PROMPTLY`, and nothing is given back twice: a hold that nests in the cancelled
//! one, or that the cancelled one nests in, keeps its lock until its own release.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockGuard, LockManager, MultiGuard};

use crate::support;
use crate::support::{manager, shared_server, unique_prefix};

/// A lease far longer than the test, so that only a release can free a key.
const LONG: Duration = Duration::from_secs(60);
/// How soon a key must be free after its release was cancelled.
const PROMPTLY: Duration = Duration::from_millis(100);
/// No release takes this many polls: past it the test has gone wrong.
const MOST_POLLS: usize = 200;

/// What the test holds and then releases.
enum Held {
    One(LockGuard),
    Set(MultiGuard),
}

type Release = std::pin::Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;

impl Held {
    fn release(self) -> Release {
        match self {
            Held::One(guard) => Box::pin(guard.release()),
            Held::Set(set) => Box::pin(set.release()),
        }
    }
}

/// The kinds whose release is cancelled.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Lock,
    Read,
    Permit,
    Set,
}

const KINDS: [Kind; 4] = [Kind::Lock, Kind::Read, Kind::Permit, Kind::Set];
/// RedLock has no read locks nor semaphores.
const REDLOCK_KINDS: [Kind; 2] = [Kind::Lock, Kind::Set];

impl Kind {
    /// The keys a hold of this kind takes.
    fn keys(self) -> &'static [&'static str] {
        match self {
            Kind::Set => &["set:a", "set:b", "set:c"],
            _ => &["one"],
        }
    }

    async fn take(self, locks: &LockManager) -> Held {
        let one = match self {
            Kind::Lock => locks.lock("one"),
            Kind::Read => locks.read_lock("one"),
            Kind::Permit => locks.semaphore("one", 2),
            Kind::Set => {
                let set = locks
                    .lock_all(self.keys().iter().copied())
                    .ttl(LONG)
                    .acquire()
                    .await;
                return Held::Set(set.unwrap());
            }
        };
        Held::One(one.ttl(LONG).acquire().await.unwrap())
    }
}

/// Polls `future` until it has answered `Pending` `n` times (each poll after the first comes
/// when the future asked to be woken, so each is at a later await point), then drops it:
/// `Some(output)` when it completed first. Also says when it was dropped.
async fn poll_n_then_drop<F: Future>(future: F, n: usize) -> (Option<F::Output>, Instant) {
    let mut pending = 0;
    let outcome = {
        let mut future = pin!(future);
        std::future::poll_fn(|cx| {
            if pending == n {
                return Poll::Ready(None);
            }
            match future.as_mut().poll(cx) {
                Poll::Ready(output) => Poll::Ready(Some(output)),
                Poll::Pending => {
                    pending += 1;
                    if pending == n {
                        Poll::Ready(None)
                    } else {
                        Poll::Pending
                    }
                }
            }
        })
        .await
    };
    (outcome, Instant::now())
}

/// `poll_n_then_drop` on the caller's runtime (`cold` false), or on a new runtime of its own
/// that has no connection yet and goes away right after.
async fn cancel(
    release: Release,
    n: usize,
    cold: bool,
) -> (Option<Result<(), LockError>>, Instant) {
    if !cold {
        return poll_n_then_drop(release, n).await;
    }
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(poll_n_then_drop(release, n))
    })
    .await
    .unwrap()
}

/// Takes every key of `keys` with `other` within `PROMPTLY` of `since`, failing the test
/// otherwise, and gives them back; each must still be `other`'s when it does.
async fn free_soon(other: &LockManager, keys: &[&str], since: Instant, why: &str) {
    let mut taken = Vec::new();
    let mut left: Vec<&str> = keys.to_vec();
    while !left.is_empty() {
        let mut still = Vec::new();
        for key in left {
            match other.lock(key).try_acquire().await.unwrap() {
                Some(guard) => taken.push(guard),
                None => still.push(key),
            }
        }
        left = still;
        assert!(
            left.is_empty() || since.elapsed() < PROMPTLY,
            "{why}: {left:?} still held {:?} after the release was dropped",
            since.elapsed()
        );
        if !left.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    for guard in taken {
        let key = guard.key().to_owned();
        assert!(
            guard.is_held().await.unwrap(),
            "{why}: `{key}` was taken from its next holder"
        );
        guard
            .release()
            .await
            .unwrap_or_else(|e| panic!("{why}: `{key}`'s next holder: {e}"));
    }
}

/// Fails the test if `other` can take any of `keys`.
async fn still_held(other: &LockManager, keys: &[&str], why: &str) {
    for key in keys {
        let taken = other.lock(*key).try_acquire().await.unwrap();
        assert!(taken.is_none(), "{why}: `{key}` was given back too soon");
    }
}

/// Cancels the release of each of `kinds` at every await point, with `locks` as the holder and
/// `other` (another manager on the same servers) as the next one.
async fn at_every_await_point(
    kinds: &[Kind],
    locks: &LockManager,
    other: &LockManager,
    topology: &str,
) {
    for cold in [false, true] {
        for &kind in kinds {
            let mut polls = 0;
            loop {
                let why = format!(
                    "{topology}, {kind:?} (cold runtime: {cold}) dropped after {polls} polls"
                );
                let held = kind.take(locks).await;
                let (outcome, dropped) = cancel(held.release(), polls, cold).await;
                free_soon(other, kind.keys(), dropped, &why).await;
                if let Some(released) = outcome {
                    released.unwrap_or_else(|e| panic!("{why}: {e}"));
                    break;
                }
                polls += 1;
                assert!(polls < MOST_POLLS, "{why}: the release never completes");
            }
        }
        nested_holds_keep_their_locks(locks, other, topology, cold).await;
    }
}

/// A cancelled release gives back only what it held: a lock the holder held before (outside)
/// and one it re-entered inside the set stay held, and a nested single hold leaves its outer
/// hold's lock in place.
async fn nested_holds_keep_their_locks(
    locks: &LockManager,
    other: &LockManager,
    topology: &str,
    cold: bool,
) {
    let mut polls = 0;
    loop {
        let why = format!(
            "{topology}, a set inside and around single holds (cold runtime: {cold}) \
             dropped after {polls} polls"
        );
        let completed = distlock::scope(async {
            let outside = locks
                .lock("set:a")
                .ttl(LONG)
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let set = locks
                .lock_all(["set:a", "set:b", "set:c"])
                .ttl(LONG)
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let inside = locks
                .lock("set:c")
                .ttl(LONG)
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let (outcome, dropped) = cancel(Box::pin(set.release()), polls, cold).await;
            free_soon(other, &["set:b"], dropped, &why).await;
            still_held(other, &["set:a", "set:c"], &why).await;
            // A nested single hold's cancelled release leaves its outer hold alone.
            let nested = locks
                .lock("set:a")
                .ttl(LONG)
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let (_, _) = cancel(Box::pin(nested.release()), polls, cold).await;
            still_held(other, &["set:a", "set:c"], &why).await;
            for last in [inside, outside] {
                let key = last.key().to_owned();
                last.release()
                    .await
                    .unwrap_or_else(|e| panic!("{why}: the last hold of `{key}`: {e}"));
            }
            free_soon(other, &["set:a", "set:c"], Instant::now(), &why).await;
            if let Some(released) = outcome {
                released.unwrap_or_else(|e| panic!("{why}: {e}"));
                return true;
            }
            false
        })
        .await;
        if completed {
            return;
        }
        polls += 1;
        assert!(
            polls < MOST_POLLS,
            "{why}: the release never completes",
            why = topology
        );
    }
}

#[tokio::test]
async fn a_release_cancelled_anywhere_gives_everything_back_on_one_server() {
    let server = shared_server();
    let prefix = unique_prefix("cancel-release");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    at_every_await_point(&KINDS, &locks, &other, "one server").await;
    assert!(support::keys(&server, &prefix).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cancelled_anywhere_gives_everything_back_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let prefix = unique_prefix("cancel-release");
    let locks = support::cluster_manager(&nodes, &prefix).await;
    let other = support::cluster_manager(&nodes, &prefix).await;
    at_every_await_point(&KINDS, &locks, &other, "Cluster").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cancelled_anywhere_gives_everything_back_on_redlock() {
    let masters = support::redlock_masters(3);
    let prefix = unique_prefix("cancel-release");
    let locks = support::redlock_manager(&masters, &prefix).await;
    let other = support::redlock_manager(&masters, &prefix).await;
    at_every_await_point(&REDLOCK_KINDS, &locks, &other, "RedLock").await;
    // A RedLock release answers at a quorum, and an attempt that fell short of one gives back
    // what it took behind its answer: the last master may lag a little (on a loaded machine,
    // past the attempt's own bound: such a give-back finishes in the background).
    let started = Instant::now();
    for master in &masters {
        loop {
            let left = support::keys(master, &prefix);
            if left.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "left behind: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
