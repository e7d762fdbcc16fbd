//! Reentrancy follows the call chain: a hold is visible to the code that runs inside it, never
//! to concurrent sibling futures of the same task, and a nested acquisition of a lock the
//! task already holds never queues behind other waiters for that lock.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use distlock::{LockError, LockManager, distributed_lock};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio::sync::Notify;

use crate::support::{keys, manager, shared_server, take_soon, unique_prefix};

#[derive(Debug)]
enum AppError {
    Lock(#[expect(dead_code, reason = "shown by `Debug` when a test fails")] LockError),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        Self::Lock(error)
    }
}

/// A critical section that counts its visitors and the most ever inside at once.
#[derive(Default)]
struct Room {
    inside: AtomicU32,
    most: AtomicU32,
    entries: AtomicU32,
    /// Visits that ended, in or out.
    ended: AtomicU32,
    entered: Notify,
}

impl Room {
    /// Enters, and stays until a sibling has shown what it does with the lock: entered as
    /// well, queued for it, or given up.
    async fn visit(&self, locks: &LockManager) {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.entries.fetch_add(1, Ordering::SeqCst);
        self.entered.notify_one();
        while self.entries.load(Ordering::SeqCst) < 2
            && locks.stats().waiting_keys == 0
            && self.ended.load(Ordering::SeqCst) == 0
        {
            tokio::task::yield_now().await;
        }
        self.inside.fetch_sub(1, Ordering::SeqCst);
    }

    /// Runs `visit` once somebody is inside, and counts it as ended.
    async fn after_first<T>(&self, visit: impl Future<Output = T>) -> T {
        self.entered.notified().await;
        self.counted(visit).await
    }

    async fn counted<T>(&self, visit: impl Future<Output = T>) -> T {
        let outcome = visit.await;
        self.ended.fetch_add(1, Ordering::SeqCst);
        outcome
    }

    fn check(&self, entries: u32) {
        assert_eq!(self.most.load(Ordering::SeqCst), 1, "two siblings inside");
        assert_eq!(self.entries.load(Ordering::SeqCst), entries);
    }
}

#[distributed_lock(key = "room:{id}", reentrant, retries = 1000, retry_delay = "5ms", manager = locks)]
async fn visit_reentrant(locks: &LockManager, id: u32, room: &Room) -> Result<(), AppError> {
    room.visit(locks).await;
    Ok(())
}

#[distributed_lock(key = "room:{id}", retries = 1000, retry_delay = "5ms", manager = locks)]
async fn visit_plain(locks: &LockManager, id: u32, room: &Room) -> Result<(), AppError> {
    room.visit(locks).await;
    Ok(())
}

async fn visit(locks: &LockManager, id: u32, room: &Room, reentrant: bool) -> Result<(), AppError> {
    if reentrant {
        visit_reentrant(locks, id, room).await
    } else {
        visit_plain(locks, id, room).await
    }
}

/// Two annotated calls joined in one task: the second starts once the first is inside.
async fn join_two(locks: &LockManager, id: u32, room: &Room, reentrant: bool) {
    let (a, b) = tokio::join!(
        room.counted(visit(locks, id, room, reentrant)),
        room.after_first(visit(locks, id, room, reentrant)),
    );
    a.unwrap();
    b.unwrap();
}

#[distributed_lock(key = "outer:{id}", manager = locks)]
async fn join_inside_a_lock(
    locks: &LockManager,
    id: u32,
    room: &Room,
    reentrant: bool,
) -> Result<(), AppError> {
    join_two(locks, id, room, reentrant).await;
    Ok(())
}

#[tokio::test]
async fn annotated_siblings_in_join_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("join");
    let locks = manager(&server, &prefix).await;
    for reentrant in [false, true] {
        let room = Room::default();
        distlock::scope(join_two(&locks, 1, &room, reentrant)).await;
        room.check(2);

        let room = Room::default();
        join_inside_a_lock(&locks, 2, &room, reentrant)
            .await
            .unwrap();
        room.check(2);
    }
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn annotated_siblings_in_select_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("select");
    let locks = manager(&server, &prefix).await;
    for reentrant in [false, true] {
        let room = Room::default();
        let first = distlock::scope(async {
            tokio::select! {
                biased;
                a = room.counted(visit(&locks, 1, &room, reentrant)) => { a.unwrap(); true }
                b = room.after_first(visit(&locks, 1, &room, reentrant)) => { b.unwrap(); false }
            }
        })
        .await;
        // The holder's release passes the lock to its sibling, then waits for the run's check:
        // meanwhile the sibling may enter (after it left), and even finish first.
        let entries = room.entries.load(Ordering::SeqCst);
        assert_eq!(room.most.load(Ordering::SeqCst), 1, "two siblings inside");
        assert!(
            entries == 1 && first || entries == 2,
            "{entries} entries, the first sibling finished first: {first}"
        );
        take_soon(&locks, "room:1", "the losing branch left nothing behind").await;
    }
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn annotated_siblings_in_futures_unordered_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("unordered");
    let locks = manager(&server, &prefix).await;
    for reentrant in [false, true] {
        let room = Room::default();
        distlock::scope(async {
            let sibling = |first: bool| {
                let (locks, room) = (&locks, &room);
                async move {
                    if first {
                        room.counted(visit(locks, 1, room, reentrant)).await
                    } else {
                        room.after_first(visit(locks, 1, room, reentrant)).await
                    }
                }
            };
            let mut running: FuturesUnordered<_> =
                [true, false, false].into_iter().map(sibling).collect();
            while let Some(outcome) = running.next().await {
                outcome.unwrap();
            }
        })
        .await;
        room.check(3);
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// Takes the lock by hand, visits the room and gives the lock back.
async fn visit_by_hand(
    locks: &LockManager,
    room: &Room,
    reentrant: bool,
) -> Result<String, LockError> {
    let guard = locks
        .lock("room")
        .reentrant(reentrant)
        .retries(1000)
        .retry_delay(Duration::from_millis(5))
        .acquire()
        .await?;
    room.visit(locks).await;
    // Holders one after another by a local pass share the server hold's token: the pass
    // count tells them apart.
    let token = format!("{}#{}", guard.token(), guard.local_passes());
    guard.release().await?;
    Ok(token)
}

#[tokio::test]
async fn branches_locking_by_hand_in_their_own_scopes_exclude_each_other() {
    let server = shared_server();
    let prefix = unique_prefix("handscoped");
    let locks = manager(&server, &prefix).await;
    for reentrant in [false, true] {
        let room = Room::default();
        let (a, b) = distlock::scope(async {
            tokio::join!(
                distlock::scope(room.counted(visit_by_hand(&locks, &room, reentrant))),
                distlock::scope(room.after_first(visit_by_hand(&locks, &room, reentrant))),
            )
        })
        .await;
        room.check(2);
        assert_ne!(a.unwrap(), b.unwrap(), "two owners");
    }
    assert!(keys(&server, &prefix).is_empty());
}

/// The documented limit: branches that lock by hand in one scope share it, so the later one
/// is a nested acquisition of the earlier one's hold.
#[tokio::test]
async fn branches_locking_by_hand_in_one_scope_share_its_holds() {
    let server = shared_server();
    let prefix = unique_prefix("handshared");
    let locks = manager(&server, &prefix).await;
    let entered = Notify::new();
    let (a, b) = distlock::scope(async {
        tokio::join!(
            async {
                let guard = locks.lock("k").reentrant(true).acquire().await.unwrap();
                entered.notify_one();
                guard
            },
            async {
                entered.notified().await;
                let nested = locks.lock("k").reentrant(true).try_acquire().await;
                let plain = locks.lock("k").acquire().await;
                (nested.unwrap().expect("a nested hold"), plain)
            },
        )
    })
    .await;
    let (nested, plain) = b;
    assert_eq!(nested.token(), a.token());
    assert!(
        matches!(plain, Err(LockError::WouldDeadlock { .. })),
        "{plain:?}"
    );
    nested.release().await.unwrap();
    a.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}

#[distributed_lock(key = "room", reentrant, retries = 0, manager = locks)]
async fn nested_call(locks: &LockManager, outer_token: &str) -> Result<bool, AppError> {
    let again = locks
        .lock("room")
        .reentrant(true)
        .try_acquire()
        .await?
        .expect("a hold of the call is visible inside it");
    let same = again.token() == outer_token;
    again.release().await?;
    Ok(same)
}

#[tokio::test]
async fn a_hold_is_visible_to_everything_that_runs_inside_it() {
    let server = shared_server();
    let prefix = unique_prefix("inside");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let outer = locks.lock("room").reentrant(true).acquire().await.unwrap();
        // Through an annotated call and a scope of its own, both opened inside the hold.
        assert!(nested_call(&locks, outer.token()).await.unwrap());
        let token = distlock::scope(async {
            let nested = locks.lock("room").reentrant(true).try_acquire().await;
            let nested = nested.unwrap().expect("visible in an inner scope");
            let token = nested.token().to_owned();
            nested.release().await.unwrap();
            token
        })
        .await;
        assert_eq!(token, outer.token());
        let again = locks.lock("room").retries(1000).acquire().await;
        assert!(
            matches!(again, Err(LockError::WouldDeadlock { .. })),
            "{again:?}"
        );
        outer.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());
}

/// Another task of the same manager queued for `key`, proof that it waits.
async fn queue_a_waiter(locks: &LockManager, key: &str) -> tokio::task::JoinHandle<()> {
    let (other, key) = (locks.clone(), key.to_owned());
    let waiter = tokio::spawn(async move {
        let guard = other
            .write_lock(key)
            .wait(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
    });
    while locks.stats().waiting_keys == 0 {
        tokio::task::yield_now().await;
    }
    waiter
}

#[tokio::test]
async fn a_nested_acquisition_never_queues_behind_waiters_for_its_own_lock() {
    let server = shared_server();
    let prefix = unique_prefix("bypass");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let outer = locks.lock("k").reentrant(true).acquire().await.unwrap();
        let waiter = queue_a_waiter(&locks, "k").await;
        let nested = locks
            .lock("k")
            .reentrant(true)
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .expect("granted at once: it holds the lock already");
        assert_eq!(nested.token(), outer.token());
        nested.release().await.unwrap();
        outer.release().await.unwrap();
        waiter.await.unwrap();
    })
    .await;

    // A writer downgrading to read while another writer waits.
    distlock::scope(async {
        let write = locks.write_lock("doc").acquire().await.unwrap();
        let waiter = queue_a_waiter(&locks, "doc").await;
        let read = locks
            .read_lock("doc")
            .wait(Duration::from_secs(2))
            .acquire()
            .await
            .expect("the downgrade is granted at once");
        assert_eq!(read.token(), write.token());
        read.release().await.unwrap();
        write.release().await.unwrap();
        waiter.await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());
}

#[distributed_lock(key = "job", reentrant, on_busy = "skip", wait = "2s", manager = locks)]
async fn inner_job(locks: &LockManager) -> Result<bool, AppError> {
    let _ = locks;
    Ok(true)
}

#[distributed_lock(key = "job", reentrant, manager = locks)]
async fn outer_job(locks: &LockManager) -> Result<bool, AppError> {
    let waiter = queue_a_waiter(locks, "job").await;
    let ran = inner_job(locks).await?;
    Ok(ran && !waiter.is_finished())
}

#[tokio::test]
async fn a_nested_annotated_call_is_not_skipped_while_others_wait() {
    let server = shared_server();
    let prefix = unique_prefix("noskip");
    let locks = manager(&server, &prefix).await;
    assert!(outer_job(&locks).await.unwrap(), "the nested body ran");
    take_soon(&locks, "job", "the waiter got its turn and left").await;
    assert!(keys(&server, &prefix).is_empty());
}
