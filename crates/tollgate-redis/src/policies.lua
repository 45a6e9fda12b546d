#!lua
-- tollgate: the fleet's policy set, versioned and announced.
--
-- KEYS[1]  the hash of the set: field "version" (an integer, only ever
--          raised) and field "set" (its text)
-- ARGV[1]  "read", "publish" or "restore"
-- ARGV[2]  publish, restore: the set's text
-- ARGV[3]  restore: the version the caller runs
-- ARGV[4]  publish, restore: the channel the version is announced on
--
-- Replies: read {version or false, text or false}; publish the new version
-- (the old one plus one, written with the text in one step, then
-- announced); restore the version written (when Redis had none, or an
-- older one: it lost the set, say in a restart without persistence), or
-- 0 when it had this version or a newer one.

local op = ARGV[1]
if op == "read" then
  return redis.call("HMGET", KEYS[1], "version", "set")
elseif op == "publish" then
  local version = redis.call("HINCRBY", KEYS[1], "version", 1)
  redis.call("HSET", KEYS[1], "set", ARGV[2])
  redis.call("PUBLISH", ARGV[4], version)
  return version
elseif op == "restore" then
  local held = tonumber(redis.call("HGET", KEYS[1], "version") or "0")
  local mine = tonumber(ARGV[3])
  if held < mine then
    redis.call("HSET", KEYS[1], "version", ARGV[3], "set", ARGV[2])
    redis.call("PUBLISH", ARGV[4], ARGV[3])
    return mine
  end
  return 0
end
return redis.error_reply("tollgate policies: unknown operation " .. tostring(op))
