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
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;

use crate::error::LockError;
use crate::guard::LockGuard;
use crate::holder::HolderIdentity;
use crate::key::Keys;
use crate::manager::LockManager;

mod leader;
mod news;
mod observe;

pub use leader::{LeaderChange, LeaderInfo};
use news::{News, announce, channel, leader_of, millis};
pub use observe::Observer;
use observe::follow;

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

    fn request(&self) -> crate::request::LockRequest<'_> {
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
        Ok(Observer::new(changes))
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
