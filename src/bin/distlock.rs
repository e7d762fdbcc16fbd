//! `distlock`: see, follow and clear locks from a shell.
//!
//! Connection settings come from the same environment variables as
//! `LockManager::from_env()` (`DISTLOCK_URL` or `REDIS_URL`, `DISTLOCK_KEY_PREFIX`,
//! `DISTLOCK_CLUSTER`, `DISTLOCK_SENTINEL`, `DISTLOCK_REDLOCK`, the TLS files…); `--url` and
//! `--prefix` override them. Exit codes: 0 done, 1 no such lock (or an error), 2 bad usage.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use distlock::inspect::{Holder, LockInfo};
use distlock::{LockError, LockManager, LockManagerBuilder};

/// See, follow and clear distlock locks.
#[derive(Parser, Debug)]
#[command(name = "distlock", version)]
struct Cli {
    /// Redis URL (overrides DISTLOCK_URL / REDIS_URL).
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
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = text
        .find(|c: char| !c.is_ascii_digit())
        .map_or((text, "s"), |at| text.split_at(at));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration such as 30s or 500ms"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n.saturating_mul(60))),
        "h" => Ok(Duration::from_secs(n.saturating_mul(3600))),
        _ => Err(format!("`{text}`: the unit must be ms, s, m or h")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("distlock: {error}");
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode, LockError> {
    let mut builder = LockManagerBuilder::from_env()?;
    if let Some(url) = &cli.url {
        builder = builder.redis_url(url);
    }
    if let Some(prefix) = &cli.prefix {
        builder = builder.key_prefix(prefix);
    }
    let locks = builder.build().await?;
    let mut out = std::io::stdout().lock();
    let code = match cli.command {
        Command::List { pattern } => {
            let found = locks.list(&pattern).await?;
            print_table(&mut out, &found);
            ExitCode::SUCCESS
        }
        Command::Show { key } => match locks.inspect(&key).await? {
            Some(info) => {
                print_detail(&mut out, &info);
                ExitCode::SUCCESS
            }
            None => {
                let _ = writeln!(out, "{key}: not held");
                ExitCode::from(1)
            }
        },
        Command::Release { key, force, yes } => release(&locks, &key, force, yes).await?,
        Command::Watch {
            key,
            count,
            duration,
            interval,
        } => {
            watch(&locks, &key, count, duration, interval).await?;
            ExitCode::SUCCESS
        }
    };
    locks.shutdown().await;
    Ok(code)
}

async fn release(
    locks: &LockManager,
    key: &str,
    force: bool,
    yes: bool,
) -> Result<ExitCode, LockError> {
    let mut out = std::io::stdout().lock();
    if !force {
        eprintln!(
            "distlock: `release` takes {key} away from whoever holds it; add --force to do so"
        );
        return Ok(ExitCode::from(2));
    }
    let Some(info) = locks.inspect(key).await? else {
        let _ = writeln!(out, "{key}: not held, nothing removed");
        return Ok(ExitCode::from(1));
    };
    if !yes {
        print_detail(&mut out, &info);
        let _ = write!(out, "Remove {key} from every holder above? [y/N] ");
        let _ = out.flush();
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            let _ = writeln!(out, "nothing removed");
            return Ok(ExitCode::from(1));
        }
    }
    match locks.force_release(key).await? {
        Some(removed) => {
            let _ = writeln!(
                out,
                "removed {} ({}), held by {}",
                removed.key,
                removed.kind.as_str(),
                holders(&removed.holders)
            );
            Ok(ExitCode::SUCCESS)
        }
        None => {
            let _ = writeln!(out, "{key}: already free, nothing removed");
            Ok(ExitCode::from(1))
        }
    }
}

async fn watch(
    locks: &LockManager,
    key: &str,
    count: Option<u64>,
    duration: Option<Duration>,
    interval: Duration,
) -> Result<(), LockError> {
    let started = Instant::now();
    let mut last: Option<Vec<String>> = None;
    let mut changes = 0;
    loop {
        let info = locks.inspect(key).await?;
        let now: Vec<String> = info
            .as_ref()
            .map(|i| i.holders.iter().map(|h| h.token.clone()).collect())
            .unwrap_or_default();
        if last.as_ref() != Some(&now) {
            let elapsed = started.elapsed();
            let line = match (&last, &info) {
                (_, None) => "free".to_owned(),
                (Some(before), Some(info)) if !before.is_empty() && !now.is_empty() => format!(
                    "handed over: {} -> {} ({})",
                    before.join(","),
                    holders(&info.holders),
                    info.kind.as_str()
                ),
                (_, Some(info)) => format!(
                    "held by {} ({}, ttl {})",
                    holders(&info.holders),
                    info.kind.as_str(),
                    ttl(info.ttl)
                ),
            };
            println!("{:>10.3}s {key}: {line}", elapsed.as_secs_f64());
            if last.is_some() {
                changes += 1;
            }
            last = Some(now);
        }
        if count.is_some_and(|n| changes >= n) || duration.is_some_and(|d| started.elapsed() >= d) {
            return Ok(());
        }
        tokio::time::sleep(interval).await;
    }
}

fn holders(holders: &[Holder]) -> String {
    if holders.is_empty() {
        return "nobody".to_owned();
    }
    holders
        .iter()
        .map(|h| format!("{} ({})", h.token, who(h)))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Who a holder is: its manager's client name, host, pid and how long that manager has been
/// up, or `unknown (gone)` when the manager's registration has expired.
fn who(holder: &Holder) -> String {
    match &holder.identity {
        Some(identity) => {
            let up = std::time::SystemTime::now()
                .duration_since(identity.started)
                .unwrap_or_default();
            format!("{identity}, up {:.1}s", up.as_secs_f64())
        }
        None => "unknown (gone)".to_owned(),
    }
}

fn ttl(ttl: Option<Duration>) -> String {
    ttl.map_or_else(|| "-".to_owned(), |t| format!("{}ms", t.as_millis()))
}

fn print_table(out: &mut impl Write, locks: &[LockInfo]) {
    let _ = writeln!(
        out,
        "{:<32} {:<10} {:>8} {:>10} {:>7} {:>7}  HOLDERS",
        "NAME", "KIND", "HOLDERS", "TTL", "FENCE", "PERMITS"
    );
    for lock in locks {
        let _ = writeln!(
            out,
            "{:<32} {:<10} {:>8} {:>10} {:>7} {:>7}  {}",
            lock.name,
            lock.kind.as_str(),
            lock.holders.len(),
            ttl(lock.ttl),
            lock.fencing_counter
                .map_or_else(|| "-".to_owned(), |f| f.to_string()),
            lock.permits
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
            holders(&lock.holders)
        );
    }
}

fn print_detail(out: &mut impl Write, info: &LockInfo) {
    let _ = writeln!(out, "name:     {}", info.name);
    let _ = writeln!(out, "key:      {}", info.key);
    let _ = writeln!(out, "kind:     {}", info.kind.as_str());
    let _ = writeln!(out, "ttl:      {}", ttl(info.ttl));
    if let Some(counter) = info.fencing_counter {
        let _ = writeln!(out, "fencing:  {counter} (last token drawn)");
    }
    if let Some(permits) = info.permits {
        let _ = writeln!(out, "permits:  {permits}");
    }
    let _ = writeln!(out, "holders:  {}", info.holders.len());
    for holder in &info.holders {
        let fence = holder
            .fence
            .map_or_else(String::new, |f| format!(", fence {f}"));
        let _ = writeln!(
            out,
            "  {} (holds {}, ttl {}{fence})",
            holder.token,
            holder.holds,
            ttl(holder.ttl)
        );
        let _ = writeln!(out, "    by {}", who(holder));
    }
}
