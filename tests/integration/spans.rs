//! Spans for traces: `lock.acquire` while a request asks, `lock.hold` from the grant to the
//! release, a child of the caller's span, with fields that say how it went.

use std::time::Duration;

use distlock::{LockError, LockManager, distributed_lock};
use tracing::Instrument;

use crate::support::logs::Logs;
use crate::support::{self, shared_server, unique_prefix};

/// The captured line of the span named `name` whose `lock.key` is `key`, and its id.
fn span_of(logs: &Logs, name: &str, key: &str) -> (String, String) {
    let line = logs
        .lines()
        .into_iter()
        .find(|line| {
            line.starts_with(&format!("SPAN {name} ")) && line.contains(&format!("lock.key={key} "))
        })
        .unwrap_or_else(|| panic!("no {name} span for {key}: {:?}", logs.lines()));
    let id = field(&line, "id").to_owned();
    (line, id)
}

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {line}"))
}

/// What was recorded on the span `id` later (its outcome, say).
fn recorded(logs: &Logs, id: &str) -> Vec<String> {
    logs.lines()
        .into_iter()
        .filter(|line| line.starts_with(&format!("SPAN-RECORD id={id} ")))
        .collect()
}

fn closed(logs: &Logs, id: &str) -> bool {
    logs.lines().contains(&format!("SPAN-CLOSE id={id}"))
}

#[tokio::test(flavor = "current_thread")]
async fn a_request_that_waited_held_and_released_is_traced_under_the_callers_span() {
    let server = shared_server();
    let prefix = unique_prefix("spans");
    let (logs, _guard) = Logs::capture_here();
    let locks = support::manager(&server, &prefix).await;
    let other = support::manager(&server, &prefix).await;
    let held = other.lock("order:1").acquire().await.unwrap();
    let job = tracing::info_span!("job");
    let waiting = {
        let locks = locks.clone();
        async move {
            let guard = locks
                .lock("order:1")
                .fencing(true)
                .wait(Duration::from_secs(5))
                .acquire()
                .await
                .unwrap();
            let token = guard.token().to_owned();
            let fence = guard.fencing_token().unwrap();
            guard.release().await.unwrap();
            (token, fence)
        }
        .instrument(job.clone())
    };
    let waiter = tokio::spawn(waiting);
    support::until_waiting(&locks, 1).await;
    held.release().await.unwrap();
    let (token, fence) = waiter.await.unwrap();

    let job_id = job
        .id()
        .expect("the job's span is captured")
        .into_u64()
        .to_string();
    // The acquire span, a debug one, under the job, ended `acquired`.
    let (acquire, acquire_id) = {
        let lines = logs.lines();
        let line = lines
            .iter()
            .rfind(|l| {
                l.starts_with("SPAN lock.acquire ") && l.contains(&format!("parent={job_id} "))
            })
            .cloned()
            .unwrap_or_else(|| panic!("no lock.acquire under the job: {lines:?}"));
        let id = field(&line, "id").to_owned();
        (line, id)
    };
    assert!(acquire.contains("level=DEBUG"), "{acquire}");
    assert!(acquire.contains("lock.kind=\"exclusive\""), "{acquire}");
    assert!(
        recorded(&logs, &acquire_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"acquired\"")),
        "{:?}",
        recorded(&logs, &acquire_id)
    );
    // The hold span, an info one, a child of the job (not of the acquire span), with the
    // token and fencing token it wrote with, ended `released`, and closed.
    let hold = logs
        .lines()
        .into_iter()
        .rfind(|l| l.starts_with("SPAN lock.hold ") && l.contains(&format!("parent={job_id} ")))
        .unwrap_or_else(|| panic!("no lock.hold under the job: {:?}", logs.lines()));
    let hold_id = field(&hold, "id").to_owned();
    assert!(hold.contains("level=INFO"), "{hold}");
    assert!(hold.contains(&format!("lock.token={token:?}")), "{hold}");
    assert!(
        hold.contains(&format!("lock.fencing_token={fence}")),
        "{hold}"
    );
    assert!(hold.contains("lock.template=\"<manual>\""), "{hold}");
    assert!(
        recorded(&logs, &hold_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"released\"")),
        "{:?}",
        recorded(&logs, &hold_id)
    );
    assert!(closed(&logs, &hold_id), "the hold span is closed");
}

#[distributed_lock(key = "report:{day}", manager = locks)]
#[tracing::instrument(skip(locks))]
async fn report(locks: &LockManager, day: u32) -> Result<(), LockError> {
    Ok(())
}

#[tokio::test(flavor = "current_thread")]
async fn an_annotated_functions_hold_is_a_child_of_its_span_with_the_key_template() {
    let server = shared_server();
    let prefix = unique_prefix("spans-macro");
    let (logs, _guard) = Logs::capture_here();
    let locks = support::manager(&server, &prefix).await;
    report(&locks, 7).await.unwrap();
    let function = logs
        .lines()
        .into_iter()
        .find(|l| l.starts_with("SPAN report "))
        .unwrap_or_else(|| panic!("no span of the function: {:?}", logs.lines()));
    let function_id = field(&function, "id");
    let (hold, hold_id) = span_of(&logs, "lock.hold", "report:7");
    assert!(hold.contains(&format!("parent={function_id} ")), "{hold}");
    assert!(hold.contains("lock.template=\"report:{day}\""), "{hold}");
    assert!(
        recorded(&logs, &hold_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"released\"")),
        "{:?}",
        logs.lines()
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_hold_says_how_it_ended_lost_dropped_or_given_back_at_shutdown() {
    let server = shared_server();
    let prefix = unique_prefix("spans-end");
    let (logs, _guard) = Logs::capture_here();
    let locks = support::manager(&server, &prefix).await;

    // Lost: the key taken away, then the release finds it gone.
    let lost = locks.lock("lost").acquire().await.unwrap();
    server
        .command(&["DEL", &format!("{prefix}{{lost}}")])
        .unwrap();
    assert!(matches!(lost.release().await, Err(LockError::Lost { .. })));
    let (_, lost_id) = span_of(&logs, "lock.hold", "lost");
    assert!(
        recorded(&logs, &lost_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"lost\"")),
        "{:?}",
        logs.lines()
    );

    // Dropped without a release.
    drop(locks.lock("dropped").acquire().await.unwrap());
    let (_, dropped_id) = span_of(&logs, "lock.hold", "dropped");
    assert!(
        recorded(&logs, &dropped_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"dropped\"")),
        "{:?}",
        logs.lines()
    );

    // A set, given back at shutdown.
    let set = locks.lock_all(["a", "b"]).acquire().await.unwrap();
    locks.shutdown().await;
    drop(set);
    let (_, set_id) = span_of(&logs, "lock.hold", "a,b");
    assert!(
        recorded(&logs, &set_id)
            .iter()
            .any(|l| l.contains("lock.outcome=\"shutdown\"")),
        "{:?}",
        logs.lines()
    );
}
