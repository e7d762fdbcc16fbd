-- Take the write side of a read-write lock, or re-enter it.
--
-- KEYS[1]  the lock hash (see share_acquire.lua for its read form)
-- KEYS[2]  the lock's fencing counter
-- KEYS[3]  the lock's write intent
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  "1" to draw a fencing token
-- ARGV[4]  hold id (equal to the token for a first hold)
-- ARGV[5]  "1" if a holder with the same token may re-enter
-- ARGV[6]  how long (ms) a refused writer's intent keeps new readers out ("0": no intent,
--          for a writer that will not try again)
--
-- Returns {1, fence} when held, {0, pttl} when not. While refused, the writer leaves an
-- intent that makes new readers wait, so a steady stream of readers cannot starve it.

local lock, fence_key, intent = KEYS[1], KEYS[2], KEYS[3]
local token, lease, hold = ARGV[1], tonumber(ARGV[2]), ARGV[4]

local function refused()
  local owner = redis.call('get', intent)
  if ARGV[6] ~= '0' and (not owner or owner == token) then
    redis.call('set', intent, token, 'PX', ARGV[6])
  end
  return {0, redis.call('pttl', lock)}
end

local mode = redis.call('hget', lock, 'mode')
if mode == 'read' or mode == 'permits' then
  if mode == 'permits' then
    return {0, redis.call('pttl', lock)}
  end
  for _, field in ipairs(redis.call('hkeys', lock)) do
    if field ~= 'mode' and string.sub(field, 1, 2) ~= 'h:' then
      if redis.call('exists', lock .. ':s:' .. field) == 1 then
        return refused()
      end
    end
  end
  -- Every reader's lease has ended.
  redis.call('del', lock)
end

if redis.call('exists', lock) == 0 then
  local fence = 0
  if ARGV[3] == '1' then
    fence = redis.call('incr', fence_key)
    redis.call('hset', lock, 'mode', 'write', token, 1, 'fence', fence)
  else
    redis.call('hset', lock, 'mode', 'write', token, 1)
  end
  redis.call('pexpire', lock, lease)
  if redis.call('get', intent) == token then
    redis.call('del', intent)
  end
  return {1, fence}
end

local function held()
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
  return {1, tonumber(redis.call('hget', lock, 'fence') or '0')}
end

if hold == token then
  if redis.call('hexists', lock, token) == 1 then
    return held()
  end
elseif redis.call('hexists', lock, 'h:' .. hold) == 1 then
  return held()
elseif ARGV[5] == '1' and redis.call('hexists', lock, token) == 1 then
  redis.call('hincrby', lock, token, 1)
  redis.call('hset', lock, 'h:' .. hold, 1, 'h:' .. token, 1)
  return held()
end

return refused()
