-- Give back one hold of an exclusive lock, only if the caller still owns it.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the lock's wake channel (same hash tag): told when the lock becomes free, or
--          when it is left as the min_hold marker (whose PTTL a waiter then learns)
-- KEYS[3]  the timer of a min_hold window asked for by a nested hold (same hash tag)
-- ARGV[1]  owner token
-- ARGV[2]  hold id
-- ARGV[3]  milliseconds the key must still live after this hold ends (min_hold); "0"
--          deletes it at once when this is the last hold (unless an earlier hold of the
--          owner asked for a min_hold, noted in the "min_hold" field and timed by KEYS[3])
--
-- Returns 1 when the hold was given back (the last hold deletes the lock, or leaves it to
-- expire after ARGV[3] ms with no owner), 0 when the caller did not hold the lock (its lease
-- expired, or another owner holds the key now: that lock is left alone).
-- Idempotent per hold id: a resent release of a hold already given back, while the owner
-- still holds the lock through other holds, succeeds without counting twice.

return release_hold(KEYS[1], KEYS[3], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]))
