//! The history and its rules: who is inside which key, and every check made on an entry,
//! a fence, a term or a free stretch.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::model::{Kind, ORPHANED, PERMITS, RECOVERY, RUN_AFTER_STEAL, STARVED};

/// What the history reads of a granted hold: a `LockGuard`'s, or a set's hold of one of its
/// keys.
pub(super) trait Granted {
    fn token(&self) -> &str;
    fn remaining(&self) -> Duration;
    fn local_passes(&self) -> u32;
    fn fencing_token(&self) -> Option<u64>;
    fn ttl(&self) -> Duration;
    fn waited(&self) -> Duration;
    /// Whether entering it counts as an acquisition (a set counts once, not once per key).
    fn counts(&self) -> bool {
        true
    }
}

/// Everything the programs did that the checker cares about.
#[derive(Default)]
pub(super) struct History {
    pub(super) state: Mutex<State>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) holders: HashMap<String, Vec<Holder>>,
    pub(super) next_id: u64,
    pub(super) violations: Vec<String>,
    /// The latest events, to show around a violation.
    pub(super) recent: VecDeque<String>,
    pub(super) acquisitions: u64,
    pub(super) faults: u64,
    pub(super) lease_checks: u64,
    /// A failover happened here: grants made before it may have been lost with the old
    /// master, which the topology does not promise to survive.
    pub(super) void_before: Option<Instant>,
    pub(super) excused: u64,
    /// Keys that must stay held until a `min_hold` ends (one asked for by a hold nested in a
    /// set, say), by whom: nobody else may enter them before.
    pub(super) kept: HashMap<String, (String, Instant)>,
    pub(super) min_holds_kept: u64,
    /// Requests sleeping in `acquire()` right now, by id: their keys (several for a set,
    /// which can only enter once every one is free), since when, who.
    pub(super) waiting: HashMap<u64, (Vec<String>, Instant, String)>,
    pub(super) next_waiter: u64,
    /// When a key was last entered.
    pub(super) last_entry: HashMap<String, Instant>,
    /// Injected faults: from, until (`None` while it lasts).
    pub(super) fault_windows: Vec<(Instant, Option<Instant>)>,
    /// The fault windows (by index) that cannot stop a release from arriving (attempts held
    /// back past their retry, the network passing everything after): they allow no key to
    /// stay owned by a token whose release was answered.
    pub(super) passing_faults: Vec<usize>,
    /// Owner tokens whose every release so far was answered `Ok` (`true`), or not (`false`:
    /// one was dropped, cancelled or failed, and its lease may run out on its own).
    pub(super) released: HashMap<String, bool>,
    /// Tokens seen owning a key after their every release was answered (a local pass on its
    /// way, an attempt that landed late), whether or not for too long.
    pub(super) owned_after_release: std::collections::HashSet<String>,
    /// The longest stretch one of them was seen owning its key.
    pub(super) longest_owned_after_release: Duration,
    /// Stretches in which the monitor's own timer fired late by more than `STALL`: the
    /// process (its runtime, or the whole machine) did not run, and neither did the waiters.
    pub(super) stalls: Vec<(Instant, Instant)>,
    /// The longest lease each live owner asked for (its holds' `ttl`, its extends).
    pub(super) lease_caps: HashMap<String, Duration>,
    pub(super) liveness_samples: u64,
    pub(super) steals: u64,
    pub(super) elections: u64,
    /// Entries by a cohort's local pass (no server command).
    pub(super) local_passes: u64,
    /// Sets entered (each one acquisition), and the keys they held.
    pub(super) sets: u64,
    pub(super) set_keys: u64,
    /// Holds taken away from their holders, by token: when, and the steal's round trip.
    pub(super) robbed: HashMap<String, (Instant, Duration)>,
    /// Each key's fencing tokens, and when their holds left (see `History::fenced`).
    pub(super) fences: HashMap<String, Vec<(u64, Option<Instant>)>>,
    /// Each election's terms, and when their leaders left.
    pub(super) terms: HashMap<String, Vec<(u64, Option<Instant>)>>,
}

pub(super) struct Holder {
    pub(super) id: u64,
    pub(super) owner: String,
    /// The owner and its place in a cohort's run: holders one after another that share a
    /// server hold (and so its token) by local passes are different holders.
    pub(super) holder: String,
    pub(super) kind: Kind,
    pub(super) entered: Instant,
    pub(super) valid_until: Instant,
    /// The fencing token this hold drew (not for a nested hold, which carries its outer's).
    pub(super) fence: Option<u64>,
    /// Whether the key's PTTL is bounded by this owner's own requests (not for fair grants,
    /// which may carry another manager's claim window).
    pub(super) capped: bool,
}

impl History {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn violation(&self, what: String) {
        let mut state = self.lock();
        let recent: Vec<String> = state.recent.iter().cloned().collect();
        state.violations.push(format!(
            "{what}\n  recent events:\n    {}",
            recent.join("\n    ")
        ));
    }

    /// `guard` was just granted, for a request made at `asked`: check it against everyone
    /// inside, and record it there under the id this returns. The fencing check compares with the holds that left before the request was
    /// made (not before the guard's `waited()`, which is fixed when the guard is built: a
    /// starved task may enter here well after, and more than the acquisition may stand
    /// between the two, as when a campaign announces its leader after taking the lock).
    pub(super) fn admit(
        &self,
        who: &str,
        key: &str,
        kind: Kind,
        guard: &impl Granted,
        asked: Instant,
    ) -> u64 {
        let now = Instant::now();
        let valid_until = now + guard.remaining();
        let owner = guard.token().to_owned();
        let holder = format!("{owner}#{}", guard.local_passes());
        let mut state = self.lock();
        state.acquisitions += u64::from(guard.counts());
        state.local_passes += u64::from(guard.local_passes() > 0);
        let event = format!(
            "{:?} #{} {who} enters {key} as {kind:?} (owner {}, valid {:?})",
            now,
            state.next_id,
            &owner[owner.len() - 8..],
            guard.remaining()
        );
        push_recent(&mut state, event);
        let conflict = conflict(&mut state, key, kind, &owner, &holder, now);
        // A hold's own fencing token: a nested hold (its owner already inside) carries the
        // outer hold's.
        let nested = state
            .holders
            .get(key)
            .is_some_and(|holders| holders.iter().any(|h| h.owner == owner));
        let fence = guard.fencing_token().filter(|_| !nested);
        let id = state.next_id;
        state.next_id += 1;
        state.last_entry.insert(key.to_owned(), now);
        // A local pass continues the server hold it was given, and sends nothing: a hold
        // taken away goes on being passed until the run's check answers (about a round trip).
        // Those holders are the robbed hold, out of the history like its first holder; the
        // run must stop in time.
        if guard.local_passes() > 0
            && let Some(&(stolen, round_trip)) = state.robbed.get(&owner)
        {
            state.excused += 1;
            drop(state);
            let after = now.duration_since(stolen);
            let bound = round_trip + RUN_AFTER_STEAL + self.allowance(stolen, now);
            if after > bound {
                self.violation(format!(
                    "cohort: {who} entered {key} by a local pass of a hold taken away {after:?} \
                     before (bound {bound:?}: a round trip of {round_trip:?} and the slack)"
                ));
            }
            return id;
        }
        // A hold taken away is lost for good: no acquire nested in it may be granted.
        if let Some(&(stolen, _)) = state.robbed.get(&owner) {
            drop(state);
            self.violation(format!(
                "lost: {who} was granted {key} as {kind:?} by a nested acquire of a hold taken \
                 away {:?} before (a refusal, `LockError::Lost`, is required)",
                now.saturating_duration_since(stolen)
            ));
            state = self.lock();
        }
        let cap = state.lease_caps.entry(owner.clone()).or_default();
        *cap = (*cap).max(guard.ttl());
        state
            .holders
            .entry(key.to_owned())
            .or_default()
            .push(Holder {
                id,
                owner,
                holder,
                kind,
                entered: now,
                valid_until,
                fence,
                capped: matches!(kind, Kind::Exclusive | Kind::Write),
            });
        drop(state);
        if let Some(conflict) = conflict {
            self.violation(format!("overlap: {who}: {conflict}"));
        }
        if let Some(fence) = fence {
            let began = now - guard.waited();
            self.fenced(who, key, fence, asked.min(began));
        }
        id
    }

    /// `owner` asked for a `min_hold` on `key` that lasts until `until` (counted from no later
    /// than the server counts it): nobody else may enter the key before, whatever is released.
    pub(super) fn min_hold(&self, key: &str, owner: &str, until: Instant) {
        let mut state = self.lock();
        state.min_holds_kept += 1;
        let kept = state.kept.entry(key.to_owned());
        let kept = kept.or_insert_with(|| (owner.to_owned(), until));
        if kept.1 < until {
            *kept = (owner.to_owned(), until);
        }
    }

    /// A new leader of the election whose lock is `key` has `term`: larger than the term of
    /// every leader that had left before this one began to campaign (`asked`), unless a
    /// failover may have lost the counter.
    pub(super) fn term(&self, who: &str, key: &str, term: u64, asked: Instant) {
        let mut state = self.lock();
        let failed_over = state.void_before.is_some();
        let terms = state.terms.entry(key.to_owned()).or_default();
        let earlier = terms
            .iter()
            .filter(|(_, left)| left.is_some_and(|left| left < asked))
            .map(|(t, _)| *t)
            .max()
            .unwrap_or(0);
        terms.push((term, None));
        state.elections += 1;
        drop(state);
        if term <= earlier && !failed_over {
            self.violation(format!(
                "term: {who} leads {key} in term {term}, not above the earlier {earlier}"
            ));
        }
    }

    /// A hold of `key` drew fencing token `fence`: larger than the token of every hold of the
    /// key that had left before this request began (`asked`), unless a failover may have lost
    /// the counter. (Holds that overlap in time, such as readers, may draw in either order.)
    pub(super) fn fenced(&self, who: &str, key: &str, fence: u64, asked: Instant) {
        let mut state = self.lock();
        let failed_over = state.void_before.is_some();
        let fences = state.fences.entry(key.to_owned()).or_default();
        let earlier = fences
            .iter()
            .filter(|(_, left)| left.is_some_and(|left| left < asked))
            .map(|(f, _)| *f)
            .max()
            .unwrap_or(0);
        fences.push((fence, None));
        drop(state);
        if fence <= earlier && !failed_over {
            self.violation(format!(
                "fencing: {who} holds {key} with token {fence}, not above the earlier {earlier}"
            ));
        }
    }

    /// The leader of `key` in `term` has left.
    pub(super) fn left(&self, key: &str, term: u64) {
        let mut state = self.lock();
        if let Some(entry) = state
            .terms
            .get_mut(key)
            .and_then(|terms| terms.iter_mut().find(|(t, _)| *t == term))
        {
            entry.1 = Some(Instant::now());
        }
    }

    /// The fault allowance of a free stretch from `from` to `to`: how much of it lies in a
    /// fault window or the recovery after one, or in a stall the monitor measured on itself
    /// (their union, each moment counted once).
    pub(super) fn allowance(&self, from: Instant, to: Instant) -> Duration {
        self.allowance_of(from, to, true)
    }

    /// As [`History::allowance`], counting the fault windows that can stop a release only
    /// unless `every_fault` (see `State::passing_faults`).
    fn allowance_of(&self, from: Instant, to: Instant, every_fault: bool) -> Duration {
        let state = self.lock();
        let faults = (state.fault_windows.iter().enumerate())
            .filter(|(at, _)| every_fault || !state.passing_faults.contains(at))
            .map(|(_, (start, end))| (*start, end.unwrap_or(to) + RECOVERY));
        let mut windows: Vec<(Instant, Instant)> = faults
            .chain(state.stalls.iter().copied())
            .filter(|(start, end)| *start < to && *end > from)
            .map(|(start, end)| (start.max(from), end.min(to)))
            .collect();
        windows.sort();
        let mut covered = Duration::ZERO;
        let mut reached = from;
        for (start, end) in windows {
            let start = start.max(reached);
            if end > start {
                covered += end - start;
                reached = end;
            }
        }
        covered
    }

    /// A release of `owner`'s hold has come back: `answered` when it was answered `Ok`.
    pub(super) fn released(&self, owner: &str, answered: bool) {
        let mut state = self.lock();
        let sure = state.released.entry(owner.to_owned()).or_insert(true);
        *sure &= answered;
    }

    /// A plain lock has been owned since `since` by `owner`, a token no holder has: a
    /// violation once that lasts longer than `ORPHANED` (plus the stalls it overlaps), if
    /// every release of `owner` was answered `Ok` and no fault that can stop a release (nor
    /// the recovery after one) overlaps the stretch: then nothing of `owner` may still be on
    /// its way (an attempt that landed after its retry was granted and released is given back
    /// once no late delivery can happen). A token never released, or whose release went
    /// unanswered, or whose release behind a local pass met a fault, may keep the key until
    /// its lease ends.
    pub(super) fn orphaned(&self, key: &str, owner: &str, since: Instant, now: Instant) -> bool {
        let stretch = now.saturating_duration_since(since);
        {
            let mut state = self.lock();
            if state.released.get(owner) != Some(&true) {
                return false;
            }
            let stopping = (state.fault_windows.iter().enumerate())
                .filter(|(at, _)| !state.passing_faults.contains(at))
                .any(|(_, (start, end))| *start < now && end.is_none_or(|e| e + RECOVERY > since));
            if stopping {
                return false;
            }
            state.owned_after_release.insert(owner.to_owned());
            state.longest_owned_after_release = state.longest_owned_after_release.max(stretch);
        }
        let allowed = self.allowance_of(since, now, false);
        if stretch <= ORPHANED + allowed {
            return false;
        }
        self.violation(format!(
            "orphan: {key} owned for {stretch:?} by {}, whose every release was answered, \
             outside any fault that can stop a release ({allowed:?} of it in stalls or in \
             faults that cannot)",
            &owner[owner.len().saturating_sub(8)..]
        ));
        true
    }

    /// Without faults, a plain lock owned since `since` by `owner`, a token no holder has,
    /// for longer than `ORPHANED`: a violation (a release on its way, or a fair grant to a
    /// waiter that left, ends sooner).
    pub(super) fn orphaned_without_faults(
        &self,
        key: &str,
        owner: &str,
        since: Instant,
        now: Instant,
    ) -> bool {
        let stretch = now.saturating_duration_since(since);
        if stretch <= ORPHANED {
            return false;
        }
        self.violation(format!(
            "orphan: {key} held by {} for {stretch:?}, a token no holder has",
            &owner[owner.len().saturating_sub(8)..],
        ));
        true
    }

    /// `key`'s PTTL (sampled at `sampled`) outlives what its live exclusive owner asked for
    /// (its lease cap): a renewal or an extend after the hold was lost would prolong it.
    pub(super) fn prolonged(&self, key: &str, pttl: Option<i64>, sampled: Instant, now: Instant) {
        let state = self.lock();
        let capped: Vec<(String, Duration)> = state
            .holders
            .get(key)
            .into_iter()
            .flatten()
            .filter(|h| h.capped && h.valid_until > now && h.entered < sampled)
            .map(|h| {
                (
                    h.owner.clone(),
                    state.lease_caps.get(&h.owner).copied().unwrap_or_default(),
                )
            })
            .collect();
        drop(state);
        if let (Some(pttl), Some((owner, cap))) = (pttl, capped.first())
            && capped.iter().all(|(o, _)| o == owner)
            && u128::try_from(pttl).is_ok_and(|ms| ms > cap.as_millis() + 50)
        {
            self.violation(format!(
                "lease: {key}'s PTTL is {pttl} ms while its holder {} asked for at most {cap:?}",
                &owner[owner.len() - 8..]
            ));
        }
    }

    /// A set sleeping in `acquire()` can only enter once every one of its keys is free: all of them
    /// free in Redis together (`free`, from the monitor's samples), none entered by anybody, for
    /// longer than `STARVED` plus the fault allowance, is a liveness violation. Keys judged are
    /// taken out of `free` (their stretch starts again).
    pub(super) fn starved_sets(&self, free: &mut HashMap<&'static str, Instant>, now: Instant) {
        let state = self.lock();
        let mut stretches = Vec::new();
        for (keys, since, who) in state.waiting.values().filter(|(keys, _, _)| keys.len() > 1) {
            let mut from = Some(*since);
            for key in keys {
                let entered = state.last_entry.get(key).copied();
                from = match (from, free.get(key.as_str())) {
                    (Some(from), Some(&free)) => Some(from.max(free).max(entered.unwrap_or(from))),
                    _ => None,
                };
            }
            if let Some(from) = from {
                stretches.push((keys.clone(), from, *since, who.clone()));
            }
        }
        drop(state);
        for (keys, from, since, who) in stretches {
            let starved = now.saturating_duration_since(from);
            let allowed = self.allowance(from, now);
            if starved > STARVED && starved > STARVED + allowed {
                self.violation(format!(
                    "liveness: {keys:?} all free in Redis for {starved:?}, entered by nobody, while \
                     the set {who} waited for them (since {:?} ago; {allowed:?} of it in faults or \
                     stalls)",
                    since.elapsed()
                ));
                for key in &keys {
                    free.remove(key.as_str());
                }
            }
        }
    }

    /// `key` has been free in Redis since `free` (the monitor's samples): if a request sleeps
    /// in `acquire()` for it, and nobody entered it, for longer than `STARVED` plus the fault
    /// allowance, that is a liveness violation.
    pub(super) fn starved(&self, key: &str, free: Instant, now: Instant) -> Judged {
        let state = self.lock();
        let oldest_waiter = state
            .waiting
            .values()
            .filter(|(keys, _, _)| keys.len() == 1 && keys[0] == key)
            .min_by_key(|(_, since, _)| *since)
            .map(|(_, since, who)| (*since, who.clone()));
        let Some((waiting_since, who)) = oldest_waiter else {
            return Judged::NobodyWaits;
        };
        let last_entry = state.last_entry.get(key).copied();
        drop(state);
        let from = [Some(free), Some(waiting_since), last_entry]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(free);
        let starved = now.saturating_duration_since(from);
        let allowed = self.allowance(from, now);
        if starved > STARVED && starved > STARVED + allowed {
            self.violation(format!(
                "liveness: {key} free in Redis for {starved:?}, entered by nobody, while {who} \
                 waited for it (since {:?} ago; {allowed:?} of it in faults or stalls)",
                now.saturating_duration_since(waiting_since)
            ));
            return Judged::Starved;
        }
        Judged::Fine
    }

    pub(super) fn report(&self, seed: u64, topology: &str) {
        let state = self.lock();
        println!(
            "history [{topology}] seed {seed}: {} acquisitions ({} by local pass, {} sets of {} \
             keys, {} leaders elected, {} min_holds nested in sets), {} lease checks, {} steals, {} liveness samples ({} \
             stalls of the monitor, {:?} in all), {} faults injected ({} holding attempts back past \
             their retry; {} tokens seen owning a key after their release was answered, for {:?} \
             at most), {} violations{}",
            state.acquisitions,
            state.local_passes,
            state.sets,
            state.set_keys,
            state.elections,
            state.min_holds_kept,
            state.lease_checks,
            state.steals,
            state.liveness_samples,
            state.stalls.len(),
            state
                .stalls
                .iter()
                .map(|(from, to)| *to - *from)
                .sum::<Duration>(),
            state.faults,
            state.passing_faults.len(),
            state.owned_after_release.len(),
            state.longest_owned_after_release,
            state.violations.len(),
            match state.void_before {
                Some(_) => format!(
                    " (a failover happened: {} holders granted before it not counted)",
                    state.excused
                ),
                None => String::new(),
            }
        );
        if !state.violations.is_empty() {
            let shown: Vec<&String> = state.violations.iter().take(4).collect();
            panic!(
                "history [{topology}]: {} violations (replay with DISTLOCK_SEED={seed}); the first:\n{}",
                state.violations.len(),
                shown
                    .iter()
                    .map(|v| v.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}

/// Whether an entry of `key` as `kind` by `holder` (of `owner`) at `now` conflicts with
/// anyone inside: a holder of a kind it does not overlap with, a `min_hold` of someone else
/// not over yet, or all the permits taken. Holders a failover may have voided are counted as
/// excused instead.
fn conflict(
    state: &mut State,
    key: &str,
    kind: Kind,
    owner: &str,
    holder: &str,
    now: Instant,
) -> Option<String> {
    let void_before = state.void_before;
    let lost_in_failover = |h: &Holder| void_before.is_some_and(|at| h.entered < at);
    let excused = state
        .holders
        .get(key)
        .into_iter()
        .flatten()
        .filter(|h| h.holder != holder && h.valid_until > now && lost_in_failover(h))
        .count();
    state.excused += excused as u64;
    // Every grant is checked, a nested one too: a nested acquire of a hold that ran out,
    // was lost or was taken away must be refused, not granted with nothing left.
    let live: Vec<(Kind, String)> = state
        .holders
        .get(key)
        .into_iter()
        .flatten()
        .filter(|h| h.holder != holder && h.valid_until > now && !lost_in_failover(h))
        .map(|h| (h.kind, h.holder.clone()))
        .collect();
    let mut conflict = live
        .iter()
        .find(|(other, _)| !kind.overlaps(*other))
        .map(|(other, o)| {
            format!(
                "{kind:?} entered {key} while {other:?} {} held it",
                &o[o.len() - 8..]
            )
        });
    if let Some((keeper, until)) = state.kept.get(key)
        && *until > now
        && *keeper != owner
        && void_before.is_none()
        && conflict.is_none()
    {
        conflict = Some(format!(
            "{kind:?} entered {key} {:?} before the end of the min_hold {} asked for",
            *until - now,
            &keeper[keeper.len() - 8..]
        ));
    }
    if kind == Kind::Permit && conflict.is_none() {
        let mut owners: Vec<&String> = live.iter().map(|(_, o)| o).collect();
        owners.sort();
        owners.dedup();
        if owners.len() >= PERMITS as usize {
            conflict = Some(format!(
                "permit {} on {key} entered beside {} other holders (N = {PERMITS})",
                &owner[owner.len() - 8..],
                owners.len()
            ));
        }
    }
    conflict
}

/// What `History::starved` found of a free key.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Judged {
    /// Nobody sleeps waiting for it.
    NobodyWaits,
    /// A waiter sleeps, for no longer than the bound so far.
    Fine,
    /// A waiter slept past the bound: a violation was recorded.
    Starved,
}

pub(super) fn push_recent(state: &mut State, event: String) {
    if state.recent.len() == 40 {
        state.recent.pop_front();
    }
    state.recent.push_back(event);
}

#[cfg(test)]
mod tests;
