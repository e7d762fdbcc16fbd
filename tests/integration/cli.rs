//! The `distlock` binary against real servers: the inspector here, `run` and `lead` in the
//! submodules.
#![cfg(feature = "cli")]

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use distlock::LockError;

use crate::support;
use crate::support::{keys, manager, shared_server, unique_prefix};

mod lead;
mod run;

/// Runs `distlock args…` with the given environment (nothing else from ours), feeding `input`.
fn distlock(env: &[(&str, &str)], args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_distlock"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_show_every_kind() {
    let server = shared_server();
    let prefix = unique_prefix("cli-list");
    let locks = manager(&server, &prefix).await;
    let plain = locks.lock("order:1").acquire().await.unwrap();
    let fenced = locks.lock("order:2").fencing(true).acquire().await.unwrap();
    let r1 = locks.read_lock("doc").acquire().await.unwrap();
    let r2 = locks.read_lock("doc").acquire().await.unwrap();
    let permit = locks.semaphore("pool", 3).acquire().await.unwrap();
    let url = server.url();
    let env = [
        ("DISTLOCK_URL", url.as_str()),
        ("DISTLOCK_KEY_PREFIX", &prefix),
    ];

    let all = distlock(&env, &["list"], "");
    assert!(all.status.success(), "{}", text(&all));
    let table = text(&all);
    for (name, kind) in [
        ("order:1", "exclusive"),
        ("order:2", "exclusive"),
        ("doc", "read"),
        ("pool", "semaphore"),
    ] {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} listed:\n{table}"));
        assert!(line.contains(kind), "{line}");
    }
    assert!(table.contains(plain.token()), "{table}");
    assert!(
        table.contains(r1.token()) && table.contains(r2.token()),
        "{table}"
    );
    let pool = table.lines().find(|l| l.starts_with("pool ")).unwrap();
    assert!(pool.split_whitespace().any(|w| w == "3"), "N shown: {pool}");

    let orders = text(&distlock(&env, &["list", "order:*"], ""));
    assert!(
        orders.contains("order:1") && !orders.contains("doc"),
        "{orders}"
    );

    let show = distlock(&env, &["show", "order:2"], "");
    assert!(show.status.success());
    let detail = text(&show);
    assert!(detail.contains(fenced.token()), "{detail}");
    assert!(
        detail.contains(&format!("fencing:  {}", fenced.fencing_token().unwrap())),
        "{detail}"
    );
    // Each holder is named: client name, host and pid of the manager that took it.
    let who = format!("{}, up ", locks.identity());
    assert!(detail.contains(&format!("by {who}")), "{detail}");
    assert!(
        table.contains(&format!("{} ({who}", plain.token())),
        "{table}"
    );
    let missing = distlock(&env, &["show", "nothing"], "");
    assert_eq!(missing.status.code(), Some(1));

    for guard in [plain, fenced, r1, r2, permit] {
        guard.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_asks_and_removes_exactly_the_lock() {
    let server = shared_server();
    let prefix = unique_prefix("cli-release");
    let locks = manager(&server, &prefix).await;
    let other = manager(&server, &prefix).await;
    let stuck = locks
        .lock("stuck")
        .ttl(Duration::from_secs(60))
        .acquire()
        .await
        .unwrap();
    let url = server.url();
    let env = [
        ("DISTLOCK_URL", url.as_str()),
        ("DISTLOCK_KEY_PREFIX", &prefix),
    ];

    let refused = distlock(&env, &["release", "stuck"], "");
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    let declined = distlock(&env, &["release", "stuck", "--force"], "n\n");
    assert!(text(&declined).contains("nothing removed"));
    assert!(
        stuck.is_held().await.unwrap(),
        "still held after --force without yes"
    );

    // A waiter on another manager gets the lock once it is removed.
    let waiter = tokio::spawn(async move {
        other
            .lock("stuck")
            .wait(Duration::from_secs(20))
            .acquire()
            .await
    });
    let removed = distlock(&env, &["release", "stuck", "--force"], "y\n");
    assert!(removed.status.success(), "{}", text(&removed));
    assert!(text(&removed).contains(stuck.token()), "{}", text(&removed));
    let next = waiter.await.unwrap().unwrap();
    assert!(matches!(stuck.release().await, Err(LockError::Lost { .. })));
    next.release().await.unwrap();

    let held = locks.lock("again").acquire().await.unwrap();
    let yes = distlock(&env, &["release", "again", "--force", "--yes"], "");
    assert!(yes.status.success(), "{}", text(&yes));
    assert!(!held.is_held().await.unwrap());
    drop(held);
    assert!(keys(&server, &prefix).is_empty());
}

/// What the operator confirmed is what goes: a lock that changed hands while they read the
/// prompt is shown again and asked about again, and the new holder keeps it unless they say
/// yes to it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_asks_again_when_the_holders_changed_while_the_operator_read() {
    use std::io::Read;
    let server = shared_server();
    let prefix = unique_prefix("cli-changed");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("stuck").acquire().await.unwrap();
    let url = server.url();
    let mut child = Command::new(env!("CARGO_BIN_EXE_distlock"))
        .args(["release", "stuck", "--force"])
        .env_clear()
        .env("DISTLOCK_URL", &url)
        .env("DISTLOCK_KEY_PREFIX", &prefix)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let (sent, printed) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut chunk = [0; 4096];
        while let Ok(n @ 1..) = stdout.read(&mut chunk) {
            let _ = sent.send(String::from_utf8_lossy(&chunk[..n]).into_owned());
        }
    });
    let mut seen = String::new();
    let mut until_printed = |what: &str, times: usize| {
        while seen.matches(what).count() < times {
            match printed.recv_timeout(Duration::from_secs(20)) {
                Ok(more) => seen.push_str(&more),
                Err(_) => panic!("never printed {what:?}:\n{seen}"),
            }
        }
        seen.clone()
    };
    let asked = until_printed("[y/N] ", 1);
    assert!(asked.contains(first.token()), "{asked}");
    // While the operator reads: the holder leaves, another takes the lock.
    first.release().await.unwrap();
    let second = locks.lock("stuck").acquire().await.unwrap();
    stdin.write_all(b"y\n").unwrap();
    let again = until_printed("[y/N] ", 2);
    assert!(again.contains("changed meanwhile"), "{again}");
    assert!(again.contains(second.token()), "{again}");
    assert!(
        second.is_held().await.unwrap(),
        "removed without being confirmed"
    );
    stdin.write_all(b"y\n").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let done = until_printed(&format!("removed {} (", locks.redis_key("stuck")), 1);
    assert!(status.success(), "{done}");
    assert!(matches!(
        second.release().await,
        Err(LockError::Lost { .. })
    ));
    assert!(keys(&server, &prefix).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_prints_holders_as_they_change() {
    use std::io::BufRead;
    let server = shared_server();
    let prefix = unique_prefix("cli-watch");
    let locks = manager(&server, &prefix).await;
    let first = locks.lock("w").acquire().await.unwrap();
    let url = server.url();
    let mut child = Command::new(env!("CARGO_BIN_EXE_distlock"))
        .args(["watch", "w", "--count", "2", "--for", "30s"])
        .env_clear()
        .env("DISTLOCK_URL", &url)
        .env("DISTLOCK_KEY_PREFIX", &prefix)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = lines_tx.send(line.unwrap());
        }
    });
    // Each step waits for the watcher to print what it saw.
    let line = lines.recv().await.unwrap();
    assert!(line.contains(first.token()), "{line}");
    let second = locks.lock("w");
    first.release().await.unwrap();
    let second = second.acquire().await.unwrap();
    let line = lines.recv().await.unwrap();
    assert!(
        line.contains(second.token()) || line.contains("free"),
        "{line}"
    );
    second.release().await.unwrap();
    let mut rest = Vec::new();
    while let Some(line) = lines.recv().await {
        rest.push(line);
    }
    assert!(child.wait().unwrap().success());
    assert!(!rest.is_empty() || line.contains("free"));
}

#[test]
fn bad_settings_are_clear_errors_and_no_password_is_printed() {
    let bad = distlock(
        &[("DISTLOCK_URL", "redis://:s3cret-pw@127.0.0.1:1")],
        &["list"],
        "",
    );
    assert_eq!(bad.status.code(), Some(69), "could not reach Redis");
    assert!(!text(&bad).contains("s3cret-pw"), "{}", text(&bad));
    let ttl = distlock(
        &[
            ("DISTLOCK_URL", "redis://127.0.0.1:1"),
            ("DISTLOCK_DEFAULT_TTL", "soon"),
        ],
        &["list"],
        "",
    );
    assert!(
        text(&ttl).contains("DISTLOCK_DEFAULT_TTL"),
        "{}",
        text(&ttl)
    );
    assert!(!text(&ttl).contains("panicked"));
    assert_eq!(ttl.status.code(), Some(78), "a configuration error");
    let usage = distlock(&[], &["frobnicate"], "");
    assert_eq!(usage.status.code(), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_reads_every_master_of_a_cluster() {
    let nodes = distlock::testing::RedisServer::start_cluster(3).unwrap();
    let locks = support::cluster_manager(&nodes, "cli-cluster:").await;
    let mut guards = Vec::new();
    for i in 0..20 {
        guards.push(locks.lock(format!("job:{i}")).acquire().await.unwrap());
    }
    let listed = locks.list("job:*").await.unwrap();
    assert_eq!(listed.len(), 20, "{listed:?}");
    let removed = locks.force_release("job:7").await.unwrap().unwrap();
    assert_eq!(removed.holders[0].token, guards[7].token());
    assert!(locks.inspect("job:7").await.unwrap().is_none());
    assert_eq!(locks.list("*").await.unwrap().len(), 19);
}

/// How long any one step of a `distlock` process may take before a test gives up on it.
const BOUND: Duration = Duration::from_secs(30);

/// A `distlock` process started with `--url` and `--prefix` and nothing from our environment,
/// whose standard output arrives line by line; its standard input is a pipe.
struct Running {
    process: tokio::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    stderr: tokio::task::JoinHandle<String>,
}

/// How a [`Running`] process ended.
#[derive(Debug)]
struct Exited {
    code: Option<i32>,
    /// The standard output lines not read before it ended.
    rest: Vec<String>,
    stderr: String,
}

impl Running {
    fn start(url: &str, prefix: &str, args: &[&str]) -> Self {
        Self::start_with(&[], &["--url", url, "--prefix", prefix], args)
    }

    /// Started with the environment `env` and the arguments `global` then `args`.
    fn start_with(env: &[(&str, &str)], global: &[&str], args: &[&str]) -> Self {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt};
        let mut process = tokio::process::Command::new(env!("CARGO_BIN_EXE_distlock"))
            .args(global)
            .args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let (sender, lines) = tokio::sync::mpsc::unbounded_channel();
        let mut stdout = tokio::io::BufReader::new(process.stdout.take().unwrap()).lines();
        tokio::spawn(async move {
            while let Ok(Some(line)) = stdout.next_line().await {
                let _ = sender.send(line);
            }
        });
        let mut stderr = process.stderr.take().unwrap();
        let stderr = tokio::spawn(async move {
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            text
        });
        Self {
            process,
            lines,
            stderr,
        }
    }

    /// The next line of standard output.
    async fn line(&mut self) -> String {
        match tokio::time::timeout(BOUND, self.lines.recv()).await {
            Ok(Some(line)) => line,
            Ok(None) => panic!("distlock ended without another line"),
            Err(_) => panic!("no line from distlock in {BOUND:?}"),
        }
    }

    fn pid(&self) -> u32 {
        self.process.id().expect("running")
    }

    /// Sends the signal `name` (`TERM`, `INT`, `KILL`) to the process.
    fn signal(&self, name: &str) {
        send_signal(self.pid(), name);
    }

    async fn write(&mut self, text: &str) {
        use tokio::io::AsyncWriteExt;
        let stdin = self.process.stdin.as_mut().unwrap();
        stdin.write_all(text.as_bytes()).await.unwrap();
        stdin.flush().await.unwrap();
    }

    async fn exit(mut self) -> Exited {
        let status = tokio::time::timeout(BOUND, self.process.wait())
            .await
            .unwrap_or_else(|_| panic!("distlock still running after {BOUND:?}"))
            .unwrap();
        let stderr = tokio::time::timeout(BOUND, self.stderr)
            .await
            .expect("stderr closed")
            .unwrap();
        let mut rest = Vec::new();
        while let Ok(Some(line)) = tokio::time::timeout(BOUND, self.lines.recv()).await {
            rest.push(line);
        }
        Exited {
            code: status.code(),
            rest,
            stderr,
        }
    }
}

/// Sends the signal `name` to the process `pid`.
fn send_signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}

/// Runs `distlock --url URL --prefix PREFIX args…` to its end.
async fn finished(url: &str, prefix: &str, args: &[&str]) -> Exited {
    Running::start(url, prefix, args).exit().await
}

/// One duration syntax (`distlock::parse_duration`, which `from_env` reads with too): what
/// the attribute refuses at compile time, the binary refuses (a bare number has no unit;
/// zero is no duration).
#[test]
fn durations_are_read_as_the_attribute_reads_them() {
    for (value, says) in [
        ("30", "needs a unit"),
        ("0s", "greater than zero"),
        ("0", "needs a unit"),
    ] {
        let output = distlock(&[], &["run", "k", "--ttl", value, "--", "true"], "");
        assert_eq!(
            output.status.code(),
            Some(2),
            "--ttl {value}: {}",
            text(&output)
        );
        assert!(
            text(&output).contains(says),
            "--ttl {value}: {}",
            text(&output)
        );
        let parsed = distlock::parse_duration(value).unwrap_err().to_string();
        assert!(parsed.contains(says), "parse_duration({value:?}): {parsed}");
    }
}

/// The state letter of the process `pid` (`R`, `S`, `T` for stopped, `Z` for a zombie), or
/// `None` once there is no such process.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state …`: the name may hold spaces and parentheses, the state follows the
    // last `)`.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Waits until the process `pid` is in a state `until` accepts (`None`: it is gone), within
/// [`BOUND`].
async fn await_state(pid: u32, what: &str, until: impl Fn(Option<char>) -> bool) {
    let started = std::time::Instant::now();
    loop {
        let state = process_state(pid);
        if until(state) {
            return;
        }
        assert!(
            started.elapsed() < BOUND,
            "process {pid} not {what} after {BOUND:?}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the process `pid` is dead (gone, or a zombie nobody has reaped yet).
async fn dead(pid: u32) {
    await_state(pid, "dead", |state| matches!(state, None | Some('Z'))).await;
}
