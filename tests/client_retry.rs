//! The field notes' `retry_check.py`, ported exactly, plus the retry policy
//! driven through tower against the quickstart.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::routing::get;
use common::{ip, quickstart, send};
use tollgate::client::{Attempt, Jitter, RetryConfig, RetryPolicy, Sleep, retry_after};

/// 2026-09-08 12:00:00 UTC, the fixture's reference time.
const REFERENCE: u64 = 1_788_868_800;

fn wall() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(REFERENCE)
}

fn delay(value: &str, received: SystemTime) -> Option<Duration> {
    retry_after(value.as_bytes(), received).ok()
}

/// The seed's `retry_at`: planned monotonic time, or `None`.
#[allow(clippy::too_many_arguments)]
fn retry_at(
    status: u16,
    method: &str,
    value: Option<&str>,
    received: SystemTime,
    monotonic_now: Duration,
    remaining: Duration,
    attempt: u32,
    jitter: Duration,
) -> Option<Duration> {
    let value = value.map(|v| HeaderValue::from_str(v).unwrap());
    let method: Method = method.parse().unwrap();
    let wait = RetryConfig::new().retry_wait(&Attempt {
        status: StatusCode::from_u16(status).unwrap(),
        method: &method,
        request_headers: &HeaderMap::new(),
        retry_after: value.as_ref(),
        received,
        attempt,
        remaining,
        jitter,
    })?;
    Some(monotonic_now + wait)
}

const J: Duration = Duration::from_millis(250);
const NOW: Duration = Duration::from_secs(100);
const TEN: Duration = Duration::from_secs(10);

#[test]
fn both_delay_forms_obsolete_dates_year_rule_and_invalid_values() {
    for value in [
        "Tue, 08 Sep 2026 12:00:07 GMT",
        "Tuesday, 08-Sep-26 12:00:07 GMT",
        "Tue Sep 8 12:00:07 2026",
    ] {
        assert_eq!(
            delay(value, wall()),
            Some(Duration::from_secs(7)),
            "{value}"
        );
    }
    assert_eq!(
        delay("Sunday, 06-Nov-94 08:49:37 GMT", wall()),
        Some(Duration::ZERO)
    );
    let y2070 = 3_177_403_200u64; // 2070-09-08 12:00:00 UTC
    assert_eq!(
        delay("Monday, 08-Sep-70 12:00:00 GMT", wall()),
        Some(Duration::from_secs(y2070 - REFERENCE))
    );
    // A leap second: 23:59:60 is one second after 23:59:59.
    let before_leap = UNIX_EPOCH + Duration::from_secs(1_483_228_799);
    assert_eq!(
        delay("Sat, 31 Dec 2016 23:59:60 GMT", before_leap),
        Some(Duration::from_secs(1))
    );
    for invalid in [
        "-1",
        "1.5",
        "later",
        "",
        "٣",
        "Tue, 31 Feb 2026 12:00:00 GMT",
    ] {
        assert_eq!(delay(invalid, wall()), None, "{invalid:?}");
    }
    assert_eq!(delay(" 0003\t", wall()), Some(Duration::from_secs(3)));
}

#[test]
fn oversized_wait_exhausted_deadline_post_and_attempt_cap_stop() {
    let huge = "9".repeat(5000);
    assert_eq!(delay(&huge, wall()), Some(Duration::MAX));
    assert_eq!(
        retry_at(503, "GET", Some(&huge), wall(), NOW, TEN, 1, J),
        None
    );
    assert_eq!(
        retry_at(
            503,
            "GET",
            Some("3"),
            wall(),
            NOW,
            Duration::from_secs(2),
            1,
            J
        ),
        None
    );
    assert_eq!(
        retry_at(503, "POST", Some("3"), wall(), NOW, TEN, 1, J),
        None
    );
    assert_eq!(
        retry_at(503, "GET", Some("3"), wall(), NOW, TEN, 3, J),
        None
    );
    // POST is replayed only by explicit opt-in.
    let mut headers = HeaderMap::new();
    headers.insert("idempotency-key", HeaderValue::from_static("k-1"));
    let opted = RetryConfig::new()
        .retry_with_idempotency_key(http::HeaderName::from_static("idempotency-key"));
    fn attempt(h: &HeaderMap) -> Attempt<'_> {
        Attempt {
            status: StatusCode::SERVICE_UNAVAILABLE,
            method: &Method::POST,
            request_headers: h,
            retry_after: None,
            received: wall(),
            attempt: 1,
            remaining: TEN,
            jitter: Duration::ZERO,
        }
    }
    assert_eq!(
        opted.retry_wait(&attempt(&headers)),
        Some(Duration::from_secs(1))
    );
    assert_eq!(opted.retry_wait(&attempt(&HeaderMap::new())), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn loopback_server_plans_match_the_fixture() {
    let visited: Arc<Mutex<Vec<String>>> = Arc::default();
    let imf_plus_7 = "Tue, 08 Sep 2026 12:00:07 GMT";
    let route = |status: u16,
                 value: Option<&'static str>,
                 visited: Arc<Mutex<Vec<String>>>,
                 path: &'static str| {
        get(move || {
            let visited = visited.clone();
            async move {
                visited.lock().unwrap().push(path.to_owned());
                let mut headers = HeaderMap::new();
                headers.insert(
                    "date",
                    HeaderValue::from_static("Tue, 08 Sep 2026 12:00:00 GMT"),
                );
                if let Some(v) = value {
                    headers.insert("retry-after", HeaderValue::from_static(v));
                }
                if status == 307 {
                    headers.insert("location", HeaderValue::from_static("/ready"));
                }
                (StatusCode::from_u16(status).unwrap(), headers)
            }
        })
    };
    let app = Router::new()
        .route(
            "/seconds",
            route(429, Some("3"), visited.clone(), "/seconds"),
        )
        .route(
            "/date",
            route(503, Some(imf_plus_7), visited.clone(), "/date"),
        )
        .route(
            "/invalid",
            route(503, Some("later"), visited.clone(), "/invalid"),
        )
        .route("/missing", route(503, None, visited.clone(), "/missing"))
        .route(
            "/redirect",
            route(307, Some("3"), visited.clone(), "/redirect"),
        )
        .route("/ready", route(200, None, visited.clone(), "/ready"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let expected = [
        ("/seconds", Some(Duration::from_millis(103_250))),
        ("/date", Some(Duration::from_millis(107_250))),
        ("/invalid", Some(Duration::from_millis(101_250))),
        ("/missing", Some(Duration::from_millis(101_250))),
        ("/redirect", None),
    ];
    for (path, planned) in expected {
        let r = send(addr, ip("127.0.0.1"), "GET", path, &[], b"").await;
        let got = retry_at(
            r.status.as_u16(),
            "GET",
            r.header("retry-after"),
            wall(),
            NOW,
            TEN,
            1,
            J,
        );
        assert_eq!(got, planned, "{path}");
    }
    assert!(
        !visited.lock().unwrap().contains(&"/ready".to_owned()),
        "redirect must not be followed"
    );
    server.abort();
}

#[test]
fn identical_delays_synchronise_and_jitter_spreads_them() {
    let same: Vec<_> = (0..4)
        .map(|_| retry_at(429, "GET", Some("3"), wall(), NOW, TEN, 1, Duration::ZERO))
        .collect();
    assert_eq!(same, vec![Some(Duration::from_secs(103)); 4]);
    let spread: Vec<Duration> = [100, 200, 300, 400]
        .into_iter()
        .map(|ms| {
            retry_at(
                429,
                "GET",
                Some("3"),
                wall(),
                NOW,
                TEN,
                1,
                Duration::from_millis(ms),
            )
            .unwrap()
        })
        .collect();
    let distinct: std::collections::BTreeSet<_> = spread.iter().collect();
    assert_eq!(distinct.len(), 4);
    assert!(spread.iter().all(|p| *p > Duration::from_secs(103)));
}

/// Records every planned wait, then really sleeps it.
#[derive(Clone, Default)]
struct RecordingSleep(Arc<Mutex<Vec<Duration>>>);

impl Sleep for RecordingSleep {
    fn sleep(
        &self,
        d: Duration,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        self.0.lock().unwrap().push(d);
        Box::pin(tokio::time::sleep(d))
    }
}

struct NoJitter;
impl Jitter for NoJitter {
    fn jitter(&self, _max: Duration) -> Duration {
        Duration::ZERO
    }
}

fn client_from(
    from: std::net::IpAddr,
) -> hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    http_body_util::Empty<bytes::Bytes>,
> {
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_local_address(Some(from));
    hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(connector)
}

#[tokio::test(flavor = "multi_thread")]
async fn retries_no_earlier_than_retry_after_and_stops_at_the_deadline() {
    use tower::{Service, ServiceExt};
    let q = quickstart(&[]);
    let from = ip("127.0.20.1");
    for _ in 0..5 {
        assert_eq!(
            send(q.addr, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
    }
    let uri: http::Uri = format!("http://{}/", q.addr).parse().unwrap();
    let request = || {
        http::Request::get(uri.clone())
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };

    // Counts attempts on the wire.
    let attempts = Arc::new(Mutex::new(
        Vec::<(Instant, StatusCode, Option<String>)>::new(),
    ));
    let counted = {
        let attempts = attempts.clone();
        let client = client_from(from);
        tower::service_fn(move |req| {
            let (client, attempts) = (client.clone(), attempts.clone());
            async move {
                let res = client.request(req).await?;
                let ra = res
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                attempts
                    .lock()
                    .unwrap()
                    .push((Instant::now(), res.status(), ra));
                Ok::<_, hyper_util::client::legacy::Error>(res)
            }
        })
    };
    let sleeps = RecordingSleep::default();
    let policy = RetryPolicy::new(RetryConfig::new().deadline(Duration::from_secs(10)))
        .with_jitter(NoJitter)
        .with_sleep(sleeps.clone());
    let mut svc = tower::retry::Retry::new(policy, counted.clone());
    let started = Instant::now();
    let res = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(
        res.status(),
        StatusCode::OK,
        "the retry after the wait is admitted"
    );
    let log = attempts.lock().unwrap().clone();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(log[0].1, StatusCode::TOO_MANY_REQUESTS);
    let asked = Duration::from_secs(log[0].2.as_deref().unwrap().parse().unwrap());
    assert!(asked >= Duration::from_secs(1));
    let waited = sleeps.0.lock().unwrap().clone();
    assert_eq!(waited.len(), 1);
    assert!(
        waited[0] >= asked,
        "planned {:?} < Retry-After {asked:?}",
        waited[0]
    );
    assert!(
        log[1].0 - log[0].0 >= asked,
        "second attempt came too early"
    );
    assert!(started.elapsed() < Duration::from_secs(10));

    // Exhaust again; now a deadline shorter than Retry-After ends retrying
    // at once with the 429 itself.
    attempts.lock().unwrap().clear();
    for _ in 0..5 {
        let _ = send(q.addr, from, "GET", "/", &[], b"").await;
    }
    let short = RetryPolicy::new(RetryConfig::new().deadline(Duration::from_millis(500)))
        .with_jitter(NoJitter)
        .with_sleep(sleeps.clone());
    let mut svc = tower::retry::Retry::new(short, counted);
    let started = Instant::now();
    let res = svc.ready().await.unwrap().call(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(attempts.lock().unwrap().len(), 1);
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(
        sleeps.0.lock().unwrap().len(),
        1,
        "no further wait was planned"
    );
}

#[tokio::test]
async fn an_empty_retry_budget_stops_retries() {
    use tower::retry::Policy;
    use tower::retry::budget::TpsBudget;
    // No reserve and no share of requests for retries: nothing to withdraw.
    let budget = Arc::new(TpsBudget::new(Duration::from_secs(10), 0, 0.0));
    let mut policy = RetryPolicy::new(RetryConfig::new())
        .with_jitter(NoJitter)
        .with_budget(budget);
    let mut req = http::Request::get("http://x/").body(()).unwrap();
    let mut first = policy.clone();
    let _ = Policy::<_, http::Response<()>, ()>::clone_request(&mut first, &req);
    let mut throttled: Result<http::Response<()>, ()> =
        Ok(http::Response::builder().status(429).body(()).unwrap());
    assert!(
        Policy::retry(&mut first, &mut req, &mut throttled).is_none(),
        "budget is empty"
    );
    // With a budget that allows retries, the same response is retried.
    let generous = Arc::new(TpsBudget::new(Duration::from_secs(10), 10, 1.0));
    policy = RetryPolicy::new(RetryConfig::new())
        .with_jitter(NoJitter)
        .with_budget(generous);
    let _ = Policy::<_, http::Response<()>, ()>::clone_request(&mut policy, &req);
    assert!(Policy::retry(&mut policy, &mut req, &mut throttled).is_some());
}

/// Audit finding 1: tower 0.5 calls `clone_request` on the service's own
/// policy before copying it into the response future, so the start time
/// was set once per service: 20 s after the first request (deadline 10 s),
/// a second request on the same service was never retried, and a retry
/// budget was deposited into once per service instead of once per request.
#[tokio::test]
async fn a_reused_retry_service_retries_every_request_afresh() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tollgate::store::ManualClock;
    use tower::{Service, ServiceExt};

    /// Sleeps by moving the manual clock.
    #[derive(Clone)]
    struct ClockSleep(ManualClock);
    impl Sleep for ClockSleep {
        fn sleep(
            &self,
            d: Duration,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
            self.0.advance(d);
            Box::pin(std::future::ready(()))
        }
    }

    #[derive(Default)]
    struct Deposits(AtomicUsize);
    impl tower::retry::budget::Budget for Deposits {
        fn deposit(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn withdraw(&self) -> bool {
            true
        }
    }

    let clock = ManualClock::new(0);
    let attempts = Arc::new(AtomicUsize::new(0));
    let throttled = {
        let attempts = attempts.clone();
        tower::service_fn(move |_req: http::Request<()>| {
            attempts.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder()
                        .status(429)
                        .header("retry-after", "1")
                        .body(())
                        .unwrap(),
                )
            }
        })
    };
    let deposits = Arc::new(Deposits::default());
    let policy = RetryPolicy::new(RetryConfig::new().deadline(Duration::from_secs(10)))
        .with_clocks(clock.clone(), std::time::SystemTime::now)
        .with_jitter(NoJitter)
        .with_sleep(ClockSleep(clock.clone()))
        .with_budget(deposits.clone());
    let mut svc = tower::retry::Retry::new(policy, throttled);
    for round in 0..3 {
        attempts.store(0, Ordering::SeqCst);
        let req = http::Request::get("http://x/").body(()).unwrap();
        let res = svc.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(attempts.load(Ordering::SeqCst), 3, "round {round}");
        clock.advance(Duration::from_secs(20));
    }
    assert_eq!(
        deposits.0.load(Ordering::SeqCst),
        3,
        "one deposit per request"
    );
}

/// Found in review: the first-sent mark of an outer retry layer reached an
/// inner one on a retry, which took the outer's start time (and skipped its
/// budget deposit) as if the request were its own.
#[tokio::test]
async fn nested_retry_layers_each_see_a_new_request() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tollgate::store::ManualClock;
    use tower::{Service, ServiceExt};

    #[derive(Clone)]
    struct ClockSleep(ManualClock);
    impl Sleep for ClockSleep {
        fn sleep(
            &self,
            d: Duration,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
            self.0.advance(d);
            Box::pin(std::future::ready(()))
        }
    }
    #[derive(Default)]
    struct Deposits(AtomicUsize);
    impl tower::retry::budget::Budget for Deposits {
        fn deposit(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn withdraw(&self) -> bool {
            true
        }
    }

    let clock = ManualClock::new(0);
    let calls = Arc::new(AtomicUsize::new(0));
    let unavailable = {
        let calls = calls.clone();
        tower::service_fn(move |_req: http::Request<()>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async {
                Ok::<_, std::convert::Infallible>(
                    http::Response::builder().status(503).body(()).unwrap(),
                )
            }
        })
    };
    let deposits = Arc::new(Deposits::default());
    let inner = RetryPolicy::new(
        RetryConfig::new()
            .max_attempts(2)
            .deadline(Duration::from_secs(5))
            .backoff(Duration::from_secs(1), Duration::from_secs(1)),
    )
    .with_clocks(clock.clone(), std::time::SystemTime::now)
    .with_jitter(NoJitter)
    .with_sleep(ClockSleep(clock.clone()))
    .with_budget(deposits.clone());
    let outer = RetryPolicy::new(
        RetryConfig::new()
            .max_attempts(2)
            .deadline(Duration::from_secs(100))
            .backoff(Duration::from_secs(10), Duration::from_secs(10)),
    )
    .with_clocks(clock.clone(), std::time::SystemTime::now)
    .with_jitter(NoJitter)
    .with_sleep(ClockSleep(clock.clone()));
    let mut svc = tower::retry::Retry::new(outer, tower::retry::Retry::new(inner, unavailable));
    let req = http::Request::get("http://x/").body(()).unwrap();
    let res = svc.ready().await.unwrap().call(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Two outer attempts, each retried once inside: four calls, two deposits.
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(deposits.0.load(Ordering::SeqCst), 2);
}
