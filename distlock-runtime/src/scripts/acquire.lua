-- Take an exclusive lock, or re-enter one that this owner already holds.
--
-- KEYS[1]  the lock: a hash {owner token -> hold count, "fence" -> the owner's fencing token,
--          and, once a hold is nested, "h:<hold id>" -> 1 for every hold}
-- KEYS[2]  the lock's fencing counter (same hash tag; touched only when ARGV[3] == "1")
-- ARGV[1]  owner token
-- ARGV[2]  lease in milliseconds
-- ARGV[3]  "1" to draw a fencing token, "0" otherwise
-- ARGV[4]  hold id: names this one acquisition (equal to the token for a first hold)
-- ARGV[5]  "1" if a holder with the same token may re-enter, "0" otherwise
-- ARGV[6]  "1" to take a plain lock in its string form (value = token) instead of a hash:
--          sent when `SET … NX` found a hash at the key, whose dead shares only this script
--          can clear
--
-- Returns {1, fence} when the caller holds the lock (fence is 0 without fencing),
-- or {0, pttl} when another owner (of any kind, or the min_hold marker) holds it for pttl
-- more milliseconds (readers or permits: until the first of their leases ends, see busy_for).
-- Only this owner's own exclusive or write lock is re-entered.
-- Idempotent per hold id: a request resent after a lost reply finds its own hold and
-- succeeds again without counting twice or drawing a second fencing token.

local lock, token, lease, hold = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[4]

local plain = ARGV[6] == '1'
local kind = kind_of(lock)
if plain and kind == 'foreign' then
  -- The string form: held when it is this owner's (a resend), busy otherwise.
  if redis.pcall('get', lock) == token then
    -- A resend: the lease counts from this attempt, as the caller's own deadline does.
    if redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, lease)
    end
    return {1, 0}
  end
  return {0, redis.call('pttl', lock)}
end
if kind == nil or free_of_dead_shares(lock, kind) then
  if plain then
    redis.call('set', lock, token, 'PX', lease)
    return {1, 0}
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
end

local function held()
  -- Never shorten a lease that an outer hold of the same owner asked for.
  if redis.call('pttl', lock) < lease then
    redis.call('pexpire', lock, lease)
  end
  return {1, tonumber(redis.call('hget', lock, 'fence') or '0')}
end

if kind ~= 'exclusive' and kind ~= 'write' then
  return {0, busy_for(lock, kind)}
end

if hold == token then
  -- A first hold: resent if the token already holds the lock.
  if redis.call('hexists', lock, token) == 1 then
    return held()
  end
elseif redis.call('hexists', lock, 'h:' .. hold) == 1 then
  return held()
elseif ARGV[5] == '1' and redis.call('hexists', lock, token) == 1 then
  -- Nesting starts: from now on every hold has a marker, the first one included.
  if redis.call('hincrby', lock, token, 1) == 2 then
    -- Once given back, the first hold's marker stays at 0 (see release.lua).
    redis.call('hsetnx', lock, 'h:' .. token, 1)
  end
  redis.call('hset', lock, 'h:' .. hold, 1)
  return held()
end

return {0, redis.call('pttl', lock)}
