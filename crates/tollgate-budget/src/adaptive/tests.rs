use std::time::Duration;

use super::*;

const MS: Nanos = 1_000_000;
/// Requests in flight, for tests where the backend is always busy.
const BUSY: u32 = 1_000;

fn config() -> AdaptiveConfigBuilder {
    AdaptiveConfig::builder()
}

/// A controller whose first probe has ended at 100 ms, having measured
/// `floor` (10 samples, one every 10 ms).
fn probed(config: AdaptiveConfig, floor: Nanos) -> AdaptiveLimit {
    let mut limit = AdaptiveLimit::new(config, 0);
    limit.tick(0, 0);
    for i in 1..=10 {
        limit.update(i * 10 * MS, 0, Sample::Ok(floor.min(i * 10 * MS)));
    }
    assert!(!limit.is_probing());
    limit
}

/// Feeds one window (100 ms from `start`, one sample every 10 ms) of
/// `latency`; the window closes at the next call.
fn window_of(limit: &mut AdaptiveLimit, start: Nanos, latency: Nanos) {
    window_at(limit, start, latency, BUSY);
}

/// [`window_of`] with `in_flight` requests in flight at each sample.
fn window_at(limit: &mut AdaptiveLimit, start: Nanos, latency: Nanos, in_flight: u32) {
    for i in 0..10 {
        limit.update(start + i * 10 * MS, in_flight, Sample::Ok(latency));
    }
}

fn fixed(limit: &AdaptiveLimit) -> u64 {
    limit.limit
}

#[test]
fn the_first_probe_measures_once_the_backend_has_drained() {
    let mut limit = AdaptiveLimit::new(config().initial(50).build().unwrap(), 100 * MS);
    assert!(limit.is_probing());
    assert_eq!(limit.limit(), 3);
    assert_eq!(limit.steady_limit(), 50);
    // Requests still crowding the backend do not measure the floor, nor
    // do those admitted before it drained to the probe limit.
    limit.update(104 * MS, 4, Sample::Ok(MS));
    limit.update(105 * MS, 3, Sample::Ok(2 * MS));
    for i in 1..=9 {
        limit.update(100 * MS + 10 * i * MS, 2, Sample::Ok(4 * MS));
    }
    // Nine samples in 90 ms: neither enough samples nor a whole window.
    assert!(limit.is_probing());
    limit.update(195 * MS, 2, Sample::Ok(9 * MS));
    // Ten samples, but not yet a window.
    assert!(limit.is_probing());
    assert_eq!(limit.tick(200 * MS, 2), None);
    assert!(!limit.is_probing());
    // The mean of the ten measured (nine of 4 ms, one of 9 ms): the
    // statistic a window is compared by.
    assert_eq!(limit.floor(), Some(4_500_000));
    assert_eq!(limit.limit(), 50);
}

#[test]
fn a_probe_waits_for_the_backend_to_drain_then_gives_up() {
    let mut limit = AdaptiveLimit::new(config().build().unwrap(), 0);
    for i in 1..=100 {
        limit.update(i * 10 * MS, 4, Sample::Ok(5 * MS + i));
    }
    assert!(limit.is_probing());
    assert_eq!(limit.floor(), None);
    // Ten windows after its first latency without draining (long-lived
    // requests, a dry run): it gives up, with the mean latency it saw
    // as the first floor.
    limit.update(1010 * MS, 4, Sample::Ok(7 * MS));
    assert!(!limit.is_probing());
    // The mean of every latency it saw.
    assert_eq!(limit.floor(), Some((100 * 5 * MS + 5050 + 7 * MS) / 101));
    assert_eq!(limit.limit(), 20);
}

#[test]
fn a_probe_that_gives_up_keeps_the_floor_it_had() {
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    let start = 10_200 * MS;
    // (Above 10: the probe tries half the limit of 20 first.)
    limit.tick(start, 11);
    assert!(limit.is_probing());
    // Slower answers while the backend never drains: the floor stays.
    for i in 1..=99 {
        limit.update(start + i * 10 * MS, 11, Sample::Ok(50 * MS));
    }
    assert!(limit.is_probing());
    // Its patience (ten windows) after it first saw traffic: it gives up.
    limit.update(start + 1000 * MS, 11, Sample::Ok(50 * MS));
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), Some(10 * MS));
}

/// Found in review: long-lived requests that take every probe slot at the
/// start end nothing, so a probe that waited for a first latency waited
/// forever; and one of them, ending, became the floor.
#[test]
fn a_probe_gives_up_on_time_and_no_long_request_is_a_floor() {
    let mut limit = AdaptiveLimit::new(config().build().unwrap(), 0);
    limit.tick(0, 0);
    limit.tick(MS, 3);
    // Nothing ends: its patience (ten windows) after it first saw
    // traffic, it gives up, back to the steady limit.
    limit.tick(1_001 * MS, 3);
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), None);
    assert_eq!(limit.limit(), 20);
    // The next probe, twice the interval later, sees a 30 s long poll end
    // (admitted after it drained): longer than the probe interval, no
    // floor.
    limit.tick(21_001 * MS, 0);
    assert!(limit.is_probing());
    limit.update(51_002 * MS, 0, Sample::Ok(30_000 * MS));
    assert_eq!(limit.floor(), None);
}

/// Found in review: a probe started on an idle service gave up before any
/// traffic came, and the limit then stayed where it started for 20 s.
#[test]
fn a_probe_on_an_idle_service_waits_for_traffic() {
    let mut limit = AdaptiveLimit::new(config().build().unwrap(), 0);
    limit.tick(0, 0);
    limit.tick(5_000 * MS, 0);
    assert!(limit.is_probing());
    for i in 1..=10 {
        limit.update(5_000 * MS + i * 10 * MS, 0, Sample::Ok(8 * MS));
    }
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), Some(8 * MS));
}

/// Found in review: a request slower than ten windows (1.5 s here) was
/// thrown away by probes, so a slow but healthy backend never had a floor.
#[test]
fn a_slow_backend_gets_a_floor() {
    let mut limit = AdaptiveLimit::new(config().build().unwrap(), 0);
    limit.tick(0, 0);
    limit.tick(MS, 1);
    limit.update(1_501 * MS, 0, Sample::Ok(1_500 * MS));
    limit.tick(3_000 * MS, 0);
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), Some(1_500 * MS));
}

/// A whole window faster than the floor (the backend got faster, or it was
/// a window of cheap answers) does not become the floor: it calls a probe
/// at once, which measures the backend as it is.
#[test]
fn a_whole_window_faster_than_the_floor_calls_a_probe() {
    let mut limit = probed(config().build().unwrap(), 25 * MS);
    let floor = limit.floor();
    window_of(&mut limit, 200 * MS, MS);
    limit.tick(300 * MS, BUSY);
    assert_eq!(limit.floor(), floor);
    limit.tick(301 * MS, BUSY);
    assert!(limit.is_probing());
}

#[test]
fn between_probes_a_fast_answer_does_not_move_the_floor() {
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    limit.update(500 * MS, BUSY, Sample::Ok(1_000));
    assert_eq!(limit.floor(), Some(10 * MS));
}

#[test]
fn a_probe_never_raises_the_limit_and_stays_in_the_bounds() {
    let below = AdaptiveLimit::new(config().initial(2).build().unwrap(), 0);
    assert_eq!(below.limit(), 2);
    let bounded = AdaptiveLimit::new(config().bounds(5, 10).build().unwrap(), 0);
    assert_eq!(bounded.limit(), 5);
    let zero = AdaptiveLimit::new(config().probe_limit(0).build().unwrap(), 0);
    assert_eq!(zero.limit(), 1);
}

#[test]
fn latency_at_its_floor_with_the_limit_full_raises_it_at_once() {
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    window_of(&mut limit, 100 * MS, 10 * MS);
    limit.tick(200 * MS, BUSY);
    // The limit held the work back (the window filled it) and nothing
    // queued: gradient 5/4, new = 20 × 5/4 + √20, taken at once.
    let sqrt20 = (20u128 << 64).isqrt();
    assert_eq!(u128::from(fixed(&limit)), (25u128 << 32) + sqrt20);
    assert_eq!(limit.limit(), 29);
    // Latency within the tolerance (gradient at least 1) also rises at
    // once: 12.5 ms over a floor of 10 is a gradient of exactly 1.
    let before = fixed(&limit);
    window_of(&mut limit, 200 * MS, 12_500_000);
    limit.tick(300 * MS, BUSY);
    let expected = u128::from(before) + (u128::from(before) << 32).isqrt();
    assert_eq!(u128::from(fixed(&limit)), expected);
}

#[test]
fn a_rise_is_smoothed_when_the_window_did_not_fill_the_limit_or_latency_queued() {
    // 19 in flight at most (the finished one counted): below the limit of 20.
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    window_at(&mut limit, 100 * MS, 10 * MS, 18);
    limit.tick(200 * MS, 18);
    // gradient 5/4: new = 20 × 5/4 + √20; limit = 4/5 × 20 + 1/5 × new.
    let sqrt20 = (20u128 << 64).isqrt();
    let new = (25u128 << 32) + sqrt20;
    let expected = ((20u128 << 32) * 4 + new) / 5;
    assert_eq!(u128::from(fixed(&limit)), expected);
    assert_eq!(limit.limit(), 21);
    // A full window whose latency queued beyond the tolerance (13 ms:
    // gradient 12.5/13) but whose target is still above the limit (the
    // queue allowance): smoothed.
    let before = u128::from(fixed(&limit));
    window_of(&mut limit, 200 * MS, 13 * MS);
    limit.tick(300 * MS, BUSY);
    let g = (12_500_000u128 << 32) / 13_000_000;
    let target = ((before * g) >> 32) + (before << 32).isqrt();
    assert!(target > before);
    assert_eq!(u128::from(fixed(&limit)), (before * 4 + target) / 5);
}

#[test]
fn latency_far_above_the_floor_halves_the_target() {
    let mut limit = probed(config().initial(400).build().unwrap(), 10 * MS);
    // (Requests started during the probe are left out of the window.)
    window_of(&mut limit, 200 * MS, 100 * MS);
    // Ten latencies are too few to fall early at 400 (half the limit).
    assert_eq!(fixed(&limit), 400 << 32);
    limit.tick(300 * MS, BUSY);
    // gradient clamped to 1/2: new = 200 + 20, below the limit: taken at
    // once (a rise would be smoothed).
    assert_eq!(fixed(&limit), 220 << 32);
}

/// `n` latencies of `latency`, one every `every` from `start`, with the
/// backend busy.
fn latencies(limit: &mut AdaptiveLimit, start: Nanos, every: Nanos, n: u64, latency: Nanos) {
    for i in 0..n {
        limit.update(start + i * every, BUSY, Sample::Ok(latency));
    }
}

/// `limit / 2 + √limit` in fixed point: a fall with the gradient at 1/2.
fn halved(limit: u64) -> u64 {
    (limit >> 1) + (u128::from(limit) << 32).isqrt() as u64
}

#[test]
fn a_window_falls_early_once_it_has_enough_latencies() {
    let mut limit = probed(config().initial(20).build().unwrap(), 10 * MS);
    // Enough: a probe's worth (10) and half the limit (10).
    latencies(&mut limit, 200 * MS, 10 * MS, 9, 100 * MS);
    assert_eq!(fixed(&limit), 20 << 32);
    limit.update(290 * MS, BUSY, Sample::Ok(100 * MS));
    assert_eq!(fixed(&limit), halved(20 << 32));
}

#[test]
fn after_an_early_fall_only_requests_started_since_count() {
    let mut limit = probed(config().initial(20).build().unwrap(), 10 * MS);
    latencies(&mut limit, 200 * MS, 10 * MS, 10, 100 * MS);
    let once = halved(20 << 32);
    assert_eq!(fixed(&limit), once);
    // Requests admitted before the fall (at 200 to 280 ms), in the crowd it
    // relieved, end slow: they do not cut the limit again.
    latencies(&mut limit, 300 * MS, 9 * MS, 10, 100 * MS);
    limit.tick(400 * MS, BUSY);
    assert_eq!(fixed(&limit), once);
    // Requests started after it, as slow, do.
    latencies(&mut limit, 410 * MS, 9 * MS, 10, 100 * MS);
    assert_eq!(fixed(&limit), halved(once));
}

#[test]
fn an_early_fall_keeps_the_windows_back_off() {
    let mut limit = probed(config().initial(20).build().unwrap(), 10 * MS);
    limit.update(200 * MS, BUSY, Sample::Failed(Failure::Error));
    assert_eq!(fixed(&limit), 18 << 32);
    // An early fall within the same window.
    latencies(&mut limit, 201 * MS, 5 * MS, 10, 100 * MS);
    let fallen = halved(18 << 32);
    assert_eq!(fixed(&limit), fallen);
    // A failure in the window opened early does not cut again.
    limit.update(260 * MS, BUSY, Sample::Failed(Failure::Error));
    assert_eq!(fixed(&limit), fallen);
}

#[test]
fn a_window_falls_early_only_by_more_than_a_tenth() {
    // Floor 10 ms; at 20 the square root adds 4.47, so a window at 17 ms
    // asks for 20 × 12.5 / 17 + 4.47 = 19.2: a fall of 4 %, not early.
    let mut limit = probed(config().initial(20).build().unwrap(), 10 * MS);
    latencies(&mut limit, 200 * MS, 9 * MS, 10, 17 * MS);
    assert_eq!(fixed(&limit), 20 << 32);
    // The window closes at its end: the fall is taken then.
    limit.tick(300 * MS, BUSY);
    assert!(fixed(&limit) < 20 << 32 && fixed(&limit) > 19 << 32);
    // 25 ms asks for 19.2 / 2 + 4.4 = 14, a fall of 27 %: early, at the
    // tenth latency of the next window.
    let before = fixed(&limit);
    latencies(&mut limit, 310 * MS, 9 * MS, 9, 25 * MS);
    assert_eq!(fixed(&limit), before);
    limit.update(395 * MS, BUSY, Sample::Ok(25 * MS));
    assert_eq!(fixed(&limit), halved(before));
}

#[test]
fn a_window_without_latencies_leaves_the_limit() {
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    let before = fixed(&limit);
    limit.tick(250 * MS, BUSY);
    limit.tick(900 * MS, BUSY);
    assert_eq!(fixed(&limit), before);
}

#[test]
fn a_failure_cuts_the_limit_once_per_window() {
    let mut limit = probed(config().initial(100).build().unwrap(), 10 * MS);
    limit.update(110 * MS, BUSY, Sample::Failed(Failure::Error));
    assert_eq!(fixed(&limit), 90 << 32);
    limit.update(120 * MS, BUSY, Sample::Failed(Failure::TimedOut));
    assert_eq!(fixed(&limit), 90 << 32);
    // The next window may cut again.
    limit.update(200 * MS, BUSY, Sample::Failed(Failure::TimedOut));
    assert_eq!(fixed(&limit), 81 << 32);
}

#[test]
fn a_window_that_never_used_half_the_limit_does_not_raise_it() {
    let mut limit = probed(config().initial(100).build().unwrap(), 10 * MS);
    for i in 0..10 {
        limit.update(100 * MS + i * 10 * MS, 48, Sample::Ok(10 * MS));
    }
    limit.tick(200 * MS, 49);
    assert_eq!(fixed(&limit), 100 << 32);
    // Half the limit in flight is busy enough.
    limit.update(210 * MS, 49, Sample::Ok(10 * MS));
    limit.tick(300 * MS, 0);
    assert!(limit.limit() > 100);
    // An idle window may still lower it.
    limit.update(310 * MS, 0, Sample::Ok(100 * MS));
    let before = limit.limit();
    limit.tick(400 * MS, 0);
    assert!(limit.limit() < before);
}

#[test]
fn a_window_with_a_failure_does_not_raise_the_limit() {
    let mut limit = probed(config().initial(100).build().unwrap(), 10 * MS);
    window_of(&mut limit, 100 * MS, 10 * MS);
    limit.update(195 * MS, BUSY, Sample::Failed(Failure::Error));
    limit.tick(200 * MS, BUSY);
    assert_eq!(fixed(&limit), 90 << 32);
}

#[test]
fn cancellations_back_off_only_when_configured() {
    let mut limit = probed(config().initial(100).build().unwrap(), 10 * MS);
    limit.update(110 * MS, BUSY, Sample::Failed(Failure::Cancelled));
    assert_eq!(limit.limit(), 100);
    let cfg = config()
        .initial(100)
        .backoff_on(Failure::Cancelled, true)
        .backoff_on(Failure::Error, false)
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    limit.update(110 * MS, BUSY, Sample::Failed(Failure::Error));
    assert_eq!(limit.limit(), 100);
    limit.update(120 * MS, BUSY, Sample::Failed(Failure::Cancelled));
    assert_eq!(limit.limit(), 90);
}

#[test]
fn back_off_stops_at_min() {
    let mut limit = probed(config().bounds(4, 10).initial(4).build().unwrap(), 10 * MS);
    limit.update(110 * MS, BUSY, Sample::Failed(Failure::Error));
    assert_eq!(fixed(&limit), 4 << 32);
}

#[test]
fn growth_stops_at_max() {
    let mut limit = probed(config().bounds(1, 22).build().unwrap(), 10 * MS);
    for w in 1..20 {
        window_of(&mut limit, w * 100 * MS, 10 * MS);
    }
    assert_eq!(fixed(&limit), 22 << 32);
}

#[test]
fn probes_repeat_and_remeasure_the_floor() {
    let cfg = config()
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    assert_eq!(limit.floor(), Some(10 * MS));
    // Between probes a faster sample does not move the floor.
    limit.update(150 * MS, BUSY, Sample::Ok(7 * MS));
    assert_eq!(limit.floor(), Some(10 * MS));
    // A second after the first probe ended, the next one starts.
    limit.tick(1_099 * MS, BUSY);
    assert!(!limit.is_probing());
    limit.tick(1_100 * MS, BUSY);
    assert!(limit.is_probing());
    // A floor is known: the probe tries half the limit first (the limit
    // rose meanwhile, on the fast sample).
    let half = limit.steady_limit() / 2;
    assert!(half > 3);
    assert_eq!(limit.limit(), half);
    limit.tick(1_105 * MS, half);
    // Half the limit measures 30 ms (the first two requests finishing
    // started before it had drained): beyond the tolerance of the floor,
    // so the backend is slower or half the limit queues, and only the
    // probe limit tells which. It measures again there.
    for i in 1..=11 {
        limit.update(1_105 * MS + i * 10 * MS, half - 1, Sample::Ok(30 * MS));
        assert_eq!((limit.is_probing(), limit.limit()), (true, half));
    }
    limit.update(1_225 * MS, half - 1, Sample::Ok(30 * MS));
    assert_eq!((limit.is_probing(), limit.limit()), (true, 3));
    assert_eq!(limit.floor(), Some(10 * MS));
    limit.tick(1_230 * MS, 3);
    // It measures the backend as it is now: slower.
    for i in 1..=12 {
        assert!(limit.is_probing());
        limit.update(1_230 * MS + i * 10 * MS, 2, Sample::Ok(30 * MS));
    }
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), Some(30 * MS));
    assert_eq!(limit.limit(), 2 * half);
}

#[test]
fn a_probe_at_half_the_limit_that_measures_the_floor_ends_there() {
    let cfg = config()
        .initial(40)
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    // A reading within an eighth above the floor keeps the floor (half
    // the limit never raises it); one below, within the tolerance, is the
    // new floor. Either way after a window and ten requests at half the
    // limit: the probe limit is never used.
    for (reading, floor) in [(11 * MS, 10 * MS), (9 * MS, 9 * MS)] {
        let mut limit = probed(cfg, 10 * MS);
        limit.tick(1_100 * MS, 40);
        assert_eq!((limit.is_probing(), limit.limit()), (true, 20));
        limit.tick(1_105 * MS, 20);
        // (Requests started from 1 105 ms measure: ten have ended by
        // 1 215 ms.)
        let mut i = 0;
        while limit.is_probing() && i < 11 {
            assert_eq!(limit.limit(), 20);
            i += 1;
            limit.update(1_105 * MS + i * 10 * MS, 19, Sample::Ok(reading));
        }
        assert!(!limit.is_probing());
        assert_eq!(limit.floor(), Some(floor));
        assert_eq!(limit.limit(), 40);
    }
}

#[test]
fn a_probe_at_half_the_limit_measuring_a_faster_floor_measures_again_low() {
    let cfg = config()
        .initial(40)
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    limit.tick(1_100 * MS, 40);
    limit.tick(1_105 * MS, 20);
    // 7 ms at half the limit: the backend got faster, and half a limit
    // set for the slower one may queue. The probe limit measures again.
    for i in 1..=12 {
        limit.update(1_105 * MS + i * 10 * MS, 19, Sample::Ok(7 * MS));
    }
    assert_eq!((limit.is_probing(), limit.limit()), (true, 3));
    assert_eq!(limit.floor(), Some(10 * MS));
    // A limit too small for half of it to be above the probe limit
    // probes at the probe limit at once.
    let mut small = probed(config().initial(6).build().unwrap(), 10 * MS);
    small.tick(10_200 * MS, 6);
    assert_eq!((small.is_probing(), small.limit()), (true, 3));
}

#[test]
fn a_clock_that_steps_back_counts_as_the_latest_reading() {
    let mut limit = probed(config().build().unwrap(), 10 * MS);
    let mut copy = limit.clone();
    limit.update(150 * MS, BUSY, Sample::Ok(10 * MS));
    limit.update(20 * MS, BUSY, Sample::Ok(10 * MS));
    copy.update(150 * MS, BUSY, Sample::Ok(10 * MS));
    copy.update(150 * MS, BUSY, Sample::Ok(10 * MS));
    assert_eq!(fixed(&limit), fixed(&copy));
    // A sample from before the probe drained, with the clock stepped back,
    // does not count.
    let mut fresh = AdaptiveLimit::new(config().build().unwrap(), 1_000 * MS);
    fresh.tick(1_000 * MS, 0);
    fresh.update(0, 0, Sample::Ok(5 * MS));
    assert_eq!(fresh.probe.map(|p| p.samples), Some(0));
}

#[test]
fn extreme_latencies_do_not_overflow() {
    let t0: Nanos = 1 << 62;
    let later = t0 + (1 << 49);
    let run = |floor: Nanos, latency: Nanos| {
        let cfg = config()
            .bounds(1, u32::MAX)
            .initial(u32::MAX)
            .probe_interval(Duration::from_nanos(1 << 62))
            .build()
            .unwrap();
        let mut limit = AdaptiveLimit::new(cfg, t0);
        limit.tick(t0, 0);
        for i in 1..=10 {
            limit.update(t0 + i * 10 * MS, 0, Sample::Ok(floor));
        }
        // (Too few latencies to fall early at this limit.)
        window_of(&mut limit, later, latency);
        limit.tick(later + 100 * MS, BUSY);
        limit.limit()
    };
    // Latencies count up to 2^48 ns: the gradient is at its floor, 1/2,
    // and the limit falls at once to max / 2 + √max, rounded down.
    assert_eq!(run(1, Nanos::MAX), 2_147_549_183);
    assert_eq!(run(Nanos::MAX, 0), u32::MAX);
}

#[test]
fn moves_are_reported_against_the_last_report() {
    let mut limit = probed(config().initial(100).build().unwrap(), 10 * MS);
    // 100 → 90 is 10%: not more than the fraction.
    assert_eq!(
        limit.update(110 * MS, BUSY, Sample::Failed(Failure::Error)),
        None
    );
    // 100 → 81 is 19%: reported, from the last report.
    assert_eq!(
        limit.update(200 * MS, BUSY, Sample::Failed(Failure::Error)),
        Some(Change { from: 100, to: 81 })
    );
    // 81 → 72 is 11%.
    assert_eq!(
        limit.update(300 * MS, BUSY, Sample::Failed(Failure::Error)),
        Some(Change { from: 81, to: 72 })
    );
    // 72 → 78 (a smoothed rise: the window did not fill the limit) is 8%:
    // nothing.
    window_at(&mut limit, 400 * MS, 10 * MS, 60);
    assert_eq!(limit.tick(500 * MS, 60), None);
    assert_eq!(limit.limit(), 78);
}

#[test]
fn a_zero_report_fraction_reports_every_move() {
    let cfg = config().initial(100).report_change(0, 1).build().unwrap();
    let mut limit = probed(cfg, 10 * MS);
    assert_eq!(
        limit.update(110 * MS, BUSY, Sample::Failed(Failure::Error)),
        Some(Change { from: 100, to: 90 })
    );
}

#[test]
fn probe_pinning_is_not_a_reported_move() {
    let mut limit = AdaptiveLimit::new(config().initial(100).build().unwrap(), 0);
    assert_eq!(limit.limit(), 3);
    assert_eq!(limit.tick(50 * MS, BUSY), None);
}

#[test]
fn the_gradient_is_clamped_and_exact() {
    assert_eq!(gradient(10, 10, 1, 1), 1 << 32);
    assert_eq!(gradient(10, 10, 5, 4), 5 << 30);
    assert_eq!(gradient(10, 1, 1, 1), 2 << 32);
    assert_eq!(gradient(1, 10, 1, 1), 1 << 31);
    assert_eq!(gradient(3, 4, 1, 1), 3 << 30);
    assert_eq!(gradient(MAX_LATENCY, 1 << 48, u32::MAX, u32::MAX), 1 << 32);
}

/// Found in review: a probe at half the limit that gave up with a few
/// latencies took them as the floor, 4x the known one, without going down
/// to the probe limit.
#[test]
fn a_light_probe_that_gives_up_does_not_raise_the_floor() {
    let cfg = config()
        .initial(40)
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    limit.tick(1_100 * MS, 40);
    assert_eq!((limit.is_probing(), limit.limit()), (true, 20));
    limit.tick(1_105 * MS, 20);
    for i in 1..=5 {
        limit.update(1_105 * MS + i * 50 * MS, 20, Sample::Ok(40 * MS));
    }
    // Its patience (1 s from its first traffic) runs out: the reading is
    // beyond what half the limit may show, so the probe limit measures,
    // with no patience left (it counts from the light probe's traffic).
    limit.tick(2_100 * MS, 20);
    assert_eq!(limit.floor(), Some(10 * MS));
    limit.tick(2_101 * MS, 20);
    assert!(!limit.is_probing());
    assert_eq!(limit.floor(), Some(10 * MS));
}

/// Found in review: going down to the probe limit started the patience
/// again, so long-lived requests held the limit low for two patiences.
#[test]
fn going_down_to_the_probe_limit_keeps_the_patience() {
    let cfg = config()
        .initial(40)
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    limit.tick(1_100 * MS, 40);
    limit.tick(1_105 * MS, 20);
    for i in 1..=10 {
        limit.update(1_105 * MS + i * 99 * MS, 19, Sample::Ok(30 * MS));
    }
    assert_eq!((limit.is_probing(), limit.limit()), (true, 3));
    // Long-lived requests keep 5 in flight: the probe limit never drains.
    let mut t = 2_095 * MS;
    while limit.is_probing() {
        t += 10 * MS;
        limit.tick(t, 5);
    }
    assert!(t <= 2_100 * MS + 10 * MS, "held until {} ms", t / MS);
    assert_eq!(limit.floor(), Some(10 * MS));
}

/// Found in review: with a lower bound above the probe limit, a probe at
/// half the limit could run at the same limit as the full one, which then
/// only repeated it.
#[test]
fn half_the_limit_is_tried_only_above_the_probe_limit_in_its_bounds() {
    let cfg = config()
        .bounds(10, 1000)
        .initial(16)
        .probe_interval(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut limit = probed(cfg, 10 * MS);
    limit.tick(1_100 * MS, 16);
    assert!(limit.is_probing());
    assert_eq!(limit.probe.map(|p| p.light), Some(false));
    assert_eq!(limit.limit(), 10);
}
