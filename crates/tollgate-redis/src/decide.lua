#!lua
--@ (Template: each @NAME@ below is a number the store shares with Rust, put in
--@ from the constant of that name in src/lua.rs when the store builds the
--@ script. Lines starting with "--@" are left out of the script.)
-- tollgate: one atomic decision for every charge of a request.
--
-- KEYS[i]   the Redis key of charge i
-- ARGV[1]   "s": time from the server's TIME; "i": injected (ARGV[2], ARGV[3])
-- ARGV[2]   injected seconds since the store epoch, ARGV[3] injected nanoseconds
-- ARGV[4]   the store epoch, in Unix seconds
-- ARGV[5]   "charge" (write only if every charge is admitted), "check" (never
--           write), "refund" (give back an earlier admission), "confirm"
--           (settle a reserved one as counted), "undo" (give back the
--           admissions of a call charged slot by slot and refused) or
--           "cancel" (give back a delayed call's reservations)
-- ARGV[5 + i] charge i: eight little-endian doubles (struct "<dddddddd"):
--           algorithm (1 token bucket, 2 fixed window, 3 sliding window),
--           p1, p2, p3, p4, need, then for refunds the window start (era,
--           offset) that the admission reported (for a token bucket's
--           reserved charge: when its epoch's reservations lapse, the
--           receipt; (0, 0) for a plain one, given back at once); in charge mode, a shaped
--           charge's longest wait in ns (0 unshaped) and 1 for a charge to
--           reserve (refundable), else 0; in cancel mode see below. The same
--           eight integers as text, joined by ":", are accepted too, for
--           tools that cannot send binary arguments (redis-benchmark); the
--           store always sends the packed form, which is cheaper to read.
--
-- All arithmetic is on integers below 2^53, exact in Lua's doubles (and in
-- their binary encoding): time is (era, offset) with eras of 4e6 s, so an
-- offset is below 4e15 ns and any difference of interest (validated horizons
-- are below 2e15 ns) is exact.
--
-- State: nine little-endian doubles, 72 bytes: (level, prior, era,
-- offset) and the numbers that wrote it (algorithm, p1..p4, as in a
-- charge); a token bucket with units reserved adds three, 96 bytes: the
-- units reserved in epoch k, those reserved in epoch k - 1, and k
-- (tollgate_budget's algorithm::State: epochs of MAX_RESERVATION from the
-- store epoch; an epoch's units lapse, as confirmed, when the epoch after
-- it ends). Binary because parsing and formatting text was most of the
-- script's cost. A key's state belongs to its policy's name and unit (the
-- key names them), not to its numbers: a charge with other numbers (a
-- plan upgrade, a limit changed at runtime) first carries the state over
-- by the rule of tollgate_budget's algorithm::carry_over, implemented in
-- `carry` below. States of 32 bytes, or text "level:prior:era:offset",
-- carry no numbers and are read as written under the charge's own. A
-- token bucket's prior is 0, or, while a request is held for later
-- (shaping), 1 plus how long after the state's time the last held request
-- is released: tollgate_budget's algorithm::State. Every write of the bucket
-- keeps it until then.
-- Reserved units (a charge kept only for some outcomes, not yet settled)
-- are taken from the level and keep the bucket below its capacity by as
-- much until they are settled or lapse (as confirmed): tollgate_budget's
-- algorithm::reserve. States of 88 bytes (an earlier layout: one count of
-- reserved units and when they lapse) are read as reserved in the epoch
-- of their time.
--
-- Reply: per charge {admitted 1/0, remaining, reset ns, retry ns, era, offset,
-- remaining before, reset before}: the last two describe the budget as it
-- stood before this charge, for a call that is refused as a whole (nothing
-- was spent, and every store describes its limits as they stand). A shaped
-- charge of a delayed call answers {2, remaining, reset ns, the call's delay
-- ns, the written state's era, offset, level and prior}, and after every
-- charge's eight come five per shaped charge: the state the reservation
-- replaced (1, level, prior, era, offset; or 0 and zeros when there was
-- none). Cancel answers {1 if given back, else 0; then zeros} per charge.

local ERA_SEC = @ERA_SECS@
local ERA_NS = @ERA_NS@
local HUGE = @HUGE_NS@

local floor = math.floor

local function idiv(a, b)
  if b == 1 then return a end
  local q = floor(a / b)
  while q * b > a do q = q - 1 end
  while (q + 1) * b <= a do q = q + 1 end
  return q
end

local function cdiv(a, b)
  if b == 1 then return a end
  local q = idiv(a, b)
  if q * b < a then q = q + 1 end
  return q
end

-- t1 - t2 in ns for t1 >= t2; HUGE when they are more than an era apart.
local function diff(e1, o1, e2, o2)
  if e1 == e2 then return o1 - o2 end
  if e1 == e2 + 1 then return ERA_NS + o1 - o2 end
  return HUGE
end

local function before(e1, o1, e2, o2)
  return e1 < e2 or (e1 == e2 and o1 < o2)
end

local function add(e, o, d)
  o = o + d
  while o >= ERA_NS do
    o = o - ERA_NS
    e = e + 1
  end
  return e, o
end

local function sub(e, o, d)
  o = o - d
  while o < 0 do
    o = o + ERA_NS
    e = e - 1
  end
  return e, o
end

-- How long a reservation may wait to be settled, at least, in seconds
-- (tollgate_budget's algorithm::MAX_RESERVATION): the length of an epoch.
local EPOCH_SEC = @MAX_RESERVATION_SECS@

-- The epoch of (e, o): whole epochs since the store epoch.
local function epoch_of(e, o)
  return idiv(e * ERA_SEC + idiv(o, 1000000000), EPOCH_SEC)
end

-- When epoch k starts.
local function epoch_start(k)
  local s = k * EPOCH_SEC
  local e = idiv(s, ERA_SEC)
  return e, (s - e * ERA_SEC) * 1000000000
end

-- A token bucket's credit after `el` ns at `num` units per ns, at most `cap`.
local function refill(credit, cap, num, el)
  if cap - credit > 0 then
    if el >= cdiv(cap - credit, num) then return cap end
    return credit + el * num
  end
  return credit
end

-- A sliding window's counts (previous, current) rolled forward to (fe, fo),
-- and where the current window then starts: windows tile time from (se, so).
local function roll(w, prev, cur, se, so, fe, fo)
  local k = idiv(math.min(diff(fe, fo, se, so), HUGE), w)
  if k == 1 then return cur, 0, add(se, so, w) end
  if k > 1 then return 0, 0, fe, fo end
  return prev, cur, se, so
end

local sec, nsec
if ARGV[1] == "s" then
  local t = redis.call("TIME")
  sec = tonumber(t[1]) - tonumber(ARGV[4])
  nsec = tonumber(t[2]) * 1000
else
  sec = tonumber(ARGV[2])
  nsec = tonumber(ARGV[3])
end
local NE = floor(sec / ERA_SEC)
local NO = (sec - NE * ERA_SEC) * 1000000000 + nsec
local mode = ARGV[5]
-- "undo" (the store's own undoing of a call charged slot by slot and
-- refused) is a refund that may also give back plain admissions (window
-- (0, 0)); a receipt's refund never does.
local undo = mode == "undo"
if undo then mode = "refund" end

-- A write that deletes: a refund that leaves no state.
local NONE = ""
local pending = {}
-- level, prior, era, offset and the numbers that wrote them (nil for a
-- state that carries none).
local function load(key)
  local v = pending[key]
  if v == nil then v = redis.call("GET", key) end
  if not v then return nil end
  -- (struct.unpack returns the next position after the values: dropped.)
  if #v == 72 then
    local l, p, e, o, a, q1, q2, q3, q4 = struct.unpack("<ddddddddd", v)
    return l, p, e, o, a, q1, q2, q3, q4, 0, 0, 0
  end
  if #v == 96 then
    return struct.unpack("<dddddddddddd", v)
  end
  if #v == 88 then
    local l, p, e, o, a, q1, q2, q3, q4, r = struct.unpack("<ddddddddddd", v)
    return l, p, e, o, a, q1, q2, q3, q4, r, 0, epoch_of(e, o)
  end
  if #v == 32 then
    local a, b, c, d = struct.unpack("<dddd", v)
    return a, b, c, d
  end
  local a, b, c, d = string.match(v, "^(%d+):(%d+):(%-?%d+):(%d+)$")
  if not a then return nil end
  return tonumber(a), tonumber(b), tonumber(c), tonumber(d)
end

local function state(level, prior, e, o, algo, p1, p2, p3, p4, rc, rp, k)
  if rc ~= nil and (rc > 0 or rp > 0) then
    return struct.pack("<dddddddddddd", level, prior, e, o, algo, p1, p2, p3, p4, rc, rp, k)
  end
  return struct.pack("<ddddddddd", level, prior, e, o, algo, p1, p2, p3, p4)
end

-- Exact integers beyond 2^53, for the rare carry-over whose products
-- exceed it: arrays of base-2^24 limbs, little endian. Every limb product
-- is below 2^48 and a cell sums at most a few, so all is exact.
local B24 = 16777216
local function big(a)
  local r = {}
  repeat
    local l = a % B24
    r[#r + 1] = l
    a = (a - l) / B24
  until a == 0
  return r
end
local function carries(r)
  local i = 1
  while i <= #r do
    local c = floor(r[i] / B24)
    if c ~= 0 then
      r[i] = r[i] - c * B24
      r[i + 1] = (r[i + 1] or 0) + c
    end
    i = i + 1
  end
  while #r > 1 and r[#r] == 0 do r[#r] = nil end
  return r
end
-- x times an integer b below 2^53.
local function bmul(x, b)
  local bl = big(b)
  local r = {}
  for i = 1, #x + #bl do r[i] = 0 end
  for i = 1, #x do
    for j = 1, #bl do
      r[i + j - 1] = r[i + j - 1] + x[i] * bl[j]
    end
    for k = i, i + #bl - 1 do
      local c = floor(r[k] / B24)
      r[k] = r[k] - c * B24
      r[k + 1] = r[k + 1] + c
    end
  end
  return carries(r)
end
local function badd(x, y)
  local r = {}
  for i = 1, math.max(#x, #y) do r[i] = (x[i] or 0) + (y[i] or 0) end
  return carries(r)
end
local function bcmp(x, y)
  if #x ~= #y then
    if #x < #y then return -1 end
    return 1
  end
  for i = #x, 1, -1 do
    if x[i] ~= y[i] then
      if x[i] < y[i] then return -1 end
      return 1
    end
  end
  return 0
end
-- The smallest v in [0, hi] with holds(v), or hi when none does.
local function least(hi, holds)
  local lo = 0
  if not holds(hi) then return hi end
  while lo < hi do
    local mid = lo + floor((hi - lo) / 2)
    if holds(mid) then hi = mid else lo = mid + 1 end
  end
  return lo
end

-- The longest debt a carried-over bucket keeps (tollgate_budget's
-- algorithm::MAX_CARRIED_DEBT), and the largest whole count carried.
local MAX_DEBT = @MAX_CARRIED_DEBT@
local MAX_COUNT = @MAX_COUNT@

-- How long an initially-empty bucket is kept once full (tollgate_budget's
-- algorithm::EMPTY_KEPT_FULL): until then it is full, not new.
local KEEP = @EMPTY_KEPT_FULL@

-- When the last request a bucket's state holds is released (nil: none).
local function hold_end(prior, se, so)
  if prior ~= nil and prior >= 1 then return add(se, so, prior - 1) end
end

-- The prior of a bucket's state dated (ae, ao) that keeps a hold ending at
-- (he, ho): none once that is not after now; one ending before the state's
-- time is kept as ending then.
local function hold_prior(he, ho, ae, ao)
  if he == nil or not before(NE, NO, he, ho) then return 0 end
  if before(he, ho, ae, ao) then return 1 end
  return 1 + diff(he, ho, ae, ao)
end

-- Reservations (tollgate_budget's algorithm::State): units reserved in an
-- epoch (MAX_RESERVATION long, counted from the store epoch) lapse, as
-- confirmed, when the epoch after it ends. A bucket keeps two counts: rc
-- reserved in epoch k, rp in epoch k - 1.

-- The ceilings of a bucket with (rc, rp, k), each with when it ends (nil:
-- never): the capacity less both counts until rp lapses, less rc until it
-- lapses, the capacity after (TokenBucket::ceilings).
local function ceilings(cap, rc, rp, k)
  local e1, o1 = epoch_start(k + 1)
  local e2, o2 = epoch_start(k + 2)
  return {{e1, o1, cap - math.min(rc + rp, cap)}, {e2, o2, cap - math.min(rc, cap)},
          {nil, nil, cap}}
end

-- The bucket (credit at (ce, co), rc, rp, k) grown to (te, to), not
-- before (ce, co): refilled within each ceiling while it holds, its
-- epochs moved on to (te, to)'s (TokenBucket::grown). Returns credit,
-- rc, rp, k.
local function grow(credit, ce, co, te, to, cap, num, rc, rp, k)
  if rc > 0 or rp > 0 then
    for _, c in ipairs(ceilings(cap, rc, rp, k)) do
      if not before(ce, co, te, to) then break end
      local ue, uo = te, to
      if c[1] ~= nil and before(c[1], c[2], te, to) then ue, uo = c[1], c[2] end
      if before(ce, co, ue, uo) then
        credit = refill(math.min(credit, c[3]), c[3], num, diff(ue, uo, ce, co))
        ce, co = ue, uo
      end
    end
  elseif before(ce, co, te, to) then
    credit = refill(credit, cap, num, diff(te, to, ce, co))
  end
  local kt = epoch_of(te, to)
  if rc == 0 and rp == 0 then return credit, 0, 0, kt end
  if kt == k + 1 then
    rc, rp = 0, rc
  elseif kt > k + 1 then
    rc, rp = 0, 0
  end
  if kt > k then k = kt end
  return credit, rc, rp, k
end

-- tollgate_budget's TokenBucket::level_at: a bucket's credit at now (or at
-- its own later time), that time, and its reservations then.
local function bucket_level(level, se, so, cap, num, rc, rp, k)
  local te, to = NE, NO
  if before(NE, NO, se, so) then te, to = se, so end
  local credit, rc2, rp2, k2 = grow(level, se, so, te, to, cap, num, rc, rp, k)
  return credit, te, to, rc2, rp2, k2
end

-- When the bucket at (credit, te, to) with (rc, rp, k) is full: not
-- before its reservations lapse (TokenBucket::full_of).
local function bucket_full(credit, te, to, cap, num, rc, rp, k)
  if rc == 0 and rp == 0 then return add(te, to, cdiv(cap - credit, num)) end
  local le, lo
  if rc > 0 then le, lo = epoch_start(k + 2) else le, lo = epoch_start(k + 1) end
  if before(le, lo, te, to) then le, lo = te, to end
  local at = grow(credit, te, to, le, lo, cap, num, rc, rp, k)
  return add(le, lo, cdiv(cap - at, num))
end

-- When need fits that bucket (TokenBucket::fits_at): reservations lapse,
-- as confirmed, if they must for the credit to grow that high.
local function bucket_fits(credit, te, to, cap, num, rc, rp, k, need)
  if credit >= need then return te, to end
  if rc == 0 and rp == 0 then return add(te, to, cdiv(need - credit, num)) end
  local ae, ao, ac, arc, arp, ak = te, to, credit, rc, rp, k
  for _, c in ipairs(ceilings(cap, rc, rp, k)) do
    if need <= c[3] then return add(ae, ao, cdiv(need - math.min(ac, c[3]), num)) end
    local ue, uo = c[1], c[2]
    if before(ue, uo, ae, ao) then ue, uo = ae, ao end
    ac, arc, arp, ak = grow(ac, ae, ao, ue, uo, cap, num, arc, arp, ak)
    ae, ao = ue, uo
  end
  return ae, ao
end

-- When a bucket's state (capacity cap, num units per ns, full_start 1 if
-- it starts full, reservations (rc, rp, k)) is idle: full (not before its
-- reservations lapse), a minute later for one that starts empty, and
-- never before its hold ends.
local function bucket_idle(level, prior, se, so, cap, num, full_start, rc, rp, k)
  local ie, io = bucket_full(level, se, so, cap, num, rc, rp, k)
  if full_start ~= 1 then ie, io = add(ie, io, KEEP) end
  local he, ho = hold_end(prior, se, so)
  if he ~= nil and before(ie, io, he, ho) then ie, io = he, ho end
  return ie, io
end
-- Under injected time Redis still expires keys on its own clock, which the
-- injected clock does not follow (a test may hold it still while real time
-- passes): a key could vanish before the injected clock reaches its idle
-- time. Expiry never changes a decision once a state is idle, so under
-- injected time keys live at least an hour of real time instead.
local MIN_TTL_MS = 1
if ARGV[1] == "i" then MIN_TTL_MS = @INJECTED_MIN_TTL_MS@ end

-- TTL in ms until (e, o), at least MIN_TTL_MS.
local function ttl(e, o)
  local d = diff(e, o, NE, NO)
  if before(e, o, NE, NO) then d = 0 end
  return math.max(MIN_TTL_MS, cdiv(d, 1000000))
end

-- A fresh bucket (capacity q1 units, q2 units per ns, q3 per token) at
-- now, lacking spent / per_token tokens (spent a bignum): credit when that
-- fits, else empty with the rest as a debt of refill time, at most MAX_DEBT.
local function into_bucket(spent, per_token, q1, q2, q3)
  local need = bmul(spent, q3)
  if bcmp(need, bmul(big(q1), per_token)) <= 0 then
    local units = least(q1, function(y) return bcmp(bmul(big(y), per_token), need) >= 0 end)
    return q1 - units, 0, NE, NO
  end
  local wait = least(MAX_DEBT, function(x)
    return bcmp(bmul(badd(big(q1), bmul(big(x), q2)), per_token), need) >= 0
  end)
  local e, o = add(NE, NO, wait)
  return 0, 0, e, o
end

-- The state written under numbers (oa, o1..o4) as read under (a, q1..q4):
-- tollgate_budget's algorithm::carry_over. Returns nothing for no state;
-- else level, prior, era, offset and the reservations carried (c, p, k).
local function carry(oa, o1, o2, o3, o4, level, prior, se, so, rc, rp, k, a, q1, q2, q3, q4)
  -- Brought to now under the numbers that wrote it: idle is no state.
  local ie, io
  if oa == 1 then
    ie, io = bucket_idle(level, prior, se, so, o1, o2, o4, rc, rp, k)
  elseif oa == 2 then
    ie, io = add(se, so, o2)
  elseif level > 0 then
    ie, io = add(se, so, 2 * o2)
  else
    ie, io = add(se, so, o2)
  end
  if not before(NE, NO, ie, io) then return end
  local te, to = NE, NO
  if before(NE, NO, se, so) then te, to = se, so end
  if (oa == 2 and a == 2) or (oa == 3 and a == 3 and o2 == q2) then
    return level, prior, se, so
  end
  -- Requests held for later under the old numbers: until when.
  local he, ho
  if oa == 1 then
    he, ho = hold_end(prior, se, so)
    if he ~= nil and not before(NE, NO, he, ho) then he, ho = nil, nil end
  end
  -- What was spent, in full: a bucket's missing units (for a state dated
  -- after now, the refill until then too), else whole units.
  local spent_units, spent
  if oa == 1 then
    if before(NE, NO, se, so) then
      spent_units = badd(big(o1 - math.min(level, o1)), bmul(big(diff(se, so, NE, NO)), o2))
    else
      -- What is reserved counts as spent (as if confirmed).
      spent_units = big(o1 - bucket_level(level, se, so, o1, o2, rc, rp, k))
    end
    if a == 1 then
      -- Reservations carry over as the same tokens in the new units (at
      -- most the new capacity), in the same epochs, so that a charge
      -- reserved before the change is still found when it is settled
      -- (TokenBucket::reservations_into).
      local kc, kp, kk = 0, 0, 0
      if rc > 0 or rp > 0 then
        local _, _, _, c2, p2, k2 = bucket_level(level, se, so, o1, o2, rc, rp, k)
        local tokens = idiv(q1, q3)
        kc = math.min(idiv(c2, o3), tokens) * q3
        kp = math.min(idiv(p2, o3), tokens) * q3
        if kc > 0 or kp > 0 then kk = k2 end
      end
      -- Requests held until later keep the new bucket empty until the
      -- later of their release and the debt, and keep the hold.
      local l, p, e, o = into_bucket(spent_units, o3, q1, q2, q3)
      if he ~= nil then
        if before(e, o, he, ho) then e, o = he, ho end
        return 0, 1, e, o, kc, kp, kk
      end
      return l, p, e, o, kc, kp, kk
    end
    spent = least(MAX_COUNT, function(z) return bcmp(bmul(big(z), o3), spent_units) >= 0 end)
  elseif oa == 2 then
    -- Not idle, so the window is still open.
    spent = level
  else
    local w = o2
    local prv, cur, ws_e, ws_o = roll(w, prior, level, se, so, te, to)
    local e = diff(te, to, ws_e, ws_o)
    spent = cdiv(prv * (w - e) + cur * w, w)
  end
  if a == 1 then
    return into_bucket(big(spent), 1, q1, q2, q3)
  end
  if spent == 0 then return end
  -- A window counting held requests opens no earlier than their release.
  if he ~= nil and before(te, to, he, ho) then te, to = he, ho end
  return spent, 0, te, to
end

local replies = {}
local nr = 0
local writes = {}
local converted = {}
local seen = {}
local created_now = {}
-- Shaping: per charge, a shaped token bucket's numbers and credit; whether
-- it was refused; the index of its write; whether a key repeats.
local buckets, refused, wrote, repeated = {}, {}, {}, false
-- Every shaped charge's longest wait (ns), shapable or not: none may be
-- held past its own.
local waits = {}
-- Initially-empty buckets a refused call found with room, as they stand:
-- written so that they are kept a minute from now (tollgate_budget's
-- algorithm::as_of).
local touches = {}
local all = true
local n = #KEYS

-- A charge's eight numbers. Packed doubles of algorithm 1..3 start with a
-- zero byte; the text form starts with the algorithm's digit.
local TEXT = "^(%d+):(%d+):(%d+):(%d+):(%d+):(%d+):(%-?%d+):(%d+)$"
local function charge_args(a)
  if #a == 64 and string.byte(a, 1) == 0 then
    return struct.unpack("<dddddddd", a)
  end
  local t = {string.match(a, TEXT)}
  for j = 1, 8 do t[j] = tonumber(t[j]) end
  return t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]
end

-- Refuse malformed arguments before anything is read or written.
for i = 1, n do
  local a = ARGV[5 + i]
  if a == nil or not ((#a == 64 and string.byte(a, 1) == 0) or string.match(a, TEXT)) then
    return redis.error_reply("tollgate: charge " .. i .. " is neither eight packed doubles nor eight numbers")
  end
end

-- Cancel: give back a delayed call's reservations, each only while its
-- key still holds the state the reservation wrote: the state it replaced
-- is put back (deleted when there was none), exactly as if the request
-- had never come. Per charge, ARGV[5 + i]: algorithm, p1..p3, the written
-- state's level and prior (in p4's and need's places) and (era, offset);
-- ARGV[5 + n + i]: 1 and the replaced state's level, prior, era and offset,
-- or 0 when the key had none, then zeros.
if mode == "cancel" then
  for i = 1, n do
    local a = ARGV[5 + n + i]
    if a == nil or not ((#a == 64 and string.byte(a, 1) == 0) or string.match(a, TEXT)) then
      return redis.error_reply("tollgate: cancel " .. i .. " has no replaced state")
    end
  end
  for i = 1, n do
    local key = KEYS[i]
    local algo, p1, p2, p3, wl, wp, we_, wo_ = charge_args(ARGV[5 + i])
    local had, bl, bp, be, bo = charge_args(ARGV[5 + n + i])
    local level, prior, se, so, oa, o1, o2, o3, o4 = load(key)
    local back = 0
    if level ~= nil and algo == 1 and oa == 1 and o1 == p1 and o2 == p2 and o3 == p3
        and level == wl and prior == wp and se == we_ and so == wo_ then
      if had == 1 then
        redis.call("SET", key, state(bl, bp, be, bo, oa, o1, o2, o3, o4), "PX",
                   ttl(bucket_idle(bl, bp, be, bo, p1, p2, o4, 0, 0, 0)))
      else
        redis.call("DEL", key)
      end
      back = 1
    end
    for j = 1, 8 do replies[(i - 1) * 8 + j] = 0 end
    replies[(i - 1) * 8 + 1] = back
  end
  return replies
end

for i = 1, n do
  local key = KEYS[i]
  local algo, p1, p2, p3, p4, need, re, ro = charge_args(ARGV[5 + i])
  if mode == "charge" and re > 0 then waits[i] = re end
  -- The first charge of the call on this key reads what is stored.
  local stored = not seen[key]
  seen[key] = true
  local level, prior, se, so, oa, o1, o2, o3, o4, rc, rp, rk = load(key)
  if rc == nil then rc, rp, rk = 0, 0, 0 end
  local carried = false
  if level ~= nil and oa ~= nil
      and not (oa == algo and o1 == p1 and o2 == p2 and o3 == p3 and o4 == p4) then
    level, prior, se, so, rc, rp, rk = carry(oa, o1, o2, o3, o4, level, prior, se, so,
                                             rc, rp, rk, algo, p1, p2, p3, p4)
    if rc == nil then rc, rp, rk = 0, 0, 0 end
    carried = true
    if stored and mode == "charge" then
      -- Written as converted unless this charge writes: the key is under
      -- the new numbers from its first charge, admitted or not.
      converted[#converted + 1] = {key, #writes, level, prior, se, so, algo, p1, p2, p3, p4,
                                   rc, rp, rk}
    end
  end
  -- A settlement under numbers the key no longer has leaves it alone, as
  -- the memory store does: the key stays under its own numbers (what was
  -- reserved carried over with it, reserved until it lapses) until a
  -- charge converts it. (An undo follows its own call's charge, on the
  -- numbers that charge wrote.)
  local unsettled = carried and not undo
  -- The state this charge finds (under its numbers): what a reservation
  -- puts back when its request is dropped.
  local found = {level, prior, se, so}
  local ok, remaining, reset, retry, we, wo = 0, 0, 0, 0, 0, 0
  local br, bt = 0, 0
  local write, idle_e, idle_o = nil, nil, nil

  if algo == 1 then
    -- Token bucket: p1 = capacity in scaled units, p2 = units per ns,
    -- p3 = units per token, p4 = 1 if a new bucket starts full.
    local cap, num, den = p1, p2, p3
    if level ~= nil and p4 == 0
        and not before(NE, NO, bucket_idle(level, prior, se, so, cap, num, 0, rc, rp, rk)) then
      -- Idle (full for a minute): an initially-empty bucket starts afresh,
      -- as one never seen (or expired) would.
      level = nil
    end
    -- Requests this bucket holds for later, until when (nil: none).
    local he, ho
    if level ~= nil then he, ho = hold_end(prior, se, so) end
    local stored_level = level
    -- The credit as it stands (at now, or at the state's own later time:
    -- a clock behind it refills nothing and moves nothing back), and its
    -- reservations then (counted in that time's epoch).
    local credit, te, to, nc, np, nk
    if level == nil then
      if p4 == 1 then credit = cap else credit = 0 end
      se, so, te, to, nc, np, nk = NE, NO, NE, NO, 0, 0, 0
    else
      credit, te, to, nc, np, nk = bucket_level(level, se, so, cap, num, rc, rp, rk)
    end
    local lead = diff(te, to, NE, NO)
    local fe, fo = bucket_full(credit, te, to, cap, num, nc, np, nk)
    br, bt = idiv(credit, den), diff(fe, fo, NE, NO)
    -- What shaping needs: the credit at (te, to), and how long it may wait.
    -- (A bucket with reservations written is not shaped.)
    if re > 0 and mode == "charge" and num <= den and rc == 0 and rp == 0 then
      buckets[i] = {credit = credit, te = te, to = to, cap = cap, num = num, den = den,
                    need = need, wait = re, numbers = {algo, p1, p2, p3, p4}, found = found}
    end
    -- A state written now with reservations (c, p, k).
    local function keeping(lv, kept, c, p, k)
      return state(lv, kept, te, to, algo, p1, p2, p3, p4, c, p, k),
             bucket_idle(lv, kept, te, to, cap, num, p4, c, p, k)
    end
    local held = he ~= nil and before(NE, NO, he, ho)
    if mode == "refund" or mode == "confirm" then
      ok = 1
      if stored_level == nil or unsettled then
        -- No state: nothing to give back or settle.
      elseif undo and re == 0 and ro == 0 then
        -- A plain admission given back at once (a call charged slot by
        -- slot and refused): the cost back as of now, up to what the
        -- bucket may hold; a state dated later (a debt) owes less;
        -- nothing while requests are held for later.
        if not held then
          local top = cap - math.min(nc + np, cap)
          local back = need
          local le, lo = NE, NO
          if lead > 0 then
            local covers = idiv(math.min(credit, top) + back, num)
            if covers >= lead then
              back = math.min(top, math.min(credit, top) + back - lead * num)
            else
              le, lo = add(NE, NO, lead - covers)
              back = 0
            end
          else
            back = math.min(top, credit + back)
          end
          write = NONE
          if back < cap or p4 == 0 or nc + np > 0 then
            write = state(back, 0, le, lo, algo, p1, p2, p3, p4, nc, np, nk)
          end
          idle_e, idle_o = bucket_idle(back, 0, le, lo, cap, num, p4, nc, np, nk)
        end
      elseif not (mode == "refund" and held) then
        -- A reservation settled before it lapsed: given back (refund) or
        -- counted (confirm); either way no longer reserved. The receipt
        -- is when its epoch's reservations lapse: they are counted in nc
        -- while that epoch is nk, in np while it is the one before.
        local ck = epoch_of(re, ro) - 2
        local c, p = nc, np
        if ck == nk and c >= need then
          c = c - need
        elseif ck + 1 == nk and p >= need then
          p = p - need
        else
          c = nil
        end
        if c ~= nil then
          local lv = credit
          -- Capped at the capacity less what stays reserved (reached only
          -- by reservations carried into a smaller bucket, as a debt).
          if mode == "refund" then lv = math.min(credit + need, cap - math.min(c + p, cap)) end
          write, idle_e, idle_o = keeping(lv, hold_prior(he, ho, te, to), c, p, nk)
        end
      end
    elseif credit >= need then
      if p4 == 0 and stored_level ~= nil and mode == "charge" and stored and not carried then
        local as_is, ie, io = keeping(credit, hold_prior(he, ho, te, to), nc, np, nk)
        touches[#touches + 1] = {key, as_is, ie, io}
      end
      local left = credit - need
      local kept = hold_prior(he, ho, te, to)
      if ro == 1 and mode == "charge" then
        -- Reserved in this epoch: settled later, or lapsing when the
        -- next one ends; the reply carries when (the receipt).
        nk = epoch_of(te, to)
        nc = nc + need
        we, wo = epoch_start(nk + 2)
      end
      local xe, xo = bucket_full(left, te, to, cap, num, nc, np, nk)
      ok, remaining, reset = 1, idiv(left, den), diff(xe, xo, NE, NO)
      write, idle_e, idle_o = keeping(left, kept, nc, np, nk)
    else
      remaining = idiv(credit, den)
      reset = bt
      local ge, go = bucket_fits(credit, te, to, cap, num, nc, np, nk, need)
      retry = diff(ge, go, NE, NO)
      if level == nil and p4 == 0 then
        -- Record when an initially-empty bucket was created (spends
        -- nothing); a later charge of this call on the key sees it, also
        -- when nothing is written.
        local created = state(0, 0, NE, NO, algo, p1, p2, p3, p4)
        pending[key] = created
        if mode == "charge" then
          redis.call("SET", key, created, "PX", ttl(bucket_idle(0, 0, NE, NO, cap, num, 0, 0, 0, 0)))
          created_now[key] = true
        end
      end
    end
  elseif algo == 2 then
    -- Fixed window anchored at the first admission: p1 = limit, p2 = window ns.
    local limit, w = p1, p2
    local count, ws_e, ws_o = 0, NE, NO
    local open = false
    if level ~= nil and (before(NE, NO, se, so) or diff(NE, NO, se, so) < w) then
      count, ws_e, ws_o = level, se, so
      open = true
    end
    local ee, eo = add(ws_e, ws_o, w)
    local left_ns = 0
    if before(NE, NO, ee, eo) then left_ns = diff(ee, eo, NE, NO) end
    -- As it stands: a window not yet opened (or over) is full now.
    br, bt = math.max(0, limit - count), 0
    if open then bt = left_ns end
    if mode == "confirm" then
      ok = 1
    elseif mode == "refund" then
      ok = 1
      if level ~= nil and not unsettled and re == ws_e and ro == ws_o and count >= need then
        write = NONE
        if count > need then write = state(count - need, 0, ws_e, ws_o, algo, p1, p2, p3, p4) end
        idle_e, idle_o = ee, eo
      end
    elseif count + need <= limit then
      ok, remaining, reset = 1, limit - count - need, left_ns
      write = state(count + need, 0, ws_e, ws_o, algo, p1, p2, p3, p4)
      idle_e, idle_o = ee, eo
      we, wo = ws_e, ws_o
    else
      remaining, reset, retry = math.max(0, limit - count), left_ns, left_ns
    end
  else
    -- Sliding window counter anchored at the first admission:
    -- p1 = limit, p2 = window ns.
    local limit, w = p1, p2
    local cur, prev = 0, 0
    if level ~= nil then cur, prev = level, prior else se, so = NE, NO end
    local fe, fo = NE, NO
    if before(NE, NO, se, so) then fe, fo = se, so end
    prev, cur, se, so = roll(w, prev, cur, se, so, fe, fo)
    local e = diff(fe, fo, se, so)
    local lead = diff(fe, fo, NE, NO)
    local function until_idle(p, c)
      local span
      if c > 0 then span = 2 * w elseif p > 0 then span = w else return 0, NE, NO end
      local xe, xo = add(se, so, span)
      local d = 0
      if before(NE, NO, xe, xo) then d = diff(xe, xo, NE, NO) end
      return d, xe, xo
    end
    local weighted = prev * (w - e) + cur * w
    br = idiv(math.max(0, limit * w - weighted), w)
    bt = until_idle(prev, cur)
    if mode == "confirm" then
      ok = 1
    elseif mode == "refund" then
      ok = 1
      if level ~= nil and not unsettled then
        if re == se and ro == so and cur >= need then
          cur = cur - need
        else
          local pe, po = add(re, ro, w)
          if pe == se and po == so and prev >= need then prev = prev - need end
        end
        write = NONE
        if cur + prev > 0 then write = state(cur, prev, se, so, algo, p1, p2, p3, p4) end
        local _, xe, xo = until_idle(prev, cur)
        idle_e, idle_o = xe, xo
      end
    elseif weighted + need * w <= limit * w then
      cur = cur + need
      local d, xe, xo = until_idle(prev, cur)
      ok, remaining, reset = 1, idiv(limit * w - (prev * (w - e) + cur * w), w), d
      write = state(cur, prev, se, so, algo, p1, p2, p3, p4)
      idle_e, idle_o = xe, xo
      we, wo = se, so
    else
      remaining = idiv(math.max(0, limit * w - weighted), w)
      reset = until_idle(prev, cur)
      -- Smallest wait until prev*(w-e') + (cur+need)*w <= limit*w.
      local wait
      if cur + need <= limit and prev > 0 then
        local allowed = idiv((limit - cur - need) * w, prev)
        local need_e = math.max(0, w - allowed)
        if need_e < w then wait = math.max(0, need_e - e) end
      end
      if wait == nil then
        local to_next = w - e
        if cur == 0 then
          wait = to_next
        else
          local need_e = math.max(0, w - idiv((limit - need) * w, cur))
          if need_e < w then wait = to_next + need_e else wait = to_next + w end
        end
      end
      retry = lead + wait
    end
  end

  if ok == 0 then all = false end
  refused[i] = ok == 0
  if not stored then repeated = true end
  if write ~= nil then
    pending[key] = write
    writes[#writes + 1] = {key, write, idle_e, idle_o}
    wrote[i] = #writes
  end
  replies[nr + 1], replies[nr + 2], replies[nr + 3] = ok, remaining, reset
  replies[nr + 4], replies[nr + 5], replies[nr + 6] = retry, we, wo
  replies[nr + 7], replies[nr + 8] = br, bt
  nr = nr + 8
end

-- Shaping (tollgate_budget's charge_at): a call refused only by shaped
-- buckets that fit within their waits is admitted as delayed until the
-- latest of their earliest fits, when that is within every shaped
-- bucket's wait; every shaped bucket is charged as of that instant, the
-- other charges now. A key that repeats is not shaped.
if mode == "charge" and not all and not repeated and next(buckets) ~= nil then
  local fits, re_e, re_o = true, NE, NO
  for i = 1, n do
    if refused[i] then
      local b = buckets[i]
      if b == nil then fits = false break end
      local fe, fo = NE, NO
      if b.credit < b.need then fe, fo = add(b.te, b.to, cdiv(b.need - b.credit, b.num)) end
      if diff(fe, fo, NE, NO) > b.wait then fits = false break end
      if before(re_e, re_o, fe, fo) then re_e, re_o = fe, fo end
    end
  end
  -- Every shaped bucket is held until the release: none past its own
  -- longest wait (the release may be another bucket's later fit).
  if fits then
    for _, w in pairs(waits) do
      if diff(re_e, re_o, NE, NO) > w then fits = false break end
    end
  end
  if fits then
    local delay = diff(re_e, re_o, NE, NO)
    for i, b in pairs(buckets) do
      local span = 0
      if before(b.te, b.to, re_e, re_o) then span = diff(re_e, re_o, b.te, b.to) end
      local level, ae, ao = 0, b.te, b.to
      if span > idiv(b.cap - b.credit, b.num) then
        -- Full before the release: what it may use now is the capacity
        -- less the refill still to come.
        if span <= idiv(b.cap - b.need, b.num) then
          level = b.cap - span * b.num - b.need
        else
          ae, ao = add(b.te, b.to, span - idiv(b.cap - b.need, b.num))
        end
      elseif b.credit >= b.need then
        level = b.credit - b.need
      else
        ae, ao = add(b.te, b.to, cdiv(b.need - b.credit, b.num))
      end
      -- Held until the release, or an earlier reservation's later one:
      -- the hold tollgate_budget's charge_at writes in `prior`.
      -- (A release not after the bucket's own time, a clock behind it, is
      -- decided as now: only the hold it had.)
      local he, ho
      if span > 0 then he, ho = re_e, re_o end
      local f = b.found
      if f[1] ~= nil then
        local fe, fo = hold_end(f[2], f[3], f[4])
        if fe ~= nil and (he == nil or before(he, ho, fe, fo)) then he, ho = fe, fo end
      end
      local held = hold_prior(he, ho, ae, ao)
      local nb = b.numbers
      local w = {KEYS[i], state(level, held, ae, ao, nb[1], nb[2], nb[3], nb[4], nb[5]),
                 bucket_idle(level, held, ae, ao, b.cap, b.num, nb[5], 0, 0, 0)}
      if wrote[i] then writes[wrote[i]] = w else writes[#writes + 1] = w end
      local lead = 0
      if before(NE, NO, ae, ao) then lead = diff(ae, ao, NE, NO) end
      local r = (i - 1) * 8
      replies[r + 1], replies[r + 2] = 2, idiv(level, b.den)
      replies[r + 3], replies[r + 4] = lead + cdiv(b.cap - level, b.num), delay
      replies[r + 5], replies[r + 6], replies[r + 7] = ae, ao, level
      replies[r + 8] = held
    end
    -- After every charge's eight: per shaped bucket, in charge order, the
    -- state it replaced (1, level, prior, era, offset; or five zeros).
    local nr = n * 8
    for i = 1, n do
      local b = buckets[i]
      if b ~= nil then
        local f = b.found
        if f[1] ~= nil then
          replies[nr + 1], replies[nr + 2], replies[nr + 3] = 1, f[1], f[2]
          replies[nr + 4], replies[nr + 5] = f[3], f[4]
        else
          for j = 1, 5 do replies[nr + j] = 0 end
        end
        nr = nr + 5
      end
    end
    all = true
  end
end

if mode == "charge" and not all and not repeated then
  for _, t in ipairs(touches) do
    redis.call("SET", t[1], t[2], "PX", ttl(t[3], t[4]))
  end
end

if (mode == "charge" and all) or mode == "refund" or mode == "confirm" then
  for _, wr in ipairs(writes) do
    if wr[2] == NONE then
      redis.call("DEL", wr[1])
    else
      redis.call("SET", wr[1], wr[2], "PX", ttl(wr[3], wr[4]))
    end
  end
end

-- States carried over to new numbers by a charge that writes nothing
-- (refused, or in a refused call): written converted, spending nothing.
-- `c[2]` is how many writes came before its charge: its own write, if
-- any, is the next one and only lands when the call is admitted.
local landed = {}
if all then
  for _, wr in ipairs(writes) do landed[wr[1]] = true end
end
for _, c in ipairs(converted) do
  -- A key that was written, or an initially-empty bucket created in place
  -- of an idle state, is converted already.
  if not landed[c[1]] and not created_now[c[1]] then
    local key, level, prior, se, so = c[1], c[3], c[4], c[5], c[6]
    if level == nil then
      redis.call("DEL", key)
    else
      local a, q1, q2 = c[7], c[8], c[9]
      local rc, rp, rk = c[12], c[13], c[14]
      local ie, io
      if a == 1 then
        ie, io = bucket_idle(level, prior, se, so, q1, q2, c[11], rc, rp, rk)
      elseif a == 2 or level == 0 then
        ie, io = add(se, so, q2)
      else
        ie, io = add(se, so, 2 * q2)
      end
      redis.call("SET", key, state(level, prior, se, so, a, q1, q2, c[10], c[11], rc, rp, rk),
                 "PX", ttl(ie, io))
    end
  end
end
return replies
