//! Giving holds back: the one path every release takes.
//!
//! What a release gives back is a [`GiveBack`]: one hold ([`OneHold`]: plain, shared, write
//! or fair) or the locks of a set ([`SetRelease`]). Every release, whoever sends it (a
//! guard's `release`, its `Drop`, a release sent again after its future was dropped,
//! shutdown, a hand-off nobody took, the cover behind an abandoned or late attempt), goes
//! through [`Releaser::give_back`]: it sends the release, sends it once more after a lost
//! reply, and ends each lock in [`settle`], a pure function of the reply, whether it answered
//! a resend and what the lease knows. Then it does, once for every kind and for sets, what a
//! release owes ([`Releaser::owe`]): it wakes the waiters of this manager who could now get
//! in (the release scripts publish to the other processes' waiters, `min_hold`'s marker
//! included), hands a fair lock to the waiter of this manager it was granted to, lets other
//! processes have their turn at the end of a run of hand-offs, settles a cohort's run, and
//! marks a lease found gone lost. A `min_hold` (the hold's own, or one nested in it) travels
//! in what is given back, as the time the key is kept.
//!
//! A release whose future is dropped before Redis answered (a `select!`, a timeout) is sent
//! again from the manager's own runtime ([`Unanswered`]), as a dropped guard's is; and a
//! release of a hold won after an attempt whose answer never came is sent once more when
//! that attempt can no longer land. A release is idempotent per owner token, so sending it
//! again never gives back anything twice.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, FairRelease, HoldIds, SetKey, SetRequest};
use crate::cohort::CohortRun;
use crate::driver::Driver;
use crate::handed::{Handed, UntakenGiver};
use crate::lease::{LeaseState, keep_from};
use crate::waiters::{Grant, Waiters};

mod settle;

pub(crate) use settle::{Reply, Step, settle};

/// What the server did with one lock a release gave back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Given back: free, or kept for nobody until `min_hold`'s end.
    Freed,
    /// A fair lock, granted to the owner of this token, the next in its queue.
    Granted(String),
    /// Given back to every process at the end of a run of hand-offs, heard by this many
    /// subscribers.
    Yielded(u64),
    /// Not this owner's any more.
    NotHeld,
}

/// Something a release gives back: one hold, or the locks of a set.
pub(crate) trait GiveBack: Clone + Send + Sync + 'static {
    /// Sends the release once: what the server did with each lock, in order.
    fn send(
        &self,
        backend: &Backend,
    ) -> impl Future<Output = redis::RedisResult<Vec<Answer>>> + Send;

    /// The wake channel of lock `at`.
    fn wake(&self, at: usize) -> &str;

    /// The name of lock `at` on the server, for the logs.
    fn lock(&self, at: usize) -> &str;

    /// How many locks it gives back.
    fn locks(&self) -> usize;

    /// A fair lock's hold, whose grant to the next in line this manager may hand over.
    fn fair(&self) -> Option<&HoldIds> {
        None
    }

    /// The release ends a run of hand-offs: the local waiters sit out other processes' turns.
    fn yielding(&self) -> Option<Yielding> {
        None
    }

    /// Until when an attempt of this owner whose answer never came may still reach the
    /// server, to take a lock again after this release.
    fn late_until(&self) -> Option<Instant>;

    /// What is sent once more when that attempt can no longer land: the same locks, kept no
    /// longer, and not covered again.
    fn late(&self) -> Self;
}

/// A release at the end of a run of hand-offs (see [`Waiters::yielded`]): the lease the local
/// head would take, and whether the run was one of local passes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Yielding {
    pub(crate) lease: Duration,
    pub(crate) cohort: bool,
}

/// One hold given back: plain, shared, write or fair.
#[derive(Debug, Clone)]
pub(crate) struct OneHold {
    ids: Arc<HoldIds>,
    /// The key stays, owned by nobody, until then (`min_hold`).
    keep_until: Option<Instant>,
    yielding: Option<Yielding>,
}

impl OneHold {
    /// The hold `ids`, its key kept until `keep_until`.
    pub(crate) fn new(ids: Arc<HoldIds>, keep_until: Option<Instant>) -> Self {
        Self {
            ids,
            keep_until,
            yielding: None,
        }
    }

    /// The plain hold `ids`, given back to every process at the end of a run of hand-offs.
    pub(crate) fn yielding(ids: Arc<HoldIds>, yielding: Yielding) -> Self {
        Self {
            ids,
            keep_until: None,
            yielding: Some(yielding),
        }
    }
}

impl GiveBack for OneHold {
    async fn send(&self, backend: &Backend) -> redis::RedisResult<Vec<Answer>> {
        let ids = &self.ids;
        let freed = if ids.fair.is_some() {
            match backend.release_fair(ids).await? {
                FairRelease::Granted(next) => Answer::Granted(next),
                FairRelease::Freed => Answer::Freed,
                FairRelease::NotHeld => Answer::NotHeld,
            }
        } else if self.yielding.is_some() {
            match backend.release_plain(ids).await? {
                Some(heard) => Answer::Yielded(heard),
                None => Answer::NotHeld,
            }
        } else {
            match backend.release(ids, keep_from(self.keep_until)).await? {
                true => Answer::Freed,
                false => Answer::NotHeld,
            }
        };
        Ok(vec![freed])
    }

    fn wake(&self, _: usize) -> &str {
        &self.ids.wake
    }

    fn lock(&self, _: usize) -> &str {
        &self.ids.lock
    }

    fn locks(&self) -> usize {
        1
    }

    fn fair(&self) -> Option<&HoldIds> {
        self.ids.fair.as_ref().map(|_| &*self.ids)
    }

    fn yielding(&self) -> Option<Yielding> {
        self.yielding
    }

    fn late_until(&self) -> Option<Instant> {
        self.ids.late_until
    }

    fn late(&self) -> Self {
        let ids = HoldIds {
            late_until: None,
            ..(*self.ids).clone()
        };
        Self::new(Arc::new(ids), None)
    }
}

/// The locks of a set given back together, each kept as its `keep` says.
#[derive(Debug, Clone)]
pub(crate) struct SetRelease {
    pub(crate) request: SetRequest,
    /// As [`HoldIds::late_until`], for the set's own attempts.
    pub(crate) late_until: Option<Instant>,
}

impl GiveBack for SetRelease {
    async fn send(&self, backend: &Backend) -> redis::RedisResult<Vec<Answer>> {
        let released = backend.release_set(&self.request).await?;
        Ok(released
            .into_iter()
            .map(|yes| if yes { Answer::Freed } else { Answer::NotHeld })
            .collect())
    }

    fn wake(&self, at: usize) -> &str {
        &self.request.keys[at].wake
    }

    fn lock(&self, at: usize) -> &str {
        &self.request.keys[at].lock
    }

    fn locks(&self) -> usize {
        self.request.keys.len()
    }

    fn late_until(&self) -> Option<Instant> {
        self.late_until
    }

    fn late(&self) -> Self {
        let keys = (self.request.keys.iter())
            .map(|key| SetKey {
                keep: Duration::ZERO,
                ..key.clone()
            })
            .collect();
        Self {
            request: SetRequest {
                keys,
                ..self.request.clone()
            },
            late_until: None,
        }
    }
}

/// The error of a release that found `lock` gone after a send whose reply was lost: it may
/// have given the lock back, or the lock was gone before.
fn not_known(lock: &str) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Io,
        "release outcome unknown",
        format!("{lock} was gone when the release was sent again after a lost reply"),
    ))
}

/// What a release knows of what it gives back, beyond its locks.
#[derive(Debug, Default)]
pub(crate) struct Known {
    /// The lease of the hold given back: a lock found gone is lost unless a resend finds
    /// it within this lease. `None` for what an attempt may hold, which has no lease yet.
    pub(crate) lease: Option<Arc<LeaseState>>,
    /// The cohort's run whose last release this is: its answer settles the run.
    pub(crate) run: Option<Arc<CohortRun>>,
    /// A release was sent already, whose reply was lost (a hand-off's).
    pub(crate) resent: bool,
    /// What is given back was held by this manager (not what an attempt may hold): once
    /// Redis answers, none of this manager holds it, and its local waiters are woken to ask.
    pub(crate) held_here: bool,
}

impl Known {
    /// A hold of this manager with `lease`.
    pub(crate) fn hold(lease: Arc<LeaseState>) -> Self {
        Self {
            lease: Some(lease),
            held_here: true,
            ..Self::default()
        }
    }
}

/// How a release ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Every lock was given back.
    Released,
    /// The lease of lock `at` (the first one) had ended: another owner may have held it.
    Lost(usize),
    /// Whether the locks were given back is not known: their leases end them.
    Unknown(redis::RedisError),
}

impl Outcome {
    /// Redis answered: `Ok(true)` when everything was given back.
    pub(crate) fn answer(&self) -> redis::RedisResult<bool> {
        match self {
            Self::Released => Ok(true),
            Self::Lost(_) => Ok(false),
            Self::Unknown(error) => Err(error.clone()),
        }
    }
}

/// What sends every release: the server, the manager's own runtime (which outlives the
/// caller's, and works outside any runtime), and the manager's waiters, to wake or to hand a
/// fair lock to.
#[derive(Debug, Clone)]
pub(crate) struct Releaser {
    pub(crate) backend: Backend,
    pub(crate) driver: Arc<Driver>,
    pub(crate) waiters: Waiters,
}

impl Releaser {
    /// Gives `given` back: sends it, once more after a lost reply, settles each lock (see
    /// [`settle`]) and does what the release owes (see [`owe`](Self::owe)).
    pub(crate) async fn give_back<G: GiveBack>(self, given: G, known: Known) -> Outcome {
        if let Some(run) = &known.run {
            run.ending();
        }
        self.cover_late(&given);
        let outcome = self.send_and_settle(&given, &known).await;
        if let Some(run) = &known.run {
            run.ended_by(outcome.answer());
        }
        if let (Outcome::Lost(_), Some(lease)) = (&outcome, &known.lease) {
            lease.mark_lost();
        }
        outcome
    }

    /// The loop of [`give_back`](Self::give_back).
    async fn send_and_settle<G: GiveBack>(&self, given: &G, known: &Known) -> Outcome {
        let lease_lost = || known.lease.as_ref().is_some_and(|lease| lease.is_lost());
        let lost_before = lease_lost();
        let mut resent = known.resent;
        for sends in 1.. {
            let sent = Instant::now();
            let freed = match given.send(&self.backend).await {
                Ok(freed) => freed,
                Err(error) => match settle(Reply::of_error(&error), resent, lost_before) {
                    // Twice at most: the second failure is the answer.
                    Step::SendAgain if sends < 2 => {
                        resent |= Reply::of_error(&error) == Reply::Silence;
                        continue;
                    }
                    _ => {
                        self.unanswered(given);
                        return Outcome::Unknown(error);
                    }
                },
            };
            let mut outcome = Outcome::Released;
            for (at, freed) in freed.iter().enumerate() {
                let reply = match freed {
                    Answer::NotHeld => Reply::NotHeld,
                    _ => Reply::Given,
                };
                match (settle(reply, resent, lost_before), &outcome) {
                    (Step::Lost, Outcome::Released) => outcome = Outcome::Lost(at),
                    (Step::Unknown, Outcome::Released | Outcome::Lost(_)) => {
                        outcome = Outcome::Unknown(not_known(given.lock(at)));
                    }
                    _ => {}
                }
                self.owe(given, at, freed, sent, known.held_here);
            }
            return outcome;
        }
        unreachable!("the loop returns by its second send")
    }

    /// What a release owes once Redis told what it did with lock `at` (sent at `sent`):
    /// the same for every kind and for sets. `held_here`: what was given back was a hold (not
    /// what an attempt may hold), so none of this manager holds the lock any more.
    fn owe<G: GiveBack>(
        &self,
        given: &G,
        at: usize,
        freed: &Answer,
        sent: Instant,
        held_here: bool,
    ) {
        let wake = given.wake(at);
        match (freed, given.yielding()) {
            (Answer::Granted(next), _) => match given.fair() {
                Some(ids) => self.hand_fair(ids, next, sent),
                None => self.waiters.released(wake),
            },
            (Answer::Yielded(heard), Some(yielding)) => {
                let Yielding { lease, cohort } = yielding;
                self.waiters.yielded(wake, *heard, lease, cohort);
            }
            (_, Some(_)) => self.waiters.unyielded(wake),
            (Answer::Freed | Answer::Yielded(_), None) => self.waiters.released(wake),
            // Nobody of this manager holds it: the local head asks the server.
            (Answer::NotHeld, None) if held_here => self.waiters.released(wake),
            (Answer::NotHeld, None) => {}
        }
    }

    /// A release went unanswered: a head that sat out for it sits out no longer.
    fn unanswered<G: GiveBack>(&self, given: &G) {
        if given.yielding().is_some() {
            self.waiters.unyielded(given.wake(0));
        }
    }

    /// What every release of `given` owes once it is sent, whatever its path: when an
    /// attempt of that owner whose answer never came may still reach the server, the
    /// release is sent once more then, from the manager's runtime, so that such an attempt
    /// landing after the release cannot keep the lock for nobody.
    pub(crate) fn cover_late<G: GiveBack>(&self, given: &G) {
        let Some(until) = given.late_until().filter(|until| *until > Instant::now()) else {
            return;
        };
        let (releaser, late) = (self.clone(), given.late());
        self.driver.spawn(async move {
            tokio::time::sleep_until(until.into()).await;
            let lock = late.lock(0).to_owned();
            match releaser.give_back(late, Known::default()).await {
                Outcome::Released => {
                    tracing::debug!(%lock, "a late attempt's grant was given back");
                }
                Outcome::Lost(_) => {}
                Outcome::Unknown(error) => {
                    tracing::debug!(%lock, %error, "the release behind a late attempt failed");
                }
            }
        });
    }

    /// Gives `given` back from the manager's own runtime, without waiting for it; the
    /// outcome is only logged. That runtime outlives the caller's, so this works while the
    /// caller's runtime shuts down, and outside any runtime. A cohort's run whose release
    /// this is learns that its answer is unknown if that runtime drops the release first.
    pub(crate) fn in_background<G: GiveBack>(&self, given: G, known: Known) {
        let ending = known.run.as_ref().map(CohortRun::ending_guarded);
        let releaser = self.clone();
        self.driver.spawn(async move {
            let outcome = releaser.logged(given, known).await;
            drop((outcome, ending));
        });
    }

    /// [`give_back`](Self::give_back), its outcome logged.
    pub(crate) async fn logged<G: GiveBack>(self, given: G, known: Known) -> Outcome {
        let (lock, locks) = (given.lock(0).to_owned(), given.locks());
        let outcome = self.give_back(given, known).await;
        match &outcome {
            Outcome::Released => tracing::debug!(%lock, locks, "released in the background"),
            Outcome::Lost(_) => {
                tracing::debug!(%lock, locks, "background release found a lock already gone");
            }
            Outcome::Unknown(error) => tracing::warn!(
                %lock, locks, %error,
                "background release failed; the lease will expire"
            ),
        }
        outcome
    }

    /// A release of fair lock `ids` (sent at `sent`) granted it to the owner of token `next`:
    /// if that is a waiter of this manager with a standing offer, it gets the lock in-process,
    /// its lease counted from `sent` (the grant gave it its whole lease, after `sent`). Any
    /// other waiter hears the grant's publish, and asks.
    fn hand_fair(&self, ids: &HoldIds, next: &str, sent: Instant) {
        let Grant::Offer(offer) = self.waiters.grant(&ids.wake, next) else {
            return;
        };
        let fair = ids
            .fair
            .as_ref()
            .map(|queue| queue.for_owner(self.waiters.manager_id(), offer.lease, &offer.token));
        let next = Arc::new(HoldIds {
            token: offer.token,
            fair,
            late_until: None,
            ..ids.clone()
        });
        self.waiters.handed_off();
        // A waiter that gave up meanwhile drops it, which gives the lock back.
        let _ = offer.handed.send(self.handed(sent, next, None));
    }

    /// A lock held as `ids`, handed over at `sent` by this manager, that gives itself back
    /// through this releaser if nobody takes it.
    pub(crate) fn handed(
        &self,
        sent: Instant,
        ids: Arc<HoldIds>,
        local: Option<crate::handed::LocalPass>,
    ) -> Handed {
        Handed::new(sent, Arc::new(self.clone()), ids, local)
    }
}

impl UntakenGiver for Releaser {
    fn give_back(&self, ids: Arc<HoldIds>, run: Option<Arc<CohortRun>>) {
        let known = Known {
            run,
            held_here: true,
            ..Known::default()
        };
        self.in_background(OneHold::new(ids, None), known);
    }
}

/// What a release sends again when its caller gave up on it before Redis answered.
pub(crate) trait Resend {
    /// Sends the release again from the manager's own runtime, without waiting for it.
    fn resend(&self);
}

/// A release on its way to Redis: dropped armed (its future dropped midway), it sends the
/// release again from the manager's runtime. Armed before the first command is sent, and
/// disarmed by [`answered`](Self::answered) once the release has settled.
pub(crate) struct Unanswered<'r, R: Resend>(Option<&'r R>);

impl<'r, R: Resend> Unanswered<'r, R> {
    /// Covers the release that `release` sends again.
    pub(crate) fn armed(release: &'r R) -> Self {
        Self(Some(release))
    }

    /// The release settled: nothing is sent again.
    pub(crate) fn answered(&mut self) {
        self.0 = None;
    }
}

impl<R: Resend> Drop for Unanswered<'_, R> {
    fn drop(&mut self) {
        if let Some(release) = self.0.take() {
            release.resend();
        }
    }
}
