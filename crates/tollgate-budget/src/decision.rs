//! Charges and decisions: what is asked of a budget and what it answered.
//!
//! Three types answer at three levels, and each has one job:
//!
//! | type | answers | who reads it |
//! |---|---|---|
//! | [`Decision`] | one policy, for one charge: admitted (units left, time to full), denied (exact wait), never fits, or not evaluated | the `RateLimit` fields, which describe every limit |
//! | [`Outcome`] | one all-or-nothing call to a store: a [`Decision`] per charge, in charge order | the caller that made the call |
//! | [`Verdict`] | the outcome as one word: admitted, denied (the longest refusing wait) or never fits | the code that admits or refuses the request |
//!
//! A store returns an [`Outcome`]; [`Outcome::verdict`] derives the
//! [`Verdict`] from it, so the two can never disagree. Nothing in a
//! [`Decision`] says whether the *call* was admitted: in a refused
//! multi-charge, an `Admitted` decision describes a budget that fitted but
//! was not spent.

use std::fmt;
use std::time::Duration;

use crate::{Key, Policy};

/// One charge: `cost` units against `policy` for `key`.
///
/// The cost is a positive integer in the policy's unit; zero is refused by
/// [`Charge::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    key: Key,
    policy: Policy,
    cost: u64,
    /// The longest the request may be held for this charge to fit
    /// ([`Charge::shaped`]); `None`: fit now or be refused.
    max_delay: Option<Duration>,
    /// Whether the caller may give it back ([`Charge::refundable`]).
    refundable: bool,
    /// Neither shaped nor refundable, and the cost can fit: decided now or
    /// refused, the memory store's one-charge path (kept with the fields it
    /// follows from, so that path tests one flag).
    plain: bool,
}

/// A charge whose cost was zero.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("charge for policy {policy:?} has cost 0; a cost must be a positive integer")]
pub struct InvalidCharge {
    policy: String,
}

impl Charge {
    /// A charge of `cost` units; refused when `cost` is zero.
    pub fn new(key: Key, policy: Policy, cost: u64) -> Result<Self, InvalidCharge> {
        if cost == 0 {
            return Err(InvalidCharge {
                policy: policy.name().to_owned(),
            });
        }
        Ok(Self {
            key,
            policy,
            cost,
            max_delay: None,
            refundable: false,
            plain: false,
        }
        .noted())
    }

    /// The charge with `plain` brought up to date.
    fn noted(mut self) -> Self {
        self.plain = self.max_delay().is_none() && self.can_fit() && !self.refundable;
        self
    }

    /// Whether the charge is neither [shaped](Charge::shaped) nor
    /// [refundable](Charge::refundable) and its cost can fit: a store
    /// decides it now or refuses it.
    pub(crate) fn is_plain(&self) -> bool {
        self.plain
    }

    /// The same charge, shaped: when the cost does not fit now but will
    /// within `max_delay`, a store that can shape ([`Store::can_shape`](crate::Store::can_shape))
    /// reserves it now for the exact instant it fits and answers an
    /// [`Outcome::delay`] to wait before the request goes on; beyond
    /// `max_delay` it is refused as usual. Token buckets only; a store
    /// that cannot shape, or a policy of another algorithm, answers as if
    /// unshaped.
    ///
    /// A [refundable](Charge::refundable) charge is never shaped: what it
    /// reserves is given back or confirmed by its outcome, while a shaped
    /// charge holds its bucket for later.
    ///
    /// A wait of zero is no wait: the charge stays unshaped. Waits longer
    /// than [`Charge::MAX_DELAY`] (about 23 days) are that long, in every
    /// store alike.
    #[must_use]
    pub fn shaped(mut self, max_delay: Duration) -> Self {
        self.max_delay = (!max_delay.is_zero()).then(|| max_delay.min(Self::MAX_DELAY));
        self.noted()
    }

    /// The same charge, to be given back if it turns out not to count: an
    /// admitted call with refundable charges carries a [`Receipt`]
    /// ([`Outcome::receipt`]) with which [`Store::refund`](crate::Store::refund)
    /// gives them back (e.g. a charge only for failed logins, reserved when
    /// the request is checked and given back when it succeeds). A store
    /// that cannot refund ([`Store::can_refund`](crate::Store::can_refund))
    /// answers no receipt. A refundable charge is not shaped
    /// ([`Charge::shaped`] has no effect on it).
    #[must_use]
    pub fn refundable(mut self) -> Self {
        self.refundable = true;
        self.noted()
    }

    /// Whether this charge is [`Charge::refundable`].
    pub fn is_refundable(&self) -> bool {
        self.refundable
    }

    /// The longest a shaped charge may wait: 2·10^15 ns, about 23 days,
    /// the horizon every store computes exactly within.
    pub const MAX_DELAY: Duration = Duration::from_nanos(2_000_000_000_000_000);

    /// The longest wait this charge accepts ([`Charge::shaped`]); `None`
    /// for one not shaped, and for a refundable one.
    pub fn max_delay(&self) -> Option<Duration> {
        self.max_delay.filter(|_| !self.refundable)
    }

    /// The key whose budget is charged.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The policy that defines the budget.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The positive cost.
    pub fn cost(&self) -> u64 {
        self.cost
    }

    /// Whether this cost can ever fit the policy (`cost <= capacity`).
    pub fn can_fit(&self) -> bool {
        self.cost <= self.policy.capacity()
    }
}

/// What one policy answered for one charge: admitted (units left, time
/// to full), denied (the exact wait, units available, time to full), never
/// fits (the cost exceeds the capacity), or not evaluated.
///
/// The representation is private: a store builds one with
/// [`Decision::admitted`], [`Decision::denied`], [`Decision::never_fitting`]
/// or [`Decision::unevaluated`], and a caller reads it through the
/// accessors, so that a store may keep the raw numbers and convert them
/// only when they are read.
///
/// ```
/// use std::time::Duration;
/// use tollgate_budget::Decision;
///
/// let d = Decision::denied(Duration::from_secs(2), 0, Duration::from_secs(10));
/// assert!(d.is_denied() && !d.is_admitted());
/// assert_eq!(d.retry_after(), Some(Duration::from_secs(2)));
/// assert_eq!(Decision::never_fitting(5, 3).remaining(), 0);
/// ```
///
/// Two decisions are equal when they hold the same numbers (the units
/// left counted whole), however a store built them.
#[derive(Clone, Copy)]
pub struct Decision(pub(crate) Answer);

/// The cases of a [`Decision`], private to this crate.
#[derive(Clone, Copy)]
pub(crate) enum Answer {
    /// The cost fitted and was (or, in a multi-charge that another limit
    /// refused, would have been) deducted.
    Admitted {
        /// What is left after the charge, in units of which `per_unit`
        /// make one whole unit of the policy: a token bucket's scaled
        /// credit, divided only when [`Decision::remaining`] is read (an
        /// admission whose numbers nobody reads costs no division).
        left: u64,
        /// At least 1.
        per_unit: u64,
        /// Until the budget is fully restored if nothing else is charged,
        /// in units of which `per_ns` refill in a nanosecond: a token
        /// bucket's missing credit, divided (rounded up) only when
        /// [`Decision::reset`] is read.
        to_full: u64,
        /// At least 1; 1 where `to_full` is nanoseconds.
        per_ns: u64,
    },
    /// The cost did not fit; nothing was spent.
    Denied {
        /// The exact nanoseconds until this cost would fit, if nothing
        /// else is charged.
        retry_after: u64,
        /// Whole units available now.
        remaining: u64,
        /// Nanoseconds until the budget is fully restored.
        reset: u64,
    },
    /// The cost exceeds the policy's capacity and can never fit; no wait is
    /// promised and nothing was spent.
    NeverFits {
        /// The cost that was asked.
        cost: u64,
        /// The policy's capacity.
        capacity: u64,
    },
    /// Not evaluated: the call was decided without this limit (another
    /// charge can never fit, or was already known to be refused). Nothing
    /// was read or spent for it.
    Unevaluated,
}

/// Times as `Duration`s, as the accessors give them (they are kept as
/// nanoseconds).
impl fmt::Debug for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ns = Duration::from_nanos;
        match self.0 {
            Answer::Admitted { .. } => f
                .debug_struct("Admitted")
                .field("remaining", &self.remaining())
                .field("reset", &self.reset())
                .finish(),
            Answer::Denied {
                retry_after,
                remaining,
                reset,
            } => f
                .debug_struct("Denied")
                .field("retry_after", &ns(retry_after))
                .field("remaining", &remaining)
                .field("reset", &ns(reset))
                .finish(),
            Answer::NeverFits { cost, capacity } => f
                .debug_struct("NeverFits")
                .field("cost", &cost)
                .field("capacity", &capacity)
                .finish(),
            Answer::Unevaluated => f.write_str("Unevaluated"),
        }
    }
}

impl PartialEq for Decision {
    fn eq(&self, other: &Self) -> bool {
        self.read() == other.read()
    }
}

impl Eq for Decision {}

impl std::hash::Hash for Decision {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.read().hash(state);
    }
}

impl Decision {
    /// The cost fitted and was (or, in a multi-charge that another limit
    /// refused, would have been) deducted: `remaining` whole units are
    /// left, and the budget is fully restored after `reset` if nothing
    /// else is charged.
    ///
    /// Durations are kept as whole nanoseconds: one beyond `u64::MAX`
    /// nanoseconds (584 years) reads back as that.
    pub const fn admitted(remaining: u64, reset: Duration) -> Self {
        Self::admitted_ns(remaining, nanos(reset))
    }

    /// [`Decision::admitted`] in nanoseconds: what the algorithms build,
    /// without a `Duration` on the hot path.
    #[inline(always)]
    pub(crate) const fn admitted_ns(remaining: u64, reset: u64) -> Self {
        Self::admitted_scaled(remaining, 1, reset)
    }

    /// [`Decision::admitted_ns`] with what is left in `per_unit` parts of
    /// a unit (`per_unit` at least 1): the whole units are worked out when
    /// they are read.
    #[inline(always)]
    pub(crate) const fn admitted_scaled(left: u64, per_unit: u64, reset: u64) -> Self {
        Self::admitted_filling(left, per_unit, reset, 1)
    }

    /// [`Decision::admitted_scaled`] with the time to full as `to_full`
    /// parts of which `per_ns` (at least 1) refill in a nanosecond: the
    /// nanoseconds are worked out (rounded up) when they are read.
    #[inline(always)]
    pub(crate) const fn admitted_filling(
        left: u64,
        per_unit: u64,
        to_full: u64,
        per_ns: u64,
    ) -> Self {
        Self(Answer::Admitted {
            left,
            per_unit,
            to_full,
            per_ns,
        })
    }

    /// The cost did not fit and nothing was spent: it fits after exactly
    /// `retry_after` if nothing else is charged; `remaining` whole units
    /// are available now, and the budget is full after `reset`.
    pub const fn denied(retry_after: Duration, remaining: u64, reset: Duration) -> Self {
        Self::denied_ns(nanos(retry_after), remaining, nanos(reset))
    }

    /// [`Decision::denied`] in nanoseconds.
    #[inline(always)]
    pub(crate) const fn denied_ns(retry_after: u64, remaining: u64, reset: u64) -> Self {
        Self(Answer::Denied {
            retry_after,
            remaining,
            reset,
        })
    }

    /// The cost exceeds the policy's capacity and can never fit: no wait is
    /// promised and nothing was spent.
    pub const fn never_fitting(cost: u64, capacity: u64) -> Self {
        Self(Answer::NeverFits { cost, capacity })
    }

    /// Not evaluated: the call was decided without this limit (another
    /// charge can never fit, or was already known to be refused). Nothing
    /// was read or spent for it.
    pub const fn unevaluated() -> Self {
        Self(Answer::Unevaluated)
    }

    /// Whether the charge fitted ([`Decision::admitted`]).
    pub fn is_admitted(&self) -> bool {
        matches!(self.0, Answer::Admitted { .. })
    }

    /// Whether the charge did not fit now but would later
    /// ([`Decision::denied`]).
    pub fn is_denied(&self) -> bool {
        matches!(self.0, Answer::Denied { .. })
    }

    /// Whether the cost exceeds the policy's capacity
    /// ([`Decision::never_fitting`]).
    pub fn never_fits(&self) -> bool {
        matches!(self.0, Answer::NeverFits { .. })
    }

    /// Whether this limit was evaluated at all (not
    /// [`Decision::unevaluated`]).
    pub fn is_evaluated(&self) -> bool {
        !matches!(self.0, Answer::Unevaluated)
    }

    /// Units left (admitted) or available now (denied); 0 for never-fits
    /// and unevaluated.
    pub fn remaining(&self) -> u64 {
        match self.0 {
            Answer::Admitted { left, per_unit, .. } => left / per_unit,
            Answer::Denied { remaining, .. } => remaining,
            Answer::NeverFits { .. } | Answer::Unevaluated => 0,
        }
    }

    /// What the accessors read, for equality and hashing.
    fn read(&self) -> (u8, u64, u64, u64) {
        match self.0 {
            Answer::Admitted { .. } => (0, self.remaining(), self.reset_ns(), 0),
            Answer::Denied {
                retry_after,
                remaining,
                reset,
            } => (1, remaining, reset, retry_after),
            Answer::NeverFits { cost, capacity } => (2, cost, capacity, 0),
            Answer::Unevaluated => (3, 0, 0, 0),
        }
    }

    /// Time until the budget is fully restored; zero for never-fits and
    /// unevaluated.
    pub fn reset(&self) -> Duration {
        Duration::from_nanos(self.reset_ns())
    }

    /// [`Decision::reset`] in nanoseconds.
    fn reset_ns(&self) -> u64 {
        match self.0 {
            Answer::Admitted {
                to_full, per_ns, ..
            } => to_full.div_ceil(per_ns),
            Answer::Denied { reset, .. } => reset,
            Answer::NeverFits { .. } | Answer::Unevaluated => 0,
        }
    }

    /// The wait before this charge would fit, for denials only.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.0 {
            Answer::Denied { retry_after, .. } => Some(Duration::from_nanos(retry_after)),
            _ => None,
        }
    }
}

/// `d` in whole nanoseconds, `u64::MAX` beyond.
const fn nanos(d: Duration) -> u64 {
    let n = d.as_nanos();
    if n > u64::MAX as u128 {
        u64::MAX
    } else {
        n as u64
    }
}

/// The answer to a set of charges made together, all-or-nothing.
///
/// `limits` holds one [`Decision`] per charge, in the order the charges were
/// given, so a caller can describe every policy (e.g. in `RateLimit` headers).
/// When the verdict is not [`Verdict::Admitted`] nothing was spent, and an
/// [admitted](Decision::admitted) entry describes that budget as it stands (units
/// available and time to full without this charge).
#[derive(Clone, PartialEq, Eq)]
pub struct Outcome {
    limits: Limits,
    /// What only shaped or refundable calls have, boxed so that the common
    /// outcome stays small (it is moved on every decision).
    extra: Option<Box<Extra>>,
}

/// The parts of an [`Outcome`] most calls do not have.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Extra {
    /// Zero unless shaped charges were reserved for later: then how long
    /// to hold the request, in nanoseconds, and what was reserved.
    delay: u64,
    reservation: Option<Reservation>,
    /// For an admitted call with refundable charges: what to give back.
    receipt: Option<Receipt>,
}

/// What an admitted call spent, for settling its refundable charges
/// ([`Charge::refundable`], [`Store::refund`](crate::Store::refund),
/// [`Store::confirm`](crate::Store::confirm)): per charge, in charge
/// order, where its admission was counted, in the store's own time
/// ([`crate::algorithm::receipt`]: a window's start, so that a refund
/// never comes out of a window the admission was not counted in; for a
/// token bucket, when its reservation lapses), or [`Receipt::NOTHING`] for
/// a charge that was not refundable: settling it does nothing.
///
/// A receipt settles its call once. A token bucket's reservations are
/// counted per key and minute, not per call: settling a receipt again
/// may settle units another call of the same key reserved in that minute
/// (never more than the key has reserved, never above its capacity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    windows: Vec<crate::Nanos>,
}

impl Receipt {
    /// The entry of a charge that was not refundable: nothing to settle.
    pub const NOTHING: crate::Nanos = crate::Nanos::MAX;

    /// A receipt with one window per charge of the call, in charge order.
    pub fn new(windows: Vec<crate::Nanos>) -> Self {
        Self { windows }
    }

    /// Per charge, in charge order, where its admission was counted.
    pub fn windows(&self) -> &[crate::Nanos] {
        &self.windows
    }

    /// The receipt of the charges at `indices` only, in that order: to
    /// give back some charges of a call, pass those charges and this.
    pub fn only(&self, indices: impl IntoIterator<Item = usize>) -> Self {
        Self {
            windows: indices
                .into_iter()
                .filter_map(|i| self.windows.get(i).copied())
                .collect(),
        }
    }
}

/// What a store reserved for a delayed [`Outcome`], so that it can give the
/// reservation back if the request is dropped before its release
/// ([`Store::cancel`](crate::Store::cancel)): per shaped charge, the state
/// the reservation wrote and the state it replaced, in the store's own
/// time. A store gives a reservation back only while the written state is
/// still what is stored (nothing was reserved or written after it), and
/// then puts back the state it replaced: the budget is exactly as if the
/// request had never come.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    entries: Vec<Reserved>,
}

/// One shaped charge's part of a [`Reservation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// The charge's index in its call.
    pub index: usize,
    /// The state the reservation wrote.
    pub written: crate::state::State,
    /// The state it replaced (`None`: the key had none).
    pub before: Option<crate::state::State>,
}

impl Reservation {
    /// What was reserved, per shaped charge.
    pub fn new(entries: Vec<Reserved>) -> Self {
        Self { entries }
    }

    /// What was reserved, per shaped charge, in charge order.
    pub fn entries(&self) -> &[Reserved] {
        &self.entries
    }
}

/// One decision inline (the common single-limit case needs no allocation),
/// or several.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Limits {
    One(Decision),
    Many(Vec<Decision>),
}

/// The overall verdict of an [`Outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Every charge fitted and all were spent.
    Admitted,
    /// At least one charge did not fit; none was spent. `retry_after` is the
    /// longest of the refusing limits' waits: before it, one of them still
    /// refuses.
    Denied {
        /// Exact wait until every refusing limit would fit this charge.
        retry_after: Duration,
    },
    /// At least one cost exceeds its policy's capacity; none was spent.
    NeverFits,
}

/// What the accessors give: the limits, and the delay, reservation and
/// receipt (none for most outcomes).
impl fmt::Debug for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outcome")
            .field("limits", &self.limits())
            .field("delay", &self.delay())
            .field("reservation", &self.reservation())
            .field("receipt", &self.receipt())
            .finish()
    }
}

impl Outcome {
    /// An outcome from per-charge decisions, in charge order.
    pub fn new(limits: Vec<Decision>) -> Self {
        match limits.as_slice() {
            [one] => Self::one(*one),
            _ => Self {
                limits: Limits::Many(limits),
                extra: None,
            },
        }
    }

    /// An outcome of a single charge.
    #[inline]
    pub fn one(decision: Decision) -> Self {
        Self {
            limits: Limits::One(decision),
            extra: None,
        }
    }

    /// An admitted outcome whose shaped charges were reserved for `delay`
    /// from now: the request goes on after `delay` (see
    /// [`Charge::shaped`]); `reservation` says what to give back if it is
    /// dropped first.
    pub fn delayed(limits: Vec<Decision>, delay: Duration, reservation: Reservation) -> Self {
        let mut outcome = Self::new(limits);
        outcome.extra = Some(Box::new(Extra {
            delay: nanos(delay),
            reservation: Some(reservation),
            receipt: None,
        }));
        outcome
    }

    /// How long to hold the request before it goes on: zero unless shaped
    /// charges were reserved for later ([`Charge::shaped`]).
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.extra.as_ref().map_or(0, |e| e.delay))
    }

    /// What a delayed outcome reserved ([`Outcome::delayed`]).
    pub fn reservation(&self) -> Option<&Reservation> {
        self.extra.as_ref().and_then(|e| e.reservation.as_ref())
    }

    /// The same outcome with `receipt`, for a store's admitted call with
    /// refundable charges ([`Charge::refundable`]).
    #[must_use]
    pub fn with_receipt(mut self, receipt: Receipt) -> Self {
        self.extra.get_or_insert_default().receipt = Some(receipt);
        self
    }

    /// What an admitted call with refundable charges spent, to give them
    /// back ([`Store::refund`](crate::Store::refund)); `None` otherwise.
    pub fn receipt(&self) -> Option<&Receipt> {
        self.extra.as_ref().and_then(|e| e.receipt.as_ref())
    }

    /// The answer every store gives a call in which some charge can never
    /// fit ([`Charge::can_fit`]): those charges [never fit](Decision::never_fitting),
    /// the others are [`Decision::unevaluated`], and nothing is read or
    /// written. `None` when every charge can fit.
    pub fn never_fits(charges: &[Charge]) -> Option<Self> {
        if charges.iter().all(Charge::can_fit) {
            return None;
        }
        let limits = charges
            .iter()
            .map(|c| {
                if c.can_fit() {
                    Decision::unevaluated()
                } else {
                    Decision::never_fitting(c.cost(), c.policy().capacity())
                }
            })
            .collect();
        Some(Self::new(limits))
    }

    /// Per-charge decisions, in the order the charges were given.
    pub fn limits(&self) -> &[Decision] {
        match &self.limits {
            Limits::One(d) => std::slice::from_ref(d),
            Limits::Many(v) => v,
        }
    }

    /// The overall verdict: never-fits beats denied beats admitted. An
    /// outcome with an unevaluated limit and no refusal is not admitted: it
    /// is reported as denied with no wait, which a store never returns.
    #[inline]
    pub fn verdict(&self) -> Verdict {
        // One admitted limit, the common outcome: answered inline.
        if let [Decision(Answer::Admitted { .. })] = self.limits() {
            return Verdict::Admitted;
        }
        self.verdict_of_all()
    }

    /// [`verdict`](Self::verdict), limit by limit.
    fn verdict_of_all(&self) -> Verdict {
        let mut wait: Option<u64> = None;
        let mut unevaluated = false;
        for d in self.limits() {
            match d.0 {
                Answer::NeverFits { .. } => return Verdict::NeverFits,
                Answer::Denied { retry_after, .. } => {
                    wait = Some(wait.map_or(retry_after, |w| w.max(retry_after)));
                }
                Answer::Unevaluated => unevaluated = true,
                Answer::Admitted { .. } => {}
            }
        }
        match wait {
            Some(retry_after) => Verdict::Denied {
                retry_after: Duration::from_nanos(retry_after),
            },
            None if unevaluated => Verdict::Denied {
                retry_after: Duration::ZERO,
            },
            None => Verdict::Admitted,
        }
    }

    /// Whether every charge was admitted.
    pub fn is_admitted(&self) -> bool {
        self.verdict() == Verdict::Admitted
    }

    /// The index of the most restrictive limit: the never-fitting one, else
    /// the refusing one with the longest wait, else the admitted one with the
    /// fewest units left. `None` for an empty outcome.
    pub fn most_restrictive(&self) -> Option<usize> {
        let rank = |d: &Decision| match d.0 {
            Answer::NeverFits { .. } => (2, u64::MAX, 0),
            Answer::Denied { retry_after, .. } => (1, retry_after, 0),
            Answer::Admitted { .. } => (0, 0, u64::MAX - d.remaining()),
            Answer::Unevaluated => (0, 0, 0),
        };
        let limits = self.limits();
        (0..limits.len()).max_by_key(|&i| rank(&limits[i]))
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Admitted => f.write_str("admitted"),
            Verdict::Denied { retry_after } => write!(f, "denied, retry after {retry_after:?}"),
            Verdict::NeverFits => f.write_str("never fits"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Rate;

    /// An admission built from a scaled credit reads, compares and hashes
    /// as one built from the whole units it holds (the Redis store builds
    /// the second kind, the in-memory store the first).
    #[test]
    fn a_scaled_admission_is_the_admission_of_its_whole_units() {
        use std::hash::{BuildHasher, RandomState};
        let hashes = RandomState::new();
        let reset = Duration::from_millis(1500);
        // 7 whole units and a part of the next, 10 parts to a unit.
        let scaled = Decision::admitted_scaled(79, 10, 1_500_000_000);
        let whole = Decision::admitted(7, reset);
        assert_eq!(scaled.remaining(), 7);
        assert_eq!(scaled, whole);
        assert_eq!(hashes.hash_one(scaled), hashes.hash_one(whole));
        assert_eq!(format!("{scaled:?}"), format!("{whole:?}"));
        assert_ne!(scaled, Decision::admitted(8, reset));
        assert_ne!(
            scaled,
            Decision::admitted(7, reset + Duration::from_nanos(1))
        );
        // Units left is not a wait: an admission is never a denial.
        assert_ne!(whole, Decision::denied(Duration::ZERO, 7, reset));
    }

    #[test]
    fn zero_cost_is_not_a_charge() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(1)).unwrap();
        let e = Charge::new(Key::new("p"), p, 0).unwrap_err();
        assert!(e.to_string().contains("cost 0"));
    }

    /// Found in review: the stores disagreed on a zero wait (one shaped
    /// it, one did not) and on waits beyond the Redis horizon.
    #[test]
    fn a_zero_wait_is_unshaped_and_long_waits_are_the_horizon() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(1)).unwrap();
        let c = Charge::new(Key::new("p"), p, 1).unwrap();
        assert_eq!(c.clone().shaped(Duration::ZERO).max_delay(), None);
        assert_eq!(
            c.clone().shaped(Duration::MAX).max_delay(),
            Some(Charge::MAX_DELAY)
        );
        let second = Duration::from_secs(1);
        assert_eq!(c.shaped(second).max_delay(), Some(second));
    }

    #[test]
    fn verdict_takes_the_longest_wait_and_never_fits_wins() {
        let denied = |s| Decision::denied(Duration::from_secs(s), 0, Duration::from_secs(s));
        let ok = Decision::admitted(1, Duration::ZERO);
        let o = Outcome::new(vec![ok, denied(2), denied(5), denied(1)]);
        assert_eq!(
            o.verdict(),
            Verdict::Denied {
                retry_after: Duration::from_secs(5)
            }
        );
        assert_eq!(o.most_restrictive(), Some(2));
        let never = Decision::never_fitting(4, 3);
        assert_eq!(
            Outcome::new(vec![denied(9), never]).verdict(),
            Verdict::NeverFits
        );
        assert_eq!(Outcome::new(vec![ok]).verdict(), Verdict::Admitted);
    }

    /// A decision is moved on every charge: kept small, it costs no
    /// store-forwarding stalls (BENCHMARKS.md, round 4). Five words for a
    /// decision (an admission's time to full is kept as the missing
    /// credit and the refill, divided when read), six for a single-charge
    /// outcome (on 64-bit targets). Its Debug form speaks `Duration`s, as
    /// its accessors do.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_decision_is_five_words_and_an_outcome_six() {
        assert_eq!(std::mem::size_of::<Decision>(), 40);
        assert_eq!(std::mem::size_of::<Outcome>(), 48);
        let d = Decision::denied(Duration::from_secs(2), 1, Duration::from_millis(1500));
        assert_eq!(
            format!("{d:?}"),
            "Denied { retry_after: 2s, remaining: 1, reset: 1.5s }"
        );
    }
}
