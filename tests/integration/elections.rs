//! Leader elections across managers (as several processes), and who holds what: the holder's
//! identity in the inspector, in `Busy`, and in `CLIENT LIST`.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::{shared_server, unique_prefix};
use distlock::testing::RedisServer;
use distlock::{LeaderChange, LockError, LockManager, Observer, distributed_lock};

/// How long a change may take to show on a loaded machine, where nothing waits for a lease.
const SOON: Duration = Duration::from_secs(5);
/// A lease only a release ends within a test.
const LONG: Duration = Duration::from_secs(600);

async fn named(server: &RedisServer, prefix: &str, name: &str) -> LockManager {
    LockManager::builder()
        .redis_url(server.url())
        .key_prefix(prefix)
        .client_name(name)
        .response_timeout(Duration::from_millis(500))
        .connect_timeout(Duration::from_millis(500))
        .build()
        .await
        .expect("manager connects to the test server")
}

async fn next(observer: &mut Observer) -> LeaderChange {
    tokio::time::timeout(SOON, observer.next())
        .await
        .expect("a change is observed in time")
        .expect("the observer follows while the manager lives")
}

fn leader_term(change: &LeaderChange) -> u64 {
    match change {
        LeaderChange::Leader(info) => info.term,
        other => panic!("expected a leader, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_one_leader_at_a_time_and_terms_grow() {
    let server = shared_server();
    let prefix = unique_prefix("one-leader");
    let mut managers = Vec::new();
    for name in ["a", "b", "c"] {
        managers.push(named(&server, &prefix, name).await);
    }
    let leading = Arc::new(AtomicUsize::new(0));
    let terms = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (at, manager) in managers.iter().enumerate() {
        for task in 0..2 {
            let election = manager.election("jobs").ttl(Duration::from_secs(5));
            let (leading, terms) = (leading.clone(), terms.clone());
            let seed = (at * 2 + task) as u64;
            tasks.push(tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(seed);
                for _ in 0..10 {
                    let leadership = election.campaign().await.expect("campaign");
                    assert_eq!(
                        leading.fetch_add(1, Ordering::SeqCst),
                        0,
                        "two leaders at once"
                    );
                    terms.lock().unwrap().push(leadership.term());
                    tokio::time::sleep(Duration::from_millis(rng.u64(0..5))).await;
                    leading.fetch_sub(1, Ordering::SeqCst);
                    leadership.resign().await.expect("resign");
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    let terms = terms.lock().unwrap().clone();
    assert_eq!(terms.len(), 60);
    assert!(
        terms.windows(2).all(|w| w[0] < w[1]),
        "terms in the order leaders were elected must grow: {terms:?}"
    );
}

#[tokio::test]
async fn resign_hands_over_at_once_and_observe_sees_every_change_in_order() {
    let server = shared_server();
    let prefix = unique_prefix("resign");
    let (a, b, watcher) = (
        named(&server, &prefix, "node-a").await,
        named(&server, &prefix, "node-b").await,
        named(&server, &prefix, "watcher").await,
    );
    let mut observer = watcher.election("sched").observe().await.unwrap();
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);

    let first = a.election("sched").ttl(LONG).campaign().await.unwrap();
    let seen = next(&mut observer).await;
    assert_eq!(leader_term(&seen), first.term());
    let LeaderChange::Leader(info) = &seen else {
        unreachable!()
    };
    assert_eq!(info.identity.as_ref().unwrap().client_name, "node-a");

    assert!(b.election("sched").try_campaign().await.unwrap().is_none());
    let now = watcher.election("sched").leader().await.unwrap().unwrap();
    assert_eq!(now.term, first.term());
    assert_eq!(now.token, first.guard().token());
    assert_eq!(now.identity.as_ref().unwrap().client_name, "node-a");
    assert_eq!(now.identity.as_ref().unwrap().pid, std::process::id());
    assert!(now.since.is_some());

    // B waits; A's resignation lets it in at once, long before A's lease would end.
    let waiting = {
        let election = b.election("sched").ttl(LONG);
        tokio::spawn(async move { election.campaign().await })
    };
    support::until_waiting(&b, 1).await;
    let first_term = first.term();
    first.resign().await.unwrap();
    let second = tokio::time::timeout(SOON, waiting)
        .await
        .expect("the next candidate leads at once")
        .unwrap()
        .unwrap();
    assert!(second.term() > first_term);
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
    assert_eq!(leader_term(&next(&mut observer).await), second.term());
    second.resign().await.unwrap();
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
    assert_eq!(watcher.election("sched").leader().await.unwrap(), None);
}

#[tokio::test]
async fn shutdown_resigns_and_the_next_candidate_leads() {
    let server = shared_server();
    let prefix = unique_prefix("shutdown");
    let (a, b) = (
        named(&server, &prefix, "a").await,
        named(&server, &prefix, "b").await,
    );
    let leading = a.election("e").ttl(LONG).campaign().await.unwrap();
    let waiting = {
        let election = b.election("e").ttl(LONG);
        tokio::spawn(async move { election.campaign().await })
    };
    support::until_waiting(&b, 1).await;
    a.shutdown().await;
    assert!(matches!(leading.lost().await, LockError::ShutDown));
    let next = tokio::time::timeout(SOON, waiting)
        .await
        .expect("shutdown hands leadership over at once")
        .unwrap()
        .unwrap();
    assert!(next.term() > leading.term());
    assert!(matches!(
        a.election("e").campaign().await,
        Err(LockError::ShutDown)
    ));
}

#[tokio::test]
async fn lead_runs_the_body_only_while_leading() {
    let server = shared_server();
    let prefix = unique_prefix("lead");
    let (a, b) = (
        named(&server, &prefix, "a").await,
        named(&server, &prefix, "b").await,
    );
    let inside = Arc::new(AtomicUsize::new(0));
    let runs = Arc::new(AtomicUsize::new(0));
    /// Counts a body inside while it lives: a body dropped (leadership lost) leaves too.
    struct Inside(Arc<AtomicUsize>);
    impl Drop for Inside {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let mut tasks = Vec::new();
    for manager in [a.clone(), b.clone()] {
        let (inside, runs) = (inside.clone(), runs.clone());
        tasks.push(tokio::spawn(async move {
            let election = manager.election("loop").ttl(Duration::from_secs(5));
            election
                .lead(|_term| {
                    let (inside, runs) = (inside.clone(), runs.clone());
                    async move {
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two leaders");
                        let _inside = Inside(inside);
                        runs.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                })
                .await
        }));
    }
    let started = Instant::now();
    while runs.load(Ordering::SeqCst) < 20 {
        assert!(
            started.elapsed() < SOON * 4,
            "the bodies ran {runs:?} times"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.shutdown().await;
    b.shutdown().await;
    for task in tasks {
        let ended = tokio::time::timeout(SOON, task).await.unwrap().unwrap();
        assert!(matches!(ended, LockError::ShutDown), "{ended:?}");
    }
}

/// Run as a child process by `a_killed_leader_is_replaced_within_its_lease`: leads the
/// election named by the environment, says so on stdout, and waits to be killed.
#[tokio::test]
#[ignore = "a child process of a_killed_leader_is_replaced_within_its_lease, not a test"]
async fn child_leader() {
    // Run by hand (`--include-ignored`), it has nothing to do.
    let (Ok(url), Ok(prefix)) = (
        std::env::var("DISTLOCK_TEST_CHILD_URL"),
        std::env::var("DISTLOCK_TEST_CHILD_PREFIX"),
    ) else {
        return;
    };
    let manager = LockManager::builder()
        .redis_url(url)
        .key_prefix(prefix)
        .client_name("child")
        .build()
        .await
        .unwrap();
    let leadership = manager
        .election("killed")
        .ttl(Duration::from_secs(2))
        .campaign()
        .await
        .unwrap();
    println!("LEADING {}", leadership.term());
    std::future::pending::<()>().await;
}

/// This test binary's name for `child_leader`, wherever the module sits.
fn child_test_name() -> String {
    match module_path!().split_once("::") {
        Some((_, path)) => format!("{path}::child_leader"),
        None => "child_leader".to_owned(),
    }
}

/// A child process leading the election `killed` under `prefix`; killed when dropped, so
/// that a failing test leaves none behind.
struct ChildLeader {
    child: Child,
    term: u64,
}

impl ChildLeader {
    async fn start(server: &RedisServer, prefix: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([&child_test_name(), "--exact", "--ignored", "--nocapture"])
            .env("DISTLOCK_TEST_CHILD_URL", server.url())
            .env("DISTLOCK_TEST_CHILD_PREFIX", prefix)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut leader = Self { child, term: 0 };
        let read = tokio::task::spawn_blocking(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if let Some(term) = line.strip_prefix("LEADING ") {
                    return term.trim().parse::<u64>().ok();
                }
            }
            None
        });
        leader.term = tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .expect("the child leads in time")
            .unwrap()
            .expect("the child leads");
        leader
    }

    /// SIGKILL: no release, no goodbye.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildLeader {
    fn drop(&mut self) {
        self.kill();
    }
}

#[tokio::test]
async fn a_killed_leader_is_replaced_within_its_lease_and_shows_as_gone() {
    let server = shared_server();
    let prefix = unique_prefix("killed");
    let mut child = ChildLeader::start(&server, &prefix).await;
    let term = child.term;
    let here = named(&server, &prefix, "survivor").await;
    let election = here.election("killed").ttl(Duration::from_secs(2));
    let mut observer = election.observe().await.unwrap();
    let LeaderChange::Leader(first) = next(&mut observer).await else {
        panic!("the child leads")
    };
    assert_eq!(first.term, term);
    assert_eq!(first.identity.unwrap().client_name, "child");
    assert!(election.try_campaign().await.unwrap().is_none());

    let waiting = {
        let election = election.clone();
        tokio::spawn(async move { election.campaign().await })
    };
    support::until_waiting(&here, 1).await;
    child.kill();
    // Within the lease (2 s) and the waiter's timer, bounded by what was left of it, plus a
    // loaded machine's slack: far less than three leases.
    let leading = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("a candidate leads once the dead leader's lease ends")
        .unwrap()
        .unwrap();
    assert!(leading.term() > term);
    let LeaderChange::Leader(second) = next(&mut observer).await else {
        panic!("the survivor leads")
    };
    assert_eq!(second.term, leading.term());
    assert_eq!(second.identity.unwrap().client_name, "survivor");

    // The dead manager's registration expires: a lock it held shows its holder as gone.
    let gone_prefix = unique_prefix("gone");
    let mut child = ChildLeader::start(&server, &gone_prefix).await;
    // Stretch the dead leader's lease, so that only its registration can tell it is gone.
    let lock = format!("{gone_prefix}{{election:killed}}");
    server.command(&["PEXPIRE", &lock, "600000"]).unwrap();
    child.kill();
    let inspector = named(&server, &gone_prefix, "inspector").await;
    let info = inspector.inspect("election:killed").await.unwrap().unwrap();
    assert_eq!(
        info.holders[0].identity.as_ref().unwrap().client_name,
        "child"
    );
    let started = Instant::now();
    loop {
        let info = inspector.inspect("election:killed").await.unwrap().unwrap();
        if info.holders[0].identity.is_none() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the dead manager's registration never expired"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    server.command(&["DEL", &lock]).unwrap();
}

#[tokio::test]
async fn an_observer_ends_when_its_manager_shuts_down() {
    let server = shared_server();
    let prefix = unique_prefix("observer-end");
    let manager = named(&server, &prefix, "watcher").await;
    let mut observer = manager.election("e").observe().await.unwrap();
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
    manager.shutdown().await;
    let ended = tokio::time::timeout(SOON, observer.next())
        .await
        .expect("the observer ends after shutdown");
    assert_eq!(ended, None);
}

#[tokio::test]
async fn an_acl_user_restricted_to_its_prefix_sees_who_holds_and_leads() {
    let server = RedisServer::start().unwrap();
    let prefix = "acl:";
    let rules = LockManager::acl_rules(prefix);
    let rules: Vec<&str> = rules.split(' ').collect();
    server.acl_setuser("locker", "secret", &rules).unwrap();
    let build = |name: &'static str| {
        LockManager::builder()
            .redis_url(server.url_as("locker", "secret"))
            .key_prefix(prefix)
            .client_name(name)
            .build()
    };
    let (a, b) = (
        build("orders-api").await.unwrap(),
        build("ops").await.unwrap(),
    );
    let leading = a.election("e").campaign().await.unwrap();
    let leader = b.election("e").leader().await.unwrap().unwrap();
    assert_eq!(leader.term, leading.term());
    assert_eq!(leader.identity.unwrap().client_name, "orders-api");
    let mut observer = b.election("e").observe().await.unwrap();
    assert_eq!(leader_term(&next(&mut observer).await), leading.term());
    let held = a.lock("k").acquire().await.unwrap();
    let error = b.lock("k").acquire().await.unwrap_err();
    assert!(error.to_string().contains("held by orders-api"), "{error}");
    let clients = server.command(&["CLIENT", "LIST"]).unwrap_or_default();
    assert!(clients.contains("name=orders-api:"), "{clients}");
    held.release().await.unwrap();
    leading.resign().await.unwrap();
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
}

#[tokio::test]
async fn busy_names_the_holder() {
    let server = shared_server();
    let prefix = unique_prefix("busy");
    let (a, b) = (
        named(&server, &prefix, "orders-api").await,
        named(&server, &prefix, "billing").await,
    );
    let held = a.lock("order:42").ttl(LONG).acquire().await.unwrap();
    let error = b.lock("order:42").acquire().await.unwrap_err();
    let LockError::Busy {
        holder_token,
        holder,
        ..
    } = &error
    else {
        panic!("expected busy, got {error:?}");
    };
    assert_eq!(holder_token.as_deref(), Some(held.token()));
    let holder = holder.as_ref().expect("the holder is named");
    assert_eq!(holder.client_name, "orders-api");
    assert_eq!(holder.pid, std::process::id());
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "held by orders-api on {}, pid {}",
            holder.host,
            std::process::id()
        )),
        "{message}"
    );
    // Waiting for it names the holder too.
    let waited = b
        .lock("order:42")
        .wait(Duration::from_millis(100))
        .acquire()
        .await
        .unwrap_err();
    assert!(
        waited.to_string().contains("held by orders-api"),
        "{waited}"
    );
    held.release().await.unwrap();
}

#[distributed_lock(key = "report:{id}", manager = locks)]
async fn report(locks: &LockManager, id: u32) -> Result<(), LockError> {
    let _ = id;
    Ok(())
}

#[tokio::test]
async fn an_annotated_function_that_finds_the_lock_busy_names_the_holder() {
    let server = shared_server();
    let prefix = unique_prefix("busy-macro");
    let (a, b) = (
        named(&server, &prefix, "reports-worker").await,
        named(&server, &prefix, "reports-api").await,
    );
    let held = a.lock("report:7").ttl(LONG).acquire().await.unwrap();
    let error = report(&b, 7).await.unwrap_err();
    let LockError::Busy { holder, .. } = &error else {
        panic!("expected busy, got {error:?}");
    };
    assert_eq!(holder.as_ref().unwrap().client_name, "reports-worker");
    assert!(
        error.to_string().contains("held by reports-worker on"),
        "{error}"
    );
    held.release().await.unwrap();
}

#[tokio::test]
async fn the_inspector_and_client_list_show_who_holds_what() {
    let server = shared_server();
    let prefix = unique_prefix("who");
    let a = named(&server, &prefix, "orders-api").await;
    let observer = named(&server, &prefix, "ops").await;
    let held = a.lock("order:7").ttl(LONG).acquire().await.unwrap();
    let info = observer.inspect("order:7").await.unwrap().unwrap();
    let identity = info.holders[0].identity.as_ref().unwrap();
    assert_eq!(identity.client_name, "orders-api");
    assert_eq!(identity.pid, std::process::id());
    assert_eq!(identity.manager_id, &held.token()[..16]);
    assert_eq!(a.identity(), identity);
    let listed = observer.list("order:*").await.unwrap();
    assert_eq!(listed.len(), 1, "the registrations are not listed as locks");
    assert_eq!(listed[0].holders[0].identity.as_ref(), Some(identity));
    let clients = server.command(&["CLIENT", "LIST"]).unwrap();
    assert!(
        clients.contains(&format!("name=orders-api:{}", identity.manager_id)),
        "{clients}"
    );
    held.release().await.unwrap();
    // Shutdown takes the registration away.
    a.shutdown().await;
    let key = format!("distlock-manager:{prefix}{}", identity.manager_id);
    assert!(support::keys(&server, &prefix).is_empty());
    assert_eq!(server.command(&["EXISTS", &key]).unwrap().trim(), ":0");
}

#[tokio::test]
async fn a_bad_client_name_is_a_config_error() {
    let server = shared_server();
    for bad in ["", "two words", "line\nbreak"] {
        let error = LockManager::builder()
            .redis_url(server.url())
            .client_name(bad)
            .build()
            .await
            .unwrap_err();
        assert!(matches!(error, LockError::Config(_)), "{error:?}");
        assert!(error.to_string().contains("`client_name`"), "{error}");
    }
    let error = distlock::LockManagerBuilder::from_vars([
        ("DISTLOCK_URL", server.url()),
        ("DISTLOCK_CLIENT_NAME", "two words".to_owned()),
    ])
    .unwrap_err();
    assert!(
        error.to_string().contains("DISTLOCK_CLIENT_NAME"),
        "{error}"
    );
    let manager = distlock::LockManagerBuilder::from_vars([
        ("DISTLOCK_URL", server.url()),
        ("DISTLOCK_CLIENT_NAME", "from-env".to_owned()),
    ])
    .unwrap()
    .build()
    .await
    .unwrap();
    assert_eq!(manager.identity().client_name, "from-env");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elections_work_on_a_cluster() {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let build = |name: &'static str| {
        LockManager::builder()
            .cluster(nodes.iter().map(RedisServer::url))
            .key_prefix("ce:")
            .client_name(name)
            .build()
    };
    let (a, b) = (build("a").await.unwrap(), build("b").await.unwrap());
    let mut observer = b.election("jobs").observe().await.unwrap();
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
    let first = a.election("jobs").campaign().await.unwrap();
    assert_eq!(leader_term(&next(&mut observer).await), first.term());
    let now = b.election("jobs").leader().await.unwrap().unwrap();
    assert_eq!(now.term, first.term());
    assert_eq!(now.identity.unwrap().client_name, "a");
    assert!(b.election("jobs").try_campaign().await.unwrap().is_none());
    let waiting = {
        let election = b.election("jobs");
        tokio::spawn(async move { election.campaign().await })
    };
    support::until_waiting(&b, 1).await;
    first.resign().await.unwrap();
    let second = tokio::time::timeout(SOON, waiting)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(second.term() > now.term);
    assert_eq!(next(&mut observer).await, LeaderChange::NoLeader);
    assert_eq!(leader_term(&next(&mut observer).await), second.term());
    second.resign().await.unwrap();
}
