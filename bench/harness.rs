//! Measurement shared by `examples/bench.rs` and `bench/compare`: which server runs, what it
//! counts (`INFO commandstats`), the lock loops and their statistics.
//!
//! Each program includes this file with `#[path]`, so both measure a row the same way.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use distlock::testing::{RedisServer, SERVER_ENV};
use distlock::{LockError, LockManager, distributed_lock};
use redis::Script;
use redis::aio::MultiplexedConnection;

/// The lease every loop asks for: long enough never to expire during a row.
pub(crate) const TTL: Duration = Duration::from_secs(10);

/// Options shared by both programs.
pub(crate) struct Options {
    /// `--quick`: short rows, for a smoke run.
    pub(crate) quick: bool,
    /// `--reps N`: repetitions (medians are printed).
    pub(crate) reps: usize,
    /// How long each row runs.
    pub(crate) run: Duration,
}

impl Options {
    /// Reads `--quick` and `--reps N` (default `default_reps`).
    pub(crate) fn parse(args: &[String], default_reps: usize) -> Result<Self, String> {
        let quick = args.iter().any(|a| a == "--quick");
        let reps = match args.iter().position(|a| a == "--reps") {
            None => default_reps,
            Some(at) => args
                .get(at + 1)
                .and_then(|n| n.parse().ok())
                .filter(|&n| n > 0)
                .ok_or("--reps needs a positive number, such as `--reps 10`")?,
        };
        let run = if quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(2)
        };
        Ok(Self { quick, reps, run })
    }
}

/// `--server redis|valkey|PATH` picks the binary that [`RedisServer`] starts, which reads it
/// from `DISTLOCK_REDIS_SERVER`. When the option names another binary than that variable,
/// the program runs itself again with the variable set: `Some(exit code)` is the child's.
pub(crate) fn select_server(args: &[String]) -> Result<Option<i32>, String> {
    let Some(at) = args.iter().position(|a| a == "--server") else {
        return Ok(None);
    };
    let choice = args
        .get(at + 1)
        .ok_or("--server needs `redis`, `valkey` or the path of a server binary")?;
    let binary = match choice.as_str() {
        "redis" => on_path("redis-server"),
        "valkey" => on_path("valkey-server"),
        path => Some(PathBuf::from(path)).filter(|p| p.is_file()),
    }
    .ok_or_else(|| {
        format!(
            "no server binary for `--server {choice}`: `redis` and `valkey` are looked up on \
             PATH (as redis-server and valkey-server); otherwise give the binary's path"
        )
    })?;
    if std::env::var_os(SERVER_ENV).is_some_and(|set| set == binary.as_os_str()) {
        return Ok(None);
    }
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let status = Command::new(me)
        .args(&args[1..])
        .env(SERVER_ENV, &binary)
        .status()
        .map_err(|e| e.to_string())?;
    Ok(Some(status.code().unwrap_or(1)))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The server's name and version from `INFO server`, e.g. `redis 7.0.15` or `valkey 9.1.2`.
pub(crate) fn server_version(server: &RedisServer) -> String {
    let info = server.command(&["INFO", "server"]).unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .map(str::to_owned)
    };
    let name = field("server_name").unwrap_or_else(|| "redis".into());
    let version = field(&format!("{name}_version"))
        .or_else(|| field("redis_version"))
        .unwrap_or_else(|| "?".into());
    format!("{name} {version}")
}

/// The server process's CPU time so far (user and system: reading and writing its sockets
/// included), from `INFO cpu`.
pub(crate) fn server_cpu(server: &RedisServer) -> Duration {
    let info = server.command(&["INFO", "cpu"]).expect("INFO cpu");
    let seconds: f64 = info
        .lines()
        .filter_map(|l| {
            let value = l
                .strip_prefix("used_cpu_sys:")
                .or_else(|| l.strip_prefix("used_cpu_user:"))?;
            value.trim().parse::<f64>().ok()
        })
        .sum();
    Duration::from_secs_f64(seconds)
}

/// Calls per command from `INFO commandstats`: every command the server ran, those a script
/// runs inside included (`INFO` itself left out).
#[derive(Debug, Default, Clone)]
pub(crate) struct Commands(BTreeMap<String, u64>);

impl Commands {
    /// The server's counters now.
    pub(crate) fn read(server: &RedisServer) -> Self {
        let info = server
            .command(&["INFO", "commandstats"])
            .unwrap_or_default();
        let calls = info
            .lines()
            .filter_map(|l| {
                let (name, stats) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats
                    .strip_prefix("calls=")?
                    .split(',')
                    .next()?
                    .parse()
                    .ok()?;
                Some((name.to_owned(), calls))
            })
            .filter(|(name, _)| name != "info")
            .collect();
        Self(calls)
    }

    /// What ran between `before` and `self`.
    pub(crate) fn since(&self, before: &Self) -> Self {
        Self(
            self.0
                .iter()
                .map(|(name, &n)| {
                    let was = before.0.get(name).copied().unwrap_or(0);
                    (name.clone(), n.saturating_sub(was))
                })
                .filter(|&(_, n)| n > 0)
                .collect(),
        )
    }

    /// Calls of the command `name` (`publish`, `evalsha`).
    pub(crate) fn calls(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// All calls.
    pub(crate) fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// Calls per `unit` (pair, entry), most frequent first: `set 1, evalsha 1, get 1`.
    pub(crate) fn per(&self, unit: u64) -> String {
        let mut calls: Vec<_> = self.0.iter().collect();
        calls.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        calls
            .iter()
            .map(|(name, n)| format!("{name} {}", short(**n as f64 / unit.max(1) as f64)))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `1`, `0.5`, `2.03`: a count per unit without trailing zeros.
pub(crate) fn short(x: f64) -> String {
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// The median of some numbers (0 when there are none).
pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_by(f64::total_cmp);
    let mid = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[mid]
    } else {
        (xs[mid - 1] + xs[mid]) / 2.0
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One uncontended acquire+release, on a key no one else uses.
pub(crate) trait Pair: Clone + Send + Sync + 'static {
    /// What this workload's keys start with: workloads that write unprefixed keys on one
    /// server keep apart, so that a key one of them left behind never trips another.
    const KEYS: &'static str = "u";

    /// Takes `key` and gives it back.
    fn pair(&mut self, key: &str) -> impl Future<Output = ()> + Send;
}

/// A lock that tasks take in turn.
pub(crate) trait Contend: Clone + Send + Sync + 'static {
    /// What holding the lock looks like.
    type Guard: Send;
    /// Waits for `key`; `None` when the call gave up (the loop asks again).
    fn acquire(&mut self, key: &str) -> impl Future<Output = Option<Self::Guard>> + Send;
    /// Gives the lock back.
    fn release(&mut self, guard: Self::Guard) -> impl Future<Output = ()> + Send;
}

/// The baseline: `SET NX PX` to take, a compare-and-delete script (EVALSHA) to give back, on
/// one multiplexed connection.
#[derive(Clone)]
pub(crate) struct Raw(pub(crate) MultiplexedConnection);

static RAW_RELEASE: std::sync::LazyLock<Script> = std::sync::LazyLock::new(|| {
    Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0",
    )
});

impl Pair for Raw {
    async fn pair(&mut self, key: &str) {
        let token = format!("{key}-token");
        let ok: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(&token)
            .arg("NX")
            .arg("PX")
            .arg(TTL.as_millis() as u64)
            .query_async(&mut self.0)
            .await
            .expect("SET NX PX");
        assert!(ok.is_some(), "raw: {key} was taken");
        let released: i64 = RAW_RELEASE
            .key(key)
            .arg(&token)
            .invoke_async(&mut self.0)
            .await
            .expect("compare-and-delete");
        assert_eq!(released, 1, "raw: {key} was not released");
    }
}

/// distlock's request builder: `lock(key).acquire()`, then `guard.release()`.
#[derive(Clone)]
pub(crate) struct Manual(pub(crate) LockManager);

impl Pair for Manual {
    async fn pair(&mut self, key: &str) {
        let guard = self.0.lock(key).ttl(TTL).acquire().await.expect("acquire");
        guard.release().await.expect("release");
    }
}

impl Contend for Manual {
    type Guard = distlock::LockGuard;

    async fn acquire(&mut self, key: &str) -> Option<Self::Guard> {
        wait_for(&self.0, key, false, true).await
    }

    async fn release(&mut self, guard: Self::Guard) {
        guard.release().await.expect("release");
    }
}

/// The manual API with `cohort(false)`: every hand-over goes through the server.
#[derive(Clone)]
pub(crate) struct Server(pub(crate) LockManager);

impl Contend for Server {
    type Guard = distlock::LockGuard;

    async fn acquire(&mut self, key: &str) -> Option<Self::Guard> {
        wait_for(&self.0, key, false, false).await
    }

    async fn release(&mut self, guard: Self::Guard) {
        guard.release().await.expect("release");
    }
}

/// Waits for `key` (a minute at most), `fair` or not, passed locally (`cohort`) or not;
/// `None` when that was not enough.
async fn wait_for(
    locks: &LockManager,
    key: &str,
    fair: bool,
    cohort: bool,
) -> Option<distlock::LockGuard> {
    let request = locks
        .lock(key)
        .fair(fair)
        .cohort(cohort)
        .ttl(TTL)
        .wait(Duration::from_secs(60))
        .retry_delay(Duration::from_millis(1));
    match request.acquire().await {
        Ok(guard) => Some(guard),
        Err(LockError::Busy { .. }) => None,
        Err(e) => panic!("{e}"),
    }
}

/// distlock's fair lock: `lock(key).fair(true).acquire()`, then `guard.release()`.
#[derive(Clone)]
pub(crate) struct Fair(pub(crate) LockManager);

impl Contend for Fair {
    type Guard = distlock::LockGuard;

    async fn acquire(&mut self, key: &str) -> Option<Self::Guard> {
        wait_for(&self.0, key, true, false).await
    }

    async fn release(&mut self, guard: Self::Guard) {
        guard.release().await.expect("release");
    }
}

/// distlock's attribute on an empty function.
#[derive(Clone)]
pub(crate) struct Annotated(pub(crate) LockManager);

#[distributed_lock(key = "{key}", ttl = "10s", manager = locks)]
async fn annotated(locks: &LockManager, key: &str) -> Result<(), LockError> {
    let _ = key;
    Ok(())
}

impl Pair for Annotated {
    async fn pair(&mut self, key: &str) {
        annotated(&self.0, key).await.expect("annotated");
    }
}

/// How long one workload runs before the next takes its turn (see [`in_turns`]).
pub(crate) const TURN: Duration = Duration::from_millis(250);

/// Runs `N` workloads for `run` each, in turns of about [`TURN`] (at least [`MIN_TURNS`] of
/// them, however short the run), and returns each one's mean rate. `turn(i, slice)` runs
/// workload `i` for `slice` and returns its rate.
///
/// On a machine whose load from elsewhere changes by the second, running each workload for
/// the whole `run` in a row lets that change fall on one of them; taking turns spreads it
/// over all of them alike, so their ratio holds still. Each turn starts with the next
/// workload, so that none always runs first or always after the same one.
pub(crate) async fn in_turns<const N: usize>(
    run: Duration,
    mut turn: impl AsyncFnMut(usize, Duration) -> f64,
) -> [f64; N] {
    let turns = (run.as_millis() / TURN.as_millis()).max(MIN_TURNS) as u32;
    let slice = run / turns;
    let mut rates = [0.0; N];
    for t in 0..turns as usize {
        for k in 0..N {
            let i = (t + k) % N;
            rates[i] += turn(i, slice).await / f64::from(turns);
        }
    }
    rates
}

/// The fewest turns [`in_turns`] takes.
pub(crate) const MIN_TURNS: u128 = 4;

/// Acquire+release pairs by `tasks` tasks, each on its own key, for `run`.
pub(crate) async fn uncontended<P: Pair>(locks: &P, tasks: usize, run: Duration) -> Run {
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let (mut locks, stop) = (locks.clone(), stop.clone());
        set.spawn(async move {
            let key = format!("{}:{t}", P::KEYS);
            let mut pairs = 0u64;
            while !stop.load(Ordering::Relaxed) {
                locks.pair(&key).await;
                pairs += 1;
            }
            pairs
        });
    }
    let started = Instant::now();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    let mut pairs = 0;
    while let Some(n) = set.join_next().await {
        pairs += n.expect("bench task");
    }
    Run {
        pairs,
        elapsed: started.elapsed(),
    }
}

/// What an uncontended run did: pairs, and the time from the tasks' start to the last one's
/// end.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) pairs: u64,
    pub(crate) elapsed: Duration,
}

impl Run {
    /// Pairs per second.
    pub(crate) fn rate(self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64()
    }
}

/// What the server ran for `pairs` uncontended pairs, one after another (after a few
/// warm-up pairs that load scripts).
pub(crate) async fn commands_per_pair<P: Pair>(
    server: &RedisServer,
    locks: &P,
    pairs: u64,
) -> Commands {
    let mut locks = locks.clone();
    for _ in 0..10 {
        locks.pair("c:0").await;
    }
    let before = Commands::read(server);
    for _ in 0..pairs {
        locks.pair("c:0").await;
    }
    Commands::read(server).since(&before)
}

/// One contended row: tasks take one key in turn.
pub(crate) struct Contended {
    /// Entries into the critical section per second.
    pub(crate) per_sec: f64,
    /// Entries counted.
    pub(crate) entries: u64,
    /// From asking to being inside.
    pub(crate) wait_p50: Duration,
    /// From asking to being inside.
    pub(crate) wait_p99: Duration,
    /// From the holder starting its release to the next holder being inside.
    pub(crate) handoff_p50: Duration,
    /// From the holder starting its release to the next holder being inside.
    pub(crate) handoff_p99: Duration,
    /// Share of entries by the task that had just released.
    pub(crate) same_holder: f64,
    /// Each group's (manager's) share of the entries.
    pub(crate) shares: Vec<f64>,
    /// Share of entries that went in ahead of a task that had asked over a millisecond
    /// earlier and was still waiting (0 in strict arrival order).
    pub(crate) overtaking: f64,
    /// What the server ran meanwhile.
    pub(crate) commands: Commands,
}

impl Contended {
    /// Commands the server ran per entry.
    pub(crate) fn commands_per_entry(&self) -> f64 {
        self.commands.total() as f64 / self.entries.max(1) as f64
    }

    /// Each group's share, as `33/34/33%`.
    pub(crate) fn shares(&self) -> String {
        let shares: Vec<_> = self
            .shares
            .iter()
            .map(|s| format!("{:.0}", s * 100.0))
            .collect();
        format!("{}%", shares.join("/"))
    }
}

/// `tasks` tasks spread over `groups` (one per manager) take key `hot` in turn for `run`.
/// The first fifth of `run` warms up; the rest is measured.
pub(crate) async fn contended<C: Contend>(
    server: &RedisServer,
    groups: &[C],
    tasks: usize,
    run: Duration,
) -> Contended {
    let epoch = Instant::now();
    let last_holder = Arc::new(AtomicU64::new(u64::MAX));
    let release_started = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let group = t % groups.len();
        let mut locks = groups[group].clone();
        let (last_holder, release_started, measuring, stop) = (
            last_holder.clone(),
            release_started.clone(),
            measuring.clone(),
            stop.clone(),
        );
        set.spawn(async move {
            let (mut waits, mut handoffs, mut same, mut count) =
                (Vec::new(), Vec::new(), 0u64, 0u64);
            // (asked, inside), since the epoch: the order check.
            let mut order = Vec::new();
            'entries: while !stop.load(Ordering::Relaxed) {
                let asked = Instant::now();
                let guard = loop {
                    match locks.acquire("hot").await {
                        Some(guard) => break guard,
                        None if stop.load(Ordering::Relaxed) => break 'entries,
                        None => {}
                    }
                };
                let inside = epoch.elapsed().as_nanos() as u64;
                let released_at = release_started.load(Ordering::Acquire);
                let previous = last_holder.swap(t as u64, Ordering::AcqRel);
                if measuring.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                    order.push((asked.duration_since(epoch), inside));
                    waits.push(asked.elapsed());
                    if released_at > 0 {
                        handoffs.push(Duration::from_nanos(inside.saturating_sub(released_at)));
                    }
                    same += u64::from(previous == t as u64);
                    count += 1;
                }
                release_started.store(epoch.elapsed().as_nanos() as u64, Ordering::Release);
                locks.release(guard).await;
            }
            (group, waits, handoffs, same, count, order)
        });
    }
    tokio::time::sleep(run / 5).await;
    let before = Commands::read(server);
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(run - run / 5).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let commands = Commands::read(server).since(&before);

    let (mut waits, mut handoffs, mut same, mut count) = (Vec::new(), Vec::new(), 0, 0);
    let mut order = Vec::new();
    let mut per_group = vec![0u64; groups.len()];
    while let Some(done) = set.join_next().await {
        let (group, w, h, s, c, o) = done.expect("bench task");
        order.extend(o);
        waits.extend(w);
        handoffs.extend(h);
        same += s;
        count += c;
        per_group[group] += c;
    }
    waits.sort();
    handoffs.sort();
    // In order of entry: an entry overtook if someone entering later had asked over a
    // millisecond before it did (and so was waiting when it asked).
    order.sort_by_key(|&(_, inside)| inside);
    let mut earliest_later = Duration::MAX;
    let mut overtakes = 0u64;
    for &(asked, _) in order.iter().rev() {
        if earliest_later.saturating_add(Duration::from_millis(1)) < asked {
            overtakes += 1;
        }
        earliest_later = earliest_later.min(asked);
    }
    Contended {
        overtaking: overtakes as f64 / order.len().max(1) as f64,
        per_sec: count as f64 / elapsed.as_secs_f64(),
        entries: count,
        wait_p50: percentile(&waits, 0.5),
        wait_p99: percentile(&waits, 0.99),
        handoff_p50: percentile(&handoffs, 0.5),
        handoff_p99: percentile(&handoffs, 0.99),
        same_holder: same as f64 / count.max(1) as f64,
        shares: per_group
            .iter()
            .map(|&n| n as f64 / count.max(1) as f64)
            .collect(),
        commands,
    }
}

/// Keys matching `pattern`, and pub/sub channels (plain and sharded) anyone still listens
/// to, once background unsubscribing has settled (up to 5 s).
pub(crate) async fn left_over(server: &RedisServer, pattern: &str) -> (usize, usize) {
    let count = |reply: std::io::Result<String>| {
        reply
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let keys = count(server.command(&["KEYS", pattern]));
        let channels = count(server.command(&["PUBSUB", "CHANNELS", "*"]))
            + count(server.command(&["PUBSUB", "SHARDCHANNELS", "*"]));
        if (keys, channels) == (0, 0) || Instant::now() > deadline {
            return (keys, channels);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
