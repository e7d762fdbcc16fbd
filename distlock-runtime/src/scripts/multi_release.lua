-- Give back a set of exclusive locks taken together, each only if the caller still owns it.
--
-- KEYS[2i-1]  a lock of the set
-- KEYS[2i]    that lock's wake channel (same hash tag): told when the lock becomes free
-- ARGV[1]     owner token of the set (its hold id too)
--
-- Returns one integer per lock: 1 given back, 0 not held by the token (its lease expired,
-- or another owner holds the key now: that lock is left alone).
-- Each lock is given back as release.lua gives back a first hold with no min_hold of its
-- own: nested holds of the same owner that are still open keep the lock (one hold fewer),
-- a min_hold left by one of them is honoured, and a resent release counts once.

local token = ARGV[1]
local result = {}

for i = 1, #KEYS / 2 do
  local lock, wake = KEYS[2 * i - 1], KEYS[2 * i]
  local window = lock .. ':mh'
  local fields = redis.pcall('hmget', lock, 'mode', token, 'min_hold')
  local count = 0
  if not fields['err'] and not (fields[1] and fields[1] ~= 'write') then
    count = tonumber(fields[2] or '0')
  end
  if count == 0 then
    result[i] = 0
  elseif count > 1 then
    -- Nested holds remain: give back this one, once.
    if redis.call('hdel', lock, 'h:' .. token) == 1 then
      redis.call('hincrby', lock, token, -1)
    end
    result[i] = 1
  else
    local keep = 0
    if fields[3] then
      keep = math.max(0, redis.call('pttl', window))
      redis.call('del', window)
    end
    redis.call('del', lock)
    if keep > 0 then
      redis.call('hset', lock, 'mode', 'min_hold')
      redis.call('pexpire', lock, keep)
    else
      redis.call('publish', wake, '')
    end
    result[i] = 1
  end
end
return result
