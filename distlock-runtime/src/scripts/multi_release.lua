-- Give back a set of exclusive locks taken together, each only if the caller still owns it.
--
-- KEYS[2i-1]  a lock of the set
-- KEYS[2i]    that lock's wake channel (same hash tag): told when the lock becomes free
-- ARGV[1]     owner token of the set (also its hold id: a set is always a first hold)
--
-- Returns one integer per lock: 1 given back, 0 not held by the token (its lease expired,
-- or another owner holds the key now: that lock is left alone). Each lock is given back as
-- release.lua gives back a first hold without a min_hold of its own.

local token = ARGV[1]
local result = {}
for i = 1, #KEYS / 2 do
  result[i] = release_hold(KEYS[2 * i - 1], KEYS[2 * i], token, token, 0)
end
return result
