//! `distlock run KEY -- CMD`: a command run while a lock is held, against a real server.

use std::time::{Duration, Instant};

use distlock::testing::{Fault, FaultProxy, RedisServer};

use crate::cli::{BOUND, Running, await_state, dead, finished, process_state};
use crate::support::{manager, raw, shared_server, unique_prefix};

/// A shell command for `run`: `sh -c SCRIPT`.
fn sh(script: &str) -> [&str; 3] {
    ["sh", "-c", script]
}

/// Runs `args` then `-- sh -c script`.
fn with_script<'a>(args: &[&'a str], script: &'a str) -> Vec<&'a str> {
    let mut all = args.to_vec();
    all.push("--");
    all.extend(sh(script));
    all
}

/// Waits for SIGTERM in a loop of at most a minute (so that nothing outlives a failed test for
/// long); says `ready` first.
const LOOP: &str = "i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";

/// Waits until the server has a subscriber on `channel`.
async fn subscribed(server: &RedisServer, channel: &str) {
    let started = Instant::now();
    loop {
        let reply = server
            .command(&["PUBSUB", "NUMSUB", channel])
            .unwrap_or_default();
        // The channel, then its number of subscribers (`:1`).
        let count = reply
            .lines()
            .nth(1)
            .map(|n| n.trim().trim_start_matches(':'));
        if count.is_some_and(|n| n.parse::<u32>().is_ok_and(|n| n > 0)) {
            return;
        }
        assert!(
            started.elapsed() < BOUND,
            "nobody subscribed to {channel}: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_runs_holding_the_lock_and_its_exit_code_passes_through() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-code");
    let locks = manager(&server, &prefix).await;
    let url = server.url();
    let script =
        r#"echo "$DISTLOCK_KEY $DISTLOCK_TOKEN $DISTLOCK_FENCING_TOKEN"; read line; exit 7"#;
    let mut run = Running::start(
        &url,
        &prefix,
        &with_script(&["run", "job", "--fencing"], script),
    );
    let line = run.line().await;
    let words: Vec<&str> = line.split(' ').collect();
    assert_eq!(words.len(), 3, "{line}");
    assert_eq!(words[0], "job");
    // While the command runs, the lock is held with the token and fence it was given.
    let info = locks.inspect("job").await.unwrap().expect("held");
    assert_eq!(info.holders.len(), 1, "{info:?}");
    assert_eq!(info.holders[0].token, words[1]);
    assert_eq!(
        info.holders[0].fence.map(|f| f.to_string()).as_deref(),
        Some(words[2])
    );
    run.write("done\n").await;
    let exited = run.exit().await;
    assert_eq!(exited.code, Some(7), "{exited:?}");
    assert!(locks.inspect("job").await.unwrap().is_none(), "given back");

    let ok = finished(&url, &prefix, &with_script(&["run", "job"], "exit 0")).await;
    assert_eq!(ok.code, Some(0), "{ok:?}");
    // A command that dies of a signal reports as a shell does: 128 + N.
    let killed = finished(&url, &prefix, &with_script(&["run", "job"], "kill -9 $$")).await;
    assert_eq!(killed.code, Some(128 + 9), "{killed:?}");
    let missing = finished(&url, &prefix, &["run", "job", "--", "/nonexistent/cmd"]).await;
    assert_eq!(missing.code, Some(127), "{missing:?}");
    assert!(locks.inspect("job").await.unwrap().is_none(), "given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_is_skipped_or_failed_with_the_busy_code_and_the_holder_named() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-busy");
    let locks = manager(&server, &prefix).await;
    let url = server.url();
    let held = locks.lock("nightly").acquire().await.unwrap();
    let who = locks.identity().to_string();
    for (on_busy, says) in [
        (&["--on-busy", "skip"][..], "skipped `sh`"),
        (&["--on-busy", "fail"][..], "`sh` not run"),
        (&["--wait", "300ms"][..], "gave up after"),
    ] {
        let mut args = vec!["run", "nightly"];
        args.extend(on_busy);
        let busy = finished(&url, &prefix, &with_script(&args, "echo ran")).await;
        assert_eq!(busy.code, Some(75), "{on_busy:?}: {busy:?}");
        assert!(busy.rest.is_empty(), "the command did not run: {busy:?}");
        assert!(busy.stderr.contains(says), "{}", busy.stderr);
        assert!(
            busy.stderr.contains(held.token()) && busy.stderr.contains(&who),
            "the holder is named: {}",
            busy.stderr
        );
    }
    held.release().await.unwrap();

    // Readers share; a writer or an exclusive lock waits for them; permits count.
    let reader = locks.read_lock("doc").acquire().await.unwrap();
    let read = finished(
        &url,
        &prefix,
        &with_script(&["run", "doc", "--mode", "read"], "echo ran"),
    )
    .await;
    assert_eq!(
        (read.code, read.rest.as_slice()),
        (Some(0), &["ran".to_owned()][..]),
        "{read:?}"
    );
    let write = ["run", "doc", "--mode", "write", "--on-busy", "fail"];
    let write = finished(&url, &prefix, &with_script(&write, "echo ran")).await;
    assert_eq!(write.code, Some(75), "{write:?}");
    assert!(write.stderr.contains(reader.token()), "{}", write.stderr);
    reader.release().await.unwrap();
    let permit = locks.semaphore("pool", 2).acquire().await.unwrap();
    let second = ["run", "pool", "--permits", "2", "--on-busy", "fail"];
    let second = finished(&url, &prefix, &with_script(&second, "echo ran")).await;
    assert_eq!(second.code, Some(0), "{second:?}");
    permit.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_and_prefix_need_no_environment_and_win_over_it() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-url");
    let locks = manager(&server, &prefix).await;
    let url = server.url();
    let held = locks.lock("k").acquire().await.unwrap();
    // The environment points elsewhere: --url and --prefix decide.
    let elsewhere = [
        ("DISTLOCK_URL", "redis://127.0.0.1:1"),
        ("DISTLOCK_KEY_PREFIX", "elsewhere:"),
    ];
    let global = ["--url", url.as_str(), "--prefix", prefix.as_str()];
    let args = with_script(&["run", "k", "--on-busy", "fail"], "echo ran");
    let busy = Running::start_with(&elsewhere, &global, &args).exit().await;
    assert_eq!(busy.code, Some(75), "the key under --prefix: {busy:?}");
    held.release().await.unwrap();
    let listed = Running::start_with(&[], &["--url", &url], &["list"])
        .exit()
        .await;
    assert_eq!(listed.code, Some(0), "--url alone: {listed:?}");

    // Redis out of reach has a code of its own.
    let unreachable = Running::start_with(&[], &["--url", "redis://127.0.0.1:1"], &args)
        .exit()
        .await;
    assert_eq!(unreachable.code, Some(69), "{unreachable:?}");
    assert!(unreachable.rest.is_empty(), "{unreachable:?}");
    let bad = Running::start_with(&[], &["--url", "http://x:1"], &args)
        .exit()
        .await;
    assert_eq!(bad.code, Some(78), "{bad:?}");
    assert!(bad.stderr.contains("--url"), "{}", bad.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_kills_the_command_within_one_renewal() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-lost");
    let locks = manager(&server, &prefix).await;
    // Renewed every 2 s (a third of the lease). The key is gone: another holder may already
    // run, so the command is killed at once, whatever its grace and its trap.
    let (ttl, renewal) = ("6s", Duration::from_secs(2));
    let script = format!("trap 'echo term' TERM; echo \"ready $$\"; {LOOP}");
    let args = ["run", "lease", "--ttl", ttl, "--grace", "5s"];
    let mut run = Running::start(&server.url(), &prefix, &with_script(&args, &script));
    let pid = ready_pid(&run.line().await);
    assert!(locks.inspect("lease").await.unwrap().is_some());
    let mut redis = raw(&server).await;
    let deleted: u32 = redis::cmd("DEL")
        .arg(locks.redis_key("lease"))
        .query_async(&mut redis)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let lost_at = Instant::now();
    dead(pid).await;
    let stopped_in = lost_at.elapsed();
    // One renewal interval, and a second for the round trips of a busy machine: well under
    // the grace period, which a run that waited it out would take.
    assert!(
        stopped_in < renewal + Duration::from_secs(1),
        "killed {stopped_in:?} after the key was deleted"
    );
    let exited = run.exit().await;
    assert_eq!(exited.code, Some(111), "{exited:?}");
    assert!(
        exited.stderr.contains("no longer held"),
        "{}",
        exited.stderr
    );
    assert!(locks.inspect("lease").await.unwrap().is_none());
}

/// The pid in a command's `ready PID` line.
fn ready_pid(line: &str) -> u32 {
    let pid = line
        .strip_prefix("ready ")
        .unwrap_or_else(|| panic!("{line}"));
    pid.parse().unwrap_or_else(|_| panic!("{line}"))
}

/// Cut off from Redis, `run` hears of no loss; its command, which ignores SIGTERM and has the
/// default grace of 10 s, is still killed before the lease can end: a second `run` that takes
/// the lock once the lease has run out never finds it alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_cut_off_from_redis_kills_its_command_before_the_lease_can_end() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-cut");
    let locks = manager(&server, &prefix).await;
    let proxy = FaultProxy::start(server.port()).unwrap();
    let script = format!("trap '' TERM; echo \"ready $$\"; {LOOP}");
    let args = ["run", "cut", "--ttl", "2s"];
    let mut first = Running::start(&proxy.url(), &prefix, &with_script(&args, &script));
    let pid = ready_pid(&first.line().await);
    assert!(locks.inspect("cut").await.unwrap().is_some(), "held");
    proxy.set(Fault::Blackhole);
    // Started at once, it waits for the lease to run out; its command looks at the first one
    // the moment it starts (a zombie not yet reaped is dead already).
    let check = format!(
        "if [ -e /proc/{pid} ] && ! grep -q '^State:.*Z' /proc/{pid}/status; \
         then echo overlap; else echo alone; fi"
    );
    let second = Running::start(
        &server.url(),
        &prefix,
        &with_script(&["run", "cut"], &check),
    );
    let exited = second.exit().await;
    assert_eq!(exited.code, Some(0), "{exited:?}");
    assert_eq!(
        exited.rest,
        ["alone"],
        "both commands ran at once: {exited:?}"
    );
    proxy.set(Fault::Pass);
    let exited = first.exit().await;
    assert_eq!(exited.code, Some(111), "{exited:?}");
    assert!(
        exited.stderr.contains("could not be renewed"),
        "{}",
        exited.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_sigint_reach_the_command_and_the_key_is_freed() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-signal");
    let locks = manager(&server, &prefix).await;
    // In a process group of its own, or in ours with --foreground.
    for (signal, code, args) in [
        ("TERM", 3, &["run", "svc"][..]),
        ("INT", 4, &["run", "svc"][..]),
        ("TERM", 5, &["run", "svc", "--foreground"][..]),
    ] {
        let script = format!("trap 'echo bye; exit {code}' {signal}; echo ready; {LOOP}");
        let mut run = Running::start(&server.url(), &prefix, &with_script(args, &script));
        assert_eq!(run.line().await, "ready");
        assert!(locks.inspect("svc").await.unwrap().is_some(), "held");
        run.signal(signal);
        assert_eq!(run.line().await, "bye");
        let exited = run.exit().await;
        assert_eq!(exited.code, Some(code), "{signal}: {exited:?}");
        assert!(
            locks.inspect("svc").await.unwrap().is_none(),
            "{signal}: freed"
        );
    }
    // A signal while waiting for the lock ends the wait, with the shell's 128 + N.
    let held = locks.lock("svc").acquire().await.unwrap();
    let waiting = Running::start(
        &server.url(),
        &prefix,
        &with_script(&["run", "svc"], "echo ran"),
    );
    // Waiting: it follows the lock's wake-up channel.
    subscribed(&server, &format!("{}:wake", locks.redis_key("svc"))).await;
    waiting.signal("TERM");
    let exited = waiting.exit().await;
    assert_eq!(
        (exited.code, exited.rest.len()),
        (Some(143), 0),
        "{exited:?}"
    );
    held.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_hold_keeps_a_second_run_in_the_same_window_from_running() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-min-hold");
    let locks = manager(&server, &prefix).await;
    let url = server.url();
    let args = ["run", "report", "--min-hold", "30s", "--on-busy", "skip"];
    let first = finished(&url, &prefix, &with_script(&args, "echo ran")).await;
    assert_eq!(first.code, Some(0), "{first:?}");
    assert_eq!(first.rest, ["ran"]);
    let second = finished(&url, &prefix, &with_script(&args, "echo ran")).await;
    assert_eq!(second.code, Some(75), "{second:?}");
    assert!(
        second.rest.is_empty(),
        "ran twice in one window: {second:?}"
    );
    assert!(second.stderr.contains("min-hold"), "{}", second.stderr);
    locks.force_release("report").await.unwrap();
}

/// SIGHUP (the terminal or the ssh session went away) and SIGQUIT end `run` as SIGTERM does:
/// passed on to the command, which is gone when `run` exits, and the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_sigquit_end_the_command_and_free_the_key() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-hup");
    let locks = manager(&server, &prefix).await;
    for (signal, trap, code) in [
        ("HUP", "trap 'echo bye; exit 6' HUP;", 6),
        ("QUIT", "trap 'echo bye; exit 7' QUIT;", 7),
        // Without a trap, the command dies of the signal, as a shell reports it.
        ("HUP", "", 128 + 1),
        ("QUIT", "", 128 + 3),
    ] {
        let script = format!("{trap} echo \"ready $$\"; {LOOP}");
        let mut run = Running::start(
            &server.url(),
            &prefix,
            &with_script(&["run", "svc"], &script),
        );
        let pid = ready_pid(&run.line().await);
        assert!(locks.inspect("svc").await.unwrap().is_some(), "held");
        run.signal(signal);
        if !trap.is_empty() {
            assert_eq!(run.line().await, "bye", "{signal}");
        }
        let exited = run.exit().await;
        assert_eq!(exited.code, Some(code), "{signal}: {exited:?}");
        assert_eq!(process_state(pid), None, "{signal}: the command is gone");
        assert!(
            locks.inspect("svc").await.unwrap().is_none(),
            "{signal}: freed"
        );
    }
}

/// `run` killed with SIGKILL takes its command with it (Linux: the parent-death signal).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_to_run_kills_the_command() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-kill");
    let locks = manager(&server, &prefix).await;
    let script = "echo \"ready $$\"; exec sleep 60";
    let mut run = Running::start(
        &server.url(),
        &prefix,
        &with_script(&["run", "svc", "--ttl", "2s"], script),
    );
    let pid = ready_pid(&run.line().await);
    assert!(locks.inspect("svc").await.unwrap().is_some(), "held");
    run.signal("KILL");
    dead(pid).await;
    let exited = run.exit().await;
    assert_eq!(exited.code, None, "killed: {exited:?}");
    // The key is left to its lease: a second run gets it once that has run out.
    let next = finished(
        &server.url(),
        &prefix,
        &with_script(&["run", "svc"], "echo ran"),
    )
    .await;
    assert_eq!(
        (next.code, next.rest.as_slice()),
        (Some(0), &["ran".to_owned()][..])
    );
}

/// `run` killed with SIGKILL takes what its command started with it too: a shell's
/// background job, which the parent-death signal (the command's alone) does not reach, is
/// killed by the watcher of the command's process group.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_to_run_kills_what_the_command_started() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-kill-group");
    let script = "sleep 60 & echo \"ready $!\"; wait";
    let mut run = Running::start(
        &server.url(),
        &prefix,
        &with_script(&["run", "svc", "--ttl", "2s"], script),
    );
    let job = ready_pid(&run.line().await);
    assert!(process_state(job).is_some(), "the background job runs");
    run.signal("KILL");
    dead(job).await;
    let exited = run.exit().await;
    assert_eq!(exited.code, None, "killed: {exited:?}");
}

/// Ctrl-Z stops the command, not `run`: the lease stays renewed while the command is stopped
/// (another run gives up waiting for it, over several leases), and SIGCONT continues it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigtstp_stops_the_command_while_the_lease_is_kept_and_sigcont_continues_it() {
    let server = shared_server();
    let prefix = unique_prefix("cli-run-tstp");
    let locks = manager(&server, &prefix).await;
    let script = r#"echo "ready $$"; read line; echo "got $line"; exit 4"#;
    let mut run = Running::start(
        &server.url(),
        &prefix,
        &with_script(&["run", "job", "--ttl", "1s"], script),
    );
    let pid = ready_pid(&run.line().await);
    run.signal("TSTP");
    await_state(pid, "stopped", |state| state == Some('T')).await;
    // Three leases of waiting: a lease left to run out would have let it in.
    let args = ["run", "job", "--wait", "3s"];
    let second = finished(&server.url(), &prefix, &with_script(&args, "echo ran")).await;
    assert_eq!(
        second.code,
        Some(75),
        "ran beside a stopped holder: {second:?}"
    );
    assert!(second.rest.is_empty(), "{second:?}");
    assert_eq!(process_state(pid), Some('T'), "still stopped");
    assert!(
        process_state(run.pid()).is_some_and(|s| s != 'T'),
        "run itself runs"
    );
    run.signal("CONT");
    await_state(pid, "continued", |state| state != Some('T')).await;
    run.write("on\n").await;
    assert_eq!(run.line().await, "got on");
    let exited = run.exit().await;
    assert_eq!(exited.code, Some(4), "{exited:?}");
    assert!(locks.inspect("job").await.unwrap().is_none(), "given back");
}
