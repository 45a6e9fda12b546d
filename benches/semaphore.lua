-- The peer for tollgate's in-flight leases (benches/leases.sh): a plain
-- counting semaphore. KEYS[1] the counter; ARGV[1] "acquire" or "release",
-- ARGV[2] the limit. No expiry: a holder that dies leaks its slot forever,
-- which is what leases exist to prevent.
if ARGV[1] == "acquire" then
  local n = redis.call("INCR", KEYS[1])
  if n > tonumber(ARGV[2]) then
    redis.call("DECR", KEYS[1])
    return 0
  end
  return 1
end
redis.call("DECR", KEYS[1])
return 1
