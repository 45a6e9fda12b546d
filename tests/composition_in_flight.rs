//! The in-flight layer's features composed, against one model.
//!
//! `tests/composition.rs` holds the rate-limit layer's features together;
//! this test does the same for `ConcurrencyLimitLayer`. It builds the layer
//! from a random combination of its features and drives it with random
//! traces on tokio's paused clock:
//!
//! - a global limit (none, fixed, or adaptive), a per-key limit by tenant
//!   (none, fixed, or adaptive), fair share by tenant (with weights by
//!   tenant, sometimes), priority classes (batch and interactive), a line
//!   (a few waiters, a few milliseconds to tens of them), dry-run, an
//!   exemption by header, a body idle timeout short enough to fire;
//! - events: requests (of three tenants, batch or interactive, exempt or
//!   not), the inner service answering a held request (`200`, or a `500`
//!   that an adaptive limit counts as a failure) with a body left open,
//!   a body ending, the client going away (while waiting, held, or
//!   reading the body), time passing, and flows of requests answered
//!   together 2 ms later (traffic an adaptive limit can measure, rise on
//!   and probe at half of).
//!
//! Checked after every event (the model is what the requests themselves
//! saw: the inner service called, the answer, the body's end):
//!
//! - **the counts are true**: the layer's `in_flight` is the number of
//!   admitted requests not over (exempt ones are never counted), and its
//!   `waiting` the number of requests neither admitted nor answered;
//! - **the bounds hold**: a fixed global or per-key limit is never
//!   exceeded (except in dry-run), an adaptive one never beyond its upper
//!   bound (also at a flow's peak, before it is answered), and never
//!   beyond its current value by an admission; the adaptive limit the
//!   layer reports stays within its bounds;
//! - **refusals are the right ones**: never in dry-run, never for an
//!   exempt request; `503`, with no `Retry-After` (a full limit promises
//!   no time) unless fair share or priorities held the request back (then
//!   whole seconds, at least one); `429` only with a per-key limit; with a
//!   fixed global limit alone, a request is refused at once only when the
//!   limit is full and the line, if any, is full too; a fixed per-key
//!   limit refuses at once (`429`) only a key that is full, whatever else
//!   is configured;
//! - **the line is bounded**: no more waiters than it holds, and nobody
//!   waits longer than its wait (a waiter is admitted or refused by then);
//! - **nothing leaks**: once every request is answered, ended or dropped
//!   and time has passed, nothing is in flight and nobody waits.
//!
//! Seeded (`PROPTEST_RNG_SEED` replays another seed), with a fixed budget
//! of cases (`COMPOSITION_CASES` changes it).

mod common;

use std::convert::Infallible;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::driven::{ChannelBody, assert_exercised, id_of, lock, note, settle};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tollgate::concurrency::{AdaptiveConfig, Priority};
use tollgate::{ConcurrencyLimitLayer, Exemption, KeyPart, Principal};
use tower::{Layer, ServiceExt};

/// The upper bound of the global adaptive limit: room for it to move
/// and for its probes to try half of it, and low enough that flows fill
/// it there (where a limit enforced and reported above its bound shows).
const ADAPTIVE_MAX: usize = 10;
/// The upper bound of a key's adaptive limit: low, so that a key admitted
/// beyond it shows.
const KEY_ADAPTIVE_MAX: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    Off,
    Fixed(usize),
    Adaptive,
}

#[derive(Debug, Clone)]
struct Setup {
    global: Bound,
    per_key: Bound,
    fair: bool,
    weights: bool,
    priority: bool,
    /// `(waiters, wait in ms)`.
    line: Option<(usize, u64)>,
    dry_run: bool,
    exempt: bool,
    idle_ms: u64,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Send {
        tenant: u8,
        batch: bool,
        exempt: bool,
    },
    /// The inner service answers the `pick`-th held request (`500` when
    /// `failed`), its body left open.
    Answer {
        pick: usize,
        failed: bool,
    },
    /// The `pick`-th open body ends.
    End(usize),
    /// The client of the `pick`-th request not over goes away.
    Drop(usize),
    Wait(u64),
    /// A flow of `n` requests at once (tenants in turn, interactive),
    /// answered and ended 2 ms later: enough traffic at an even latency
    /// for an adaptive limit to measure, rise and probe.
    Flow(usize),
}

#[derive(Debug, Clone)]
struct Case {
    setup: Setup,
    events: Vec<Event>,
}

fn bound(max: usize) -> impl Strategy<Value = Bound> {
    prop_oneof![
        Just(Bound::Off),
        (1..=max).prop_map(Bound::Fixed),
        Just(Bound::Adaptive),
    ]
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        (bound(5), bound(3)),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        prop::option::of((1..4usize, prop_oneof![Just(5u64), Just(40), Just(150)])),
        (
            any::<bool>(),
            any::<bool>(),
            prop_oneof![Just(60u64), Just(60_000)],
        ),
    )
        .prop_map(
            |((global, per_key), (fair, weights, priority), line, (dry_run, exempt, idle_ms))| {
                // Only what `build` accepts: something to bound, a global
                // limit to share, no dry-run with an adaptive limit.
                let (global, per_key) = match (global, per_key) {
                    (Bound::Off, Bound::Off) => (Bound::Fixed(2), Bound::Off),
                    other => other,
                };
                let shares = global != Bound::Off;
                let adaptive = global == Bound::Adaptive || per_key == Bound::Adaptive;
                Setup {
                    global,
                    per_key,
                    fair: fair && shares,
                    weights: weights && fair && shares,
                    priority: priority && shares,
                    line,
                    dry_run: dry_run && !adaptive,
                    exempt,
                    idle_ms,
                }
            },
        )
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        5 => (0..3u8, any::<bool>(), prop::bool::weighted(0.1))
            .prop_map(|(tenant, batch, exempt)| Event::Send { tenant, batch, exempt }),
        3 => (0..8usize, prop::bool::weighted(0.2))
            .prop_map(|(pick, failed)| Event::Answer { pick, failed }),
        3 => (0..8usize).prop_map(Event::End),
        1 => (0..8usize).prop_map(Event::Drop),
        2 => prop_oneof![Just(1u64), Just(5), Just(30), Just(100)].prop_map(Event::Wait),
        3 => (4..24usize).prop_map(Event::Flow),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (setup(), prop::collection::vec(event(), 1..40))
        .prop_map(|(setup, events)| Case { setup, events })
}

fn layer(setup: &Setup) -> Result<ConcurrencyLimitLayer, String> {
    let n = |v: usize| NonZeroUsize::new(v).expect("not zero");
    let adaptive = |max: usize, initial: u32| {
        AdaptiveConfig::builder()
            .bounds(1, u32::try_from(max).expect("small"))
            .initial(initial)
            .probe_limit(1)
            .probe_samples(3)
            .window(Duration::from_millis(10))
            .probe_interval(Duration::from_millis(200))
            .build()
            .expect("a valid adaptive limit")
    };
    let mut b = ConcurrencyLimitLayer::builder("work");
    b = match setup.global {
        Bound::Off => b,
        Bound::Fixed(max) => b.global(n(max)),
        Bound::Adaptive => b.adaptive(adaptive(ADAPTIVE_MAX, 8)),
    };
    b = match setup.per_key {
        Bound::Off => b,
        Bound::Fixed(max) => b.per_key(n(max), [KeyPart::Tenant]),
        Bound::Adaptive => b.per_key_adaptive(adaptive(KEY_ADAPTIVE_MAX, 2), [KeyPart::Tenant]),
    };
    if setup.fair {
        b = b.fair_share([KeyPart::Tenant]);
    }
    if setup.weights {
        b = b.fair_share_weight(|parts| {
            let heavy = parts
                .extensions
                .get::<Principal>()
                .is_some_and(|p| p.tenant() == "t0");
            NonZeroU32::new(if heavy { 3 } else { 1 }).expect("not zero")
        });
    }
    if setup.priority {
        b = b.priority(|parts| {
            if parts.headers.contains_key("x-batch") {
                Priority::Batch
            } else {
                Priority::Interactive
            }
        });
    }
    if let Some((waiters, ms)) = setup.line {
        b = b.wait(waiters, Duration::from_millis(ms));
    }
    if setup.exempt {
        b = b.exempt(Exemption::when(|parts| {
            parts.headers.contains_key("x-exempt")
        }));
    }
    b.dry_run(setup.dry_run)
        .body_idle_timeout(Duration::from_millis(setup.idle_ms))
        .build()
        .map_err(|e| format!("{setup:?} does not build: {e}"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Sent; neither admitted nor answered.
    Pending,
    /// The inner service has it.
    Held,
    /// Answered by the inner service; its body is open.
    Streaming,
    /// Refused by the layer: the status and `Retry-After`.
    Refused(StatusCode, Option<String>),
    /// Its body ended (or failed).
    Over,
    /// Its client went away.
    Dropped,
}

struct Req {
    tenant: u8,
    exempt: bool,
    sent: Duration,
    /// When it left `Pending`.
    settled: Option<Duration>,
    phase: Phase,
    /// Lets the inner service answer (`true`: a `500`).
    answer: Option<oneshot::Sender<bool>>,
    body: Option<mpsc::Sender<Bytes>>,
    task: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct World {
    reqs: Vec<Req>,
    origin: Option<Instant>,
}

impl World {
    fn now(&self) -> Duration {
        self.origin.map_or(Duration::ZERO, |o| o.elapsed())
    }

    fn leave_pending(&mut self, id: usize, phase: Phase) {
        let now = self.now();
        let req = &mut self.reqs[id];
        if req.phase == Phase::Pending {
            req.settled = Some(now);
        }
        req.phase = phase;
    }
}

type Shared = Arc<Mutex<World>>;

/// Counts of what the cases exercised, so that a run that never reached a
/// feature fails instead of passing for want of trying.
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    refused_503: AtomicU64,
    refused_429: AtomicU64,
    waited_then_admitted: AtomicU64,
    timed_out_in_line: AtomicU64,
    dropped_waiting: AtomicU64,
    dropped_held: AtomicU64,
    stalled: AtomicU64,
    dry_run_over_limit: AtomicU64,
    exempt_over_limit: AtomicU64,
    adaptive_rose: AtomicU64,
    adaptive_between: AtomicU64,
    adaptive_full_at_bound: AtomicU64,
}

impl Seen {
    fn exercised(&self, min: u64) {
        let counts = [
            ("admitted", &self.admitted),
            ("refused with 503", &self.refused_503),
            ("refused with 429", &self.refused_429),
            ("admitted after waiting", &self.waited_then_admitted),
            ("timed out in the line", &self.timed_out_in_line),
            ("dropped while waiting", &self.dropped_waiting),
            ("dropped while held", &self.dropped_held),
            ("bodies ended for stalling", &self.stalled),
            ("dry-run above the limit", &self.dry_run_over_limit),
            ("exempt above the limit", &self.exempt_over_limit),
            ("adaptive limit above its start", &self.adaptive_rose),
            (
                "adaptive limit between probe limit and start",
                &self.adaptive_between,
            ),
            (
                "adaptive limit full at its upper bound",
                &self.adaptive_full_at_bound,
            ),
        ];
        assert_exercised(&counts, min);
    }
}

struct Drive<'a> {
    setup: &'a Setup,
    layer: ConcurrencyLimitLayer,
    world: Shared,
    seen: &'a Seen,
    svc: Limited,
}

/// The layer over the test's inner service.
type Limited = tower::util::BoxCloneSyncService<
    Request<Empty<Bytes>>,
    Response<tollgate::ResponseBody<tollgate::concurrency::PermitBody<ChannelBody>>>,
    Infallible,
>;

impl Drive<'_> {
    fn send(&self, tenant: u8, batch: bool, exempt: bool) -> usize {
        let id = {
            let mut w = lock(&self.world);
            let sent = w.now();
            w.reqs.push(Req {
                tenant,
                exempt,
                sent,
                settled: None,
                phase: Phase::Pending,
                answer: None,
                body: None,
                task: None,
            });
            w.reqs.len() - 1
        };
        let mut req = Request::builder()
            .uri("/work")
            .header("x-id", id.to_string());
        if batch {
            req = req.header("x-batch", "1");
        }
        if exempt {
            req = req.header("x-exempt", "1");
        }
        let mut req = req.body(Empty::new()).expect("a valid request");
        req.extensions_mut()
            .insert(Principal::new(format!("t{tenant}"), "user"));
        let (svc, world) = (self.svc.clone(), self.world.clone());
        let task = tokio::spawn(async move {
            let Ok(response) = svc.oneshot(req).await;
            let pending = lock(&world).reqs[id].phase == Phase::Pending;
            if pending {
                let retry = response
                    .headers()
                    .get("retry-after")
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                lock(&world).leave_pending(id, Phase::Refused(response.status(), retry));
                return;
            }
            let mut body = response.into_body();
            while let Some(frame) = body.frame().await {
                if frame.is_err() {
                    break;
                }
            }
            lock(&world).reqs[id].phase = Phase::Over;
        });
        lock(&self.world).reqs[id].task = Some(task);
        id
    }

    /// The ids of the requests in `phase`-like states, in order.
    fn ids(&self, want: impl Fn(&Phase) -> bool) -> Vec<usize> {
        let w = lock(&self.world);
        (0..w.reqs.len())
            .filter(|&i| want(&w.reqs[i].phase))
            .collect()
    }

    async fn step(&mut self, event: Event) -> Result<(), String> {
        let before: Vec<Phase> = lock(&self.world)
            .reqs
            .iter()
            .map(|r| r.phase.clone())
            .collect();
        let in_flight_before = self.counted_in_flight();
        let mut sent = None;
        match event {
            Event::Send {
                tenant,
                batch,
                exempt,
            } => {
                sent = Some(self.send(tenant, batch, exempt && self.setup.exempt));
            }
            Event::Answer { pick, failed } => {
                let held = self.ids(|p| *p == Phase::Held);
                if let Some(&id) = held.get(pick % held.len().max(1))
                    && let Some(answer) = lock(&self.world).reqs[id].answer.take()
                {
                    let _ = answer.send(failed);
                }
            }
            Event::End(pick) => {
                let open = self.ids(|p| *p == Phase::Streaming);
                if let Some(&id) = open.get(pick % open.len().max(1)) {
                    lock(&self.world).reqs[id].body.take();
                }
            }
            Event::Drop(pick) => {
                let live =
                    self.ids(|p| matches!(p, Phase::Pending | Phase::Held | Phase::Streaming));
                if let Some(&id) = live.get(pick % live.len().max(1)) {
                    let mut w = lock(&self.world);
                    match w.reqs[id].phase {
                        Phase::Pending => note(&self.seen.dropped_waiting),
                        Phase::Held => note(&self.seen.dropped_held),
                        _ => {}
                    }
                    if let Some(task) = w.reqs[id].task.take() {
                        task.abort();
                    }
                    w.leave_pending(id, Phase::Dropped);
                }
            }
            Event::Wait(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Event::Flow(n) => {
                let ids: Vec<usize> = (0..n)
                    .map(|i| self.send(u8::try_from(i % 3).expect("small"), false, false))
                    .collect();
                settle().await;
                self.check_peak()?;
                tokio::time::sleep(Duration::from_millis(2)).await;
                for &id in &ids {
                    let answer = lock(&self.world).reqs[id].answer.take();
                    if let Some(answer) = answer {
                        let _ = answer.send(false);
                    }
                }
                settle().await;
                for &id in &ids {
                    lock(&self.world).reqs[id].body.take();
                }
            }
        }
        settle().await;
        self.check(&before, in_flight_before, sent)
    }

    /// A flow's peak, before it is answered: an adaptive global limit
    /// holds its upper bound (the limit may move while the flow arrives,
    /// so the bound, not its value, is what every admission must keep),
    /// and is seen full there.
    fn check_peak(&self) -> Result<(), String> {
        if self.setup.global != Bound::Adaptive {
            return Ok(());
        }
        let limit = self.layer.stats().global_limit.unwrap_or(0);
        let counted = self.counted_in_flight();
        if counted > ADAPTIVE_MAX {
            return Err(format!(
                "a flow put {counted} in flight over the adaptive bound"
            ));
        }
        if limit == ADAPTIVE_MAX && counted == ADAPTIVE_MAX {
            note(&self.seen.adaptive_full_at_bound);
        }
        Ok(())
    }

    /// Admitted requests not over, exempt ones left out (the layer does
    /// not count them).
    fn counted_in_flight(&self) -> usize {
        let w = lock(&self.world);
        w.reqs
            .iter()
            .filter(|r| !r.exempt && matches!(r.phase, Phase::Held | Phase::Streaming))
            .count()
    }

    fn check(
        &self,
        before: &[Phase],
        in_flight_before: usize,
        sent: Option<usize>,
    ) -> Result<(), String> {
        let s = self.setup;
        let stats = self.layer.stats();
        let w = lock(&self.world);
        let now = w.now();
        let live = |r: &Req| matches!(r.phase, Phase::Held | Phase::Streaming);
        let counted = w.reqs.iter().filter(|r| !r.exempt && live(r)).count();
        let everyone = w.reqs.iter().filter(|r| live(r)).count();
        let pending = w
            .reqs
            .iter()
            .filter(|r| !r.exempt && r.phase == Phase::Pending)
            .count();
        let per_tenant = |t: u8| {
            w.reqs
                .iter()
                .filter(|r| !r.exempt && r.tenant == t && live(r))
                .count()
        };

        // The counts are true.
        if stats.in_flight != counted {
            return Err(format!(
                "in flight: the layer says {}, the requests {counted}",
                stats.in_flight
            ));
        }
        if stats.waiting != pending {
            return Err(format!(
                "waiting: the layer says {}, the requests {pending}",
                stats.waiting
            ));
        }
        if let Bound::Fixed(n) = s.global
            && everyone > n
            && everyone > counted
        {
            note(&self.seen.exempt_over_limit);
        }

        // The bounds hold.
        let admitted_now = before
            .iter()
            .zip(&w.reqs)
            .filter(|(b, r)| **b == Phase::Pending && live(r))
            .count()
            + sent.map_or(0, |id| usize::from(live(&w.reqs[id])));
        if admitted_now > 0 {
            note(&self.seen.admitted);
        }
        match s.global {
            Bound::Fixed(n) if counted > n => {
                if !s.dry_run {
                    return Err(format!("{counted} in flight over a global limit of {n}"));
                }
                note(&self.seen.dry_run_over_limit);
            }
            Bound::Adaptive => {
                let limit = stats.global_limit.unwrap_or(0);
                // Above where it starts (8), and between the probe limit
                // (1) and that: a fall, or a probe at half the limit.
                if limit > 8 {
                    note(&self.seen.adaptive_rose);
                } else if limit > 1 && limit < 8 {
                    note(&self.seen.adaptive_between);
                }
                if !(1..=ADAPTIVE_MAX).contains(&limit) {
                    return Err(format!(
                        "an adaptive limit of {limit} outside 1..={ADAPTIVE_MAX}"
                    ));
                }
                if counted > ADAPTIVE_MAX {
                    return Err(format!("{counted} in flight over the adaptive bound"));
                }
                if admitted_now > 0 && counted > limit.max(in_flight_before) {
                    return Err(format!(
                        "admitted to {counted} in flight over an adaptive limit of {limit}"
                    ));
                }
            }
            _ => {}
        }
        for t in 0..3 {
            let n = per_tenant(t);
            match s.per_key {
                Bound::Fixed(m) if n > m && !s.dry_run => {
                    return Err(format!(
                        "tenant {t}: {n} in flight over a per-key limit of {m}"
                    ));
                }
                Bound::Adaptive if n > KEY_ADAPTIVE_MAX && !s.dry_run => {
                    return Err(format!("tenant {t}: {n} in flight over the adaptive bound"));
                }
                _ => {}
            }
        }

        // Refusals are the right ones.
        for (i, r) in w.reqs.iter().enumerate() {
            let Phase::Refused(status, retry) = &r.phase else {
                continue;
            };
            if before.get(i) == Some(&r.phase) {
                continue;
            }
            if s.dry_run {
                return Err(format!("request {i} refused ({status}) in dry-run"));
            }
            if r.exempt {
                return Err(format!("exempt request {i} refused ({status})"));
            }
            let waited = r.settled.unwrap_or(now).saturating_sub(r.sent);
            if let Some((_, ms)) = s.line {
                if waited > Duration::from_millis(ms + 1) {
                    return Err(format!(
                        "request {i} refused after {waited:?} in a line of {ms} ms"
                    ));
                }
                if waited >= Duration::from_millis(ms) {
                    note(&self.seen.timed_out_in_line);
                }
            }
            match *status {
                StatusCode::SERVICE_UNAVAILABLE => {
                    note(&self.seen.refused_503);
                    // A full limit or line promises no time; a share or a
                    // class held back is looked at again within a second.
                    let seconds = retry.as_deref().map(|v| v.parse::<u64>().ok());
                    let shares = s.fair || s.priority;
                    match seconds {
                        None => {}
                        Some(Some(1..)) if shares => {}
                        _ => {
                            return Err(format!("request {i}: 503 with Retry-After {retry:?}"));
                        }
                    }
                }
                StatusCode::TOO_MANY_REQUESTS if s.per_key != Bound::Off => {
                    note(&self.seen.refused_429);
                }
                other => return Err(format!("request {i} refused with {other}")),
            }
            // With one fixed limit and nothing else, a request is refused
            // at once only when the limit is full and so is the line.
            let at_once = sent == Some(i);
            let alone = !s.fair && !s.priority;
            let line_full = s.line.is_none_or(|(waiters, _)| pending >= waiters);
            match (s.global, s.per_key) {
                (Bound::Fixed(n), Bound::Off)
                    if at_once && alone && (counted < n || !line_full) =>
                {
                    return Err(format!(
                        "request {i} refused at once with {counted} of {n} in flight, {pending} waiting"
                    ));
                }
                // A fixed per-key limit refuses (429) only a key that is
                // full, whatever else is configured.
                (_, Bound::Fixed(m))
                    if at_once
                        && *status == StatusCode::TOO_MANY_REQUESTS
                        && per_tenant(r.tenant) < m =>
                {
                    return Err(format!(
                        "request {i} refused (429) at once with its tenant at {} of {m}",
                        per_tenant(r.tenant)
                    ));
                }
                _ => {}
            }
        }

        // The line is bounded: in size and in time.
        match s.line {
            None if pending > 0 && !s.dry_run => {
                return Err(format!("{pending} waiting without a line"));
            }
            Some((waiters, ms)) => {
                if pending > waiters {
                    return Err(format!("{pending} waiting in a line of {waiters}"));
                }
                for (i, r) in w.reqs.iter().enumerate() {
                    if r.phase == Phase::Pending
                        && now.saturating_sub(r.sent) > Duration::from_millis(ms + 1)
                    {
                        return Err(format!(
                            "request {i} waiting for {:?} in a line of {ms} ms",
                            now - r.sent
                        ));
                    }
                }
            }
            None => {}
        }
        for (i, r) in w.reqs.iter().enumerate() {
            if before.get(i) == Some(&Phase::Pending) && live(r) {
                note(&self.seen.waited_then_admitted);
            }
            if before.get(i) == Some(&Phase::Streaming)
                && r.phase == Phase::Over
                && r.body.is_some()
            {
                note(&self.seen.stalled);
            }
        }
        Ok(())
    }

    /// Answers and ends everything, lets every line and idle time run
    /// out: nothing may be left in flight or waiting.
    async fn finish(&mut self) -> Result<(), String> {
        for _ in 0..4 {
            let held = self.ids(|p| *p == Phase::Held);
            for id in held {
                if let Some(answer) = lock(&self.world).reqs[id].answer.take() {
                    let _ = answer.send(false);
                }
            }
            settle().await;
            let open = self.ids(|p| *p == Phase::Streaming);
            for id in open {
                lock(&self.world).reqs[id].body.take();
            }
            settle().await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            settle().await;
        }
        let stats = self.layer.stats();
        let left = self.ids(|p| matches!(p, Phase::Pending | Phase::Held | Phase::Streaming));
        if stats.in_flight != 0 || stats.waiting != 0 || !left.is_empty() {
            return Err(format!(
                "at the end: {} in flight, {} waiting, requests not over {left:?}",
                stats.in_flight, stats.waiting
            ));
        }
        Ok(())
    }
}

fn run_case(case: &Case, seen: &Seen) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let layer = layer(&case.setup)?;
        let world: Shared = Arc::new(Mutex::new(World {
            reqs: Vec::new(),
            origin: Some(Instant::now()),
        }));
        let inner = {
            let world = world.clone();
            tower::service_fn(move |req: Request<Empty<Bytes>>| {
                let world = world.clone();
                let id = id_of(&req);
                let (tx, rx) = oneshot::channel();
                {
                    let mut w = lock(&world);
                    w.reqs[id].answer = Some(tx);
                    w.leave_pending(id, Phase::Held);
                }
                async move {
                    let failed = rx.await.unwrap_or(false);
                    let (body_tx, body_rx) = mpsc::channel(4);
                    let _ = body_tx.try_send(Bytes::from_static(b"first\n"));
                    {
                        let mut w = lock(&world);
                        w.reqs[id].body = Some(body_tx);
                        w.reqs[id].phase = Phase::Streaming;
                    }
                    let status = if failed {
                        StatusCode::INTERNAL_SERVER_ERROR
                    } else {
                        StatusCode::OK
                    };
                    let mut response = Response::new(ChannelBody(body_rx));
                    *response.status_mut() = status;
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let svc = tower::util::BoxCloneSyncService::new(layer.clone().layer(inner));
        let mut drive = Drive {
            setup: &case.setup,
            layer,
            world,
            seen,
            svc,
        };
        for (i, &event) in case.events.iter().enumerate() {
            drive
                .step(event)
                .await
                .map_err(|e| format!("after event {i} ({event:?}): {e}"))?;
        }
        drive.finish().await
    })
}

#[test]
fn in_flight_features_compose() {
    // (A longer hunt: COMPOSITION_CASES, the same seed.)
    let cases = std::env::var("COMPOSITION_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1500);
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1f_11_6a_7e);
    let seen = Seen::default();
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    })
    .run(&case(), |case| {
        run_case(&case, &seen).map_err(TestCaseError::fail)
    })
    .unwrap();
    seen.exercised(10);
}
