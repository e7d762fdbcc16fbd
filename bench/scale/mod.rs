//! `--scale`: what thousands of held locks, waiters and managers cost, on the client and on
//! the server, at 1k, 10k and 100k (`--scale-max N` caps it; `--quick` stops at 10k with
//! shorter windows), then what Cluster costs at 3 and 6 masters beside one server (`cluster`;
//! `--cluster` runs those tables alone). Included by `examples/bench.rs`; the rows on one
//! server are in `rows`.
//!
//! Client memory is the process's resident set (`VmRSS` in `/proc/self/status`) before and
//! after; server figures come from `INFO` (memory, cpu, clients, commandstats) and `PUBSUB`.
//! Renewal lateness is sampled from the guards' local lease (`remaining()`), which jumps up
//! when a renewal lands: the last sample before the jump, against the lease left when the
//! renewal was due, at a twentieth of the renewal interval (the figure is rounded up by that).

use std::time::Duration;

use distlock::LockManager;
use distlock::testing::RedisServer;

use crate::harness;

mod cluster;
mod deployment;
mod failover;
mod handover;
mod rows;

/// Keys and channels of every row start with this.
const PREFIX: &str = "scale:";

/// Tasks that take (and give back) the held locks side by side.
const TAKERS: usize = 256;

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn info(server: &RedisServer, section: &str, field: &str) -> f64 {
    let info = server.command(&["INFO", section]).unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn used_memory(server: &RedisServer) -> f64 {
    info(server, "memory", "used_memory")
}

/// Channels under the prefix, and their subscribers in all (`PUBSUB NUMSUB`).
fn subscriptions(server: &RedisServer) -> (usize, u64) {
    let reply = server
        .command(&["PUBSUB", "CHANNELS", &format!("{PREFIX}*")])
        .unwrap_or_default();
    let channels: Vec<&str> = reply.lines().filter(|l| !l.is_empty()).collect();
    let mut subscribers = 0;
    for chunk in channels.chunks(1000) {
        let mut args = vec!["PUBSUB", "NUMSUB"];
        args.extend(chunk);
        let reply = server.command(&args).unwrap_or_default();
        subscribers += reply
            .lines()
            .skip(1)
            .step_by(2)
            .filter_map(|n| n.trim_start_matches(':').parse::<u64>().ok())
            .sum::<u64>();
    }
    (channels.len(), subscribers)
}

/// Keys and channels left under the prefix once background work has settled.
async fn left(server: &RedisServer) -> String {
    let (keys, channels) = harness::left_over(server, &format!("{PREFIX}*")).await;
    format!("{keys}/{channels}")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The median of `rows`' `field` (the middle one of an odd count, the lower middle of an even).
fn median<T>(rows: &[T], field: impl Fn(&T) -> f64) -> f64 {
    let mut values: Vec<f64> = rows.iter().map(field).collect();
    values.sort_by(f64::total_cmp);
    values
        .get(values.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or(0.0)
}

/// `median` of a duration field.
fn median_time<T>(rows: &[T], field: impl Fn(&T) -> Duration) -> Duration {
    Duration::from_secs_f64(median(rows, |row| field(row).as_secs_f64()))
}

/// What was left in Redis after each run, once each distinct answer.
fn lefts<'a>(all: impl Iterator<Item = &'a str>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for left in all {
        if !seen.contains(&left) {
            seen.push(left);
        }
    }
    seen.join(",")
}

async fn manager(url: &str) -> LockManager {
    LockManager::builder()
        .redis_url(url)
        .key_prefix(PREFIX)
        .build()
        .await
        .expect("manager")
}

fn kib(bytes: f64) -> String {
    format!("{:.2} KiB", bytes / 1024.0)
}

fn thousands(n: usize) -> String {
    if n >= 1000 && n.is_multiple_of(1000) {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

/// How the `--scale` run was asked for.
struct Options {
    /// `--quick`: shorter windows, one run per row, up to 10k.
    quick: bool,
    /// Each row is the median of this many runs.
    runs: usize,
    /// The counts of held locks and waiters measured.
    sizes: Vec<usize>,
    /// `--cluster`: only the Cluster tables.
    cluster_only: bool,
}

impl Options {
    fn parse(args: &[String], quick: bool) -> Result<Self, String> {
        let max = match args.iter().position(|a| a == "--scale-max") {
            Some(at) => args
                .get(at + 1)
                .and_then(|n| n.parse().ok())
                .ok_or("--scale-max needs a number, such as `--scale-max 10000`")?,
            None if quick => 10_000,
            None => 100_000,
        };
        let runs: usize = match args.iter().position(|a| a == "--runs") {
            Some(at) => args
                .get(at + 1)
                .and_then(|n| n.parse().ok())
                .filter(|&n| n > 0)
                .ok_or("--runs needs a positive number, such as `--runs 3`")?,
            None if quick => 1,
            None => 3,
        };
        let sizes = [1_000, 10_000, 100_000]
            .into_iter()
            .filter(|&n| n <= max)
            .collect();
        Ok(Self {
            quick,
            runs,
            sizes,
            cluster_only: args.iter().any(|a| a == "--cluster"),
        })
    }
}

/// The `--scale` run.
pub(crate) async fn run(args: &[String], quick: bool) -> Result<(), Box<dyn std::error::Error>> {
    let options = Options::parse(args, quick)?;
    let runs = options.runs;
    let server = RedisServer::start()?;
    let url = server.url();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "distlock scale: {} on loopback, {cores} cores shared by client and server{}; each row \
         the median of {runs} run{} (lost and late: the most of any run)\n",
        harness::server_version(&server),
        if quick { ", quick" } else { "" },
        if runs == 1 { "" } else { "s" }
    );
    if !options.cluster_only {
        print_held(&server, &url, &options).await;
        print_waiting(&server, &url, &options).await;
        print_managers(&server, &url, &options).await;
    }
    cluster::run(&server, &options).await
}

/// The held-locks table.
async fn print_held(server: &RedisServer, url: &str, options: &Options) {
    let (server, url, runs) = (server, url, options.runs);
    // Renewal rounds held for, at ttl 30 s (10 s each) and 3 s (1 s each).
    let (rounds_30, rounds_3) = if options.quick { (1, 2) } else { (2, 6) };
    print_held_header(rounds_30, rounds_3);
    for &n in &options.sizes {
        let mut floors = Vec::new();
        let mut plains = Vec::new();
        for _ in 0..runs {
            floors.push(rows::floor(server, url, n).await);
            plains.push(rows::held(server, url, n, Duration::from_secs(30), None).await);
        }
        let bare = median(&floors, |f| *f);
        let plain = rows::Held::median_of(&plains);
        let plain_rate = n as f64 / plain.take.as_secs_f64();
        println!(
            "{:>5} {:>5} {:>10.0} {:>6} {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>7} {:>8.2?} {:>5}",
            thousands(n),
            "no wd",
            plain_rate,
            "",
            kib(plain.client_per_hold),
            format!("{:.0} B", plain.server_per_hold),
            format!("{bare:.0} B"),
            "",
            "",
            "",
            "",
            "",
            plain.give_back,
            plain.left
        );
        for (ttl, rounds) in [(30, rounds_30), (3, rounds_3)] {
            let ttl = Duration::from_secs(ttl);
            let mut all = Vec::new();
            for _ in 0..runs {
                all.push(rows::held(server, url, n, ttl, Some(rounds)).await);
            }
            let h = rows::Held::median_of(&all);
            let rate = n as f64 / h.take.as_secs_f64();
            let interval = ttl / 3;
            println!(
                "{:>5} {:>5} {:>10.0} {:>5.2}x {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>6.1}% {:>8.2?} {:>5}",
                thousands(n),
                format!("{}s", ttl.as_secs()),
                rate,
                rate / plain_rate,
                kib(h.client_per_hold),
                format!("{:.0} B", h.server_per_hold),
                format!("{bare:.0} B"),
                format!(
                    "{}/{} {:.0}/{:.0}/s",
                    h.renewed, h.due, h.renewed_per_sec, h.due_per_sec
                ),
                h.late_p99.map_or("-".to_owned(), |late| format!(
                    "{:.1}%",
                    late.as_secs_f64() * 100.0 / interval.as_secs_f64()
                )),
                h.late_renewals,
                h.lost,
                h.server_cpu * 100.0,
                h.give_back,
                h.left
            );
        }
    }
}

/// The held-locks table's title and column heads.
fn print_held_header(rounds_30: u32, rounds_3: u32) {
    println!(
        "held locks (one manager, {TAKERS} tasks taking them): with `watchdog`, held for \
         {rounds_30} renewal rounds at ttl 30 s, {rounds_3} at ttl 3 s (a round: a third of the \
         ttl); renewed/due: leases renewed in those rounds, of those due; late p99: of the \
         renewal interval, sampled at a twentieth of it (so at least 5%); warned: renewals the \
         watchdog sent with less than half of their lease left, which it logs a warning for"
    );
    println!(
        "{:>5} {:>5} {:>10} {:>6} {:>10} {:>10} {:>10} {:>30} {:>9} {:>7} {:>5} {:>7} {:>8} {:>5}",
        "held",
        "ttl",
        "taken/s",
        "vs no",
        "client",
        "server",
        "floor",
        "renewed/due, per s",
        "late p99",
        "warned",
        "lost",
        "srv cpu",
        "give back",
        "left"
    );
}

/// The waiters table.
async fn print_waiting(server: &RedisServer, url: &str, options: &Options) {
    let quiet = Duration::from_secs(if options.quick { 2 } else { 5 });
    println!(
        "\nwaiters: N tasks of one manager waiting on N/10 keys another manager holds (ttl 60 s); \
         server commands over a quiet {quiet:?}; entry: from a release to its first waiter inside, \
         over the first 1,000 keys released one at a time; all in: until every waiter got in \
         and out"
    );
    println!(
        "{:>7} {:>6} {:>11} {:>9} {:>6} {:>9} {:>13} {:>10} {:>10} {:>9} {:>5}",
        "waiters",
        "keys",
        "client",
        "channels",
        "subs",
        "cmds/s",
        "per key /s",
        "entry p50",
        "entry p99",
        "all in",
        "left"
    );
    for &n in &options.sizes {
        let mut all = Vec::new();
        for _ in 0..options.runs {
            all.push(rows::waiting(server, url, n, quiet).await);
        }
        let w = rows::Waiting::median_of(&all);
        println!(
            "{:>7} {:>6} {:>11} {:>9} {:>6} {:>9.1} {:>13.4} {:>10.2?} {:>10.2?} {:>9.2?} {:>5}",
            thousands(n),
            thousands(n / 10),
            kib(w.client_per_waiter),
            w.channels,
            w.subscribers,
            w.quiet_per_sec,
            w.quiet_per_key,
            w.entry_p50,
            w.entry_p99,
            w.drained,
            w.left
        );
        if w.unanswered > 0 {
            println!(
                "        ({} of the waiters' releases did not answer within the response \
                 timeout, in the worst run: each was sent again in the background)",
                w.unanswered
            );
        }
    }
}

/// The managers table.
async fn print_managers(server: &RedisServer, url: &str, options: &Options) {
    let run = row_time(options);
    println!(
        "\nmanagers (as processes would be) on 1,000 keys, two tasks per key, for {run:?}: \
         server connections and subscriptions mid-run"
    );
    println!(
        "{:>8} {:>14} {:>9} {:>6} {:>10} {:>12} {:>5}",
        "managers", "conns/manager", "channels", "subs", "entries/s", "memory/mgr", "left"
    );
    for m in [1, 8, 32] {
        let mut all = Vec::new();
        for _ in 0..options.runs {
            all.push(rows::managers(server, url, m, run).await);
        }
        let r = rows::Managers::median_of(&all);
        println!(
            "{m:>8} {:>14.2} {:>9} {:>6} {:>10.0} {:>12} {:>5}",
            r.connections,
            r.channels,
            r.subscribers,
            r.entries_per_sec,
            kib(r.memory_per_manager),
            r.left
        );
    }
}

/// How long the managers' and the Cluster's throughput rows run.
fn row_time(options: &Options) -> Duration {
    Duration::from_secs(if options.quick { 2 } else { 4 })
}
