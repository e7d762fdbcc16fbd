-- Give back one hold of a share (read lock or semaphore permit).
--
-- KEYS[1]  the lock hash, whose fields hold every share (see kind.lua)
-- KEYS[2]  the lock's wake channel
-- ARGV[1]  owner token
-- ARGV[2]  hold id
--
-- Returns 1 when the hold was given back, 0 when the caller did not hold the share (its
-- lease ended: the share was already returned). Idempotent per hold id. Only a read or
-- permits lock that has this token's field is touched: a lock of another kind, or the
-- min_hold marker, is left alone.

local lock, token, hold = KEYS[1], ARGV[1], ARGV[2]

local fields = redis.pcall('hmget', lock, 'mode', token, 'h:' .. token, 's:' .. token)
if fields['err'] or (fields[1] ~= 'read' and fields[1] ~= 'permits') then
  return 0
end
local count = tonumber(fields[2] or '0')
if count == 0 then
  return 0
end
if (tonumber(fields[4] or '') or 0) <= server_now() then
  -- This share's lease ended: its fields go, as any dead share's would.
  drop_share(lock, token)
  return 0
end

local first = fields[3]
if count > 1 or hold ~= token or first then
  -- As in release.lua: the first hold's marker stays at 0 once that hold is given back.
  if hold == token then
    if first == '0' then
      return 1
    end
    redis.call('hset', lock, 'h:' .. token, 0)
  elseif redis.call('hdel', lock, 'h:' .. hold) == 0 then
    return 1
  end
  if redis.call('hincrby', lock, token, -1) > 0 then
    return 1
  end
end

-- The last hold: the first hold's marker (if holds ever nested) goes with the count.
drop_share(lock, token)

-- The lock goes when its last live share does.
if live_shares(lock) == 0 then
  redis.call('del', lock)
end
announce(KEYS[2], '')
return 1
