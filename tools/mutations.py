#!/usr/bin/env python3
"""Plants realistic bugs one at a time and checks that the tests catch each.

Each mutation edits the Lua scripts or the Rust waiting and hand-off code, then runs the
history checker's short mode (`cargo test --all-features --test integration history::`) and
the tests of the module that owns the code (`tests/integration/<module>.rs` or
`<module>/mod.rs`, run the same way
with `<module>::`). A mutation is caught when either fails (or runs past its time limit). The
tree is restored after each one, whatever happens.

    python3 tools/mutations.py               # every mutation (about an hour on 2 cores)
    python3 tools/mutations.py unlock renew  # those whose name contains any of the words
    python3 tools/mutations.py --check       # every mutation still plants where its code is

Not part of CI: too long. Prints a Markdown table: mutation, caught by, time.
"""

import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RT = "distlock-runtime/src/"
LUA = RT + "scripts/"
LIMIT = 420  # seconds per test run; past it the run counts as failed (a hang)

# name, owning test module (tests/integration/<module>.rs), [(file, text, replacement), ...]
MUTATIONS = [
    # --- Lua: owner checks
    ("unlock.lua: owner check becomes a key-exists check", "exclusive",
     [(LUA + "unlock.lua", "if value ~= ARGV[1] then", "if not value then")]),
    ("renew.lua (held_by): owner check becomes a key-exists check", "leases",
     [(LUA + "held_by.lua", "return redis.call('get', key) == token", "return true")]),
    ("held_by.lua: a hash holder's token is not checked", "kinds",
     [(LUA + "held_by.lua", "    if not fields[1] then\n      return false\n    end\n", "")]),
    ("extend.lua: owner check removed", "leases",
     [(LUA + "extend.lua", "if not held_by(lock, token) then", "if false then")]),
    ("handoff.lua: owner check removed", "handoff",
     [(LUA + "handoff.lua", "if redis.pcall('get', KEYS[1]) ~= ARGV[1] then", "if false then")]),
    ("release_hold.lua: owner check removed", "kinds",
     [(LUA + "release_hold.lua", "if count == 0 or (mode and mode ~= 'write') then",
       "if mode and mode ~= 'write' then")]),
    # --- Lua: kind checks (the compatibility matrix)
    ("write_acquire.lua: readers inside do not keep a writer out", "shared",
     [(LUA + "write_acquire.lua", "if not free_of_dead_shares(lock, kind) then",
       "if false then")]),
    ("share_acquire.lua: another kind does not keep a share out", "shared",
     [(LUA + "share_acquire.lua", "if current ~= nil and current ~= mode then",
       "if false then")]),
    ("share_acquire.lua: permits counted one too many", "shared",
     [(LUA + "share_acquire.lua", "elseif held >= limit then", "elseif held > limit then")]),
    ("acquire.lua: live readers do not keep an exclusive lock out", "kinds",
     [(LUA + "acquire.lua", "if kind == nil or free_of_dead_shares(lock, kind) then",
       "if kind == nil or kind == 'read' or free_of_dead_shares(lock, kind) then")]),
    ("write_acquire.lua: another owner's write lock is re-entered", "shared",
     [(LUA + "write_acquire.lua", "if hold == token then\n  if redis.call('hexists', lock, token) == 1 then",
       "if hold == token then\n  if true then")]),
    # --- Lua: wake-ups
    ("unlock.lua: no PUBLISH on release", "waiting",
     [(LUA + "unlock.lua", "return 1 + announce(KEYS[2], ARGV[3])", "return 1")]),
    ("release_hold.lua: no PUBLISH on release", "liveness",
     [(LUA + "release_hold.lua", "    redis.call('del', lock)\n    announce(wake, '')\n",
       "    redis.call('del', lock)\n")]),
    ("share_release.lua: no PUBLISH on release", "liveness",
     [(LUA + "share_release.lua", "announce(KEYS[2], '')", "")]),
    ("fair.lua: a grant is not announced", "liveness",
     [(LUA + "fair.lua", "  announce(wake, '=' .. owner)\n", "")]),
    ("withdraw_intent.lua: no PUBLISH", "liveness",
     [(LUA + "withdraw_intent.lua", "announce(KEYS[2], '')", "")]),
    # --- Lua: expiry arguments
    ("held_by.lua (extend, renew): the lock's lease is not lengthened", "leases",
     [(LUA + "held_by.lua", "  if redis.call('pttl', key) < lease then\n    redis.call('pexpire', key, lease)\n  end\n",
       "")]),
    ("held_by.lua (renew): a share's lock is renewed without its share", "shared",
     [(LUA + "held_by.lua", "    redis.call('hset', key, share, server_now() + lease)\n", "")]),
    ("kind.lua: a share whose lease ended still counts", "shared",
     [(LUA + "kind.lua", "      if left > 0 then\n", "      if true then\n")]),
    ("handoff.lua: the next owner gets ten times its lease", "handoff",
     [(LUA + "handoff.lua", "redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3])",
       "redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3] * 10)")]),
    ("write_acquire.lua: the write lock gets ten times its lease", "shared",
     [(LUA + "write_acquire.lua", "    redis.call('hset', lock, 'mode', 'write', token, 1)\n  end\n  redis.call('pexpire', lock, lease)",
       "    redis.call('hset', lock, 'mode', 'write', token, 1)\n  end\n  redis.call('pexpire', lock, lease * 10)")]),
    # --- Rust: the stand-aside rule, deadlines, cancellation, hand-offs
    ("engine: a writer that gives up leaves its intent", "liveness",
     [(RT + "engine/cover.rs", "        self.intent_left = self.claim.intent().is_some()\n            && matches!(answer, Err(_) | Ok(AcquireAnswer::Busy { .. }));",
       "        self.intent_left = false\n            && matches!(answer, Err(_) | Ok(AcquireAnswer::Busy { .. }));")]),
    ("waiters: a hand-off whose taker is gone is not released", "handoff",
     [(RT + "handed.rs", "        if let Some((giver, ids)) = self.untaken.take() {",
       "        if let Some((giver, ids)) = self.untaken.take().filter(|_| false) {")]),
    ("waiters: a leaving head does not tell the next one", "waiting",
     [(RT + "waiters/ticket.rs", "                next.turn.notify_one();", "                let _ = next;")]),
    # Every wake-up (a release by this manager, or one heard on the wake channel) goes through
    # here: the liveness tests' waiters have timers of a day, so only a wake-up lets them in.
    ("waiters: a release does not wake the local head", "liveness",
     [(RT + "waiters/mod.rs", "        self.wakes.fetch_add(1, Ordering::AcqRel);\n        self.wake.notify_one();",
       "")]),
    # --- Rust: cohorts and elections
    ("release: a local pass also releases the lock to everyone", "cohorts",
     [(RT + "guard/give_back.rs", "\"passed locally\");\n                Ok((run, check))",
       "\"passed locally\");\n                Err(())")]),
    ("cohort: the run check skipped (it always finds the hold)", "cohorts",
     [(RT + "cohort.rs", "let answer = run.backend.is_held_plain(&run.ids).await;",
       "let answer = Ok(true);")]),
    ("release: the run check skipped by a release that passed the lock on", "cohorts",
     [(RT + "guard/give_back.rs", "return Ok(Box::pin(self.checked(&run, check)).await);",
       "return Ok(Ok(()));")]),
    ("waiters: a run of local passes has no bound", "cohorts",
     [(RT + "waiters/choice.rs", "true => (bounds.passes, bounds.time.min(lease / 10)),",
       "true => (u32::MAX, Duration::MAX),")]),
    ("waiters: a lock passes to a waiter that asked for another lease", "cohorts",
     [(RT + "waiters/choice.rs", " && offer.lease == lease && passable.remaining", " && passable.remaining")]),
    ("held: a hold nested in a set's lock renews and extends its own lock alone", "sets",
     [(RT + "held.rs", "        match self.set.get() {\n            Some(set) => set",
       "        match None::<&Arc<[Weak<Held>]>> {\n            Some(set) => set")]),
    ("watchdog: a holder that never runs its probe is renewed anyway", "leases",
     [(RT + "watchdog/mod.rs", "let waiting = self.alive.load(Ordering::Acquire) < self.probed;",
       "let waiting = false;")]),
    ("watchdog: a renewal sent late is not reported", "leases",
     [(RT + "watchdog/mod.rs", "if is_late(left, lease.ttl) {", "if false {")]),
    ("acquire.lua: the fencing counter does not grow", "exclusive",
     [(LUA + "acquire.lua", "    fence = redis.call('incr', KEYS[2])\n    redis.call('hset', lock, token, 1, 'fence', fence)",
       "    fence = redis.call('incr', KEYS[2]) % 3 + 1\n    redis.call('hset', lock, token, 1, 'fence', fence)")]),
    ("election: a new leader's term does not grow", "elections",
     [(RT + "election/mod.rs", "let term = guard.fencing_token().unwrap_or_default();",
       "let term = guard.fencing_token().unwrap_or_default() % 3;")]),
    ("decide: a waiter's sleep is not bounded by its deadline", "exclusive",
     [(RT + "decide.rs", "for bound in [bounds.deadline, sit_out_until(state)]",
       "for bound in [sit_out_until(state)]")]),
    ("retry: the fallback timer is not bounded by the holder's lease", "waiting",
     [(RT + "retry.rs", "Some(ttl) => jittered.min(ttl.saturating_add(Duration::from_millis(1))),",
       "Some(_) => jittered,")]),
    ("set_acquire.lua: a set's last key is not checked", "sets",
     [(LUA + "set_acquire.lua", "for i = 1, n do\n  local lock = KEYS[2 * i - 1]\n  local kind = kind_of(lock)",
       "for i = 1, n - 1 do\n  local lock = KEYS[2 * i - 1]\n  local kind = kind_of(lock)")]),
    ("decide: a subscribed waiter sleeps past the holder's lease (until woken)", "waiting",
     [(RT + "decide.rs", "Some(lease) if state.announced && bounds.by_time() => crate::retry::past_lease(lease),",
       "Some(_) if state.announced && bounds.by_time() => Duration::from_secs(3600),")]),
    ("decide: a waiter that hears no release sleeps until the holder's lease ends", "acl",
     [(RT + "decide.rs", "Some(lease) if state.announced && bounds.by_time() =>",
       "Some(lease) if bounds.by_time() =>")]),
    ("share_acquire.lua: a full semaphore answers its longest lease, not its first", "waiting",
     [(LUA + "share_acquire.lua", "  elseif held >= limit then\n    return {0, busy_for(lock, current)}",
       "  elseif held >= limit then\n    return {0, redis.call('pttl', lock)}")]),
    ("engine: a busy set follows the first key's queue, not the busy key's", "sets",
     [(RT + "engine/mod.rs", "self.busy_at = at.min(self.names.len() - 1);", "self.busy_at = 0;")]),
    ("set: a set's release without its resend (a cancelled release sends nothing)",
     "cancellation",
     [(RT + "set.rs", "            let mut unanswered = Unanswered::armed(&giving);\n",
       "            let mut unanswered = Unanswered::armed(&giving);\n            unanswered.answered();\n")]),
    ("engine: a cancelled attempt leaves its lock behind", "lifecycle",
     [(RT + "engine/cover.rs", "        if self.maybe_held || late {\n            self.claim.release_behind(self.inner, intent);",
       "        if false {\n            self.claim.release_behind(self.inner, intent);")]),
    ("engine: a cancelled fair waiter keeps its place in the server's queue", "fair",
     [(RT + "engine/cover.rs", "            Ok(_) => self.claim.fair(),", "            Ok(_) => false,")]),
    ("decide: a fair waiter does not ask again within the refresh of its place", "fair",
     [(RT + "decide.rs", "        .min(FAIR_REFRESH),", "        ,")]),
    ("waiters: a run of hand-offs never ends", "handoff",
     [(RT + "waiters/choice.rs", "false => (CHAIN, SLICE.min(lease / 10)),", "false => (u32::MAX, Duration::MAX),")]),
    ("lease: a failed renewal is not marked lost", "leases",
     [(RT + "watchdog/renew.rs",
       "            lease.state.mark_lost();\n            lost.extend(holds.iter().cloned());\n",
       "            lost.extend(holds.iter().cloned());\n")]),
    ("waiters: a sit-out takes no look when nobody takes the lock up", "liveness",
     [(RT + "waiters/sit_out.rs", "let until = self.until.min(self.look_at);", "let until = self.until;")]),
    # --- Rust and Lua: where two features meet (tests/integration/seams.rs)
    ("lock: a nested acquire is not checked on the server (a stolen hold is re-entered)",
     "seams",
     [(RT + "lock/nest.rs",
       "    if !guard.is_held().await? || guard.held().lease.is_lost() {\n        guard.held().lease.mark_lost();",
       "    if false {\n        guard.held().lease.mark_lost();")]),
    ("set: a set's release drops the min_hold of a hold nested in it", "seams",
     [(RT + "set.rs", "keep: keep_from(held.keep_until()),", "keep: Duration::ZERO,")]),
    ("release_hold.lua: no PUBLISH when the min_hold marker is left", "seams",
     [(LUA + "release_hold.lua",
       "take the lock then.\n    announce(wake, '')", "take the lock then.")]),
    ("pubsub: a release from elsewhere does not end 'held here' (a forced release wakes "
     "nobody behind this manager's holder)", "seams",
     [(RT + "waiters/pubsub.rs", "                queue.held_here = None;\n", "")]),
    ("release: the release behind an attempt that may land late is not sent again", "seams",
     [(RT + "release/mod.rs",
       "let Some(until) = given.late_until().filter(|until| *until > Instant::now()) else {",
       "let Some(until) = given.late_until().filter(|_| false) else {")]),
    ("settle: a release sent again that finds the lock gone answers released", "seams",
     [(RT + "release/settle.rs", "Reply::NotHeld if resent && !lease_lost => Step::Unknown,",
       "Reply::NotHeld if resent && !lease_lost => Step::Released,")]),
    ("cover: an unanswered attempt is forgotten once a later one is answered busy", "seams",
     [(RT + "engine/cover.rs", "let late = !self.won && self.late_until",
       "let late = false && self.late_until")]),
    ("holds: shutdown gives a hold back with the min_hold it had when it was listed", "seams",
     [(RT + "manager/mod.rs", "OneHold::new(hold.ids, hold.keep_until.now())",
       "OneHold::new(hold.ids, None)")]),
    ("watchdog: a lease found lost wakes nobody queued behind its holder", "seams",
     [(RT + "watchdog/renew.rs", "                    waiters.released(&hold.wake);\n", "")]),
    ("watcher: distlock's death leaves what the command started running", "cli",
     [("src/bin/distlock/watcher.rs",
       "    let _ = killpg(nix::unistd::Pid::from_raw(group), Signal::SIGKILL);\n",
       "    let _ = (killpg(nix::unistd::Pid::from_raw(group), None), Signal::SIGKILL);\n")]),
    # --- Rust: connections on a real network
    ("waiters: a lost pub/sub connection is not followed again", "partitions",
     [(RT + "waiters/pubsub.rs", "        shared.lost_connection(generation);\n        shared.recover(&backend);",
       "        shared.lost_connection(generation);")]),
    ("watchdog: a renewed lease is not scheduled again", "leases",
     [(RT + "watchdog/mod.rs", "        }\n        leases.reschedule(id);\n    }\n    warn_if_behind(",
       "        }\n    }\n    warn_if_behind(")]),
    ("link.rs: a timed-out connection is reused", "partitions",
     [(RT + "backend/link.rs", "if !(error.is_unrecoverable_error() || error.is_timeout()) {",
       "if !error.is_unrecoverable_error() {")]),
]


def run(args, env=None, limit=LIMIT):
    started = time.time()
    try:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=limit)
        ok = done.returncode == 0
    except subprocess.TimeoutExpired:
        ok = False
    return ok, time.time() - started


def cargo_test(module, env=None):
    """The tests of one module of the integration test binary."""
    return run(["cargo", "test", "--all-features", "--test", "integration", f"{module}::"],
               env=env)


# Mutations whose rule only faults exercise: the history's run for them is the long mode on
# one server (its proxy holds attempts back past their retry), a few thousand acquisitions.
LONG_HISTORY = {"release: the release behind an attempt that may land late is not sent again"}


def history_env(name):
    if name not in LONG_HISTORY:
        return None
    env = dict(os.environ)
    env.update(DISTLOCK_HISTORY_TOPOLOGY="single", DISTLOCK_HISTORY_LONG="6000")
    return env


def apply(edits):
    """Applies `edits`; returns the originals to restore, or raises if one does not apply."""
    saved = {}
    for file, text, replacement in edits:
        path = ROOT / file
        source = saved.get(file) or path.read_text()
        saved.setdefault(file, source)
        current = path.read_text()
        if current.count(text) != 1:
            raise ValueError(f"{file}: the text to mutate occurs {current.count(text)} times")
        path.write_text(current.replace(text, replacement))
    return saved


def restore(saved):
    for file, source in saved.items():
        (ROOT / file).write_text(source)


def test_module(name):
    """Whether `tests/integration` has the test module `name`."""
    tests = ROOT / "tests" / "integration"
    return (tests / f"{name}.rs").is_file() or (tests / name / "mod.rs").is_file()


def check():
    """Every mutation's text occurs exactly once in the file it names, and the test module
    that owns it exists: none is left behind by a move of its code or its tests (CI runs
    this; it builds nothing)."""
    stale = []
    for name, owner, edits in MUTATIONS:
        if not test_module(owner):
            stale.append(f"{name}: no test module tests/integration/{owner}")
        for file, text, _ in edits:
            path = ROOT / file
            count = path.read_text().count(text) if path.is_file() else 0
            if count != 1:
                stale.append(f"{name}: {file} has its text {count} times")
    for line in stale:
        print(line)
    print(f"{len(MUTATIONS)} mutations, {len(stale)} stale")
    sys.exit(1 if stale else 0)


def main():
    if sys.argv[1:] == ["--check"]:
        check()
    words = sys.argv[1:]
    chosen = [m for m in MUTATIONS if not words or any(w in m[0] for w in words)]
    print("baseline: the unmutated tree must pass", flush=True)
    for name in sorted({"history"} | {m[1] for m in chosen}):
        # A filter that matches no test passes: the module must exist.
        if not test_module(name):
            sys.exit(f"no test module tests/integration/{name}.rs")
        ok, _ = cargo_test(name)
        if not ok:
            sys.exit(f"baseline: tests/integration/{name}.rs fails without any mutation")
    rows = []
    for name, owner, edits in chosen:
        saved = apply(edits)
        try:
            started = time.time()
            run(["cargo", "build", "--all-features", "--tests"], limit=900)
            caught = []
            for test in ["history", owner]:
                ok, _ = cargo_test(test, history_env(name) if test == "history" else None)
                if not ok:
                    caught.append(test)
            elapsed = time.time() - started
        finally:
            restore(saved)
        verdict = ", ".join(caught) if caught else "NOT CAUGHT"
        rows.append((name, verdict, elapsed))
        print(f"| {name} | {verdict} | {elapsed:.0f} s |", flush=True)
    print()
    print("| mutation | caught by | time |")
    print("|---|---|---|")
    for name, verdict, elapsed in rows:
        print(f"| {name} | {verdict} | {elapsed:.0f} s |")
    missed = [r for r in rows if r[1] == "NOT CAUGHT"]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} mutations caught")
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
