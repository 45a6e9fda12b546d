#!lua
-- tollgate: in-flight leases shared by a fleet, on Redis time.
--
-- KEYS[1]  the sorted set of the limit's leases (member: lease id, score:
--          expiry in ms of Redis time)
-- KEYS[2]  the sorted set of one key's leases, when the limit is per key
-- ARGV[1]  "acquire", "renew" or "release"
-- ARGV[2]  the lease id
-- ARGV[3]  the lease's time to live, in ms
-- ARGV[4]  acquire: at most this many leases in all (0: no bound)
-- ARGV[5]  acquire: at most this many per key (0: no bound)
--
-- Replies: acquire 0 granted, 1 the key is full, 2 the limit is full,
-- 3 both are full; renew 1 renewed, 2 taken again (it had expired or was
-- lost: its request still runs, so it counts again, even above the
-- bounds); release 1.
--
-- Every step first drops the leases that have expired, so a holder that
-- died stops counting one time to live after its last renewal. A set lives
-- as long as its longest lease (PEXPIREAT), so nothing is left behind. The
-- same id twice is one lease: a resent call takes nothing more. Needs
-- Redis 7 (PEXPIRETIME).

local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local op, id, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local keyed = KEYS[2] ~= nil

local function prune(k)
  redis.call("ZREMRANGEBYSCORE", k, "-inf", now)
end

-- The set lives until its longest lease ends: a lease just taken or
-- renewed ends at `now + ttl`, later than the set's expiry unless another
-- holder's lease is longer.
local function keep(k)
  local ends = now + ttl
  if redis.call("PEXPIRETIME", k) < ends then redis.call("PEXPIREAT", k, ends) end
end

if op == "acquire" then
  prune(KEYS[1])
  if keyed then prune(KEYS[2]) end
  local all_max, key_max = tonumber(ARGV[4]), tonumber(ARGV[5])
  local mine = redis.call("ZSCORE", KEYS[1], id)
  if not mine then
    local key_full = keyed and key_max > 0 and redis.call("ZCARD", KEYS[2]) >= key_max
    local all_full = all_max > 0 and redis.call("ZCARD", KEYS[1]) >= all_max
    if key_full and all_full then return 3 end
    if key_full then return 1 end
    if all_full then return 2 end
  end
  redis.call("ZADD", KEYS[1], now + ttl, id)
  keep(KEYS[1])
  if keyed then
    redis.call("ZADD", KEYS[2], now + ttl, id)
    keep(KEYS[2])
  end
  return 0
elseif op == "renew" then
  local score = redis.call("ZSCORE", KEYS[1], id)
  local held = score and tonumber(score) > now
  redis.call("ZADD", KEYS[1], now + ttl, id)
  keep(KEYS[1])
  if keyed then
    redis.call("ZADD", KEYS[2], now + ttl, id)
    keep(KEYS[2])
  end
  if held then return 1 end
  return 2
elseif op == "release" then
  redis.call("ZREM", KEYS[1], id)
  if keyed then redis.call("ZREM", KEYS[2], id) end
  return 1
end
return redis.error_reply("tollgate: unknown lease operation " .. tostring(op))
