//! A cohort's run: one server hold passed among a manager's own tasks with no server command,
//! and the check that keeps what the run believes in step with what the server knows.
//!
//! A local pass sends nothing, so the server may know what the run does not: a `DEL`, a
//! forced release, a failover that lost the key, a lease run out. The run asks. Every pass
//! asks for a check sent after it, a `GET` of the lock compared with the run's token (runs
//! exist only where a release may hand a lock over: one endpoint, never RedLock, whose check
//! would take a majority as its holds do). One check is in flight at a time; the passes
//! made while it is out share the next one, sent as its answer comes back, so a busy run costs
//! about one command per round trip, and a run that stopped passing costs nothing. A pass
//! never waits for a check: the holder that made it does, before its release answers, and
//! answers `Ok` only once a check sent after its pass found the hold still the run's.
//!
//! A check that finds the hold gone ends the run: its lease, which every holder of the run
//! shares, is marked lost, so no pass is made from then on, the holder that has it now sees
//! `lost()` fire, and every release waiting for that check (or any later one) answers
//! `Lost`. A steal therefore stops the run within the round trip of the first check sent
//! after it, and the run's own bounds stop it in any case.
//!
//! The run's hold leaves the server through its last holder: a release (to everyone, or
//! handed over through the server), in the foreground or from the manager's runtime. Once
//! that is on its way, a check that finds the hold gone may be seeing that very release, so
//! such answers are set aside, and the release's own answer (it compares the token too)
//! settles what is still waiting: held then, held at every pass before it.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

use crate::backend::{Backend, HoldIds};
use crate::driver::Driver;
use crate::lease::LeaseState;

/// A checked run of local passes of one server hold (see the module docs). Shared by the
/// holders of the run and the releases waiting for its checks.
#[derive(Debug)]
pub(crate) struct CohortRun {
    ids: Arc<HoldIds>,
    /// The server hold's lease, shared by every holder of the run.
    lease: Arc<LeaseState>,
    /// When the run's first pass was made: its time bound counts from here.
    began: Instant,
    backend: Backend,
    driver: Arc<Driver>,
    checks: Mutex<Checks>,
    /// Told whenever the checks' state moves (an answer, the run's end).
    moved: Notify,
}

#[derive(Debug, Default)]
struct Checks {
    /// Checks sent so far, the one in flight included; they are numbered from 1.
    sent: u64,
    /// The latest check a pass asked for.
    asked: u64,
    /// A check is in flight (or about to be sent).
    in_flight: bool,
    /// The latest check that found the hold still the run's (`u64::MAX`: the run's own last
    /// release did, after every pass).
    confirmed: u64,
    /// The hold was found gone: final.
    stolen: bool,
    /// The latest check that could not tell (`u64::MAX`: nor could the run's last release),
    /// and why.
    failed: Option<(u64, redis::RedisError)>,
    /// The run's own last release is on its way: a check that finds the hold gone may be
    /// seeing it.
    ending: bool,
    /// That release answered (or was given up): `ending` is settled.
    ended: bool,
}

/// What the check a release waits for found.
#[derive(Debug)]
pub(crate) enum Checked {
    /// The hold was still the run's after the pass.
    Held,
    /// The hold was gone.
    Stolen,
    /// The server could not tell.
    Failed(redis::RedisError),
    /// The manager shut down meanwhile (and gave the run's hold back).
    ShutDown,
}

impl CohortRun {
    /// A run of the server hold `ids`, whose lease is `lease`, checked through `backend`.
    pub(crate) fn new(
        ids: Arc<HoldIds>,
        lease: Arc<LeaseState>,
        backend: Backend,
        driver: Arc<Driver>,
    ) -> Arc<Self> {
        Arc::new(Self {
            ids,
            lease,
            began: Instant::now(),
            backend,
            driver,
            checks: Mutex::default(),
            moved: Notify::new(),
        })
    }

    /// The server hold passed along the run.
    pub(crate) fn ids(&self) -> &Arc<HoldIds> {
        &self.ids
    }

    /// The server hold's lease, shared by every holder of the run.
    pub(crate) fn lease(&self) -> &Arc<LeaseState> {
        &self.lease
    }

    /// When the run's first pass was made.
    pub(crate) fn began(&self) -> Instant {
        self.began
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Checks> {
        self.checks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the run may pass its hold on: no check found it gone or failed, and its last
    /// release has not begun.
    pub(crate) fn passable(&self) -> bool {
        let checks = self.lock();
        !checks.stolen && checks.failed.is_none() && !checks.ending
    }

    /// A pass was just made: asks for a check sent from now on, and sends it unless one is in
    /// flight (its answer sends the next). Returns the number of the check to wait for.
    pub(crate) fn passed(self: &Arc<Self>) -> u64 {
        let mut checks = self.lock();
        let wanted = checks.sent + 1;
        checks.asked = checks.asked.max(wanted);
        if checks.in_flight || checks.stolen || checks.ending {
            return wanted;
        }
        checks.in_flight = true;
        checks.sent = wanted;
        drop(checks);
        self.send(wanted);
        wanted
    }

    /// Sends check `number` from the caller's runtime (on its connection, behind what the
    /// run sent there), or from the manager's when there is none.
    fn send(self: &Arc<Self>, number: u64) {
        let task = check(self.clone(), number);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(task)),
            Err(_) => self.driver.spawn(task),
        }
    }

    /// The answer to check `number`; returns the number of the next one to send, if a pass
    /// asked for one meanwhile.
    fn answered(&self, number: u64, answer: redis::RedisResult<bool>) -> Option<u64> {
        let mut checks = self.lock();
        let mut stolen = false;
        match answer {
            Ok(true) => checks.confirmed = checks.confirmed.max(number),
            // The run's own last release may be what the check found: it settles the run.
            Ok(false) | Err(_) if checks.ending => {}
            Ok(false) => {
                checks.stolen = true;
                stolen = true;
            }
            Err(error) => {
                tracing::debug!(lock = %self.ids.lock, %error, "a cohort's check failed");
                checks.failed = Some((number, error));
            }
        }
        let next = (checks.asked > checks.sent
            && !checks.stolen
            && checks.failed.is_none()
            && !checks.ending)
            .then(|| {
                checks.sent += 1;
                checks.sent
            });
        checks.in_flight = next.is_some();
        drop(checks);
        if stolen {
            tracing::debug!(lock = %self.ids.lock, "a cohort's run found its hold gone");
            self.lease.mark_lost();
        }
        self.moved.notify_waiters();
        next
    }

    /// The run's last release is about to be sent: from now on a check that finds the hold
    /// gone may be seeing it. That release's answer must [`end`](Self::ended_by) the run.
    pub(crate) fn ending(&self) {
        self.lock().ending = true;
    }

    /// The same, with a guard that settles the run with an error if it is dropped before
    /// that release answers (its runtime went away).
    pub(crate) fn ending_guarded(self: &Arc<Self>) -> Ending {
        self.ending();
        Ending {
            run: Some(self.clone()),
        }
    }

    /// Waits until a check numbered `number` or later answers (or the run's last release
    /// does): what it found. Never sends a command unless the check it waits for was lost
    /// with its runtime.
    pub(crate) async fn confirm(
        self: &Arc<Self>,
        number: u64,
        shut_down: &crate::holds::HoldList,
    ) -> Checked {
        let mut resent = 0;
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            // Registered before looking, so that an answer in between is not missed.
            moved.as_mut().enable();
            {
                let mut checks = self.lock();
                if checks.confirmed >= number {
                    return Checked::Held;
                }
                if shut_down.is_shut_down() {
                    return Checked::ShutDown;
                }
                if checks.stolen {
                    return Checked::Stolen;
                }
                if let Some((at, error)) = &checks.failed
                    && *at >= number
                {
                    return Checked::Failed(error.clone());
                }
                if !checks.in_flight && !checks.ending {
                    // The check was dropped with the runtime it ran on: send another.
                    if resent == 2 {
                        return Checked::Failed(redis::RedisError::from(std::io::Error::other(
                            "the cohort's check could not be sent",
                        )));
                    }
                    resent += 1;
                    checks.in_flight = true;
                    checks.sent += 1;
                    let again = checks.sent;
                    drop(checks);
                    self.send(again);
                    continue;
                }
            }
            tokio::select! {
                () = moved => {}
                () = shut_down.until_shut_down() => {}
            }
        }
    }
}

/// The run's last release on its way from the manager's runtime (see
/// [`CohortRun::ending_guarded`]), whose answer settles the run. Dropped before that (its runtime
/// went away), it tells the releases still waiting that the server's answer is unknown;
/// dropped after, it changes nothing (only the first answer counts).
#[derive(Debug)]
pub(crate) struct Ending {
    run: Option<Arc<CohortRun>>,
}

impl Drop for Ending {
    fn drop(&mut self) {
        if let Some(run) = self.run.take() {
            run.ended_by(Err(redis::RedisError::from(std::io::Error::other(
                "the release of the cohort's hold was abandoned before its answer",
            ))));
        }
    }
}

impl CohortRun {
    /// The run's last release answered: `true` when its token still held the lock then,
    /// which it did at every pass before; `false` when it was gone; an error when the server
    /// could not tell. Only the first answer counts.
    pub(crate) fn ended_by(&self, answer: redis::RedisResult<bool>) {
        let mut checks = self.lock();
        if checks.ended {
            return;
        }
        checks.ended = true;
        let mut stolen = false;
        match answer {
            Ok(true) => checks.confirmed = u64::MAX,
            Ok(false) => {
                checks.stolen = true;
                stolen = true;
            }
            Err(error) => checks.failed = Some((u64::MAX, error)),
        }
        drop(checks);
        if stolen {
            self.lease.mark_lost();
        }
        self.moved.notify_waiters();
    }
}

/// Sends check `number` of `run`, and the next ones its passes ask for meanwhile, one at a
/// time. Dropped midway (its runtime shut down), it leaves the run without a check in
/// flight, which the next release that waits for one sends again.
async fn check(run: Arc<CohortRun>, number: u64) {
    struct InFlight<'r>(Option<&'r CohortRun>);
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            if let Some(run) = self.0.take() {
                run.lock().in_flight = false;
                run.moved.notify_waiters();
            }
        }
    }
    let mut in_flight = InFlight(Some(&run));
    let mut number = number;
    loop {
        let answer = run.backend.is_held_plain(&run.ids).await;
        match run.answered(number, answer) {
            Some(next) => number = next,
            None => break,
        }
    }
    in_flight.0 = None;
}
