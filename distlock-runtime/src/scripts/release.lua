-- Give back an exclusive lock, only if the caller still owns it.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  owner token
--
-- Returns 1 when the caller's lock was deleted, 0 when the caller did not hold it
-- (its lease expired, or another owner holds the key now: that lock is left alone).

if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('del', KEYS[1])
return 1
