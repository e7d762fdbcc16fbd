-- Renew many leases in one round trip (the watchdog's batch).
--
-- KEYS[i]        a lock: a hash, or the string form of a plain exclusive lock (all in one
--                hash slot on Cluster); a read share's or permit's lease is the hash's field
--                "s:<token>", renewed with the lock
-- ARGV[2i-1]     the owner token that must hold KEYS[i]
-- ARGV[2i]       the lease in milliseconds; a longer lease already set is kept
--
-- Returns one integer per hold: 1 renewed, 0 no longer held by that token (never extended).
-- A key of an unexpected type is not held; it never fails the batch.

local result = {}
for i = 1, #KEYS do
  local lock, token = KEYS[i], ARGV[2 * i - 1]
  if held_by(lock, token) then
    lengthen_hold(lock, token, tonumber(ARGV[2 * i]))
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
