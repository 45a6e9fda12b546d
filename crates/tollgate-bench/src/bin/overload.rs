//! The overload benchmark: tollgate's adaptive limit (with fair share and
//! priorities where the scenario asks for them), tollgate's fixed limit
//! set 2x too high and 2x too low, and `tower-resilience-adaptive`'s AIMD
//! and Vegas, in one run, on one simulated backend.
//!
//! The backend is the quickstart's `/work` model (processor sharing with a
//! capacity of 16: each of n requests in it progresses at 16/max(n, 16) of
//! its speed), 20 ms of work per request, in process, on real time (the
//! peer measures latency with `std::time::Instant`, so a paused clock
//! would blind it). Arrivals are open loop: a Poisson process from a fixed
//! seed, the same arrival times for every configuration. A request's
//! latency runs from its arrival to the end of its response body; it is
//! good when that is at most the deadline, 1 s.
//!
//! Nothing waits in a line by default in `step` and `noisy`: tollgate's
//! configurations refuse at once (`--wait-ms N` gives them `wait(64, N
//! ms)` in every scenario, and `--wait-ms 0` no line in any). In
//! `priority` they wait in a line of 64 for
//! at most 20 ms: priorities act through it (a higher class takes the
//! slot a lower one waits for; without a line, an interactive stream
//! that alone fills the capacity loses its Poisson bursts above the
//! limit whatever the classes). The peer, a
//! `tower` service that waits in `poll_ready`, runs behind
//! `tower::load_shed` (refused at once when not ready), as it is deployed
//! against an open loop (without it, its line is unbounded).
//!
//! Scenarios:
//! 1. `step`: 1.5x capacity offered; capacity halves at 5 s and recovers
//!    at 10 s (15 s).
//! 2. `noisy`: one tenant offers 10x its fair share, three offer half of
//!    theirs (10 s).
//! 3. `priority`: 2x capacity, half batch, half interactive (10 s).
//!
//! Prints a table per scenario and, last, one line per number the issue
//! asks for. Writes `CSV_DIR/<scenario>-<config>.csv` (time, limit, in
//! flight, p99 of the last half second) for `overload_plot`.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin overload -- [--quick] [--csv DIR]
//!     [--only SCENARIO] [--config NAME] [--oracle-eighths N] [--oracle-delay-ms N]
//! ```
//!
//! `--only` runs one scenario (`step`, `noisy`, `priority`) and `--config`
//! one configuration (its name in the table, e.g. `tollgate-adaptive`):
//! for iterating on one number.
//!
//! The last configuration, `oracle`, is no peer and no part of
//! `vs_best_peer_min`: a plain counter told the backend's capacity, with a
//! limit of `--oracle-eighths N` eighths of it (13 by default: where the
//! adaptive limit settles), learning of a change `--oracle-delay-ms N`
//! late (0 by default). It shows what admission alone can reach with no
//! probes and no time spent finding out: the bound a controller that
//! measures is held to. The last lines are printed when the
//! adaptive configuration ran, cover the scenarios that ran, and
//! `vs_best_peer_min` needs the peers.

// A measurement program: rates, ratios and percentiles are fractions.
#![allow(clippy::float_arithmetic)]

#[path = "../../../../examples/support/processor_sharing.rs"]
mod processor_sharing;

use std::convert::Infallible;
use std::future::Future;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use processor_sharing::ProcessorSharing;
use tokio::time::Instant;
use tollgate::concurrency::{AdaptiveConfig, Priority};
use tollgate::{ConcurrencyLimitLayer, KeyPart, Principal};
use tower::{Layer, ServiceExt};
use tower_resilience_adaptive::{AdaptiveLimiterLayer, AdaptiveService, Aimd, Vegas};

/// Work per request, alone on the backend.
const WORK: Duration = Duration::from_millis(20);
/// Requests the backend serves at full speed.
const CAPACITY: u64 = 16;
/// A request answered later than this is not goodput.
const DEADLINE: Duration = Duration::from_secs(1);
/// How long tollgate's configurations wait in a line of 64 in the
/// `priority` scenario (without `--wait-ms`).
const PRIORITY_WAIT: Duration = Duration::from_millis(20);
/// How often the limit and the requests in flight are sampled.
const SAMPLE: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Config {
    Adaptive,
    FixedHigh,
    FixedLow,
    Aimd,
    Vegas,
    Oracle,
}

const CONFIGS: [Config; 6] = [
    Config::Adaptive,
    Config::FixedHigh,
    Config::FixedLow,
    Config::Aimd,
    Config::Vegas,
    Config::Oracle,
];

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::Adaptive => "tollgate-adaptive",
            Config::FixedHigh => "tollgate-fixed-32",
            Config::FixedLow => "tollgate-fixed-8",
            Config::Aimd => "peer-aimd",
            Config::Vegas => "peer-vegas",
            Config::Oracle => "oracle",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Step,
    Noisy,
    Priority,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Step => "step",
            Scenario::Noisy => "noisy",
            Scenario::Priority => "priority",
        }
    }
}

type Call =
    Arc<dyn Fn(Request<Empty<Bytes>>) -> Pin<Box<dyn Future<Output = bool> + Send>> + Send + Sync>;
type Gauge = Arc<dyn Fn() -> (usize, usize) + Send + Sync>;

/// A configuration over the backend: how to send a request (`true`:
/// answered), and its (limit, in flight) now.
struct System {
    call: Call,
    gauge: Gauge,
}

type Backed =
    tower::util::BoxCloneSyncService<Request<Empty<Bytes>>, Response<Full<Bytes>>, Infallible>;

fn backend_service(backend: &ProcessorSharing) -> Backed {
    let backend = backend.clone();
    tower::util::BoxCloneSyncService::new(tower::service_fn(move |_req: Request<Empty<Bytes>>| {
        let backend = backend.clone();
        async move {
            backend.serve(WORK).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    }))
}

fn class_of(req: &http::request::Parts) -> Priority {
    match req.headers.get("x-class").map(|v| v.as_bytes()) {
        Some(b"batch") => Priority::Batch,
        _ => Priority::Interactive,
    }
}

fn tollgate_system(
    config: Config,
    scenario: Scenario,
    inner: Backed,
    wait: Option<Duration>,
) -> System {
    let builder = ConcurrencyLimitLayer::builder("overload");
    let nz = |n| NonZeroUsize::new(n).expect("not zero");
    let builder = match config {
        Config::FixedHigh => builder.global(nz(2 * CAPACITY as usize)),
        Config::FixedLow => builder.global(nz(CAPACITY as usize / 2)),
        _ => {
            let adaptive = AdaptiveConfig::builder()
                .bounds(4, 1024)
                .build()
                .expect("valid adaptive config");
            let builder = builder.adaptive(adaptive);
            match scenario {
                Scenario::Noisy => builder.fair_share([KeyPart::Tenant]),
                Scenario::Priority => builder.priority(class_of),
                Scenario::Step => builder,
            }
        }
    };
    // Priorities act through the line (a higher class takes the slot a
    // lower one waits for): in that scenario tollgate's configurations
    // wait, unless told otherwise.
    let wait = match (wait, scenario) {
        (Some(wait), _) => wait,
        (None, Scenario::Priority) => PRIORITY_WAIT,
        (None, _) => Duration::ZERO,
    };
    let builder = if wait.is_zero() {
        builder
    } else {
        builder.wait(64, wait)
    };
    let layer = builder.build().expect("valid layer");
    let svc = layer.layer(inner);
    let call: Call = Arc::new(move |req| {
        let svc = svc.clone();
        Box::pin(async move {
            let Ok(response) = svc.oneshot(req).await;
            response.status() == StatusCode::OK && response.into_body().collect().await.is_ok()
        })
    });
    let gauge: Gauge = Arc::new(move || {
        let stats = layer.stats();
        (stats.global_limit.unwrap_or(0), stats.in_flight)
    });
    System { call, gauge }
}

fn peer_system<A>(algorithm: A, inner: Backed) -> System
where
    A: tower_resilience_adaptive::ConcurrencyAlgorithm + Send + Sync + 'static,
{
    let adaptive: AdaptiveService<Backed, A> = AdaptiveLimiterLayer::new(algorithm).layer(inner);
    let watched = Mutex::new(adaptive.clone());
    let svc = tower::load_shed::LoadShed::new(adaptive);
    let call: Call = Arc::new(move |req| {
        let svc = svc.clone();
        Box::pin(async move { svc.oneshot(req).await.is_ok() })
    });
    let gauge: Gauge = Arc::new(move || {
        let watched = watched.lock().expect("not poisoned");
        (watched.limit(), watched.in_flight())
    });
    System { call, gauge }
}

/// How the oracle configuration runs.
#[derive(Debug, Clone, Copy)]
struct Oracle {
    /// Its limit, in eighths of the capacity.
    eighths: u64,
    /// How late it learns of a change of capacity.
    delay: Duration,
}

/// The oracle: no measurement at all. It is told the backend's capacity
/// (`delay` after it changes) and holds a limit of `eighths` eighths of it
/// (by default 13: 26 for 16, 13 for 8, where the adaptive limit settles),
/// refusing beyond. Not a peer: it shows what admission alone can reach,
/// with no probes and no time spent finding out, and how the scores move
/// with the limit and with how late a change is known.
fn oracle_system(inner: Backed, capacity: Arc<AtomicU64>, eighths: u64) -> System {
    let in_flight = Arc::new(AtomicU64::new(0));
    let limit = move || capacity.load(Ordering::SeqCst) * eighths / 8;
    let call: Call = {
        let (in_flight, limit) = (in_flight.clone(), limit.clone());
        Arc::new(move |req| {
            let (svc, in_flight) = (inner.clone(), in_flight.clone());
            let admitted = in_flight.fetch_add(1, Ordering::SeqCst) < limit();
            Box::pin(async move {
                let answered = admitted && svc.oneshot(req).await.is_ok();
                in_flight.fetch_sub(1, Ordering::SeqCst);
                answered
            })
        })
    };
    let gauge: Gauge = Arc::new(move || {
        let n = in_flight.load(Ordering::SeqCst);
        (limit() as usize, n as usize)
    });
    System { call, gauge }
}

fn system(
    config: Config,
    scenario: Scenario,
    backend: &ProcessorSharing,
    options: &Options,
    capacity: Arc<AtomicU64>,
) -> System {
    let inner = backend_service(backend);
    match config {
        Config::Oracle => oracle_system(inner, capacity, options.oracle.eighths),
        Config::Aimd => peer_system(
            Aimd::builder()
                .initial_limit(10)
                .min_limit(1)
                .max_limit(1024)
                .latency_threshold(2 * WORK)
                .build()
                .expect("valid AIMD"),
            inner,
        ),
        Config::Vegas => peer_system(
            Vegas::builder()
                .initial_limit(10)
                .min_limit(1)
                .max_limit(1024)
                .build()
                .expect("valid Vegas"),
            inner,
        ),
        _ => tollgate_system(config, scenario, inner, options.wait),
    }
}

/// Who sends a request: its tenant (0 is the noisy one) and whether it is
/// batch work.
#[derive(Debug, Clone, Copy)]
struct Sender {
    tenant: u8,
    batch: bool,
}

/// One request's fate.
#[derive(Debug, Clone, Copy)]
struct Record {
    /// Arrival, since the start.
    at: Duration,
    /// `None`: refused.
    latency: Option<Duration>,
    sender: Sender,
}

impl Record {
    fn good(&self) -> bool {
        self.latency.is_some_and(|l| l <= DEADLINE)
    }
}

/// A small deterministic generator: the same arrivals for every
/// configuration.
struct Lcg(u64);

impl Lcg {
    fn unit(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
}

/// The arrival times and senders of a scenario: independent Poisson
/// streams, merged.
fn arrivals(scenario: Scenario, run: Duration) -> Vec<(Duration, Sender)> {
    let capacity_rps = CAPACITY as f64 / WORK.as_secs_f64();
    // (rate per second, sender) of each stream.
    let streams: Vec<(f64, Sender)> = match scenario {
        Scenario::Step => vec![(
            1.5 * capacity_rps,
            Sender {
                tenant: 1,
                batch: false,
            },
        )],
        Scenario::Noisy => {
            // Fair share: a quarter of the capacity each.
            let share = capacity_rps / 4.0;
            let mut streams = vec![(
                10.0 * share,
                Sender {
                    tenant: 0,
                    batch: false,
                },
            )];
            for tenant in 1..=3 {
                streams.push((
                    share / 2.0,
                    Sender {
                        tenant,
                        batch: false,
                    },
                ));
            }
            streams
        }
        Scenario::Priority => vec![
            (
                capacity_rps,
                Sender {
                    tenant: 1,
                    batch: true,
                },
            ),
            (
                capacity_rps,
                Sender {
                    tenant: 2,
                    batch: false,
                },
            ),
        ],
    };
    let mut all = Vec::new();
    for (i, (rate, sender)) in streams.into_iter().enumerate() {
        let mut rng = Lcg(0x5eed_0000 + i as u64);
        let mut t = 0.0;
        loop {
            t += -rng.unit().ln() / rate;
            if t >= run.as_secs_f64() {
                break;
            }
            all.push((Duration::from_secs_f64(t), sender));
        }
    }
    all.sort_by_key(|(t, _)| *t);
    all
}

/// The backend's capacity at `t` into a scenario.
fn capacity_at(scenario: Scenario, run: Duration, t: Duration) -> u64 {
    if scenario == Scenario::Step && t >= run / 3 && t < run * 2 / 3 {
        CAPACITY / 2
    } else {
        CAPACITY
    }
}

struct Run {
    records: Vec<Record>,
    /// (time, limit, in flight) every [`SAMPLE`].
    samples: Vec<(Duration, usize, usize)>,
}

/// What the command line asked.
struct Options {
    /// tollgate's configurations wait in a line of 64 this long (`None`:
    /// the scenario's default).
    wait: Option<Duration>,
    oracle: Oracle,
}

async fn run(scenario: Scenario, config: Config, length: Duration, options: &Options) -> Run {
    let backend = ProcessorSharing::new(CAPACITY);
    // The capacity as the oracle knows it.
    let known = Arc::new(AtomicU64::new(CAPACITY));
    let system = system(config, scenario, &backend, options, known.clone());
    let delay = options.oracle.delay;
    let plan = arrivals(scenario, length);
    let start = Instant::now();
    let records = Arc::new(Mutex::new(Vec::with_capacity(plan.len())));
    let sampler = {
        let (gauge, backend) = (system.gauge.clone(), backend.clone());
        tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut capacity = CAPACITY;
            // The capacity changes within 2 ms of its time.
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            loop {
                tick.tick().await;
                let t = start.elapsed();
                if t >= length {
                    return samples;
                }
                let now = capacity_at(scenario, length, t);
                if now != capacity {
                    backend.set_capacity(now);
                    let known = known.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        known.store(now, Ordering::SeqCst);
                    });
                    capacity = now;
                }
                let n = samples.len() as u32;
                if t >= SAMPLE * n {
                    let (limit, in_flight) = gauge();
                    samples.push((t, limit, in_flight));
                }
            }
        })
    };
    let mut tasks = Vec::with_capacity(plan.len());
    for (at, sender) in plan {
        tokio::time::sleep_until(start + at).await;
        let mut req = Request::new(Empty::new());
        let tenant = if sender.tenant == 0 {
            "noisy".to_owned()
        } else {
            format!("quiet{}", sender.tenant)
        };
        req.extensions_mut().insert(Principal::new(tenant, "user"));
        if sender.batch {
            req.headers_mut()
                .insert("x-class", http::HeaderValue::from_static("batch"));
        }
        let (call, records) = (system.call.clone(), records.clone());
        tasks.push(tokio::spawn(async move {
            let arrived = Instant::now();
            let answered = call(req).await;
            let latency = answered.then(|| arrived.elapsed());
            records.lock().expect("not poisoned").push(Record {
                at: arrived - start,
                latency,
                sender,
            });
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let samples = sampler.await.unwrap_or_default();
    let mut records = std::mem::take(&mut *records.lock().expect("not poisoned"));
    records.sort_by_key(|r| r.at);
    Run { records, samples }
}

fn percentile(mut values: Vec<Duration>, p: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    values.sort();
    let i = ((values.len() as f64 * p).ceil() as usize).clamp(1, values.len()) - 1;
    values[i]
}

/// What a run scored.
#[derive(Debug, Default, Clone)]
struct Score {
    /// The scenario's goodput: for `step` the smallest phase's goodput as
    /// a fraction of that phase's capacity; for `noisy` the worst quiet
    /// tenant's good requests as a fraction of its demand; for `priority`
    /// the interactive requests'.
    goodput: f64,
    /// Of the requests that count, the admitted ones answered within the
    /// deadline.
    hit_rate: f64,
    /// p99 latency of the admitted requests that count, as a multiple of
    /// the unloaded service time (`step`: the worst phase).
    p99: f64,
    /// Everything else, for the table.
    detail: String,
    /// `step`: the longest time the limit took to settle after a change.
    settle: Option<Duration>,
}

impl Score {
    fn value(&self) -> f64 {
        self.goodput * self.hit_rate
    }
}

fn hit_rate(records: &[&Record]) -> f64 {
    let admitted = records.iter().filter(|r| r.latency.is_some()).count();
    if admitted == 0 {
        return 0.0;
    }
    records.iter().filter(|r| r.good()).count() as f64 / admitted as f64
}

fn p99_of(records: &[&Record]) -> f64 {
    let latencies = records.iter().filter_map(|r| r.latency).collect();
    percentile(latencies, 0.99).as_secs_f64() / WORK.as_secs_f64()
}

/// How long after `change` the limit stays within a quarter of where it
/// ends the phase (the median of its last second); `None` if it never
/// does.
fn settle_time(
    samples: &[(Duration, usize, usize)],
    change: Duration,
    end: Duration,
) -> Option<Duration> {
    let phase: Vec<_> = samples
        .iter()
        .filter(|(t, ..)| *t >= change && *t < end)
        .collect();
    let mut last: Vec<usize> = phase
        .iter()
        .filter(|(t, ..)| *t + Duration::from_secs(1) >= end)
        .map(|(_, l, _)| *l)
        .collect();
    last.sort_unstable();
    let settled = *last.get(last.len() / 2)? as f64;
    let near = |l: usize| (l as f64 - settled).abs() <= settled / 4.0;
    // The first sample from which every later one is near.
    let mut from = None;
    for (t, l, _) in phase.iter().rev() {
        if near(*l) {
            from = Some(*t);
        } else {
            break;
        }
    }
    from.map(|t| t.saturating_sub(change))
}

fn score(scenario: Scenario, length: Duration, run: &Run, adaptive: bool) -> Score {
    // The first second is a cold start (an adaptive limit measures its
    // floor first); it counts nowhere.
    let warm = Duration::from_secs(1);
    match scenario {
        Scenario::Step => {
            let third = length / 3;
            let mut goodput = f64::MAX;
            let mut p99 = 0.0f64;
            let mut detail = Vec::new();
            for phase in 0..3u32 {
                let (from, to) = (third * phase, third * (phase + 1));
                let capacity = capacity_at(scenario, length, from) as f64 / WORK.as_secs_f64();
                let counted_from = if phase == 0 { from + warm } else { from };
                if counted_from >= to {
                    // (A quick run's first phase is all warm-up.)
                    continue;
                }
                let seconds = (to - counted_from).as_secs_f64();
                let done: Vec<&Record> = run
                    .records
                    .iter()
                    .filter(|r| {
                        r.latency.is_some_and(|l| {
                            let end = r.at + l;
                            end >= counted_from && end < to
                        })
                    })
                    .collect();
                let good = done.iter().filter(|r| r.good()).count() as f64;
                let fraction = good / (capacity * seconds);
                let arrived: Vec<&Record> = run
                    .records
                    .iter()
                    .filter(|r| r.at >= counted_from && r.at < to)
                    .collect();
                let phase_p99 = p99_of(&arrived);
                goodput = goodput.min(fraction);
                p99 = p99.max(phase_p99);
                detail.push(format!("{fraction:.3}/{phase_p99:.1}x"));
            }
            let counted: Vec<&Record> = run.records.iter().filter(|r| r.at >= warm).collect();
            let settle = adaptive.then(|| {
                [third, third * 2]
                    .iter()
                    .map(|&change| {
                        settle_time(&run.samples, change, change + third).unwrap_or(third)
                    })
                    .max()
                    .unwrap_or_default()
            });
            Score {
                goodput,
                hit_rate: hit_rate(&counted),
                p99,
                detail: detail.join(" "),
                settle,
            }
        }
        Scenario::Noisy => {
            let counted: Vec<&Record> = run.records.iter().filter(|r| r.at >= warm).collect();
            let of = |tenant: u8| -> Vec<&Record> {
                counted
                    .iter()
                    .copied()
                    .filter(|r| r.sender.tenant == tenant)
                    .collect()
            };
            let fraction = |rs: &[&Record]| {
                rs.iter().filter(|r| r.good()).count() as f64 / rs.len().max(1) as f64
            };
            let quiet: Vec<Vec<&Record>> = (1..=3).map(of).collect();
            let worst = quiet.iter().map(|rs| fraction(rs)).fold(f64::MAX, f64::min);
            let all_quiet: Vec<&Record> = quiet.concat();
            let noisy = fraction(&of(0));
            Score {
                goodput: worst,
                hit_rate: hit_rate(&all_quiet),
                p99: p99_of(&all_quiet),
                detail: format!("noisy {noisy:.2}"),
                settle: None,
            }
        }
        Scenario::Priority => {
            let counted: Vec<&Record> = run.records.iter().filter(|r| r.at >= warm).collect();
            let (batch, interactive): (Vec<&Record>, Vec<&Record>) =
                counted.iter().partition(|r| r.sender.batch);
            let fraction = |rs: &[&Record]| {
                rs.iter().filter(|r| r.good()).count() as f64 / rs.len().max(1) as f64
            };
            Score {
                goodput: fraction(&interactive),
                hit_rate: hit_rate(&interactive),
                p99: p99_of(&interactive),
                detail: format!("batch {:.2}", fraction(&batch)),
                settle: None,
            }
        }
    }
}

/// `(time, limit, in flight, p99 in ms of what ended in the half second
/// before)` per sample.
fn series(run: &Run) -> Vec<(f64, usize, usize, f64)> {
    let half = Duration::from_millis(500);
    run.samples
        .iter()
        .map(|&(t, limit, in_flight)| {
            let recent: Vec<Duration> = run
                .records
                .iter()
                .filter_map(|r| {
                    let l = r.latency?;
                    let end = r.at + l;
                    (end <= t && end + half > t).then_some(l)
                })
                .collect();
            let p99 = percentile(recent, 0.99).as_secs_f64() * 1e3;
            (t.as_secs_f64(), limit, in_flight, p99)
        })
        .collect()
}

fn write_csv(dir: &std::path::Path, scenario: Scenario, config: Config, run: &Run) {
    let mut text = String::from("t_s,limit,in_flight,p99_ms\n");
    for (t, limit, in_flight, p99) in series(run) {
        text.push_str(&format!("{t:.2},{limit},{in_flight},{p99:.1}\n"));
    }
    let path = dir.join(format!("{}-{}.csv", scenario.name(), config.name()));
    if let Err(e) = std::fs::write(&path, text) {
        eprintln!("cannot write {}: {e}", path.display());
    }
}

fn main() {
    let mut quick = false;
    let mut options = Options {
        wait: None,
        oracle: Oracle {
            eighths: 13,
            delay: Duration::ZERO,
        },
    };
    let mut csv = std::path::PathBuf::from("target/overload");
    let mut only: Option<String> = None;
    let mut only_config: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--wait-ms" => {
                let ms = args.next().and_then(|v| v.parse().ok());
                options.wait = Some(Duration::from_millis(
                    ms.expect("--wait-ms needs a number of milliseconds"),
                ));
            }
            "--oracle-eighths" => {
                let eighths = args.next().and_then(|v| v.parse().ok());
                options.oracle.eighths = eighths
                    .filter(|&e| e > 0)
                    .expect("--oracle-eighths needs a positive number");
            }
            "--oracle-delay-ms" => {
                let ms = args.next().and_then(|v| v.parse().ok());
                options.oracle.delay = Duration::from_millis(
                    ms.expect("--oracle-delay-ms needs a number of milliseconds"),
                );
            }
            "--csv" => csv = args.next().expect("--csv needs a directory").into(),
            "--only" => only = Some(args.next().expect("--only needs a scenario")),
            "--config" => only_config = Some(args.next().expect("--config needs a name")),
            other => {
                eprintln!(
                    "usage: overload [--quick] [--wait-ms N] [--csv DIR] [--only SCENARIO] \
                     [--config NAME] [--oracle-eighths N] [--oracle-delay-ms N] (not {other:?})"
                );
                std::process::exit(2);
            }
        }
    }
    std::fs::create_dir_all(&csv).expect("a directory for the CSV files");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let scale = if quick { 5 } else { 1 };
    let scenarios = [
        (Scenario::Step, Duration::from_secs(15)),
        (Scenario::Noisy, Duration::from_secs(10)),
        (Scenario::Priority, Duration::from_secs(10)),
    ];
    let mut summary: Vec<(Scenario, Vec<(Config, Score)>)> = Vec::new();
    let scenarios: Vec<_> = scenarios
        .into_iter()
        .filter(|(s, _)| only.as_deref().is_none_or(|o| o == s.name()))
        .collect();
    let configs: Vec<Config> = CONFIGS
        .into_iter()
        .filter(|c| only_config.as_deref().is_none_or(|o| o == c.name()))
        .collect();
    if scenarios.is_empty() || configs.is_empty() {
        eprintln!("no scenario or configuration by that name");
        std::process::exit(2);
    }
    for (scenario, length) in scenarios {
        let length = length / scale;
        let mut scores = Vec::new();
        println!("\n## {} ({} s)\n", scenario.name(), length.as_secs_f64());
        println!(
            "| configuration | goodput | deadline hit rate | score | p99 / unloaded | settle | detail |"
        );
        println!("|---|---|---|---|---|---|---|");
        for &config in &configs {
            let result = runtime.block_on(run(scenario, config, length, &options));
            write_csv(&csv, scenario, config, &result);
            let s = score(scenario, length, &result, config == Config::Adaptive);
            println!(
                "| {} | {:.3} | {:.3} | {:.3} | {:.1} | {} | {} |",
                config.name(),
                s.goodput,
                s.hit_rate,
                s.value(),
                s.p99,
                s.settle
                    .map_or_else(|| "-".to_owned(), |d| format!("{:.1} s", d.as_secs_f64())),
                s.detail
            );
            scores.push((config, s));
        }
        summary.push((scenario, scores));
    }
    let get = |scenario: Scenario, config: Config| -> Score {
        summary
            .iter()
            .find(|(s, _)| *s == scenario)
            .and_then(|(_, scores)| scores.iter().find(|(c, _)| *c == config))
            .map(|(_, s)| s.clone())
            .unwrap_or_default()
    };
    if !configs.contains(&Config::Adaptive) {
        // The last lines are tollgate's adaptive limit's numbers.
        return;
    }
    let step = get(Scenario::Step, Config::Adaptive);
    let vs_best_peer_min = summary
        .iter()
        .map(|(scenario, scores)| {
            let ours = get(*scenario, Config::Adaptive).value();
            let best = scores
                .iter()
                .filter(|(c, _)| !matches!(c, Config::Adaptive | Config::Oracle))
                .map(|(_, s)| s.value())
                .fold(0.0f64, f64::max);
            if best > 0.0 {
                ours / best
            } else {
                f64::INFINITY
            }
        })
        .fold(f64::MAX, f64::min);
    println!();
    println!(
        "step_settle_max {:.1}",
        step.settle.unwrap_or_default().as_secs_f64()
    );
    println!("step_goodput_min {:.3}", step.goodput);
    println!("step_p99_vs_unloaded_max {:.2}", step.p99);
    println!(
        "noisy_worst_tenant {:.3}",
        get(Scenario::Noisy, Config::Adaptive).goodput
    );
    println!(
        "priority_interactive {:.3}",
        get(Scenario::Priority, Config::Adaptive).goodput
    );
    println!("vs_best_peer_min {vs_best_peer_min:.3}");
}
