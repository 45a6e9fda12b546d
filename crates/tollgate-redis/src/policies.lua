#!lua
-- tollgate: the fleet's policy set, versioned and announced.
--
-- KEYS[1]  the hash of the set: field "version" (an integer, only ever
--          raised) and field "set" (its text)
-- ARGV[1]  "read", "publish", "publish_after" or "restore"
-- ARGV[2]  publish, publish_after, restore: the set's text
-- ARGV[3]  publish: the version the caller runs (the new version is above
--          it and above the one held); publish_after: the version the
--          change was made on; restore: the version the caller runs
-- ARGV[4]  the channel versions are announced on
--
-- A version that is not an integer (written by hand) counts as none.
--
-- Replies: read {version or false, text or false}; publish {1, the new
-- version}; publish_after {1, the new version}, or {0, the version held}
-- when the set changed since the caller read it (nothing written);
-- restore the version written (when Redis had none, an older one or a
-- broken one: it lost the set, say in a restart without persistence), or
-- 0 when it had this version or a newer one. Every write is announced.

local op = ARGV[1]
if op == "read" then
  return redis.call("HMGET", KEYS[1], "version", "set")
end
local held = tonumber(redis.call("HGET", KEYS[1], "version") or "")
if held == nil or held ~= math.floor(held) or held < 0 then
  held = 0
end
local mine = tonumber(ARGV[3])
local function write(version)
  redis.call("HSET", KEYS[1], "version", version, "set", ARGV[2])
  redis.call("PUBLISH", ARGV[4], version)
end
if op == "publish" then
  local version = math.max(held, mine) + 1
  write(version)
  return {1, version}
elseif op == "publish_after" then
  if held ~= mine then
    return {0, held}
  end
  write(held + 1)
  return {1, held + 1}
elseif op == "restore" then
  if held < mine then
    write(mine)
    return mine
  end
  return 0
end
return redis.error_reply("tollgate policies: unknown operation " .. tostring(op))
