-- Remove a lock whatever holds it, and say what was removed (`LockManager::force_release`,
-- the inspector's `release --force`). One script: what it reports is exactly what it
-- deleted, even while holders come and go around it.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the lock's fencing counter (read, never deleted: tokens keep increasing)
-- KEYS[3]  the timer of a min_hold window
-- KEYS[4]  a waiting writer's intent
-- KEYS[5]  the lock's wake channel
--
-- Returns {form, pttl, counter, fields, shares}: the key's type ("none": nothing was there
-- and nothing was removed), its PTTL, the fencing counter (false when never drawn), the
-- string's value or the hash's fields and values in turn, and for every field that has a
-- live share: its token, the share's PTTL and the share's value.

local lock, fence, timer, intent, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local form = redis.call('type', lock)['ok']
local pttl = redis.call('pttl', lock)
local counter = redis.call('get', fence)
if form == 'none' then
  return {form, pttl, counter, {}, {}}
end

local fields, shares = {}, {}
if form == 'string' then
  fields = {redis.call('get', lock)}
elseif form == 'hash' then
  fields = redis.call('hgetall', lock)
  for at = 1, #fields, 2 do
    local field = fields[at]
    if field ~= 'mode' and field ~= 'permits' and field ~= 'fence' and field ~= 'min_hold'
        and string.sub(field, 1, 2) ~= 'h:' then
      local share = lock .. ':s:' .. field
      local left = redis.call('pttl', share)
      if left ~= -2 then
        table.insert(shares, field)
        table.insert(shares, left)
        table.insert(shares, redis.call('get', share) or false)
        redis.call('del', share)
      end
    end
  end
end

redis.call('del', lock, timer, intent)
redis.call('publish', wake, '')
return {form, pttl, counter, fields, shares}
