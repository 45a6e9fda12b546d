-- The peer for benches/redis.sh: a plain hand-rolled GCRA limiter, the kind
-- of script a team writes for itself. KEYS[1] holds the theoretical arrival
-- time (TAT) in microseconds; ARGV[1] = emission interval (us per unit),
-- ARGV[2] = burst tolerance (us), ARGV[3] = cost.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call("GET", KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + tonumber(ARGV[1]) * tonumber(ARGV[3])
local allow_at = new_tat - tonumber(ARGV[2])
if allow_at > now then
  return {0, allow_at - now}
end
redis.call("SET", KEYS[1], string.format("%.0f", new_tat), "PX", math.ceil((new_tat - now) / 1000))
return {1, 0}
