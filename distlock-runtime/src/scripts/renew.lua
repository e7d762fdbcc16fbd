-- Renew many leases in one round trip (the watchdog's batch).
--
-- KEYS[i]        a lock hash (all in one hash slot on Cluster)
-- ARGV[2i-1]     the owner token that must hold KEYS[i]
-- ARGV[2i]       the lease in milliseconds; a longer lease already set is kept
--
-- Returns one integer per key: 1 renewed, 0 no longer held by that token (never extended).

local result = {}
for i, lock in ipairs(KEYS) do
  if redis.call('hexists', lock, ARGV[2 * i - 1]) == 1 then
    local lease = tonumber(ARGV[2 * i])
    if redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, lease)
    end
    result[i] = 1
  else
    result[i] = 0
  end
end
return result
