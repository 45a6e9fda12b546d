//! One vocabulary for both layers: exemptions, the application's refusal
//! bodies, the `WWW-Authenticate` challenge and dry-run work the same way
//! on `RateLimitLayer` and `ConcurrencyLimitLayer`, each checked on each
//! layer over a real socket. (Refusal logging on both layers:
//! `tests/operator_logs.rs`.)

mod common;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use common::{ip, send, serve};
use http::{HeaderValue, StatusCode};
use tokio::sync::Semaphore;
use tollgate::{
    ConcurrencyLimitLayer, Exemption, KeyPart, MemoryStore, Policy, Rate, RateLimitLayer,
    RefusalBody, RefusalInfo, Rule, concurrency::ConcurrencyLimitBuilder,
    rate_limit::RateLimitBuilder,
};

const CHALLENGE: &str = "Bearer realm=\"api\"";

/// The application's one error format, for both layers.
fn envelope(refusal: &RefusalInfo<'_>) -> RefusalBody {
    RefusalBody::json(format!(
        r#"{{"error":{{"status":{},"policy":"{}"}}}}"#,
        refusal.status().as_u16(),
        refusal.policy().unwrap_or("")
    ))
}

/// A rate limit of one request an hour per address (per account on
/// `/private`), with `edit` applied.
fn rate_limited(
    edit: impl FnOnce(RateLimitBuilder<MemoryStore>) -> RateLimitBuilder<MemoryStore>,
) -> Router {
    let hourly = |name| Policy::token_bucket(name, 1, Rate::per_hour(1)).unwrap();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(hourly("hourly")).on_route("/"))
        .rule(Rule::per_account(hourly("private")).on_route("/private"));
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "metrics" }))
        .route("/private", get(|| async { "ok" }))
        .layer(edit(layer).build().unwrap())
}

/// One request in flight in all: `/hold` waits for a permit of `gate`;
/// with `edit` applied.
fn in_flight(
    gate: Arc<Semaphore>,
    edit: impl FnOnce(ConcurrencyLimitBuilder) -> ConcurrencyLimitBuilder,
) -> (Router, ConcurrencyLimitLayer) {
    let limit =
        edit(ConcurrencyLimitLayer::builder("one-at-a-time").global(NonZeroUsize::new(1).unwrap()))
            .build()
            .unwrap();
    let app = Router::new()
        .route(
            "/hold",
            get(move || async move {
                let _permit = gate.acquire().await.unwrap();
                "held"
            }),
        )
        .route("/", get(|| async { "ok" }))
        .route("/metrics", get(|| async { "metrics" }))
        .layer(limit.clone());
    (app, limit)
}

/// Holds `/hold` in flight until `gate` opens; returns once it counts.
async fn hold(
    addr: SocketAddr,
    limit: &ConcurrencyLimitLayer,
) -> tokio::task::JoinHandle<StatusCode> {
    let held = tokio::spawn(async move {
        send(addr, ip("127.0.90.1"), "GET", "/hold", &[], b"")
            .await
            .status
    });
    while limit.stats().in_flight == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    held
}

#[tokio::test(flavor = "multi_thread")]
async fn exempt_on_the_rate_limit_layer() {
    let app = rate_limited(|l| l.exempt(Exemption::when(|req| req.uri.path() == "/metrics")));
    let addr = serve(app).await;
    let from = ip("127.0.90.2");
    assert_eq!(
        send(addr, from, "GET", "/", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(addr, from, "GET", "/", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    for _ in 0..3 {
        assert_eq!(
            send(addr, from, "GET", "/metrics", &[], b"").await.status,
            StatusCode::OK
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn exempt_on_the_concurrency_layer() {
    let gate = Arc::new(Semaphore::new(0));
    let (app, limit) = in_flight(gate.clone(), |l| {
        l.exempt(Exemption::when(|req| req.uri.path() == "/metrics"))
    });
    let addr = serve(app).await;
    let held = hold(addr, &limit).await;
    let from = ip("127.0.90.3");
    assert_eq!(
        send(addr, from, "GET", "/", &[], b"").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    for _ in 0..3 {
        assert_eq!(
            send(addr, from, "GET", "/metrics", &[], b"").await.status,
            StatusCode::OK
        );
    }
    // Exempt requests were never counted.
    assert_eq!(limit.stats().in_flight, 1);
    gate.add_permits(1);
    assert_eq!(held.await.unwrap(), StatusCode::OK);
}

/// The same body function on both layers: the application's JSON, with
/// tollgate's status and headers.
#[tokio::test(flavor = "multi_thread")]
async fn one_refusal_body_for_both_layers() {
    let addr = serve(rate_limited(|l| l.refusal_body(envelope))).await;
    let from = ip("127.0.90.4");
    send(addr, from, "GET", "/", &[], b"").await;
    let r = send(addr, from, "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.body, r#"{"error":{"status":429,"policy":"hourly"}}"#);
    assert!(r.header("retry-after").is_some());

    let gate = Arc::new(Semaphore::new(0));
    let (app, limit) = in_flight(gate.clone(), |l| l.refusal_body(envelope));
    let addr = serve(app).await;
    let held = hold(addr, &limit).await;
    let r = send(addr, from, "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.body,
        r#"{"error":{"status":503,"policy":"one-at-a-time"}}"#
    );
    assert_eq!(r.header("cache-control"), Some("no-store"));
    gate.add_permits(1);
    held.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn www_authenticate_on_the_rate_limit_layer() {
    let addr = serve(rate_limited(|l| {
        l.www_authenticate(HeaderValue::from_static(CHALLENGE))
    }))
    .await;
    let r = send(addr, ip("127.0.90.5"), "GET", "/private", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.header("www-authenticate"), Some(CHALLENGE));
}

#[tokio::test(flavor = "multi_thread")]
async fn www_authenticate_on_the_concurrency_layer() {
    let limit = ConcurrencyLimitLayer::builder("per-account")
        .per_key(NonZeroUsize::new(1).unwrap(), [KeyPart::Account])
        .www_authenticate(HeaderValue::from_static(CHALLENGE))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/private", get(|| async { "ok" }))
        .layer(limit);
    let addr = serve(app).await;
    let r = send(addr, ip("127.0.90.6"), "GET", "/private", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.header("www-authenticate"), Some(CHALLENGE));
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_on_the_rate_limit_layer() {
    let addr = serve(rate_limited(|l| l.dry_run(true))).await;
    let from = ip("127.0.90.7");
    for _ in 0..3 {
        let r = send(addr, from, "GET", "/", &[], b"").await;
        assert_eq!(r.status, StatusCode::OK);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_on_the_concurrency_layer() {
    let gate = Arc::new(Semaphore::new(0));
    let (app, limit) = in_flight(gate.clone(), |l| l.dry_run(true));
    let addr = serve(app).await;
    let held = hold(addr, &limit).await;
    for _ in 0..3 {
        let r = send(addr, ip("127.0.90.8"), "GET", "/", &[], b"").await;
        assert_eq!(r.status, StatusCode::OK);
    }
    // Nothing refused (would-be refusals are logged and counted in
    // `tollgate_dry_run_refused_total`, not as refusals).
    assert_eq!(limit.stats().refused_global, 0, "{:?}", limit.stats());
    gate.add_permits(1);
    held.await.unwrap();
}
