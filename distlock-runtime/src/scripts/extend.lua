-- Set a held lock's lease to a new length, only if the caller still owns it.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  (shares only) the share's lease key
-- ARGV[1]  owner token
-- ARGV[2]  new lease in milliseconds, counted from now
--
-- Returns 1 when the lease was set, 0 when the caller no longer holds the lock.

local lock, token, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('hexists', lock, token) == 0 then
  return 0
end
if KEYS[2] then
  if redis.call('pexpire', KEYS[2], lease) == 0 then
    return 0
  end
  -- The lock lives as long as its longest share.
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
else
  redis.call('pexpire', lock, lease)
end
return 1
