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
-- string's value or the hash's fields and values in turn, for every live share (its lease
-- field "s:<token>" ends in the future, see kind.lua) its token, the milliseconds left of its
-- lease and its fencing token (false without one), and 1 when the lock was removed (0: it
-- was not there, or its holders were not the expected ones). Every share lives in the lock's
-- hash, so removing the lock removes them all.

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
  fields = redis.call('hgetall', lock)
  local values = {}
  for at = 1, #fields, 2 do
    values[fields[at]] = fields[at + 1]
  end
  local shared = values['mode'] == 'read' or values['mode'] == 'permits'
  local now = server_now()
  for at = 1, #fields, 2 do
    local field = fields[at]
    local prefix = string.sub(field, 1, 2)
    if field ~= 'mode' and field ~= 'permits' and field ~= 'fence' and field ~= 'min_hold'
        and prefix ~= 'h:' and prefix ~= 's:' and prefix ~= 'f:' then
      local ends = tonumber(values['s:' .. field] or '')
      if ends and ends > now then
        table.insert(shares, field)
        table.insert(shares, ends - now)
        table.insert(shares, text(values['f:' .. field]))
      end
      if (ends and ends > now) or not shared then
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

redis.call('del', lock, timer, intent)
announce(wake, '')
return {form, pttl, counter, fields, shares, 1}
