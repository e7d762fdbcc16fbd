-- Whether a token still holds its lock (a read share or permit: whether its lease lives),
-- for `LockGuard::is_held` on shares; the other kinds ask with one native command.
--
-- KEYS[1]  the lock
-- ARGV[1]  owner token
--
-- Returns 1 when held, 0 when not.

if held_by(KEYS[1], ARGV[1]) then
  return 1
end
return 0
