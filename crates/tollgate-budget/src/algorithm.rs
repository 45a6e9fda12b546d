//! The algorithms as pure functions of (state, now, policy, cost).
//!
//! Storage only has to make the read-modify-write of [`decide`] atomic; the
//! time comes from whoever calls it. All arithmetic is in integers (`u64`
//! state; `u128` intermediates where a product can exceed 64 bits), so every
//! boundary is exact.
//!
//! A clock reading earlier than the one a state was written at is treated as
//! that state's own time: no credit is minted and the state never moves back.

use std::time::Duration;

use crate::{Algorithm, Decision, Initial, Nanos, Policy, TokenBucket};

pub use crate::state::State;

/// The result of one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// What the policy answered.
    pub decision: Decision,
    /// The state to store: the charged state when admitted; on a refusal,
    /// `Some` only when an initially-empty token bucket is first seen (its
    /// creation time must be recorded, or a client polling faster than one
    /// refill step would be refused forever; recording it spends nothing).
    /// A store must write a refusal's `next` even when another charge of the
    /// same call was refused, and an admission's only when all were admitted.
    pub next: Option<State>,
    /// When the state to keep (the new one, or the old one when unchanged)
    /// becomes indistinguishable from no state at all, so it can be dropped.
    pub idle_at: Nanos,
}

/// How long an initially-empty token bucket ([`Initial::Empty`]) is kept
/// once it has refilled to full: 60 s. A bucket that starts full is the
/// same as no state once full, and is forgotten then; one that starts
/// empty is not (a key never seen starts empty), so forgetting it at once
/// would refuse a client that waited exactly its `Retry-After` (which is
/// rounded up to whole seconds, so the bucket may have filled meanwhile)
/// and start it empty again, forever for a cost equal to the capacity. A
/// key away for longer than this after its bucket filled starts empty
/// again, as a new key does: a finite memory, and finite Redis TTLs.
pub const EMPTY_KEPT_FULL: Nanos = 60_000_000_000;

/// How long a reservation ([`reserve`]) may wait to be settled, at least:
/// reservations are counted by epochs of this length (60 s), and an
/// epoch's units still reserved when the epoch after it ends lapse, as
/// confirmed (they stay spent, and the bucket refills to its whole
/// capacity again): between one and two minutes after their charge. A
/// request in flight for longer keeps its charge whatever its outcome; a
/// caller that dies before it settles (or a settlement that is lost)
/// holds nothing for longer, whatever is reserved after it.
pub const MAX_RESERVATION: Nanos = 60_000_000_000;

/// When the last request a token bucket's state holds for later is
/// released (see [`State`]), if any.
pub fn hold_end(state: State) -> Option<Nanos> {
    (state.prior != 0).then(|| state.at.saturating_add(state.prior - 1))
}

/// A token bucket's `prior` for a state dated `at` whose held requests are
/// released at `hold` (none once that is not after `now`). A hold ending
/// before `at` is kept as ending at `at`: later, never earlier.
fn hold_prior(hold: Option<Nanos>, at: Nanos, now: Nanos) -> u64 {
    match hold {
        Some(end) if end > now => end.saturating_sub(at).saturating_add(1),
        _ => 0,
    }
}

/// The `prior` a token bucket's new state dated `at` keeps from `state`.
#[inline(always)]
fn kept_hold(state: Option<State>, at: Nanos, now: Nanos) -> u64 {
    match state {
        Some(s) if s.prior != 0 => hold_prior(hold_end(s), at, now),
        _ => 0,
    }
}

fn ns(n: u128) -> Duration {
    Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
}

fn sat(n: u128) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Decides `cost` against `policy` given the key's stored `state` (`None`
/// if the key has none) at time `now`.
///
/// A `cost` of zero is treated as one; [`crate::Charge`] never carries zero.
#[inline]
pub fn decide(policy: &Policy, state: Option<State>, now: Nanos, cost: u64) -> Step {
    let cost = cost.max(1);
    if cost > policy.capacity() {
        return never_fits(policy, state, now, cost);
    }
    match policy.algorithm() {
        Algorithm::TokenBucket(b) => token_bucket(b, state, now, cost),
        Algorithm::FixedWindow(w) => fixed_window(w.limit, w.window, state, now, cost),
        Algorithm::SlidingWindow(w) => sliding_window(w.limit, w.window, state, now, cost),
    }
}

/// [`decide`] for a charge whose cost fits (the caller checked), with its
/// state: what a store's hot path asks, inlined there for token buckets.
#[inline(always)]
pub(crate) fn decide_fitting(policy: &Policy, state: State, now: Nanos, cost: u64) -> Step {
    match policy.algorithm() {
        Algorithm::TokenBucket(b) => token_bucket(b, Some(state), now, cost.max(1)),
        _ => decide(policy, Some(state), now, cost),
    }
}

#[cold]
fn never_fits(policy: &Policy, state: Option<State>, now: Nanos, cost: u64) -> Step {
    Step {
        decision: Decision::never_fitting(cost, policy.capacity()),
        next: None,
        idle_at: state.map_or(now, |_| idle_at(policy, state, now)),
    }
}

/// The budget as it stands at `now`, without charging: the units available
/// and the time until fully restored, as an [admitted](Decision::admitted)
/// description. Used to describe limits that were not spent because another
/// limit of the same call refused.
pub fn describe(policy: &Policy, state: Option<State>, now: Nanos) -> Decision {
    let state = match *policy.algorithm() {
        Algorithm::TokenBucket(b) => b.unless_idle(state, now),
        _ => state,
    };
    let s = match state {
        Some(s) => s,
        None => {
            let remaining = match *policy.algorithm() {
                Algorithm::TokenBucket(b) if b.initial == Initial::Empty => 0,
                _ => policy.capacity(),
            };
            let reset = if remaining == 0 {
                policy.window()
            } else {
                Duration::ZERO
            };
            return Decision::admitted(remaining, reset);
        }
    };
    match *policy.algorithm() {
        Algorithm::TokenBucket(p) => {
            let l = p.level_at(s, now);
            Decision::admitted(p.tokens(l.credit), Duration::from_nanos(p.full_of(l) - now))
        }
        Algorithm::FixedWindow(w) => {
            let (limit, window) = (w.limit, w.window);
            let end = s.at.saturating_add(window);
            if now < end {
                Decision::admitted(
                    limit.saturating_sub(s.level),
                    Duration::from_nanos(end - now),
                )
            } else {
                Decision::admitted(limit, Duration::ZERO)
            }
        }
        Algorithm::SlidingWindow(w) => {
            let sl = Slide::new(w.limit, w.window, Some(s), now);
            Decision::admitted(sl.remaining(sl.prev, sl.cur), ns(sl.until(sl.prev, sl.cur)))
        }
    }
}

/// When `state` stops mattering, without charging anything.
pub fn idle_at(policy: &Policy, state: Option<State>, now: Nanos) -> Nanos {
    match state {
        Some(s) => idle_since(policy.algorithm(), s),
        None => now,
    }
}

/// When `s` becomes indistinguishable from no state under `algorithm`.
pub(crate) fn idle_since(algorithm: &Algorithm, s: State) -> Nanos {
    match *algorithm {
        Algorithm::TokenBucket(p) => {
            let full = p.full_of(p.level_at(s, s.at));
            let idle = match p.initial {
                Initial::Full => full,
                Initial::Empty => full.saturating_add(EMPTY_KEPT_FULL),
            };
            match hold_end(s) {
                Some(end) => idle.max(end),
                None => idle,
            }
        }
        Algorithm::FixedWindow(w) => s.at.saturating_add(w.window),
        Algorithm::SlidingWindow(w) => {
            let windows = if s.level > 0 { 2 } else { 1 };
            sat(u128::from(s.at) + windows * u128::from(w.window))
        }
    }
}

/// Shaping, for token buckets: the earliest time at or after `now` when
/// `cost` fits `policy` given `state`, or `None` when the policy cannot
/// shape it (not a token bucket, a cost above the capacity, or a refill
/// faster than one token per nanosecond, whose reservations could not be
/// told from credit).
pub fn earliest_fit(policy: &Policy, state: Option<State>, now: Nanos, cost: u64) -> Option<Nanos> {
    let Algorithm::TokenBucket(p) = *policy.algorithm() else {
        return None;
    };
    if cost > p.capacity || p.numerator > p.denominator || p.reserving(state) {
        return None;
    }
    let (credit, t) = p.credit_at(state, now);
    let need = cost * p.denominator;
    Some(if credit >= need {
        now
    } else {
        t.saturating_add(p.refill.div_ceil(need - credit))
    })
}

/// Shaping, for token buckets: `cost` charged as of `at` (at or after its
/// [`earliest_fit`]), decided now. The state written keeps the bucket
/// exact on release times: what a request released at `at` takes is
/// taken from the credit the bucket will have then, and nothing released
/// before `at` can use it. It is dated now (or at the state's own later
/// time); a reservation beyond the credit is a debt, written as an empty
/// bucket until the instant the debt is repaid, so that every later
/// charge waits behind it. Panics never; a `cost` that does not fit at
/// `at` is decided as now.
pub fn charge_at(policy: &Policy, state: Option<State>, now: Nanos, at: Nanos, cost: u64) -> Step {
    let Algorithm::TokenBucket(p) = *policy.algorithm() else {
        return decide(policy, state, now, cost);
    };
    let (credit, t) = p.credit_at(state, now);
    let need = cost.saturating_mul(p.denominator);
    if at <= t
        || credit.saturating_add((at - t).saturating_mul(p.numerator)) < need
        || p.reserving(state)
    {
        return decide(policy, state, now, cost);
    }
    // What the bucket holds at `at` is at most its capacity: seen from `t`,
    // the credit it may use now is that, less the refill still to come
    // (negative when the bucket will have filled up by `at`).
    let refill = i128::try_from(u128::from(at - t) * u128::from(p.numerator)).unwrap_or(i128::MAX);
    let held = i128::from(credit).min(i128::from(p.cap()).saturating_sub(refill));
    // Requests are held until `at`, or until an earlier reservation's
    // later release: every state written until then says so (see `State`).
    let hold = Some(match state.and_then(hold_end) {
        Some(end) => end.max(at),
        None => at,
    });
    let mut next = match u64::try_from(held - i128::from(need)) {
        Ok(left) => State {
            level: left,
            at: t,
            ..State::default()
        },
        Err(_) => {
            // A debt: empty until it has refilled, which is when the
            // request is released (or earlier, when the bucket would be
            // full before then).
            let debt = i128::from(need).saturating_sub(held).unsigned_abs();
            State {
                at: t.saturating_add(sat(debt.div_ceil(u128::from(p.numerator)))),
                ..State::default()
            }
        }
    };
    next.prior = hold_prior(hold, next.at, now);
    Step {
        decision: describe(policy, Some(next), now),
        next: Some(next),
        idle_at: idle_since(policy.algorithm(), next),
    }
}

/// Decides `cost` as [`decide`] does, as a charge to be settled later
/// ([`confirm`] or [`refund`]: kept only for some outcomes). A token
/// bucket's admission is also *reserved*: taken from the credit as usual,
/// and counted in the state's `reserved` units (see [`State`]) until it is
/// settled, or lapses [`MAX_RESERVATION`] after the charge, as confirmed.
/// Windows count it as usual (what a refund takes back is known by the
/// window it was counted in).
pub fn reserve(policy: &Policy, state: Option<State>, now: Nanos, cost: u64) -> Step {
    let mut step = decide(policy, state, now, cost);
    if let (Algorithm::TokenBucket(p), true, Some(next)) = (
        policy.algorithm(),
        step.decision.is_admitted(),
        step.next.as_mut(),
    ) {
        // (The admission wrote the reservations as they stand at its
        // time, in that time's epoch.)
        next.epoch = next.at / MAX_RESERVATION;
        next.reserved = next
            .reserved
            .saturating_add(cost.saturating_mul(p.denominator));
        step.decision = describe(policy, Some(*next), now);
        step.idle_at = idle_since(policy.algorithm(), *next);
    }
    step
}

/// `state` as it stands at `now`, spending nothing: for a token bucket,
/// the same credit from now on, dated now (or at its own later time);
/// other states unchanged. A refused call writes this for the
/// initially-empty buckets it found with room: an idle one is forgotten
/// [`EMPTY_KEPT_FULL`] after it filled, and a client that was refused by
/// another limit and told to come back must not find it forgotten (and
/// empty) then. So such a bucket is kept at least a minute after it was
/// last asked for.
pub fn as_of(policy: &Policy, state: Option<State>, now: Nanos) -> Option<State> {
    let Algorithm::TokenBucket(p) = *policy.algorithm() else {
        return state;
    };
    let s = p.unless_idle(state, now)?;
    let l = p.level_at(s, now);
    Some(l.state(kept_hold(Some(s), l.t, now)))
}

/// Where a charge admitted with `step` ([`decide`], [`reserve`]) was
/// counted, for a [`crate::Receipt`]: a window's start, or, for a token
/// bucket, when its reservation lapses (the end of the epoch after its
/// own: see [`MAX_RESERVATION`]).
pub fn receipt(policy: &Policy, step: &Step) -> Nanos {
    match (policy.algorithm(), step.next) {
        (_, None) => 0,
        (Algorithm::TokenBucket(_), Some(next)) => lapse_of(next.at / MAX_RESERVATION),
        (_, Some(next)) => next.at,
    }
}

/// When the units reserved in `epoch` lapse: at the end of the epoch
/// after it.
fn lapse_of(epoch: u64) -> Nanos {
    epoch.saturating_add(2).saturating_mul(MAX_RESERVATION)
}

/// Gives back `cost`, admitted with [`reserve`] and counted at `counted`
/// ([`receipt`]), to `policy`'s `state` at `now`: the charge did not
/// count (its outcome did not match). The state to keep (`None`: no
/// state).
///
/// Exact: the budget is then what it would be had that charge never been
/// made, as far as its rule can tell:
///
/// - a token bucket gets `cost` back from its reserved units, while they
///   have not lapsed (before `counted`, as [`receipt`] said); it has
///   refilled no higher than its capacity less them meanwhile, so that is
///   exactly the credit it would have without the charge. A bucket that
///   holds requests for later (shaping) gives nothing back while it holds
///   them;
/// - a fixed window gives `cost` back only while the window it was counted
///   in is open;
/// - a sliding window gives it back to the window it was counted in, while
///   that is the current or the previous one.
///
/// Otherwise the state stays as it is (conservative: nothing is minted).
pub fn refund(
    policy: &Policy,
    state: Option<State>,
    now: Nanos,
    cost: u64,
    counted: Nanos,
) -> Option<State> {
    settle(policy, state, now, cost, counted, true)
}

/// Confirms `cost`, admitted with [`reserve`] and counted at `counted`
/// ([`receipt`]): the charge counts (its outcome matched). A token bucket's
/// reserved units lose it (the credit stays spent, and the bucket refills
/// to its capacity again); other algorithms are unchanged.
pub fn confirm(
    policy: &Policy,
    state: Option<State>,
    now: Nanos,
    cost: u64,
    counted: Nanos,
) -> Option<State> {
    settle(policy, state, now, cost, counted, false)
}

fn settle(
    policy: &Policy,
    state: Option<State>,
    now: Nanos,
    cost: u64,
    counted: Nanos,
    back: bool,
) -> Option<State> {
    let s = state?;
    match *policy.algorithm() {
        Algorithm::TokenBucket(p) => {
            let need = cost.saturating_mul(p.denominator);
            let mut l = p.level_at(s, now);
            let held = hold_end(s).is_some_and(|end| end > now);
            // The epoch the charge was reserved in, and where its units
            // are counted now: this epoch's or the one before's (older
            // ones have lapsed).
            // (A receipt is never earlier than two epochs: one that is
            // names no reservation.)
            let Some(epoch) = (counted / MAX_RESERVATION).checked_sub(2) else {
                return state;
            };
            let units = if epoch == l.epoch {
                &mut l.reserved
            } else if epoch.saturating_add(1) == l.epoch {
                &mut l.earlier
            } else {
                return state;
            };
            if *units < need || (back && held) {
                return state;
            }
            *units -= need;
            if back {
                // Below the capacity less what was reserved, so below the
                // capacity less what stays reserved with `need` added;
                // capped there all the same, for reservations carried over
                // into a smaller bucket (a debt: see `carry_over`).
                let ceiling = p.cap() - (l.reserved.saturating_add(l.earlier)).min(p.cap());
                l.credit = l.credit.saturating_add(need).min(ceiling);
            }
            Some(l.state(kept_hold(state, l.t, now)))
        }
        Algorithm::FixedWindow(_) | Algorithm::SlidingWindow(_) if !back => state,
        Algorithm::FixedWindow(w) => {
            let open = now < s.at.saturating_add(w.window);
            if s.at != counted || !open || s.level < cost {
                return state;
            }
            let level = s.level - cost;
            (level > 0).then_some(State { level, ..s })
        }
        Algorithm::SlidingWindow(w) => {
            let (cur, prev) = if s.at == counted && s.level >= cost {
                (s.level - cost, s.prior)
            } else if s.at == counted.saturating_add(w.window) && s.prior >= cost {
                (s.level, s.prior - cost)
            } else {
                return state;
            };
            (cur + prev > 0).then_some(State {
                level: cur,
                prior: prev,
                at: s.at,
                ..State::default()
            })
        }
    }
}

/// The longest debt a carried-over bucket keeps (about 23 days): what a key
/// has spent beyond a new, smaller bucket's capacity is kept as time before
/// that bucket refills, up to this long. The Redis store's horizon.
pub const MAX_CARRIED_DEBT: Nanos = 2_000_000_000_000_000;

/// What a key has spent, carried from the numbers its state was written
/// under (`from`) to the numbers it is read under (`to`) at `now`: the state
/// that `to` decides on, `None` for no state. Every store applies it when a
/// policy's numbers change under one name (a plan upgrade, a limit changed
/// at runtime); the Redis script implements the same rule.
///
/// A key stays under the numbers that wrote it until it is next charged: its
/// state is first brought to `now` under `from` (a bucket refilled at the
/// old rate, a window rolled on at the old length), and what it has spent
/// then carries over, **in full**:
///
/// - A state that is idle under `from` (a full bucket, a window that is
///   over) is no state, exactly as if it had been swept.
/// - Token bucket to token bucket: the credit missing from the bucket is
///   kept exactly, in tokens (rounded up to the new scaled unit). The new
///   bucket lacks that much of its capacity; what exceeds its capacity is a
///   debt, kept as the time the new bucket needs to refill it before its
///   credit starts to grow (at most [`MAX_CARRIED_DEBT`]). So lowering a
///   capacity never gives a burst, raising it never forgets what was spent,
///   and switching back and forth never mints credit. A bucket holding
///   requests for later (shaping: a hold in `prior` that ends after
///   `now`) stays empty under the new numbers until the later of that end
///   and the debt carried over, and keeps the hold until then, through any
///   number of further changes: a held request's units are spent, and no
///   rate, however fast, releases new requests alongside it or repays
///   them before it is released. A debt that holds no request is carried
///   as tokens, so a raised limit admits its new room at once.
///   Units reserved and not yet settled (charges kept only for some
///   outcomes, [`reserve`]) carry over as reserved, the same tokens in the
///   same epochs: settled after the change, a charge gives back or counts
///   its own units, never a reservation made since. Conservatively: at
///   most the new capacity is carried per epoch, and a converted state
///   dated past its epochs (a debt) lets them lapse, as confirmed, when it
///   is read; a settlement then gives back less than was reserved, never
///   more.
/// - Fixed window to fixed window: the count and the window's start are
///   kept; the window ends at that start plus the new length.
/// - Sliding window to sliding window of the same length: the counts are
///   kept.
/// - Anything else (another algorithm, a sliding window of another
///   length): the units spent under `from` (a bucket's missing tokens, a
///   fixed window's count, a sliding window's weighted count, each rounded
///   up, at most [`MAX_CARRIED_COUNT`]) are charged to a fresh state of `to` at `now`: a bucket lacking
///   them (with a debt beyond its capacity, as above), or a window whose
///   count they are.
///
/// A count kept above a new limit simply means the budget is spent:
/// nothing is admitted until it has refilled or its window is over.
///
/// For one key, the change happens at its first charge under the new
/// numbers (stores write the converted state then, also when the charge is
/// refused, spending nothing). Across changes, the cost a key is admitted in
/// any interval is at most the largest capacity in force in it plus each
/// policy's rate over the time it was in force.
pub fn carry_over(from: &Algorithm, state: State, to: &Algorithm, now: Nanos) -> Option<State> {
    if same_numbers(from, to) {
        return Some(state);
    }
    if idle_since(from, state) <= now {
        return None;
    }
    let t = now.max(state.at);
    // Requests held for later (shaping) under `from`: until when.
    let held = match from {
        Algorithm::TokenBucket(_) => hold_end(state).filter(|&end| end > now),
        _ => None,
    };
    match (*from, *to) {
        (Algorithm::FixedWindow(_), Algorithm::FixedWindow(_)) => Some(state),
        (Algorithm::SlidingWindow(a), Algorithm::SlidingWindow(b)) if a.window == b.window => {
            Some(state)
        }
        (Algorithm::TokenBucket(a), Algorithm::TokenBucket(b)) => {
            let carried = into_bucket(&b, a.spent(state, now), u128::from(a.denominator), now);
            let carried = a.reservations_into(&b, state, now, carried);
            // Requests held until later (shaping): the new bucket stays
            // empty until then too, or a faster rate would release new
            // requests alongside the ones already held for that instant;
            // and it keeps the hold, or a later change to a faster rate
            // would repay the debt before they are released.
            Some(match held {
                Some(end) => State {
                    level: 0,
                    prior: 1,
                    at: carried.at.max(end),
                    ..carried
                },
                None => carried,
            })
        }
        (_, Algorithm::TokenBucket(b)) => Some(into_bucket(
            &b,
            u128::from(spent_units(from, state, now)),
            1,
            now,
        )),
        (_, Algorithm::FixedWindow(_) | Algorithm::SlidingWindow(_)) => {
            let spent = spent_units(from, state, now);
            // A window counting held requests opens no earlier than their
            // release (a window dated later counts as open until then).
            (spent > 0).then_some(State {
                level: spent,
                prior: 0,
                at: held.map_or(t, |end| t.max(end)),
                ..State::default()
            })
        }
    }
}

/// A fresh bucket `b` at `now` that lacks `spent / per_token` tokens:
/// credit when that fits its capacity, else empty with the rest as a debt
/// (the time to refill it, rounded up, at most [`MAX_CARRIED_DEBT`]).
fn into_bucket(b: &TokenBucket, spent: u128, per_token: u128, now: Nanos) -> State {
    let (den, num, cap) = (
        u128::from(b.denominator),
        u128::from(b.numerator),
        u128::from(b.cap()),
    );
    // spent · den / per_token units of b, compared exactly.
    let need = wide_mul(spent, den);
    if need <= wide_mul(cap, per_token) {
        // Fits 128 bits: at most cap · per_token.
        let units = (spent * den).div_ceil(per_token);
        return State {
            level: sat(cap - units),
            prior: 0,
            at: now,
            ..State::default()
        };
    }
    // The smallest wait x with per_token · (cap + x · num) >= spent · den.
    let repaid = |x: u128| wide_mul(per_token, cap + x * num) >= need;
    let (mut lo, mut hi) = (0u128, u128::from(MAX_CARRIED_DEBT));
    if !repaid(hi) {
        lo = hi;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if repaid(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    State {
        level: 0,
        prior: 0,
        at: now.saturating_add(sat(lo)),
        ..State::default()
    }
}

/// `a · b` as (high, low) 128-bit halves, for exact comparisons of products
/// that exceed 128 bits.
fn wide_mul(a: u128, b: u128) -> (u128, u128) {
    const LOW: u128 = (1 << 64) - 1;
    let (a1, a0) = (a >> 64, a & LOW);
    let (b1, b0) = (b >> 64, b & LOW);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    let mid = (p00 >> 64) + (p01 & LOW) + (p10 & LOW);
    let low = (p00 & LOW) | (mid << 64);
    let high = p11 + (p01 >> 64) + (p10 >> 64) + (mid >> 64);
    (high, low)
}

/// The most units a conversion between algorithms carries (2^53 - 1, the
/// Redis store's exact range): more is as spent as that for any window, and
/// is repaid as that much by a bucket.
pub const MAX_CARRIED_COUNT: u64 = (1 << 53) - 1;

/// Whole units spent under `algorithm` at `now`, rounded up: a bucket's
/// missing tokens (a debt included), a fixed window's count while it is
/// open, a sliding window's weighted count; at most [`MAX_CARRIED_COUNT`].
fn spent_units(algorithm: &Algorithm, s: State, now: Nanos) -> u64 {
    let spent = match *algorithm {
        Algorithm::TokenBucket(p) => sat(p.spent(s, now).div_ceil(u128::from(p.denominator))),
        Algorithm::FixedWindow(w) if now < s.at.saturating_add(w.window) => s.level,
        Algorithm::FixedWindow(_) => 0,
        Algorithm::SlidingWindow(w) => {
            let sl = Slide::new(w.limit, w.window, Some(s), now);
            sat(sl.weighted(sl.prev, sl.cur).div_ceil(sl.w))
        }
    };
    spent.min(MAX_CARRIED_COUNT)
}

/// Whether two algorithms decide alike: equal, or token buckets whose rates
/// are spelled differently but reduce to the same (`2 per second` and `4
/// per 2 seconds`).
fn same_numbers(a: &Algorithm, b: &Algorithm) -> bool {
    match (a, b) {
        (Algorithm::TokenBucket(x), Algorithm::TokenBucket(y)) => {
            (x.capacity, x.numerator, x.denominator, x.initial)
                == (y.capacity, y.numerator, y.denominator, y.initial)
        }
        _ => a == b,
    }
}

/// The exact arithmetic of a token bucket, on its scaled units.
impl TokenBucket {
    /// Capacity in scaled units. [`Policy::token_bucket`] refuses policies
    /// whose scaled capacity does not fit in 64 bits, so every credit does.
    #[inline]
    fn cap(&self) -> u64 {
        self.cap
    }

    /// The credit `credit` (held at `at`) refilled up to `now`, and the time
    /// it is valid at. A clock behind `at` refills nothing and moves
    /// nothing back: the time stays `at`. Saturation is exact here: any
    /// saturated sum is above the capacity it is capped to.
    fn refilled(&self, credit: u64, at: Nanos, now: Nanos) -> (u64, Nanos) {
        let t = now.max(at);
        let refill = (t - at).saturating_mul(self.numerator);
        (credit.saturating_add(refill).min(self.cap()), t)
    }

    /// Nanoseconds from holding `credit` (at most the capacity) until the
    /// bucket is full.
    fn time_to_full(&self, credit: u64) -> u64 {
        self.refill.div_ceil(self.cap() - credit)
    }

    /// The bucket `s` describes as it stands at `now`: its credit refilled
    /// (up to the capacity less what is reserved, less each epoch's units
    /// once they lapse), the time that holds at (`now`, or the state's own
    /// later time: a clock behind it refills nothing), and what is still
    /// reserved then, counted in that time's epoch.
    #[inline(always)]
    fn level_at(&self, s: State, now: Nanos) -> Level {
        if s.reserved == 0 && s.reserved_earlier == 0 {
            let (credit, t) = self.refilled(s.level, s.at, now);
            return Level {
                credit,
                t,
                reserved: 0,
                earlier: 0,
                epoch: 0,
            };
        }
        self.reserved_level_at(s, now)
    }

    #[cold]
    fn reserved_level_at(&self, s: State, now: Nanos) -> Level {
        let t = now.max(s.at);
        let at_state = Level {
            credit: s.level,
            t: s.at,
            reserved: s.reserved,
            earlier: s.reserved_earlier,
            epoch: s.epoch,
        };
        self.grown(at_state, t)
    }

    /// The bucket at `l` grown to `t` (at or after `l.t`): refilled within
    /// each ceiling while it holds, its epochs moved on (a lapsed epoch's
    /// units are gone).
    fn grown(&self, mut l: Level, t: Nanos) -> Level {
        for (until, top) in self.ceilings(l) {
            if l.t >= t {
                break;
            }
            let to = until.min(t);
            if to > l.t {
                l.credit = l
                    .credit
                    .min(top)
                    .saturating_add((to - l.t).saturating_mul(self.numerator))
                    .min(top);
                l.t = to;
            }
        }
        l.t = t;
        l.moved_to(t / MAX_RESERVATION)
    }

    /// The ceilings of the bucket at `l`, each with when it ends: the
    /// capacity less both epochs' units until the earlier lapses, less
    /// this epoch's until they lapse, the capacity after.
    fn ceilings(&self, l: Level) -> [(Nanos, u64); 3] {
        let cap = self.cap();
        let both = l.reserved.saturating_add(l.earlier).min(cap);
        let end_of = |epoch: u64| epoch.saturating_add(1).saturating_mul(MAX_RESERVATION);
        [
            // The epoch before lapses when this one ends.
            (end_of(l.epoch), cap - both),
            (lapse_of(l.epoch), cap - l.reserved.min(cap)),
            (Nanos::MAX, cap),
        ]
    }

    /// When the bucket at `l` is full: not before its reservations lapse.
    #[inline(always)]
    fn full_of(&self, l: Level) -> Nanos {
        if l.reserved == 0 && l.earlier == 0 {
            return l.t.saturating_add(self.time_to_full(l.credit));
        }
        let last = if l.reserved > 0 {
            lapse_of(l.epoch)
        } else {
            l.epoch.saturating_add(1).saturating_mul(MAX_RESERVATION)
        };
        let at_lapse = self.grown(l, last.max(l.t));
        at_lapse
            .t
            .saturating_add(self.time_to_full(at_lapse.credit))
    }

    /// When `need` fits the bucket at `l`, with nothing else charged and its
    /// reservations lapsing (as confirmed) if they must, for the credit to
    /// grow that high; settling them earlier only brings it sooner.
    #[inline(always)]
    fn fits_at(&self, l: Level, need: u64) -> Nanos {
        if l.credit >= need {
            return l.t;
        }
        if l.reserved == 0 && l.earlier == 0 {
            return l.t.saturating_add(self.refill.div_ceil(need - l.credit));
        }
        let mut at = l;
        for (until, top) in self.ceilings(l) {
            if need <= top {
                return at
                    .t
                    .saturating_add(self.refill.div_ceil(need - at.credit.min(top)));
            }
            at = self.grown(at, until.max(at.t));
        }
        at.t
    }

    /// Whether `state` has reservations written (settled or lapsed or not:
    /// the next write that is not a reservation clears those that lapsed):
    /// it is not shaped then, so that a reservation's hold never has to
    /// be given back over reserved units.
    fn reserving(&self, state: Option<State>) -> bool {
        state.is_some_and(|s| s.reserved != 0 || s.reserved_earlier != 0)
    }

    /// `into` (a state of `to`) with the reservations `s` holds at `now`
    /// (or at its own later time) carried over: the same tokens, in `to`'s
    /// units, at most its capacity, in the same epochs. So a charge
    /// reserved before a change of numbers is still found when it is
    /// settled after it: given back (once) or counted, never taken from
    /// a reservation made since (which gave back units that request still
    /// held: a concurrent guess let through).
    fn reservations_into(&self, to: &TokenBucket, s: State, now: Nanos, into: State) -> State {
        if s.reserved == 0 && s.reserved_earlier == 0 {
            return into;
        }
        let l = self.reserved_level_at(s, now);
        let tokens = |units: u64| {
            (units / self.denominator)
                .min(to.capacity)
                .saturating_mul(to.denominator)
        };
        let (reserved, reserved_earlier) = (tokens(l.reserved), tokens(l.earlier));
        if reserved == 0 && reserved_earlier == 0 {
            return into;
        }
        State {
            reserved,
            reserved_earlier,
            epoch: l.epoch,
            ..into
        }
    }

    /// Scaled units missing from the bucket at `now`: the capacity less the
    /// credit refilled to `now`, or, for a state dated after `now` (a debt
    /// carried over, or a clock that stepped back), less the credit it will
    /// have then and the refill until then.
    fn spent(&self, s: State, now: Nanos) -> u128 {
        if now >= s.at {
            // What is reserved counts as spent (as if confirmed).
            u128::from(self.cap() - self.level_at(s, now).credit)
        } else {
            u128::from(self.cap() - s.level.min(self.cap()))
                + u128::from(s.at - now) * u128::from(self.numerator)
        }
    }

    /// The credit `state` holds at `now` (a new bucket's when there is
    /// none) and the time it holds at: `now`, or the state's own later time.
    fn credit_at(&self, state: Option<State>, now: Nanos) -> (u64, Nanos) {
        match self.unless_idle(state, now) {
            Some(s) => {
                let l = self.level_at(s, now);
                (l.credit, l.t)
            }
            None => match self.initial {
                Initial::Full => (self.cap(), now),
                Initial::Empty => (0, now),
            },
        }
    }

    /// `state`, or `None` when it is idle at `now`: an idle bucket decides
    /// as one never seen, whether or not a store has dropped it yet. A
    /// bucket that starts full is idle once full, and then decides alike
    /// either way, so only an initially-empty one needs the check: it is
    /// idle [`EMPTY_KEPT_FULL`] after it filled (see there), and until then
    /// it is full, not new.
    #[inline(always)]
    fn unless_idle(&self, state: Option<State>, now: Nanos) -> Option<State> {
        match state {
            Some(s)
                if self.initial == Initial::Empty
                    && self
                        .full_of(self.level_at(s, s.at))
                        .saturating_add(EMPTY_KEPT_FULL)
                        <= now
                    && hold_end(s).is_none_or(|end| end <= now) =>
            {
                None
            }
            other => other,
        }
    }

    /// Whole tokens in `credit`.
    #[inline(always)]
    fn tokens(&self, credit: u64) -> u64 {
        self.per_token.div(credit)
    }
}

/// A token bucket as it stands at a time: see [`TokenBucket::level_at`].
#[derive(Debug, Clone, Copy)]
struct Level {
    credit: u64,
    t: Nanos,
    /// Units reserved in `epoch`, and in the epoch before.
    reserved: u64,
    earlier: u64,
    epoch: u64,
}

impl Level {
    /// The same bucket with its epochs moved on to `epoch` (later or the
    /// same): an epoch's units lapse when the epoch after it ends.
    fn moved_to(mut self, epoch: u64) -> Self {
        if self.reserved == 0 && self.earlier == 0 {
            self.epoch = epoch;
            return self;
        }
        match epoch.saturating_sub(self.epoch) {
            0 => {}
            1 => {
                self.earlier = self.reserved;
                self.reserved = 0;
            }
            _ => {
                self.earlier = 0;
                self.reserved = 0;
            }
        }
        self.epoch = epoch.max(self.epoch);
        self
    }

    /// The state written for this bucket, with `prior` (a hold).
    fn state(self, prior: u64) -> State {
        let reserving = self.reserved != 0 || self.earlier != 0;
        State {
            level: self.credit,
            prior,
            at: self.t,
            reserved: self.reserved,
            reserved_earlier: self.earlier,
            epoch: if reserving { self.epoch } else { 0 },
        }
    }
}

#[inline(always)]
fn token_bucket(p: &TokenBucket, state: Option<State>, now: Nanos, cost: u64) -> Step {
    let state = p.unless_idle(state, now);
    let l = match state {
        Some(s) => p.level_at(s, now),
        None => Level {
            credit: match p.initial {
                Initial::Full => p.cap(),
                Initial::Empty => 0,
            },
            t: now,
            reserved: 0,
            earlier: 0,
            epoch: 0,
        },
    };
    // `decide` refused costs above the capacity, so this fits.
    let need = cost.saturating_mul(p.denominator);
    match charged(p, l, need, now) {
        (decision, Some(after), full) => {
            let next = after.state(kept_hold(state, l.t, now));
            Step {
                decision,
                next: Some(next),
                idle_at: if next.prior == 0 && p.initial == Initial::Full {
                    full
                } else {
                    idle_since(&Algorithm::TokenBucket(*p), next)
                },
            }
        }
        (decision, None, full) => {
            let next = match (state, p.initial) {
                (None, Initial::Empty) => Some(State {
                    at: now,
                    ..State::default()
                }),
                _ => None,
            };
            Step {
                decision,
                next,
                idle_at: match next.or(state) {
                    Some(kept) => idle_since(&Algorithm::TokenBucket(*p), kept),
                    None => full,
                },
            }
        }
    }
}

/// `need` units charged to the bucket at `l`: the answer, the bucket after
/// the charge when admitted, and when that bucket (or `l`, refused) is
/// full. What [`token_bucket`] and [`token_bucket_compact`] share.
#[inline(always)]
fn charged(p: &TokenBucket, l: Level, need: u64, now: Nanos) -> (Decision, Option<Level>, Nanos) {
    if l.credit >= need {
        let after = Level {
            credit: l.credit - need,
            ..l
        };
        let full = p.full_of(after);
        let decision = Decision::admitted_scaled(after.credit, p.denominator, full - now);
        (decision, Some(after), full)
    } else {
        let full = p.full_of(l);
        let decision =
            Decision::denied_ns(p.fits_at(l, need) - now, p.tokens(l.credit), full - now);
        (decision, None, full)
    }
}

/// [`token_bucket`] for the state most keys have: a bucket that starts
/// full, with no hold and nothing reserved, stored as its credit `level`
/// at `at`. The decision, and the new credit and its time when admitted
/// (a refusal writes nothing: such a state is never first seen). The
/// same arithmetic as [`token_bucket`] without a [`State`] or [`Step`]
/// built and moved: what a store's hot path calls. `None` for a bucket
/// that starts empty (its idle rule is [`token_bucket`]'s), which the
/// caller decides in full.
#[inline(always)]
pub(crate) fn token_bucket_compact(
    p: &TokenBucket,
    level: u64,
    at: Nanos,
    now: Nanos,
    cost: u64,
) -> Option<(Decision, Option<(u64, Nanos)>)> {
    if p.initial != Initial::Full {
        return None;
    }
    let l = p.level_at(
        State {
            level,
            at,
            ..State::default()
        },
        now,
    );
    // The caller checked that the cost fits the capacity.
    let need = cost.max(1).saturating_mul(p.denominator);
    // Admitted at `now` (the clock not behind the state): the time to full
    // is the missing credit over the refill per nanosecond, which the
    // decision divides only if it is read. The sum `now` + that time
    // (which [`charged`] saturates) is checked not to overflow: the time
    // is at most the missing credit itself.
    if l.credit >= need && l.t == now {
        let credit = l.credit - need;
        let missing = p.cap() - credit;
        if now.checked_add(missing).is_some() {
            let decision = Decision::admitted_filling(credit, p.denominator, missing, p.numerator);
            return Some((decision, Some((credit, now))));
        }
    }
    let (decision, after, _) = charged(p, l, need, now);
    Some((decision, after.map(|a| (a.credit, a.t))))
}

fn fixed_window(limit: u64, window: Nanos, state: Option<State>, now: Nanos, cost: u64) -> Step {
    let (count, start) = match state {
        // Still inside the window (a clock behind `start` counts as inside).
        Some(s) if now < s.at.saturating_add(window) => (s.level, s.at),
        _ => (0, now),
    };
    let end = start.saturating_add(window);
    let reset = Duration::from_nanos(end - now.min(end));
    // `count + cost` can overflow for limits of 2^63 and more: compare with
    // what is left instead.
    let left = limit.saturating_sub(count);
    if cost <= left {
        Step {
            decision: Decision::admitted(left - cost, reset),
            next: Some(State {
                level: count + cost,
                prior: 0,
                at: start,
                ..State::default()
            }),
            idle_at: end,
        }
    } else {
        Step {
            decision: Decision::denied(reset, left, reset),
            next: None,
            idle_at: end,
        }
    }
}

/// A sliding window's state rolled forward to `now`: the previous and
/// current windows' admitted cost, where the current window starts, and how
/// far into it `now` is.
struct Slide {
    w: u128,
    l: u128,
    prev: u128,
    cur: u128,
    start: u128,
    /// Elapsed time in the current window.
    e: u128,
    /// How far the clock is behind the stored window (read as its start).
    lead: u128,
    now: u128,
}

impl Slide {
    fn new(limit: u64, window: Nanos, state: Option<State>, now: Nanos) -> Self {
        let w = u128::from(window);
        // Windows tile the time line from the key's first admission.
        let (mut prev, mut cur, stored_start) = match state {
            Some(s) => (u128::from(s.prior), u128::from(s.level), s.at),
            None => (0, 0, now),
        };
        // A clock behind the stored window is read as that window's start.
        let eff_now = now.max(stored_start);
        let windows_on = u128::from(eff_now - stored_start) / w;
        if windows_on == 1 {
            prev = cur;
            cur = 0;
        } else if windows_on > 1 {
            prev = 0;
            cur = 0;
        }
        // Two windows on, nothing counts any more: the key starts over,
        // anchored now, exactly as a key never seen (or swept) would. So an
        // idle state decides like no state, whether or not it was swept.
        let start = if windows_on > 1 {
            u128::from(eff_now)
        } else {
            u128::from(stored_start) + windows_on * w
        };
        Self {
            w,
            l: u128::from(limit),
            prev,
            cur,
            start,
            e: u128::from(eff_now) - start,
            lead: u128::from(eff_now - now),
            now: u128::from(now),
        }
    }

    fn weighted(&self, prev: u128, cur: u128) -> u128 {
        prev * (self.w - self.e) + cur * self.w
    }

    /// Whole units left with these counts.
    fn remaining(&self, prev: u128, cur: u128) -> u64 {
        sat((self.l * self.w).saturating_sub(self.weighted(prev, cur)) / self.w)
    }

    /// Time from `now` until both windows' cost has slid out.
    fn until(&self, prev: u128, cur: u128) -> u128 {
        let end = if cur > 0 {
            self.start + 2 * self.w
        } else if prev > 0 {
            self.start + self.w
        } else {
            return 0;
        };
        end.saturating_sub(self.now)
    }
}

fn sliding_window(limit: u64, window: Nanos, state: Option<State>, now: Nanos, cost: u64) -> Step {
    let sl = Slide::new(limit, window, state, now);
    let (prev, cur, w, l) = (sl.prev, sl.cur, sl.w, sl.l);
    let c = u128::from(cost);
    if sl.weighted(prev, cur) + c * w <= l * w {
        let cur = cur + c;
        let reset = sl.until(prev, cur);
        Step {
            decision: Decision::admitted(sl.remaining(prev, cur), ns(reset)),
            next: Some(State {
                level: sat(cur),
                prior: sat(prev),
                at: sat(sl.start),
                ..State::default()
            }),
            idle_at: sat(sl.now + reset),
        }
    } else {
        let wait = sliding_wait(prev, cur, sl.e, c, l, w);
        let reset = sl.until(prev, cur);
        Step {
            decision: Decision::denied(ns(sl.lead + wait), sl.remaining(prev, cur), ns(reset)),
            next: None,
            idle_at: sat(sl.now + reset),
        }
    }
}

/// Smallest wait from elapsed `e` in the current window until
/// `prev·(w−e′) + (cur+c)·w ≤ l·w` holds (with windows rolling over).
fn sliding_wait(prev: u128, cur: u128, e: u128, c: u128, l: u128, w: u128) -> u128 {
    // In the current window, only the previous window's weight decays.
    if cur + c <= l && prev > 0 {
        let allowed = (l - cur - c) * w / prev;
        let need = w.saturating_sub(allowed);
        if need < w {
            return need.saturating_sub(e);
        }
    }
    // In the next window the current count becomes the decaying one.
    let to_next = w - e;
    if cur == 0 {
        return to_next;
    }
    let need = w.saturating_sub((l - c) * w / cur);
    if need < w {
        to_next + need
    } else {
        to_next + w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rate;

    const S: u64 = 1_000_000_000;

    #[test]
    fn token_bucket_wait_is_exact_and_refusal_spends_nothing() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let mut s = None;
        for _ in 0..3 {
            let step = decide(&p, s, 0, 1);
            assert!(step.decision.is_admitted());
            s = step.next;
        }
        let step = decide(&p, s, 0, 1);
        assert_eq!(
            step.decision.retry_after(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(step.next, None);
        let step = decide(&p, s, 0, 2);
        assert_eq!(step.decision.retry_after(), Some(Duration::from_secs(1)));
        assert!(decide(&p, s, S / 2, 1).decision.is_admitted());
        assert!(!decide(&p, s, S / 2 - 1, 1).decision.is_admitted());
    }

    #[test]
    fn backwards_clock_mints_nothing() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let s = decide(&p, None, 10 * S, 3).next;
        let step = decide(&p, s, 0, 1);
        // Credit is as at 10 s (empty); one token is 0.5 s after 10 s.
        assert_eq!(
            step.decision.retry_after(),
            Some(Duration::from_millis(10_500))
        );
        let w = Policy::fixed_window("w", 1, Duration::from_secs(1)).unwrap();
        let s = decide(&w, None, 10 * S, 1).next;
        assert!(!decide(&w, s, 0, 1).decision.is_admitted());
        let sw = Policy::sliding_window("s", 1, Duration::from_secs(1)).unwrap();
        let s = decide(&sw, None, 10 * S, 1).next;
        assert!(!decide(&sw, s, 0, 1).decision.is_admitted());
    }

    #[test]
    fn empty_initial_credit_waits_one_step() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(2))
            .unwrap()
            .with_initial(Initial::Empty);
        let step = decide(&p, None, 0, 1);
        assert_eq!(
            step.decision.retry_after(),
            Some(Duration::from_millis(500))
        );
    }

    /// Audit finding 5: `count + cost <= limit` overflowed for limits of
    /// 2^63 and more (a panic in debug builds, unlimited admission after
    /// wrapping in release builds).
    #[test]
    fn huge_limits_do_not_overflow() {
        let w = Policy::fixed_window("w", u64::MAX, Duration::from_secs(60)).unwrap();
        let s = decide(&w, None, 0, u64::MAX - 1).next;
        assert!(decide(&w, s, S, 1).decision.is_admitted());
        let refused = decide(&w, s, S, 2);
        assert!(!refused.decision.is_admitted());
        assert_eq!(refused.decision.remaining(), 1);
        let full = decide(&w, None, 0, u64::MAX).next;
        assert!(!decide(&w, full, S, u64::MAX).decision.is_admitted());
        // The largest sliding windows that are accepted decide without
        // overflow, at the limit and one past it.
        let sw = Policy::sliding_window("sw", u64::MAX, Duration::from_secs(86_400)).unwrap();
        let s = decide(&sw, None, 0, u64::MAX).next;
        assert!(!decide(&sw, s, S, u64::MAX).decision.is_admitted());
        let later = decide(&sw, s, 86_400 * S + S, u64::MAX);
        assert!(!later.decision.is_admitted());
        assert!(
            decide(&sw, s, 2 * 86_400 * S, u64::MAX)
                .decision
                .is_admitted()
        );
        let e = Policy::sliding_window("sw", u64::MAX, Duration::from_secs(300 * 365 * 86_400))
            .unwrap_err();
        assert!(e.reason().contains("128 bits"), "{e}");
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let p = Policy::sliding_window("s", 4, Duration::from_secs(1)).unwrap();
        let mut s = None;
        for _ in 0..4 {
            s = decide(&p, s, 0, 1).next;
        }
        // At 1.5 s the previous 4 weigh 2: two more fit, the third must wait
        // until the weight drops to 1 at 1.75 s.
        let a = decide(&p, s, 3 * S / 2, 2);
        assert!(a.decision.is_admitted());
        let d = decide(&p, a.next, 3 * S / 2, 1);
        assert_eq!(d.decision.retry_after(), Some(Duration::from_millis(250)));
        assert!(decide(&p, a.next, 7 * S / 4, 1).decision.is_admitted());
        assert!(!decide(&p, a.next, 7 * S / 4 - 1, 1).decision.is_admitted());
    }

    proptest::proptest! {
        /// The store's hot path decides a compact bucket as the full
        /// algorithm does: the same decision, and the same state written.
        #[test]
        fn the_compact_bucket_decides_as_the_full_one(
            capacity in 1u64..1_000_000,
            amount in 1u64..1_000_000,
            period_ns in 1u64..4_000_000_000_000,
            fill in 0u64..=1_000,
            at in 0u64..1_000_000_000_000,
            ahead in -1_000_000_000i64..4_000_000_000_000,
            cost_share in 0u64..=1_000,
            exact: bool,
            late: bool,
        ) {
            // Late: near the end of the clock, where the time to full
            // saturates.
            let at = if late { u64::MAX - at } else { at };
            let Ok(p) = Policy::token_bucket(
                "p",
                capacity,
                Rate::new(amount, Duration::from_nanos(period_ns)),
            ) else {
                return Ok(());
            };
            let Algorithm::TokenBucket(b) = *p.algorithm() else { unreachable!() };
            let mut level = u64::try_from(u128::from(b.cap) * u128::from(fill) / 1_000).unwrap();
            let mut now = at.saturating_add_signed(ahead);
            let cost = (capacity * cost_share / 1_000).max(1);
            if exact {
                // The cost fits at `now` exactly, or one unit short.
                now = at.saturating_add(ahead.unsigned_abs() % 1_000);
                let refill = (now - at).saturating_mul(b.numerator);
                let need = cost * b.units_per_token();
                level = need.saturating_sub(refill).saturating_sub(fill % 2).min(b.cap);
            }
            let full = decide(&p, Some(State { level, at, ..State::default() }), now, cost);
            let (decision, next) = token_bucket_compact(&b, level, at, now, cost).unwrap();
            proptest::prop_assert_eq!(decision, full.decision);
            proptest::prop_assert_eq!(
                next.map(|(level, at)| State { level, at, ..State::default() }),
                full.next
            );
            let empty = p.clone().with_initial(Initial::Empty);
            let Algorithm::TokenBucket(e) = *empty.algorithm() else { unreachable!() };
            proptest::prop_assert!(token_bucket_compact(&e, level, at, now, cost).is_none());
        }
    }
}
