//! A real PostgreSQL server for tests: `initdb` and `postgres` in a fresh temporary directory,
//! on a free loopback port, stopped and removed on drop.
//!
//! The binaries are `DISTLOCK_POSTGRES_BIN`'s (a directory), or on `PATH`, or the newest
//! under `/usr/lib/postgresql/*/bin` (Debian's `postgresql` package). PostgreSQL refuses to
//! run as root: when this process is root, the server runs as the `postgres` user (which
//! that package creates), through `setpriv`.

use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The environment variable that names the directory of `initdb` and `postgres`.
pub const POSTGRES_BIN_ENV: &str = "DISTLOCK_POSTGRES_BIN";

/// The superuser of the test server (no password: it trusts loopback connections).
pub const POSTGRES_USER: &str = "distlock";

/// The unprivileged user the server runs as when this process is root.
const RUN_AS: &str = "postgres";

const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A `postgres` child process on a loopback port, stopped on drop.
#[derive(Debug)]
pub struct PostgresServer {
    port: u16,
    dir: PathBuf,
    child: Mutex<Option<Child>>,
}

impl PostgresServer {
    /// Runs `initdb` in a temporary directory and starts `postgres` on a free loopback port;
    /// returns once it accepts connections.
    pub fn start() -> io::Result<Self> {
        let bin = find_bin()?;
        let port = super::free_port()?;
        let dir = scratch_dir(port)?;
        let as_root = effective_uid()? == 0;
        if as_root {
            chown(&dir)?;
        }
        let data = dir.join("data");
        let initdb = run_as(as_root, &bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                POSTGRES_USER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ])
            .stdin(Stdio::null())
            .output()?;
        if !initdb.status.success() {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(io::Error::other(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&initdb.stderr).trim()
            )));
        }
        let log = std::fs::File::create(dir.join("postgres.log"))?;
        if as_root {
            chown(&dir)?;
        }
        let child = run_as(as_root, &bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&dir)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "synchronous_commit=off", "-c", "full_page_writes=off"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let server = Self {
            port,
            dir,
            child: Mutex::new(Some(child)),
        };
        server.wait_until_ready()?;
        Ok(server)
    }

    /// The server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A `tokio-postgres` connection string for the `postgres` database as
    /// [`POSTGRES_USER`].
    pub fn connection_string(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user={POSTGRES_USER} dbname=postgres",
            self.port
        )
    }

    /// Waits until the server's log says it accepts connections (or it exited).
    fn wait_until_ready(&self) -> io::Result<()> {
        let started = Instant::now();
        let log = self.dir.join("postgres.log");
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("ready to accept connections") {
                return Ok(());
            }
            let exited = self
                .lock_child()
                .as_mut()
                .is_none_or(|child| child.try_wait().ok().flatten().is_some());
            if exited || started.elapsed() > START_TIMEOUT {
                return Err(io::Error::other(format!(
                    "postgres did not start on port {}: {}",
                    self.port,
                    text.trim()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn lock_child(&self) -> std::sync::MutexGuard<'_, Option<Child>> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.lock_child().take() {
            // A fast shutdown (SIGINT) stops the server's own children too; SIGKILL if it
            // does not end in time.
            let _ = Command::new("kill")
                .arg("-INT")
                .arg(child.id().to_string())
                .status();
            let until = Instant::now() + Duration::from_secs(5);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory holding `initdb` and `postgres`.
fn find_bin() -> io::Result<PathBuf> {
    if let Some(dir) = std::env::var_os(POSTGRES_BIN_ENV).filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(dir));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = std::env::split_paths(&path)
        .find(|dir| dir.join("initdb").is_file() && dir.join("postgres").is_file());
    if let Some(dir) = on_path {
        return Ok(dir);
    }
    // The newest major version Debian's packages installed.
    let mut installed: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .collect();
    installed.sort();
    installed.pop().map(|(_, bin)| bin).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no PostgreSQL server found: install one (Debian: `apt-get install postgresql`), \
                 put `initdb` and `postgres` on PATH, or set {POSTGRES_BIN_ENV} to their directory"
            ),
        )
    })
}

/// `program`, run as [`RUN_AS`] when this process is root.
fn run_as(as_root: bool, program: &Path) -> Command {
    if !as_root {
        return Command::new(program);
    }
    let mut command = Command::new("setpriv");
    command
        .args(["--reuid", RUN_AS, "--regid", RUN_AS, "--init-groups", "--"])
        .arg(program);
    command
}

/// Gives `dir` to [`RUN_AS`].
fn chown(dir: &Path) -> io::Result<()> {
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{RUN_AS}:"))
        .arg(dir)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "running as root, the PostgreSQL test server runs as the `{RUN_AS}` user, and \
             `chown` to it failed ({status}): create that user (Debian's `postgresql` package does)"
        )))
    }
}

/// This process's effective user id, from `/proc/self/status` (Linux); 1 elsewhere.
fn effective_uid() -> io::Result<u32> {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return Ok(1);
    };
    let uid = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .and_then(|id| id.parse().ok());
    uid.ok_or_else(|| io::Error::other("no effective uid in /proc/self/status"))
}

fn scratch_dir(port: u16) -> io::Result<PathBuf> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "distlock-postgres-{}-{port}-{n}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
