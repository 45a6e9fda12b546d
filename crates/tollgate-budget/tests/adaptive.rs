//! The adaptive limit against a simulated processor-sharing backend, and
//! its invariants for arbitrary sample sequences.

use std::time::Duration;

use proptest::prelude::*;
use tollgate_budget::{AdaptiveConfig, AdaptiveLimit, Failure, Nanos, Sample};

const MS: Nanos = 1_000_000;

/// A processor-sharing backend driven in 1 ms steps: with `n` requests in
/// service, each progresses at `capacity / max(n, capacity)` of its speed
/// (times `speed`), so a request alone takes `base` and latency grows as
/// `base × max(n, capacity) / capacity`. The client side is a closed loop
/// with an endless backlog: every step, requests are admitted up to the
/// limit. Everything is integers, so a run is exactly reproducible.
#[derive(Clone)]
struct Backend {
    capacity: u64,
    /// Work units a request needs.
    work: u64,
    /// Speed as a fraction (numerator over `SPEED_DEN`).
    speed: u64,
    jobs: Vec<Job>,
    now: Nanos,
    /// Requests of uneven size: 0.5 to 1.5 times `work`, in turn.
    spread: bool,
    /// Requests of widely spread sizes instead: 0.2 to 2.8 times `work`,
    /// mean 1, drawn from a fixed sequence (this state).
    dispersed: Option<u64>,
    made: u64,
    /// Shows the controller its oldest requests (as the layer does).
    aged: bool,
    /// One request in `.0` costs `.1` times `work` (the others `work`).
    bimodal: Option<(u64, u64)>,
    /// Requests that have ended.
    done: u64,
    /// Light load: a request arrives every this many steps (at most one a
    /// step) instead of an endless backlog.
    every: Option<u64>,
}

#[derive(Clone)]
struct Job {
    started: Nanos,
    left: u64,
}

const STEP: Nanos = MS;
/// Work units one request alone gets through in one step at full speed.
const UNITS: u64 = 720_720;
const SPEED_DEN: u64 = 4;

/// What one step showed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Step {
    now: Nanos,
    limit: u32,
    steady: u32,
    probing: bool,
    in_flight: usize,
}

impl Backend {
    fn new(capacity: u64, base: Nanos) -> Self {
        Self {
            capacity,
            work: base / STEP * UNITS,
            speed: SPEED_DEN,
            jobs: Vec::new(),
            now: 0,
            spread: false,
            dispersed: None,
            made: 0,
            aged: true,
            bimodal: None,
            done: 0,
            every: None,
        }
    }

    /// One step: admit up to the limit, serve, report completions.
    fn step(&mut self, limit: &mut AdaptiveLimit) -> Step {
        limit.tick(self.now, count(self.jobs.len()));
        // The layer shows the controller its oldest requests on every
        // arrival and departure; here once a step.
        let (rank, since) = limit.overdue_query();
        let oldest = self
            .jobs
            .iter()
            .filter(|job| job.started >= since)
            .nth(usize::try_from(rank).unwrap() - 1)
            .map(|job| job.started);
        if self.aged {
            limit.overdue(self.now, oldest);
        }
        let mut admit = usize::try_from(limit.limit()).unwrap();
        if let Some(every) = self.every {
            let arrives = (self.now / STEP).is_multiple_of(every);
            admit = admit.min(self.jobs.len() + usize::from(arrives));
        }
        while self.jobs.len() < admit {
            let left = if let Some(state) = &mut self.dispersed {
                // Tenths of `work`: a mean of 10, from 2 to 28.
                const SIZES: [u64; 10] = [2, 3, 4, 5, 6, 8, 10, 14, 20, 28];
                *state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                self.work * SIZES[usize::try_from((*state >> 33) % 10).unwrap()] / 10
            } else if let Some((one_in, times)) = self.bimodal {
                if self.made % one_in == one_in - 1 {
                    self.work * times
                } else {
                    self.work
                }
            } else if self.spread {
                self.work * (5 + self.made % 11) / 10
            } else {
                self.work
            };
            self.made += 1;
            self.jobs.push(Job {
                started: self.now,
                left,
            });
        }
        let in_flight = self.jobs.len();
        let n = in_flight as u64;
        let progress = UNITS * self.capacity * self.speed / (n.max(self.capacity) * SPEED_DEN);
        self.now += STEP;
        let now = self.now;
        let mut done = Vec::new();
        self.jobs.retain_mut(|job| {
            job.left = job.left.saturating_sub(progress.max(1));
            if job.left == 0 {
                done.push(now - job.started);
            }
            job.left > 0
        });
        self.done += done.len() as u64;
        for (k, latency) in done.iter().enumerate() {
            let still = self.jobs.len() + done.len() - k - 1;
            limit.update(now, count(still), Sample::Ok(*latency));
        }
        Step {
            now,
            limit: limit.limit(),
            steady: limit.steady_limit(),
            probing: limit.is_probing(),
            in_flight,
        }
    }

    fn run(&mut self, limit: &mut AdaptiveLimit, steps: u64) -> Vec<Step> {
        (0..steps).map(|_| self.step(limit)).collect()
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap()
}

fn controller(min: u32, max: u32, initial: u32) -> AdaptiveLimit {
    let config = AdaptiveConfig::builder()
        .bounds(min, max)
        .initial(initial)
        .build()
        .unwrap();
    AdaptiveLimit::new(config, 0)
}

/// Runs `steps` steps, `capacity` changing as given: `(at step, capacity)`.
fn run_phases(
    backend: &mut Backend,
    limit: &mut AdaptiveLimit,
    phases: &[(u64, u64)],
    steps: u64,
) -> Vec<Step> {
    let mut out = Vec::new();
    for (i, &(from, capacity)) in phases.iter().enumerate() {
        let to = phases.get(i + 1).map_or(steps, |p| p.0);
        backend.capacity = capacity;
        out.extend(backend.run(limit, to - from));
    }
    out
}

/// The first step from which the steady limit stays in `lo..=hi` until
/// the end of `steps` (`None` if it never settles).
fn settles(steps: &[Step], lo: u32, hi: u32) -> Option<usize> {
    let last_out = steps.iter().rposition(|s| s.steady < lo || s.steady > hi);
    match last_out {
        Some(i) if i + 1 == steps.len() => None,
        Some(i) => Some(i + 1),
        None => Some(0),
    }
}

/// Steps per window (100 ms).
const WINDOW: usize = 100;

/// Found in review: the floor was the fastest of a probe's requests while
/// windows are compared by their mean, so a route whose requests differ in
/// cost (5 to 15 ms here) had a gradient below 1 at any load, and the limit
/// sank to about 7 for a backend of capacity 64. The floor is now the
/// probe's mean.
#[test]
fn requests_of_uneven_cost_settle_near_the_capacity() {
    let mut backend = Backend::new(64, 10 * MS);
    backend.spread = true;
    let mut limit = controller(1, 1000, 20);
    let steps = backend.run(&mut limit, 20_000);
    let at = settles(&steps, 64, 128);
    assert!(
        at.is_some_and(|at| at <= 10_000),
        "settled into [64, 128] from step {at:?}; last steady limit {}",
        steps.last().unwrap().steady
    );
}

/// Latencies widely spread (request sizes from 0.2 to 2.8 times the
/// mean): a window's first latencies, which decide an early fall, are
/// often far from its mean; the limit still settles near the capacity,
/// and spends little time below it.
#[test]
fn widely_spread_latencies_settle_near_the_capacity() {
    for capacity in [16, 64] {
        let mut backend = Backend::new(capacity, 10 * MS);
        backend.dispersed = Some(7);
        let mut limit = controller(1, 1000, 20);
        let steps = backend.run(&mut limit, 30_000);
        let lo = u32::try_from(capacity).unwrap();
        let tail = &steps[10_000..];
        let below = tail.iter().filter(|s| !s.probing && s.steady < lo).count();
        let above = tail.iter().filter(|s| s.steady > 2 * lo).count();
        assert!(
            below * 10 <= tail.len() && above * 10 <= tail.len(),
            "capacity {capacity}: {below} steps below it and {above} above twice it of {}",
            tail.len()
        );
    }
}

#[test]
fn settles_into_capacity_to_twice_capacity_from_below_and_from_above() {
    for (capacity, initial, max) in [
        (16, 1, 1000),
        (64, 1, 1000),
        (16, 200, 200),
        (64, 800, 1000),
    ] {
        let mut backend = Backend::new(capacity, 10 * MS);
        let mut limit = controller(1, max, initial);
        let steps = backend.run(&mut limit, 15_000);
        let lo = u32::try_from(capacity).unwrap();
        let at = settles(&steps, lo, 2 * lo);
        // Within 5 s (measured: 2.1 s for 16 from 1, 3.8 s for 64 from 1,
        // 2.5 s for 16 from 200, 2.2 s for 64 from 800).
        assert!(
            at.is_some_and(|at| at <= 50 * WINDOW),
            "capacity {capacity} from {initial}: settled at step {at:?}"
        );
        // Settled, and once the requests admitted under a higher limit
        // have drained (within a second), the backend is kept full (apart
        // from probes) and latency at most doubled: in flight within
        // [C, 2C]. (A step admits under the limit the step before ended
        // with.)
        let at = at.unwrap();
        let band = lo as usize..=2 * lo as usize;
        let drained = at
            + steps[at..]
                .iter()
                .position(|s| s.in_flight <= 2 * lo as usize)
                .unwrap();
        assert!(drained <= at + 10 * WINDOW, "drained at {drained}");
        for pair in steps[drained..].windows(2) {
            assert!(
                pair[0].probing || band.contains(&pair[1].in_flight),
                "{pair:?}"
            );
        }
    }
}

#[test]
fn follows_capacity_down_and_back_up() {
    let mut backend = Backend::new(32, 10 * MS);
    let mut limit = controller(1, 1000, 1);
    let steps = run_phases(
        &mut backend,
        &mut limit,
        &[(0, 32), (20_000, 16), (40_000, 32)],
        60_000,
    );
    let (high, low, again) = (&steps[..20_000], &steps[20_000..40_000], &steps[40_000..]);
    assert!(settles(high, 32, 64).is_some_and(|at| at <= 50 * WINDOW));
    // Each change is followed within 2 s (measured: 0.6 s down, 0.3 s up).
    let down = settles(low, 16, 32);
    assert!(down.is_some_and(|at| at <= 20 * WINDOW), "down: {down:?}");
    let up = settles(again, 32, 64);
    assert!(up.is_some_and(|at| at <= 20 * WINDOW), "up: {up:?}");
}

/// A slowdown (every request at half speed) halves the throughput but
/// not the concurrency the backend can take. The gradient, comparing with
/// the minimum measured before, reads it as overload and cuts the limit;
/// only a probe, measuring the slower floor, lets it climb back while the
/// slowdown lasts.
#[test]
fn a_probe_lets_the_limit_recover_from_a_slowdown() {
    let run = |probe_interval: Duration| {
        let config = AdaptiveConfig::builder()
            .initial(1)
            .probe_interval(probe_interval)
            .build()
            .unwrap();
        let mut limit = AdaptiveLimit::new(config, 0);
        let mut backend = Backend::new(16, 10 * MS);
        let mut steps = backend.run(&mut limit, 25_000);
        backend.speed = SPEED_DEN / 2;
        steps.extend(backend.run(&mut limit, 30_000));
        backend.speed = SPEED_DEN;
        steps.extend(backend.run(&mut limit, 20_000));
        steps
    };
    let probed = run(Duration::from_secs(10));
    let stale = run(Duration::from_secs(1_000));
    for steps in [&probed, &stale] {
        assert!(settles(&steps[..25_000], 16, 32).is_some());
    }
    // Without a probe the limit falls below the backend's capacity and
    // stays there for as long as the slowdown lasts.
    assert!(stale[30_000..55_000].iter().all(|s| s.steady < 16));
    // With one, it is back within one probe interval and a few windows
    // (measured: 6.1 s after the slowdown began).
    let slow = &probed[25_000..55_000];
    let back = settles(slow, 16, 32);
    assert!(
        back.is_some_and(|at| at <= 10_000 + 40 * WINDOW),
        "{back:?}"
    );
    // When the slowdown ends, both are back within a probe interval and a
    // few windows. (The probed one overshoots first, to about 37: the
    // backend is full, so no request shows the faster floor until the next
    // probe measures it; measured: settled after 5.9 s, and 0.8 s without
    // probes.)
    for steps in [&probed, &stale] {
        let after = settles(&steps[55_000..], 16, 32);
        assert!(
            after.is_some_and(|at| at <= 10_000 + 40 * WINDOW),
            "{after:?}"
        );
    }
}

#[test]
fn one_sample_sequence_gives_one_sequence_of_limits() {
    let run = || {
        let mut backend = Backend::new(24, 7 * MS);
        let mut limit = controller(2, 500, 300);
        run_phases(
            &mut backend,
            &mut limit,
            &[(0, 24), (8_000, 9), (16_000, 40)],
            24_000,
        )
    };
    let first = run();
    assert_eq!(first, run());
    // A clone taken mid-run continues exactly as the original.
    let mut backend = Backend::new(24, 7 * MS);
    let mut limit = controller(2, 500, 300);
    backend.run(&mut limit, 5_000);
    let (mut backend_twin, mut twin) = (backend.clone(), limit.clone());
    assert_eq!(
        backend.run(&mut limit, 5_000),
        backend_twin.run(&mut twin, 5_000)
    );
}

#[test]
fn failures_cut_the_limit_to_min_once_per_window() {
    let mut limit = controller(3, 1000, 1000);
    limit.tick(0, 0);
    for i in 1..=10 {
        limit.update(i * 10 * MS, 0, Sample::Ok(5 * MS));
    }
    assert_eq!(limit.limit(), 1000);
    let mut expected: u64 = 1000 << 32;
    for w in 2..80 {
        // Three failures a window: only the first cuts.
        for k in 0..3 {
            limit.update(
                w * 100 * MS + k * MS,
                500,
                Sample::Failed(Failure::TimedOut),
            );
        }
        expected = (expected * 9 / 10).max(3 << 32);
        assert_eq!(u64::from(limit.steady_limit()), expected >> 32);
    }
    assert_eq!(limit.limit(), 3);
}

/// Events fed to a controller: time step, in flight, and what happened.
#[derive(Debug, Clone)]
enum Event {
    Tick {
        after: Nanos,
        in_flight: u32,
    },
    Sample {
        after: Nanos,
        in_flight: u32,
        sample: Sample,
    },
    /// The clock steps back.
    Back {
        by: Nanos,
    },
    /// The oldest requests in flight shown (`age` of the one asked for,
    /// or none in flight).
    Overdue {
        after: Nanos,
        age: Option<Nanos>,
    },
}

fn event() -> impl Strategy<Value = Event> {
    let after = prop_oneof![Just(0u64), 0..5 * MS, 0..500 * MS, 0..30_000 * MS];
    let in_flight = prop_oneof![0u32..4, 0u32..2_000, Just(u32::MAX)];
    let sample = prop_oneof![
        4 => prop_oneof![0..50 * MS, 0..5_000 * MS, Just(0), Just(Nanos::MAX)].prop_map(Sample::Ok),
        1 => Just(Sample::Failed(Failure::Error)),
        1 => Just(Sample::Failed(Failure::TimedOut)),
        1 => Just(Sample::Failed(Failure::Cancelled)),
    ];
    prop_oneof![
        2 => (after.clone(), in_flight.clone()).prop_map(|(after, in_flight)| Event::Tick { after, in_flight }),
        8 => (after.clone(), in_flight, sample).prop_map(|(after, in_flight, sample)| Event::Sample { after, in_flight, sample }),
        1 => (0..1_000 * MS).prop_map(|by| Event::Back { by }),
        2 => (after.clone(), proptest::option::of(prop_oneof![0..100 * MS, 0..10_000 * MS]))
            .prop_map(|(after, age)| Event::Overdue { after, age }),
    ]
}

fn config() -> impl Strategy<Value = AdaptiveConfig> {
    (
        (1u32..50, 0u32..2_000),
        (1u32..=10, 1u32..=10),
        (0u32..=10, 1u32..=10),
        (1u32..=10, 1u32..=10),
        (1..1_000 * MS, 1u64..100),
        (0u32..20, 1u32..20),
        proptest::array::uniform3(any::<bool>()),
    )
        .prop_filter_map(
            "a valid config",
            |(bounds, s, t, b, (window, probe), p, off)| {
                let (min, span) = bounds;
                let failures = [Failure::Error, Failure::TimedOut, Failure::Cancelled];
                let mut builder = AdaptiveConfig::builder()
                    .bounds(min, min + span)
                    .smoothing(s.0.min(s.1), s.1)
                    .tolerance(t.1 + t.0, t.1)
                    .backoff(b.0.min(b.1), b.1)
                    .window(Duration::from_nanos(window))
                    .probe_interval(Duration::from_nanos(window * probe))
                    .probe_limit(p.0)
                    .probe_samples(p.1);
                for (f, on) in failures.into_iter().zip(off) {
                    builder = builder.backoff_on(f, on);
                }
                builder.build().ok()
            },
        )
}

fn replay(
    config: AdaptiveConfig,
    events: &[Event],
) -> Vec<(u32, u32, bool, Option<tollgate_budget::Change>)> {
    let mut limit = AdaptiveLimit::new(config, 1 << 40);
    let mut now: Nanos = 1 << 40;
    let mut out = Vec::new();
    for e in events {
        let change = match *e {
            Event::Tick { after, in_flight } => {
                now += after;
                limit.tick(now, in_flight)
            }
            Event::Sample {
                after,
                in_flight,
                sample,
            } => {
                now += after;
                limit.update(now, in_flight, sample)
            }
            Event::Back { by } => {
                now -= by;
                limit.tick(now, 0)
            }
            Event::Overdue { after, age } => {
                now += after;
                limit.overdue(now, age.map(|age| now.saturating_sub(age)))
            }
        };
        out.push((
            limit.limit(),
            limit.steady_limit(),
            limit.is_probing(),
            change,
        ));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn the_limit_stays_in_its_bounds_and_is_deterministic(
        config in config(),
        events in proptest::collection::vec(event(), 1..300),
    ) {
        let (min, max) = config.bounds();
        let trace = replay(config, &events);
        let mut reported = config.initial();
        for &(limit, steady, probing, change) in &trace {
            prop_assert!(min <= limit && limit <= steady && steady <= max);
            if !probing {
                prop_assert_eq!(limit, steady);
            }
            if let Some(c) = change {
                prop_assert_eq!(c.from, reported);
                prop_assert_eq!(c.to, steady);
                prop_assert_ne!(c.from, c.to);
                reported = c.to;
            }
        }
        prop_assert_eq!(trace, replay(config, &events));
    }

    #[test]
    fn a_failure_never_raises_the_limit(
        config in config(),
        events in proptest::collection::vec(event(), 1..200),
        in_flight in 0u32..2_000,
        after in 0..500 * MS,
    ) {
        let mut limit = AdaptiveLimit::new(config, 0);
        let mut now = 0;
        for e in &events {
            if let Event::Sample { after, in_flight, sample } = *e {
                now += after;
                limit.update(now, in_flight, sample);
            }
        }
        now += after;
        let mut reference = limit.clone();
        reference.tick(now, in_flight.saturating_add(1));
        limit.update(now, in_flight, Sample::Failed(Failure::Error));
        prop_assert!(limit.steady_limit() <= reference.steady_limit());
        if config.backs_off_on(Failure::Error) {
            let (num, den) = config.backoff();
            let cut = u64::from(reference.steady_limit()) * u64::from(num) / u64::from(den);
            // Cut now, or already cut in this window.
            prop_assert!(
                u64::from(limit.steady_limit()) <= cut.max(u64::from(config.bounds().0)) + 1
                    || limit.steady_limit() == reference.steady_limit()
            );
        }
    }

    /// Showing an old request never raises the limit, nor takes it below
    /// its bound: against the same controller shown nothing at that time.
    #[test]
    fn an_overdue_request_never_raises_the_limit(
        config in config(),
        events in proptest::collection::vec(event(), 1..300),
    ) {
        let mut limit = AdaptiveLimit::new(config, 0);
        let mut now = 0;
        for e in &events {
            match *e {
                Event::Tick { after, in_flight } => {
                    now += after;
                    limit.tick(now, in_flight);
                }
                Event::Sample { after, in_flight, sample } => {
                    now += after;
                    limit.update(now, in_flight, sample);
                }
                Event::Back { .. } => {}
                Event::Overdue { after, age } => {
                    now += after;
                    let mut shown_nothing = limit.clone();
                    shown_nothing.overdue(now, None);
                    limit.overdue(now, age.map(|age| now.saturating_sub(age)));
                    prop_assert!(limit.steady_limit() <= shown_nothing.steady_limit());
                    prop_assert!(limit.limit() >= config.bounds().0);
                }
            }
        }
    }
}

proptest! {
    // Each case simulates 15 s of a backend.
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Settling, for random capacities, service times and starts.
    #[test]
    fn settles_for_random_backends(
        capacity in 8u64..=96,
        base in prop_oneof![Just(5 * MS), Just(10 * MS), Just(20 * MS)],
        from_above in any::<bool>(),
    ) {
        let lo = u32::try_from(capacity).unwrap();
        let initial = if from_above { 12 * lo } else { 1 };
        let mut backend = Backend::new(capacity, base);
        let mut limit = controller(1, 12 * lo, initial);
        let steps = backend.run(&mut limit, 15_000);
        let at = settles(&steps, lo, 2 * lo);
        prop_assert!(at.is_some_and(|at| at <= 100 * WINDOW), "settled at {:?}", at);
    }
}

/// The floors each finished probe left, in a run of `steps` steps.
fn floors_after_probes(backend: &mut Backend, limit: &mut AdaptiveLimit, steps: u64) -> Vec<Nanos> {
    let mut floors = Vec::new();
    let mut was = false;
    for _ in 0..steps {
        let s = backend.step(limit);
        if was && !s.probing {
            floors.push(limit.floor().unwrap_or(0));
        }
        was = s.probing;
    }
    floors
}

/// Found in review: a probe at half the limit that queues (here, with a
/// tolerance of 2, half the limit is above the capacity) read a floor
/// higher than the true one yet within the tolerance, took it, raised the
/// limit with it, and the next half queued more: the floor went from 10
/// to 78 ms in 120 s (348 ms at 300 s), the limit to 185 for a capacity of
/// 4. Half the limit never raises the floor now.
#[test]
fn probes_at_half_the_limit_do_not_ratchet_the_floor_up() {
    for capacity in [4, 16] {
        let config = AdaptiveConfig::builder().tolerance(2, 1).build().unwrap();
        let mut limit = AdaptiveLimit::new(config, 0);
        let mut backend = Backend::new(capacity, 10 * MS);
        let floors = floors_after_probes(&mut backend, &mut limit, 120_000);
        assert!(floors.len() >= 10, "{floors:?}");
        assert!(
            floors.iter().all(|&f| f <= 11 * MS),
            "capacity {capacity}: true floor 10 ms, floors {floors:?}"
        );
    }
}

/// A backend behind a fixed round trip: each request spends `net` in
/// flight outside the backend (holding a slot, using no capacity) after
/// its work, so half the limit can queue at the backend.
struct RoundTrip {
    capacity: u64,
    work: u64,
    net: Nanos,
    /// (started, work left, round trip left)
    jobs: Vec<(Nanos, u64, Nanos)>,
    now: Nanos,
}

impl RoundTrip {
    fn step(&mut self, limit: &mut AdaptiveLimit) {
        limit.tick(self.now, count(self.jobs.len()));
        let admit = usize::try_from(limit.limit()).unwrap();
        while self.jobs.len() < admit {
            self.jobs.push((self.now, self.work, self.net));
        }
        let serving = self.jobs.iter().filter(|j| j.1 > 0).count() as u64;
        let progress = UNITS * self.capacity / serving.max(self.capacity);
        self.now += STEP;
        let now = self.now;
        let mut done = Vec::new();
        self.jobs.retain_mut(|j| {
            if j.1 > 0 {
                j.1 = j.1.saturating_sub(progress.max(1));
            } else {
                j.2 = j.2.saturating_sub(STEP);
                if j.2 == 0 {
                    done.push(now - j.0);
                    return false;
                }
            }
            true
        });
        for (k, latency) in done.iter().enumerate() {
            let still = self.jobs.len() + done.len() - k - 1;
            limit.update(now, count(still), Sample::Ok(*latency));
        }
    }
}

/// Found in review: with the defaults, on a backend of 5 ms of work behind
/// a 50 ms round trip, probes at half the limit read the queue at the
/// backend as floor, up to 98 ms for a true 55 ms.
#[test]
fn a_fixed_round_trip_keeps_its_floor() {
    for capacity in [4, 16] {
        let mut backend = RoundTrip {
            capacity,
            work: 5 * UNITS,
            net: 50 * MS,
            jobs: Vec::new(),
            now: 0,
        };
        let mut limit = AdaptiveLimit::new(AdaptiveConfig::default(), 0);
        let mut worst = 0;
        for _ in 0..200_000 {
            backend.step(&mut limit);
            worst = worst.max(limit.floor().unwrap_or(0));
        }
        // 55 ms, and a step of rounding.
        assert!(
            worst <= 57 * MS,
            "capacity {capacity}: the floor reached {worst} ns"
        );
    }
}

/// Found in the overload benchmark: after a backend's capacity halved,
/// the requests it slowed told the controller only as they ended, a
/// latency later, and the limit came down over 50-150 ms while every
/// request admitted meanwhile ran in a crowd of up to 3x the capacity.
/// The oldest requests in flight, aging past the latencies of the last
/// window, show it sooner.
#[test]
fn overdue_requests_bring_the_limit_down_before_they_end() {
    let first_at_most_twice_the_capacity = |aged: bool| {
        let mut backend = Backend::new(16, 20 * MS);
        backend.aged = aged;
        let mut limit = controller(1, 1000, 20);
        backend.run(&mut limit, 20_000);
        let settled = limit.steady_limit();
        assert!((20..=28).contains(&settled), "settled at {settled}");
        backend.capacity = 8;
        let steps = backend.run(&mut limit, 2_000);
        // Where the gradient settles for 8, with or without.
        let at = settles(&steps, 8, 16);
        assert!(at.is_some_and(|at| at <= 5 * WINDOW), "settled at {at:?}");
        steps.iter().position(|s| s.steady <= 16).unwrap()
    };
    // Measured: 50 steps shown the oldest, 98 without.
    let (aged, unaged) = (
        first_at_most_twice_the_capacity(true),
        first_at_most_twice_the_capacity(false),
    );
    assert!(
        aged <= 60 && aged + 30 <= unaged,
        "down to twice the capacity after {aged} steps (without: {unaged})"
    );
}

/// Requests that live long (streams, long polls) age past any latency; a
/// few of them starting together may cut the limit once, by at most half,
/// and never more than that until windows have measured again.
#[test]
fn long_lived_requests_cut_the_limit_by_half_at_most() {
    for streams in [1, 2, 8, 30] {
        let mut backend = Backend::new(16, 20 * MS);
        let mut limit = controller(1, 1000, 20);
        backend.run(&mut limit, 20_000);
        let settled = limit.steady_limit();
        for _ in 0..streams {
            backend.jobs.push(Job {
                started: backend.now,
                left: u64::MAX,
            });
        }
        let steps = backend.run(&mut limit, 3_000);
        let lowest = steps.iter().map(|s| s.steady).min().unwrap();
        assert!(
            lowest * 2 + 1 >= settled,
            "{streams} streams: from {settled} down to {lowest}"
        );
        if streams == 1 {
            assert!(lowest >= settled, "one stream moved the limit to {lowest}");
        }
    }
}

/// Found in review: with the requests in flight compared with the last
/// window's latencies (their mean plus three standard deviations), a route
/// where one request in twenty costs twenty times the others had its
/// limit cut to about 3 (a fall counts only requests admitted after it,
/// so the next windows held only cheap ones, and two expensive requests
/// in flight looked overdue again). They are now compared with how old
/// the request asked about grew in earlier windows: the expensive ones
/// set that age.
#[test]
fn a_few_expensive_requests_on_a_route_do_not_cut_the_limit() {
    for (capacity, one_in, times) in [(16, 20, 20), (64, 20, 20), (64, 50, 40), (16, 10, 10)] {
        let done = |aged: bool| {
            let mut backend = Backend::new(capacity, 10 * MS);
            backend.aged = aged;
            backend.bimodal = Some((one_in, times));
            let mut limit = controller(1, 1000, 20);
            backend.run(&mut limit, 5_000);
            let before = backend.done;
            backend.run(&mut limit, 20_000);
            backend.done - before
        };
        let (aged, unaged) = (done(true), done(false));
        assert!(
            aged * 100 >= unaged * 97,
            "capacity {capacity}, one in {one_in} at {times}x: {aged} requests done, {unaged} without"
        );
    }
}

/// Found in review: ages were learnt from every window that measured
/// enough latencies, so at light load the age of the request asked about
/// sank to what a half-empty backend gives, and the next burst, filling
/// the limit, looked overdue: a limit of 101 halved. Ages are learnt only
/// from windows that filled the limit.
#[test]
fn a_burst_after_light_load_is_not_overdue() {
    for (capacity, every) in [(64, 3), (64, 1), (16, 5)] {
        let mut backend = Backend::new(capacity, 20 * MS);
        let mut limit = controller(1, 1000, 20);
        backend.run(&mut limit, 20_000);
        backend.every = Some(every);
        backend.run(&mut limit, 5_000);
        backend.every = None;
        let steps = backend.run(&mut limit, 1_000);
        let lowest = steps
            .iter()
            .filter(|s| !s.probing)
            .map(|s| s.steady)
            .min()
            .unwrap();
        assert!(
            lowest >= u32::try_from(capacity).unwrap(),
            "capacity {capacity}, light load of one request every {every} ms: the burst found the limit at {lowest}"
        );
    }
}
