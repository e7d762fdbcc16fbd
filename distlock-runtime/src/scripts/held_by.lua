-- Shared by the scripts that check a holder (extend, renew, holds, guarded writes): whether
-- `token` owns the lock `key`, in either form — a hash with the token's field (for a read
-- share or permit, also a lease field "s:<token>" whose end has not passed, see kind.lua),
-- or the string form of a plain exclusive lock whose value is the token. Any other type is
-- owned by nobody here. Needs clock.lua.
local function held_by(key, token)
  local form = redis.call('type', key)['ok']
  if form == 'hash' then
    local fields = redis.call('hmget', key, token, 's:' .. token)
    if not fields[1] then
      return false
    end
    return not fields[2] or (tonumber(fields[2]) or 0) > server_now()
  elseif form == 'string' then
    return redis.call('get', key) == token
  end
  return false
end

-- Makes the lease of `token`'s share of `key` (if it has one) end no sooner than `lease` ms
-- from now, and the lock key live at least as long: a longer lease already set is kept.
-- The string form has no fields (its HGET answers an error): only its key's lease counts.
local function lengthen_hold(key, token, lease)
  local share = 's:' .. token
  local ends = redis.pcall('hget', key, share)
  ends = type(ends) == 'string' and tonumber(ends)
  if ends and ends < server_now() + lease then
    redis.call('hset', key, share, server_now() + lease)
  end
  if redis.call('pttl', key) < lease then
    redis.call('pexpire', key, lease)
  end
end
