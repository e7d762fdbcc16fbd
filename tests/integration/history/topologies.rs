//! The runners: rounds of programs on managers, the end check, and the long mode's
//! topologies with their faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distlock::LockManager;
use distlock::testing::{Fault, FaultProxy, RedisServer};

use crate::support;

use super::checker::{History, push_recent};
use super::model::{Features, ORPHANED, RECOVERY};
use super::monitor::monitor;
use super::program::program;
use super::world::{Probe, World};

/// A run's shape.
pub(super) struct Run {
    pub(super) managers: usize,
    pub(super) tasks: usize,
    pub(super) ops: u32,
}

/// Runs the programs of `run` over `managers` (built by the caller), then shuts the managers
/// down and checks that nothing is left.
pub(super) async fn run_programs(
    seed: u64,
    world: &World,
    managers: &[LockManager],
    run: &Run,
    faults: bool,
) {
    let stop = Arc::new(tokio::sync::Notify::new());
    let watching = tokio::spawn(monitor(
        world.clone(),
        managers[0].clone(),
        stop.clone(),
        faults,
    ));
    let mut tasks = tokio::task::JoinSet::new();
    for (m, locks) in managers.iter().enumerate() {
        for t in 0..run.tasks {
            let seed = seed ^ (((m as u64) << 32) | t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let who = format!("m{m}t{t}");
            tasks.spawn(program(
                world.clone(),
                locks.clone(),
                who,
                seed,
                run.ops,
                faults,
            ));
        }
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(error) = done {
            world
                .history
                .violation(format!("a program task failed: {error}"));
        }
    }
    stop.notify_one();
    let _ = watching.await;
}

/// After every task has ended: managers shut down, and nothing may be left behind.
pub(super) async fn check_nothing_left(
    world: &World,
    managers: &[LockManager],
    servers: &[&RedisServer],
    prefix: &str,
) {
    for locks in managers {
        if world.bounded("shutdown", locks.shutdown()).await.is_none() {
            return;
        }
        let stats = locks.stats();
        if stats.waiting_keys != 0 || stats.watched_leases != 0 {
            world.history.violation(format!(
                "leftover: a manager still has {} waiting keys and {} watched leases",
                stats.waiting_keys, stats.watched_leases
            ));
        }
    }
    // Background releases (of dropped guards) and min_hold windows settle within a moment.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left: Vec<String> = servers
            .iter()
            .flat_map(|server| {
                let keys = server
                    .command(&["KEYS", &format!("{prefix}*")])
                    .unwrap_or_default();
                let channels = server
                    .command(&["PUBSUB", "CHANNELS", &format!("{prefix}*")])
                    .unwrap_or_default();
                keys.lines()
                    .chain(channels.lines())
                    // Kept by design: fencing counters, and a leader's record until its
                    // successor's (or a day).
                    .filter(|k| !k.is_empty() && !k.ends_with(":fence") && !k.ends_with(":leader"))
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            world
                .history
                .violation(format!("leftover: still in Redis after the run: {left:?}"));
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Panics that the programs cause on purpose are not news.
pub(super) fn quiet_planned_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let planned = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with("a body panics"));
            if !planned {
                default(info);
            }
        }));
    });
}

pub(super) fn seed() -> u64 {
    quiet_planned_panics();
    match std::env::var("DISTLOCK_SEED") {
        Ok(seed) => seed.trim().parse().expect("DISTLOCK_SEED must be a number"),
        Err(_) => fastrand::u64(..),
    }
}

pub(super) fn long_mode() -> Option<u64> {
    std::env::var("DISTLOCK_HISTORY_LONG").ok().map(|n| {
        n.trim()
            .parse()
            .expect("DISTLOCK_HISTORY_LONG must be a number")
    })
}

pub(super) async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

pub(super) async fn raws(
    urls: impl Iterator<Item = String>,
) -> Vec<redis::aio::MultiplexedConnection> {
    let mut conns = Vec::new();
    for url in urls {
        conns.push(raw(&url).await);
    }
    conns
}

/// Runs rounds of programs until `target` acquisitions, with `fault` injecting faults in
/// the background, then checks that nothing is left.
pub(super) async fn rounds(
    topology: &str,
    seed: u64,
    target: u64,
    world: &World,
    managers: &[LockManager],
    run: &Run,
    faults: bool,
) {
    let mut round = 0u64;
    loop {
        run_programs(
            seed.wrapping_add(round.wrapping_mul(7919)),
            world,
            managers,
            run,
            faults,
        )
        .await;
        round += 1;
        let acquisitions = world.history.lock().acquisitions;
        if acquisitions >= target {
            break;
        }
        if round.is_multiple_of(10) {
            println!("history [{topology}]: {acquisitions} acquisitions so far");
        }
    }
}

/// Background faults until `stop`: `inject` is called every so often.
pub(super) fn faults_in_background(
    history: Arc<History>,
    seed: u64,
    stop: Arc<AtomicBool>,
    inject: impl Fn(&mut fastrand::Rng) + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut rng = fastrand::Rng::with_seed(seed ^ 0xFA17);
        while !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(rng.u64(300..1_500)));
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let index = {
                let mut state = history.lock();
                state.faults += 1;
                state.fault_windows.push((Instant::now(), None));
                let event = format!("{:?} fault {} begins", Instant::now(), state.faults);
                push_recent(&mut state, event);
                state.fault_windows.len() - 1
            };
            inject(&mut rng);
            let mut state = history.lock();
            // (A fault may have closed its own window before staying quiet for a while.)
            state.fault_windows[index]
                .1
                .get_or_insert_with(Instant::now);
            let event = format!("{:?} fault {} ends", Instant::now(), index + 1);
            push_recent(&mut state, event);
        }
    })
}

/// One server; one manager talks through a proxy that adds latency or partitions it, and the
/// server is paused now and then. Neither voids exclusion: a partitioned holder's lease only
/// runs out.
pub(super) async fn single_with_faults(seed: u64, target: u64, run: &Run) {
    let server = Arc::new(RedisServer::start().unwrap());
    let proxy = Arc::new(FaultProxy::start(server.port()).unwrap());
    let prefix = support::unique_prefix("long-single");
    let managers = vec![
        support::manager(&server, &prefix).await,
        support::manager(&server, &prefix).await,
        support::manager_at(proxy.url(), &prefix).await,
    ];
    let world = World {
        history: Arc::default(),
        raw: raw(&server.url()).await,
        features: Features {
            shared_kinds: true,
            fencing: true,
            fair: true,
            short_leases: false,
        },
        check_leases: true,
        probe: Probe::One(raw(&server.url()).await),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (s, p, history) = (server.clone(), proxy.clone(), world.history.clone());
    let injector =
        faults_in_background(
            world.history.clone(),
            seed,
            stop.clone(),
            move |rng| match rng.u8(..4) {
                0 => {
                    p.set(Fault::Latency(Duration::from_millis(rng.u64(1..30))));
                    std::thread::sleep(Duration::from_millis(300));
                    p.reset();
                }
                3 => late_attempts(std::slice::from_ref(&p), &history, rng),
                1 => {
                    p.set(Fault::Blackhole);
                    std::thread::sleep(Duration::from_millis(rng.u64(50..700)));
                    p.reset();
                }
                _ => {
                    let _ = s.pause();
                    std::thread::sleep(Duration::from_millis(rng.u64(20..200)));
                    let _ = s.resume();
                }
            },
        );
    rounds("single", seed, target, &world, &managers, run, true).await;
    stop.store(true, Ordering::Relaxed);
    injector.join().unwrap();
    check_nothing_left(&world, &managers, &[&server], &prefix).await;
    world.history.report(seed, "one server, faults");
}

/// Holds back what the proxied managers send through `proxies` in a short window far past
/// their response timeout, and lets everything through after: their attempts in that window
/// time out, their retries are granted on another connection (and released), and then the
/// attempts land (on a Cluster lane, one connection per master, before the retry). The network
/// stops no release, so no key may stay owned by a token whose release was answered (see
/// `History::orphaned`); quiet before and after, so that no other fault excuses one.
fn late_attempts(proxies: &[Arc<FaultProxy>], history: &History, rng: &mut fastrand::Rng) {
    // Past the recovery of the fault before (its window covers this wait too: a connection
    // that fault reset is found dead only when next used).
    std::thread::sleep(RECOVERY);
    let delay = Duration::from_millis(rng.u64(1_300..2_000));
    let window = {
        let mut state = history.lock();
        let window = state.fault_windows.len() - 1;
        state.passing_faults.push(window);
        let event = format!("{:?} attempts held back {delay:?} from now", Instant::now());
        push_recent(&mut state, event);
        window
    };
    let set = |fault| proxies.iter().for_each(|proxy| proxy.set(fault));
    set(Fault::Latency(delay));
    std::thread::sleep(Duration::from_millis(rng.u64(100..300)));
    set(Fault::Pass);
    // What was held back arrives until then: that is the window waiters are allowed.
    let bound = Instant::now() + delay + RECOVERY;
    while proxies.iter().any(|proxy| proxy.held_back() > 0) && Instant::now() < bound {
        std::thread::sleep(Duration::from_millis(5));
    }
    history.lock().fault_windows[window].1 = Some(Instant::now());
    std::thread::sleep(ORPHANED + RECOVERY * 2);
}

/// A master with a replica behind three Sentinels; the master is paused for less than the
/// Sentinels' down-after time (no failover: a failover of unreplicated grants is the one
/// documented way to lose exclusion on this topology, so it is left out).
pub(super) async fn sentinel_with_faults(seed: u64, target: u64, run: &Run) {
    let group = support::SentinelGroup::start("history");
    let master = group.master.clone();
    let prefix = support::unique_prefix("long-sentinel");
    let mut managers = Vec::new();
    for _ in 0..run.managers {
        managers.push(support::connect(support::quick(group.builder(), &prefix)).await);
    }
    let world = World {
        history: Arc::default(),
        raw: raw(&master.url()).await,
        features: Features {
            shared_kinds: true,
            fencing: true,
            fair: true,
            short_leases: false,
        },
        check_leases: true,
        probe: Probe::One(raw(&master.url()).await),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (m, history) = (master.clone(), world.history.clone());
    let injector = faults_in_background(world.history.clone(), seed, stop.clone(), move |rng| {
        let _ = m.pause();
        std::thread::sleep(Duration::from_millis(rng.u64(20..120)));
        let _ = m.resume();
        // On a loaded machine a pause can outlast the Sentinels' patience: if they failed the
        // master over, grants made before are not covered (see the guide's topologies
        // chapter, Sentinel).
        let role = m.command(&["ROLE"]).unwrap_or_default();
        if role.lines().next().is_some_and(|r| r != "master") {
            let mut state = history.lock();
            if state.void_before.is_none() {
                state.void_before = Some(Instant::now());
            }
        }
    });
    rounds("sentinel", seed, target, &world, &managers, run, true).await;
    stop.store(true, Ordering::Relaxed);
    injector.join().unwrap();
    check_nothing_left(&world, &managers, &[&master], &prefix).await;
    world.history.report(seed, "Sentinel, faults");
}

/// Three masters; one of them is paused now and then (the keys spread over all three), or
/// what every manager sends held back past its retry (the nodes announce proxies in front of
/// them).
pub(super) async fn cluster_with_faults(seed: u64, target: u64, run: &Run) {
    let nodes = RedisServer::start_cluster(3).unwrap();
    let proxies: Vec<Arc<FaultProxy>> = (support::announce_proxies(&nodes).into_iter())
        .map(Arc::new)
        .collect();
    let nodes: Vec<Arc<RedisServer>> = nodes.into_iter().map(Arc::new).collect();
    let prefix = support::unique_prefix("long-cluster");
    let mut managers = Vec::new();
    for _ in 0..run.managers {
        managers.push(support::connect(support::quick(support::cluster(&nodes), &prefix)).await);
    }
    let world = World {
        history: Arc::default(),
        raw: raw(&nodes[0].url()).await,
        features: Features {
            shared_kinds: true,
            fencing: true,
            fair: true,
            short_leases: false,
        },
        // A raw single-node connection would be redirected: leases are checked elsewhere.
        check_leases: false,
        probe: Probe::Cluster(raws(nodes.iter().map(|n| n.url())).await),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let (paused, history) = (nodes.clone(), world.history.clone());
    let injector = faults_in_background(world.history.clone(), seed, stop.clone(), move |rng| {
        if rng.u8(..4) == 0 {
            return late_attempts(&proxies, &history, rng);
        }
        let node = &paused[rng.usize(..paused.len())];
        let _ = node.pause();
        std::thread::sleep(Duration::from_millis(rng.u64(20..150)));
        let _ = node.resume();
    });
    rounds("cluster", seed, target, &world, &managers, run, true).await;
    stop.store(true, Ordering::Relaxed);
    injector.join().unwrap();
    let servers: Vec<&RedisServer> = nodes.iter().map(|n| n.as_ref()).collect();
    check_nothing_left(&world, &managers, &servers, &prefix).await;
    world.history.report(seed, "Cluster, faults");
}

/// RedLock over three masters; one master at a time is paused, or killed and restarted
/// empty (a minority: the quorum rule and the restart delay keep exclusion), or what the last
/// manager sends (through a proxy in front of every master) held back past its retry.
pub(super) async fn redlock_with_faults(seed: u64, target: u64, run: &Run) {
    let masters: Vec<Arc<RedisServer>> = support::redlock_masters(3)
        .into_iter()
        .map(Arc::new)
        .collect();
    let proxies: Vec<Arc<FaultProxy>> = (masters.iter())
        .map(|master| Arc::new(FaultProxy::start(master.port()).unwrap()))
        .collect();
    let prefix = support::unique_prefix("long-redlock");
    let mut managers = Vec::new();
    for m in 0..run.managers {
        let builder = match m + 1 == run.managers {
            true => LockManager::builder().redlock(proxies.iter().map(|p| p.url())),
            false => support::redlock(&masters),
        };
        // Longer than any lease the programs take there.
        let builder = builder.redlock_restart_delay(Duration::from_millis(2_500));
        managers.push(support::connect(support::quick(builder, &prefix)).await);
    }
    let world = World {
        history: Arc::default(),
        raw: raw(&masters[0].url()).await,
        features: Features {
            shared_kinds: false,
            fencing: false,
            fair: false,
            short_leases: true,
        },
        check_leases: false,
        probe: Probe::Masters(raws(masters.iter().map(|m| m.url())).await),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let faulted = masters.clone();
    let history = world.history.clone();
    let injector = faults_in_background(world.history.clone(), seed, stop.clone(), move |rng| {
        let which = rng.usize(..faulted.len());
        let node = &faulted[which];
        let draw = rng.u8(..5);
        if draw == 4 {
            late_attempts(&proxies, &history, rng);
        } else if draw == 0 {
            let _ = node.restart();
            let event = format!("{:?} master {which} restarted empty", Instant::now());
            push_recent(&mut history.lock(), event);
        } else {
            let _ = node.pause();
            std::thread::sleep(Duration::from_millis(rng.u64(20..200)));
            let _ = node.resume();
        }
    });
    rounds("redlock", seed, target, &world, &managers, run, true).await;
    stop.store(true, Ordering::Relaxed);
    injector.join().unwrap();
    let servers: Vec<&RedisServer> = masters.iter().map(|m| m.as_ref()).collect();
    check_nothing_left(&world, &managers, &servers, &prefix).await;
    world.history.report(seed, "RedLock-3, faults");
}
