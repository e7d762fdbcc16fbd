-- Renew many leases in one round trip (the watchdog's batch).
--
-- KEYS[2i-1]     a lock: a hash, or the string form of a plain exclusive lock (all in one
--                hash slot on Cluster)
-- KEYS[2i]       that hold's share lease key, or the lock hash again for a whole-lock hold
-- ARGV[2i-1]     the owner token that must hold KEYS[2i-1]
-- ARGV[2i]       the lease in milliseconds; a longer lease already set is kept
--
-- Returns one integer per hold: 1 renewed, 0 no longer held by that token (never extended).
-- A key of an unexpected type is not held; it never fails the batch.

local result = {}
for i = 1, #ARGV / 2 do
  local lock, share = KEYS[2 * i - 1], KEYS[2 * i]
  local lease = tonumber(ARGV[2 * i])
  if held_by(lock, ARGV[2 * i - 1])
      and (share == lock or redis.call('exists', share) == 1) then
    if redis.call('pttl', share) < lease then
      redis.call('pexpire', share, lease)
    end
    if share ~= lock and redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, lease)
    end
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
