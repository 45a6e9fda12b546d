//! A shared (fleet-wide) in-flight limit's features composed, on a real
//! Redis, against one model.
//!
//! `tests/composition_in_flight.rs` composes the in-process layer's
//! features on tokio's paused clock; a shared limit's leases live in Redis,
//! on Redis's clock, so this test runs in real time. Each case builds two
//! instances of one `ConcurrencyLimitLayer` on one Redis (a fleet of two
//! processes' worth of local state) from a random combination of what
//! `build` accepts beside `shared`: a global limit, a per-key limit by
//! tenant, a line (a few waiters, for a few milliseconds or a few tens),
//! dry-run, an exemption by header, and a body idle timeout short enough
//! to fire. It drives them with random traces: requests to either instance
//! (three tenants, some exempt, some in bursts), the inner service
//! answering a held request with its body left open, a body ending, a
//! client going away (while waiting, held, or reading), and time passing.
//!
//! Checked (the model is what the requests themselves saw):
//!
//! - **the bounds hold across the fleet**: whenever the inner service of
//!   either instance is called, the requests that surely hold a lease at
//!   that instant (held by an inner service, or answered with a body
//!   neither ended nor past its idle time) are within the global and the
//!   per-tenant limit, except in dry-run;
//! - **refusals are the right ones**: never in dry-run, never for an
//!   exempt request; `503` without `Retry-After`, or `429` only with a
//!   per-key limit; and a request sent while the fleet is quiet, with
//!   nobody waiting or being decided and room in both limits counting
//!   every request in flight, is admitted;
//! - **the counts are true**, once the fleet is quiet: each instance's
//!   `in_flight` is its admitted requests not over (exempt ones are never
//!   counted) and its `waiting` those neither admitted nor answered; Redis
//!   holds one lease per admitted request not over, in the limit's set
//!   and, with a per-key limit, in the key sets, none of which holds more
//!   than that limit (in dry-run, no more than that, and never more than
//!   the limit: a request let through over the limit holds no lease);
//! - **nothing leaks**: once every request is answered, ended or dropped,
//!   no lease and no key set is left in Redis and nothing is in flight or
//!   waiting. Leases last an hour, so none expires during a case.
//!
//! Seeded (`PROPTEST_RNG_SEED` replays another seed), with a fixed budget
//! of cases (`COMPOSITION_CASES` changes it).

mod common;

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::driven::{ChannelBody, assert_exercised, id_of, lock, note, settle};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestRunner};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tollgate::{ConcurrencyLimitLayer, Exemption, KeyPart, Principal, RedisStore};
use tollgate_testkit::RedisServer;
use tower::{Layer, ServiceExt};

#[derive(Debug, Clone)]
struct Setup {
    global: Option<usize>,
    per_key: Option<usize>,
    /// `(waiters, wait in ms)`.
    line: Option<(usize, u64)>,
    dry_run: bool,
    exempt: bool,
    idle_ms: u64,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Send {
        instance: usize,
        tenant: u8,
        exempt: bool,
    },
    /// `n` requests at once to one instance, tenants in turn.
    Burst {
        instance: usize,
        n: usize,
    },
    /// The inner service answers the `pick`-th held request, its body
    /// left open.
    Answer(usize),
    /// The `pick`-th open body ends.
    End(usize),
    /// The client of the `pick`-th request not over goes away.
    Drop(usize),
    Wait(u64),
}

#[derive(Debug, Clone)]
struct Case {
    setup: Setup,
    events: Vec<Event>,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop::option::of(1..=3usize),
        prop::option::of(1..=2usize),
        prop::option::of((1..3usize, prop_oneof![Just(20u64), Just(150)])),
        prop::bool::weighted(0.25),
        any::<bool>(),
        prop_oneof![Just(120u64), Just(60_000)],
    )
        .prop_map(|(global, per_key, line, dry_run, exempt, idle_ms)| {
            // Something to bound (what `build` accepts).
            let global = if global.is_none() && per_key.is_none() {
                Some(2)
            } else {
                global
            };
            Setup {
                global,
                per_key,
                line,
                dry_run,
                exempt,
                idle_ms,
            }
        })
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        5 => (0..2usize, 0..3u8, prop::bool::weighted(0.15))
            .prop_map(|(instance, tenant, exempt)| Event::Send { instance, tenant, exempt }),
        2 => (0..2usize, 2..6usize).prop_map(|(instance, n)| Event::Burst { instance, n }),
        3 => (0..8usize).prop_map(Event::Answer),
        3 => (0..8usize).prop_map(Event::End),
        1 => (0..8usize).prop_map(Event::Drop),
        2 => prop_oneof![Just(5u64), Just(40), Just(160)].prop_map(Event::Wait),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (setup(), prop::collection::vec(event(), 1..30))
        .prop_map(|(setup, events)| Case { setup, events })
}

fn layer(setup: &Setup, name: &str, store: &RedisStore) -> Result<ConcurrencyLimitLayer, String> {
    let n = |v: usize| NonZeroUsize::new(v).expect("not zero");
    let mut b = ConcurrencyLimitLayer::builder(name)
        .shared(Arc::new(store.clone()))
        // An hour: no lease expires during a case, so a release that never
        // happened cannot pass for one that did.
        .lease_ttl(Duration::from_secs(3600))
        .poll_every(Duration::from_millis(10));
    if let Some(max) = setup.global {
        b = b.global(n(max));
    }
    if let Some(max) = setup.per_key {
        b = b.per_key(n(max), [KeyPart::Tenant]);
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
    instance: usize,
    tenant: u8,
    exempt: bool,
    phase: Phase,
    /// Whether the inner service was ever called with it.
    admitted: bool,
    /// When the test let the inner service answer: the layer's idle timer
    /// starts after that, so the body is surely open until `idle` later.
    answered: Option<Instant>,
    /// Lets the inner service answer.
    answer: Option<oneshot::Sender<()>>,
    body: Option<mpsc::Sender<Bytes>>,
    task: Option<JoinHandle<()>>,
}

struct World {
    reqs: Vec<Req>,
    idle: Duration,
    /// What a call of the inner service found over a bound.
    violations: Vec<String>,
}

impl World {
    /// Whether `r` surely holds its slot (and lease) now.
    fn surely_holds(&self, r: &Req, now: Instant) -> bool {
        !r.exempt
            && match r.phase {
                Phase::Held => true,
                Phase::Streaming => {
                    r.body.is_some() && r.answered.is_some_and(|at| now < at + self.idle)
                }
                _ => false,
            }
    }

    /// Requests admitted and not over (as far as their clients know).
    fn live(&self, instance: Option<usize>) -> usize {
        self.reqs
            .iter()
            .filter(|r| !r.exempt && instance.is_none_or(|i| r.instance == i))
            .filter(|r| matches!(r.phase, Phase::Held | Phase::Streaming))
            .count()
    }

    fn live_of_tenant(&self, tenant: u8) -> usize {
        self.reqs
            .iter()
            .filter(|r| !r.exempt && r.tenant == tenant)
            .filter(|r| matches!(r.phase, Phase::Held | Phase::Streaming))
            .count()
    }

    fn pending(&self, instance: usize) -> usize {
        self.reqs
            .iter()
            .filter(|r| r.instance == instance && r.phase == Phase::Pending)
            .count()
    }
}

type Shared = Arc<Mutex<World>>;

/// Counts of what the cases exercised, so that a run that never reached a
/// feature fails instead of passing for want of trying.
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    admitted_with_room: AtomicU64,
    refused_503: AtomicU64,
    refused_429: AtomicU64,
    waited_then_admitted: AtomicU64,
    refused_after_waiting: AtomicU64,
    dropped_waiting: AtomicU64,
    dropped_held: AtomicU64,
    stalled: AtomicU64,
    dry_run_over_limit: AtomicU64,
    exempt_over_limit: AtomicU64,
    full_on_the_other_instance: AtomicU64,
}

impl Seen {
    fn exercised(&self, min: u64) {
        let counts = [
            ("admitted", &self.admitted),
            ("sent with room, and admitted", &self.admitted_with_room),
            ("refused with 503", &self.refused_503),
            ("refused with 429", &self.refused_429),
            ("admitted after waiting", &self.waited_then_admitted),
            ("refused after waiting", &self.refused_after_waiting),
            ("dropped while waiting", &self.dropped_waiting),
            ("dropped while held", &self.dropped_held),
            ("bodies ended for stalling", &self.stalled),
            ("dry-run above the limit", &self.dry_run_over_limit),
            ("exempt above the limit", &self.exempt_over_limit),
            (
                "refused while only the other instance had requests in flight",
                &self.full_on_the_other_instance,
            ),
        ];
        assert_exercised(&counts, min);
    }
}

/// One instance: the layer (for its stats) over the test's inner service.
struct Instance {
    layer: ConcurrencyLimitLayer,
    svc: Limited,
}

type Limited = tower::util::BoxCloneSyncService<
    Request<Empty<Bytes>>,
    Response<tollgate::ResponseBody<tollgate::concurrency::PermitBody<ChannelBody>>>,
    Infallible,
>;

struct Drive<'a> {
    setup: &'a Setup,
    redis: &'a RedisServer,
    leases_key: String,
    instances: [Instance; 2],
    world: Shared,
    seen: &'a Seen,
}

/// The inner service of `instance`: marks the request held, checks the
/// fleet's bounds at that instant, and answers when the test says so,
/// with a body the test ends.
fn inner(
    world: Shared,
    setup: Setup,
) -> impl tower::Service<
    Request<Empty<Bytes>>,
    Response = Response<ChannelBody>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<ChannelBody>, Infallible>> + Send,
> + Clone
+ Send
+ Sync {
    tower::service_fn(move |req: Request<Empty<Bytes>>| {
        let world = world.clone();
        let id = id_of(&req);
        let (tx, rx) = oneshot::channel();
        {
            let mut w = lock(&world);
            w.reqs[id].answer = Some(tx);
            w.reqs[id].phase = Phase::Held;
            w.reqs[id].admitted = true;
            if !setup.dry_run {
                let now = Instant::now();
                let holding: Vec<&Req> = w.reqs.iter().filter(|r| w.surely_holds(r, now)).collect();
                let mut over = Vec::new();
                if let Some(max) = setup.global
                    && holding.len() > max
                {
                    over.push(format!(
                        "request {id} called with {} holding a global limit of {max}",
                        holding.len()
                    ));
                }
                let tenant = w.reqs[id].tenant;
                let mine = holding.iter().filter(|r| r.tenant == tenant).count();
                if let Some(max) = setup.per_key
                    && !w.reqs[id].exempt
                    && mine > max
                {
                    over.push(format!(
                        "request {id} called with {mine} of tenant {tenant} holding a per-key limit of {max}"
                    ));
                }
                w.violations.extend(over);
            }
        }
        async move {
            let _ = rx.await;
            let (body_tx, body_rx) = mpsc::channel(4);
            let _ = body_tx.try_send(Bytes::from_static(b"first\n"));
            {
                let mut w = lock(&world);
                w.reqs[id].body = Some(body_tx);
                w.reqs[id].phase = Phase::Streaming;
            }
            Ok::<_, Infallible>(Response::new(ChannelBody(body_rx)))
        }
    })
}

impl Drive<'_> {
    fn send(&self, instance: usize, tenant: u8, exempt: bool) {
        let id = {
            let mut w = lock(&self.world);
            w.reqs.push(Req {
                instance,
                tenant,
                exempt,
                phase: Phase::Pending,
                admitted: false,
                answered: None,
                answer: None,
                body: None,
                task: None,
            });
            w.reqs.len() - 1
        };
        let mut req = Request::builder()
            .uri("/work")
            .header("x-id", id.to_string());
        if exempt {
            req = req.header("x-exempt", "1");
        }
        let mut req = req.body(Empty::new()).expect("a valid request");
        req.extensions_mut()
            .insert(Principal::new(format!("t{tenant}"), "user"));
        let (svc, world) = (self.instances[instance].svc.clone(), self.world.clone());
        let task = tokio::spawn(async move {
            let Ok(response) = svc.oneshot(req).await;
            if lock(&world).reqs[id].phase == Phase::Pending {
                let retry = response
                    .headers()
                    .get("retry-after")
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                lock(&world).reqs[id].phase = Phase::Refused(response.status(), retry);
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
    }

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
        let exempting = self.setup.exempt;
        let mut must_admit = None;
        match event {
            Event::Send {
                instance,
                tenant,
                exempt,
            } => {
                let exempt = exempt && exempting;
                if !exempt && self.room_for(tenant) {
                    must_admit = Some(lock(&self.world).reqs.len());
                }
                self.send(instance, tenant, exempt);
            }
            Event::Burst { instance, n } => {
                for i in 0..n {
                    self.send(instance, u8::try_from(i % 3).expect("small"), false);
                }
            }
            Event::Answer(pick) => {
                let held = self.ids(|p| *p == Phase::Held);
                if let Some(&id) = held.get(pick % held.len().max(1)) {
                    let mut w = lock(&self.world);
                    if let Some(answer) = w.reqs[id].answer.take() {
                        w.reqs[id].answered = Some(Instant::now());
                        let _ = answer.send(());
                    }
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
                    w.reqs[id].phase = Phase::Dropped;
                }
            }
            Event::Wait(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
        settle().await;
        self.check(&before)?;
        self.quiet().await?;
        if let Some(id) = must_admit {
            let w = lock(&self.world);
            if let Phase::Refused(status, _) = &w.reqs[id].phase {
                return Err(format!(
                    "request {id} refused ({status}) with room: {} of {:?} in flight, its tenant's {} of {:?}",
                    w.live(None),
                    self.setup.global,
                    w.live_of_tenant(w.reqs[id].tenant),
                    self.setup.per_key,
                ));
            }
            note(&self.seen.admitted_with_room);
        }
        Ok(())
    }

    /// Whether a request of `tenant` sent now must be admitted at once:
    /// the fleet is quiet (every step ends with `quiet`, so Redis holds a
    /// lease for each request in flight and none for one that is over),
    /// nobody waits or is being decided (a request dropped before it was
    /// admitted may still have an acquire on its way: one in a case turns
    /// this check off for the rest of it), and the limits have room even
    /// counting every request in flight (a body that times out meanwhile
    /// only makes more room). The refusals the model cannot time (a full
    /// limit seen in the middle of releases) are left alone; this is the
    /// one a limit that refuses too much must fail.
    fn room_for(&self, tenant: u8) -> bool {
        let w = lock(&self.world);
        let busy = w
            .reqs
            .iter()
            .any(|r| r.phase == Phase::Pending || (r.phase == Phase::Dropped && !r.admitted));
        !busy
            && self.setup.global.is_none_or(|max| w.live(None) < max)
            && self
                .setup
                .per_key
                .is_none_or(|max| w.live_of_tenant(tenant) < max)
    }

    /// The bounds and the refusals, after an event.
    fn check(&self, before: &[Phase]) -> Result<(), String> {
        let s = self.setup;
        let w = lock(&self.world);
        if let Some(first) = w.violations.first() {
            return Err(first.clone());
        }
        let live = |r: &Req| matches!(r.phase, Phase::Held | Phase::Streaming);
        let counted = w.live(None);
        let everyone = w.reqs.iter().filter(|r| live(r)).count();
        for (i, r) in w.reqs.iter().enumerate() {
            let changed = before.get(i) != Some(&r.phase);
            if changed && live(r) {
                note(&self.seen.admitted);
                if before.get(i) == Some(&Phase::Pending) && s.line.is_some() {
                    note(&self.seen.waited_then_admitted);
                }
            }
            if changed
                && r.phase == Phase::Over
                && r.body.is_some()
                && before.get(i) == Some(&Phase::Streaming)
            {
                note(&self.seen.stalled);
            }
            let Phase::Refused(status, retry) = &r.phase else {
                continue;
            };
            if !changed {
                continue;
            }
            if s.dry_run {
                return Err(format!("request {i} refused ({status}) in dry-run"));
            }
            if r.exempt {
                return Err(format!("exempt request {i} refused ({status})"));
            }
            if before.get(i) == Some(&Phase::Pending) && s.line.is_some() {
                note(&self.seen.refused_after_waiting);
            }
            let other = 1 - r.instance;
            if w.live(Some(other)) > 0 && w.live(Some(r.instance)) == 0 {
                note(&self.seen.full_on_the_other_instance);
            }
            match *status {
                StatusCode::SERVICE_UNAVAILABLE if retry.is_none() => {
                    note(&self.seen.refused_503);
                }
                StatusCode::TOO_MANY_REQUESTS if s.per_key.is_some() => {
                    note(&self.seen.refused_429);
                }
                other => {
                    return Err(format!(
                        "request {i} refused with {other}, Retry-After {retry:?}"
                    ));
                }
            }
        }
        if let Some(max) = s.global {
            if s.dry_run && counted > max {
                note(&self.seen.dry_run_over_limit);
            }
            if everyone > max && everyone > counted {
                note(&self.seen.exempt_over_limit);
            }
        }
        Ok(())
    }

    fn leases(&self) -> Result<usize, String> {
        self.zcard(&self.leases_key)
    }

    fn zcard(&self, key: &str) -> Result<usize, String> {
        self.redis
            .query(&["ZCARD", key])?
            .trim()
            .parse()
            .map_err(|e| format!("ZCARD {key}: {e}"))
    }

    /// The leases in each key's set (`PREFIX:{inflight/NAME}:k:KEY`), by
    /// set: one per keyed request in flight, as in the limit's own set.
    fn keyed_leases(&self) -> Result<Vec<usize>, String> {
        let pattern = format!("{}:k:*", self.leases_key.trim_end_matches(":all"));
        let keys = self.redis.query(&["KEYS", &pattern])?;
        keys.lines()
            .filter(|k| !k.trim().is_empty())
            .map(|k| self.zcard(k.trim()))
            .collect()
    }

    /// What the counts should be once the fleet is quiet, or why not.
    fn counts_disagree(&self) -> Result<Option<String>, String> {
        let leases = self.leases()?;
        let keyed = self.keyed_leases()?;
        let w = lock(&self.world);
        for (i, instance) in self.instances.iter().enumerate() {
            let stats = instance.layer.stats();
            let (live, pending) = (w.live(Some(i)), w.pending(i));
            if stats.in_flight != live || stats.waiting != pending {
                return Ok(Some(format!(
                    "instance {i}: the layer counts {} in flight and {} waiting, the requests {live} and {pending}",
                    stats.in_flight, stats.waiting
                )));
            }
        }
        let live = w.live(None);
        let true_leases = if self.setup.dry_run {
            leases <= live && self.setup.global.is_none_or(|max| leases <= max)
        } else {
            leases == live
        };
        if !true_leases {
            return Ok(Some(format!(
                "{leases} leases in Redis for {live} requests in flight"
            )));
        }
        // With a per-key limit every request counted has a key: each is in
        // its key's set too, and no key's set holds more than the limit
        // (in dry-run, one let through over it holds no lease).
        let Some(max) = self.setup.per_key else {
            return Ok(
                (!keyed.is_empty()).then(|| format!("key sets {keyed:?} without a per-key limit"))
            );
        };
        let in_sets: usize = keyed.iter().sum();
        let agree = if self.setup.dry_run {
            in_sets <= live
        } else {
            in_sets == live
        };
        Ok((!agree || keyed.iter().any(|&n| n > max)).then(|| {
            format!("{in_sets} leases in the key sets {keyed:?} for {live} requests in flight")
        }))
    }

    /// Waits until the counts agree (requests and leases settle in real
    /// time: a release is a round trip to Redis); fails if they never do.
    async fn quiet(&self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            settle().await;
            let Some(why) = self.counts_disagree()? else {
                return Ok(());
            };
            if Instant::now() > deadline {
                return Err(format!("never quiet: {why}"));
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
    }

    /// Answers and ends everything, lets every line and idle time run
    /// out: nothing may be left in flight, waiting, or in Redis.
    async fn finish(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let held = self.ids(|p| *p == Phase::Held);
            for id in held {
                if let Some(answer) = lock(&self.world).reqs[id].answer.take() {
                    let _ = answer.send(());
                }
            }
            settle().await;
            for id in self.ids(|p| *p == Phase::Streaming) {
                lock(&self.world).reqs[id].body.take();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            let left = self.ids(|p| matches!(p, Phase::Pending | Phase::Held | Phase::Streaming));
            let leases = self.leases()?;
            let keyed = self.keyed_leases()?;
            let stats = self.instances.each_ref().map(|i| i.layer.stats());
            let idle = stats.iter().all(|s| s.in_flight == 0 && s.waiting == 0);
            if left.is_empty() && leases == 0 && keyed.is_empty() && idle {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "at the end: {leases} leases, key sets {keyed:?}, requests not over {left:?}, in flight / waiting {:?}",
                    stats.map(|s| (s.in_flight, s.waiting))
                ));
            }
        }
    }
}

fn run_case(case: &Case, redis: &RedisServer, seen: &Seen, number: usize) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let store = RedisStore::builder(&redis.url())
            .map_err(|e| e.to_string())?
            .build()
            .map_err(|e| e.to_string())?;
        // A limit of its own per case: no case sees another's leases.
        let name = format!("case{number}");
        let world: Shared = Arc::new(Mutex::new(World {
            reqs: Vec::new(),
            idle: Duration::from_millis(case.setup.idle_ms),
            violations: Vec::new(),
        }));
        let instance = |_: usize| -> Result<Instance, String> {
            let layer = layer(&case.setup, &name, &store)?;
            let svc = tower::util::BoxCloneSyncService::new(
                layer
                    .clone()
                    .layer(inner(world.clone(), case.setup.clone())),
            );
            Ok(Instance { layer, svc })
        };
        let mut drive = Drive {
            setup: &case.setup,
            redis,
            leases_key: format!("tollgate:{{inflight/{name}}}:all"),
            instances: [instance(0)?, instance(1)?],
            world,
            seen,
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
fn shared_in_flight_features_compose() {
    let redis = tollgate_testkit::or_skip!(RedisServer::start());
    // (A longer hunt: COMPOSITION_CASES, the same seed.)
    let cases = std::env::var("COMPOSITION_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(150);
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5a_a7_ed_01);
    let seen = Seen::default();
    let number = AtomicUsize::new(0);
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    })
    .run(&case(), |case| {
        let n = number.fetch_add(1, Ordering::Relaxed);
        run_case(&case, &redis, &seen, n).map_err(TestCaseError::fail)
    })
    .unwrap();
    seen.exercised(3);
}
