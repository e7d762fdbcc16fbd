//! Three replicas of a scheduler, as three processes: only the leader runs the schedule. The
//! leader is killed (SIGKILL: no release, no goodbye); another replica leads once the dead
//! one's lease has run out, and an observer prints every change as it is announced.
//!
//! Run it with `cargo run --example leader`. It uses the Redis at `REDIS_URL` if set;
//! otherwise it starts a throwaway `redis-server` (which must be on `PATH`).
//!
//! ```text
//! observer: nobody leads
//! observer: term 1: scheduler-0 on host-3, pid 4242
//! replica 0: tick in term 1
//! killing the leader (pid 4242)
//! observer: term 2: scheduler-2 on host-3, pid 4244 (1.9s after the kill)
//! replica 2: tick in term 2
//! ```

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use distlock::testing::RedisServer;
use distlock::{LeaderChange, LockError, LockManager};

/// The leader's lease: how long the replicas wait for a leader that died.
const LEASE: Duration = Duration::from_secs(2);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    if let (Some(flag), Some(n)) = (args.next(), args.next())
        && flag == "--replica"
    {
        let url = std::env::var("REDIS_URL")?;
        return Ok(replica(&url, &n).await?);
    }
    let _server;
    let url = match std::env::var("REDIS_URL") {
        Ok(url) => url,
        Err(_) => {
            let server = RedisServer::start()?;
            let url = server.url();
            _server = server;
            url
        }
    };
    observe_and_kill(&url).await
}

/// A replica: runs the schedule whenever it leads, until it is killed.
async fn replica(url: &str, n: &str) -> Result<(), LockError> {
    let locks = LockManager::builder()
        .redis_url(url)
        .key_prefix("example:leader:")
        .client_name(format!("scheduler-{n}"))
        .build()
        .await?;
    let election = locks.election("scheduler").ttl(LEASE);
    let ended = election
        .lead(|term| async move {
            loop {
                println!("replica {n}: tick in term {term}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
        .await;
    Err(ended)
}

/// Starts three replicas, prints the election's changes, kills the first leader and waits for
/// its successor.
async fn observe_and_kill(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let locks = LockManager::builder()
        .redis_url(url)
        .key_prefix("example:leader:")
        .client_name("observer")
        .build()
        .await?;
    let mut observer = locks.election("scheduler").observe().await?;
    let exe = std::env::current_exe()?;
    let mut replicas = Replicas(Vec::new());
    for n in 0..3 {
        let replica = Command::new(&exe)
            .args(["--replica", &n.to_string()])
            .env("REDIS_URL", url)
            .spawn()?;
        replicas.0.push(replica);
    }
    let replicas = &mut replicas.0;
    let mut killed: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Some(change)) = tokio::time::timeout(left, observer.next()).await else {
            eprintln!("no change within 30 s: giving up");
            break;
        };
        let after = killed.map_or_else(String::new, |at| {
            format!(" ({:.1}s after the kill)", at.elapsed().as_secs_f64())
        });
        match change {
            LeaderChange::Leader(leader) => {
                println!("observer: {leader}{after}");
                if killed.is_some() {
                    break;
                }
                let pid = leader.identity.as_ref().map(|who| who.pid);
                if let Some(at) = replicas.iter().position(|r| Some(r.id()) == pid) {
                    // Let it tick once, then kill it without a word.
                    tokio::time::sleep(Duration::from_millis(700)).await;
                    println!("killing the leader (pid {})", replicas[at].id());
                    replicas[at].kill()?;
                    replicas[at].wait()?;
                    killed = Some(Instant::now());
                }
            }
            LeaderChange::NoLeader => println!("observer: nobody leads{after}"),
            _ => {}
        }
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    locks.shutdown().await;
    Ok(())
}

/// The replica processes, killed when dropped: on the way out, on an error or a panic.
struct Replicas(Vec<Child>);

impl Drop for Replicas {
    fn drop(&mut self) {
        for replica in &mut self.0 {
            let _ = replica.kill();
            let _ = replica.wait();
        }
    }
}
