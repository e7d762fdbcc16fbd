-- Take a share of a lock: a read lock (many readers) or a semaphore permit (at most N).
--
-- KEYS[1]  the lock: a hash {"mode" -> "read" | "permits", "permits" -> N (semaphores),
--          and per share (see kind.lua) owner token -> hold count, "s:<token>" -> the
--          server time its lease ends at, "f:<token>" -> its fencing token, "h:<hold id>" ->
--          1 for nested holds}
-- KEYS[2]  the lock's write intent (same hash tag): set while a writer waits
-- KEYS[3]  the lock's fencing counter (same hash tag; touched only when ARGV[5] == "1")
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  hold id (equal to the token for a first hold)
-- ARGV[4]  "read", or the number of permits of a semaphore
-- ARGV[5]  "1" to draw a fencing token
--
-- Returns {1, fence} when the share is held, {0, pttl} when it is not available (held by
-- another kind, the min_hold marker, a waiting writer, or N permit holders), and {-1, N}
-- when the semaphore is in use with N permits and ARGV[4] asks for another number.
-- Each share has a lease of its own: a reader or permit holder that dies frees its share
-- when its own lease ends, whatever the other holders' leases. Shares whose lease has ended
-- are pruned here before counting.

local lock, intent = KEYS[1], KEYS[2]
local token, lease, hold = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local mode = ARGV[4] == 'read' and 'read' or 'permits'
local limit = tonumber(ARGV[4]) or 0

local current = kind_of(lock)
if current ~= nil and current ~= mode then
  if not free_of_dead_shares(lock, current) then
    return {0, busy_for(lock, current)}
  end
  current = nil
end

-- A resent request, or a nested hold of a share this owner already has (and whose lease
-- has not ended).
if current and held_by(lock, token) then
  if hold ~= token and redis.call('hsetnx', lock, 'h:' .. hold, 1) == 1 then
    -- Nesting starts: from now on every hold has a marker, the first one included.
    if redis.call('hincrby', lock, token, 1) == 2 then
      -- Once given back, the first hold's marker stays at 0 (see release.lua).
      redis.call('hsetnx', lock, 'h:' .. token, 1)
    end
  end
  lengthen_hold(lock, token, lease)
  return {1, tonumber(redis.call('hget', lock, 'f:' .. token) or '0')}
end

if mode == 'read' and redis.call('exists', intent) == 1 then
  -- A writer is waiting: new readers queue behind it.
  return {0, redis.call('pttl', intent)}
end

if current == 'permits' then
  local held = live_shares(lock)
  local stored = tonumber(redis.call('hget', lock, 'permits') or limit)
  if held == 0 then
    -- Every holder is gone: the key is free, for any number of permits.
    redis.call('del', lock)
    current = nil
  elseif stored ~= limit then
    return {-1, stored}
  elseif held >= limit then
    return {0, busy_for(lock, current)}
  end
end

local fence = 0
if ARGV[5] == '1' then
  fence = redis.call('incr', KEYS[3])
end
if current then
  -- What an ended share of this token left is replaced, not added to.
  drop_share(lock, token)
end
local fields = {token, 1, 's:' .. token, server_now() + lease}
if fence ~= 0 then
  table.insert(fields, 'f:' .. token)
  table.insert(fields, fence)
end
if not current then
  table.insert(fields, 'mode')
  table.insert(fields, mode)
  if mode == 'permits' then
    table.insert(fields, 'permits')
    table.insert(fields, limit)
  end
end
redis.call('hset', lock, unpack(fields))
if redis.call('pttl', lock) < lease then
  redis.call('pexpire', lock, lease)
end
return {1, fence}
