//! Leader election on the locks: one leader at a time per election name, with a term number
//! that every new leader gets larger than all before it, in every process.
//!
//! An election `name` is the exclusive lock named `election:<name>`, taken with a fencing
//! token (the term) and renewed by the watchdog while the leader lives. A new leader writes
//! who it is and since when next to the lock (`…:leader`) and announces it on a channel of
//! the same name, which [`Election::observe`] follows; a leader that resigns announces that
//! too, and its release wakes the next candidate at once.

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use redis::aio::PubSub;
use tokio::sync::mpsc;

use crate::backend::Backend;
use crate::identity::Registry;
use crate::key::Keys;
use crate::manager::Inner;
use crate::{HolderIdentity, LockError, LockGuard, LockManager};

/// An election among the processes that share a Redis: at most one of them leads at a time.
/// Made by [`LockManager::election`]; cheap to clone.
///
/// ```no_run
/// # async fn run(locks: distlock_runtime::LockManager) -> Result<(), distlock_runtime::LockError> {
/// use std::time::Duration;
///
/// let election = locks.election("scheduler").ttl(Duration::from_secs(10));
/// let leadership = election.campaign().await?; // waits until this process leads
/// println!("leading in term {}", leadership.term());
/// tokio::select! {
///     lost = leadership.lost() => eprintln!("no longer leading: {lost}"),
///     () = async { /* the leader's work */ } => leadership.resign().await?,
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "an election does nothing until `campaign`, `leader` or `observe` is called"]
pub struct Election {
    manager: LockManager,
    name: String,
    ttl: Option<Duration>,
    watchdog: bool,
    wait: Option<Duration>,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .field("watchdog", &self.watchdog)
            .field("wait", &self.wait)
            .finish()
    }
}

impl LockManager {
    /// The election named `name` (the exclusive lock `election:<name>` under this manager's
    /// prefix): campaign to lead it, see who leads, follow its changes. Every process that
    /// uses the same name and Redis (and prefix) takes part in the same election.
    pub fn election(&self, name: impl Into<String>) -> Election {
        Election {
            manager: self.clone(),
            name: name.into(),
            ttl: None,
            watchdog: true,
            wait: None,
        }
    }

    /// This manager's identity, as registered in Redis and shown next to every lock it holds.
    pub fn identity(&self) -> &HolderIdentity {
        &self.inner.registry.identity
    }
}

impl Election {
    /// The leader's lease: how long leadership outlives a leader that stops renewing it (a
    /// crashed or cut-off process): another candidate leads within about this long. Default:
    /// the manager's `default_ttl`.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Renew the leader's lease while its [`Leadership`] lives (default: on). Without it,
    /// leadership ends when the lease runs out.
    pub fn watchdog(mut self, watchdog: bool) -> Self {
        self.watchdog = watchdog;
        self
    }

    /// How long [`campaign`](Self::campaign) waits to lead before it fails with
    /// [`LockError::Busy`]. Default: no bound.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The election's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn lock_name(&self) -> String {
        format!("election:{}", self.name)
    }

    /// Waits until this process leads, within [`wait`](Self::wait) if set. A leader that
    /// resigns wakes the next candidate at once; one that dies is replaced when its lease
    /// runs out.
    ///
    /// Errors: [`LockError::Busy`] when `wait` ran out; [`LockError::ShutDown`] when the
    /// manager was shut down; [`LockError::Redis`] when Redis could not be reached at the end;
    /// [`LockError::InvalidInput`] for a bad name or ttl, and on RedLock, whose masters keep
    /// independent counters, so that no term could be trusted to grow.
    pub async fn campaign(&self) -> Result<Leadership, LockError> {
        self.check()?;
        let wait = self.wait.unwrap_or(Duration::MAX);
        self.elect(self.request().wait(wait).acquire().await?).await
    }

    /// Leads if nobody does now: `Ok(None)` when another process leads. Never waits.
    pub async fn try_campaign(&self) -> Result<Option<Leadership>, LockError> {
        self.check()?;
        match self.request().try_acquire().await? {
            Some(guard) => Ok(Some(self.elect(guard).await?)),
            None => Ok(None),
        }
    }

    /// Terms are fencing tokens: one counter, which RedLock does not have.
    fn check(&self) -> Result<(), LockError> {
        if self.manager.inner.backend.capabilities().fencing {
            return Ok(());
        }
        Err(LockError::invalid(
            "election",
            "elections draw their terms from one counter; RedLock masters count independently",
        ))
    }

    fn request(&self) -> crate::LockRequest<'_> {
        let mut request = self
            .manager
            .lock(self.lock_name())
            .fencing(true)
            .watchdog(self.watchdog)
            .max_hold(Duration::MAX)
            .label("election");
        if let Some(ttl) = self.ttl {
            request = request.ttl(ttl);
        }
        request
    }

    /// Records and announces a new leader.
    async fn elect(&self, guard: LockGuard) -> Result<Leadership, LockError> {
        let term = guard.fencing_token().unwrap_or_default();
        let since = SystemTime::now();
        let keys = Keys::new(&self.manager.inner.prefix, self.lock_name())?;
        let news = News::Elected {
            term,
            token: guard.token().to_owned(),
            since: millis(since),
        };
        announce(&self.manager, &keys, &news).await;
        crate::metrics::election_won(&self.name, term);
        tracing::info!(election = %self.name, term, "leading");
        Ok(Leadership {
            guard: Some(guard),
            term,
            since,
            election: self.clone(),
        })
    }

    /// Who leads now: `None` when nobody does (the last leader resigned, or its lease ran
    /// out and no candidate has taken over yet).
    pub async fn leader(&self) -> Result<Option<LeaderInfo>, LockError> {
        leader_of(&self.manager, &self.lock_name()).await
    }

    /// Follows the election: the current state first, then every change as it is announced
    /// (pushed through pub/sub, never polled). Changes come in the order of their terms, each
    /// once; an [`Observer`] that reconnects after a failure reads the state again and goes on.
    ///
    /// A leader that dies is seen when its successor is elected (nobody announces an
    /// expiry). Ends (`None`) when the manager is shut down or dropped.
    pub async fn observe(&self) -> Result<Observer, LockError> {
        let keys = Keys::new(&self.manager.inner.prefix, self.lock_name())?;
        let (sender, changes) = mpsc::unbounded_channel();
        let follow = follow(
            Arc::downgrade(&self.manager.inner),
            self.lock_name(),
            channel(&keys),
            sender,
        );
        self.manager.inner.driver.spawn(follow);
        Ok(Observer { changes })
    }

    /// Runs `body` whenever this process leads, for as long as it leads: campaigns, runs
    /// `body(term)` until leadership is lost (the body's future is dropped then) or the body
    /// ends (leadership is resigned then), and campaigns again. Returns only with the error
    /// that ends campaigning: [`LockError::ShutDown`] once the manager is shut down, or a
    /// mistake in input; a Redis failure is waited out.
    pub async fn lead<F, Fut>(&self, mut body: F) -> LockError
    where
        F: FnMut(u64) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            let leadership = match self.campaign().await {
                Ok(leadership) => leadership,
                Err(
                    error @ (LockError::ShutDown
                    | LockError::InvalidInput { .. }
                    | LockError::Config(_)
                    | LockError::DriverStopped),
                ) => return error,
                // Anything else passes: Redis failing, a replica late, a wait run out.
                Err(error) => {
                    tracing::debug!(%error, election = %self.name, "campaign failed; again");
                    let again = std::time::Instant::now() + Duration::from_millis(100);
                    if let Err(error) = self.manager.inner.sleep_until(again).await {
                        return error;
                    }
                    continue;
                }
            };
            let term = leadership.term();
            let ended = tokio::select! {
                () = body(term) => true,
                lost = leadership.lost() => {
                    tracing::warn!(election = %self.name, term, %lost, "leadership lost");
                    false
                }
            };
            if ended {
                if let Err(error) = leadership.resign().await {
                    tracing::debug!(%error, election = %self.name, "resign failed");
                }
            } else {
                drop(leadership);
            }
        }
    }
}

/// This process's leadership of an election, from [`Election::campaign`].
///
/// Dropping it gives leadership back in the background, without the announcement
/// [`resign`](Self::resign) makes.
#[must_use = "dropping a Leadership gives leadership back"]
pub struct Leadership {
    guard: Option<LockGuard>,
    term: u64,
    since: SystemTime,
    election: Election,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("election", &self.election.name)
            .field("term", &self.term)
            .field("since", &self.since)
            .finish()
    }
}

impl Leadership {
    /// This leadership's term: larger than the term of every earlier leader of the election,
    /// in every process. Use it as a fencing token: have what the leader writes to reject a
    /// term smaller than the largest it has seen, so that a leader that paused past its lease
    /// cannot overwrite its successor's work.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// When this process became leader (its wall clock).
    pub fn since(&self) -> SystemTime {
        self.since
    }

    /// The election this leadership belongs to.
    pub fn election(&self) -> &Election {
        &self.election
    }

    /// The lock behind this leadership.
    pub fn guard(&self) -> &LockGuard {
        self.guard.as_ref().expect("held until resigned or dropped")
    }

    /// Whether leadership is known to be lost (asks nothing of Redis).
    pub fn is_lost(&self) -> bool {
        self.guard().is_lost()
    }

    /// Completes when leadership is lost: the lease ran out or was taken
    /// ([`LockError::Lost`]), or the manager was shut down ([`LockError::ShutDown`]). Race it
    /// against the leader's work.
    pub async fn lost(&self) -> LockError {
        self.guard().lost().await
    }

    /// Gives leadership back and tells the other candidates at once: the next one leads
    /// without waiting for the lease. [`LockError::Lost`] if it had already been lost.
    pub async fn resign(mut self) -> Result<(), LockError> {
        let guard = self.guard.take().expect("held until resigned or dropped");
        let keys = Keys::new(
            &self.election.manager.inner.prefix,
            self.election.lock_name(),
        )?;
        let news = News::Resigned {
            term: self.term,
            token: guard.token().to_owned(),
        };
        // Announced first, so that observers see "nobody" before the next leader, and the
        // record goes before anyone else can write theirs.
        if !guard.is_lost() {
            announce(&self.election.manager, &keys, &news).await;
        }
        let released = guard.release().await;
        crate::metrics::election_ended(&self.election.name, released.is_err());
        tracing::info!(election = %self.election.name, term = self.term, "resigned");
        released
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        if let Some(guard) = &self.guard {
            crate::metrics::election_ended(&self.election.name, guard.is_lost());
        }
    }
}

/// Who leads an election, from [`Election::leader`] and [`Observer`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaderInfo {
    /// The leader's term (see [`Leadership::term`]).
    pub term: u64,
    /// The leader's owner token.
    pub token: String,
    /// Who the leader is, when its manager's registration is there to read.
    pub identity: Option<HolderIdentity>,
    /// When it became leader (its own wall clock), when it said so.
    pub since: Option<SystemTime>,
}

impl fmt::Display for LeaderInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.identity {
            Some(identity) => write!(f, "term {}: {identity}", self.term),
            None => write!(f, "term {}: {} (unknown or gone)", self.term, self.token),
        }
    }
}

/// A change of an election's leader, from [`Observer::next`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaderChange {
    /// This process leads now (the first event when one leads as observing starts).
    Leader(LeaderInfo),
    /// Nobody leads: the leader resigned (or nobody led as observing started).
    NoLeader,
}

/// The changes of an election's leader, from [`Election::observe`]: read them with
/// [`next`](Self::next), or as a `Stream`. Dropping it stops following.
#[derive(Debug)]
pub struct Observer {
    changes: mpsc::UnboundedReceiver<LeaderChange>,
}

impl Observer {
    /// The next change; `None` once the manager is shut down or dropped.
    pub async fn next(&mut self) -> Option<LeaderChange> {
        self.changes.recv().await
    }
}

impl futures_util::Stream for Observer {
    type Item = LeaderChange;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<LeaderChange>> {
        self.changes.poll_recv(cx)
    }
}

/// What a leader announces.
#[derive(Debug, Clone, PartialEq, Eq)]
enum News {
    Elected {
        term: u64,
        token: String,
        since: u64,
    },
    Resigned {
        term: u64,
        token: String,
    },
}

impl News {
    fn encode(&self) -> String {
        match self {
            Self::Elected { term, token, since } => format!("elected {term} {token} {since}"),
            Self::Resigned { term, token } => format!("resigned {term} {token}"),
        }
    }

    fn decode(text: &str) -> Option<Self> {
        let mut words = text.split(' ');
        let news = match (words.next()?, words.next()?.parse().ok()?, words.next()?) {
            ("elected", term, token) => Self::Elected {
                term,
                token: token.to_owned(),
                since: words.next()?.parse().ok()?,
            },
            ("resigned", term, token) => Self::Resigned {
                term,
                token: token.to_owned(),
            },
            _ => return None,
        };
        words.next().is_none().then_some(news)
    }
}

fn channel(keys: &Keys) -> String {
    format!("{}:leader", keys.lock)
}

fn millis(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// How long a leader's record outlives a leader that never resigned (it crashed): the record
/// is only read next to a live lock, so this bounds what a dead election leaves behind.
const RECORD_KEPT: Duration = Duration::from_secs(24 * 3600);

/// Records `news` next to the lock (a new leader's, or none after a resignation) and
/// publishes it. Best effort: the lock is what decides who leads; a failure here only leaves
/// observers to learn it later.
async fn announce(manager: &LockManager, keys: &Keys, news: &News) {
    let (record, channel) = (channel(keys), channel(keys));
    let text = news.encode();
    let elected = matches!(news, News::Elected { .. });
    let sent = manager
        .inner
        .exec(move |backend| async move {
            let node = backend.inspected();
            let write = if elected {
                let mut set = redis::cmd("SET");
                set.arg(&record)
                    .arg(&text)
                    .arg("PX")
                    .arg(RECORD_KEPT.as_millis() as u64);
                set
            } else {
                let mut del = redis::cmd("DEL");
                del.arg(&record);
                del
            };
            node.query::<redis::Value>(&write).await?;
            let mut publish = redis::cmd("PUBLISH");
            publish.arg(&channel).arg(&text);
            node.query::<redis::Value>(&publish).await
        })
        .await;
    if let Ok(Err(error)) = sent {
        tracing::debug!(%error, "an election's news was not announced");
    }
}

/// Who leads the election whose lock is `lock_name`, read from the lock itself (its holder
/// and fencing token: the hash of a fenced lock) and the record its leader wrote. Uses only
/// commands a user restricted by `LockManager::acl_rules` may send.
async fn leader_of(
    manager: &LockManager,
    lock_name: &str,
) -> Result<Option<LeaderInfo>, LockError> {
    let keys = Keys::new(&manager.inner.prefix, lock_name.to_owned())?;
    let registry = Arc::clone(&manager.inner.registry);
    let read = move |backend: crate::backend::Backend| async move {
        let node = backend.inspected();
        let fields: Vec<String> = node.query(redis::cmd("HKEYS").arg(&keys.lock)).await?;
        let Some(token) = fields.into_iter().find(|field| {
            !matches!(field.as_str(), "mode" | "permits" | "fence" | "min_hold")
                && !field.starts_with("h:")
        }) else {
            return Ok(None);
        };
        let term: Option<u64> = node
            .query(redis::cmd("HGET").arg(&keys.lock).arg("fence"))
            .await?;
        let record: Option<String> = node.query(redis::cmd("GET").arg(channel(&keys))).await?;
        let since = match record.as_deref().and_then(News::decode) {
            Some(News::Elected {
                token: recorded,
                since,
                ..
            }) if recorded == token => UNIX_EPOCH.checked_add(Duration::from_millis(since)),
            _ => None,
        };
        let identity = registry.lookup(&backend, &token).await.ok().flatten();
        Ok::<_, redis::RedisError>(Some(LeaderInfo {
            term: term.unwrap_or_default(),
            token,
            identity,
            since,
        }))
    };
    manager
        .inner
        .exec(read)
        .await?
        .map_err(|e| LockError::redis(lock_name, e))
}

/// What an observer last told: the largest term it saw, the leader it told last, and whether
/// that leader still leads.
#[derive(Debug, Default)]
struct Seen {
    term: u64,
    token: Option<String>,
    leading: bool,
    told: bool,
}

impl Seen {
    /// The change to tell, if `now` is news. An announcement is news with a larger term; a
    /// look at the state (`looked`) is the truth of its moment, so any other leader than the
    /// one told is news then (after a failover lost the counter, a term can come again), and
    /// so is nobody.
    fn change(&mut self, now: Option<LeaderInfo>, looked: bool) -> Option<LeaderChange> {
        match now {
            Some(leader) => {
                let same = self.leading && self.token.as_deref() == Some(leader.token.as_str());
                if self.told && (same || (leader.term <= self.term && !looked)) {
                    return None;
                }
                self.term = self.term.max(leader.term);
                self.token = Some(leader.token.clone());
                self.leading = true;
                self.told = true;
                Some(LeaderChange::Leader(leader))
            }
            None if self.leading || !self.told => {
                self.leading = false;
                self.told = true;
                Some(LeaderChange::NoLeader)
            }
            None => None,
        }
    }

    /// A resignation is news only from the leader told.
    fn resigned(&mut self, token: &str) -> Option<LeaderChange> {
        (self.leading && self.token.as_deref() == Some(token)).then(|| {
            self.leading = false;
            LeaderChange::NoLeader
        })
    }
}

/// How long subscribing may take before the observer tries again.
const SUBSCRIBE_BOUND: Duration = Duration::from_secs(2);
/// How often a following observer looks at the state itself: a leader that died with no
/// successor, or a shutdown, announces nothing; a connection can also die silently.
const LOOK_AGAIN: Duration = Duration::from_secs(5);
/// How often it checks that its manager still runs.
const CHECK: Duration = Duration::from_secs(1);

/// The state now, read through the manager (if it still runs).
async fn look(
    inner: &Weak<Inner>,
    lock_name: &str,
) -> Option<Result<Option<LeaderInfo>, LockError>> {
    let manager = inner.upgrade().map(|inner| LockManager { inner })?;
    if manager.inner.holds.is_shut_down() {
        return None;
    }
    Some(leader_of(&manager, lock_name).await)
}

/// Whether the observer should stop: its manager is gone or shut down.
fn stopped(inner: &Weak<Inner>) -> bool {
    inner
        .upgrade()
        .is_none_or(|inner| inner.holds.is_shut_down())
}

/// The observer's task, on the manager's runtime: subscribes, reads the state, then follows
/// the announcements, looking at the state again now and then; after a failure it subscribes
/// and reads again. Holds no strong reference to the manager except while it reads, and
/// ends once the manager is shut down or dropped, or the observer is.
async fn follow(
    inner: Weak<Inner>,
    lock_name: String,
    channel: String,
    changes: mpsc::UnboundedSender<LeaderChange>,
) {
    let Some((backend, registry)) = inner
        .upgrade()
        .map(|inner| (inner.backend.clone(), Arc::clone(&inner.registry)))
    else {
        return;
    };
    let mut follower = Follower {
        inner,
        lock_name,
        channel,
        changes,
        backend,
        registry,
        seen: Seen::default(),
    };
    let mut pause = Duration::from_millis(50);
    loop {
        if stopped(&follower.inner) || follower.changes.is_closed() {
            return;
        }
        let (pubsub, now) = match follower.subscribe().await {
            Subscribed::Stop => return,
            Subscribed::Failed => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                continue;
            }
            Subscribed::Ready(pubsub, now) => (pubsub, now),
        };
        pause = Duration::from_millis(50);
        let change = follower.seen.change(now, true);
        if follower.tell(change).is_break() || follower.listen(pubsub).await.is_break() {
            return;
        }
        // The connection ended: subscribe again and read the state.
    }
}

/// An observer's task and what it knows.
struct Follower {
    inner: Weak<Inner>,
    lock_name: String,
    channel: String,
    changes: mpsc::UnboundedSender<LeaderChange>,
    backend: Backend,
    registry: Arc<Registry>,
    seen: Seen,
}

/// How an observer's subscription went.
enum Subscribed {
    /// Subscribed, and the state read since.
    Ready(PubSub, Option<LeaderInfo>),
    /// Not now: try again after a pause.
    Failed,
    /// The manager is gone or shut down.
    Stop,
}

impl Follower {
    /// Subscribes to the announcements, then reads the state: a change between the two is
    /// heard, not missed.
    async fn subscribe(&self) -> Subscribed {
        let subscribed = tokio::time::timeout(SUBSCRIBE_BOUND, async {
            let mut pubsub = self.backend.pubsub().await?;
            pubsub.subscribe(&self.channel).await?;
            Ok::<_, redis::RedisError>(pubsub)
        })
        .await;
        match subscribed {
            Ok(Ok(pubsub)) => match look(&self.inner, &self.lock_name).await {
                None => Subscribed::Stop,
                Some(Ok(now)) => Subscribed::Ready(pubsub, now),
                Some(Err(error)) => {
                    tracing::debug!(%error, "an election observer could not read the leader");
                    Subscribed::Failed
                }
            },
            Ok(Err(error)) => {
                tracing::debug!(%error, "an election observer could not subscribe");
                Subscribed::Failed
            }
            Err(_) => Subscribed::Failed,
        }
    }

    /// Follows the announcements on `pubsub`, and looks at the state itself every
    /// [`LOOK_AGAIN`]. `Continue` when the connection ended or a look failed (subscribe and
    /// read again), `Break` when the observer should stop.
    async fn listen(&mut self, mut pubsub: PubSub) -> ControlFlow<()> {
        let mut messages = pubsub.on_message();
        let mut check = tokio::time::interval(CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut looked = tokio::time::Instant::now();
        loop {
            let message = tokio::select! {
                message = messages.next() => message,
                () = self.changes.closed() => return ControlFlow::Break(()),
                _ = check.tick() => {
                    if stopped(&self.inner) {
                        return ControlFlow::Break(());
                    }
                    if looked.elapsed() < LOOK_AGAIN {
                        continue;
                    }
                    looked = tokio::time::Instant::now();
                    match look(&self.inner, &self.lock_name).await {
                        None => return ControlFlow::Break(()),
                        Some(Ok(now)) => {
                            let change = self.seen.change(now, true);
                            self.tell(change)?;
                            continue;
                        }
                        // Subscribe and read again.
                        Some(Err(_)) => return ControlFlow::Continue(()),
                    }
                }
            };
            let Some(message) = message else {
                return ControlFlow::Continue(());
            };
            let Ok(text) = message.get_payload::<String>() else {
                continue;
            };
            let change = self.news(&text).await;
            self.tell(change)?;
        }
    }

    /// What an announcement changes, if anything.
    async fn news(&mut self, text: &str) -> Option<LeaderChange> {
        match News::decode(text) {
            Some(News::Elected { term, token, since }) => {
                let identity = (self.registry.lookup(&self.backend, &token).await)
                    .ok()
                    .flatten();
                self.seen.change(
                    Some(LeaderInfo {
                        term,
                        token,
                        identity,
                        since: UNIX_EPOCH.checked_add(Duration::from_millis(since)),
                    }),
                    false,
                )
            }
            Some(News::Resigned { token, .. }) => self.seen.resigned(&token),
            None => None,
        }
    }

    /// Passes `change` on, if any: `Break` when nobody observes any more.
    fn tell(&self, change: Option<LeaderChange>) -> ControlFlow<()> {
        if let Some(change) = change
            && self.changes.send(change).is_err()
        {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leader(term: u64) -> Option<LeaderInfo> {
        Some(LeaderInfo {
            term,
            token: format!("{term:032x}"),
            identity: None,
            since: None,
        })
    }

    #[test]
    fn news_reads_back_as_written() {
        for news in [
            News::Elected {
                term: 7,
                token: "ab".repeat(16),
                since: 1_700_000_000_000,
            },
            News::Resigned {
                term: 7,
                token: "ab".repeat(16),
            },
        ] {
            assert_eq!(News::decode(&news.encode()), Some(news));
        }
        for text in [
            "",
            "elected",
            "elected x t 1",
            "resigned 1",
            "elected 1 t 1 extra",
        ] {
            assert_eq!(News::decode(text), None, "{text:?}");
        }
    }

    fn token(term: u64) -> String {
        format!("{term:032x}")
    }

    fn told_leader(change: Option<LeaderChange>) -> Option<u64> {
        match change {
            Some(LeaderChange::Leader(leader)) => Some(leader.term),
            _ => None,
        }
    }

    #[test]
    fn an_observer_tells_each_change_once_in_term_order() {
        let mut seen = Seen::default();
        assert_eq!(seen.change(None, true), Some(LeaderChange::NoLeader));
        assert_eq!(seen.change(None, true), None);
        assert_eq!(told_leader(seen.change(leader(3), false)), Some(3));
        assert_eq!(seen.change(leader(3), false), None, "the same leader again");
        assert_eq!(
            seen.change(leader(3), true),
            None,
            "the same leader, looked at"
        );
        assert_eq!(seen.change(leader(2), false), None, "an older term, late");
        assert_eq!(seen.resigned(&token(2)), None, "an older leader resigning");
        assert_eq!(seen.resigned(&token(3)), Some(LeaderChange::NoLeader));
        assert_eq!(seen.resigned(&token(3)), None);
        assert_eq!(told_leader(seen.change(leader(5), false)), Some(5));
        // A successor elected before the resignation of its predecessor is heard.
        assert_eq!(seen.resigned(&token(3)), None);
    }

    #[test]
    fn a_look_tells_what_announcements_cannot() {
        let mut seen = Seen::default();
        assert_eq!(
            told_leader(seen.change(leader(0), true)),
            Some(0),
            "term 0 first"
        );
        assert_eq!(told_leader(seen.change(leader(7), false)), Some(7));
        // The leader died with no successor: only a look tells.
        assert_eq!(seen.change(None, true), Some(LeaderChange::NoLeader));
        // A failover lost the counter: a term comes again, with another leader.
        assert_eq!(told_leader(seen.change(leader(4), true)), Some(4));
    }
}
