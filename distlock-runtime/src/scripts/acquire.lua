-- Take an exclusive lock.
--
-- KEYS[1]  the lock: a hash {owner token -> hold count, "fence" -> fencing token}
-- KEYS[2]  the lock's fencing counter (same hash tag; touched only when ARGV[3] == "1")
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  "1" to draw a fencing token, "0" otherwise
--
-- Returns {1, fence} when the caller holds the lock (fence is 0 without fencing),
-- or {0, pttl} when another owner holds it for pttl more milliseconds.
-- A resent request (same token, reply lost) finds its own field and succeeds again
-- without drawing a second fencing token.

local lock, token, lease = KEYS[1], ARGV[1], ARGV[2]

if redis.call('hexists', lock, token) == 1 then
  redis.call('pexpire', lock, lease)
  return {1, tonumber(redis.call('hget', lock, 'fence') or '0')}
end

if redis.call('exists', lock) == 1 then
  return {0, redis.call('pttl', lock)}
end

local fence = 0
if ARGV[3] == '1' then
  fence = redis.call('incr', KEYS[2])
  redis.call('hset', lock, token, 1, 'fence', fence)
else
  redis.call('hset', lock, token, 1)
end
redis.call('pexpire', lock, lease)
return {1, fence}
