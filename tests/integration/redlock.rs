//! RedLock over independent masters: every mix of healthy, killed, frozen and foreign-held
//! nodes grants the lock exactly when a majority is free and reachable.

use std::sync::Arc;
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LockError, LockManager};

use crate::support;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Healthy,
    Killed,
    Paused,
    Foreign,
}

const STATES: [State; 4] = [State::Healthy, State::Killed, State::Paused, State::Foreign];
const TTL: Duration = Duration::from_secs(1);

async fn redlock(servers: &[RedisServer]) -> LockManager {
    support::redlock(servers)
        .key_prefix("rl:")
        .connect_timeout(Duration::from_millis(300))
        .response_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap()
}

/// Puts each node in its state, tries once, checks the outcome, and puts everything back.
async fn check(servers: &[RedisServer], states: &[State], case: usize) {
    let locks = redlock(servers).await;
    let key = format!("case{case}");
    let redis_key = locks.redis_key(&key);
    for (server, state) in servers.iter().zip(states) {
        match state {
            State::Healthy => {}
            State::Killed => server.kill().unwrap(),
            State::Paused => server.pause().unwrap(),
            State::Foreign => {
                server
                    .command(&["HSET", &redis_key, "someone-else", "1"])
                    .unwrap();
                server.command(&["PEXPIRE", &redis_key, "60000"]).unwrap();
            }
        }
    }
    let free = states.iter().filter(|s| **s == State::Healthy).count();
    let quorum = servers.len() / 2 + 1;
    let started = Instant::now();
    let outcome = locks.lock(&key).ttl(TTL).try_acquire().await;
    let took = started.elapsed();
    // Answers are awaited at most about a tenth of the lease per node, all nodes at once
    // (and once more to give back a refused grant).
    assert!(took < TTL, "{states:?}: took {took:?}");
    match outcome {
        Ok(Some(guard)) => {
            assert!(
                free >= quorum,
                "{states:?}: granted without a free majority"
            );
            let drift = TTL / 100 + Duration::from_millis(2);
            assert!(
                guard.remaining() <= TTL - drift,
                "{states:?}: validity over TTL - drift"
            );
            guard.release().await.unwrap();
        }
        Ok(None) | Err(LockError::Redis { .. }) => {
            assert!(free < quorum, "{states:?}: refused with a free majority");
            // Nothing of ours is left on the nodes that answer.
            for (server, state) in servers.iter().zip(states) {
                if *state == State::Healthy {
                    let exists = server.command(&["EXISTS", &redis_key]).unwrap();
                    assert_eq!(exists, ":0", "{states:?}: leftover on a healthy node");
                }
            }
        }
        Err(other) => panic!("{states:?}: {other}"),
    }
    for (server, state) in servers.iter().zip(states) {
        match state {
            State::Healthy => {}
            State::Killed => server.restart().unwrap(),
            State::Paused => server.resume().unwrap(),
            State::Foreign => {
                server.command(&["DEL", &redis_key]).unwrap();
            }
        }
    }
}

#[tokio::test]
async fn three_masters_every_combination() {
    let servers = support::redlock_masters(3);
    let mut case = 0;
    for a in STATES {
        for b in STATES {
            for c in STATES {
                case += 1;
                check(&servers, &[a, b, c], case).await;
            }
        }
    }
}

#[tokio::test]
async fn five_masters_a_spread_of_combinations() {
    let servers = support::redlock_masters(5);
    // Every number of failed nodes, with each kind of failure, and mixes.
    let cases: Vec<Vec<State>> = (0..=5)
        .flat_map(|failed| {
            [State::Killed, State::Paused, State::Foreign]
                .into_iter()
                .map(move |bad| {
                    (0..5)
                        .map(|i| if i < failed { bad } else { State::Healthy })
                        .collect()
                })
        })
        .chain([
            vec![
                State::Killed,
                State::Paused,
                State::Healthy,
                State::Healthy,
                State::Healthy,
            ],
            vec![
                State::Killed,
                State::Paused,
                State::Foreign,
                State::Healthy,
                State::Healthy,
            ],
            vec![
                State::Foreign,
                State::Healthy,
                State::Paused,
                State::Healthy,
                State::Killed,
            ],
        ])
        .collect();
    for (case, states) in cases.iter().enumerate() {
        check(&servers, states, 100 + case).await;
    }
}

#[tokio::test]
async fn bad_redlock_configurations_are_errors() {
    let one = RedisServer::start().unwrap();
    let two = support::redlock(&[&one, &one]).build().await;
    assert!(matches!(two, Err(LockError::Config(_))));
    let servers = support::redlock_masters(3);
    let locks = redlock(&servers).await;
    let fencing = locks.lock("k").fencing(true).acquire().await;
    assert!(matches!(
        fencing,
        Err(LockError::InvalidInput {
            what: "fencing",
            ..
        })
    ));
    let read = locks.read_lock("k").acquire().await;
    assert!(matches!(read, Err(LockError::InvalidInput { .. })));
}

/// The same exclusion checker as for one server, across three managers on three masters,
/// with one master killed halfway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusion_holds_with_a_master_down() {
    let servers = support::redlock_masters(3);
    let mut managers = Vec::new();
    for _ in 0..3 {
        managers.push(redlock(&servers).await);
    }
    let halfway = Arc::new(tokio::sync::Notify::new());
    let run = support::contend(&managers, 4, 10, false, Some(halfway.clone()));
    let kill = async {
        halfway.notified().await;
        servers[2].kill().unwrap();
    };
    let (run, ()) = tokio::join!(run, kill);
    assert_eq!(run.entries, 120);
}

/// The scenario RedLock's delayed restart exists for: a lock held on masters A and B (C was
/// down), then C comes back and B restarts, both empty. Counting them again at once would
/// let a second client win B and C; kept out for the restart delay, they cannot.
#[tokio::test]
async fn a_restarted_master_stays_out_of_the_quorum() {
    let servers = support::redlock_masters(3);
    let build = |delay: Duration| {
        support::redlock(&servers)
            .response_timeout(Duration::from_millis(300))
            .connect_timeout(Duration::from_millis(300))
            .redlock_restart_delay(delay)
            .build()
    };
    let first = build(Duration::from_secs(60)).await.unwrap();
    let second = build(Duration::from_secs(60)).await.unwrap();

    servers[2].kill().unwrap();
    let held = first
        .lock("k")
        .ttl(Duration::from_secs(30))
        .try_acquire()
        .await
        .unwrap();
    let held = held.expect("A and B are a majority");
    // C comes back (empty: it was down), and B restarts empty.
    servers[2].restart().unwrap();
    servers[1].restart().unwrap();

    // The second client's connections to B and C broke: it checks their run_ids, finds both
    // restarted, and does not count them.
    for _ in 0..5 {
        let outcome = second
            .lock("k")
            .ttl(Duration::from_secs(30))
            .try_acquire()
            .await;
        assert!(
            !matches!(outcome, Ok(Some(_))),
            "granted twice: {outcome:?}"
        );
    }
    held.release().await.unwrap();
}

/// A forced release answers for what a majority of masters did: with the first master
/// frozen, the lock the other two hold is removed and reported; with two of three frozen,
/// it is an error within the response timeout — not a removal claimed while the holder
/// may keep a majority (the frozen masters run the removal when they wake, or not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_answers_for_a_majority_of_masters() {
    let servers = support::redlock_masters(3);
    let locks = redlock(&servers).await;
    let forcing = redlock(&servers).await;
    let take = || locks.lock("stuck").ttl(Duration::from_secs(30)).acquire();
    let held = take().await.unwrap();
    servers[0].pause().unwrap();
    let removed = forcing.force_release("stuck").await;
    servers[0].resume().unwrap();
    let removed = removed.unwrap().expect("held on two masters of three");
    assert_eq!(removed.holders[0].token, held.token());
    assert!(matches!(held.release().await, Err(LockError::Lost { .. })));

    let held = take().await.unwrap();
    servers[0].pause().unwrap();
    servers[1].pause().unwrap();
    let started = Instant::now();
    let answer = forcing.force_release("stuck").await;
    let took = started.elapsed();
    servers[0].resume().unwrap();
    servers[1].resume().unwrap();
    assert!(matches!(answer, Err(LockError::Redis { .. })), "{answer:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // Removed by the masters as they woke, or given back now.
    let _ = held.release().await;
}

/// The holders confirmed on one master are not what a majority has: a stale copy for A on
/// the first master, B's lock on the other two. Removing "A's" lock takes A's stale copy
/// only, and reports B, who keeps the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_forced_release_answers_for_what_a_majority_holds() {
    use distlock::inspect::ForcedRelease;
    let servers = support::redlock_masters(3);
    let forcing = redlock(&servers).await;
    let key = forcing.redis_key("split");
    for (server, token) in servers.iter().zip(["a-stale", "b-holds", "b-holds"]) {
        server
            .command(&["SET", &key, token, "PX", "30000"])
            .unwrap();
    }
    match forcing
        .force_release_if_held_by("split", &["a-stale"])
        .await
        .unwrap()
    {
        ForcedRelease::Changed(now) => assert_eq!(now.holders[0].token, "b-holds"),
        other => panic!("{other:?}"),
    }
    let left: Vec<String> = servers
        .iter()
        .map(|server| server.command(&["GET", &key]).unwrap())
        .collect();
    assert_eq!(left[1..], ["b-holds", "b-holds"], "{left:?}");
    for server in &servers {
        server.command(&["DEL", &key]).unwrap();
    }
}
