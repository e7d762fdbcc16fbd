//! `distlock lead NAME -- CMD` and `distlock leader NAME`: a command run by one replica at a
//! time, against a real server.

use std::time::{Duration, Instant};

use futures_util::FutureExt;

use distlock::testing::{Fault, FaultProxy};

use crate::cli::{Running, dead, finished, process_state, send_signal};
use crate::support::{manager, raw, shared_server, unique_prefix};

/// Says `leading TERM PID` (the shell's pid), then waits at most a minute, so that nothing
/// outlives a failed test for long.
const LEADING: &str = r#"echo "leading $DISTLOCK_TERM $$"; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"#;

/// The first line any of `replicas` but `except` prints, and which one printed it.
async fn first_line(replicas: &mut [Running], except: Option<usize>) -> (usize, String) {
    let waits = replicas
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| Some(*i) != except)
        .map(|(i, replica)| async move { (i, replica.line().await) }.boxed());
    futures_util::future::select_all(waits).await.0
}

/// `leading TERM PID` read back.
fn leading(line: &str) -> (u64, u32) {
    let words: Vec<&str> = line.split(' ').collect();
    assert_eq!(words.first(), Some(&"leading"), "{line}");
    (words[1].parse().unwrap(), words[2].parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_of_three_runs_the_command_and_another_takes_over_within_the_lease() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead");
    let url = server.url();
    let nobody = finished(&url, &prefix, &["leader", "scheduler"]).await;
    assert_eq!(nobody.code, Some(1), "{nobody:?}");
    assert_eq!(nobody.rest, ["scheduler: no leader"]);

    let ttl = Duration::from_secs(2);
    let args = [
        "lead",
        "scheduler",
        "--ttl",
        "2s",
        "--grace",
        "1s",
        "--",
        "sh",
        "-c",
        LEADING,
    ];
    let mut replicas: Vec<Running> = (0..3)
        .map(|_| Running::start(&url, &prefix, &args))
        .collect();
    let (first, line) = first_line(&mut replicas, None).await;
    let (term, child) = leading(&line);
    let shown = finished(&url, &prefix, &["leader", "scheduler"]).await;
    assert_eq!(shown.code, Some(0), "{shown:?}");
    let pid = format!("pid {} ", replicas[first].pid());
    assert!(
        shown.rest[0].starts_with(&format!("term {term}: ")) && shown.rest[0].contains(&pid),
        "{shown:?}"
    );
    // For two leases, while the leader renews, no other replica runs the command.
    let others = tokio::time::timeout(2 * ttl, first_line(&mut replicas, Some(first))).await;
    assert!(others.is_err(), "two leaders: {others:?}");

    // The leader dies without a word (its command with it): another takes over within the
    // lease, with a larger term.
    replicas[first].signal("KILL");
    send_signal(child, "KILL");
    let killed = Instant::now();
    let (next, line) = first_line(&mut replicas, Some(first)).await;
    let took_over = killed.elapsed();
    let (next_term, _) = leading(&line);
    assert!(next_term > term, "{line}");
    assert!(
        took_over < ttl + Duration::from_secs(1),
        "took {took_over:?} over a lease of {ttl:?}"
    );

    // SIGTERM reaches the leader's command; leadership is given back as it ends.
    let mut replicas = replicas.into_iter().enumerate();
    let mut rest = Vec::new();
    for (i, replica) in replicas.by_ref() {
        if i != first {
            replica.signal("TERM");
            rest.push((i, replica.exit().await));
        }
    }
    for (i, exited) in rest {
        // The leader's command died of SIGTERM; the other replica was campaigning.
        assert_eq!(
            exited.code,
            Some(128 + 15),
            "replica {i} (leader {next}): {exited:?}"
        );
    }
    let nobody = finished(&url, &prefix, &["leader", "scheduler"]).await;
    assert_eq!(nobody.code, Some(1), "resigned: {nobody:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_runs_one_term_and_a_lost_leadership_stops_the_command() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead-once");
    let locks = manager(&server, &prefix).await;
    let url = server.url();
    let script = r#"echo "$DISTLOCK_ELECTION $DISTLOCK_TERM"; exit 5"#;
    let once = finished(
        &url,
        &prefix,
        &["lead", "batch", "--once", "--", "sh", "-c", script],
    )
    .await;
    assert_eq!(once.code, Some(5), "{once:?}");
    assert!(once.rest[0].starts_with("batch "), "{once:?}");
    let nobody = finished(&url, &prefix, &["leader", "batch"]).await;
    assert_eq!(nobody.code, Some(1), "resigned: {nobody:?}");

    // Without --once it campaigns again after the command ends: a new term each time.
    let script = r#"echo "leading $DISTLOCK_TERM $$"; exit 0"#;
    let mut again = Running::start(&url, &prefix, &["lead", "batch", "--", "sh", "-c", script]);
    let (first, _) = leading(&again.line().await);
    let (second, _) = leading(&again.line().await);
    assert!(second > first, "{first} then {second}");
    again.signal("TERM");
    let exited = again.exit().await;
    assert!(matches!(exited.code, Some(0 | 143)), "{exited:?}");

    let script = "trap 'echo term; exit 0' TERM; echo ready; \
                  i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";
    let args = [
        "lead", "lost", "--once", "--ttl", "3s", "--", "sh", "-c", script,
    ];
    let mut lead = Running::start(&url, &prefix, &args);
    assert_eq!(lead.line().await, "ready");
    let mut redis = raw(&server).await;
    let deleted: u32 = redis::cmd("DEL")
        .arg(locks.redis_key("election:lost"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    // Leadership is over: the command is killed at once, its trap unheard.
    let exited = lead.exit().await;
    assert!(!exited.rest.contains(&"term".to_owned()), "{exited:?}");
    assert_eq!(exited.code, Some(111), "{exited:?}");
    assert!(
        exited.stderr.contains("leadership of `lost`"),
        "{}",
        exited.stderr
    );
}

/// SIGHUP and SIGQUIT end `lead` as SIGTERM does: the command gets the signal and is gone
/// when `lead` exits, leadership given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_sigquit_end_the_leaders_command_and_resign() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead-hup");
    let url = server.url();
    for (signal, code) in [("HUP", 128 + 1), ("QUIT", 128 + 3)] {
        let mut lead = Running::start(&url, &prefix, &["lead", "svc", "--", "sh", "-c", LEADING]);
        let (_, pid) = leading(&lead.line().await);
        lead.signal(signal);
        let exited = lead.exit().await;
        assert_eq!(exited.code, Some(code), "{signal}: {exited:?}");
        assert_eq!(process_state(pid), None, "{signal}: the command is gone");
        let nobody = finished(&url, &prefix, &["leader", "svc"]).await;
        assert_eq!(nobody.code, Some(1), "{signal}: resigned: {nobody:?}");
    }
}

/// A leader killed with SIGKILL takes its command with it (Linux: the parent-death signal).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_to_lead_kills_the_command() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead-kill");
    let script = r#"echo "leading $DISTLOCK_TERM $$"; exec sleep 60"#;
    let args = ["lead", "svc", "--ttl", "2s", "--", "sh", "-c", script];
    let mut lead = Running::start(&server.url(), &prefix, &args);
    let (_, pid) = leading(&lead.line().await);
    lead.signal("KILL");
    dead(pid).await;
    assert_eq!(lead.exit().await.code, None, "killed");
}

/// A leader cut off from Redis kills its command, which ignores SIGTERM, before its lease can
/// end: the next leader's command never finds it alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_redis_kills_its_command_before_another_leads() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead-cut");
    let proxy = FaultProxy::start(server.port()).unwrap();
    let script = r#"trap '' TERM; echo "leading $DISTLOCK_TERM $$"; exec sleep 60"#;
    let args = [
        "lead", "svc", "--ttl", "2s", "--once", "--", "sh", "-c", script,
    ];
    let mut first = Running::start(&proxy.url(), &prefix, &args);
    let (term, pid) = leading(&first.line().await);
    proxy.set(Fault::Blackhole);
    let check = format!(
        "echo $DISTLOCK_TERM; if [ -e /proc/{pid} ] && ! grep -q '^State:.*Z' /proc/{pid}/status; \
         then echo overlap; else echo alone; fi"
    );
    let args = ["lead", "svc", "--once", "--", "sh", "-c", &check];
    let second = finished(&server.url(), &prefix, &args).await;
    assert_eq!(second.code, Some(0), "{second:?}");
    assert_eq!(
        second.rest[1], "alone",
        "two leaders' commands at once: {second:?}"
    );
    assert!(second.rest[0].parse::<u64>().unwrap() > term, "{second:?}");
    proxy.set(Fault::Pass);
    let exited = first.exit().await;
    assert_eq!(exited.code, Some(111), "{exited:?}");
}

/// Ctrl-Z stops the leader's command, not `lead`: leadership stays renewed while the command
/// is stopped (another replica does not take over for several leases), and SIGCONT continues
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigtstp_stops_the_leaders_command_while_leadership_is_kept() {
    let server = shared_server();
    let prefix = unique_prefix("cli-lead-tstp");
    let url = server.url();
    let script = r#"echo "leading $DISTLOCK_TERM $$"; read line; echo "got $line"; exit 4"#;
    let args = [
        "lead", "svc", "--ttl", "1s", "--once", "--", "sh", "-c", script,
    ];
    let mut lead = Running::start(&url, &prefix, &args);
    let (_, pid) = leading(&lead.line().await);
    lead.signal("TSTP");
    crate::cli::await_state(pid, "stopped", |state| state == Some('T')).await;
    let mut other = Running::start(&url, &prefix, &["lead", "svc", "--", "sh", "-c", LEADING]);
    // For three leases, nobody else leads beside the stopped command.
    let others = tokio::time::timeout(Duration::from_secs(3), other.line()).await;
    assert!(others.is_err(), "two leaders: {others:?}");
    assert_eq!(process_state(pid), Some('T'), "still stopped");
    lead.signal("CONT");
    crate::cli::await_state(pid, "continued", |state| state != Some('T')).await;
    lead.write("on\n").await;
    assert_eq!(lead.line().await, "got on");
    assert_eq!(lead.exit().await.code, Some(4));
    // Resigned: the other replica leads now.
    let (_, next) = leading(&other.line().await);
    other.signal("TERM");
    other.exit().await;
    dead(next).await;
}
