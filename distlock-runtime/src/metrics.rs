//! Metrics, through the [`metrics`](https://docs.rs/metrics) facade: install any recorder
//! (a Prometheus, StatsD or OpenTelemetry exporter) and these appear in it.
//!
//! Recorded only with the `metrics` feature (`distlock/metrics`); without it every hook here
//! compiles to nothing. Every metric carries two labels:
//!
//! * `template`: the key *template* the request was made from, `order:{id}` for
//!   `#[distributed_lock(key = "order:{id}")]`, the name given with
//!   [`LockRequest::label`](crate::LockRequest::label), or `<manual>`. Never the key itself,
//!   so the number of series stays small whatever the keys are.
//! * `kind`: `exclusive`, `read`, `write` or `semaphore`.
//!
//! | name | type | extra labels | meaning |
//! |---|---|---|---|
//! | `distlock_acquire_attempts_total` | counter | | attempts sent to Redis |
//! | `distlock_acquires_total` | counter | `outcome` | requests that ended: `acquired`, `busy` (not taken within its bounds), `refused` (would deadlock, upgrade, permits mismatch), `shutdown` (the manager was shut down), `error` (Redis failed) |
//! | `distlock_acquire_wait_seconds` | histogram | `outcome` | time from the request to its outcome |
//! | `distlock_hold_seconds` | histogram | | time from acquisition to release (or drop); a set of locks is one hold, of kind `exclusive` (a key it re-entered is a hold of its own) |
//! | `distlock_lost_total` | counter | | holds that ended with their lease lost, as [`LockGuard::is_lost`](crate::LockGuard::is_lost) tells (not those given back by shutdown) |
//! | `distlock_renewals_total` | counter | `outcome` | watchdog renewals of one lease: `renewed`, `lost` (another owner or no key), `failed` (Redis failed; retried) |
//! | `distlock_renewals_late_total` | counter | | watchdog renewals sent with less than half of their lease left: renewal is falling behind, and leases will be lost if it goes on (a warning is logged too) |
//! | `distlock_handoffs_total` | counter | | locks taken by a request that had queued for them: a release (or an expiry) handed the lock to a waiter |
//! | `distlock_waiting` | gauge | | requests waiting in the manager's queue for a busy lock |
//! | `distlock_elections_won_total` | counter | `election` (only) | campaigns that made this process leader |
//! | `distlock_elections_lost_total` | counter | `election` (only) | leaderships that ended lost (lease, steal, shutdown) rather than resigned |
//! | `distlock_election_term` | gauge | `election` (only) | the term this process last led |
//!
//! Descriptions and units are registered on the first request, or by [`describe`] after
//! installing a recorder.

use std::time::Instant;

#[cfg(feature = "metrics")]
use crate::error::LockError;
use crate::kind::RequestKind;

/// Counter: attempts sent to Redis.
pub const ACQUIRE_ATTEMPTS: &str = "distlock_acquire_attempts_total";
/// Counter: requests that ended, by `outcome` (`acquired`, `busy`, `refused`, `shutdown`,
/// `error`).
pub const ACQUIRES: &str = "distlock_acquires_total";
/// Histogram, seconds: time from the request to its outcome, by `outcome`.
pub const ACQUIRE_WAIT: &str = "distlock_acquire_wait_seconds";
/// Histogram, seconds: time from acquisition to release (or drop).
pub const HOLD: &str = "distlock_hold_seconds";
/// Counter: holds that ended with their lease lost (see [`LockGuard::is_lost`](crate::LockGuard::is_lost)).
pub const LOST: &str = "distlock_lost_total";
/// Counter: watchdog renewals of one lease, by `outcome` (`renewed`, `lost`, `failed`).
pub const RENEWALS: &str = "distlock_renewals_total";
/// Counter: watchdog renewals sent with less than half of their lease left.
pub const RENEWALS_LATE: &str = "distlock_renewals_late_total";
/// Counter: locks taken by a request that had queued for them.
pub const HANDOFFS: &str = "distlock_handoffs_total";
/// Gauge: requests waiting in the manager's queue for a busy lock.
pub const WAITING: &str = "distlock_waiting";
/// Counter, labelled by `election`: campaigns won.
pub const ELECTIONS_WON: &str = "distlock_elections_won_total";
/// Counter, labelled by `election`: leaderships lost rather than resigned.
pub const ELECTIONS_LOST: &str = "distlock_elections_lost_total";
/// Gauge, labelled by `election`: the term this process last led.
pub const ELECTION_TERM: &str = "distlock_election_term";

/// Registers the description and unit of every metric above with the installed recorder.
///
/// Done on the first request anyway; call it after installing a recorder that should know
/// them before any lock is taken. Does nothing without the `metrics` feature.
pub fn describe() {
    #[cfg(feature = "metrics")]
    {
        use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
        describe_counter!(ACQUIRE_ATTEMPTS, "Lock attempts sent to Redis.");
        describe_counter!(ACQUIRES, "Lock requests that ended, by outcome.");
        describe_histogram!(
            ACQUIRE_WAIT,
            Unit::Seconds,
            "Time from a lock request to its outcome."
        );
        describe_histogram!(HOLD, Unit::Seconds, "Time from acquisition to release.");
        describe_counter!(LOST, "Holds that ended with their lease lost.");
        describe_counter!(RENEWALS, "Watchdog renewals of one lease, by outcome.");
        describe_counter!(
            RENEWALS_LATE,
            "Watchdog renewals sent with less than half of their lease left."
        );
        describe_counter!(
            HANDOFFS,
            "Locks taken by a request that had queued for them."
        );
        describe_gauge!(WAITING, "Requests waiting for a busy lock.");
        describe_counter!(ELECTIONS_WON, "Campaigns that made this process leader.");
        describe_counter!(ELECTIONS_LOST, "Leaderships lost rather than resigned.");
        describe_gauge!(ELECTION_TERM, "The term this process last led.");
    }
}

/// This process leads `election` in `term`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn election_won(election: &str, term: u64) {
    #[cfg(feature = "metrics")]
    {
        let label = [("election", election.to_owned())];
        metrics::counter!(ELECTIONS_WON, &label).increment(1);
        metrics::gauge!(ELECTION_TERM, &label).set(term as f64);
    }
}

/// This process's leadership of `election` ended; `lost` unless it was resigned.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn election_ended(election: &str, lost: bool) {
    #[cfg(feature = "metrics")]
    if lost {
        metrics::counter!(ELECTIONS_LOST, &[("election", election.to_owned())]).increment(1);
    }
}

/// The labels of one request: its key template and lock kind (in metrics and in spans).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Labels {
    template: &'static str,
    kind: &'static str,
}

impl Labels {
    pub(crate) fn new(template: &'static str, kind: RequestKind) -> Self {
        #[cfg(feature = "metrics")]
        {
            static DESCRIBED: std::sync::Once = std::sync::Once::new();
            DESCRIBED.call_once(describe);
        }
        let kind = match kind {
            RequestKind::Exclusive => "exclusive",
            RequestKind::Read => "read",
            RequestKind::Write => "write",
            RequestKind::Permits(_) => "semaphore",
        };
        Self { template, kind }
    }

    /// The key template.
    pub(crate) fn template(&self) -> &'static str {
        self.template
    }

    /// The lock kind: `exclusive`, `read`, `write` or `semaphore`.
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }
}

#[cfg(feature = "metrics")]
macro_rules! labelled {
    ($macro:ident, $name:expr, $labels:expr $(, $key:literal => $value:expr)*) => {
        metrics::$macro!(
            $name,
            "template" => $labels.template,
            "kind" => $labels.kind
            $(, $key => $value)*
        )
    };
}

/// When a request started; nothing without the feature.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timer {
    #[cfg(feature = "metrics")]
    started: Instant,
}

impl Timer {
    pub(crate) fn start() -> Self {
        Self {
            #[cfg(feature = "metrics")]
            started: Instant::now(),
        }
    }
}

/// One attempt is about to be sent.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn attempt(labels: Labels) {
    #[cfg(feature = "metrics")]
    labelled!(counter, ACQUIRE_ATTEMPTS, labels).increment(1);
}

/// A request ended with `result`, `timer` after it started.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn acquire_ended<T>(
    labels: Labels,
    timer: Timer,
    result: &Result<T, crate::error::LockError>,
) {
    #[cfg(feature = "metrics")]
    {
        let outcome = match result {
            Ok(_) => "acquired",
            Err(LockError::Busy { .. }) => "busy",
            Err(
                LockError::WouldDeadlock { .. }
                | LockError::Upgrade { .. }
                | LockError::PermitsMismatch { .. },
            ) => "refused",
            Err(LockError::ShutDown) => "shutdown",
            Err(_) => "error",
        };
        labelled!(counter, ACQUIRES, labels, "outcome" => outcome).increment(1);
        labelled!(histogram, ACQUIRE_WAIT, labels, "outcome" => outcome)
            .record(timer.started.elapsed());
    }
}

/// A hold acquired at `since` ended (released or dropped); `lost` if its lease was lost.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn hold_ended(labels: Labels, since: Instant, lost: bool) {
    #[cfg(feature = "metrics")]
    {
        labelled!(histogram, HOLD, labels).record(since.elapsed());
        if lost {
            labelled!(counter, LOST, labels).increment(1);
        }
    }
}

/// The outcome of one lease's renewal.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RenewalOutcome {
    Renewed,
    Lost,
    Failed,
}

/// The watchdog renewed (or tried to renew) one lease.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn renewal(labels: Labels, outcome: RenewalOutcome) {
    #[cfg(feature = "metrics")]
    {
        let outcome = match outcome {
            RenewalOutcome::Renewed => "renewed",
            RenewalOutcome::Lost => "lost",
            RenewalOutcome::Failed => "failed",
        };
        labelled!(counter, RENEWALS, labels, "outcome" => outcome).increment(1);
    }
}

/// The watchdog sent one lease's renewal late (less than half of the lease left).
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn renewal_late(labels: Labels) {
    #[cfg(feature = "metrics")]
    labelled!(counter, RENEWALS_LATE, labels).increment(1);
}

/// A request took its lock; `queued` if it had waited in the manager's queue for it.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn handed_over(labels: Labels, queued: bool) {
    #[cfg(feature = "metrics")]
    if queued {
        labelled!(counter, HANDOFFS, labels).increment(1);
    }
}

/// Counts one waiting request while it lives.
#[derive(Debug)]
pub(crate) struct Waiting {
    #[cfg(feature = "metrics")]
    labels: Labels,
}

impl Waiting {
    pub(crate) fn new(labels: Labels) -> Self {
        #[cfg(feature = "metrics")]
        labelled!(gauge, WAITING, labels).increment(1.0);
        let _ = labels;
        Self {
            #[cfg(feature = "metrics")]
            labels,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        labelled!(gauge, WAITING, self.labels).decrement(1.0);
    }
}
