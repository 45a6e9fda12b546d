//! [`AdaptiveConfig`]: the validated parameters of an [`AdaptiveLimit`],
//! built with [`AdaptiveConfigBuilder`].
//!
//! [`AdaptiveLimit`]: super::AdaptiveLimit

use std::time::Duration;

use crate::Nanos;

use super::Failure;

/// A fraction `numerator / denominator`, kept as the two integers the
/// caller gave so that the controller's arithmetic stays exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Frac {
    pub(super) num: u32,
    pub(super) den: u32,
}

impl Frac {
    const fn new(num: u32, den: u32) -> Self {
        Self { num, den }
    }

    /// `self < 1`.
    fn below_one(self) -> bool {
        self.num < self.den
    }
}

/// The parameters of an [`AdaptiveLimit`](super::AdaptiveLimit), validated:
/// build one with [`AdaptiveConfig::builder`], or take the
/// [`Default`] (the values listed on the builder's methods).
///
/// ```
/// use std::time::Duration;
/// use tollgate_budget::AdaptiveConfig;
///
/// let config = AdaptiveConfig::builder()
///     .bounds(2, 500)
///     .window(Duration::from_millis(50))
///     .build()?;
/// assert_eq!(config.bounds(), (2, 500));
/// assert_eq!(config.initial(), 20);
///
/// let refused = AdaptiveConfig::builder().bounds(10, 5).build().unwrap_err();
/// assert_eq!(refused.to_string(), "invalid adaptive limit: min 10 is above max 5");
/// # Ok::<(), tollgate_budget::InvalidAdaptiveLimit>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveConfig {
    pub(super) min: u32,
    pub(super) max: u32,
    pub(super) initial: u32,
    pub(super) window: Nanos,
    pub(super) smoothing: Frac,
    pub(super) tolerance: Frac,
    pub(super) backoff: Frac,
    pub(super) probe_interval: Nanos,
    pub(super) probe_limit: u32,
    pub(super) probe_samples: u32,
    pub(super) backoff_on: [bool; 3],
    pub(super) report: Frac,
}

impl AdaptiveConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> AdaptiveConfigBuilder {
        AdaptiveConfigBuilder::default()
    }

    /// The bounds `(min, max)` the limit always stays within.
    pub fn bounds(&self) -> (u32, u32) {
        (self.min, self.max)
    }

    /// The limit the controller starts from.
    pub fn initial(&self) -> u32 {
        self.initial
    }

    /// The length of a sampling window, in nanoseconds.
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// The smoothing factor as `(numerator, denominator)`.
    pub fn smoothing(&self) -> (u32, u32) {
        (self.smoothing.num, self.smoothing.den)
    }

    /// The latency tolerance as `(numerator, denominator)`.
    pub fn tolerance(&self) -> (u32, u32) {
        (self.tolerance.num, self.tolerance.den)
    }

    /// The multiplicative backoff on failure as `(numerator, denominator)`.
    pub fn backoff(&self) -> (u32, u32) {
        (self.backoff.num, self.backoff.den)
    }

    /// How long after one probe of the minimum latency the next starts, in
    /// nanoseconds.
    pub fn probe_interval(&self) -> Nanos {
        self.probe_interval
    }

    /// The limit held during a probe (before clamping into the bounds and
    /// to the limit in force).
    pub fn probe_limit(&self) -> u32 {
        self.probe_limit
    }

    /// How many latencies a probe measures at least.
    pub fn probe_samples(&self) -> u32 {
        self.probe_samples
    }

    /// Whether a failure of this kind cuts the limit.
    pub fn backs_off_on(&self, failure: Failure) -> bool {
        self.backoff_on[failure as usize]
    }

    /// The fraction of a move that is reported, as `(numerator,
    /// denominator)`.
    pub fn report_change(&self) -> (u32, u32) {
        (self.report.num, self.report.den)
    }
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        let b = AdaptiveConfigBuilder::default();
        Self {
            min: b.min,
            max: b.max,
            initial: DEFAULT_INITIAL,
            window: DEFAULT_WINDOW_NS,
            smoothing: b.smoothing,
            tolerance: b.tolerance,
            backoff: b.backoff,
            probe_interval: DEFAULT_PROBE_INTERVAL_NS,
            probe_limit: b.probe_limit,
            probe_samples: b.probe_samples,
            backoff_on: b.backoff_on,
            report: b.report,
        }
    }
}

const DEFAULT_INITIAL: u32 = 20;
const DEFAULT_WINDOW_NS: Nanos = 100_000_000;
const DEFAULT_PROBE_INTERVAL_NS: Nanos = 10_000_000_000;

/// Builds an [`AdaptiveConfig`]; every setting has a default, and
/// [`build`](Self::build) checks them together.
///
/// Fractions are given as `(numerator, denominator)` so that they are
/// exact: `smoothing(1, 5)` is 0.2.
#[derive(Debug, Clone)]
#[must_use]
pub struct AdaptiveConfigBuilder {
    min: u32,
    max: u32,
    initial: Option<u32>,
    window: Duration,
    smoothing: Frac,
    tolerance: Frac,
    backoff: Frac,
    probe_interval: Duration,
    probe_limit: u32,
    probe_samples: u32,
    backoff_on: [bool; 3],
    report: Frac,
}

impl Default for AdaptiveConfigBuilder {
    fn default() -> Self {
        Self {
            min: 1,
            max: 1000,
            initial: None,
            window: Duration::from_nanos(DEFAULT_WINDOW_NS),
            smoothing: Frac::new(1, 5),
            tolerance: Frac::new(5, 4),
            backoff: Frac::new(9, 10),
            probe_interval: Duration::from_nanos(DEFAULT_PROBE_INTERVAL_NS),
            probe_limit: 3,
            probe_samples: 10,
            // Indexed by `Failure as usize`: Error, TimedOut, Cancelled.
            backoff_on: [true, true, false],
            report: Frac::new(1, 10),
        }
    }
}

impl AdaptiveConfigBuilder {
    /// The limit stays within `min..=max` (default 1 and 1000); `min` is at
    /// least 1.
    pub fn bounds(mut self, min: u32, max: u32) -> Self {
        self.min = min;
        self.max = max;
        self
    }

    /// The limit to start from (default 20, moved into the bounds when
    /// they exclude it); when set, it must lie within the bounds.
    pub fn initial(mut self, initial: u32) -> Self {
        self.initial = Some(initial);
        self
    }

    /// The sampling window (default 100 ms, not zero): latencies are
    /// averaged over a window, and the limit moves by the gradient once per
    /// window (a window whose first latencies already ask for a fall by
    /// more than a tenth closes early, and a new one starts: see
    /// [`AdaptiveLimit`](super::AdaptiveLimit)) and by a failure at most
    /// once in a window's length.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How far each window's new limit is followed when it is higher
    /// (default 1/5): the limit becomes `(1 − s) × limit + s × new`; a
    /// lower one is followed at once, and so is a higher one from a window
    /// that filled the limit with latency within the tolerance of the
    /// floor. In `(0, 1]`.
    pub fn smoothing(mut self, numerator: u32, denominator: u32) -> Self {
        self.smoothing = Frac::new(numerator, denominator);
        self
    }

    /// How much slower than the minimum latency a window may be before the
    /// limit shrinks (default 5/4): the gradient is `min_latency ×
    /// tolerance / window_latency`. At least 1.
    pub fn tolerance(mut self, numerator: u32, denominator: u32) -> Self {
        self.tolerance = Frac::new(numerator, denominator);
        self
    }

    /// The factor a failure multiplies the limit by (default 9/10), at most
    /// once per window. In `(0, 1]`; 1 turns backing off off.
    pub fn backoff(mut self, numerator: u32, denominator: u32) -> Self {
        self.backoff = Frac::new(numerator, denominator);
        self
    }

    /// How long after one probe of the minimum latency ends the next starts
    /// (default 10 s; at least one window, and it should be many).
    pub fn probe_interval(mut self, interval: Duration) -> Self {
        self.probe_interval = interval;
        self
    }

    /// The limit held while the minimum latency is measured (default 3;
    /// moved into the bounds, and never above the limit in force). Once a
    /// floor is known, a probe first tries half the steady limit (when that
    /// is above this one), and comes down to this one only when half the
    /// limit reads more than an eighth above the known floor, or below it
    /// by more than the tolerance (see [`AdaptiveLimit`](crate::AdaptiveLimit)).
    pub fn probe_limit(mut self, limit: u32) -> Self {
        self.probe_limit = limit;
        self
    }

    /// How many latencies, of requests started during the probe, a probe
    /// measures at least (default 10, at least 1). A probe also lasts at
    /// least one window.
    pub fn probe_samples(mut self, samples: u32) -> Self {
        self.probe_samples = samples;
        self
    }

    /// Whether a failure of this kind cuts the limit (default: errors and
    /// time-outs do, cancellations do not). A failure that does not is
    /// ignored: it carries no latency either.
    pub fn backoff_on(mut self, failure: Failure, backs_off: bool) -> Self {
        self.backoff_on[failure as usize] = backs_off;
        self
    }

    /// Moves of the limit larger than this fraction of the limit last
    /// reported are reported as a [`Change`](super::Change) (default 1/10;
    /// 0 reports every move).
    pub fn report_change(mut self, numerator: u32, denominator: u32) -> Self {
        self.report = Frac::new(numerator, denominator);
        self
    }

    /// The validated configuration.
    ///
    /// # Errors
    ///
    /// [`InvalidAdaptiveLimit`], saying which setting is wrong and with what
    /// value: `min` 0 or above `max`, an `initial` outside the bounds, a
    /// zero denominator, a fraction outside its range, a zero window, a
    /// probe interval shorter than a window, zero probe samples, or a
    /// duration that does not fit in 64-bit nanoseconds.
    pub fn build(self) -> Result<AdaptiveConfig, InvalidAdaptiveLimit> {
        let err = |reason: String| Err(InvalidAdaptiveLimit { reason });
        if self.min == 0 {
            return err("min must be at least 1, not 0".into());
        }
        if self.min > self.max {
            return err(format!("min {} is above max {}", self.min, self.max));
        }
        let initial = match self.initial {
            Some(i) if i < self.min || i > self.max => {
                return err(format!(
                    "initial {i} is outside the bounds {}..={}",
                    self.min, self.max
                ));
            }
            Some(i) => i,
            None => DEFAULT_INITIAL.clamp(self.min, self.max),
        };
        for (name, f) in [
            ("smoothing", self.smoothing),
            ("tolerance", self.tolerance),
            ("backoff", self.backoff),
            ("report_change", self.report),
        ] {
            if f.den == 0 {
                return err(format!("{name} {}/0 has a zero denominator", f.num));
            }
        }
        let s = self.smoothing;
        if s.num == 0 || s.num > s.den {
            return err(format!("smoothing {}/{} is outside (0, 1]", s.num, s.den));
        }
        let t = self.tolerance;
        if t.below_one() {
            return err(format!("tolerance {}/{} is below 1", t.num, t.den));
        }
        let b = self.backoff;
        if b.num == 0 || b.num > b.den {
            return err(format!("backoff {}/{} is outside (0, 1]", b.num, b.den));
        }
        let window = nanos("window", self.window)?;
        if window == 0 {
            return err("window must not be zero".into());
        }
        let probe_interval = nanos("probe_interval", self.probe_interval)?;
        if probe_interval < window {
            return err(format!(
                "probe_interval {:?} is shorter than the window {:?}",
                self.probe_interval, self.window
            ));
        }
        if self.probe_samples == 0 {
            return err("probe_samples must be at least 1, not 0".into());
        }
        Ok(AdaptiveConfig {
            min: self.min,
            max: self.max,
            initial,
            window,
            smoothing: s,
            tolerance: t,
            backoff: b,
            probe_interval,
            probe_limit: self.probe_limit,
            probe_samples: self.probe_samples,
            backoff_on: self.backoff_on,
            report: self.report,
        })
    }
}

fn nanos(what: &str, d: Duration) -> Result<Nanos, InvalidAdaptiveLimit> {
    u64::try_from(d.as_nanos()).map_err(|_| InvalidAdaptiveLimit {
        reason: format!("{what} {d:?} does not fit in 64-bit nanoseconds"),
    })
}

/// An [`AdaptiveConfig`] that was refused: what was wrong, with the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid adaptive limit: {reason}")]
pub struct InvalidAdaptiveLimit {
    reason: String,
}

impl InvalidAdaptiveLimit {
    /// What was wrong, with the offending value.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(b: AdaptiveConfigBuilder) -> String {
        b.build().unwrap_err().reason().to_owned()
    }

    #[test]
    fn defaults_are_valid_and_match_the_builder() {
        let built = AdaptiveConfig::builder().build().unwrap();
        assert_eq!(built, AdaptiveConfig::default());
        assert_eq!(built.bounds(), (1, 1000));
        assert_eq!(built.initial(), 20);
        assert_eq!(built.window(), 100_000_000);
        assert_eq!(built.smoothing(), (1, 5));
        assert_eq!(built.tolerance(), (5, 4));
        assert_eq!(built.backoff(), (9, 10));
        assert_eq!(built.probe_interval(), 10_000_000_000);
        assert_eq!(built.probe_limit(), 3);
        assert_eq!(built.probe_samples(), 10);
        assert!(built.backs_off_on(Failure::Error));
        assert!(built.backs_off_on(Failure::TimedOut));
        assert!(!built.backs_off_on(Failure::Cancelled));
        assert_eq!(built.report_change(), (1, 10));
    }

    #[test]
    fn the_default_initial_moves_into_narrow_bounds() {
        let b = AdaptiveConfig::builder();
        assert_eq!(b.clone().bounds(1, 8).build().unwrap().initial(), 8);
        assert_eq!(b.bounds(50, 80).build().unwrap().initial(), 50);
    }

    #[test]
    fn bad_settings_are_refused_with_what_was_wrong() {
        let b = AdaptiveConfig::builder;
        assert_eq!(reason(b().bounds(0, 5)), "min must be at least 1, not 0");
        assert_eq!(reason(b().bounds(6, 5)), "min 6 is above max 5");
        assert_eq!(
            reason(b().bounds(2, 5).initial(1)),
            "initial 1 is outside the bounds 2..=5"
        );
        assert_eq!(
            reason(b().initial(1001)),
            "initial 1001 is outside the bounds 1..=1000"
        );
        assert_eq!(
            reason(b().smoothing(0, 5)),
            "smoothing 0/5 is outside (0, 1]"
        );
        assert_eq!(
            reason(b().smoothing(6, 5)),
            "smoothing 6/5 is outside (0, 1]"
        );
        assert_eq!(
            reason(b().smoothing(1, 0)),
            "smoothing 1/0 has a zero denominator"
        );
        assert_eq!(reason(b().tolerance(9, 10)), "tolerance 9/10 is below 1");
        assert_eq!(reason(b().backoff(0, 1)), "backoff 0/1 is outside (0, 1]");
        assert_eq!(reason(b().backoff(3, 2)), "backoff 3/2 is outside (0, 1]");
        assert_eq!(
            reason(b().report_change(1, 0)),
            "report_change 1/0 has a zero denominator"
        );
        assert_eq!(
            reason(b().window(Duration::ZERO)),
            "window must not be zero"
        );
        assert_eq!(
            reason(b().window(Duration::MAX)),
            format!(
                "window {:?} does not fit in 64-bit nanoseconds",
                Duration::MAX
            )
        );
        assert_eq!(
            reason(b().probe_interval(Duration::from_millis(50))),
            "probe_interval 50ms is shorter than the window 100ms"
        );
        assert_eq!(
            reason(b().probe_samples(0)),
            "probe_samples must be at least 1, not 0"
        );
    }

    #[test]
    fn edges_of_the_ranges_are_accepted() {
        let c = AdaptiveConfig::builder()
            .bounds(7, 7)
            .smoothing(1, 1)
            .tolerance(1, 1)
            .backoff(1, 1)
            .report_change(0, 1)
            .window(Duration::from_nanos(1))
            .probe_interval(Duration::from_nanos(1))
            .probe_samples(1)
            .backoff_on(Failure::Cancelled, true)
            .build()
            .unwrap();
        assert_eq!(c.initial(), 7);
        assert!(c.backs_off_on(Failure::Cancelled));
    }
}
