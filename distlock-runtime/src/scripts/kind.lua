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

-- A read or permits lock keeps every share in its own hash: "<token>" -> the share's hold
-- count, "s:<token>" -> the server time (ms, see clock.lua) its lease ends at, "f:<token>" ->
-- its fencing token (when one was drawn), "h:<token>" -> its first-hold marker once holds
-- nest. A share whose end has passed is gone (that holder died or stopped renewing), whatever
-- the other shares' leases; the lock key itself lives at least as long as its last share.
-- Nothing here touches a key other than the lock: a slot migration moves a lock and all its
-- shares together.

-- Removes the fields of `token`'s share (not the markers of its nested holds, which name
-- other hold ids and go with the lock).
local function drop_share(lock, token)
  redis.call('hdel', lock, token, 's:' .. token, 'f:' .. token, 'h:' .. token)
end

-- The live shares of a read or permits lock, and how long until the first of them ends
-- (nil when none is live). The fields of a share whose lease has ended are removed; nothing
-- else is touched.
local function scan_shares(lock)
  local now = server_now()
  local live, soonest = 0, nil
  local fields = redis.call('hgetall', lock)
  for at = 1, #fields, 2 do
    local field = fields[at]
    if string.sub(field, 1, 2) == 's:' then
      local left = (tonumber(fields[at + 1]) or 0) - now
      if left > 0 then
        live = live + 1
        if not soonest or left < soonest then
          soonest = left
        end
      else
        drop_share(lock, string.sub(field, 3))
      end
    end
  end
  return live, soonest
end

-- The number of live shares of a read or permits lock (dead ones are removed).
local function live_shares(lock)
  local live = scan_shares(lock)
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
    local _, soonest = scan_shares(lock)
    if soonest then
      return soonest
    end
  end
  return redis.call('pttl', lock)
end
