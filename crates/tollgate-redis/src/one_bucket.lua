#!lua
--@ (Template: each @NAME@ below is a number the store shares with Rust, put in
--@ from the constant of that name in src/lua.rs when the store builds the
--@ script. Lines starting with "--@" are left out of the script.)
-- tollgate: the common decision alone — one token-bucket charge, not
-- shaped, of a bucket that starts full, on a key whose state (if any) was
-- written under the same numbers. It decides exactly as decide.lua does
-- for that call (the same arithmetic, the same state, TTL and reply
-- values) with a fraction of its work. For anything it does not cover it
-- writes nothing and answers an empty reply: the store then sends the call
-- to decide.lua. Both scripts may run on one key in any order.
--
-- KEYS[1]   the Redis key of the charge
-- ARGV[1]   the charge, packed (or as text) as for decide.lua (its
--           ARGV[5 + i])
-- ARGV[2], ARGV[3]  injected time (seconds since the store epoch,
--           nanoseconds); absent: the server's TIME
--
-- Reply: the values of decide.lua's reply that a single charge's decision
-- reads, as little-endian doubles in one string (Redis turns a string into
-- its reply for a fraction of what a table of integers costs it): 16 bytes
-- (remaining, reset ns) when admitted, 24 (remaining, reset ns, retry ns)
-- when refused, and "" when decide.lua must decide.

local floor = math.floor

local a = ARGV[1]
local algo, cap, num, den, full, need, wait
if #a == 64 then algo, cap, num, den, full, need, wait = struct.unpack("<ddddddd", a) end
if algo ~= 1 then
  -- The same numbers as text joined by ":", as decide.lua accepts them,
  -- for tools that cannot send binary arguments (redis-benchmark). Text
  -- never unpacks to algorithm 1: its first byte would be zero.
  local t = {string.match(a, "^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):%d+$")}
  if not t[7] then return "" end
  algo, cap, num, den = tonumber(t[1]), tonumber(t[2]), tonumber(t[3]), tonumber(t[4])
  full, need, wait = tonumber(t[5]), tonumber(t[6]), tonumber(t[7])
end
if algo ~= 1 or full ~= 1 or wait ~= 0 then return "" end

-- Time as decide.lua keeps it: (era of 4e6 s, ns within it). Arithmetic
-- on the strings converts them once (tonumber would parse twice).
local sec, nsec, min_ttl
if ARGV[2] then
  -- Under injected time keys live at least an hour (see decide.lua).
  sec, nsec, min_ttl = ARGV[2] + 0, ARGV[3] + 0, @INJECTED_MIN_TTL_MS@
else
  local t = redis.call("TIME")
  sec, nsec, min_ttl = t[1] - @EPOCH_UNIX_SECS@, t[2] * 1000, 1
end
local ne = floor(sec / @ERA_SECS@)
local no = (sec - ne * @ERA_SECS@) * 1000000000 + nsec

local key = KEYS[1]
local v = redis.call("GET", key)
-- No state: a full bucket, now. Else the state refilled to now; a clock
-- behind the state's time refills nothing and moves nothing back (lead:
-- how far the state is ahead of now).
local credit, te, to, lead = cap, ne, no, 0
if v then
  if #v ~= 72 then return "" end
  local level, prior, se, so, oa, o1, o2, o3, o4 = struct.unpack("<ddddddddd", v)
  -- (A bucket holding requests for later keeps its hold: decide.lua.)
  if oa ~= 1 or o1 ~= cap or o2 ~= num or o3 ~= den or o4 ~= 1 or se > ne or prior ~= 0 then
    return ""
  end
  local el
  if se < ne then
    -- decide.lua's diff: more than an era apart is HUGE (refills fully).
    if se + 1 == ne then el = @ERA_NS@ + no - so else el = @HUGE_NS@ end
  elseif so <= no then
    el = no - so
  else
    te, to, lead, el = se, so, so - no, 0
  end
  -- decide.lua's refill: full once el >= ceil((cap - level) / num) ns.
  -- Compared as el * num >= cap - level, which is the same test: a
  -- product below 2^53 is exact, and one above it is above cap.
  credit = level
  if credit < cap then
    local gained = el * num
    if gained >= cap - credit then credit = cap else credit = credit + gained end
  end
end

-- Divisions are decide.lua's exact ones (a floor corrected by products
-- below 2^53), written out: a Lua function call costs this script more
-- than the arithmetic.
if credit >= need then
  local left = credit - need
  -- reset = lead + ceil((cap - left) / num)
  local x, q = cap - left, floor((cap - left) / num)
  while q * num > x do q = q - 1 end
  while (q + 1) * num <= x do q = q + 1 end
  if q * num < x then q = q + 1 end
  local reset = lead + q
  -- Idle (full) after `reset` ns: the key lives ceil(reset / 1e6) ms.
  local ms = floor(reset / 1000000)
  while ms * 1000000 > reset do ms = ms - 1 end
  while (ms + 1) * 1000000 <= reset do ms = ms + 1 end
  if ms * 1000000 < reset then ms = ms + 1 end
  if ms < min_ttl then ms = min_ttl end
  -- remaining = floor(left / den)
  q = floor(left / den)
  while q * den > left do q = q - 1 end
  while (q + 1) * den <= left do q = q + 1 end
  redis.call("SET", key, struct.pack("<ddddddddd", left, 0, te, to, 1, cap, num, den, 1),
             "PX", string.format("%d", ms))
  return struct.pack("<dd", q, reset)
end

-- Refused: nothing is written.
local function idiv(x, y)
  local q = floor(x / y)
  while q * y > x do q = q - 1 end
  while (q + 1) * y <= x do q = q + 1 end
  return q
end
local function cdiv(x, y)
  local q = idiv(x, y)
  if q * y < x then q = q + 1 end
  return q
end
return struct.pack("<ddd", idiv(credit, den), lead + cdiv(cap - credit, num),
                   lead + cdiv(need - credit, num))
