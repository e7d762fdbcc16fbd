//! The checker's own rules, on synthetic event streams: no server is involved.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

/// A grant as the history reads it, made up.
struct Fake {
    token: String,
    remaining: Duration,
    passes: u32,
    fence: Option<u64>,
}

impl Fake {
    fn owner(token: &str) -> Self {
        Self {
            token: format!("{token:0>12}"),
            remaining: Duration::from_secs(5),
            passes: 0,
            fence: None,
        }
    }
}

impl Granted for Fake {
    fn token(&self) -> &str {
        &self.token
    }
    fn remaining(&self) -> Duration {
        self.remaining
    }
    fn local_passes(&self) -> u32 {
        self.passes
    }
    fn fencing_token(&self) -> Option<u64> {
        self.fence
    }
    fn ttl(&self) -> Duration {
        Duration::from_secs(5)
    }
    fn waited(&self) -> Duration {
        Duration::ZERO
    }
}

fn violations(history: &History) -> Vec<String> {
    history.lock().violations.clone()
}

#[test]
fn holders_one_after_another_and_readers_together_are_accepted() {
    let history = Arc::new(History::default());
    let first = history.enter(
        "one",
        "a",
        Kind::Exclusive,
        &Fake::owner("x"),
        Instant::now(),
    );
    drop(first);
    let second = history.enter(
        "two",
        "a",
        Kind::Exclusive,
        &Fake::owner("y"),
        Instant::now(),
    );
    drop(second);
    let r1 = history.enter("r1", "b", Kind::Read, &Fake::owner("r"), Instant::now());
    let r2 = history.enter("r2", "b", Kind::Read, &Fake::owner("s"), Instant::now());
    // A nested hold of the same owner is no conflict with itself.
    let outer = history.enter(
        "outer",
        "c",
        Kind::Exclusive,
        &Fake::owner("z"),
        Instant::now(),
    );
    let nested = history.enter(
        "nested",
        "c",
        Kind::Exclusive,
        &Fake::owner("z"),
        Instant::now(),
    );
    drop((r1, r2, outer, nested));
    assert_eq!(violations(&history), Vec::<String>::new());
}

#[test]
fn an_overlap_of_conflicting_holders_is_rejected() {
    let history = Arc::new(History::default());
    let _reader = history.enter("reader", "a", Kind::Read, &Fake::owner("x"), Instant::now());
    let _writer = history.enter(
        "writer",
        "a",
        Kind::Write,
        &Fake::owner("y"),
        Instant::now(),
    );
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("overlap:"), "{found:?}");
}

#[test]
fn an_expired_holder_conflicts_with_nobody() {
    let history = Arc::new(History::default());
    let gone = Fake {
        remaining: Duration::ZERO,
        ..Fake::owner("x")
    };
    let _old = history.enter("old", "a", Kind::Exclusive, &gone, Instant::now());
    let _new = history.enter(
        "new",
        "a",
        Kind::Exclusive,
        &Fake::owner("y"),
        Instant::now(),
    );
    assert_eq!(violations(&history), Vec::<String>::new());
}

#[test]
fn a_stale_fence_is_rejected() {
    let history = Arc::new(History::default());
    let first = Fake {
        fence: Some(5),
        ..Fake::owner("x")
    };
    drop(history.enter("one", "a", Kind::Exclusive, &first, Instant::now()));
    let asked = Instant::now();
    let larger = Fake {
        fence: Some(6),
        ..Fake::owner("y")
    };
    drop(history.enter("two", "a", Kind::Exclusive, &larger, asked));
    assert_eq!(violations(&history), Vec::<String>::new());
    let asked = Instant::now();
    let stale = Fake {
        fence: Some(6),
        ..Fake::owner("z")
    };
    drop(history.enter("three", "a", Kind::Exclusive, &stale, asked));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("fencing:"), "{found:?}");
}

#[test]
fn a_term_not_above_a_leader_that_left_before_the_campaign_is_rejected() {
    let history = History::default();
    history.term("one", "e", 3, Instant::now());
    history.left("e", 3);
    // A campaign that began after term 3 ended must draw a larger term.
    history.term("two", "e", 4, Instant::now());
    assert_eq!(violations(&history), Vec::<String>::new());
    history.left("e", 4);
    history.term("three", "e", 4, Instant::now());
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("term:"), "{found:?}");
}

#[test]
fn a_term_drawn_while_the_last_leader_still_led_is_accepted() {
    let history = History::default();
    let asked = Instant::now();
    history.term("one", "e", 7, Instant::now());
    // Began to campaign before term 7's leader left: the order of the two is not known.
    history.left("e", 7);
    history.term("two", "e", 7, asked);
    assert_eq!(violations(&history), Vec::<String>::new());
}

#[test]
fn more_permit_holders_than_permits_is_an_overlap() {
    let history = Arc::new(History::default());
    let holders: Vec<_> = (0..PERMITS)
        .map(|n| {
            let owner = Fake::owner(&format!("p{n}"));
            history.enter("permit", "s", Kind::Permit, &owner, Instant::now())
        })
        .collect();
    assert_eq!(violations(&history), Vec::<String>::new());
    let one_more = history.enter(
        "one more",
        "s",
        Kind::Permit,
        &Fake::owner("q"),
        Instant::now(),
    );
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("overlap:") && found[0].contains("permit"),
        "{found:?}"
    );
    drop((holders, one_more));
}

#[test]
fn a_free_lock_left_while_a_waiter_sleeps_past_the_bound_is_rejected() {
    let history = Arc::new(History::default());
    let free = Instant::now();
    assert_eq!(
        history.starved("a", free, free + STARVED * 4),
        Judged::NobodyWaits
    );
    let _waiting = history.waits("patient", "a");
    let now = Instant::now();
    assert_eq!(history.starved("a", free, now + STARVED / 2), Judged::Fine);
    assert_eq!(violations(&history), Vec::<String>::new());
    assert_eq!(
        history.starved("a", free, now + STARVED * 2),
        Judged::Starved
    );
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("liveness:"), "{found:?}");
}

#[test]
fn a_fault_window_excuses_a_free_stretch_it_covers() {
    let history = Arc::new(History::default());
    let _waiting = history.waits("patient", "a");
    let free = Instant::now();
    history.lock().fault_windows.push((free, Some(free)));
    // The recovery after the fault covers the whole stretch.
    assert_eq!(history.starved("a", free, free + RECOVERY), Judged::Fine);
    assert_eq!(violations(&history), Vec::<String>::new());
}

/// Marks the holds of `token` taken away, `ago`, with a steal's round trip of 1 ms.
fn rob(history: &History, token: &Fake, ago: Duration) {
    let stolen = Instant::now() - ago;
    let robbed = (stolen, Duration::from_millis(1));
    history.lock().robbed.insert(token.token.clone(), robbed);
}

#[test]
fn a_pass_long_after_a_steal_is_rejected() {
    let history = Arc::new(History::default());
    let soon = Fake {
        passes: 1,
        ..Fake::owner("x")
    };
    rob(&history, &soon, Duration::ZERO);
    drop(history.enter("next", "a", Kind::Exclusive, &soon, Instant::now()));
    assert_eq!(violations(&history), Vec::<String>::new());
    let late = Fake {
        passes: 2,
        ..Fake::owner("y")
    };
    rob(&history, &late, Duration::from_secs(1));
    drop(history.enter("later", "a", Kind::Exclusive, &late, Instant::now()));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("cohort:"), "{found:?}");
}

#[test]
fn a_nested_acquire_granted_inside_a_stolen_hold_is_rejected() {
    let history = Arc::new(History::default());
    let robbed = Fake::owner("x");
    rob(&history, &robbed, Duration::from_millis(5));
    drop(history.enter("nested", "a", Kind::Exclusive, &robbed, Instant::now()));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("lost:"), "{found:?}");
}

#[test]
fn a_nested_acquire_granted_inside_a_lost_hold_is_an_overlap() {
    let history = Arc::new(History::default());
    let _thief = history.enter(
        "thief",
        "a",
        Kind::Exclusive,
        &Fake::owner("y"),
        Instant::now(),
    );
    // The outer hold ran out; the nested acquire answered Ok with nothing left.
    let lost = Fake {
        remaining: Duration::ZERO,
        ..Fake::owner("x")
    };
    let _nested = history.enter("nested", "a", Kind::Exclusive, &lost, Instant::now());
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("overlap:"), "{found:?}");
}

#[test]
fn entering_before_a_nested_min_hold_ends_is_rejected() {
    let history = Arc::new(History::default());
    let set = Fake::owner("x");
    history.min_hold("a", &set.token, Instant::now() + Duration::from_secs(5));
    // The keeper itself may come back; the set released, someone else may not.
    drop(history.enter("keeper", "a", Kind::Exclusive, &set, Instant::now()));
    history.min_hold("b", &set.token, Instant::now());
    drop(history.enter(
        "after",
        "b",
        Kind::Exclusive,
        &Fake::owner("z"),
        Instant::now(),
    ));
    assert_eq!(violations(&history), Vec::<String>::new());
    drop(history.enter(
        "early",
        "a",
        Kind::Exclusive,
        &Fake::owner("y"),
        Instant::now(),
    ));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("min_hold"), "{found:?}");
}

#[test]
fn a_key_owned_past_an_answered_release_is_an_orphan() {
    let history = Arc::new(History::default());
    let owner = "000000released";
    history.released(owner, true);
    let since = Instant::now();
    assert!(!history.orphaned("a", owner, since, since + ORPHANED));
    assert!(history.orphaned("a", owner, since, since + ORPHANED * 2));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("orphan:"), "{found:?}");
}

#[test]
fn a_release_not_answered_lets_the_lease_run_out() {
    let history = Arc::new(History::default());
    let owner = "00000000dropped";
    // Answered once (a nested hold), then dropped: the key may stay until its lease ends.
    history.released(owner, true);
    history.released(owner, false);
    let since = Instant::now();
    assert!(!history.orphaned("a", owner, since, since + ORPHANED * 4));
    // A token never released (a late attempt of a request that gave up) likewise.
    assert!(!history.orphaned("a", "00000000never", since, since + ORPHANED * 4));
    assert_eq!(violations(&history), Vec::<String>::new());
}

#[test]
fn only_a_fault_that_can_stop_a_release_excuses_an_orphan() {
    let history = Arc::new(History::default());
    let owner = "000000answered";
    history.released(owner, true);
    let since = Instant::now();
    let window = (since, Some(since + Duration::from_millis(50)));
    history.lock().fault_windows.push(window);
    // A partition may have stopped the release behind a local pass: excused.
    assert!(!history.orphaned("a", owner, since, since + ORPHANED * 4));
    // Latency that lets everything through after stops no release: not excused.
    history.lock().passing_faults.push(0);
    assert!(history.orphaned("a", owner, since, since + ORPHANED * 4));
    assert_eq!(violations(&history).len(), 1);
}

#[test]
fn a_set_left_asleep_while_all_its_keys_are_free_is_rejected() {
    let history = Arc::new(History::default());
    let waiting = history.waits_all("set", &["a", "b"]);
    let free_from = Instant::now();
    let later = free_from + STARVED * 4;
    // One key still taken: the set cannot enter, and nobody is starved.
    let mut free = HashMap::from([("a", free_from)]);
    history.starved_sets(&mut free, later);
    assert_eq!(violations(&history), Vec::<String>::new());
    // Both free together for four times the bound, entered by nobody.
    let mut free = HashMap::from([("a", free_from), ("b", free_from)]);
    history.starved_sets(&mut free, later);
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("liveness:"), "{found:?}");
    assert!(free.is_empty(), "the keys judged start a new stretch");
    drop(waiting);
}

#[test]
fn a_set_whose_keys_were_free_together_only_briefly_is_accepted() {
    let history = Arc::new(History::default());
    let waiting = history.waits_all("set", &["a", "b"]);
    let now = Instant::now() + STARVED * 4;
    // "b" has been free only for half the bound.
    let mut free = HashMap::from([("a", now - STARVED * 3), ("b", now - STARVED / 2)]);
    history.starved_sets(&mut free, now);
    assert_eq!(violations(&history), Vec::<String>::new());
    drop(waiting);
}

#[test]
fn a_lease_longer_than_its_holder_asked_for_is_rejected() {
    let history = Arc::new(History::default());
    let holder = Fake::owner("x");
    let entry = history.enter("one", "a", Kind::Exclusive, &holder, Instant::now());
    let sampled = Instant::now() + Duration::from_millis(1);
    // The holder asked for 5 s: a PTTL within it is its own lease.
    history.prolonged("a", Some(4_900), sampled, sampled);
    assert_eq!(violations(&history), Vec::<String>::new());
    history.prolonged("a", Some(9_000), sampled, sampled);
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("lease:"), "{found:?}");
    drop(entry);
}

#[test]
fn without_faults_a_key_owned_by_no_holder_past_the_bound_is_an_orphan() {
    let history = History::default();
    let since = Instant::now();
    assert!(!history.orphaned_without_faults("a", "000000nobody", since, since + ORPHANED));
    assert_eq!(violations(&history), Vec::<String>::new());
    assert!(history.orphaned_without_faults("a", "000000nobody", since, since + ORPHANED * 2));
    let found = violations(&history);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("orphan:"), "{found:?}");
}
