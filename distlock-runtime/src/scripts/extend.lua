-- Set a held lock's lease to a new length, only if the caller still owns it.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  owner token
-- ARGV[2]  new lease in milliseconds, counted from now
--
-- Returns 1 when the lease was set, 0 when the caller no longer holds the lock.

if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('pexpire', KEYS[1], ARGV[2])
return 1
