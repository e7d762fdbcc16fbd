-- A fair lock: a plain exclusive lock (the string form, value = owner token) with a queue of
-- waiters in arrival order, shared by every process. A release grants the lock to the head of
-- the queue in the same step; nobody else can take it meanwhile.
--
-- KEYS[1]  the lock
-- KEYS[2]  the queue: a list of entries, oldest first
-- KEYS[3]  the entries' leases: a sorted set, entry -> the server time (ms) it ends at
-- KEYS[4]  the lock's wake channel: told about every grant and every release
-- ARGV[1]  "take" or "release"
-- ARGV[2]  the caller's owner token
-- ARGV[3]  the caller's queue entry, `<manager id>:<lease ms>:<token>`
-- ARGV[4]  the caller's manager id
-- ARGV[5]  how long a lock granted to a waiter of another manager stays held unclaimed (ms)
--
-- take, ARGV[6] the lease (ms), ARGV[7] the entry's lease (ms), ARGV[8] "1" to join the queue
--   when the lock is not granted now:
--   {1, 0} held (taken now, or granted earlier by a release: the lease starts over);
--   {0, the holder's pttl} not held (queued, if asked to; a queued entry's lease starts over).
-- release: the caller's entry leaves the queue if it is still there (a waiter giving up),
--   and if the caller holds the lock (taken, or granted by a release meanwhile), the lock
--   goes to the head: {0, 0} the caller did not hold the lock (left alone); {1, heard}
--   released to nobody (the queue is empty) and `heard` subscribers heard it; {2, token}
--   granted to the head, whose owner token this is.
--
-- An entry whose lease ended (its waiter died or stopped asking) leaves the queue before
-- anything else happens, so a dead waiter never holds the queue up. The queue's keys expire
-- with the last live entry's lease.

local lock, queue, leases, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local op, token, entry, manager_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local unclaimed = tonumber(ARGV[5])

local clock = redis.call('time')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

for _, dead in ipairs(redis.call('zrangebyscore', leases, '-inf', now)) do
  redis.call('lrem', queue, 1, dead)
  redis.call('zrem', leases, dead)
end

-- Grants the lock to the oldest live entry and tells it: its own manager's waiter gets its
-- whole lease (that manager hands the grant over at once), another's a short one until it
-- claims the lock. Returns the new owner's token, or nil when nobody waits.
local function grant_head()
  local head = redis.call('lpop', queue)
  if not head then
    return nil
  end
  redis.call('zrem', leases, head)
  local owner_manager, lease, owner = string.match(head, '^([^:]*):(%d+):(.*)$')
  lease = tonumber(lease)
  if owner_manager ~= manager_id and lease > unclaimed then
    lease = unclaimed
  end
  redis.call('set', lock, owner, 'px', lease)
  announce(wake, '=' .. owner)
  return owner
end

-- Gives the caller's lock to the head, or frees it.
local function release()
  local next_owner = grant_head()
  if next_owner then
    return {2, next_owner}
  end
  redis.call('del', lock)
  return {1, announce(wake, manager_id)}
end

-- A key of another type (a hash: another lock kind) answers an error here: held, not ours.
local value = redis.pcall('get', lock)
if type(value) == 'table' then
  value = true
end

-- Its entry, if it is still queued (a list scan only then).
local function dequeue()
  if redis.call('zrem', leases, entry) == 1 then
    redis.call('lrem', queue, 1, entry)
  end
end

if op == 'release' then
  -- A holder has no entry (taking the lock took it out): only a waiter giving up has one.
  if value == token then
    return release()
  end
  dequeue()
  return {0, 0}
end

-- take
local lease, entry_lease = tonumber(ARGV[6]), tonumber(ARGV[7])
if value == token then
  redis.call('pexpire', lock, lease)
  dequeue()
  return {1, 0}
end
if not value then
  local head = redis.call('lindex', queue, 0)
  if not head or head == entry then
    if head then
      redis.call('lpop', queue)
      redis.call('zrem', leases, entry)
    end
    redis.call('set', lock, token, 'px', lease)
    return {1, 0}
  end
  -- Free, but owed to the head: grant it now rather than wait for the head to ask.
  grant_head()
end
if ARGV[8] == '1' then
  -- A new entry goes to the back; a queued one keeps its place, with its lease renewed.
  if redis.call('zadd', leases, 'nx', now + entry_lease, entry) == 1 then
    redis.call('rpush', queue, entry)
  else
    redis.call('zadd', leases, 'xx', now + entry_lease, entry)
  end
  if redis.call('pttl', queue) < entry_lease then
    redis.call('pexpire', queue, entry_lease)
    redis.call('pexpire', leases, entry_lease)
  end
end
return {0, redis.call('pttl', lock)}
