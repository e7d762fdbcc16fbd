//! The command `run` and `lead` start: spawned in a process group of its own (on Linux, killed
//! should `distlock` die), watched until it exits, stopped (SIGTERM, then SIGKILL) so that it
//! is gone before its lease can end, and sent the signals `distlock` itself receives.
//!
//! Signals are Unix's. Elsewhere Ctrl-C is the only signal heard, and stopping the command
//! kills it at once.

use std::ffi::OsString;
use std::future::Future;
use std::io;
use std::process::ExitStatus;
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::exit;

/// A signal `distlock` received: its number (2 for SIGINT, 15 for SIGTERM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Received(pub(crate) i32);

/// SIGHUP.
pub(crate) const HANGUP: Received = Received(1);
/// SIGINT.
pub(crate) const INTERRUPT: Received = Received(2);
/// SIGQUIT.
pub(crate) const QUIT: Received = Received(3);
/// SIGKILL.
#[cfg(unix)]
const KILL: Received = Received(9);
/// SIGTERM.
pub(crate) const TERMINATE: Received = Received(15);
/// SIGCONT (Linux's number; taken from the platform where signals are heard).
#[cfg(unix)]
const CONTINUE: Received = Received(nix::libc::SIGCONT);
/// SIGSTOP.
#[cfg(unix)]
const STOP: Received = Received(nix::libc::SIGSTOP);
/// SIGTSTP (Ctrl-Z).
#[cfg(unix)]
const TERMINAL_STOP: Received = Received(nix::libc::SIGTSTP);

impl Received {
    /// The exit code of a process that gave up because of this signal, as a shell reports it.
    pub(crate) fn exit_code(self) -> u8 {
        u8::try_from(128 + self.0).unwrap_or(exit::SOFTWARE)
    }

    /// Whether this signal asks `distlock` to end (SIGHUP, SIGINT, SIGQUIT, SIGTERM), rather
    /// than to stop or continue the command.
    pub(crate) fn ends(self) -> bool {
        [HANGUP, INTERRUPT, QUIT, TERMINATE].contains(&self)
    }
}

/// The signals `distlock` handles instead of their default action, heard from the moment this
/// is made: SIGHUP, SIGINT, SIGQUIT and SIGTERM (passed on, then `distlock` ends once the
/// command has), SIGTSTP and SIGCONT (the command is stopped and continued; `distlock` itself
/// never stops, so that the lease stays renewed while the command is stopped).
#[derive(Debug)]
pub(crate) struct Signals {
    #[cfg(unix)]
    heard: Vec<(Received, tokio::signal::unix::Signal)>,
}

#[cfg(unix)]
impl Signals {
    /// Starts listening.
    pub(crate) fn listen() -> io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut heard = Vec::new();
        for received in [HANGUP, INTERRUPT, QUIT, TERMINATE, TERMINAL_STOP, CONTINUE] {
            heard.push((received, signal(SignalKind::from_raw(received.0))?));
        }
        Ok(Self { heard })
    }

    /// The next signal received.
    pub(crate) async fn recv(&mut self) -> Received {
        std::future::poll_fn(|cx| {
            for (received, signal) in &mut self.heard {
                if signal.poll_recv(cx).is_ready() {
                    return std::task::Poll::Ready(*received);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }

    /// The next signal received that asks `distlock` to end (others are dropped): while no
    /// command runs, stopping and continuing concern nobody else.
    pub(crate) async fn ending(&mut self) -> Received {
        loop {
            let received = self.recv().await;
            if received.ends() {
                return received;
            }
        }
    }
}

#[cfg(not(unix))]
impl Signals {
    /// Starts listening (for Ctrl-C only).
    pub(crate) fn listen() -> io::Result<Self> {
        Ok(Self {})
    }

    /// The next Ctrl-C, as SIGINT.
    pub(crate) async fn recv(&mut self) -> Received {
        match tokio::signal::ctrl_c().await {
            Ok(()) => INTERRUPT,
            Err(_) => std::future::pending().await,
        }
    }

    /// The next Ctrl-C, as SIGINT.
    pub(crate) async fn ending(&mut self) -> Received {
        self.recv().await
    }
}

/// A started command, and whether it leads a process group of its own.
#[derive(Debug)]
pub(crate) struct Started {
    child: Child,
    group: bool,
    /// Kills what is left of the group should `distlock` die; told to leave once this is
    /// dropped (the command's end seen to).
    #[cfg(target_os = "linux")]
    _watch: Option<crate::watcher::GroupWatch>,
}

/// Starts `command` (program and arguments) with `vars` added to its environment. Its standard
/// streams are ours. Unless `foreground`, it runs in a process group of its own, so that a
/// signal reaches everything it started (a shell and its pipeline, which would otherwise
/// finish their current command before the shell heard it).
///
/// Fails with the exit code to report: 127 when the program was not found, 126 otherwise.
pub(crate) fn spawn(
    command: &[OsString],
    vars: &[(&str, String)],
    foreground: bool,
) -> Result<Started, u8> {
    let (program, args) = command.split_first().ok_or(exit::USAGE)?;
    let mut spawn = Command::new(program);
    spawn.args(args).envs(vars.iter().map(|(k, v)| (k, v)));
    let group = cfg!(unix) && !foreground;
    #[cfg(unix)]
    if group {
        spawn.process_group(0);
    }
    #[cfg(target_os = "linux")]
    dies_with_us(&mut spawn);
    match spawn.spawn() {
        Ok(child) => Ok(Started {
            #[cfg(target_os = "linux")]
            _watch: watch_group(&child, group),
            child,
            group,
        }),
        Err(error) => {
            say!(
                "distlock: cannot run `{}`: {error}",
                program.to_string_lossy()
            );
            Err(if error.kind() == io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_RUN
            })
        }
    }
}

/// A watcher of the command's group (see [`crate::watcher`]), if it has one.
#[cfg(target_os = "linux")]
fn watch_group(child: &Child, group: bool) -> Option<crate::watcher::GroupWatch> {
    let pid = child.id().filter(|_| group)?;
    match crate::watcher::GroupWatch::start(pid) {
        Ok(watch) => Some(watch),
        Err(error) => {
            say!(
                "distlock: cannot watch the command's process group ({error}): should distlock \
                 die, what the command started may outlive it"
            );
            None
        }
    }
}

/// Has the kernel SIGKILL the command when `distlock` dies, of whatever cause (SIGKILL
/// included), so that it never runs on unsupervised while the lease runs out.
///
/// The kernel sends it when the thread that started the command ends: commands are started
/// from the main thread (the one `#[tokio::main]` blocks on), which ends only with the process.
/// It reaches the command itself (and whatever it `exec`s), not processes it started: the
/// group's watcher kills those.
#[cfg(target_os = "linux")]
fn dies_with_us(spawn: &mut Command) {
    let parent = nix::unistd::getpid();
    let child = move || -> io::Result<()> {
        nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
        // Dead already, before the setting took: nobody would send the signal.
        if nix::unistd::getppid() != parent {
            return Err(io::Error::from(nix::errno::Errno::ESRCH));
        }
        Ok(())
    };
    // SAFETY: the closure runs in the forked child before `exec`, where only
    // async-signal-safe calls are sound: it makes two system calls (`prctl`, `getppid`) and
    // builds an `io::Error` from an OS error code, which allocates nothing; it takes no lock
    // and touches no memory shared with other threads of the parent.
    #[allow(unsafe_code)]
    unsafe {
        spawn.pre_exec(child);
    }
}

/// How a supervised command ended.
#[derive(Debug)]
pub(crate) struct Ended {
    /// Its exit status (an error if it could not be waited for).
    pub(crate) status: io::Result<ExitStatus>,
    /// Set when the command was stopped for its lease.
    pub(crate) lost: Option<Stopped>,
    /// The last signal passed on to it, if any.
    pub(crate) interrupted: Option<Received>,
}

impl Ended {
    /// The command's exit code, as a shell reports it: 128 + N when it died of signal N.
    pub(crate) fn exit_code(&self) -> u8 {
        match &self.status {
            Ok(status) => status_code(*status),
            Err(error) => {
                say!("distlock: lost track of the command: {error}");
                exit::SOFTWARE
            }
        }
    }
}

fn status_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        // Unix keeps the low 8 bits; elsewhere a larger code is still a failure.
        return u8::try_from(code).unwrap_or(if code == 0 { 0 } else { 1 });
    }
    signal_code(status).unwrap_or(exit::SOFTWARE)
}

/// 128 + N for a process that died of signal N.
#[cfg(unix)]
fn signal_code(status: ExitStatus) -> Option<u8> {
    use std::os::unix::process::ExitStatusExt;
    status.signal().map(|signal| Received(signal).exit_code())
}

#[cfg(not(unix))]
fn signal_code(_: ExitStatus) -> Option<u8> {
    None
}

/// The least time between SIGKILL and the end of the lease by this process's clock (which
/// already keeps a margin for drift against the server's): a tenth of the lease, a second at
/// most.
pub(crate) fn kill_margin(ttl: Duration) -> Duration {
    (ttl / 10).min(Duration::from_secs(1))
}

/// `grace` shortened to what fits in a lease of `ttl`: the stop starts once half the lease has
/// passed without a renewal (renewals come every third of it), and SIGKILL goes out
/// [`kill_margin`] before the lease ends.
pub(crate) fn fitted_grace(grace: Duration, ttl: Duration) -> Duration {
    grace.min((ttl / 2).saturating_sub(kill_margin(ttl)))
}

/// Why the command was stopped.
#[derive(Debug)]
pub(crate) enum Stopped {
    /// The lease is known lost (the key gone or taken, or the manager shut down).
    Lost(distlock::LockError),
    /// No renewal confirmed the lease on this key in time: it may run out soon, and the
    /// command had to be gone before it could.
    Unconfirmed(String),
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Lost(error) => error.fmt(f),
            Self::Unconfirmed(key) => write!(
                f,
                "the lease on `{key}` could not be renewed before it would run out"
            ),
        }
    }
}

/// Waits for the command to exit, passing on every signal `distlock` receives meanwhile, and
/// stops it (SIGTERM, then SIGKILL) so that it is gone before the lease of `guard` can end:
/// when `lost` completes (SIGKILL at once: the lease is over), or when the lease has gone
/// unconfirmed so long that only the grace period (see [`fitted_grace`]) is left of it.
pub(crate) async fn supervise(
    mut started: Started,
    guard: &distlock::LockGuard,
    lost: impl Future<Output = distlock::LockError>,
    grace: Duration,
    signals: &mut Signals,
) -> Ended {
    let margin = kill_margin(guard.ttl());
    let before_end = fitted_grace(grace, guard.ttl()) + margin;
    let kill_at = || tokio::time::Instant::now() + guard.remaining().saturating_sub(margin);
    let mut lost = std::pin::pin!(lost);
    let mut interrupted = None;
    let mut paused = false;
    loop {
        // Looked at again after each renewal moved the lease on.
        let unconfirmed = tokio::time::sleep(guard.remaining().saturating_sub(before_end));
        let stopped = tokio::select! {
            status = started.child.wait() => return Ended { status, lost: None, interrupted },
            received = signals.recv() => {
                paused = started.pass_on(received, paused);
                if received.ends() {
                    interrupted = Some(received);
                }
                continue;
            }
            error = &mut lost => Stopped::Lost(error),
            () = unconfirmed => {
                if guard.remaining() > before_end {
                    continue;
                }
                Stopped::Unconfirmed(guard.key().to_owned())
            }
        };
        let status = started.stop(kill_at(), signals).await;
        return Ended {
            status,
            lost: Some(stopped),
            interrupted,
        };
    }
}

impl Started {
    /// Passes a signal on: one that ends as itself (continuing a stopped command, so that it
    /// can act on it), SIGTSTP as SIGSTOP (which the command cannot ignore: it stays stopped
    /// for as long as `distlock`, which does not stop, renews the lease), SIGCONT as itself.
    /// Returns whether the command is stopped now.
    fn pass_on(&mut self, received: Received, paused: bool) -> bool {
        #[cfg(unix)]
        match received {
            TERMINAL_STOP => {
                self.send(STOP);
                return true;
            }
            CONTINUE => {
                self.send(CONTINUE);
                return false;
            }
            _ => {}
        }
        self.send(received);
        #[cfg(unix)]
        if paused {
            self.send(CONTINUE);
        }
        false
    }

    /// SIGTERM (and SIGCONT, should it be stopped), SIGKILL at `kill_at` (at once if that has
    /// passed); waits for the command to exit. Signals that end are passed on meanwhile.
    async fn stop(
        &mut self,
        kill_at: tokio::time::Instant,
        signals: &mut Signals,
    ) -> io::Result<ExitStatus> {
        if kill_at > tokio::time::Instant::now() {
            self.send(TERMINATE);
            #[cfg(unix)]
            self.send(CONTINUE);
            let deadline = tokio::time::sleep_until(kill_at);
            let mut deadline = std::pin::pin!(deadline);
            loop {
                tokio::select! {
                    status = self.child.wait() => return status,
                    received = signals.recv() => if received.ends() {
                        self.send(received);
                    },
                    () = &mut deadline => break,
                }
            }
        }
        self.kill();
        self.child.wait().await
    }

    /// Sends `signal` to the command (to its process group, if it has one), while it has not
    /// been waited for: its id cannot have been reused then.
    #[cfg(unix)]
    fn send(&mut self, signal: Received) {
        use nix::sys::signal::{Signal, kill, killpg};
        use nix::unistd::Pid;
        let Ok(signal) = Signal::try_from(signal.0) else {
            return;
        };
        let Some(pid) = self.child.id().and_then(|pid| i32::try_from(pid).ok()) else {
            return;
        };
        let pid = Pid::from_raw(pid);
        let sent = if self.group {
            killpg(pid, signal)
        } else {
            kill(pid, signal)
        };
        // ESRCH: it is gone already.
        if let Err(error) = sent
            && error != nix::errno::Errno::ESRCH
        {
            say!("distlock: cannot send {signal} to the command: {error}");
        }
    }

    /// Without Unix signals, any signal stops the command at once.
    #[cfg(not(unix))]
    fn send(&mut self, _: Received) {
        self.kill();
    }

    /// SIGKILL to the command (its process group, if it has one).
    #[cfg(unix)]
    fn kill(&mut self) {
        self.send(KILL);
    }

    /// Kills the command.
    #[cfg(not(unix))]
    fn kill(&mut self) {
        let _ = self.child.start_kill();
    }
}
