//! [`AdaptiveLimit`]: a concurrency limit that finds itself from latency.
//!
//! The controller lives here, its rules documented on the type, where
//! users read them; `config` holds its validated parameters.

mod config;

pub use config::{AdaptiveConfig, AdaptiveConfigBuilder, InvalidAdaptiveLimit};

use crate::Nanos;

/// What a finished request tells the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sample {
    /// The request succeeded after this latency (measured until its
    /// response body ended).
    Ok(Nanos),
    /// The request failed; whether that cuts the limit depends on the kind
    /// ([`AdaptiveConfigBuilder::backoff_on`]).
    Failed(Failure),
}

/// The kinds of failure the caller reports; which of them are overload
/// signals is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The request failed, e.g. with a status class the caller counts as
    /// overload (backs off by default).
    Error = 0,
    /// The request ran out of time (backs off by default).
    TimedOut = 1,
    /// The client went away before the response ended (does not back off
    /// by default: a client that leaves is not a sign of overload by
    /// itself).
    Cancelled = 2,
}

/// A move of the limit larger than the configured fraction
/// ([`AdaptiveConfigBuilder::report_change`]) of the limit last reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Change {
    /// The limit last reported (at first, the initial limit).
    pub from: u32,
    /// The limit now.
    pub to: u32,
}

const FRAC_BITS: u32 = 32;
const MAX_LATENCY: Nanos = 1 << 48;

/// An adaptive concurrency limit: a gradient of each window's mean latency
/// against a re-probed floor (the mean latency with few requests in
/// flight), with multiplicative back-off on failures.
///
/// The controller is a pure function of what it is fed: it never reads a
/// clock, draws no random numbers and holds no floating point, so one
/// sequence of calls gives one sequence of limits, on every platform.
///
/// # Feeding it
///
/// - [`update`](Self::update) for every request that ends: the time, how
///   many requests are still in flight, and a [`Sample`] (its latency, or
///   the kind of failure);
/// - [`tick`](Self::tick) when time passes without one (e.g. on arrival),
///   so a probe starts on time and sees the requests in flight drain;
/// - [`overdue`](Self::overdue), optionally, on arrivals and departures:
///   when the request [`overdue_query`](Self::overdue_query) names was
///   admitted (the layer keeps its requests' admission times for this);
///   a caller that cannot tell leaves it out and the limit moves on
///   latencies alone;
/// - [`limit`](Self::limit) is the number to enforce.
///
/// The caller owns the time: `now` comes from any [`Clock`], or a test's
/// explicit numbers; a `now` earlier than one already seen counts as that
/// one. Controllers started together probe together (there is no random
/// jitter): a fleet that should not should start them at different times.
///
/// # How the limit moves
///
/// - **Gradient, once per window.** Latencies of successful requests are
///   averaged over a sampling window ([`window`]). When a window closes
///   (at its end, or early: see *a fall, early*),
///   `gradient = floor × tolerance / window_latency`, clamped to
///   `[1/2, 2]`, and `new = limit × gradient + √limit` (the square root is
///   a queue allowance: it lets the limit grow while latency is at its
///   floor, and lets a few requests wait so the backend never idles). A
///   rise is smoothed by the smoothing factor `s`:
///   `limit = (1 − s) × limit + s × new`; a fall is taken at once
///   (`limit = new`), so a backend that slowed down is relieved within a
///   window (smoothing falls too let latency stay at three times its
///   floor for over a second after a backend's capacity halved). So is a
///   rise from a window that filled the limit with latency within the
///   tolerance of the floor (`gradient ≥ 1`): the limit, not the backend,
///   held the work back (after a backend's capacity came back, smoothed
///   rises left it partly idle for most of a second; now the limit is back
///   within 0.2 s). **A fall, early:** once a window holds enough
///   latencies ([`probe_samples`], and half the limit) and their mean
///   already asks the limit to fall by more than a tenth, the window
///   closes then, not at its end: a limit above a backend whose capacity
///   halved comes down within a few service times instead of up to a
///   window later. The window opened then counts only requests started
///   after the fall (those started before ran in the crowd it relieved:
///   counting them would cut again before the first cut could show), and
///   keeps the closed window's back-off (failures cut at most once in a
///   window's length). The evidence asked is what keeps widely spread
///   latencies from cutting the limit on a few slow requests (with
///   [`probe_samples`] alone, in review, a limit over a backend of
///   capacity 64 whose requests vary from 0.2 to 2.8 times their mean
///   spent a quarter of its time below 64; with half the limit too,
///   none). A window in which fewer than
///   half the limit were ever in flight does not raise the limit (the
///   backend was not asked for more, so its latency says nothing about
///   more). At equilibrium on a saturated backend whose latency grows
///   with concurrency beyond its capacity `C` (processor sharing), the
///   limit sits at about `tolerance × C + √limit` (with the defaults,
///   25 for `C` = 16, 84 to 89 for `C` = 64), where latency is about
///   `limit / C` times its floor.
/// - **A fall before anything ends (overdue requests).** Latencies show a
///   backend that slowed down only as its slowed requests end, a latency
///   later. The requests still waiting for their answer show it sooner.
///   The caller shows the controller the `rank`-th oldest of those
///   admitted within the last two windows (`rank` a sixteenth of the
///   steady limit, at least 2); the controller remembers how old that
///   request grew in windows that filled the limit and measured enough
///   latencies (the greatest such age; each such window keeps at least
///   seven eighths of the age before it). When it is older
///   than that by more than a quarter, the limit falls at once: to what a
///   window of that age would ask, and at least by the ratio of the two
///   ages; a further fall on the same evidence needs the age to grow by a
///   quarter again. The comparison is with how old the request asked
///   about usually grows, not with latencies, so a route where a few
///   requests cost far more than the rest (which are most of what is in
///   flight) does not look overdue (in review, comparing with the last
///   window's mean latency plus three standard deviations cut such a
///   route's limit from about 80 to about 3). These falls together never
///   take the limit below half of where the first of them started until a
///   window with enough latencies has closed (eight requests that never
///   end, started together over a limit of 24, cut it to 12; without the
///   bound, to 4). Ages are learnt only while the limit is full, so a
///   burst after light load is judged by what the limit saw full (in
///   review, learning at light load too halved a limit of 101 at the
///   burst); while the limit grows from low, an age learnt at a lower limit
///   can cost one fall of about a fifth for a window. Requests admitted
///   more than two windows ago are left
///   out, so this does nothing for a backend whose latency is longer than
///   about one window (100 ms by default), where latencies alone move the
///   limit. In the overload benchmark, after the backend's capacity
///   halved, the limit reached about 14 within 45-60 ms (it took 150 ms
///   on latencies alone), and p99 of that phase went from 2.5-3.0x to
///   1.8-1.9x the unloaded service time (2.4x once in eighteen runs).
/// - **The floor, re-probed.** The floor ([`floor`](Self::floor)) is the
///   mean latency of requests run with few others in flight, measured by
///   probes only: the same statistic as a window's (a floor taken as the
///   fastest request would make a route whose requests differ in cost
///   look overloaded at any load), not moved by one fast answer; a whole
///   window (at least [`probe_samples`] latencies) faster than the floor
///   by more than the tolerance calls the next probe at once. A probe
///   ([`probe_interval`] after the last one ended, and once at the start)
///   holds the limit at [`probe_limit`] for at least one window and until
///   [`probe_samples`] requests have finished that *started* after the
///   requests in flight had drained to the probe limit, and takes their
///   mean latency as the new floor; then the limit returns to where it
///   was. **Half the limit first:** once a floor is known, a probe first
///   holds the limit at half the steady limit (when that is above the
///   probe limit), measured the same way. A steady limit sits above the
///   capacity by the tolerance and the queue allowance, so half of it
///   queues nothing, and the backend keeps working at half the limit
///   where the probe limit would leave it nearly idle for a window (in
///   the overload benchmark, 2 % of a phase's goodput for each probe).
///   Half the limit never raises the floor, since it may queue after all
///   (behind a fixed round trip, or with a tolerance near 2), and a floor
///   raised by a queue would raise the limit, the next half and the next
///   reading with it: a reading at most an eighth above the floor keeps
///   the lower of the two; one beyond that, or below the floor by more
///   than the tolerance (the backend got faster, and half a limit set for
///   the slower one may queue), sends the probe on at the probe limit,
///   which tells, within the same patience. A probe at half the limit
///   that gives up with latencies does the same. Long-lived requests may keep the
///   backend from draining, or hold every probe slot so that nothing
///   ends: a probe gives up after its patience (ten windows or four
///   floors, whichever is longer, at most a probe interval), counted from
///   when it first saw traffic (a probe on an idle service waits for
///   some). Giving up, it takes the mean latency of the requests it
///   admitted if any finished, else the smaller of the floor it had and
///   the mean latency of all it saw end, else (the first time) that mean,
///   if any; a latency longer than the probe interval is
///   never a floor (a backend that slow needs a longer interval). Each
///   probe that measured nothing at all doubles the wait before the next
///   (up to eight probe intervals), so a service whose long-lived
///   requests keep probes from measuring is held at the probe limit for
///   at most a patience in every few intervals. Until a floor is known
///   the limit stays where it started. A probe ends about a window after
///   it drains, so requests slower than about a window rarely finish
///   inside it: on a route where such requests are common (one in twenty
///   at twice the window, in review), the floor leaves them out, windows
///   include them, and the limit sits well below the capacity; give such
///   a route a longer [`window`]. (A request admitted while
///   older ones still crowd the backend would measure the crowd, not the
///   floor; and a request admitted during the probe says nothing about
///   the latency at the steady limit, so windows leave it out.) Without
///   probes, a floor measured before the backend got slower would hold
///   the limit down for as long as the slowdown lasts; with them, the
///   limit recovers at the next probe that measures (one probe interval
///   when probes can drain the backend).
/// - **Back-off on failure.** A failure of a kind that backs off
///   ([`backoff_on`]) multiplies the limit by [`backoff`], at most once per
///   window, and a window with a back-off does not raise the limit when it
///   closes. Failures carry no latency.
/// - **Bounds.** The limit is always within `min..=max`.
///
/// # Arithmetic
///
/// The limit is kept in 32.32 fixed point (a `u64`); fractions are the
/// caller's exact `numerator / denominator`; every step is integer
/// arithmetic in `u128` rounded down. Floating point would be as
/// deterministic for one input sequence on one platform, but fixed point
/// is the same everywhere and keeps this crate free of float arithmetic
/// (its lint). Latencies are counted from 1 ns up to 2^48 ns (about 78
/// hours): a latency outside that range counts as the nearest end.
///
/// ```
/// use tollgate_budget::{AdaptiveConfig, AdaptiveLimit, Failure, Sample};
///
/// const MS: u64 = 1_000_000;
/// let config = AdaptiveConfig::builder().bounds(1, 100).build()?;
/// let mut limit = AdaptiveLimit::new(config, 0);
///
/// // It starts by measuring the floor (the unloaded latency) at a small limit.
/// assert!(limit.is_probing());
/// assert_eq!(limit.limit(), 3);
/// limit.tick(0, 0);
/// for i in 1..=10 {
///     limit.update(10 * i * MS, 2, Sample::Ok(10 * MS));
/// }
/// assert!(!limit.is_probing());
/// assert_eq!(limit.floor(), Some(10 * MS));
/// assert_eq!(limit.limit(), 20);
///
/// // Latency at its floor with the limit full: the limit grows, one window
/// // at a time, and moves of more than a tenth are reported.
/// let moves: Vec<_> = (11..=40)
///     .filter_map(|i| limit.update(10 * i * MS, limit.limit() - 1, Sample::Ok(10 * MS)))
///     .collect();
/// assert!(limit.limit() > 20);
/// assert_eq!(moves[0].from, 20);
///
/// // A failure cuts it by a tenth.
/// let before = limit.limit();
/// limit.update(400 * MS, 20, Sample::Failed(Failure::Error));
/// assert_eq!(limit.limit(), before * 9 / 10);
/// # Ok::<(), tollgate_budget::InvalidAdaptiveLimit>(())
/// ```
///
/// [`window`]: AdaptiveConfigBuilder::window
/// [`probe_interval`]: AdaptiveConfigBuilder::probe_interval
/// [`probe_limit`]: AdaptiveConfigBuilder::probe_limit
/// [`probe_samples`]: AdaptiveConfigBuilder::probe_samples
/// [`backoff_on`]: AdaptiveConfigBuilder::backoff_on
/// [`backoff`]: AdaptiveConfigBuilder::backoff
///
/// [`Clock`]: crate::Clock
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    config: AdaptiveConfig,
    /// The limit outside probes, in 32.32 fixed point; always within
    /// `min..=max` (shifted).
    limit: u64,
    /// The floor: the mean latency measured by the last probe that
    /// measured one (or lowered by a probe that gave up); `None` until
    /// there is one.
    min_latency: Option<Nanos>,
    /// Probes in a row that gave up: each doubles the wait before the
    /// next (up to eight times the interval).
    gave_up: u32,
    window: Window,
    /// Set while the floor is being measured.
    probe: Option<Probe>,
    /// When the next probe starts (meaningless while one runs).
    next_probe: Nanos,
    /// Windows leave out requests started before this: the end of the last
    /// probe (they ran under the probe limit, and say nothing about the
    /// steady one) or the last early fall (they ran in the crowd that
    /// fall relieved: counting them again would cut the limit again before
    /// the first cut could show).
    counted_from: Nanos,
    /// The limit last reported as a [`Change`] (or the initial one).
    reported: u32,
    /// A limit and its square root in fixed point (see `root`).
    root: (u64, u128),
    /// The latest `now` seen: time never moves back.
    now: Nanos,
    /// The age the requests in flight are compared with (see
    /// [`overdue`](Self::overdue)): the greatest age of the request asked
    /// about in the last window that filled the limit and measured enough
    /// latencies, or seven eighths of the age before it if that is
    /// greater; after a fall, the age that caused it.
    overdue_after: Option<Nanos>,
    /// The lowest limit overdue falls may reach until a window closes with
    /// enough latencies: half the limit the first of them fell from.
    overdue_floor: Option<u64>,
}

/// The latencies of one sampling window.
#[derive(Debug, Clone, Copy)]
struct Window {
    start: Nanos,
    sum: u128,
    count: u64,
    /// The most requests in flight the caller reported in this window.
    busiest: u32,
    /// A failure has cut the limit in this window.
    backed_off: bool,
    /// The greatest age of the request [`AdaptiveLimit::overdue`] was
    /// shown in this window, outside falls.
    oldest: Nanos,
}

impl Window {
    fn new(start: Nanos) -> Self {
        Self {
            start,
            sum: 0,
            count: 0,
            busiest: 0,
            backed_off: false,
            oldest: 0,
        }
    }
}

/// A measurement of the floor in progress.
#[derive(Debug, Clone, Copy)]
struct Probe {
    started: Nanos,
    /// Probing at half the steady limit, not at the probe limit.
    light: bool,
    /// When the requests in flight were first reported at or below the
    /// probe limit.
    drained: Option<Nanos>,
    /// The sum of the latencies of the requests started at or after
    /// `drained` (`samples` of them): their mean is the floor, the same
    /// statistic a window is compared by.
    sum: u128,
    samples: u32,
    /// The sum and count of the latencies of every request that ended
    /// during the probe: their mean is the floor a probe that gives up
    /// takes when it has no other.
    seen: (u128, u64),
    /// When the probe first saw traffic (a request in flight, or one
    /// ending): its patience counts from then, so a probe started on an
    /// idle service waits for traffic.
    busy_at: Option<Nanos>,
}

impl AdaptiveLimit {
    /// A controller at the configured initial limit, starting (at `now`)
    /// with a probe of the floor.
    pub fn new(config: AdaptiveConfig, now: Nanos) -> Self {
        Self {
            limit: u64::from(config.initial) << FRAC_BITS,
            reported: config.initial,
            config,
            min_latency: None,
            window: Window::new(now),
            probe: Some(Probe::new(now, false)),
            next_probe: now,
            counted_from: now,
            root: (0, 0),
            gave_up: 0,
            now,
            overdue_after: None,
            overdue_floor: None,
        }
    }

    /// The limit to enforce now: at most this many requests in flight.
    /// During a probe it is the probe limit (in the bounds, and never above
    /// [`steady_limit`](Self::steady_limit)).
    pub fn limit(&self) -> u32 {
        match self.probe {
            Some(_) => self.probe_limit(),
            None => self.steady_limit(),
        }
    }

    fn probe_limit(&self) -> u32 {
        let c = &self.config;
        let low = c.probe_limit.clamp(c.min, c.max);
        let steady = self.steady_limit();
        match self.probe {
            Some(Probe { light: true, .. }) => (steady / 2).max(low).min(steady),
            _ => steady.min(low),
        }
    }

    /// The limit outside probes (rounded down), which a probe returns to;
    /// [`Change`]s report moves of this one.
    pub fn steady_limit(&self) -> u32 {
        // The fixed-point limit is at most `max << 32`, so this is exact.
        u32::try_from(self.limit >> FRAC_BITS).unwrap_or(self.config.max)
    }

    /// Whether the floor is being measured (the limit is held at
    /// the probe limit).
    pub fn is_probing(&self) -> bool {
        self.probe.is_some()
    }

    /// The floor the gradient compares each window's mean latency with:
    /// the mean latency of requests run with few others in flight, once a
    /// probe has measured it.
    pub fn floor(&self) -> Option<Nanos> {
        self.min_latency
    }

    /// The configuration this controller runs.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.config
    }

    /// Feeds one finished request at `now`, with `in_flight` requests still
    /// in flight (not counting the finished one): closes the sampling
    /// window if it has ended, starts or ends a probe when due, and applies
    /// the sample. Returns the move if the limit has moved by more than the
    /// report fraction since the last report.
    pub fn update(&mut self, now: Nanos, in_flight: u32, sample: Sample) -> Option<Change> {
        let now = self.advance(now);
        // The finished request was in flight until now.
        self.window.busiest = self.window.busiest.max(in_flight.saturating_add(1));
        self.note_drained(now, in_flight);
        match sample {
            Sample::Ok(latency) => self.record_latency(now, latency),
            Sample::Failed(failure) => {
                if self.config.backs_off_on(failure) {
                    self.back_off();
                }
            }
        }
        self.end_probe_if_done(now);
        self.report()
    }

    /// Lets time pass without a sample, with `in_flight` requests in
    /// flight: closes the window if it has ended and starts a probe when
    /// due (so [`limit`](Self::limit) is current for a caller that reads it
    /// on arrival), and lets a probe see the requests drain.
    pub fn tick(&mut self, now: Nanos, in_flight: u32) -> Option<Change> {
        let now = self.advance(now);
        self.window.busiest = self.window.busiest.max(in_flight);
        self.note_drained(now, in_flight);
        self.end_probe_if_done(now);
        self.report()
    }

    /// Which request [`overdue`](Self::overdue) wants to be shown:
    /// `(rank, since)`, the `rank`-th oldest of the requests still waiting
    /// for their answer that were admitted at or after `since` (a
    /// sixteenth of the steady limit, at least 2, of those admitted within
    /// the last two windows). Requests admitted earlier are left out, and
    /// so are requests already answered (a stream, an upgraded connection):
    /// they say nothing about how fast the backend answers now.
    pub fn overdue_query(&self) -> (u32, Nanos) {
        let rank = (self.steady_limit() / 16).max(2);
        let since = self
            .now
            .saturating_sub(self.config.window.saturating_mul(2));
        (rank, since)
    }

    /// Shows the controller, at `now`, when the request
    /// [`overdue_query`](Self::overdue_query) names was admitted (`None`
    /// when fewer requests are in flight): see *a fall before anything
    /// ends* on the type. Returns the move if the limit has moved by more
    /// than the report fraction since the last report.
    pub fn overdue(&mut self, now: Nanos, started: Option<Nanos>) -> Option<Change> {
        let now = self.advance(now);
        let since = now.saturating_sub(self.config.window.saturating_mul(2));
        let (None, Some(floor), Some(started)) = (
            self.probe,
            self.min_latency,
            started.filter(|&at| at >= since),
        ) else {
            return self.report();
        };
        let age = now.saturating_sub(started);
        match self.overdue_after {
            Some(reference) if u128::from(age) * 4 > u128::from(reference) * 5 => {
                let by_ratio = u128::from(self.limit) * u128::from(reference) / u128::from(age);
                let (_, by_gradient) = self.target(floor, u128::from(age));
                // Never below half of where the first of these falls started
                // (long-lived requests age too), and never a rise (the limit
                // may have backed off below that half since).
                let lowest = u128::from(*self.overdue_floor.get_or_insert(self.limit / 2));
                let limit = u128::from(self.limit);
                self.limit = self.clamp(by_ratio.min(by_gradient).max(lowest).min(limit));
                self.overdue_after = Some(age);
                let backed_off = self.window.backed_off;
                self.window = Window::new(now);
                self.window.backed_off = backed_off;
                self.counted_from = now;
            }
            _ => self.window.oldest = self.window.oldest.max(age),
        }
        self.report()
    }

    fn note_drained(&mut self, now: Nanos, in_flight: u32) {
        let limit = self.probe_limit();
        if let Some(probe) = &mut self.probe {
            if in_flight > 0 {
                probe.busy_at.get_or_insert(now);
            }
            if probe.drained.is_none() && in_flight <= limit {
                probe.drained = Some(now);
            }
        }
    }

    fn advance(&mut self, now: Nanos) -> Nanos {
        let now = now.max(self.now);
        self.now = now;
        if now - self.window.start >= self.config.window {
            self.close_window();
            self.window = Window::new(now);
        }
        if self.probe.is_none() && now >= self.next_probe {
            // With a floor known, a probe first tries half the limit (a
            // limit at rest sits above the capacity by the tolerance and
            // the queue allowance, so half of it queues nothing); at the
            // probe limit, the backend runs nearly idle for a window.
            let c = &self.config;
            let low = c.probe_limit.clamp(c.min, c.max);
            let light = self.min_latency.is_some() && self.steady_limit() / 2 > low;
            self.probe = Some(Probe::new(now, light));
        }
        now
    }

    fn record_latency(&mut self, now: Nanos, latency: Nanos) {
        let latency = latency.clamp(1, MAX_LATENCY);
        let longest = self.config.probe_interval;
        match &mut self.probe {
            Some(probe) => {
                probe.busy_at.get_or_insert(now);
                // A request that ran longer than the probe interval (a
                // long poll, a stream) is no floor: a backend that slow
                // needs a longer interval.
                if latency > longest {
                    return;
                }
                probe.seen.0 += u128::from(latency);
                probe.seen.1 += 1;
                // Only requests admitted once the backend had drained to
                // the probe limit measure the floor.
                if probe
                    .drained
                    .is_some_and(|drained| now.saturating_sub(latency) >= drained)
                {
                    probe.sum += u128::from(latency);
                    probe.samples = probe.samples.saturating_add(1);
                }
            }
            None => {
                if now.saturating_sub(latency) >= self.counted_from {
                    self.window.sum += u128::from(latency);
                    self.window.count += 1;
                    // Enough latencies (a probe's worth, and half the
                    // limit) that say the limit must fall by more than a
                    // tenth: fall now, not at the window's end (a backend
                    // whose capacity halved was crowded for up to a window
                    // longer). The next window counts only requests
                    // started from now, and keeps the window's back-off:
                    // failures still cut at most once in a window's length.
                    let enough =
                        u64::from(self.config.probe_samples).max(self.limit >> (FRAC_BITS + 1));
                    if self.window.count >= enough && self.falls_far() {
                        let backed_off = self.window.backed_off;
                        self.close_window();
                        self.window = Window::new(now);
                        self.window.backed_off = backed_off;
                        self.counted_from = now;
                    }
                }
            }
        }
    }

    fn back_off(&mut self) {
        if self.window.backed_off {
            return;
        }
        self.window.backed_off = true;
        let b = self.config.backoff;
        let cut = u128::from(self.limit) * u128::from(b.num) / u128::from(b.den);
        self.limit = self.clamp(cut);
    }

    /// How long a probe waits for the backend to drain and measure, once
    /// it has seen traffic: ten windows or four floors, whichever is
    /// longer, and never longer than the probe interval.
    fn patience(&self) -> Nanos {
        let c = &self.config;
        c.window
            .saturating_mul(10)
            .max(self.min_latency.unwrap_or(0).saturating_mul(4))
            .min(c.probe_interval.max(c.window))
    }

    fn end_probe_if_done(&mut self, now: Nanos) {
        let Some(probe) = self.probe else { return };
        let ran = now - probe.started;
        let measured = probe.samples >= self.config.probe_samples && ran >= self.config.window;
        let patience = self.patience();
        // Long-lived requests may keep the backend from draining, or hold
        // every slot so that nothing ends: a probe gives up once it has
        // waited its patience since it first saw traffic (an idle service
        // keeps its probe waiting for some).
        let given_up = probe
            .busy_at
            .is_some_and(|at| now.saturating_sub(at) >= patience);
        if measured || given_up {
            let measured_floor = mean_of(probe.sum, u64::from(probe.samples));
            let seen = mean_of(probe.seen.0, probe.seen.1);
            self.min_latency = match (measured, probe.samples, self.min_latency, seen) {
                // Half the limit never raises the floor: it may queue (a
                // backend behind a fixed round trip, a tolerance near 2),
                // and a floor raised by it would raise the limit, the next
                // half, and the next reading with them. A reading within
                // an eighth above the floor keeps the lower of the two;
                // beyond that, or faster than the tolerance allows (the
                // backend got faster, and half a limit set for the slower
                // one may queue), the probe goes on at the probe limit,
                // which tells, within the same patience (measured or given
                // up alike).
                (_, 1.., Some(floor), _) if probe.light => match measured_floor {
                    Some(m) if light_reading_holds(floor, m, self.config.tolerance) => {
                        Some(m.min(floor))
                    }
                    _ => {
                        let mut full = Probe::new(now, false);
                        full.busy_at = probe.busy_at;
                        self.probe = Some(full);
                        return;
                    }
                },
                (true, _, _, _) => measured_floor,
                // Some requests measured the floor, fewer than asked.
                (false, 1.., _, _) => measured_floor,
                // Nothing measured, but a crowded latency below the floor
                // shows the floor is too high.
                (false, 0, Some(kept), seen) => Some(seen.map_or(kept, |s| s.min(kept))),
                (false, 0, None, seen) => seen,
            };
            // Only probes that measured nothing come less often.
            self.gave_up = if probe.samples > 0 {
                0
            } else {
                self.gave_up.saturating_add(1)
            };
            let wait = self
                .config
                .probe_interval
                .saturating_mul(1 << self.gave_up.min(3));
            self.probe = None;
            self.next_probe = now.saturating_add(wait);
            self.counted_from = now;
            // The window's latencies, if any, are from before the probe.
            self.window = Window::new(now);
        }
    }

    fn close_window(&mut self) {
        let w = self.window;
        let (None, Some(min), true) = (self.probe, self.min_latency, w.count > 0) else {
            return;
        };
        let mean = w.sum / u128::from(w.count);
        // What the requests in flight are compared with: how old the one
        // asked about grew in a window that filled the limit and measured
        // enough latencies (a window of a stalled backend measures none and
        // sets nothing; one at light load would teach an age that the
        // next burst exceeds, found in review: a limit of 101 halved).
        let full = u64::from(w.busiest) >= self.limit >> FRAC_BITS;
        if full && w.count >= u64::from(self.config.probe_samples) && w.oldest > 0 {
            let kept = self.overdue_after.map_or(0, |r| r - r / 8);
            self.overdue_after = Some(w.oldest.max(kept));
            self.overdue_floor = None;
        }
        // A whole window faster than the floor by more than the tolerance
        // (the backend got faster, or the window was of cheap answers):
        // measure again now, rather than take a mean of whatever was asked
        // as the floor.
        let t = self.config.tolerance;
        if w.count >= u64::from(self.config.probe_samples)
            && mean * u128::from(t.num) < u128::from(min) * u128::from(t.den)
        {
            self.next_probe = self.next_probe.min(self.now);
        }
        let (g, target) = self.target(min, mean);
        let limit = u128::from(self.limit);
        // Rises are smoothed; a fall is taken at once, so a backend that
        // slowed down is relieved within a window. So is a rise when the
        // limit held the work back (the window filled it) and latency
        // stayed within the tolerance of the floor: nothing queued that
        // is not tolerated, and a smoothed rise would leave the backend
        // idle for a second after its capacity came back.
        let s = self.config.smoothing;
        let smoothed = if target < limit || (full && g >= 1 << FRAC_BITS) {
            target
        } else {
            (limit * u128::from(s.den - s.num) + target * u128::from(s.num)) / u128::from(s.den)
        };
        let idle = u64::from(w.busiest) * 2 < self.limit >> FRAC_BITS;
        let smoothed = if w.backed_off || idle {
            smoothed.min(limit)
        } else {
            smoothed
        };
        self.limit = self.clamp(smoothed);
    }

    /// The gradient of a window of mean latency `mean` against the floor
    /// `min`, and the limit it asks for: `limit × gradient + √limit`, in
    /// fixed point.
    fn target(&mut self, min: Nanos, mean: u128) -> (u128, u128) {
        let t = self.config.tolerance;
        let g = gradient(min, mean, t.num, t.den);
        let limit = u128::from(self.limit);
        (g, ((limit * g) >> FRAC_BITS) + self.root())
    }

    /// `√limit` in fixed point, computed again only when the limit moved
    /// (an early fall asks for it at every latency).
    fn root(&mut self) -> u128 {
        if self.root.0 != self.limit {
            self.root = (self.limit, (u128::from(self.limit) << FRAC_BITS).isqrt());
        }
        self.root.1
    }

    /// Whether the window so far asks the limit to fall by more than a
    /// tenth.
    fn falls_far(&mut self) -> bool {
        let (Some(min), count @ 1..) = (self.min_latency, self.window.count) else {
            return false;
        };
        let (_, target) = self.target(min, self.window.sum / u128::from(count));
        target * 10 < u128::from(self.limit) * 9
    }

    fn clamp(&self, limit: u128) -> u64 {
        let min = u64::from(self.config.min) << FRAC_BITS;
        let max = u64::from(self.config.max) << FRAC_BITS;
        u64::try_from(limit).map_or(max, |l| l.clamp(min, max))
    }

    fn report(&mut self) -> Option<Change> {
        let to = self.steady_limit();
        let from = self.reported;
        let moved = u64::from(from.abs_diff(to));
        let r = self.config.report;
        if to != from && moved * u64::from(r.den) > u64::from(r.num) * u64::from(from) {
            self.reported = to;
            return Some(Change { from, to });
        }
        None
    }
}

impl Probe {
    fn new(started: Nanos, light: bool) -> Self {
        Self {
            started,
            light,
            drained: None,
            sum: 0,
            samples: 0,
            seen: (0, 0),
            busy_at: None,
        }
    }
}

/// Whether a light probe's reading `m` may stand against the known
/// `floor`: at most an eighth above it, and not below it by more than the
/// tolerance.
fn light_reading_holds(floor: Nanos, m: Nanos, t: config::Frac) -> bool {
    let (floor, m) = (u128::from(floor), u128::from(m));
    m * 8 <= floor * 9 && m * u128::from(t.num) >= floor * u128::from(t.den)
}

/// The mean of `count` latencies summing to `sum`, at least 1 ns; `None`
/// for none.
fn mean_of(sum: u128, count: u64) -> Option<Nanos> {
    let mean = sum.checked_div(u128::from(count))?;
    Some(
        Nanos::try_from(mean)
            .unwrap_or(MAX_LATENCY)
            .clamp(1, MAX_LATENCY),
    )
}

/// `min × num / (mean × den)` clamped to `[1/2, 2]`, in 32.32 fixed point.
/// `min` is at most 2^48 and `num` below 2^32, so the shifted numerator fits
/// in 112 bits.
fn gradient(min: Nanos, mean: u128, num: u32, den: u32) -> u128 {
    let num = u128::from(min) * u128::from(num);
    let den = mean * u128::from(den);
    if num >= 2 * den {
        2 << FRAC_BITS
    } else if 2 * num <= den {
        1 << (FRAC_BITS - 1)
    } else {
        (num << FRAC_BITS) / den
    }
}

#[cfg(test)]
mod tests;
