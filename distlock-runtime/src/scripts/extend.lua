-- Make a held lock's lease last at least a given length from now, only if the caller still
-- owns it. A longer lease already set is kept: extending never shortens a lease, so the
-- client's own deadline never runs past the server's.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  (shares only) the share's lease key
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds, counted from now
--
-- Returns 1 when the caller holds the lock (its lease now lasts at least that long), 0 when
-- the caller no longer holds it.

local lock, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('hexists', lock, token) == 0 then
  return 0
end
if KEYS[2] then
  local left = redis.call('pttl', KEYS[2])
  if left == -2 then
    return 0
  end
  if left < lease then
    redis.call('pexpire', KEYS[2], lease)
  end
end
-- The lock lives as long as its longest share.
if redis.call('pttl', lock) < lease then
  redis.call('pexpire', lock, lease)
end
return 1
