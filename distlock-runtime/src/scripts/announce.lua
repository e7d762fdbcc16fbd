-- Shared by the scripts that publish wake-ups (after the line that names `publish`: PUBLISH,
-- or SPUBLISH on a Cluster with sharded pub/sub).

-- Publishes `message` on `channel`, a declared key's wake channel: how many subscribers heard
-- it. A wake-up that cannot be sent (a node without the command, a user not allowed it) is
-- lost, not the change it announces: the script's writes stand and its answer is the same;
-- waiters find the change by their timers.
local function announce(channel, message)
  local heard = redis.pcall(publish, channel, message)
  if type(heard) == 'number' then
    return heard
  end
  return 0
end
