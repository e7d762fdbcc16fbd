//! `distlock`: see, follow and clear locks from a shell, and run a program while holding a lock
//! (`run`) or while leading an election (`lead`).
//!
//! Connection settings come from the same environment variables as
//! `LockManager::from_env()` (`DISTLOCK_URL` or `REDIS_URL`, `DISTLOCK_KEY_PREFIX`,
//! `DISTLOCK_CLUSTER`, `DISTLOCK_SENTINEL`, `DISTLOCK_REDLOCK`, the TLS files…); `--url` and
//! `--prefix` override them, and are enough on their own. The exit codes are in [`exit`].

/// Writes a line to stderr, as `eprintln!` does, but never panics when stderr is gone (a
/// terminal closed by a dropped ssh session): `distlock` must go on supervising its command
/// and give the lock back whether or not anyone can read what it says.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod child;
mod duration;
mod exit;
mod inspector;
mod supervise;
#[cfg(target_os = "linux")]
mod watcher;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use distlock::{LockError, LockManager, LockManagerBuilder};

use crate::duration::parse_duration;
use crate::supervise::{LeadArgs, RunArgs};

/// See, follow and clear distlock locks; run a command while holding a lock or leading.
#[derive(Parser, Debug)]
#[command(name = "distlock", version, after_long_help = exit::TABLE)]
struct Cli {
    /// Redis URL (replaces the endpoint of the environment: DISTLOCK_URL, REDIS_URL,
    /// DISTLOCK_CLUSTER, DISTLOCK_SENTINEL, DISTLOCK_REDLOCK).
    #[arg(long, global = true)]
    url: Option<String>,
    /// Key prefix (overrides DISTLOCK_KEY_PREFIX).
    #[arg(long, global = true)]
    prefix: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Every lock under the prefix whose name matches PATTERN (`*`, `?`).
    List {
        /// Which names (default: all).
        #[arg(default_value = "*")]
        pattern: String,
    },
    /// One lock in detail.
    Show {
        /// The lock's name.
        key: String,
    },
    /// Removes a stuck lock, whatever holds it, and wakes its waiters.
    Release {
        /// The lock's name.
        key: String,
        /// Required: this takes the lock away from whoever holds it.
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long, short)]
        yes: bool,
    },
    /// Prints the lock's holders each time they change.
    Watch {
        /// The lock's name.
        key: String,
        /// Stop after this many changes.
        #[arg(long)]
        count: Option<u64>,
        /// Stop after this long (e.g. `30s`, `500ms`).
        #[arg(long = "for", value_parser = parse_duration)]
        duration: Option<Duration>,
        /// How often to look (default 50ms).
        #[arg(long, value_parser = parse_duration, default_value = "50ms")]
        interval: Duration,
    },
    /// Runs CMD while holding the lock KEY, and gives the lock back when CMD exits.
    ///
    /// The lease is renewed while CMD runs. CMD gets DISTLOCK_KEY, DISTLOCK_TOKEN and, with
    /// --fencing, DISTLOCK_FENCING_TOKEN in its environment, and runs in a process group of
    /// its own. CMD is gone before the lease can end: once half the lease has passed without a
    /// renewal, that group gets SIGTERM, then SIGKILL shortly before the lease would end
    /// (--grace is shortened to fit), and `run` exits with 111; if the key is found gone or
    /// taken, SIGKILL at once. SIGHUP, SIGINT, SIGQUIT and SIGTERM sent to `run` are passed
    /// on to CMD; the lock is given back once it exits, and `run` exits with CMD's exit code.
    /// SIGTSTP (Ctrl-Z) stops CMD (SIGSTOP) while `run` keeps the lease; SIGCONT continues it.
    ///
    /// On Linux, CMD is killed (SIGKILL) if `distlock` dies, even of SIGKILL. Signals are
    /// Unix's; elsewhere CMD is killed when the lease is lost or on Ctrl-C.
    #[command(after_long_help = exit::TABLE)]
    Run(RunArgs),
    /// Campaigns in the election NAME, runs CMD while leading, and campaigns again when it
    /// ends.
    ///
    /// CMD gets DISTLOCK_ELECTION, DISTLOCK_TERM (the leader's term: larger than every
    /// earlier leader's, a fencing token) and DISTLOCK_TOKEN in its environment. If
    /// leadership is lost, CMD is stopped as `run` stops it, and `lead` campaigns again
    /// (with --once, exits with 111). After CMD ends on its own, leadership is given back at
    /// once; with --once, or after a SIGHUP, SIGINT, SIGQUIT or SIGTERM that `lead` passed on, `lead` then
    /// exits with CMD's code, and otherwise campaigns again (a second after CMD started, at
    /// the earliest).
    #[command(after_long_help = exit::TABLE)]
    Lead(LeadArgs),
    /// Prints who leads the election NAME: term, identity, token; exits 1 when nobody does.
    Leader {
        /// The election's name.
        name: String,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    #[cfg(target_os = "linux")]
    if let [_, arg, group] = &std::env::args().collect::<Vec<_>>()[..]
        && arg == watcher::ARG
    {
        return watcher::watch(group);
    }
    let cli = Cli::parse();
    if let Command::Run(args) = &cli.command
        && let Some(misuse) = args.misuse()
    {
        Cli::command()
            .error(clap::error::ErrorKind::ArgumentConflict, misuse)
            .exit();
    }
    // Heard from now on: a signal while connecting or waiting ends `run` without a lock left.
    let mut signals = match &cli.command {
        Command::Run(_) | Command::Lead(_) => match child::Signals::listen() {
            Ok(signals) => Some(signals),
            Err(error) => {
                say!("distlock: cannot listen for signals: {error}");
                return ExitCode::from(exit::SOFTWARE);
            }
        },
        _ => None,
    };
    let locks = match connect(&cli).await {
        Ok(locks) => locks,
        Err(error) => {
            say!("distlock: {error}");
            return ExitCode::from(exit::of(&error));
        }
    };
    let code = match (cli.command, signals.as_mut()) {
        (Command::Run(args), Some(signals)) => Ok(supervise::run(&locks, &args, signals).await),
        (Command::Lead(args), Some(signals)) => Ok(supervise::lead(&locks, &args, signals).await),
        (command, _) => inspect(&locks, command).await,
    };
    locks.shutdown().await;
    match code {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            say!("distlock: {error}");
            ExitCode::from(exit::of(&error))
        }
    }
}

/// The variables that name an endpoint: `--url` replaces all of them.
const ENDPOINT_VARS: [&str; 6] = [
    "DISTLOCK_URL",
    "REDIS_URL",
    "DISTLOCK_CLUSTER",
    "DISTLOCK_SENTINEL",
    "DISTLOCK_SENTINEL_MASTER",
    "DISTLOCK_REDLOCK",
];

/// The manager the environment describes, with `--url` and `--prefix` in place of what it
/// says about those: either is enough without the environment, and wins over it.
fn builder(
    vars: impl Iterator<Item = (String, String)>,
    url: Option<&str>,
    prefix: Option<&str>,
) -> Result<LockManagerBuilder, LockError> {
    let vars = vars
        .filter(|(name, _)| {
            !(url.is_some() && ENDPOINT_VARS.contains(&name.as_str())
                || prefix.is_some() && name == "DISTLOCK_KEY_PREFIX")
        })
        // Checked as the environment's URL is (TLS files against its scheme, too).
        .chain(url.map(|url| ("DISTLOCK_URL".to_owned(), url.to_owned())));
    let builder = LockManagerBuilder::from_vars(vars).map_err(|error| match error {
        LockError::Config(message) if url.is_some() => LockError::Config(
            message
                .strip_prefix("DISTLOCK_URL")
                .map_or(message.clone(), |rest| format!("--url{rest}")),
        ),
        error => error,
    })?;
    Ok(match prefix {
        Some(prefix) => builder.key_prefix(prefix),
        None => builder,
    })
}

async fn connect(cli: &Cli) -> Result<LockManager, LockError> {
    let vars = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)));
    builder(vars, cli.url.as_deref(), cli.prefix.as_deref())?
        .build()
        .await
}

/// The inspector's commands, and `leader`.
async fn inspect(locks: &LockManager, command: Command) -> Result<u8, LockError> {
    let mut out = std::io::stdout().lock();
    Ok(match command {
        Command::List { pattern } => {
            let found = locks.list(&pattern).await?;
            inspector::print_table(&mut out, &found);
            0
        }
        Command::Show { key } => match locks.inspect(&key).await? {
            Some(info) => {
                inspector::print_detail(&mut out, &info);
                0
            }
            None => {
                let _ = writeln!(out, "{key}: not held");
                exit::NONE
            }
        },
        Command::Release { key, force, yes } => {
            drop(out);
            inspector::release(locks, &key, force, yes).await?
        }
        Command::Watch {
            key,
            count,
            duration,
            interval,
        } => {
            drop(out);
            inspector::watch(locks, &key, count, duration, interval).await?;
            0
        }
        Command::Leader { name } => {
            drop(out);
            inspector::leader(locks, &name).await?
        }
        Command::Run(_) | Command::Lead(_) => unreachable!("run and lead listen for signals"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn debug(vars: &[(&str, &str)], url: Option<&str>, prefix: Option<&str>) -> String {
        let vars = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
        match builder(vars, url, prefix) {
            Ok(builder) => format!("{builder:?}"),
            Err(error) => format!("error: {error}"),
        }
    }

    #[test]
    fn url_and_prefix_suffice_alone() {
        let alone = debug(&[], Some("redis://a:1"), Some("p:"));
        assert!(
            alone.contains("redis://a:1") && alone.contains("\"p:\""),
            "{alone}"
        );
    }

    #[test]
    fn url_and_prefix_win_over_the_environment() {
        let env = [
            ("DISTLOCK_CLUSTER", "redis://c:1,redis://c:2"),
            ("REDIS_URL", "redis://r:1"),
            ("DISTLOCK_KEY_PREFIX", "{bad"),
        ];
        let both = debug(&env, Some("redis://a:1"), Some("p:"));
        assert!(both.contains("redis://a:1"), "{both}");
        assert!(
            !both.contains("redis://c:") && !both.contains("r:1"),
            "{both}"
        );
        assert!(!both.contains("{bad"), "{both}");
        // Without them, the environment is read as before.
        let env = debug(&env, None, None);
        assert!(env.contains("DISTLOCK_KEY_PREFIX"), "{env}");
    }

    #[test]
    fn a_bad_url_is_named_as_given() {
        let bad = debug(&[], Some("http://u:hunter2@a:1"), None);
        assert!(bad.starts_with("error:") && bad.contains("--url"), "{bad}");
        assert!(
            !bad.contains("hunter2") && !bad.contains("DISTLOCK_URL"),
            "{bad}"
        );
    }
}
