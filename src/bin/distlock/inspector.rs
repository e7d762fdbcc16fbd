//! `list`, `show`, `release`, `watch` and `leader`: what the locks under a prefix are, who
//! holds them, and who leads an election.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use distlock::inspect::{ForcedRelease, Holder, LockInfo, LockKind};
use distlock::{LockError, LockManager};

use crate::exit;

pub(crate) async fn release(
    locks: &LockManager,
    key: &str,
    force: bool,
    yes: bool,
) -> Result<u8, LockError> {
    let mut out = std::io::stdout().lock();
    if !force {
        eprintln!(
            "distlock: `release` takes {key} away from whoever holds it; add --force to do so"
        );
        return Ok(exit::USAGE);
    }
    if yes {
        return Ok(match locks.force_release(key).await? {
            Some(removed) => removed_line(&mut out, &removed),
            None => free_line(&mut out, key),
        });
    }
    let Some(mut info) = locks.inspect(key).await? else {
        return Ok(free_line(&mut out, key));
    };
    // What the operator confirms is what goes: holders that changed while they read are
    // shown again, and asked about again.
    loop {
        print_detail(&mut out, &info);
        let _ = write!(out, "Remove {key} from every holder above? [y/N] ");
        let _ = out.flush();
        let mut answer = String::new();
        let _ = std::io::stdin().lock().read_line(&mut answer);
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            let _ = writeln!(out, "nothing removed");
            return Ok(exit::NONE);
        }
        let confirmed: Vec<&str> = info.holders.iter().map(|h| h.token.as_str()).collect();
        match locks.force_release_if_held_by(key, &confirmed).await? {
            ForcedRelease::Removed(removed) => return Ok(removed_line(&mut out, &removed)),
            ForcedRelease::Changed(now) => {
                let _ = writeln!(out, "{key}: its holders changed meanwhile, nothing removed");
                info = now;
            }
            _ => return Ok(free_line(&mut out, key)),
        }
    }
}

/// Says what a forced release removed.
fn removed_line(out: &mut impl Write, removed: &LockInfo) -> u8 {
    let _ = writeln!(
        out,
        "removed {} ({}), held by {}",
        removed.key,
        removed.kind.as_str(),
        holders(&removed.holders)
    );
    0
}

/// Says that the lock was free.
fn free_line(out: &mut impl Write, key: &str) -> u8 {
    let _ = writeln!(out, "{key}: not held, nothing removed");
    exit::NONE
}

pub(crate) async fn watch(
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

/// What a busy key is held by, for a message that follows its name: every holder and who it
/// is as the key shows them now, else the holder the busy `error` named, or the `min_hold`
/// that keeps the key after its holder let go.
pub(crate) async fn held_by(locks: &LockManager, key: &str, error: &LockError) -> String {
    match locks.inspect(key).await {
        Ok(Some(info)) if info.kind == LockKind::MinHold => format!(
            "is kept by an earlier holder's min-hold (ttl {})",
            ttl(info.ttl)
        ),
        Ok(Some(info)) if !info.holders.is_empty() => format!(
            "is held ({}) by {}",
            info.kind.as_str(),
            holders(&info.holders)
        ),
        _ => match error {
            LockError::Busy {
                holder_token: Some(token),
                holder: Some(identity),
                ..
            } => format!("is held by {token} ({identity})"),
            LockError::Busy {
                holder_token: Some(token),
                ..
            } => format!("is held by {token} (unknown or gone)"),
            _ => "was held (its holder has let go since)".to_owned(),
        },
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

pub(crate) fn print_table(out: &mut impl Write, locks: &[LockInfo]) {
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

pub(crate) fn print_detail(out: &mut impl Write, info: &LockInfo) {
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

/// `distlock leader`: prints who leads the election; [`exit::NONE`] when nobody does.
pub(crate) async fn leader(locks: &LockManager, name: &str) -> Result<u8, LockError> {
    match locks.election(name).leader().await? {
        Some(leader) => {
            let since = leader
                .since
                .and_then(|since| std::time::SystemTime::now().duration_since(since).ok())
                .map_or_else(String::new, |d| {
                    format!(", leading for {:.1}s", d.as_secs_f64())
                });
            println!("{leader} (token {}{since})", leader.token);
            Ok(0)
        }
        None => {
            println!("{name}: no leader");
            Ok(exit::NONE)
        }
    }
}
