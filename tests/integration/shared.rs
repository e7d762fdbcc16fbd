//! Read-write locks and counting semaphores against a real redis-server.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use distlock::{LockError, LockManager, distributed_lock};
use tokio::sync::Barrier;

use crate::support::{keys, manager, shared_server, unique_prefix};

/// Entries and exits of every holder, as (+1 reader | +1000 writer) deltas, checked on entry.
#[derive(Default)]
struct Occupancy {
    now: AtomicI64,
}

const WRITER: i64 = 1000;

impl Occupancy {
    fn enter(&self, delta: i64) -> i64 {
        self.now.fetch_add(delta, Ordering::SeqCst) + delta
    }
    fn exit(&self, delta: i64) {
        self.now.fetch_sub(delta, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn readers_overlap() {
    let server = shared_server();
    let prefix = unique_prefix("readers");
    let locks = manager(&server, &prefix).await;
    let barrier = Arc::new(Barrier::new(5));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (locks, barrier) = (locks.clone(), barrier.clone());
        tasks.spawn(async move {
            let guard = locks.read_lock("doc").acquire().await.unwrap();
            // All five get here only if all five hold the read lock at once.
            barrier.wait().await;
            guard.release().await.unwrap();
        });
    }
    let all = async {
        while let Some(done) = tasks.join_next().await {
            done.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(10), all)
        .await
        .expect("readers overlapped");
    assert!(keys(&server, &prefix).is_empty());
}

/// Readers and writers on three managers: a writer is never inside with anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_exclude_readers_and_writers() {
    let server = shared_server();
    let prefix = unique_prefix("rw");
    let occupancy = Arc::new(Occupancy::default());
    let mut tasks = tokio::task::JoinSet::new();
    for m in 0..3 {
        let locks = manager(&server, &prefix).await;
        for t in 0..6 {
            let (locks, occupancy) = (locks.clone(), occupancy.clone());
            let writer = (m + t) % 3 == 0;
            tasks.spawn(async move {
                for _ in 0..10 {
                    let (request, delta) = if writer {
                        (locks.write_lock("doc"), WRITER)
                    } else {
                        (locks.read_lock("doc"), 1)
                    };
                    let guard = request
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .unwrap();
                    let inside = occupancy.enter(delta);
                    if writer {
                        assert_eq!(inside, WRITER, "a writer entered with others inside");
                    } else {
                        assert!(inside < WRITER, "a reader entered with a writer inside");
                    }
                    tokio::task::yield_now().await;
                    occupancy.exit(delta);
                    guard.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(
        keys(&server, &prefix)
            .iter()
            .all(|k| k.ends_with(":fence") || k.ends_with(":wi")),
        "{:?}",
        keys(&server, &prefix)
    );
}

#[tokio::test]
async fn a_dead_reader_frees_only_its_own_share() {
    let server = shared_server();
    let prefix = unique_prefix("deadreader");
    let locks = manager(&server, &prefix).await;
    let long = locks
        .read_lock("doc")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    // A reader that dies: its share's lease is short and nobody releases it.
    std::mem::forget(
        locks
            .read_lock("doc")
            .ttl(Duration::from_millis(200))
            .acquire()
            .await
            .unwrap(),
    );
    let writer = locks
        .write_lock("doc")
        .wait(Duration::from_millis(400))
        .acquire()
        .await;
    assert!(
        matches!(writer, Err(LockError::Busy { .. })),
        "the live reader still holds it"
    );
    assert!(long.is_held().await.unwrap());
    long.release().await.unwrap();
    let writer = locks
        .write_lock("doc")
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    writer.release().await.unwrap();
}

#[tokio::test]
async fn a_waiting_writer_is_not_starved_by_readers() {
    let server = shared_server();
    let prefix = unique_prefix("starve");
    let locks = manager(&server, &prefix).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = tokio::task::JoinSet::new();
    // Readers that overlap each other, so the lock is never without one.
    for _ in 0..4 {
        let (locks, stop) = (locks.clone(), stop.clone());
        readers.spawn(async move {
            let mut entries = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let guard = locks
                    .read_lock("doc")
                    .wait(Duration::from_secs(30))
                    .acquire()
                    .await
                    .unwrap();
                entries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
                guard.release().await.unwrap();
            }
            entries
        });
    }
    let writer = locks
        .write_lock("doc")
        .wait(Duration::from_secs(10))
        .acquire()
        .await
        .expect("the writer got in despite a steady stream of readers");
    writer.release().await.unwrap();
    stop.store(true, Ordering::SeqCst);
    let mut total = 0;
    while let Some(entries) = readers.join_next().await {
        total += entries.unwrap();
    }
    assert!(total > 0);
}

#[tokio::test]
async fn downgrade_works_and_upgrade_fails_at_once() {
    let server = shared_server();
    let prefix = unique_prefix("grade");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let write = locks.write_lock("doc").acquire().await.unwrap();
        let read = locks
            .read_lock("doc")
            .retries(0)
            .acquire()
            .await
            .expect("downgrade");
        assert_eq!(read.token(), write.token());
        write.release().await.unwrap();
        // Still held (for reading) by this task: another owner cannot write.
        let other = locks.clone();
        let blocked = tokio::spawn(async move { other.write_lock("doc").try_acquire().await })
            .await
            .unwrap();
        assert!(blocked.unwrap().is_none());
        read.release().await.unwrap();
    })
    .await;
    distlock::scope(async {
        let read = locks.read_lock("doc").acquire().await.unwrap();
        let upgrade = locks.write_lock("doc").retries(1000).acquire().await;
        assert!(
            matches!(upgrade, Err(LockError::Upgrade { .. })),
            "{upgrade:?}"
        );
        read.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn watchdog_and_fencing_work_for_both_modes() {
    let server = shared_server();
    let prefix = unique_prefix("rwlease");
    let locks = manager(&server, &prefix).await;
    let ttl = Duration::from_millis(300);
    let read = locks
        .read_lock("doc")
        .ttl(ttl)
        .watchdog(true)
        .fencing(true)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(ttl * 3).await;
    assert!(!read.is_lost());
    assert!(read.is_held().await.unwrap());
    let first = read.fencing_token().unwrap();
    read.release().await.unwrap();
    let write = locks
        .write_lock("doc")
        .ttl(ttl)
        .watchdog(true)
        .fencing(true)
        .acquire()
        .await
        .unwrap();
    tokio::time::sleep(ttl * 3).await;
    assert!(write.is_held().await.unwrap());
    assert!(write.fencing_token().unwrap() > first);
    write.release().await.unwrap();
}

/// Never more than N holders of a semaphore, checked on every entry, across managers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_never_has_more_than_n_holders() {
    const PERMITS: u32 = 3;
    let server = shared_server();
    let prefix = unique_prefix("sem");
    let occupancy = Arc::new(Occupancy::default());
    let most = Arc::new(AtomicI64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let locks = manager(&server, &prefix).await;
        for _ in 0..6 {
            let (locks, occupancy, most) = (locks.clone(), occupancy.clone(), most.clone());
            tasks.spawn(async move {
                for _ in 0..10 {
                    let permit = locks
                        .semaphore("pool", PERMITS)
                        .wait(Duration::from_secs(60))
                        .acquire()
                        .await
                        .unwrap();
                    let inside = occupancy.enter(1);
                    assert!(
                        inside <= i64::from(PERMITS),
                        "{inside} holders of {PERMITS} permits"
                    );
                    most.fetch_max(inside, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    occupancy.exit(1);
                    permit.release().await.unwrap();
                }
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(most.load(Ordering::SeqCst) > 1, "permits were shared");
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

#[tokio::test]
async fn expired_permits_return_and_foreign_releases_are_reported() {
    let server = shared_server();
    let prefix = unique_prefix("permits");
    let locks = manager(&server, &prefix).await;
    std::mem::forget(
        locks
            .semaphore("pool", 2)
            .ttl(Duration::from_millis(200))
            .acquire()
            .await
            .unwrap(),
    );
    let second = locks
        .semaphore("pool", 2)
        .ttl(Duration::from_millis(200))
        .acquire()
        .await
        .unwrap();
    assert!(
        locks
            .semaphore("pool", 2)
            .try_acquire()
            .await
            .unwrap()
            .is_none(),
        "both permits taken"
    );
    // Both leases end; the forgotten one was never released.
    let third = locks
        .semaphore("pool", 2)
        .wait(Duration::from_secs(5))
        .acquire()
        .await
        .unwrap();
    // The expired holder's release finds nothing of its own: once its share has expired on
    // the server too (on a busy machine, the third may have come in through the forgotten
    // permit while the second's lease still ran).
    let deadline = Instant::now() + Duration::from_secs(5);
    while second.is_held().await.unwrap() {
        assert!(Instant::now() < deadline, "the second share never expired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(matches!(
        second.release().await,
        Err(LockError::Lost { .. })
    ));
    third.release().await.unwrap();
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
    let zero = locks.semaphore("pool", 0).acquire().await;
    assert!(matches!(
        zero,
        Err(LockError::InvalidInput {
            what: "permits",
            ..
        })
    ));
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

#[distributed_lock(key = "doc:{id}", mode = "read", manager = locks)]
async fn read_doc(locks: &LockManager, id: u32) -> Result<u32, AppError> {
    Ok(id)
}

#[distributed_lock(key = "doc:{id}", mode = "write", manager = locks)]
async fn write_doc(locks: &LockManager, id: u32) -> Result<u32, AppError> {
    // Downgrade inside the write lock.
    read_doc(locks, id).await
}

#[distributed_lock(key = "pool", permits = 2, manager = locks)]
async fn use_pool(locks: &LockManager) -> Result<(), AppError> {
    let _ = locks;
    Ok(())
}

#[tokio::test]
async fn the_attribute_takes_read_write_and_permits() {
    let server = shared_server();
    let prefix = unique_prefix("attrshared");
    let locks = manager(&server, &prefix).await;
    assert_eq!(read_doc(&locks, 1).await.unwrap(), 1);
    assert_eq!(write_doc(&locks, 2).await.unwrap(), 2);
    use_pool(&locks).await.unwrap();
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
    let AppError::Lock(error) = AppError::from(LockError::NotInstalled);
    assert!(matches!(error, LockError::NotInstalled));
}
