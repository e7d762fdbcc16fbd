-- Shared by the acquire and release scripts: what form a lock key has.
--
-- A lock is a hash whose "mode" field names its kind: none for an exclusive lock, "write",
-- "read", "permits", or "min_hold" for the marker a released lock leaves for its min_hold
-- (owned by nobody). A key of any other type was not written by these scripts: it is busy
-- for every kind, and nothing here reads its fields, rewrites or deletes it.

-- nil when the key does not exist, "foreign" when it is not a hash, else the lock's kind.
local function kind_of(key)
  local form = redis.call('type', key)['ok']
  if form == 'none' then
    return nil
  elseif form ~= 'hash' then
    return 'foreign'
  end
  return redis.call('hget', key, 'mode') or 'exclusive'
end

-- The live shares of a read or permits lock. The field of a share whose own lease key has
-- ended is removed (that holder is gone); nothing else is touched.
local function live_shares(lock)
  local live = 0
  for _, field in ipairs(redis.call('hkeys', lock)) do
    if field ~= 'mode' and field ~= 'permits' and string.sub(field, 1, 2) ~= 'h:' then
      if redis.call('exists', lock .. ':s:' .. field) == 1 then
        live = live + 1
      else
        redis.call('hdel', lock, field)
      end
    end
  end
  return live
end

-- Whether `kind` is a read or permits lock whose every share has ended; such a lock is
-- deleted, so the key is free.
local function free_of_dead_shares(lock, kind)
  if (kind == 'read' or kind == 'permits') and live_shares(lock) == 0 then
    redis.call('del', lock)
    return true
  end
  return false
end

-- How long `lock`, held by someone else, stays as it is at most unless a release announces a
-- change: the time a waiter may sleep before it must look again. A read or permits lock
-- changes when the first of its live shares' leases ends (a permit frees; each share ends
-- alone, whatever the lock key's own lease, which outlasts them all); any other lock when its
-- own lease ends. The same answer as PTTL: -1 without expiry, -2 when the key is gone.
local function busy_for(lock, kind)
  if kind == 'read' or kind == 'permits' then
    local soonest = -1
    for _, field in ipairs(redis.call('hkeys', lock)) do
      if field ~= 'mode' and field ~= 'permits' and string.sub(field, 1, 2) ~= 'h:' then
        local left = redis.call('pttl', lock .. ':s:' .. field)
        if left >= 0 and (soonest < 0 or left < soonest) then
          soonest = left
        end
      end
    end
    if soonest >= 0 then
      return soonest
    end
  end
  return redis.call('pttl', lock)
end
