-- Shared by extend.lua and renew.lua: whether `token` owns the lock `key`, in either form —
-- a hash with the token's field, or the string form of a plain exclusive lock whose value
-- is the token. Any other type is owned by nobody here.
local function held_by(key, token)
  local form = redis.call('type', key)['ok']
  if form == 'hash' then
    return redis.call('hexists', key, token) == 1
  elseif form == 'string' then
    return redis.call('get', key) == token
  end
  return false
end
