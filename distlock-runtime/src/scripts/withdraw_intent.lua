-- A writer that stops waiting without the lock takes back its write intent, so that readers
-- it kept out need not wait for the intent to expire, and wakes them.
--
-- KEYS[1]  the lock's write intent (see write_acquire.lua)
-- KEYS[2]  the lock's wake channel (same hash tag)
-- ARGV[1]  the writer's owner token
--
-- Returns 1 when the intent was this writer's and is gone, 0 when it was not (another
-- writer's, or none): that is left alone.

if redis.call('get', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('del', KEYS[1])
announce(KEYS[2], '')
return 1
