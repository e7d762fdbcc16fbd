-- Remove a lock whatever holds it, and say what was removed (`LockManager::force_release`,
-- the inspector's `release --force`). One script: what it reports is exactly what it
-- deleted, even while holders come and go around it.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the lock's fencing counter (read, never deleted: tokens keep increasing)
-- KEYS[3]  the timer of a min_hold window
-- KEYS[4]  a waiting writer's intent
-- KEYS[5]  the lock's wake channel
-- ARGV[1]  '1': remove only if the lock's holders are exactly ARGV[2..] (the ones an operator
--          confirmed); anything else: remove whatever holds it
-- ARGV[2..] the expected holders' tokens
--
-- Returns {form, pttl, counter, fields, shares, removed}: the key's type ("none": nothing
-- was there), its PTTL, the fencing counter (false when never drawn or not a string), the
-- string's value or the hash's fields and values in turn, for every field that has a live
-- share its token, the share's PTTL and the share's value, and 1 when the lock was removed
-- (0: it was not there, or its holders were not the expected ones).

local lock, fence, timer, intent, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

-- A string value, or false for anything else (another type's key answers an error).
local function text(reply)
  if type(reply) == 'string' then
    return reply
  end
  return false
end

local form = redis.call('type', lock)['ok']
local pttl = redis.call('pttl', lock)
local counter = text(redis.pcall('get', fence))
if form == 'none' then
  return {form, pttl, counter, {}, {}, 0}
end

local fields, shares, holders = {}, {}, {}
if form == 'string' then
  local value = redis.call('get', lock)
  fields = {value}
  holders[value] = true
elseif form == 'hash' then
  local mode = redis.call('hget', lock, 'mode')
  local shared = mode == 'read' or mode == 'permits'
  for _, field in ipairs(redis.call('hkeys', lock)) do
    table.insert(fields, field)
    table.insert(fields, redis.call('hget', lock, field))
    if field ~= 'mode' and field ~= 'permits' and field ~= 'fence' and field ~= 'min_hold'
        and string.sub(field, 1, 2) ~= 'h:' then
      local left = redis.call('pttl', lock .. ':s:' .. field)
      if left ~= -2 then
        table.insert(shares, field)
        table.insert(shares, left)
        table.insert(shares, text(redis.pcall('get', lock .. ':s:' .. field)))
      end
      if left ~= -2 or not shared then
        holders[field] = true
      end
    end
  end
end

if ARGV[1] == '1' then
  local expected = 0
  for at = 2, #ARGV do
    if not holders[ARGV[at]] then
      return {form, pttl, counter, fields, shares, 0}
    end
    expected = expected + 1
  end
  local present = 0
  for _ in pairs(holders) do
    present = present + 1
  end
  if present ~= expected then
    return {form, pttl, counter, fields, shares, 0}
  end
end

for at = 1, #shares, 3 do
  redis.call('del', lock .. ':s:' .. shares[at])
end
redis.call('del', lock, timer, intent)
redis.call(publish, wake, '')
return {form, pttl, counter, fields, shares, 1}
