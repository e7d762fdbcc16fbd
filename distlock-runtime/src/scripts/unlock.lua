-- Give back a plain exclusive lock (the string form: the key's value is the owner token),
-- only if the caller still owns it. Servers with a native compare-and-delete (DELIFEQ) use
-- that instead when nothing has to stay behind.
--
-- KEYS[1]  the lock
-- KEYS[2]  the lock's wake channel (same hash tag): told when the lock becomes free, or
--          left as the min_hold marker
-- ARGV[1]  owner token
-- ARGV[2]  milliseconds the key must still live (min_hold of a hold taken inside); "0"
--          deletes it
-- ARGV[3]  the wake-up message (the releasing manager's id)
--
-- Returns 1 + the number of subscribers that heard the wake-up when released, 0 when the
-- caller did not hold the lock (expired, or another owner or another kind holds the key
-- now: left alone).

-- A key of another type (a hash: another lock kind) answers an error here: not ours.
local value = redis.pcall('get', KEYS[1])
if value ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1])
local keep = tonumber(ARGV[2])
if keep > 0 then
  -- The ownerless min_hold marker, as release.lua leaves it.
  redis.call('hset', KEYS[1], 'mode', 'min_hold')
  redis.call('pexpire', KEYS[1], keep)
  -- Waiters look once more, learn when the marker ends, and take the lock then.
  announce(KEYS[2], ARGV[3])
  return 1
end
return 1 + announce(KEYS[2], ARGV[3])
