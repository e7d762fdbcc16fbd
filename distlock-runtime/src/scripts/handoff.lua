-- Pass a plain exclusive lock (the string form) from its owner straight to the next owner,
-- if the caller still owns it: the release of a holder whose own manager has a task waiting
-- for the key. Nothing is published: the next owner is told by its manager. Servers with a
-- conditional SET (`SET … IFEQ`) use that instead.
--
-- KEYS[1]  the lock
-- ARGV[1]  the current owner's token
-- ARGV[2]  the next owner's token
-- ARGV[3]  the next owner's lease, in milliseconds
--
-- Returns 1 when handed over, 0 when the caller did not hold the lock (left alone).

-- A key of another type (a hash: another lock kind) answers an error here: not ours.
if redis.pcall('get', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3])
return 1
