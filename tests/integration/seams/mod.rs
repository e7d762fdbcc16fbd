//! Where two features meet: a nested acquire inside a hold that was lost, `min_hold` inside a
//! set, wake-ups after a `min_hold` marker or a forced release, an attempt that lands after
//! its retry. Each as a user would trip over it, on real servers: one server, and each seam
//! again on a Cluster, behind Sentinels and on RedLock (`every_seam_holds_*`; RedLock has no
//! fencing tokens, and Sentinel no proxy on its master's path).

mod deployment;

use std::time::{Duration, Instant};

use distlock::{LockError, LockManager, distributed_lock};

use deployment::Deployment;

use crate::support::{self, unique_prefix};

/// Each seam on the test binary's shared server (a late attempt: on a server of its own,
/// behind a proxy).
mod one_server {
    use super::*;

    #[tokio::test]
    async fn a_nested_acquire_inside_a_lost_hold_is_refused() {
        super::a_nested_acquire_inside_a_lost_hold_is_refused(&Deployment::single()).await;
    }

    #[tokio::test]
    async fn an_annotated_reentrant_call_inside_a_lost_hold_does_not_run() {
        super::an_annotated_reentrant_call_inside_a_lost_hold_does_not_run(&Deployment::single())
            .await;
    }

    #[tokio::test]
    async fn a_nested_acquire_during_the_last_release_waits_for_it() {
        super::a_nested_acquire_during_the_last_release_waits_for_it(&Deployment::single()).await;
    }

    #[tokio::test]
    async fn a_min_hold_nested_in_a_set_is_kept_when_the_set_is_released_or_dropped() {
        let d = Deployment::single();
        super::a_min_hold_nested_in_a_set_is_kept_when_the_set_is_released_or_dropped(&d).await;
    }

    #[tokio::test]
    async fn a_release_that_leaves_a_min_hold_marker_wakes_waiters_elsewhere() {
        let d = Deployment::single();
        super::a_release_that_leaves_a_min_hold_marker_wakes_waiters_elsewhere(&d).await;
    }

    #[tokio::test]
    async fn a_waiter_behind_its_own_managers_holder_takes_a_force_released_lock() {
        let d = Deployment::single();
        super::a_waiter_behind_its_own_managers_holder_takes_a_force_released_lock(&d).await;
    }

    #[tokio::test]
    async fn a_late_first_attempt_never_keeps_the_key_after_its_retry_was_released() {
        let d = Deployment::own_server().through_proxies();
        super::a_late_first_attempt_never_keeps_the_key_after_its_retry_was_released(&d, false)
            .await;
    }

    #[tokio::test]
    async fn a_late_attempt_of_a_request_that_gave_up_is_given_back() {
        let d = Deployment::own_server().through_proxies();
        super::a_late_attempt_of_a_request_that_gave_up_is_given_back(&d).await;
    }

    #[tokio::test]
    async fn a_waiter_behind_its_own_managers_holder_takes_a_deleted_lock() {
        let d = Deployment::single();
        super::a_waiter_behind_its_own_managers_holder_takes_a_deleted_lock(&d).await;
    }

    #[tokio::test]
    async fn shutdown_keeps_a_min_hold_nested_after_the_hold_was_taken() {
        let d = Deployment::single();
        super::shutdown_keeps_a_min_hold_nested_after_the_hold_was_taken(&d).await;
    }

    #[tokio::test]
    async fn a_release_whose_reply_was_lost_never_answers_ok_for_a_lock_gone_before() {
        let d = Deployment::own_server().through_proxies();
        super::a_release_whose_reply_was_lost_never_answers_ok_for_a_lock_gone_before(&d).await;
    }

    #[tokio::test]
    async fn a_set_whose_nested_hold_ends_while_it_waits_is_refused() {
        super::a_set_whose_nested_hold_ends_while_it_waits_is_refused(&Deployment::single()).await;
    }
}

/// The seams with no fault of the network, one after another on `d`.
async fn every_seam(d: &Deployment) {
    a_nested_acquire_inside_a_lost_hold_is_refused(d).await;
    an_annotated_reentrant_call_inside_a_lost_hold_does_not_run(d).await;
    a_nested_acquire_during_the_last_release_waits_for_it(d).await;
    a_min_hold_nested_in_a_set_is_kept_when_the_set_is_released_or_dropped(d).await;
    a_release_that_leaves_a_min_hold_marker_wakes_waiters_elsewhere(d).await;
    a_waiter_behind_its_own_managers_holder_takes_a_force_released_lock(d).await;
    a_set_whose_nested_hold_ends_while_it_waits_is_refused(d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_seam_holds_on_a_cluster() {
    let d = Deployment::cluster();
    every_seam(&d).await;
    // The nodes now announce proxies in front of them, which hold the first attempt back.
    let d = d.through_proxies();
    a_late_first_attempt_never_keeps_the_key_after_its_retry_was_released(&d, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_seam_holds_behind_sentinel() {
    every_seam(&Deployment::sentinel()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_seam_holds_on_redlock() {
    let d = Deployment::redlock();
    every_seam(&d).await;
    let d = d.through_proxies();
    a_late_first_attempt_never_keeps_the_key_after_its_retry_was_released(&d, false).await;
}

async fn a_nested_acquire_inside_a_lost_hold_is_refused(d: &Deployment) {
    let prefix = unique_prefix("seams-nested-lost");
    let (a, b) = (d.manager(&prefix).await, d.manager(&prefix).await);
    distlock::scope(async {
        let outer = a.lock("k").reentrant(true).acquire().await.unwrap();
        // The lock is taken from under the holder, and another manager takes it.
        d.delete(&prefix, "k");
        let thief = b.lock("k").acquire().await.unwrap();
        let nested = a.lock("k").reentrant(true).acquire().await;
        assert!(
            matches!(nested, Err(LockError::Lost { .. })),
            "a nested acquire of a stolen hold: {nested:?}"
        );
        // The refusal marked the hold lost: every guard of it sees that.
        assert!(outer.is_lost());
        let set = a.lock_all(["k", "j"]).reentrant(true).acquire().await;
        assert!(
            matches!(set, Err(LockError::Lost { .. })),
            "a set nesting a stolen hold: {:?}",
            set.as_ref().map(|_| ())
        );
        assert!(matches!(outer.release().await, Err(LockError::Lost { .. })));
        assert!(thief.is_held().await.unwrap(), "the thief keeps its lock");
        thief.release().await.unwrap();
    })
    .await;
}

#[distributed_lock(key = "k", reentrant, manager = locks)]
async fn nested_call(locks: &LockManager) -> Result<(), LockError> {
    Ok(())
}

async fn an_annotated_reentrant_call_inside_a_lost_hold_does_not_run(d: &Deployment) {
    let prefix = unique_prefix("seams-annotated-lost");
    let (a, b) = (d.manager(&prefix).await, d.manager(&prefix).await);
    distlock::scope(async {
        let outer = a.lock("k").reentrant(true).acquire().await.unwrap();
        d.delete(&prefix, "k");
        let thief = b.lock("k").acquire().await.unwrap();
        let ran = nested_call(&a).await;
        assert!(matches!(ran, Err(LockError::Lost { .. })), "{ran:?}");
        drop(outer);
        thief.release().await.unwrap();
    })
    .await;
}

async fn a_nested_acquire_during_the_last_release_waits_for_it(d: &Deployment) {
    let prefix = unique_prefix("seams-nested-releasing");
    let locks = d.manager(&prefix).await;
    let outer = locks.lock("k").reentrant(true).acquire().await.unwrap();
    // The release is on its way while a sibling of the same frame asks again.
    let (released, nested) = tokio::join!(outer.release(), async {
        locks
            .lock("k")
            .reentrant(true)
            .wait(Duration::from_secs(5))
            .acquire()
            .await
    });
    released.unwrap();
    let nested = nested.unwrap();
    // A fresh owner: it holds the lock on the server, under a token of its own.
    assert!(nested.is_held().await.unwrap());
    nested.release().await.unwrap();
    assert!(d.keys(&prefix).is_empty());
}

/// Waits until `locks` takes `key`, with `wait`: when it got it, from `from`.
async fn taken_after(locks: &LockManager, key: &str, from: Instant) -> Duration {
    let guard = locks
        .lock(key)
        .wait(Duration::from_secs(8))
        .retry_delay(Duration::from_millis(2))
        .acquire()
        .await
        .unwrap();
    let after = from.elapsed();
    guard.release().await.unwrap();
    after
}

async fn a_min_hold_nested_in_a_set_is_kept_when_the_set_is_released_or_dropped(d: &Deployment) {
    let prefix = unique_prefix("seams-set-min-hold");
    let (a, b) = (d.manager(&prefix).await, d.manager(&prefix).await);
    for drop_it in [false, true] {
        let started = Instant::now();
        let set = distlock::scope(async {
            let set = a
                .lock_all(["k", "j"])
                .reentrant(true)
                .acquire()
                .await
                .unwrap();
            let inner = a
                .lock("k")
                .reentrant(true)
                .min_hold(Duration::from_millis(800))
                .acquire()
                .await
                .unwrap();
            inner.release().await.unwrap();
            set
        })
        .await;
        if drop_it {
            drop(set);
        } else {
            set.release().await.unwrap();
        }
        let k = taken_after(&b, "k", started).await;
        assert!(
            k >= Duration::from_millis(800),
            "k free {k:?} after a nested min_hold of 800 ms (dropped: {drop_it})"
        );
    }
}

async fn a_release_that_leaves_a_min_hold_marker_wakes_waiters_elsewhere(d: &Deployment) {
    let prefix = unique_prefix("seams-marker-wakes");
    let (a, b) = (d.manager(&prefix).await, d.manager(&prefix).await);
    for plain in [true, false]
        .into_iter()
        .filter(|plain| *plain || d.fences())
    {
        let started = Instant::now();
        let holder = a
            .lock("k")
            .ttl(Duration::from_secs(10))
            .min_hold(Duration::from_millis(300))
            .fencing(!plain)
            .acquire()
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { taken_after(&b, "k", started).await }
        });
        support::until_waiting(&b, 1).await;
        holder.release().await.unwrap();
        let taken = waiter.await.unwrap();
        // Free at 300 ms: taken then, not at the 10 s lease's end.
        assert!(
            taken >= Duration::from_millis(300) && taken < Duration::from_secs(3),
            "taken {taken:?} after a 300 ms min_hold (plain: {plain})"
        );
    }
}

async fn a_waiter_behind_its_own_managers_holder_takes_a_force_released_lock(d: &Deployment) {
    let prefix = unique_prefix("seams-forced-here");
    let (a, operator) = (d.manager(&prefix).await, d.manager(&prefix).await);
    // The holder got the key by a hand-off from a release of the same manager.
    let first = a
        .lock("k")
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let second = tokio::spawn({
        let a = a.clone();
        async move {
            a.lock("k")
                .ttl(Duration::from_secs(20))
                .wait(Duration::from_secs(10))
                .acquire()
                .await
        }
    });
    support::until_waiting(&a, 1).await;
    first.release().await.unwrap();
    let holder = second.await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let a = a.clone();
        async move {
            let started = Instant::now();
            let guard = a
                .lock("k")
                .wait(Duration::from_secs(10))
                .acquire()
                .await
                .unwrap();
            let waited = started.elapsed();
            guard.release().await.unwrap();
            waited
        }
    });
    support::until_waiting(&a, 1).await;
    let removed = operator.force_release("k").await.unwrap().unwrap();
    // (On RedLock, a master the release before had not reached yet may name that token too.)
    assert!(
        removed.holders.iter().any(|h| h.token == holder.token()),
        "the forced release removed {:?}",
        removed.holders
    );
    let waited = waiter.await.unwrap();
    assert!(
        waited < Duration::from_secs(3),
        "the waiter took the freed key after {waited:?}"
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::Lost { .. })
    ));
}

/// Starts taking `k` with a 30 s lease from `locks`, waiting up to `wait`, on a task of its
/// own.
fn spawn_acquire(
    locks: &LockManager,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<distlock::LockGuard, LockError>> {
    let locks = locks.clone();
    tokio::spawn(async move {
        let request = locks.lock("k").ttl(Duration::from_secs(30)).wait(wait);
        request.acquire().await
    })
}

/// Polls `done` every few milliseconds until it holds; fails naming `what` after `within`.
pub(super) async fn until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < within, "{what} did not happen");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn a_late_first_attempt_never_keeps_the_key_after_its_retry_was_released(
    d: &Deployment,
    may_land_first: bool,
) {
    let prefix = unique_prefix("seams-late-first");
    let locks = d.proxied_manager(&prefix).await;
    let key = format!("{prefix}{{k}}");
    // The first attempt is held back 1 s by the network, far past its response timeout; the
    // retry goes through at once and is granted.
    let before = d.hold_back(Duration::from_secs(1));
    let request = spawn_acquire(&locks, Duration::from_secs(10));
    d.pass_once_held(&before, "the first attempt reaching the proxy")
        .await;
    let guard = request.await.unwrap().unwrap();
    assert!(guard.attempts() >= 2, "granted by a retry");
    guard.release().await.unwrap();
    // Then the first attempt lands, on a key nobody holds, and takes it for the released
    // token: the release is sent again once no late delivery can happen, well inside the
    // 30 s lease it would otherwise keep.
    let landed = d.seen_until_delivered(&prefix, &key).await;
    // A Cluster lane is one connection per master: the retry went after the first attempt on
    // it, so the first attempt landed before its retry, not after the release.
    assert!(
        landed || may_land_first,
        "the first attempt did not land after the release"
    );
    until(Duration::from_secs(10), "the late grant given back", || {
        !d.keys(&prefix).contains(&key)
    })
    .await;
    let other = d.manager(&prefix).await;
    let taken = other.lock("k").try_acquire().await.unwrap();
    taken.expect("the key is free").release().await.unwrap();
}

async fn a_set_whose_nested_hold_ends_while_it_waits_is_refused(d: &Deployment) {
    let prefix = unique_prefix("seams-set-nested-expiring");
    let (a, b, c) = (
        d.manager(&prefix).await,
        d.manager(&prefix).await,
        d.manager(&prefix).await,
    );
    let blocker = c
        .lock("j")
        .ttl(Duration::from_secs(10))
        .acquire()
        .await
        .unwrap();
    distlock::scope(async {
        let outer = a
            .lock("k")
            .ttl(Duration::from_millis(150))
            .reentrant(true)
            .acquire()
            .await
            .unwrap();
        // The set nests `k` and waits for `j`; meanwhile `k`'s lease runs out and another
        // manager takes it, and only then is `j` free.
        let set = a
            .lock_all(["k", "j"])
            .reentrant(true)
            .wait(Duration::from_secs(10))
            .acquire();
        let thief = async {
            let thief = b
                .lock("k")
                .ttl(Duration::from_secs(10))
                .wait(Duration::from_secs(10))
                .acquire()
                .await
                .unwrap();
            blocker.release().await.unwrap();
            thief
        };
        let (set, thief) = tokio::join!(set, thief);
        assert!(
            matches!(&set, Err(LockError::Lost { key, .. }) if key == "k"),
            "a set nesting a hold that ended while it waited: {:?}",
            set.as_ref().map(|_| ())
        );
        assert!(outer.is_lost());
        assert!(thief.is_held().await.unwrap(), "the thief keeps `k`");
        // The set's own lock went back with the refusal.
        let j = c.lock("j").try_acquire().await.unwrap();
        assert!(j.is_some(), "`j` was left held by the refused set");
        thief.release().await.unwrap();
    })
    .await;
}

/// A request whose first attempt went unanswered, whose retry was refused, and which then
/// gave up: its first attempt lands once the holder has released, and takes the key for a
/// request that is gone. It is given back once no late delivery can happen.
async fn a_late_attempt_of_a_request_that_gave_up_is_given_back(d: &Deployment) {
    let prefix = unique_prefix("seams-late-gave-up");
    let holder = d.manager(&prefix).await;
    let held = holder
        .lock("k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let locks = d.proxied_manager(&prefix).await;
    let key = format!("{prefix}{{k}}");
    let before = d.hold_back(Duration::from_secs(2));
    let request = spawn_acquire(&locks, Duration::from_millis(600));
    d.pass_once_held(&before, "the first attempt reaching the proxy")
        .await;
    let gave_up = request.await.unwrap();
    assert!(
        gave_up.is_err(),
        "the key was held: {:?}",
        gave_up.map(|_| ())
    );
    held.release().await.unwrap();
    let landed = d.seen_until_delivered(&prefix, &key).await;
    assert!(landed, "the first attempt did not land after the release");
    until(Duration::from_secs(10), "the late grant given back", || {
        !d.keys(&prefix).contains(&key)
    })
    .await;
}

/// Until the wake channel of `key` under `prefix` is followed somewhere in `d`.
async fn until_followed(d: &Deployment, prefix: &str, key: &str) {
    let wake = format!("{prefix}{{{key}}}:wake");
    until(Duration::from_secs(10), "the wake channel followed", || {
        (d.data().iter())
            .filter_map(|node| node.command(&["PUBSUB", "NUMSUB", &wake]).ok())
            .any(|reply| {
                reply
                    .lines()
                    .nth(1)
                    .is_some_and(|n| n.trim_start_matches(':') != "0")
            })
    })
    .await;
}

/// A request for `k` with a 6 s lease the watchdog renews.
fn watched(locks: &LockManager) -> distlock::LockRequest<'_> {
    locks.lock("k").ttl(Duration::from_secs(6)).watchdog(true)
}

/// As `a_waiter_behind_its_own_managers_holder_takes_a_force_released_lock`, with the key
/// deleted behind distlock's back (which announces nothing): the holder's watchdog finds its
/// lease lost at its next renewal, and that wakes the waiter behind it.
async fn a_waiter_behind_its_own_managers_holder_takes_a_deleted_lock(d: &Deployment) {
    let prefix = unique_prefix("seams-deleted-here");
    let a = d.manager(&prefix).await;
    // The holder got the key by a hand-off from a release of the same manager, whose channel
    // was followed by then: the waiter behind it trusts it to hand the key on.
    let first = watched(&a).acquire().await.unwrap();
    let second = tokio::spawn({
        let a = a.clone();
        async move { watched(&a).wait(Duration::from_secs(10)).acquire().await }
    });
    support::until_waiting(&a, 1).await;
    until_followed(d, &prefix, "k").await;
    first.release().await.unwrap();
    let holder = second.await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let a = a.clone();
        async move {
            let guard = a
                .lock("k")
                .wait(Duration::from_secs(20))
                .acquire()
                .await
                .unwrap();
            let at = Instant::now();
            guard.release().await.unwrap();
            at
        }
    });
    support::until_waiting(&a, 1).await;
    d.delete(&prefix, "k");
    let deleted = Instant::now();
    holder.lost().await;
    let entered = waiter.await.unwrap();
    // Renewals come every 2 s: the first after the deletion finds the lease lost and wakes
    // the waiter, which does not sleep out the 6 s its holder's lease would have run.
    assert!(
        entered.saturating_duration_since(deleted) < Duration::from_millis(3_500),
        "the waiter took the deleted key after {:?}",
        entered.saturating_duration_since(deleted)
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::Lost { .. })
    ));
}

/// A hold listed with the manager before a hold nested in it asked for a `min_hold`: the
/// manager's shutdown keeps the key until that `min_hold` ends.
async fn shutdown_keeps_a_min_hold_nested_after_the_hold_was_taken(d: &Deployment) {
    let prefix = unique_prefix("seams-shutdown-min-hold");
    let (a, b) = (d.manager(&prefix).await, d.manager(&prefix).await);
    let started = Instant::now();
    let outer = distlock::scope(async {
        let outer = a.lock("k").reentrant(true).acquire().await.unwrap();
        let inner = a
            .lock("k")
            .reentrant(true)
            .min_hold(Duration::from_millis(800))
            .acquire()
            .await
            .unwrap();
        inner.release().await.unwrap();
        outer
    })
    .await;
    a.shutdown().await;
    let k = taken_after(&b, "k", started).await;
    assert!(
        k >= Duration::from_millis(800),
        "k free {k:?} after a nested min_hold of 800 ms, the manager shut down"
    );
    drop(outer);
}

/// A holder's lock is deleted and taken by another manager; then its release is held back by
/// the network past its response timeout, and sent again: finding the lock gone, it cannot
/// tell whether its first send gave it back, and must not answer `Ok`.
async fn a_release_whose_reply_was_lost_never_answers_ok_for_a_lock_gone_before(d: &Deployment) {
    let prefix = unique_prefix("seams-release-unknown");
    let locks = d.proxied_manager(&prefix).await;
    let other = d.manager(&prefix).await;
    let holder = locks
        .lock("k")
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    d.delete(&prefix, "k");
    let thief = other.lock("k").acquire().await.unwrap();
    let before = d.hold_back(Duration::from_secs(1));
    let release = tokio::spawn(async move { holder.release().await });
    d.pass_once_held(&before, "the release reaching the proxy")
        .await;
    let released = release.await.unwrap();
    assert!(
        released.is_err(),
        "a release sent again that found another's lock answered {released:?}"
    );
    assert!(thief.is_held().await.unwrap(), "the thief keeps the lock");
    thief.release().await.unwrap();
}
