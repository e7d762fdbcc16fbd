-- Give back one hold of a share (read lock or semaphore permit).
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the share's lease key
-- KEYS[3]  the lock's wake channel
-- ARGV[1]  owner token
-- ARGV[2]  hold id
--
-- Returns 1 when the hold was given back, 0 when the caller did not hold the share (its
-- lease ended: the share was already returned). Idempotent per hold id.

local lock, share, token, hold = KEYS[1], KEYS[2], ARGV[1], ARGV[2]

local count = tonumber(redis.call('hget', lock, token) or '0')
if count == 0 or redis.call('exists', share) == 0 then
  redis.call('hdel', lock, token)
  return 0
end

if count > 1 or hold ~= token then
  if redis.call('hdel', lock, 'h:' .. hold) == 0 then
    return 1
  end
  if redis.call('hincrby', lock, token, -1) > 0 then
    return 1
  end
end

redis.call('hdel', lock, token)
redis.call('del', share)

-- The lock goes when its last live share does.
local live = 0
for _, field in ipairs(redis.call('hkeys', lock)) do
  if field ~= 'mode' and string.sub(field, 1, 2) ~= 'h:' then
    if redis.call('exists', lock .. ':s:' .. field) == 1 then
      live = live + 1
    else
      redis.call('hdel', lock, field)
    end
  end
end
if live == 0 then
  redis.call('del', lock)
end
redis.call('publish', KEYS[3], '')
return 1
