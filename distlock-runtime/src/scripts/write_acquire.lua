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
-- Returns {1, fence} when held, {0, pttl} when not (another writer or exclusive holder,
-- live readers or permits, the min_hold marker). While refused, the writer leaves an
-- intent that makes new readers wait, so a steady stream of readers cannot starve it.

local lock, fence_key, intent = KEYS[1], KEYS[2], KEYS[3]
local token, lease, hold = ARGV[1], tonumber(ARGV[2]), ARGV[4]

local function refused(kind)
  local owner = redis.call('get', intent)
  if ARGV[6] ~= '0' and (not owner or owner == token) then
    redis.call('set', intent, token, 'PX', ARGV[6])
  end
  return {0, busy_for(lock, kind)}
end

local kind = kind_of(lock)
if kind == 'read' or kind == 'permits' then
  if not free_of_dead_shares(lock, kind) then
    -- Readers inside: keep new ones out until they leave. Permits take no intent.
    if kind == 'read' then
      return refused(kind)
    end
    return {0, busy_for(lock, kind)}
  end
  kind = nil
end

if kind == nil then
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

-- Only this owner's own write or exclusive lock is re-entered; any other kind, the
-- min_hold marker or a key of another form waits.
if kind ~= 'exclusive' and kind ~= 'write' then
  return refused(kind)
end

if hold == token then
  if redis.call('hexists', lock, token) == 1 then
    return held()
  end
elseif redis.call('hexists', lock, 'h:' .. hold) == 1 then
  return held()
elseif ARGV[5] == '1' and redis.call('hexists', lock, token) == 1 then
  if redis.call('hincrby', lock, token, 1) == 2 then
    -- Once given back, the first hold's marker stays at 0 (see release.lua).
    redis.call('hsetnx', lock, 'h:' .. token, 1)
  end
  redis.call('hset', lock, 'h:' .. hold, 1)
  return held()
end

return refused(kind)
