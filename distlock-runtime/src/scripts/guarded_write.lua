-- Run the caller's own commands only while the caller still holds its locks: a guarded
-- write. The ownership check and the commands run in this one script, so nothing can take
-- the lock between them.
--
-- KEYS[1..h]   the locks the caller must hold, each in either form (see held_by.lua)
-- KEYS[h+1]    (with a receipt) the receipt key, in the first lock's slot
-- KEYS[...]    the commands' keys, in command order
-- ARGV[1]      h, the number of locks
-- ARGV[1+i]    the owner token that must hold KEYS[i]
-- ARGV[h+2]    the receipt's lifetime in milliseconds, "0" without a receipt
-- ARGV[h+3]    this call's nonce, which the receipt records
-- ARGV[h+4]    n, the number of commands
-- then, per command: its number of keys k, its number of other arguments a, its name, and
--   its a arguments; the command runs as `name KEYS(k) args(a)`.
--
-- Returns {1, {reply…}} when every lock was held and the commands ran; {0, i} when the lock
-- KEYS[i] was not held by its token (nothing ran); {-1, state} when the receipt was already
-- there (a nonce: the batch of that call ran; "0": it was withdrawn), and nothing ran.
-- A command that fails raises its error: the ones before it stay done, as with MULTI/EXEC.

local h = tonumber(ARGV[1])
for i = 1, h do
  if not held_by(KEYS[i], ARGV[1 + i]) then
    return {0, i}
  end
end

local key_at = h + 1
local receipt_ms = tonumber(ARGV[h + 2])
if receipt_ms > 0 then
  local receipt = KEYS[key_at]
  key_at = key_at + 1
  local state = redis.call('get', receipt)
  if state then
    return {-1, state}
  end
  redis.call('set', receipt, ARGV[h + 3], 'px', receipt_ms)
end

local at = h + 4
local count = tonumber(ARGV[at])
at = at + 1
local replies = {}
for c = 1, count do
  local n_keys, n_args = tonumber(ARGV[at]), tonumber(ARGV[at + 1])
  local command = {ARGV[at + 2]}
  at = at + 3
  for k = 1, n_keys do
    command[#command + 1] = KEYS[key_at]
    key_at = key_at + 1
  end
  for a = 1, n_args do
    command[#command + 1] = ARGV[at]
    at = at + 1
  end
  replies[c] = redis.call(unpack(command))
end
return {1, replies}
