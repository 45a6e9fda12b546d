//! A per-key adaptive limit through the concurrency layer, on tokio's
//! paused clock: two tenants whose backends differ (one slows down beyond
//! 4 requests in flight, the other never does) each find their own limit,
//! where one global adaptive limit (the control) holds both to the slow
//! one's; the refusal is a `429` that promises no number; a key that stops
//! sending keeps what it learned; the build refuses what cannot work.

use std::collections::HashMap;
use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tollgate::concurrency::{AdaptiveConfig, ConcurrencyLimit};
use tollgate::{ConcurrencyLimitLayer, KeyPart, Principal};
use tower::{Layer, ServiceExt};

const MS: Duration = Duration::from_millis(1);

type Backed =
    tower::util::BoxCloneSyncService<Request<Full<Bytes>>, Response<Full<Bytes>>, Infallible>;

/// Each tenant's backend: requests in it now, and the most seen at once
/// since `reset`.
#[derive(Default)]
struct Backends(Mutex<HashMap<String, (usize, usize)>>);

impl Backends {
    /// Enters `tenant`'s backend; returns how many are in it, this one
    /// counted.
    fn enter(&self, tenant: &str) -> usize {
        let mut map = self.0.lock().unwrap();
        let (now, most) = map.entry(tenant.to_owned()).or_default();
        *now += 1;
        *most = (*most).max(*now);
        *now
    }

    fn leave(&self, tenant: &str) {
        self.0.lock().unwrap().get_mut(tenant).unwrap().0 -= 1;
    }

    /// Requests in every tenant's backend now.
    fn total(&self) -> usize {
        self.0.lock().unwrap().values().map(|t| t.0).sum()
    }

    fn most(&self, tenant: &str) -> usize {
        self.0.lock().unwrap().get(tenant).map_or(0, |t| t.1)
    }

    fn reset(&self) {
        for (_, most) in self.0.lock().unwrap().values_mut() {
            *most = 0;
        }
    }
}

/// Tenant "slow": 10 ms alone, `10 ms × n / 4` with `n > 4` in it (its
/// database takes 4 at full speed). Tenant "fast": 10 ms however many.
/// Path `/long`: 1 s.
fn limited(layer: &ConcurrencyLimitLayer, backends: &Arc<Backends>) -> ConcurrencyLimit<Backed> {
    let backends = backends.clone();
    let inner = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let backends = backends.clone();
        async move {
            let tenant = req
                .extensions()
                .get::<Principal>()
                .map(|p| p.tenant().to_owned())
                .unwrap_or_default();
            let n = backends.enter(&tenant);
            let latency = if req.uri().path() == "/long" {
                Duration::from_secs(1)
            } else if tenant == "slow" {
                10 * MS * u32::try_from(n.max(4)).unwrap() / 4
            } else {
                10 * MS
            };
            tokio::time::sleep(latency).await;
            backends.leave(&tenant);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        }
    });
    layer.layer(tower::util::BoxCloneSyncService::new(inner))
}

fn request(tenant: &str) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(Bytes::new()));
    req.extensions_mut()
        .insert(Principal::new(tenant.to_owned(), "user"));
    req
}

/// `clients` closed-loop clients of `tenant` until `until`; a refused
/// one tries again 2 ms later. Returns the statuses of the refusals seen.
fn load(
    svc: &ConcurrencyLimit<Backed>,
    tenant: &'static str,
    clients: usize,
    until: Instant,
) -> Vec<tokio::task::JoinHandle<Vec<StatusCode>>> {
    (0..clients)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let mut refusals = Vec::new();
                while Instant::now() < until {
                    let response = svc.clone().oneshot(request(tenant)).await.unwrap();
                    if response.status() == StatusCode::OK {
                        response.into_body().collect().await.unwrap();
                    } else {
                        refusals.push(response.status());
                        tokio::time::sleep(2 * MS).await;
                    }
                }
                refusals
            })
        })
        .collect()
}

/// Runs 32 clients of each tenant for 12 s; returns the most each tenant
/// had in its backend at once over the last 4 s, and every refusal's
/// status.
async fn run(layer: &ConcurrencyLimitLayer) -> (usize, usize, Vec<StatusCode>) {
    let backends = Arc::new(Backends::default());
    let svc = limited(layer, &backends);
    let until = Instant::now() + Duration::from_secs(12);
    let mut tasks = load(&svc, "slow", 32, until);
    tasks.extend(load(&svc, "fast", 32, until));
    tokio::time::sleep(Duration::from_secs(8)).await;
    backends.reset();
    let mut refusals = Vec::new();
    for task in tasks {
        refusals.extend(task.await.unwrap());
    }
    (backends.most("slow"), backends.most("fast"), refusals)
}

fn config() -> AdaptiveConfig {
    AdaptiveConfig::builder().bounds(1, 64).build().unwrap()
}

#[tokio::test(start_paused = true)]
async fn each_key_finds_its_own_limit_where_a_global_one_holds_all_to_the_slowest() {
    let per_key = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(config(), [KeyPart::Tenant])
        .build()
        .unwrap();
    let (slow, fast, refusals) = run(&per_key).await;
    assert!(
        (2..=12).contains(&slow),
        "the slow tenant's database takes 4 at full speed: {slow} at once"
    );
    assert!(
        fast >= 28,
        "the fast tenant never slows down, and its 32 clients were held to {fast}"
    );
    assert!(
        !refusals.is_empty(),
        "the slow tenant's clients were refused"
    );
    assert!(
        refusals.iter().all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "per-key refusals are 429: {refusals:?}"
    );

    // The control: one adaptive limit for both sees the slow tenant's
    // latency in its windows and holds both tenants together to far less
    // than the fast one alone takes with a limit of its own.
    let global = ConcurrencyLimitLayer::builder("shards")
        .adaptive(config())
        .build()
        .unwrap();
    let (slow_global, fast_global, _) = run(&global).await;
    assert!(
        slow_global + fast_global < 20,
        "a global adaptive limit let {slow_global} + {fast_global} in at once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refusal_is_a_429_that_promises_no_number_and_keys_do_not_share_a_limit() {
    // Bounds 2..2: every key's limit is 2.
    let layer = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(
            AdaptiveConfig::builder().bounds(2, 2).build().unwrap(),
            [KeyPart::Tenant],
        )
        .build()
        .unwrap();
    let backends = Arc::new(Backends::default());
    let svc = limited(&layer, &backends);
    let calls: Vec<_> = (0..3)
        .map(|_| tokio::spawn(svc.clone().oneshot(request("slow"))))
        .chain([tokio::spawn(svc.clone().oneshot(request("fast")))])
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap().unwrap());
    }
    let statuses: Vec<_> = answers.iter().map(Response::status).collect();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::OK
        ],
        "two of slow's, and fast's own"
    );
    let refused = answers.swap_remove(2);
    assert!(refused.headers().get("retry-after").is_none());
    assert!(refused.headers().get("ratelimit-policy").is_none());
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("in flight"), "{body}");
}

#[test]
fn the_build_refuses_what_cannot_work() {
    let both = ConcurrencyLimitLayer::builder("shards")
        .per_key(NonZeroUsize::new(4).unwrap(), [KeyPart::Tenant])
        .per_key_adaptive(config(), [KeyPart::Tenant])
        .build()
        .unwrap_err();
    assert!(
        both.to_string()
            .contains("both a fixed per-key limit and an adaptive one"),
        "{both}"
    );
    let dry = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(config(), [KeyPart::Tenant])
        .dry_run(true)
        .build()
        .unwrap_err();
    assert!(dry.to_string().contains("cannot be dry-run"), "{dry}");
    // Alone, and beside a global limit, it is a bound.
    for global in [None, Some(NonZeroUsize::new(64).unwrap())] {
        let mut builder =
            ConcurrencyLimitLayer::builder("shards").per_key_adaptive(config(), [KeyPart::Tenant]);
        if let Some(max) = global {
            builder = builder.global(max);
        }
        let _ = builder.build().unwrap();
    }
}

/// With a line and exemptions: a key's waiter takes its key's freed slot,
/// a key has no more waiters than its limit (the next is refused at once),
/// another key is neither held by the first one's limit nor by its line,
/// and an exempt request is neither counted nor refused.
#[tokio::test(start_paused = true)]
async fn a_keys_line_and_exemptions_compose_with_its_adaptive_limit() {
    let layer = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(
            AdaptiveConfig::builder().bounds(2, 2).build().unwrap(),
            [KeyPart::Tenant],
        )
        .wait(16, Duration::from_secs(1))
        .exempt(tollgate::Exemption::when(|req| req.uri.path() == "/health"))
        .build()
        .unwrap();
    let backends = Arc::new(Backends::default());
    let svc = limited(&layer, &backends);
    let send = |req| spawn_send(&svc, req);
    let start = Instant::now();
    // Five of "slow" at once: two in flight, two waiting, one refused.
    let slow: Vec<_> = (0..5).map(|_| send(request("slow"))).collect();
    tokio::task::yield_now().await;
    let fast = send(request("fast"));
    let mut health = request("slow");
    *health.uri_mut() = "/health".parse().unwrap();
    let health = send(health);
    let mut answers = Vec::new();
    for call in slow {
        answers.push(call.await.unwrap());
    }
    let statuses: Vec<_> = answers.iter().map(|a| a.0).collect();
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
    // The waiters went in when the first two ended, 10 ms in (the backend
    // never held more than 4: 10 ms each), and ended at 20 ms.
    assert_eq!(answers[2].1 - start, 20 * MS, "{answers:?}");
    assert_eq!(answers[4].1 - start, Duration::ZERO, "refused at once");
    let (fast, fast_done) = fast.await.unwrap();
    assert_eq!((fast, fast_done - start), (StatusCode::OK, 10 * MS));
    let (health, _) = health.await.unwrap();
    assert_eq!(
        health,
        StatusCode::OK,
        "exempt: neither counted nor refused"
    );
    assert_eq!(backends.most("slow"), 3, "two counted, and the exempt one");
    assert_eq!(layer.stats().in_flight, 0);
}

/// Sends `req` in a task of its own; its status and when its body ended.
fn spawn_send(
    svc: &ConcurrencyLimit<Backed>,
    req: Request<Full<Bytes>>,
) -> tokio::task::JoinHandle<(StatusCode, Instant)> {
    let svc = svc.clone();
    tokio::spawn(async move {
        let response = svc.oneshot(req).await.unwrap();
        let status = response.status();
        response.into_body().collect().await.unwrap();
        (status, Instant::now())
    })
}

fn long(tenant: &str) -> Request<Full<Bytes>> {
    let mut req = request(tenant);
    *req.uri_mut() = "/long".parse().unwrap();
    req
}

/// Found in review: a key's limit that grew as one of its requests
/// arrived (its probe ended) gave the newcomer a slot while the key's
/// waiters sat in the line until a request of the key ended.
#[tokio::test(start_paused = true)]
async fn a_keys_waiters_take_the_room_its_grown_limit_makes_before_a_newcomer() {
    let layer = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(
            AdaptiveConfig::builder()
                .bounds(1, 64)
                .probe_samples(1)
                .build()
                .unwrap(),
            [KeyPart::Tenant],
        )
        .wait(16, Duration::from_secs(5))
        .build()
        .unwrap();
    let backends = Arc::new(Backends::default());
    let svc = limited(&layer, &backends);
    let send = |req| spawn_send(&svc, req);
    let start = Instant::now();
    // The probe holds the key at 3: one short request measures the floor,
    // three long ones hold the slots, two short ones wait.
    let _held = [send(request("a")), send(long("a")), send(long("a"))];
    tokio::time::sleep(20 * MS).await;
    let _third = send(long("a"));
    tokio::time::sleep(10 * MS).await;
    let waiters = [send(request("a")), send(request("a"))];
    // The probe may end once a window has passed: the next arrival's tick
    // ends it, and the limit grows to the initial 20.
    tokio::time::sleep(120 * MS).await;
    let newcomer = send(request("a"));
    for waiter in waiters {
        let (status, done) = waiter.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(done - start, 160 * MS, "served when the limit grew");
    }
    let (status, done) = newcomer.await.unwrap();
    assert_eq!((status, done - start), (StatusCode::OK, 160 * MS));
}

/// Fair share of a global limit beside per-key adaptive limits: a tenant
/// held back by its own key's limit keeps few global slots idle for the
/// demand it remembers (at most a second or two old), while another
/// tenant wants them. (In review, with another harness, 1.5 of 16 sat
/// idle; here about 0.6, with or without the two fixes tried for it: the
/// slow tenant's remembered demand is above what its key's limit, which
/// moves, allows now.)
#[tokio::test(start_paused = true)]
async fn a_tenant_its_own_key_limit_holds_back_keeps_no_global_slot_idle() {
    let layer = ConcurrencyLimitLayer::builder("shards")
        .per_key_adaptive(config(), [KeyPart::Tenant])
        .global(NonZeroUsize::new(16).unwrap())
        .fair_share([KeyPart::Tenant])
        .build()
        .unwrap();
    let backends = Arc::new(Backends::default());
    let svc = limited(&layer, &backends);
    let until = Instant::now() + Duration::from_secs(10);
    let mut tasks = load(&svc, "slow", 32, until);
    tasks.extend(load(&svc, "fast", 32, until));
    tokio::time::sleep(Duration::from_secs(6)).await;
    // The mean in the backends over the last 4 s, every 5 ms.
    let (mut sum, mut samples) = (0, 0);
    while Instant::now() + 5 * MS < until {
        tokio::time::sleep(5 * MS).await;
        sum += backends.total();
        samples += 1;
    }
    for task in tasks {
        task.await.unwrap();
    }
    // 16 slots, both tenants always asking: the slow one holds what its
    // key limit allows, the fast one the rest.
    assert!(
        sum * 100 >= samples * 16 * 95,
        "{} of 16 slots in use on average",
        sum as f64 / samples as f64
    );
}
