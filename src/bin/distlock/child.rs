//! The command `run` and `lead` start: spawned in a process group of its own, watched until it
//! exits, stopped (SIGTERM, then SIGKILL after a grace period) when the lock is lost, and sent
//! the SIGINT or SIGTERM that `distlock` itself receives.
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

impl Received {
    /// The exit code of a process that gave up because of this signal, as a shell reports it.
    pub(crate) fn exit_code(self) -> u8 {
        u8::try_from(128 + self.0).unwrap_or(exit::SOFTWARE)
    }
}

/// SIGINT and SIGTERM, heard from the moment this is made (instead of ending the process).
#[derive(Debug)]
pub(crate) struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Signals {
    /// Starts listening.
    pub(crate) fn listen() -> io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// The next signal received.
    pub(crate) async fn recv(&mut self) -> Received {
        tokio::select! {
            Some(()) = self.interrupt.recv() => Received(2),
            Some(()) = self.terminate.recv() => Received(15),
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
            Ok(()) => Received(2),
            Err(_) => std::future::pending().await,
        }
    }
}

/// A started command, and whether it leads a process group of its own.
#[derive(Debug)]
pub(crate) struct Started {
    child: Child,
    group: bool,
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
    match spawn.spawn() {
        Ok(child) => Ok(Started { child, group }),
        Err(error) => {
            eprintln!(
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

/// How a supervised command ended.
#[derive(Debug)]
pub(crate) struct Ended {
    /// Its exit status (an error if it could not be waited for).
    pub(crate) status: io::Result<ExitStatus>,
    /// Set when the lock was lost and the command was stopped for it.
    pub(crate) lost: Option<distlock::LockError>,
    /// The last signal passed on to it, if any.
    pub(crate) interrupted: Option<Received>,
}

impl Ended {
    /// The command's exit code, as a shell reports it: 128 + N when it died of signal N.
    pub(crate) fn exit_code(&self) -> u8 {
        match &self.status {
            Ok(status) => status_code(*status),
            Err(error) => {
                eprintln!("distlock: lost track of the command: {error}");
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

/// Waits for the command to exit, passing on every signal `distlock` receives meanwhile; if
/// `lost` completes first, stops it: SIGTERM, then SIGKILL after `grace`.
pub(crate) async fn supervise(
    mut started: Started,
    lost: impl Future<Output = distlock::LockError>,
    grace: Duration,
    signals: &mut Signals,
) -> Ended {
    let mut lost = std::pin::pin!(lost);
    let mut interrupted = None;
    loop {
        tokio::select! {
            status = started.child.wait() => return Ended { status, lost: None, interrupted },
            received = signals.recv() => {
                started.send(received);
                interrupted = Some(received);
            }
            error = &mut lost => {
                let status = started.stop(grace, signals).await;
                return Ended { status, lost: Some(error), interrupted };
            }
        }
    }
}

impl Started {
    /// SIGTERM, SIGKILL after `grace`; waits for the command to exit. Signals received
    /// meanwhile are passed on.
    async fn stop(&mut self, grace: Duration, signals: &mut Signals) -> io::Result<ExitStatus> {
        self.send(Received(15));
        let deadline = tokio::time::sleep(grace);
        let mut deadline = std::pin::pin!(deadline);
        loop {
            tokio::select! {
                status = self.child.wait() => return status,
                received = signals.recv() => self.send(received),
                () = &mut deadline => break,
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
            eprintln!("distlock: cannot send {signal} to the command: {error}");
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
        self.send(Received(9));
    }

    /// Kills the command.
    #[cfg(not(unix))]
    fn kill(&mut self) {
        let _ = self.child.start_kill();
    }
}
