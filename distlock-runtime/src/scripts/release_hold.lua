-- Shared by the scripts that give back holds of exclusive locks: one hold, only if the
-- caller still owns the lock.
--
-- lock   the lock hash
-- window the timer of a min_hold window asked for by a nested hold (`<lock>:mh`, same hash
--        tag; declared by the caller)
-- wake   the lock's wake channel (same hash tag): told when the lock becomes free, and when
--        it is left as the min_hold marker, so that waiters learn the marker's PTTL
-- token  owner token
-- hold   hold id
-- keep   milliseconds the key must still live after this hold ends (min_hold); 0 deletes it
--        at once when this is the last hold (unless an earlier hold of the owner asked for a
--        min_hold, noted in the "min_hold" field and timed by `window`)
--
-- Returns 1 when the hold was given back (the last hold deletes the lock, or leaves it to
-- expire after `keep` ms with no owner), 0 when the caller did not hold the lock (its lease
-- expired, or another owner holds the key now: that lock is left alone).
-- Idempotent per hold id: a resent release of a hold already given back, while the owner
-- still holds the lock through other holds, succeeds without counting twice.
local function release_hold(lock, window, wake, token, hold, keep)

  -- Only this owner's own exclusive or write lock is touched; a key that is not a hash was
  -- not written by these scripts.
  local fields = redis.pcall('hmget', lock, 'mode', token, 'min_hold', 'h:' .. token)
  if fields['err'] then
    return 0
  end
  local mode, count, first = fields[1], tonumber(fields[2] or '0'), fields[4]
  if count == 0 or (mode and mode ~= 'write') then
    return 0
  end

  if count > 1 or hold ~= token or first then
    -- Nested holds carry markers: give back this one, once. The first hold's marker (set
    -- when nesting started) stays, at 0, once that hold is given back, so that a resent
    -- release of it is recognised while later holds keep the lock.
    if hold == token then
      if first == '0' then
        return 1
      end
      redis.call('hset', lock, 'h:' .. token, 0)
    elseif redis.call('hdel', lock, 'h:' .. hold) == 0 then
      return 1
    end
    count = redis.call('hincrby', lock, token, -1)
    if count > 0 then
      if keep > 0 then
        -- Holds of this owner remain: the lock lives at least until this hold's min_hold
        -- ends, and the last release leaves the marker for what is left of it, as timed by
        -- the window key <lock>:mh (same hash tag).
        if redis.call('pttl', lock) < keep then
          redis.call('pexpire', lock, keep)
        end
        if redis.call('pttl', window) < keep then
          redis.call('set', window, 1, 'PX', keep)
        end
        redis.call('hset', lock, 'min_hold', 1)
      end
      return 1
    end
  end

  if fields[3] then
    -- An earlier hold's min_hold may not have passed yet.
    keep = math.max(keep, redis.call('pttl', window))
    redis.call('del', window)
  end
  if keep > 0 then
    -- Nobody owns it any more, but no lock of any kind may be taken before min_hold has
    -- passed: the marker is a lock of its own kind, with no owner.
    redis.call('del', lock)
    redis.call('hset', lock, 'mode', 'min_hold')
    redis.call('pexpire', lock, keep)
    -- Waiters elsewhere look once more, learn when the marker ends, and take the lock then.
    announce(wake, '')
  else
    redis.call('del', lock)
    announce(wake, '')
  end
  return 1
end
