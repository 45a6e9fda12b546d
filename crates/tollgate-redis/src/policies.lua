#!lua
-- tollgate: the fleet's policy set, versioned and announced.
--
-- KEYS[1]  the hash of the set: field "version" (an integer, only ever
--          raised) and field "set" (its text)
-- ARGV[1]  "read", "publish", "publish_after" or "restore" ("numbers",
--          on another key, is described where it is handled)
-- ARGV[2]  publish, publish_after, restore: the set's text
-- ARGV[3]  publish: the version the caller runs (the new version is above
--          it and above the one held); publish_after: the version the
--          change was made on; restore: the version the caller runs
-- ARGV[4]  the channel versions are announced on
--
-- A version that is not up to 15 decimal digits (written by hand) counts
-- as none.
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
if op == "numbers" then
  -- Which numbers each instance charges a budget under, to see instances
  -- that charge one budget under different numbers.
  --
  -- KEYS[1]  the hash of numbers: field "BUDGET\nINSTANCE", value
  --          "AT SINCE QUIET SETTLE FINGERPRINT LABEL" (server
  --          milliseconds: when the instance last said so, since when it
  --          has had these numbers, after how long without a word it is
  --          gone, and how long a publication may take to reach it; the
  --          fingerprint of its numbers; a label, its fleet version)
  -- ARGV[2]  this instance; ARGV[3] after how many ms without a word it
  --          is gone (its own period, three times); ARGV[4] how many ms
  --          numbers must have been in force on both sides before a
  --          difference counts (a publication still on its way is no
  --          mismatch: the longer of the two instances' own)
  -- ARGV[5..] triples: budget, fingerprint, label
  --
  -- Writes this instance's numbers and drops what is gone (each record by
  -- its own writer's period, at most ten minutes; a record dated more
  -- than a minute ahead of the server is garbage) or unreadable. Replies
  -- per budget given, in order: {how many other instances charge it
  -- under other numbers, the label of one of them or false}. Another
  -- instance counts only if it spoke after this one's numbers came into
  -- force: an instance stopped before that (whose record has not aged
  -- out yet) is not taken for one that runs other numbers.
  local t = redis.call("TIME")
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local me = ARGV[2]
  local quiet, settle = math.min(tonumber(ARGV[3]), 600000), math.min(tonumber(ARGV[4]), 600000)
  local function parse(v)
    local at, since, q, st, fp, label =
      string.match(v, "^(%d+) (%d+) (%d+) (%d+) (%S+) ?(.*)$")
    if at == nil then return nil end
    return tonumber(at), tonumber(since), math.min(tonumber(q), 600000),
           math.min(tonumber(st), 600000), fp, label
  end
  local ours, order = {}, {}
  for i = 5, #ARGV - 2, 3 do
    local budget, fp, label = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    local field = budget .. "\n" .. me
    local since = now
    local old = redis.call("HGET", KEYS[1], field)
    if old then
      local _, s, _, _, f = parse(old)
      if f == fp and s ~= nil and s <= now then since = s end
    end
    redis.call("HSET", KEYS[1], field,
               now .. " " .. since .. " " .. quiet .. " " .. settle .. " " .. fp .. " " .. label)
    ours[budget] = {fp = fp, since = since, others = 0, label = false}
    order[#order + 1] = budget
  end
  local all = redis.call("HGETALL", KEYS[1])
  for i = 1, #all, 2 do
    local budget, who = string.match(all[i], "^(.*)\n(.*)$")
    local at, since, q, st, fp, label = parse(all[i + 1])
    if budget == nil or at == nil or at < now - q or at > now + 60000 then
      redis.call("HDEL", KEYS[1], all[i])
    elseif who ~= me then
      local o = ours[budget]
      local wait = math.max(settle, st or 0)
      if o ~= nil and fp ~= o.fp and at >= o.since
          and o.since <= now - wait and since <= now - wait then
        o.others = o.others + 1
        o.label = label
      end
    end
  end
  redis.call("PEXPIRE", KEYS[1], math.max(2 * quiet, redis.call("PTTL", KEYS[1])))
  local reply = {}
  for _, budget in ipairs(order) do
    reply[#reply + 1] = ours[budget].others
    reply[#reply + 1] = ours[budget].label
  end
  return reply
end
-- A version is up to 15 decimal digits (exact in Lua's numbers and in
-- Rust's u64 alike); anything else (written by hand: "1e3", "inf", " 12")
-- counts as none.
local function version_of(text)
  if text == nil or text == false or not string.match(text, "^%d+$") or #text > 15 then
    return 0
  end
  return tonumber(text)
end
local MAX_VERSION = 999999999999999
local held = version_of(redis.call("HGET", KEYS[1], "version"))
local mine = version_of(ARGV[3])
if (op == "publish" or op == "publish_after") and math.max(held, mine) >= MAX_VERSION then
  return redis.error_reply("tollgate policies: no version is left above " .. MAX_VERSION)
end
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
