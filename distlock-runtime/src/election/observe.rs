//! Following an election: an [`Observer`]'s task, on the manager's runtime, that subscribes
//! to the election's channel, reads the state, and tells each change of leader once, in term
//! order.

use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, UNIX_EPOCH};

use futures_util::StreamExt;
use redis::aio::PubSub;
use tokio::sync::mpsc;

use super::leader::{LeaderChange, LeaderInfo};
use super::news::{News, leader_of};
use crate::backend::Backend;
use crate::error::LockError;
use crate::identity::Registry;
use crate::manager::Inner;
use crate::manager::LockManager;

/// The changes of an election's leader, from
/// [`Election::observe`](super::Election::observe): read them with [`next`](Self::next), or as
/// a `Stream`. Dropping it stops following.
#[derive(Debug)]
pub struct Observer {
    changes: mpsc::UnboundedReceiver<LeaderChange>,
}

impl Observer {
    pub(super) fn new(changes: mpsc::UnboundedReceiver<LeaderChange>) -> Self {
        Self { changes }
    }

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
pub(super) async fn follow(
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
