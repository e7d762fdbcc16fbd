//! Real partitions: servers in a network namespace of their own, each reached over a veth
//! pair (its *path*) whose link can be set down and up again.
//!
//! A cut path drops packets without a word, as a real partition does: connections stay
//! half-open, new ones wait for a SYN that never arrives, and the kernel retransmits with a
//! growing backoff. Nothing but the `ip` command is needed (Linux, as root).
//!
//! ```no_run
//! use distlock_runtime::testing::Network;
//!
//! let network = Network::create()?;      // a namespace of its own, removed on drop
//! let server = network.start_server()?;  // redis://198.x.y.z:<port>, over its own path
//! network.cut(&server)?;                 // packets to and from it are dropped
//! network.heal(&server)?;                // and flow again
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! Inside the namespace the servers reach each other (replication, Sentinel, the Cluster
//! bus) whatever is cut: a cut separates the test process from one server, not the servers
//! from each other. The harness's own commands ([`RedisServer::command`]) go over a control
//! path that is never cut. Every address is inside `198.18.0.0/15` (set aside for network
//! tests, routed nowhere), on links that exist only between this process and the namespace.

use std::net::Ipv4Addr;
use std::path::Path as FsPath;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::{fmt, io};

use super::RedisServer;

/// How many paths a network can have (each a `/30` of its `/24`); the first is the control
/// path.
const PATHS: u32 = 64;

/// A network namespace with servers inside, reached over paths that can be cut; removed,
/// with every link of it, when the last server started in it and the network itself are
/// dropped (also when a test panics). Namespaces left by a process that died are removed by
/// the next [`Network::create`].
pub struct Network {
    /// The namespace's name: `distlock-<pid>-<n>`.
    name: String,
    /// Every path is a `/30` of `198.<a>.<b>.0/24`.
    block: (u8, u8),
    /// The next path's index.
    next: AtomicU32,
    /// The next port for a server: ports in the namespace are its own, so a counter gives
    /// each server one no other listens on.
    ports: AtomicU32,
    /// The root end's name of each path starts with this.
    prefix: String,
}

impl fmt::Debug for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Network")
            .field("name", &self.name)
            .field(
                "block",
                &format_args!("198.{}.{}.0/24", self.block.0, self.block.1),
            )
            .finish()
    }
}

/// Where a server in a [`Network`] listens: the namespace end of its own path.
#[derive(Debug, Clone)]
pub(super) struct Host {
    pub(super) network: Arc<Network>,
    /// The address clients reach it at.
    pub(super) ip: Ipv4Addr,
    /// Its path, cut by [`Network::cut`].
    link: Link,
}

/// One path: a veth pair between this process's namespace and the network's.
#[derive(Debug, Clone)]
struct Link {
    /// The end inside the namespace, which a cut sets down (the end on this side stays up,
    /// so that packets for the path are dropped, not routed elsewhere).
    inside: String,
}

/// A further path to a server of a [`Network`], cut and healed on its own: another client
/// (as if on another machine) that a cut of the server's own path does not reach.
#[derive(Debug)]
pub struct Path {
    network: Arc<Network>,
    url: String,
    link: Link,
}

impl Path {
    /// The server's URL over this path.
    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// Sets this path's link down: packets on it are dropped.
    pub fn cut(&self) -> io::Result<()> {
        self.network.set(&self.link, "down")
    }

    /// Sets this path's link up again.
    pub fn heal(&self) -> io::Result<()> {
        self.network.set(&self.link, "up")
    }
}

impl Network {
    /// Creates a namespace and its control path. Fails with [`io::ErrorKind::Unsupported`]
    /// where namespaces cannot be made (not Linux, not root, no `ip` command).
    pub fn create() -> io::Result<Arc<Self>> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        if !cfg!(target_os = "linux") {
            return Err(unsupported("network namespaces need Linux"));
        }
        sweep();
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("distlock-{pid}-{n}");
        ip(&["netns", "add", &name]).map_err(|error| {
            unsupported(&format!(
                "cannot create a network namespace (`ip netns add` needs root): {error}"
            ))
        })?;
        let mut network = Self {
            name,
            block: (0, 0),
            next: AtomicU32::new(0),
            ports: AtomicU32::new(20_000),
            prefix: format!("d{pid:x}n{n:x}p"),
        };
        // A block no address of this machine is in; on a clash (another process picked the
        // same one meanwhile), another.
        let mut last = None;
        for _ in 0..8 {
            network.block = (18 + fastrand::u8(0..2), fastrand::u8(..));
            if in_use(network.block)? {
                continue;
            }
            network.next.store(0, Ordering::Relaxed);
            match network.add_path() {
                Ok(_) => {
                    ip(&["-n", &network.name, "link", "set", "lo", "up"])?;
                    return Ok(Arc::new(network));
                }
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free address block for a network")))
    }

    /// Starts a server inside the namespace, on a path of its own; see
    /// [`RedisServer::start`]. Replicas and Sentinels of it
    /// ([`RedisServer::start_replica_of`], [`RedisServer::start_sentinel`]) start in the
    /// same namespace, each on a path of its own.
    pub fn start_server(self: &Arc<Self>) -> io::Result<RedisServer> {
        RedisServer::start_as(Vec::new(), None, None, Some(self))
    }

    /// Starts a Redis Cluster of `masters` masters inside the namespace, each node on a path
    /// of its own, announcing that path's address; see [`RedisServer::start_cluster`].
    pub fn start_cluster(self: &Arc<Self>, masters: usize) -> io::Result<Vec<RedisServer>> {
        RedisServer::cluster_of(masters, 0, None, Some(self))
    }

    /// Starts `n` independent servers inside the namespace (RedLock masters), each on a
    /// path of its own.
    pub fn start_servers(self: &Arc<Self>, n: usize) -> io::Result<Vec<RedisServer>> {
        (0..n).map(|_| self.start_server()).collect()
    }

    /// A further path to `server`, cut and healed on its own.
    pub fn path_to(self: &Arc<Self>, server: &RedisServer) -> io::Result<Path> {
        let host = self.host()?;
        let url = server
            .url()
            .replacen(&server.addr(), &host.ip.to_string(), 1);
        Ok(Path {
            network: Arc::clone(self),
            url,
            link: host.link,
        })
    }

    /// Cuts `server`'s own path: packets between this process and the server are dropped
    /// until [`heal`](Self::heal). Paths made by [`path_to`](Self::path_to) stay up.
    pub fn cut(&self, server: &RedisServer) -> io::Result<()> {
        self.set(&self.link_of(server)?, "down")
    }

    /// Heals `server`'s own path.
    pub fn heal(&self, server: &RedisServer) -> io::Result<()> {
        self.set(&self.link_of(server)?, "up")
    }

    /// The control path's address in the namespace, where the harness reaches every server.
    pub(super) fn control(&self) -> Ipv4Addr {
        self.inside(0)
    }

    /// A port no other server of the namespace listens on.
    pub(super) fn port(&self) -> u16 {
        let port = self.ports.fetch_add(1, Ordering::Relaxed);
        u16::try_from(port).unwrap_or(u16::MAX)
    }

    /// `program` to be run inside the namespace.
    pub(super) fn command(&self, program: &FsPath) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name]).arg(program);
        command
    }

    /// A new path, for a server to listen on.
    pub(super) fn host(self: &Arc<Self>) -> io::Result<Host> {
        let (ip, link) = self.add_path()?;
        Ok(Host {
            network: Arc::clone(self),
            ip,
            link,
        })
    }

    fn link_of(&self, server: &RedisServer) -> io::Result<Link> {
        match &server.host {
            Some(host) if std::ptr::eq(Arc::as_ptr(&host.network), self) => Ok(host.link.clone()),
            _ => Err(io::Error::other(
                "the server was not started in this network",
            )),
        }
    }

    fn set(&self, link: &Link, state: &str) -> io::Result<()> {
        ip(&["-n", &self.name, "link", "set", &link.inside, state])
    }

    /// Adds a veth pair: `198.a.b.4k+1` on this side, `198.a.b.4k+2` inside.
    fn add_path(&self) -> io::Result<(Ipv4Addr, Link)> {
        let k = self.next.fetch_add(1, Ordering::Relaxed);
        if k >= PATHS {
            return Err(io::Error::other("a network has at most 63 paths"));
        }
        let outside = format!("{}{k:x}", self.prefix);
        let inside = format!("p{k}");
        let (near, far) = (self.address(4 * k + 1), self.inside(k));
        ip(&[
            "link", "add", &outside, "type", "veth", "peer", "name", &inside, "netns", &self.name,
        ])?;
        ip(&["addr", "add", &format!("{near}/30"), "dev", &outside])?;
        ip(&["link", "set", &outside, "up"])?;
        ip(&[
            "-n",
            &self.name,
            "addr",
            "add",
            &format!("{far}/30"),
            "dev",
            &inside,
        ])?;
        ip(&["-n", &self.name, "link", "set", &inside, "up"])?;
        Ok((far, Link { inside }))
    }

    fn inside(&self, k: u32) -> Ipv4Addr {
        self.address(4 * k + 2)
    }

    fn address(&self, host: u32) -> Ipv4Addr {
        Ipv4Addr::new(198, self.block.0, self.block.1, host as u8)
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Removes the namespace's end of every path, and with it this side's end.
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Runs `ip` with `args`; its error output becomes the error.
fn ip(args: &[&str]) -> io::Result<()> {
    super::run_tool("ip", args)
}

fn unsupported(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, why.to_owned())
}

/// Whether an address or a route of this machine is in `198.a.b.0/24`.
fn in_use((a, b): (u8, u8)) -> io::Result<bool> {
    let block = format!("198.{a}.{b}.");
    for args in [
        &["-o", "-4", "addr", "show"][..],
        &["-4", "route", "show"][..],
    ] {
        let output = Command::new("ip").args(args).output()?;
        if String::from_utf8_lossy(&output.stdout).contains(&block) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Removes the namespaces of processes that are gone (killed before their networks dropped).
fn sweep() {
    let Ok(output) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix("distlock-")
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !FsPath::new("/proc").join(pid).exists() {
            // Its servers first: they would keep the namespace, and its links, alive.
            if let Ok(pids) = Command::new("ip").args(["netns", "pids", name]).output() {
                for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", name]);
        }
    }
}
