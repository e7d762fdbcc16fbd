//! Metrics through the `metrics` facade, read back with a debugging recorder after known
//! sequences against a real server. Each test labels its requests with a template of its own,
//! so tests running side by side never count each other's locks. The recorder is global to
//! the test binary: once installed it also sees the locks of the other modules' tests, whose
//! templates (their keys, or `<manual>`) are none of these.
#![cfg(feature = "metrics")]

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use distlock::{LockError, LockManager, distributed_lock, metrics as names};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::{CompositeKey, MetricKind};

use crate::support;
use crate::support::{keys, manager, shared_server, unique_prefix};

/// Every key these tests lock contains this, so the labels can be searched for it.
const MARK: &str = "FULLKEY";

/// What the recorder has seen so far. A snapshot takes the values out of the recorder (a
/// counter's or gauge's change since the last one, a histogram's new values), so they are
/// added up here; gauges here only ever move by increments.
static SEEN: Mutex<Option<HashMap<CompositeKey, DebugValue>>> = Mutex::new(None);

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this test binary");
        snapshotter
    })
}

/// Every metric seen so far: counters and gauges at their current value, histograms with
/// every value ever recorded.
fn seen() -> Vec<(CompositeKey, DebugValue)> {
    // Snapshot under the lock: a concurrent caller must not read before these are added.
    let mut seen = SEEN.lock().unwrap();
    let snapshot = snapshotter().snapshot().into_vec();
    let seen = seen.get_or_insert_with(HashMap::new);
    for (key, _, _, value) in snapshot {
        match (seen.get_mut(&key), value) {
            (Some(DebugValue::Counter(all)), DebugValue::Counter(new)) => *all += new,
            (Some(DebugValue::Gauge(all)), DebugValue::Gauge(new)) => *all += new,
            (Some(DebugValue::Histogram(all)), DebugValue::Histogram(new)) => all.extend(new),
            (_, value) => {
                seen.insert(key, value);
            }
        }
    }
    seen.iter().map(|(k, v)| (k.clone(), copy(v))).collect()
}

/// (`DebugValue` is not `Clone`.)
fn copy(value: &DebugValue) -> DebugValue {
    match value {
        DebugValue::Counter(n) => DebugValue::Counter(*n),
        DebugValue::Gauge(n) => DebugValue::Gauge(*n),
        DebugValue::Histogram(values) => DebugValue::Histogram(values.clone()),
    }
}

/// The metrics of `kind` named `name` whose labels include all of `labels`.
fn matching(kind: MetricKind, name: &str, labels: &[(&str, &str)]) -> Vec<DebugValue> {
    seen()
        .into_iter()
        .filter(|(key, _)| key.kind() == kind && key.key().name() == name)
        .filter(|(key, _)| {
            labels.iter().all(|(k, v)| {
                key.key()
                    .labels()
                    .any(|label| label.key() == *k && label.value() == *v)
            })
        })
        .map(|(_, value)| value)
        .collect()
}

fn counter(name: &str, labels: &[(&str, &str)]) -> u64 {
    matching(MetricKind::Counter, name, labels)
        .into_iter()
        .map(|value| match value {
            DebugValue::Counter(n) => n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

fn gauge(name: &str, labels: &[(&str, &str)]) -> f64 {
    matching(MetricKind::Gauge, name, labels)
        .into_iter()
        .map(|value| match value {
            DebugValue::Gauge(n) => n.into_inner(),
            other => panic!("{name} is not a gauge: {other:?}"),
        })
        .sum()
}

fn histogram(name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    matching(MetricKind::Histogram, name, labels)
        .into_iter()
        .flat_map(|value| match value {
            DebugValue::Histogram(values) => values.into_iter().map(|v| v.into_inner()),
            other => panic!("{name} is not a histogram: {other:?}"),
        })
        .collect()
}

/// Polls the recorder until `done` holds (or fails after 10 s).
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn acquire_and_release_record_one_attempt_a_wait_and_a_hold() {
    snapshotter();
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("m-hold")).await;
    let exclusive = [("template", "hold:{id}"), ("kind", "exclusive")];

    let guard = locks
        .lock(format!("hold:{MARK}-1"))
        .label("hold:{id}")
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();

    assert_eq!(counter(names::ACQUIRE_ATTEMPTS, &exclusive), 1);
    let acquired = [exclusive[0], exclusive[1], ("outcome", "acquired")];
    assert_eq!(counter(names::ACQUIRES, &acquired), 1);
    assert_eq!(histogram(names::ACQUIRE_WAIT, &acquired).len(), 1);
    assert_eq!(histogram(names::HOLD, &exclusive).len(), 1);
    assert_eq!(counter(names::LOST, &exclusive), 0);
    assert_eq!(gauge(names::WAITING, &exclusive), 0.0);

    // The other kinds carry their own `kind` label.
    let read = locks
        .read_lock(format!("hold:{MARK}-2"))
        .label("hold:{id}")
        .acquire()
        .await
        .unwrap();
    let permit = locks
        .semaphore(format!("hold:{MARK}-3"), 2)
        .label("hold:{id}")
        .acquire()
        .await
        .unwrap();
    read.release().await.unwrap();
    permit.release().await.unwrap();
    for kind in ["read", "semaphore"] {
        let labels = [("template", "hold:{id}"), ("kind", kind)];
        assert_eq!(counter(names::ACQUIRES, &labels), 1, "{kind}");
        assert_eq!(histogram(names::HOLD, &labels).len(), 1, "{kind}");
    }
}

#[tokio::test]
async fn busy_requests_count_every_attempt_and_the_busy_outcome() {
    snapshotter();
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("m-busy")).await;
    let key = format!("busy:{MARK}");
    let labels = [("template", "busy"), ("kind", "exclusive")];

    let holder = locks.lock(&key).label("busy").acquire().await.unwrap();
    assert!(
        locks
            .lock(&key)
            .label("busy")
            .try_acquire()
            .await
            .unwrap()
            .is_none()
    );
    let busy = locks
        .lock(&key)
        .label("busy")
        .retries(2)
        .retry_delay(Duration::from_millis(1))
        .acquire()
        .await;
    assert!(matches!(busy, Err(LockError::Busy { attempts: 3, .. })));
    holder.release().await.unwrap();

    // 1 for the holder, 1 for try_acquire, 3 for the request with two retries.
    assert_eq!(counter(names::ACQUIRE_ATTEMPTS, &labels), 5);
    let busy = [labels[0], labels[1], ("outcome", "busy")];
    assert_eq!(counter(names::ACQUIRES, &busy), 2);
    assert_eq!(histogram(names::ACQUIRE_WAIT, &busy).len(), 2);
    // The retrying request queued while it waited, and left the queue when it gave up.
    assert_eq!(gauge(names::WAITING, &labels), 0.0);
}

#[tokio::test]
async fn a_waiting_request_is_counted_then_handed_the_lock() {
    snapshotter();
    let server = shared_server();
    let locks = manager(&server, &unique_prefix("m-wait")).await;
    let key = format!("wait:{MARK}");
    let labels = [("template", "wait"), ("kind", "exclusive")];

    let holder = locks.lock(&key).label("wait").acquire().await.unwrap();
    let waiter = tokio::spawn({
        let (locks, key) = (locks.clone(), key.clone());
        async move {
            let guard = locks
                .lock(&key)
                .label("wait")
                .wait(Duration::from_secs(30))
                .acquire()
                .await
                .unwrap();
            guard.release().await.unwrap();
        }
    });
    until("the waiter is counted", || {
        gauge(names::WAITING, &labels) == 1.0
    })
    .await;
    holder.release().await.unwrap();
    waiter.await.unwrap();

    assert_eq!(counter(names::HANDOFFS, &labels), 1);
    assert_eq!(gauge(names::WAITING, &labels), 0.0);
    let acquired = [labels[0], labels[1], ("outcome", "acquired")];
    assert_eq!(counter(names::ACQUIRES, &acquired), 2);
    assert_eq!(histogram(names::HOLD, &labels).len(), 2);
}

#[tokio::test]
async fn a_lease_that_ran_out_counts_as_lost() {
    snapshotter();
    let server = shared_server();
    let prefix = unique_prefix("m-expired");
    let locks = manager(&server, &prefix).await;
    let labels = [("template", "expired"), ("kind", "exclusive")];

    let guard = locks
        .lock(format!("expired:{MARK}"))
        .label("expired")
        .ttl(Duration::from_millis(100))
        .acquire()
        .await
        .unwrap();
    let _ = guard.lost().await;
    // The local deadline keeps a margin: wait for the server to drop the key too.
    let key = format!("{prefix}{{expired:{MARK}}}");
    until("the key expires", || {
        support::keys(&server, &key).is_empty()
    })
    .await;
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));

    assert_eq!(counter(names::LOST, &labels), 1);
    assert_eq!(histogram(names::HOLD, &labels).len(), 1);
}

#[tokio::test]
async fn watchdog_renewals_and_a_renewal_that_finds_the_key_gone() {
    snapshotter();
    let server = shared_server();
    let prefix = unique_prefix("m-renew");
    let locks = manager(&server, &prefix).await;
    let labels = [("template", "renew"), ("kind", "exclusive")];
    let renewed = [labels[0], labels[1], ("outcome", "renewed")];

    let guard = locks
        .lock(format!("renew:{MARK}"))
        .label("renew")
        .ttl(Duration::from_millis(300))
        .watchdog(true)
        .acquire()
        .await
        .unwrap();
    until("two renewals", || counter(names::RENEWALS, &renewed) >= 2).await;
    assert!(locks.stats().leases_renewed >= 2);

    // Someone deletes the key: the next renewal finds it gone, and the hold ends lost.
    let mut raw = support::raw(&server).await;
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}{{renew:{MARK}}}"))
        .query_async(&mut raw)
        .await
        .unwrap();
    let _ = guard.lost().await;
    assert!(guard.release().await.is_err());

    let lost = [labels[0], labels[1], ("outcome", "lost")];
    // Recorded right after the guard was told.
    until("the lost renewal", || counter(names::RENEWALS, &lost) >= 1).await;
    assert_eq!(counter(names::RENEWALS, &lost), 1);
    assert_eq!(counter(names::LOST, &labels), 1);
}

#[distributed_lock(key = "invoice:{id}", manager = locks)]
async fn invoice(locks: &LockManager, id: &str) -> Result<(), LockError> {
    let _ = id;
    Ok(())
}

#[tokio::test]
async fn labels_carry_the_template_and_never_the_key() {
    snapshotter();
    let server = shared_server();
    let prefix = unique_prefix("m-labels");
    let locks = manager(&server, &prefix).await;

    invoice(&locks, &format!("{MARK}-7")).await.unwrap();
    let guard = locks
        .lock(format!("manual:{MARK}"))
        .acquire()
        .await
        .unwrap();
    guard.release().await.unwrap();

    let acquired = ("outcome", "acquired");
    let macro_labels = [
        ("template", "invoice:{id}"),
        ("kind", "exclusive"),
        acquired,
    ];
    assert_eq!(counter(names::ACQUIRES, &macro_labels), 1);
    assert!(counter(names::ACQUIRES, &[("template", "<manual>"), acquired]) >= 1);

    let all = seen();
    assert!(all.len() >= 5, "{all:?}");
    for (key, _) in &all {
        for label in key.key().labels() {
            assert!(
                !label.value().contains(MARK) && !label.value().contains(&prefix),
                "a full key in a label: {key:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_sets_nested_holds_carry_its_label() {
    snapshotter();
    let server = shared_server();
    let prefix = unique_prefix("m-set");
    let locks = manager(&server, &prefix).await;
    let labels = [
        ("template", "transfer:{from}:{to}"),
        ("kind", "exclusive"),
        ("outcome", "acquired"),
    ];
    distlock::scope(async {
        let outer = locks
            .lock(format!("acct:{MARK}-1"))
            .label("account:{id}")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        // One key of the set is already this task's: a nested hold, under the set's label.
        let set = locks
            .lock_all([format!("acct:{MARK}-1"), format!("acct:{MARK}-2")])
            .label("transfer:{from}:{to}")
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        assert_eq!(counter(names::ACQUIRES, &labels), 1);
        set.release().await.unwrap();
        outer.release().await.unwrap();
    })
    .await;
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test]
async fn a_set_records_its_hold_as_a_single_lock_does() {
    snapshotter();
    let server = shared_server();
    let prefix = unique_prefix("m-set-hold");
    let locks = manager(&server, &prefix).await;
    let labels = [("template", "pair:{a}:{b}"), ("kind", "exclusive")];
    let pair = |ttl| {
        locks
            .lock_all([format!("pair:{MARK}-1"), format!("pair:{MARK}-2")])
            .label("pair:{a}:{b}")
            .ttl(ttl)
            .acquire()
    };

    // Released, then dropped: one hold each, neither lost.
    pair(Duration::from_secs(10))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    assert_eq!(histogram(names::HOLD, &labels).len(), 1);
    drop(pair(Duration::from_secs(10)).await.unwrap());
    assert_eq!(histogram(names::HOLD, &labels).len(), 2);
    assert_eq!(counter(names::LOST, &labels), 0);
    until("the dropped set is given back", || {
        keys(&server, &prefix).is_empty()
    })
    .await;

    // A set whose lease ran out ends lost.
    let set = pair(Duration::from_millis(100)).await.unwrap();
    let _ = set.lost().await;
    until("the keys expire", || keys(&server, &prefix).is_empty()).await;
    assert!(matches!(set.release().await, Err(LockError::Lost { .. })));
    assert_eq!(histogram(names::HOLD, &labels).len(), 3);
    assert_eq!(counter(names::LOST, &labels), 1);
}
