-- Take a set of exclusive locks at once: every key, or none.
--
-- KEYS[2i-1]  a lock of the set (the hash an exclusive lock is: {owner token -> 1,
--             "fence" -> fencing token})
-- KEYS[2i]    that lock's fencing counter (same hash tag; touched only when ARGV[3] == "1")
-- ARGV[1]     owner token of the set (also its hold id: a set is always a first hold)
-- ARGV[2]     lease in milliseconds
-- ARGV[3]     "1" to draw a fencing token per key, "0" otherwise
--
-- Returns {1, fence_1, …, fence_n} when the caller holds every key (fences are 0 without
-- fencing), or {0, i, pttl} when the i-th lock is held by another owner (of any kind or
-- form, or the min_hold marker) for pttl more milliseconds: then nothing is taken, and a key
-- this token held from an earlier attempt of the same request is given back.
-- Idempotent: a request resent after a lost reply finds its own keys and succeeds again
-- without drawing second fencing tokens.

local token, lease, fencing = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local n = #KEYS / 2
local ours = {}

for i = 1, n do
  local lock = KEYS[2 * i - 1]
  local kind = kind_of(lock)
  if kind == nil or free_of_dead_shares(lock, kind) then
    ours[i] = false
  elseif kind == 'exclusive' and redis.call('hexists', lock, token) == 1 then
    ours[i] = true
  else
    -- Busy: give back what an earlier attempt of this request may have taken.
    for j = 1, n do
      if ours[j] == nil and j > i then
        local other = KEYS[2 * j - 1]
        if kind_of(other) == 'exclusive' and redis.call('hexists', other, token) == 1 then
          ours[j] = true
        end
      end
      if ours[j] then
        redis.call('del', KEYS[2 * j - 1])
      end
    end
    return {0, i, busy_for(lock, kind)}
  end
end

local result = {1}
for i = 1, n do
  local lock = KEYS[2 * i - 1]
  if ours[i] then
    if redis.call('pttl', lock) < lease then
      redis.call('pexpire', lock, lease)
    end
    result[i + 1] = tonumber(redis.call('hget', lock, 'fence') or '0')
  else
    local fence = 0
    if fencing then
      fence = redis.call('incr', KEYS[2 * i])
      redis.call('hset', lock, token, 1, 'fence', fence)
    else
      redis.call('hset', lock, token, 1)
    end
    redis.call('pexpire', lock, lease)
    result[i + 1] = fence
  end
end
return result
