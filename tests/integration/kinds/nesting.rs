//! Nested holds of one owner, of every kind: given back in any order, the key is free once
//! the last is, and not before the `min_hold` of any of them; nothing is left beside other
//! readers.

use super::*;

/// Two holds of `kind` in one task, given back in `order`; another owner stays out until
/// the last one is given back, then gets in at once.
async fn nested(kind: Kind, outer_first: bool, test: &str) {
    let server = shared_server();
    let prefix = unique_prefix(test);
    let locks = manager(&server, &prefix).await;
    let other = |kind: Kind| {
        let locks = locks.clone();
        // A spawned task is another owner.
        async move {
            tokio::spawn(async move {
                match try_take(&locks, kind, "k").await {
                    Some(guard) => {
                        guard.release().await.unwrap();
                        true
                    }
                    None => false,
                }
            })
            .await
            .unwrap()
        }
    };
    distlock::scope(async {
        let outer = request(&locks, kind, "k").reentrant(true).acquire().await;
        let outer = outer.unwrap();
        let inner = request(&locks, kind, "k").reentrant(true).acquire().await;
        let inner = inner.expect("nested hold");
        assert_eq!(inner.token(), outer.token());
        let (first, last) = if outer_first {
            (outer, inner)
        } else {
            (inner, outer)
        };
        first.release().await.unwrap();
        assert!(last.is_held().await.unwrap());
        assert!(!other(Write).await, "one hold is still held");
        last.release().await.unwrap();
    })
    .await;
    assert!(
        other(Write).await,
        "every hold was released: a writer gets in at once"
    );
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

#[tokio::test]
async fn nested_read_holds_released_outer_first() {
    nested(Read, true, "nestro").await;
}

#[tokio::test]
async fn nested_read_holds_released_inner_first() {
    nested(Read, false, "nestri").await;
}

#[tokio::test]
async fn nested_exclusive_holds_released_outer_first() {
    nested(Exclusive, true, "nestxo").await;
}

#[tokio::test]
async fn nested_write_holds_released_outer_first() {
    nested(Write, true, "nestwo").await;
}

#[tokio::test]
async fn nested_write_holds_released_inner_first() {
    nested(Write, false, "nestwi").await;
}

/// A nested hold that outlives an outer hold with `min_hold` still leaves the marker: the
/// window of the outer hold is kept whatever the order of release.
#[tokio::test]
async fn min_hold_of_an_outer_hold_released_first_is_kept() {
    let server = shared_server();
    let prefix = unique_prefix("nestmin");
    let locks = manager(&server, &prefix).await;
    distlock::scope(async {
        let outer = locks
            .write_lock("job")
            .reentrant(true)
            .min_hold(MIN_HOLD)
            .acquire()
            .await
            .unwrap();
        let inner = locks.lock("job").reentrant(true).acquire().await.unwrap();
        outer.release().await.unwrap();
        inner.release().await.unwrap();
    })
    .await;
    let others = locks.clone();
    let granted = tokio::spawn(async move { try_take(&others, Write, "job").await.is_some() })
        .await
        .unwrap();
    assert!(!granted, "a second run within the outer hold's min_hold");
    let next = locks
        .write_lock("job")
        .wait(Duration::from_secs(10))
        .retry_delay(Duration::from_millis(20))
        .acquire()
        .await
        .unwrap();
    next.release().await.unwrap();
    assert!(
        keys(&server, &prefix).is_empty(),
        "{:?}",
        keys(&server, &prefix)
    );
}

/// Nested read holds beside another owner's read share leave nothing of theirs in the lock
/// (the hash would otherwise grow while readers keep overlapping).
#[tokio::test]
async fn nested_read_holds_leave_nothing_behind_beside_other_readers() {
    let server = shared_server();
    let prefix = unique_prefix("nestclean");
    let locks = manager(&server, &prefix).await;
    let other = try_take(&locks, Read, "k").await.expect("free");
    for outer_first in [true, false] {
        distlock::scope(async {
            let outer = try_take(&locks, Read, "k").await.expect("readers overlap");
            let inner = try_take(&locks, Read, "k").await.expect("nested hold");
            let (first, last) = if outer_first {
                (outer, inner)
            } else {
                (inner, outer)
            };
            first.release().await.unwrap();
            last.release().await.unwrap();
        })
        .await;
    }
    let mut conn = raw(&server).await;
    let mut fields: Vec<String> = conn.hkeys(format!("{prefix}{{k}}")).await.unwrap();
    fields.sort();
    // The other reader's hold count and lease; nothing of the nested holds.
    let mut expected = vec![
        "mode".to_owned(),
        other.token().to_owned(),
        format!("s:{}", other.token()),
    ];
    expected.sort();
    assert_eq!(fields, expected);
    other.release().await.unwrap();
    assert!(keys(&server, &prefix).is_empty());
}
