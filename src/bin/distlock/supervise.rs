//! `run` and `lead`: a command run while a lock (or an election) is held, through the same
//! requests the attribute makes, and ended when it is lost.

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, ValueEnum};
use distlock::{LockError, LockGuard, LockManager, LockRequest};

use crate::child::{self, Ended, Signals};
use crate::duration::parse_duration;
use crate::{exit, inspector};

/// What `run` does when the lock is held by someone else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum OnBusy {
    /// Wait for it (up to `--wait`, if given).
    Wait,
    /// Do not run the command; say so on stderr.
    Skip,
    /// Do not run the command; fail with an error on stderr.
    Fail,
}

/// The read or write side of a read-write lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Shared with other readers.
    Read,
    /// Exclusive, against readers and writers.
    Write,
}

/// What runs, and how it is stopped.
#[derive(Args, Debug)]
pub(crate) struct CommandArgs {
    /// When the lease is lost or unconfirmed: how long the command has between SIGTERM and
    /// SIGKILL, shortened to what fits before the lease can end (under half of `--ttl`).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    grace: Duration,
    /// Keep the command in distlock's process group, as for an interactive program that
    /// reads the terminal: signals then reach the command itself, not what it starts.
    #[arg(long)]
    foreground: bool,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

impl CommandArgs {
    /// The program's name, for messages.
    fn program(&self) -> String {
        self.command
            .first()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The options of `run`: those of `#[distributed_lock]`, by the same names.
#[derive(Args, Debug)]
pub(crate) struct RunArgs {
    /// The lock's name.
    key: String,
    /// The lease, renewed while the command runs (default: the manager's, 30s; with
    /// `--min-hold` and no `--ttl`, the min-hold).
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// With `--on-busy wait`: how long to wait for the lock (default: as long as it takes).
    #[arg(long, value_parser = parse_duration)]
    wait: Option<Duration>,
    /// When the lock is held: wait for it, skip the command, or fail.
    #[arg(long, value_enum, default_value = "wait")]
    on_busy: OnBusy,
    /// Keep the key this long after the lock was taken, even when the command ends sooner:
    /// another run in the same window finds it busy (a job runs at most once per window).
    #[arg(long, value_parser = parse_duration)]
    min_hold: Option<Duration>,
    /// Draw a fencing token, passed to the command as DISTLOCK_FENCING_TOKEN.
    #[arg(long)]
    fencing: bool,
    /// Take the read or the write side of a read-write lock (default: an exclusive lock).
    #[arg(long, value_enum, conflicts_with = "permits")]
    mode: Option<Mode>,
    /// Take one of N permits of a counting semaphore.
    #[arg(long, value_name = "N")]
    permits: Option<u32>,
    /// Stop renewing the lease after this long, whatever the command does: it is then stopped
    /// as for a lost lease when the lease runs out (default: the manager's, 1h).
    #[arg(long, value_parser = parse_duration)]
    max_hold: Option<Duration>,
    #[command(flatten)]
    command: CommandArgs,
}

impl RunArgs {
    /// The usage mistake clap cannot see, if any.
    pub(crate) fn misuse(&self) -> Option<&'static str> {
        (self.wait.is_some() && self.on_busy != OnBusy::Wait)
            .then_some("`--wait` applies to `--on-busy wait` only")
    }

    /// The request the attribute would make with the same arguments, plus `watchdog`.
    fn request<'m>(&self, locks: &'m LockManager) -> LockRequest<'m> {
        let key = self.key.clone();
        let request = match (self.mode, self.permits) {
            (_, Some(permits)) => locks.semaphore(key, permits),
            (Some(Mode::Read), None) => locks.read_lock(key),
            (Some(Mode::Write), None) => locks.write_lock(key),
            (None, None) => locks.lock(key),
        };
        let mut request = request.watchdog(true).fencing(self.fencing);
        if let Some(ttl) = self.ttl.or(self.min_hold) {
            request = request.ttl(ttl);
        }
        if let Some(min_hold) = self.min_hold {
            request = request.min_hold(min_hold);
        }
        if let Some(max_hold) = self.max_hold {
            request = request.max_hold(max_hold);
        }
        match self.on_busy {
            OnBusy::Wait => request.wait(self.wait.unwrap_or(Duration::MAX)),
            OnBusy::Skip | OnBusy::Fail => request.retries(0).wait(Duration::ZERO),
        }
    }
}

/// `distlock run`: takes the lock, runs the command while the watchdog renews it, gives it
/// back when the command exits; returns the exit code.
pub(crate) async fn run(locks: &LockManager, args: &RunArgs, signals: &mut Signals) -> u8 {
    let taken = tokio::select! {
        taken = args.request(locks).acquire() => taken,
        received = signals.ending() => return received.exit_code(),
    };
    let guard = match taken {
        Ok(guard) => guard,
        Err(error @ LockError::Busy { .. }) => {
            let held_by = inspector::held_by(locks, &args.key, &error).await;
            let program = args.command.program();
            let key = &args.key;
            match (args.on_busy, &error) {
                (OnBusy::Skip, _) => say!("distlock: {key} {held_by}; skipped `{program}`"),
                (OnBusy::Wait, LockError::Busy { waited, .. }) => say!(
                    "distlock: {key} {held_by}; gave up after {:.1}s; `{program}` not run",
                    waited.as_secs_f64()
                ),
                _ => say!("distlock: {key} {held_by}; `{program}` not run"),
            }
            return exit::BUSY;
        }
        Err(error) => {
            say!("distlock: {error}");
            return exit::of(&error);
        }
    };
    let mut vars = vec![
        ("DISTLOCK_KEY", args.key.clone()),
        ("DISTLOCK_TOKEN", guard.token().to_owned()),
    ];
    if let Some(fence) = guard.fencing_token() {
        vars.push(("DISTLOCK_FENCING_TOKEN", fence.to_string()));
    }
    let child = match child::spawn(&args.command.command, &vars, args.command.foreground) {
        Ok(child) => child,
        Err(code) => {
            give_back(guard).await;
            return code;
        }
    };
    let ended = child::supervise(child, &guard, guard.lost(), args.command.grace, signals).await;
    finish_run(guard, &ended, &args.command.program()).await
}

/// The exit code of a run whose command has ended, after giving the lock back.
async fn finish_run(guard: LockGuard, ended: &Ended, program: &str) -> u8 {
    let key = guard.key().to_owned();
    if let Some(lost) = &ended.lost {
        say!("distlock: {lost}; stopped `{program}`");
        return exit::LOST;
    }
    let code = ended.exit_code();
    match guard.release().await {
        Ok(()) => code,
        Err(error @ LockError::Lost { .. }) => {
            say!("distlock: `{program}` ended, but {error}: it did not hold `{key}` throughout");
            exit::LOST
        }
        Err(error) => {
            say!(
                "distlock: `{program}` ended; giving `{key}` back failed ({error}): its lease runs out by itself"
            );
            code
        }
    }
}

/// Gives a lock back whose command never ran.
async fn give_back(guard: LockGuard) {
    if let Err(error) = guard.release().await {
        say!("distlock: {error}");
    }
}

/// The options of `lead`.
#[derive(Args, Debug)]
pub(crate) struct LeadArgs {
    /// The election's name.
    name: String,
    /// The leader's lease, renewed while the command runs: another replica leads within
    /// about this long after a leader dies (default: the manager's, 30s).
    #[arg(long, value_parser = parse_duration)]
    ttl: Option<Duration>,
    /// Run the command once as leader, then exit with its code (default: campaign again
    /// after it ends).
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    command: CommandArgs,
}

/// How long `lead` waits before campaigning again after Redis failed.
const RETRY: Duration = Duration::from_secs(1);
/// The least time between the starts of two terms of one `lead` (its command ended sooner).
const TERM_AT_LEAST: Duration = Duration::from_secs(1);

/// `distlock lead`: campaigns, runs the command while leading, and again after it ends
/// (unless `--once`); returns the exit code.
pub(crate) async fn lead(locks: &LockManager, args: &LeadArgs, signals: &mut Signals) -> u8 {
    let mut election = locks.election(args.name.clone());
    if let Some(ttl) = args.ttl {
        election = election.ttl(ttl);
    }
    loop {
        let leadership = match campaign(&election, args, signals).await {
            Ok(leadership) => leadership,
            Err(code) => return code,
        };
        let started = tokio::time::Instant::now();
        match term(leadership, args, signals).await {
            After::Exit(code) => return code,
            After::Lost => continue,
            After::Ended => {}
        }
        // A command that keeps failing at once is started at most once a second.
        tokio::select! {
            () = tokio::time::sleep_until(started + TERM_AT_LEAST) => {}
            received = signals.ending() => return received.exit_code(),
        }
    }
}

/// What `lead` does after a term.
enum After {
    /// Exits with this code.
    Exit(u8),
    /// Campaigns again at once: the leadership was lost.
    Lost,
    /// Campaigns again: the command ended and the leadership was given back.
    Ended,
}

/// Campaigns until elected; Redis failing is waited out, unless a single term was asked for.
/// `Err`: the exit code (a signal, or an error).
async fn campaign(
    election: &distlock::Election,
    args: &LeadArgs,
    signals: &mut Signals,
) -> Result<distlock::Leadership, u8> {
    let mut warned = false;
    loop {
        let campaign = tokio::select! {
            campaign = election.campaign() => campaign,
            received = signals.ending() => return Err(received.exit_code()),
        };
        match campaign {
            Ok(leadership) => return Ok(leadership),
            Err(error @ LockError::Redis { .. }) if !args.once => {
                if !warned {
                    say!("distlock: {error}; campaigning again");
                    warned = true;
                }
                tokio::select! {
                    () = tokio::time::sleep(RETRY) => {}
                    received = signals.ending() => return Err(received.exit_code()),
                }
            }
            Err(error) => {
                say!("distlock: {error}");
                return Err(exit::of(&error));
            }
        }
    }
}

/// One term of `leadership`: runs the command while leading, then gives the leadership back.
async fn term(leadership: distlock::Leadership, args: &LeadArgs, signals: &mut Signals) -> After {
    let program = args.command.program();
    let term = leadership.term();
    let vars = [
        ("DISTLOCK_ELECTION", args.name.clone()),
        ("DISTLOCK_TERM", term.to_string()),
        ("DISTLOCK_TOKEN", leadership.guard().token().to_owned()),
    ];
    let child = match child::spawn(&args.command.command, &vars, args.command.foreground) {
        Ok(child) => child,
        Err(code) => {
            if let Err(error) = leadership.resign().await {
                say!("distlock: {error}");
            }
            return After::Exit(code);
        }
    };
    let guard = leadership.guard();
    let ended = child::supervise(child, guard, leadership.lost(), args.command.grace, signals);
    let ended = ended.await;
    let last = args.once || ended.interrupted.is_some();
    if let Some(lost) = &ended.lost {
        say!(
            "distlock: leadership of `{}` (term {term}) lost: {lost}; stopped `{program}`",
            args.name
        );
        drop(leadership);
        return if last {
            After::Exit(exit::LOST)
        } else {
            After::Lost
        };
    }
    let code = ended.exit_code();
    let resigned = leadership.resign().await;
    if let Err(error) = &resigned {
        say!("distlock: `{program}` ended; {error}");
    }
    match (last, resigned) {
        (true, Err(LockError::Lost { .. })) => After::Exit(exit::LOST),
        (true, _) => After::Exit(code),
        (false, _) => After::Ended,
    }
}
