-- Make a held lock's lease last at least a given length from now, only if the caller still
-- owns it. A longer lease already set is kept: extending never shortens a lease, so the
-- client's own deadline never runs past the server's.
--
-- KEYS[1]  the lock: a hash, or the string form of a plain exclusive lock (value = token);
--          a read share's or permit's lease is the lock hash's field "s:<token>"
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds, counted from now
--
-- Returns 1 when the caller holds the lock (its lease now lasts at least that long), 0 when
-- the caller no longer holds it.

local lock, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if not held_by(lock, token) then
  return 0
end
-- A share's own lease, and the lock, which lives as long as its longest share.
lengthen_hold(lock, token, lease)
return 1
