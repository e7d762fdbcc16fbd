-- Give back a set of exclusive locks taken together, each only if the caller still owns it.
--
-- KEYS[3i-2]  a lock of the set
-- KEYS[3i-1]  that lock's min_hold window timer (same hash tag)
-- KEYS[3i]    that lock's wake channel (same hash tag): told when the lock becomes free
-- ARGV[1]     owner token of the set (also its hold id: a set is always a first hold)
-- ARGV[1+i]   milliseconds lock i must still live (a min_hold of a hold nested in the set's;
--             "0" deletes it at once)
--
-- Returns one integer per lock: 1 given back, 0 not held by the token (its lease expired,
-- or another owner holds the key now: that lock is left alone). Each lock is given back as
-- release.lua gives back a first hold.

local token = ARGV[1]
local result = {}
for i = 1, #KEYS / 3 do
  result[i] = release_hold(KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], token, token,
    tonumber(ARGV[1 + i]))
end
return result
