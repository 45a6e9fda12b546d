//! Policies: what a budget is, in which unit, under which time rule.
//!
//! Every number is validated at construction so that the algorithms can work
//! in exact integer arithmetic: a policy whose numbers cannot be represented
//! exactly in 64-bit scaled units is refused with [`InvalidPolicy`].

use std::any::Any;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::panic::{RefUnwindSafe, UnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::Nanos;
use crate::divisor::Divisor;

/// A refill rate, named as a rate: `Rate::per_second(10)` is ten per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    amount: u64,
    period: Duration,
}

impl Rate {
    /// `amount` units every `period`.
    pub const fn new(amount: u64, period: Duration) -> Self {
        Self { amount, period }
    }

    /// `amount` units per second.
    pub const fn per_second(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(1))
    }

    /// `amount` units per minute.
    pub const fn per_minute(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(60))
    }

    /// `amount` units per hour.
    pub const fn per_hour(amount: u64) -> Self {
        Self::new(amount, Duration::from_secs(3600))
    }

    /// Units added per period.
    pub const fn amount(&self) -> u64 {
        self.amount
    }

    /// The period over which [`Rate::amount`] units are added.
    pub const fn period(&self) -> Duration {
        self.period
    }
}

/// What one unit of cost stands for; it names the unit in headers and docs.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Unit {
    /// One unit per request (the default).
    #[default]
    Requests,
    /// Content bytes.
    Bytes,
    /// Requests running at the same time (used by concurrency limits).
    ConcurrentRequests,
    /// Any other unit, e.g. `"kib"` or `"work"`; must be a valid policy name.
    Other(Arc<str>),
}

impl Unit {
    /// The unit's name as used in the `RateLimit-Policy` `pu` parameter.
    pub fn as_str(&self) -> &str {
        match self {
            Unit::Requests => "requests",
            Unit::Bytes => "content-bytes",
            Unit::ConcurrentRequests => "concurrent-requests",
            Unit::Other(name) => name,
        }
    }
}

/// Credit a token bucket starts with, for a key it has never seen (or that
/// stores forgot because it was idle).
///
/// A bucket that starts full and has refilled to full is idle: stores may
/// drop it, and it decides exactly like a key never seen. A bucket that
/// starts empty and has refilled to full is *not* the same as one never
/// seen (that one would start empty): stores keep it, full, for
/// [`EMPTY_KEPT_FULL`](crate::algorithm::EMPTY_KEPT_FULL) (a minute) after
/// it filled, and only a key that stays away longer starts empty again, as
/// a new one. So a client that waits the `Retry-After` it was given is
/// admitted (the wait is rounded up by at most a second), and memory stays
/// bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Initial {
    /// Start with `capacity` tokens: an immediate burst is allowed (default).
    #[default]
    Full,
    /// Start with no tokens: the first unit is available after one refill step.
    Empty,
}

/// The time rule of a policy, with its validated, exact parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Token bucket: capacity `B`, refill `r`, lazily refilled on arrival.
    TokenBucket(TokenBucket),
    /// Fixed window anchored at the first admitted request: at most the
    /// limit within the window from that admission; a refusal neither
    /// counts nor extends the window.
    FixedWindow(Window),
    /// Sliding window counter: windows of the window's length tiling the
    /// time line from the key's first admission; a charge is admitted when
    /// `previous × (window − elapsed) + (current + cost) × window ≤ limit × window`,
    /// i.e. the previous window's admitted cost is weighted by the share of it
    /// still inside the sliding interval. Computed exactly in integers.
    SlidingWindow(Window),
}

/// A token bucket's parameters, validated so that credit is exact.
///
/// Credit is kept in *scaled units* of `1 / units_per_token` tokens, and
/// `units_per_nanosecond` such units are added per nanosecond: the refill
/// rate in tokens per nanosecond, reduced to lowest terms, is
/// `units_per_nanosecond / units_per_token`. A full bucket holds
/// `capacity × units_per_token` units, which fits 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    pub(crate) capacity: u64,
    pub(crate) numerator: u64,
    pub(crate) denominator: u64,
    pub(crate) initial: Initial,
    pub(crate) rate: Rate,
    /// `capacity × denominator`: a full bucket in scaled units (checked to
    /// fit 64 bits when the policy is made).
    pub(crate) cap: u64,
    /// `numerator`, prepared: the time to refill units, without a division
    /// instruction.
    pub(crate) refill: Divisor,
    /// `denominator`, prepared: whole tokens in a credit.
    pub(crate) per_token: Divisor,
}

impl TokenBucket {
    /// Maximum stored tokens, `B`.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The refill rate as configured.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// Credit for a key with no state.
    pub fn initial(&self) -> Initial {
        self.initial
    }

    /// Scaled units per token.
    pub fn units_per_token(&self) -> u64 {
        self.denominator
    }

    /// Scaled units added per nanosecond.
    pub fn units_per_nanosecond(&self) -> u64 {
        self.numerator
    }
}

/// A window algorithm's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    pub(crate) limit: u64,
    pub(crate) window: Nanos,
}

impl Window {
    /// Maximum admitted (or, sliding, weighted) cost per window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window's length.
    pub fn length(&self) -> Duration {
        Duration::from_nanos(self.window)
    }

    /// The window's length in nanoseconds.
    pub fn nanos(&self) -> Nanos {
        self.window
    }
}

/// A named budget: an algorithm, its numbers and its unit.
///
/// Cheap to clone (one shared pointer: a [`crate::Charge`] carries one per
/// request). Construct with [`Policy::token_bucket`],
/// [`Policy::fixed_window`] or [`Policy::sliding_window`].
///
/// # Which state a policy reads
///
/// Budget state belongs to the policy's **name and unit** and the key, not
/// to its numbers: two policies that differ only in their numbers (a plan
/// upgrade, a limit changed at runtime) read and write the same state, and
/// every store converts what the key has spent from the numbers it was
/// written under to the numbers it is read under
/// ([`algorithm::carry_over`](crate::algorithm::carry_over)). A policy of
/// another name or unit is another budget.
#[derive(Clone)]
pub struct Policy {
    inner: Arc<PolicyInner>,
}

struct PolicyInner {
    name: Arc<str>,
    unit: Unit,
    algorithm: Algorithm,
    /// A hash of the name and unit, the part of the policy its state
    /// belongs to, kept in step with them by every constructor and setter,
    /// so stores need not rehash them per decision.
    state_identity: u64,
    /// The last store that looked up the space of these numbers, and the
    /// space it gave them (see [`Policy::cached_space`]): `store << 24 |
    /// space`, `u64::MAX` when none has.
    space_cache: AtomicU64,
    /// What a front end derived from this policy once ([`Policy::memo`]);
    /// unwind-safe, as every other part of a policy is.
    memo: OnceLock<Box<dyn Any + Send + Sync + UnwindSafe + RefUnwindSafe>>,
}

impl PartialEq for Policy {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.name == other.inner.name
                && self.inner.unit == other.inner.unit
                && self.inner.algorithm == other.inner.algorithm)
    }
}

impl Eq for Policy {}

impl Hash for Policy {
    fn hash<H: Hasher>(&self, state: &mut H) {
        (&*self.inner.name, &self.inner.unit, &self.inner.algorithm).hash(state);
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("name", &self.inner.name)
            .field("unit", &self.inner.unit)
            .field("algorithm", &self.inner.algorithm)
            .finish_non_exhaustive()
    }
}

/// Why a policy was refused at construction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid policy {name:?}: {reason}")]
pub struct InvalidPolicy {
    name: String,
    reason: String,
}

impl InvalidPolicy {
    fn new(name: &str, reason: impl Into<String>) -> Self {
        Self {
            name: name.to_owned(),
            reason: reason.into(),
        }
    }

    /// The name of the policy that was refused.
    pub fn policy_name(&self) -> &str {
        &self.name
    }

    /// What was wrong, with the offending value.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

const MAX_NAME_LEN: usize = 64;

/// A name that headers and metric labels cannot carry: names of policies
/// and of in-flight limits are 1 to 64 ASCII letters, digits, `-`, `_` or
/// `.`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid name {name:?}: {reason}")]
pub struct InvalidName {
    name: String,
    reason: String,
}

impl InvalidName {
    /// The name that was refused.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What was wrong, with the offending value.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Checks a name of a policy or an in-flight limit. Names appear as
/// structured-field strings in `RateLimit` headers and as metric labels;
/// restricting them keeps both unambiguous.
pub fn check_name(name: &str) -> Result<(), InvalidName> {
    let refuse = |reason: String| InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(refuse(format!(
            "a name must be 1..={MAX_NAME_LEN} bytes, got {}",
            name.len()
        )));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(refuse(format!(
            "a name may contain only ASCII letters, digits, '-', '_' and '.', found {bad:?}"
        )));
    }
    Ok(())
}

fn validate_name(name: &str) -> Result<(), InvalidPolicy> {
    check_name(name).map_err(|e| InvalidPolicy::new(name, e.reason))
}

fn nanos(name: &str, what: &str, d: Duration) -> Result<u64, InvalidPolicy> {
    let n = u64::try_from(d.as_nanos()).map_err(|_| {
        InvalidPolicy::new(
            name,
            format!("{what} {d:?} does not fit in 64-bit nanoseconds"),
        )
    })?;
    if n == 0 {
        return Err(InvalidPolicy::new(
            name,
            format!("{what} must be positive, got {d:?}"),
        ));
    }
    Ok(n)
}

const fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

impl Policy {
    /// A token bucket holding at most `capacity` tokens, refilled at `rate`,
    /// starting full.
    ///
    /// Refused when the capacity, the rate's amount or its period is zero, or
    /// when `capacity` expressed in the exact scaled unit (`1 / denominator` of
    /// a token, where `rate` reduced to lowest terms is
    /// `numerator / denominator` tokens per nanosecond) overflows 64 bits.
    ///
    /// ```
    /// use tollgate_budget::{Policy, Rate};
    /// let export = Policy::token_bucket("export", 3, Rate::per_second(2)).unwrap();
    /// assert_eq!(export.capacity(), 3);
    /// assert!(Policy::token_bucket("bad", 0, Rate::per_second(2)).is_err());
    /// ```
    pub fn token_bucket(
        name: impl Into<Arc<str>>,
        capacity: u64,
        rate: Rate,
    ) -> Result<Self, InvalidPolicy> {
        let name = name.into();
        validate_name(&name)?;
        if capacity == 0 {
            return Err(InvalidPolicy::new(
                &name,
                "capacity must be positive, got 0",
            ));
        }
        if rate.amount == 0 {
            return Err(InvalidPolicy::new(
                &name,
                "refill amount must be positive, got 0",
            ));
        }
        let period = nanos(&name, "refill period", rate.period)?;
        let g = gcd(rate.amount, period);
        let (numerator, denominator) = (rate.amount / g, period / g);
        if capacity.checked_mul(denominator).is_none() {
            return Err(InvalidPolicy::new(
                &name,
                format!(
                    "capacity {capacity} at {} per {:?} needs {capacity} x {denominator} \
                     scaled units, which overflows 64 bits; use a shorter period or smaller capacity",
                    rate.amount, rate.period
                ),
            ));
        }
        Ok(Self::assemble(
            name,
            Unit::Requests,
            Algorithm::TokenBucket(TokenBucket {
                capacity,
                numerator,
                denominator,
                initial: Initial::Full,
                rate,
                cap: capacity * denominator,
                refill: Divisor::new(numerator),
                per_token: Divisor::new(denominator),
            }),
        ))
    }

    /// A fixed window of length `window` anchored at the first admitted
    /// request, admitting at most `limit` per window.
    pub fn fixed_window(
        name: impl Into<Arc<str>>,
        limit: u64,
        window: Duration,
    ) -> Result<Self, InvalidPolicy> {
        Self::windowed(name.into(), limit, window, |limit, window| {
            Algorithm::FixedWindow(Window { limit, window })
        })
    }

    /// A sliding window counter admitting at most `limit` weighted cost per
    /// `window` (see [`Algorithm::SlidingWindow`] for the exact rule).
    ///
    /// Refused when `3 × limit × window` (in nanoseconds) does not fit 128
    /// bits: the exact comparison weighs up to three such products (e.g. a
    /// limit of 2^64 − 1 with a window over about 190 years). Any limit works with
    /// windows up to a day.
    pub fn sliding_window(
        name: impl Into<Arc<str>>,
        limit: u64,
        window: Duration,
    ) -> Result<Self, InvalidPolicy> {
        let name = name.into();
        let policy = Self::windowed(name.clone(), limit, window, |limit, window| {
            Algorithm::SlidingWindow(Window { limit, window })
        })?;
        let window = policy.window().as_nanos();
        if u128::from(limit)
            .checked_mul(window)
            .and_then(|p| p.checked_mul(3))
            .is_none()
        {
            return Err(InvalidPolicy::new(
                &name,
                format!(
                    "3 x limit {limit} x window {window} ns does not fit 128 bits; \
                     use a smaller limit or a shorter window"
                ),
            ));
        }
        Ok(policy)
    }

    fn windowed(
        name: Arc<str>,
        limit: u64,
        window: Duration,
        algorithm: impl FnOnce(u64, u64) -> Algorithm,
    ) -> Result<Self, InvalidPolicy> {
        validate_name(&name)?;
        if limit == 0 {
            return Err(InvalidPolicy::new(&name, "limit must be positive, got 0"));
        }
        let window = nanos(&name, "window", window)?;
        Ok(Self::assemble(
            name,
            Unit::Requests,
            algorithm(limit, window),
        ))
    }

    fn assemble(name: Arc<str>, unit: Unit, algorithm: Algorithm) -> Self {
        let mut h = std::hash::DefaultHasher::new();
        (&*name, &unit).hash(&mut h);
        Self {
            inner: Arc::new(PolicyInner {
                state_identity: h.finish(),
                name,
                unit,
                algorithm,
                space_cache: AtomicU64::new(u64::MAX),
                memo: OnceLock::new(),
            }),
        }
    }

    /// The same policy counting in `unit`.
    #[must_use]
    pub fn with_unit(self, unit: Unit) -> Self {
        Self::assemble(self.inner.name.clone(), unit, self.inner.algorithm)
    }

    /// The same token bucket with the given initial credit; other algorithms
    /// are returned unchanged.
    #[must_use]
    pub fn with_initial(self, initial: Initial) -> Self {
        let mut algorithm = self.inner.algorithm;
        if let Algorithm::TokenBucket(bucket) = &mut algorithm {
            bucket.initial = initial;
        }
        Self::assemble(self.inner.name.clone(), self.inner.unit.clone(), algorithm)
    }

    /// The space `store` gave these numbers, if it was the last store to
    /// ask.
    #[inline]
    pub(crate) fn cached_space(&self, store: u64) -> Option<u32> {
        let cached = self.inner.space_cache.load(Ordering::Relaxed);
        (cached >> 24 == store).then_some((cached & 0xff_ffff) as u32)
    }

    /// Remembers the space `store` gave these numbers (`store` below 2^40,
    /// `space` below 2^24).
    pub(crate) fn cache_space(&self, store: u64, space: u32) {
        self.inner
            .space_cache
            .store(store << 24 | u64::from(space), Ordering::Relaxed);
    }

    /// A value derived from this policy once and kept with it: made by
    /// `make` on first use, then shared by every clone of the policy and
    /// dropped with the last. A policy never changes once built (a change
    /// makes a new one), so the value never goes stale.
    ///
    /// **The slot is tollgate's**, not part of the stable API (hence hidden
    /// from the docs): its layer keeps the policy's pre-rendered refusal
    /// here, so that a refusal writes only its numbers. There is one value
    /// per policy: `None` when a value of another type was kept first, and
    /// the layer then writes its answers the slower, general way. An
    /// application keeps its own derivations elsewhere. `make` must not
    /// call `memo` on the same policy (it would wait for itself).
    ///
    /// ```
    /// use tollgate_budget::{Policy, Rate};
    ///
    /// let policy = Policy::token_bucket("api", 10, Rate::per_second(1)).unwrap();
    /// let header = policy.memo(|p| format!("\"{}\";q={}", p.name(), p.capacity()));
    /// assert_eq!(header.map(String::as_str), Some("\"api\";q=10"));
    /// // Made once: the clone sees the same value, another type sees none.
    /// assert!(std::ptr::eq(header.unwrap(), policy.clone().memo(|_| String::new()).unwrap()));
    /// assert_eq!(policy.memo(|_| 0u32), None);
    /// ```
    #[doc(hidden)]
    pub fn memo<T>(&self, make: impl FnOnce(&Policy) -> T) -> Option<&T>
    where
        T: Any + Send + Sync + UnwindSafe + RefUnwindSafe,
    {
        let kept: &(dyn Any + Send + Sync) =
            &**self.inner.memo.get_or_init(|| Box::new(make(self)));
        kept.downcast_ref()
    }

    /// Whether `other` reads the same state: the same name and unit.
    pub fn same_budget(&self, other: &Policy) -> bool {
        self.inner.state_identity == other.inner.state_identity
            && self.inner.name == other.inner.name
            && self.inner.unit == other.inner.unit
    }

    /// The policy's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The unit of cost.
    pub fn unit(&self) -> &Unit {
        &self.inner.unit
    }

    /// The algorithm and its exact parameters.
    pub fn algorithm(&self) -> &Algorithm {
        &self.inner.algorithm
    }

    /// The largest cost a single charge can ever have: `B` for a token bucket,
    /// the limit for windows.
    pub fn capacity(&self) -> u64 {
        match self.inner.algorithm {
            Algorithm::TokenBucket(b) => b.capacity,
            Algorithm::FixedWindow(w) | Algorithm::SlidingWindow(w) => w.limit,
        }
    }

    /// The window the quota is expressed over, for the `w` header parameter:
    /// the refill period scaled to refill a full bucket for token buckets
    /// (rounded up to a whole second by the header writer), the window for
    /// window algorithms.
    pub fn window(&self) -> Duration {
        match self.inner.algorithm {
            Algorithm::TokenBucket(b) => {
                // Time to refill from empty: capacity * denominator / numerator ns.
                let ns = (u128::from(b.capacity) * u128::from(b.denominator))
                    .div_ceil(u128::from(b.numerator));
                Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
            }
            Algorithm::FixedWindow(w) | Algorithm::SlidingWindow(w) => w.length(),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, unit) = (&self.inner.name, self.inner.unit.as_str());
        match &self.inner.algorithm {
            Algorithm::TokenBucket(b) => write!(
                f,
                "{}: token bucket, capacity {} {}, refill {} per {:?}",
                name, b.capacity, unit, b.rate.amount, b.rate.period
            ),
            Algorithm::FixedWindow(w) => write!(
                f,
                "{}: fixed window, {} {} per {:?} from the first admission",
                name,
                w.limit,
                unit,
                w.length()
            ),
            Algorithm::SlidingWindow(w) => write!(
                f,
                "{}: sliding window, {} {} per {:?}",
                name,
                w.limit,
                unit,
                w.length()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy, and every charge and rule holding one, stays unwind-safe
    /// (the memo's slot included): an application may hold them across
    /// `catch_unwind`.
    #[test]
    fn a_policy_is_unwind_safe() {
        fn unwind_safe<T: UnwindSafe + RefUnwindSafe>() {}
        unwind_safe::<Policy>();
        unwind_safe::<crate::Charge>();
    }

    #[test]
    fn rates_are_reduced_to_lowest_terms() {
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        match p.algorithm() {
            Algorithm::TokenBucket(b) => {
                assert_eq!(
                    (b.units_per_nanosecond(), b.units_per_token()),
                    (1, 500_000_000)
                )
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(p.window(), Duration::from_millis(1500));
    }

    #[test]
    fn invalid_numbers_are_refused_with_the_value() {
        let e = Policy::token_bucket("p", 0, Rate::per_second(1)).unwrap_err();
        assert!(e.to_string().contains("capacity must be positive"), "{e}");
        let e = Policy::token_bucket("p", 1, Rate::per_second(0)).unwrap_err();
        assert!(e.to_string().contains("refill amount"), "{e}");
        let e = Policy::token_bucket("p", 1, Rate::new(1, Duration::ZERO)).unwrap_err();
        assert!(e.to_string().contains("refill period"), "{e}");
        let e = Policy::token_bucket("p", u64::MAX / 2, Rate::per_hour(7)).unwrap_err();
        assert!(e.to_string().contains("overflows 64 bits"), "{e}");
        let e = Policy::fixed_window("p", 0, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("limit"), "{e}");
        let e = Policy::sliding_window("p", 1, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("window must be positive"), "{e}");
        let e = Policy::fixed_window("p", 1, Duration::MAX).unwrap_err();
        assert!(e.to_string().contains("64-bit"), "{e}");
    }

    #[test]
    fn names_are_checked() {
        assert!(Policy::fixed_window("", 1, Duration::from_secs(1)).is_err());
        let e = Policy::fixed_window("a b", 1, Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("' '"), "{e}");
        assert!(Policy::fixed_window("x".repeat(65), 1, Duration::from_secs(1)).is_err());
        assert!(Policy::fixed_window("per-ip_v2.1", 1, Duration::from_secs(1)).is_ok());
    }
}
