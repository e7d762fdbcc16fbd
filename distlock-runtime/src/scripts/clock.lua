-- Shared by the scripts that read or write the leases of read shares and permits: the
-- server's clock in milliseconds, read once per script. A share's lease is a field of the
-- lock's own hash that holds the time it ends at (see kind.lua), so no script needs a key
-- of its own per share.
local clock_now
local function server_now()
  if not clock_now then
    local clock = redis.call('time')
    clock_now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
  end
  return clock_now
end
