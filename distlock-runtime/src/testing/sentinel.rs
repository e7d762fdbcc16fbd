//! Sentinels that monitor a master, and their configuration files.

use std::io;
use std::path::PathBuf;

use super::{Password, RedisServer, TestCertificates, free_port};

impl RedisServer {
    /// Starts a Sentinel that monitors `master` as `name` with the given quorum, and notices a
    /// failed master quickly (down after 300 ms). Several Sentinels started for one master find
    /// each other through it. A Sentinel of a master [with a password](Self::start_with_password)
    /// requires the same password, and uses it with the master and the other Sentinels.
    pub fn start_sentinel(master: &RedisServer, name: &str, quorum: u32) -> io::Result<Self> {
        Self::start_as(
            Vec::new(),
            Some(Monitor::of(master, master.port, name, quorum)),
            master.password.clone(),
            master.network(),
        )
    }

    /// A Sentinel that listens with TLS (its [`url`](Self::url) is `rediss://`) and monitors
    /// `master`, [started with TLS](Self::start_tls), on its TLS port (`tls-replication yes`),
    /// so that it names the master's TLS address to clients.
    pub fn start_sentinel_tls(
        master: &RedisServer,
        name: &str,
        quorum: u32,
        certs: &TestCertificates,
    ) -> io::Result<Self> {
        let master_port = master
            .tls_port
            .ok_or_else(|| io::Error::other("the master was not started with TLS"))?;
        let tls_port = free_port()?;
        let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
        let lines = vec![
            format!("tls-port {tls_port}"),
            format!("tls-cert-file {}", file("server.crt")),
            format!("tls-key-file {}", file("server.key")),
            format!("tls-ca-cert-file {}", file("ca.crt")),
            "tls-auth-clients no".to_owned(),
            "tls-replication yes".to_owned(),
        ];
        let mut sentinel = Self::start_as(
            lines,
            Some(Monitor::of(master, master_port, name, quorum)),
            master.password.clone(),
            None,
        )?;
        sentinel.tls_port = Some(tls_port);
        Ok(sentinel)
    }

    /// Writes the configuration file of a Sentinel that monitors `monitor`, which it takes
    /// first and rewrites as it learns; returns its path.
    pub(super) fn write_sentinel_config(
        &self,
        monitor: &Monitor,
        bind: &str,
        announce: Option<&str>,
    ) -> io::Result<PathBuf> {
        let Monitor {
            name,
            addr,
            port: master,
            quorum,
        } = monitor;
        let config = self.dir.join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {port}\nbind {bind}\ndir {dir}\n{announce}\
                 sentinel monitor {name} {addr} {master} {quorum}\n\
                 sentinel down-after-milliseconds {name} 300\n\
                 sentinel failover-timeout {name} 2000\n\
                 sentinel parallel-syncs {name} 1\n{auth}{extra}\n",
                port = self.port,
                dir = self.dir.display(),
                announce = announce.map_or_else(String::new, |ip| format!("sentinel announce-ip {ip}\n")),
                // Extra configuration lines (TLS).
                extra = self.extra.join("\n"),
                auth = self.password.as_ref().map_or_else(String::new, |Password(p)| format!(
                    "requirepass {p}\nsentinel auth-pass {name} {p}\nsentinel sentinel-pass {p}\n"
                )),
            ),
        )?;
        Ok(config)
    }
}

/// The master a Sentinel monitors.
#[derive(Debug, Clone)]
pub(super) struct Monitor {
    name: String,
    /// Its address and port as the Sentinel reaches it (and names it to clients).
    addr: String,
    port: u16,
    quorum: u32,
}

impl Monitor {
    fn of(master: &RedisServer, port: u16, name: &str, quorum: u32) -> Self {
        Self {
            name: name.to_owned(),
            addr: master.addr(),
            port,
            quorum,
        }
    }
}
