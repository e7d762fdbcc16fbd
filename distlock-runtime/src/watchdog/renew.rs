//! Sending renewals and settling their answers: batches of leases, several calls in flight,
//! each lease renewed, lost, or tried again soon.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{BATCH, Due, IN_FLIGHT, Leases, Renewals};
use crate::backend::{Backend, HoldIds, Renewal};
use crate::waiters::Waiters;

/// Renews `due`, [`BATCH`] leases per call, up to [`IN_FLIGHT`] calls at once (on Cluster,
/// each call goes to every node its leases are on, at once).
pub(super) async fn renew(shared: &Renewals, backend: &Backend, waiters: &Waiters, due: Vec<Due>) {
    use futures_util::StreamExt;
    let mut batches = due.chunks(BATCH);
    let mut in_flight = futures_util::stream::FuturesUnordered::new();
    loop {
        while in_flight.len() < IN_FLIGHT {
            let Some(batch) = batches.next() else {
                break;
            };
            in_flight.push(renew_batch(shared, backend, waiters, batch));
        }
        if in_flight.next().await.is_none() {
            return;
        }
    }
}

/// Renews one batch of due leases in one call.
async fn renew_batch(shared: &Renewals, backend: &Backend, waiters: &Waiters, batch: &[Due]) {
    {
        let sent = Instant::now();
        // What each lease renews, taken once: a nested hold's set may change meanwhile.
        let holds: Vec<Cow<'_, [Arc<HoldIds>]>> = batch.iter().map(|d| d.hold.all()).collect();
        let items: Vec<Renewal<'_>> = batch
            .iter()
            .zip(&holds)
            .flat_map(|(d, holds)| {
                holds.iter().map(|hold| Renewal {
                    lock: &hold.lock,
                    token: &hold.token,
                    lease: d.ttl,
                })
            })
            .collect();
        shared.counters.round_trips.fetch_add(1, Ordering::Relaxed);
        match backend.renew(&items).await {
            Ok(results) => {
                // Each lock of a lease found lost: its waiters here, queued behind its holder,
                // ask the server now (a key deleted under its holder announces nothing).
                for hold in apply_answers(shared, batch, &holds, results, sent) {
                    waiters.released(&hold.wake);
                }
            }
            // Try again soon; the local deadline reports the loss if Redis stays away.
            Err(error) => {
                tracing::warn!(%error, leases = batch.len(), "lease renewal failed");
                let mut leases = shared.lock();
                for lease in batch {
                    retry_soon(&mut leases, lease);
                }
            }
        }
    }
}

/// Applies to each lease of `batch` the answers to its holds' renewals (`None`: that
/// hold's slot did not answer, its master cut off or frozen, while other slots did). A lease
/// whose every hold answered is renewed or lost on those answers alone; one with an
/// unanswered hold and none refused is tried again soon, as if the whole call had failed:
/// one master's trouble never costs a lease on another.
fn apply_answers(
    shared: &Renewals,
    batch: &[Due],
    holds: &[Cow<'_, [Arc<HoldIds>]>],
    results: Vec<Option<bool>>,
    sent: Instant,
) -> Vec<Arc<HoldIds>> {
    let mut lost = Vec::new();
    let mut leases = shared.lock();
    let mut results = results.into_iter();
    let mut unanswered = 0;
    for (lease, holds) in batch.iter().zip(holds) {
        // A set's lease is renewed only if every one of its locks was.
        let count = holds.len();
        // (Every answer of this lease is taken: the next lease's follow.)
        let (mut renewed, mut refused, mut answered) = (true, false, 0);
        for one in results.by_ref().take(count) {
            match one {
                Some(yes) => {
                    renewed &= yes;
                    refused |= !yes;
                    answered += 1;
                }
                None => renewed = false,
            }
        }
        if !refused && answered < count {
            unanswered += 1;
            retry_soon(&mut leases, lease);
            continue;
        }
        let renewed = renewed && answered == count;
        // An answer after the local deadline finds the lease already lost.
        if renewed && lease.state.renewed(sent, lease.ttl) {
            shared.counters.renewed.fetch_add(1, Ordering::Relaxed);
            crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Renewed);
        } else if leases.remove(lease.id).is_some() {
            // (A lease released while its renewal was in flight is not lost.)
            tracing::warn!(lock = %lease.hold.lock(), renewed, "lease lost: renewal found another owner or no key, or came too late");
            // Marked first: a loss that is counted is already seen by the guard.
            lease.state.mark_lost();
            lost.extend(holds.iter().cloned());
            shared.counters.lost.fetch_add(1, Ordering::Release);
            crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Lost);
        } else if !renewed {
            // Released while this renewal was in flight, but the key was gone or another
            // owner's already: a holder the lease was passed on to must know.
            lease.state.mark_lost();
        }
    }
    if unanswered > 0 {
        tracing::warn!(
            leases = unanswered,
            "lease renewal failed on part of the cluster"
        );
    }
    lost
}

/// Plans the next renewal of `lease` soon: its renewal was not answered.
pub(super) fn retry_soon(leases: &mut Leases, lease: &Due) {
    crate::metrics::renewal(lease.metrics, crate::metrics::RenewalOutcome::Failed);
    if let Some(entry) = leases.by_id.get_mut(&lease.id) {
        let soon = (lease.ttl / 10).min(Duration::from_secs(1));
        entry.next_renewal = Instant::now() + soon;
        leases.reschedule(lease.id);
    }
}
