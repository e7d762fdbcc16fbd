//! A master's replicas: started in sync, and promoted as a failover does.

use std::io;
use std::time::{Duration, Instant};

use super::{RedisServer, START_TIMEOUT};

impl RedisServer {
    /// Starts a replica of `master` and waits until the master sees it online. A restart
    /// keeps it a replica of the same master; [`promote`](Self::promote) makes it a master.
    pub fn start_replica_of(master: &RedisServer) -> io::Result<Self> {
        let args = vec!["--replicaof".into(), master.addr(), master.port.to_string()];
        let replica = Self::start_as(args, None, None, master.network())?;
        replica.wait_synced(master)?;
        Ok(replica)
    }

    /// Waits until this replica is in sync with `master` and acknowledges its writes.
    fn wait_synced(&self, master: &RedisServer) -> io::Result<()> {
        let replica = self;
        let started = Instant::now();
        let online = format!("port={},state=online", replica.port);
        while !(replica
            .command(&["INFO", "replication"])?
            .contains("master_link_status:up")
            && master.command(&["INFO", "replication"])?.contains(&online))
        {
            if started.elapsed() > START_TIMEOUT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "replica did not sync",
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Online is not yet acknowledging: wait until a write is confirmed by WAIT.
        while master
            .commands(&[
                &["PUBLISH", "distlock-harness", "sync"],
                &["WAIT", "1", "1000"],
            ])?
            .last()
            .map(String::as_str)
            != Some(":1")
        {
            if started.elapsed() > START_TIMEOUT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "replica does not acknowledge",
                ));
            }
        }
        Ok(())
    }

    /// Makes a replica a master (`REPLICAOF NO ONE`), as a failover does.
    pub fn promote(&self) -> io::Result<()> {
        let reply = self.command(&["REPLICAOF", "NO", "ONE"])?;
        if reply.starts_with('+') {
            Ok(())
        } else {
            Err(io::Error::other(format!("REPLICAOF NO ONE: {reply}")))
        }
    }
}
