//! Rules for real deployments, over real sockets: exemptions (by network,
//! principal and request), dry-run rules mixed with enforced ones, and the
//! `WWW-Authenticate` challenge of a `401`.

mod common;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use common::{ip, param, send, serve, sf_list, test_auth};
use http::{HeaderValue, StatusCode};
use tollgate::{
    ClientIpResolver, Cost, Exemption, KeyPart, MemoryStore, Policy, Rate, RateLimitLayer, Rule,
    identity::ForwardedHeader,
    rate_limit::RateLimitBuilder,
    store::{Charge, Key, OnKeyCap},
};

fn bucket(name: &str, capacity: u64) -> Policy {
    Policy::token_bucket(name, capacity, Rate::per_hour(1)).unwrap()
}

async fn statuses(
    addr: std::net::SocketAddr,
    from: &str,
    path: &str,
    headers: &[(&str, &str)],
    n: usize,
) -> Vec<StatusCode> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(send(addr, ip(from), "GET", path, headers, b"").await.status);
    }
    out
}

const OK: StatusCode = StatusCode::OK;
const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

#[tokio::test(flavor = "multi_thread")]
async fn exempt_networks_are_checked_against_the_resolved_address() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .client_ip(
            ClientIpResolver::trusting(
                ["127.0.30.1/32".parse().unwrap()],
                ForwardedHeader::XForwardedFor,
            )
            .unwrap(),
        )
        .rule(Rule::per_client_ip(bucket("per-ip", 2)).exempt(
            // Written in IPv4-mapped form: the IPv4 network 127.0.31.0/24.
            Exemption::networks(["::ffff:127.0.31.0/120".parse().unwrap()]).unwrap(),
        ))
        .build()
        .unwrap();
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;

    // Inside the network: never limited.
    assert_eq!(statuses(addr, "127.0.31.7", "/", &[], 5).await, [OK; 5]);
    // Outside: limited.
    assert_eq!(
        statuses(addr, "127.0.32.7", "/", &[], 3).await,
        [OK, OK, LIMITED]
    );
    // An untrusted peer cannot claim an exempt address...
    let forged = [("X-Forwarded-For", "127.0.31.9")];
    assert_eq!(
        statuses(addr, "127.0.32.8", "/", &forged, 3).await,
        [OK, OK, LIMITED]
    );
    // ...but the trusted proxy's report is believed, both ways.
    assert_eq!(
        statuses(
            addr,
            "127.0.30.1",
            "/",
            &[("X-Forwarded-For", "127.0.31.9")],
            4
        )
        .await,
        [OK; 4]
    );
    assert_eq!(
        statuses(
            addr,
            "127.0.30.1",
            "/",
            &[("X-Forwarded-For", "198.51.100.4")],
            3
        )
        .await,
        [OK, OK, LIMITED]
    );
}

#[test]
fn a_mapped_exempt_network_shorter_than_96_is_refused() {
    let e = Exemption::networks(["::ffff:0.0.0.0/80".parse().unwrap()]).unwrap_err();
    assert!(e.to_string().contains("IPv4-mapped"), "{e}");
}

#[tokio::test(flavor = "multi_thread")]
async fn exempt_principals_skip_only_their_rule() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(bucket("per-ip", 4)))
        .rule(
            Rule::per_account(bucket("per-account", 1))
                .exempt(Exemption::principals(|p| p.tenant() == "internal")),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
        .layer(middleware::from_fn(test_auth));
    let addr = serve(app).await;
    let internal = [("X-Test-User", "internal/ops")];
    let customer = [("X-Test-User", "north/alice")];
    // The customer's account budget is 1.
    assert_eq!(
        statuses(addr, "127.0.33.1", "/", &customer, 2).await,
        [OK, LIMITED]
    );
    // The internal tenant skips the account rule, not the address rule (4).
    assert_eq!(
        statuses(addr, "127.0.33.2", "/", &internal, 5).await,
        [OK, OK, OK, OK, LIMITED]
    );
    // Without a principal the exemption does not apply: the account rule
    // needs one and answers 401.
    assert_eq!(
        statuses(addr, "127.0.33.3", "/", &[], 1).await,
        [StatusCode::UNAUTHORIZED]
    );
}

/// The health check of a fail-closed layer whose store is failing: one line
/// exempts it, and it is answered without a store call.
#[tokio::test(flavor = "multi_thread")]
async fn an_exempt_health_check_answers_while_the_store_fails() {
    let broken = MemoryStore::builder()
        .max_keys(1, OnKeyCap::RefuseNewKeys)
        .shards(1)
        .build();
    let occupied = Charge::new(Key::new("occupied"), bucket("x", 1), 1).unwrap();
    assert!(broken.charge_now(&[occupied]).unwrap().is_admitted());
    let layer = RateLimitLayer::builder(broken)
        .exempt(Exemption::when(|req| req.uri.path() == "/healthz"))
        .rule(Rule::per_client_ip(bucket("per-ip", 5)))
        .rule(Rule::per_account(bucket("per-account", 5)))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/healthz", get(|| async { "up" }))
        .layer(layer);
    let addr = serve(app).await;
    assert_eq!(
        statuses(addr, "127.0.34.1", "/", &[], 1).await,
        [StatusCode::SERVICE_UNAVAILABLE]
    );
    // No principal, no store: still 200, with no RateLimit fields.
    let r = send(addr, ip("127.0.34.1"), "GET", "/healthz", &[], b"").await;
    assert_eq!(r.status, OK);
    assert!(r.header("ratelimit").is_none());
    // The predicate sees the path, not the query: `/healthz?x` is exempt
    // too, `/healthzz` and `/healthz/` are not.
    for (path, status) in [
        ("/healthz?probe=1", OK),
        ("/healthzz", StatusCode::SERVICE_UNAVAILABLE),
        ("/healthz/", StatusCode::SERVICE_UNAVAILABLE),
    ] {
        assert_eq!(
            send(addr, ip("127.0.34.1"), "GET", path, &[], b"")
                .await
                .status,
            status,
            "{path}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn layer_wide_dry_run_refuses_nothing_and_shows_the_spent_budget() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .dry_run(true)
        .rule(Rule::per_client_ip(bucket("per-ip", 2)))
        .rule(
            Rule::per_client_ip(bucket("upload", 4))
                .on_route("/upload")
                .with_cost(Cost::content_kib()),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/upload", post(|| async { "stored" }))
        .layer(layer);
    let addr = serve(app).await;
    let mut remaining = Vec::new();
    for _ in 0..4 {
        let r = send(addr, ip("127.0.35.1"), "GET", "/", &[], b"").await;
        assert_eq!(r.status, OK);
        let fields = sf_list(&r.header_joined("ratelimit").unwrap());
        remaining.push(param(&fields[0], "r").unwrap());
    }
    assert_eq!(remaining, [1, 0, 0, 0]);
    // A cost that can never fit (8 KiB against 4) is about the request, not
    // the budget: refused as without dry-run (413), and charged to the
    // address rule (1 of its 2 spent).
    let big = vec![b'x'; 8 * 1024];
    let r = send(addr, ip("127.0.35.2"), "POST", "/upload", &[], &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    let fields = sf_list(&r.header_joined("ratelimit").unwrap());
    assert_eq!(param(&fields[0], "r"), Some(1));
}

/// Enforced and dry-run rules in one request: a dry-run limit that would
/// refuse is left out, one that would admit is charged with the enforced
/// ones, all-or-nothing, and a 429 comes only from enforced limits.
#[tokio::test(flavor = "multi_thread")]
async fn dry_run_and_enforced_rules_mix_all_or_nothing() {
    let store = Arc::new(MemoryStore::new());
    let enforced = bucket("enforced", 3);
    // Refills half as fast as the enforced rule: its wait would be 2 h.
    let trial = Policy::token_bucket(
        "trial",
        2,
        Rate::new(1, std::time::Duration::from_secs(7200)),
    )
    .unwrap();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::per_client_ip(enforced.clone()))
        .rule(Rule::per_client_ip(trial.clone()).dry_run(true))
        .build()
        .unwrap();
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let trial_left = || {
        let charge = Charge::new(Key::new("ip=127.0.36.1"), trial.clone(), 1).unwrap();
        store.describe(&[charge]).limits()[0].remaining()
    };
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = send(addr, ip("127.0.36.1"), "GET", "/", &[], b"").await;
        seen.push((
            r.status,
            trial_left(),
            r.header("retry-after").map(str::to_owned),
        ));
    }
    assert_eq!(
        seen,
        [
            (OK, 1, None),
            (OK, 0, None),
            // The trial budget is spent: it would refuse, and is left out.
            (OK, 0, None),
            // Now the enforced budget is spent: 429, with its own wait of
            // an hour (the trial's would be two).
            (LIMITED, 0, Some("3600".to_owned())),
        ]
    );

    // All-or-nothing: when an enforced limit refuses, a dry-run limit that
    // would admit is not charged.
    let small = bucket("small", 1);
    let roomy = bucket("roomy", 5);
    let store = Arc::new(MemoryStore::new());
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::per_client_ip(small))
        .rule(Rule::per_client_ip(roomy.clone()).dry_run(true))
        .build()
        .unwrap();
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    assert_eq!(
        statuses(addr, "127.0.36.2", "/", &[], 3).await,
        [OK, LIMITED, LIMITED]
    );
    let roomy_key = Charge::new(Key::new("ip=127.0.36.2"), roomy, 1).unwrap();
    assert_eq!(store.describe(&[roomy_key]).limits()[0].remaining(), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn dry_run_rules_still_refuse_requests_that_lack_what_they_need() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .dry_run(true)
        .rule(Rule::new(bucket("acct", 5)).keyed_by([KeyPart::Account]))
        .build()
        .unwrap();
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    let r = send(addr, ip("127.0.37.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_401_carries_a_configurable_challenge_and_grpc_gets_none() {
    let app = |layer: RateLimitBuilder<MemoryStore>| {
        Router::new()
            .route("/", get(|| async { "ok" }).post(|| async { "ok" }))
            .layer(
                layer
                    .rule(Rule::per_account(bucket("acct", 5)))
                    .build()
                    .unwrap(),
            )
    };
    let default = serve(app(RateLimitLayer::builder(MemoryStore::new()))).await;
    let r = send(default, ip("127.0.38.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));

    let custom = serve(app(RateLimitLayer::builder(MemoryStore::new())
        .www_authenticate(HeaderValue::from_static("Bearer realm=\"api\""))))
    .await;
    let r = send(custom, ip("127.0.38.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.header("www-authenticate"), Some("Bearer realm=\"api\""));

    let r = send(
        custom,
        ip("127.0.38.1"),
        "POST",
        "/",
        &[("Content-Type", "application/grpc")],
        b"",
    )
    .await;
    assert_eq!(r.header("grpc-status"), Some("16"));
    assert!(r.header("www-authenticate").is_none());
}

/// A policy the store cannot hold is a configuration error when the layer
/// is built, with the reason, not a `503` "store unavailable" at runtime.
#[tokio::test]
async fn a_policy_the_store_cannot_hold_is_refused_when_the_rule_is_added() {
    let redis = tollgate::RedisStore::builder("redis://127.0.0.1:1")
        .unwrap()
        .build()
        .unwrap();
    let month =
        Policy::fixed_window("monthly", 1000, std::time::Duration::from_secs(30 * 86_400)).unwrap();
    let huge = Policy::token_bucket("huge", 1 << 30, Rate::per_second(1)).unwrap();
    let fine = bucket("fine", 5);
    let dynamic: Arc<dyn tollgate::store::DynStore> = Arc::new(redis);
    for policy in [&month, &huge] {
        let e = RateLimitLayer::builder(dynamic.clone())
            .rule(Rule::per_client_ip(policy.clone()))
            .build()
            .unwrap_err();
        assert_eq!(e.policy(), policy.name());
        assert!(e.to_string().contains(policy.name()), "{e}");
    }
    assert!(
        RateLimitLayer::builder(dynamic.clone())
            .rule(Rule::per_client_ip(fine.clone()))
            .build()
            .is_ok()
    );
    // The store refused it, not the rule itself.
    let e = RateLimitLayer::builder(dynamic.clone())
        .rule(Rule::per_client_ip(huge.clone()))
        .build()
        .unwrap_err();
    assert!(e.is_unsupported_by_store(), "{e}");
    assert!(e.to_string().contains("huge"), "{e}");
    // A fallback store is held to the same, whichever is set first.
    let e = RateLimitLayer::builder(MemoryStore::new())
        .on_store_error(tollgate::OnStoreError::Fallback(dynamic.clone()))
        .rule(Rule::per_client_ip(huge.clone()))
        .build()
        .unwrap_err();
    assert_eq!(e.policy(), "huge");
    let e = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(huge.clone()))
        .on_store_error(tollgate::OnStoreError::Fallback(dynamic.clone()))
        .build()
        .unwrap_err();
    assert_eq!(e.policy(), "huge");
    // The in-memory store holds every valid policy.
    assert!(
        RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::per_client_ip(month))
            .build()
            .is_ok()
    );
}

/// Set by the application's own API-key middleware after verifying a key.
#[derive(Clone)]
struct ApiKeyId(String);

async fn api_key_auth(mut req: Request, next: Next) -> Response {
    let id = match req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        Some("secret-1") => Some("key-1"),
        Some("secret-2") => Some("key-2"),
        _ => None,
    };
    if let Some(id) = id {
        req.extensions_mut().insert(ApiKeyId(id.to_owned()));
    }
    next.run(req).await
}

#[tokio::test(flavor = "multi_thread")]
async fn custom_key_parts_from_a_trusted_extension_and_from_client_bytes() {
    let per_key = KeyPart::from_extension("api-key", |k: &ApiKeyId| k.0.clone()).unwrap();
    // Per tenant-chosen region header, *within* the client address: the
    // client picks the header, but not its address.
    let region = KeyPart::unverified("region", |p| {
        p.headers
            .get("x-region")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    })
    .unwrap();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new(bucket("per-api-key", 2))
                .on_route("/keyed")
                .keyed_by([per_key]),
        )
        .rule(
            Rule::new(bucket("per-region", 1))
                .on_route("/region")
                .keyed_by([KeyPart::ClientIp, region])
                .when_no_principal(tollgate::MissingPrincipal::Skip),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/keyed", get(|| async { "ok" }))
        .route("/region", get(|| async { "ok" }))
        .layer(layer)
        .layer(middleware::from_fn(api_key_auth));
    let addr = serve(app).await;
    let one = [("X-Api-Key", "secret-1")];
    let two = [("X-Api-Key", "secret-2")];
    // Each verified key has its own budget, whatever address it comes from.
    assert_eq!(
        statuses(addr, "127.0.39.1", "/keyed", &one, 2).await,
        [OK, OK]
    );
    assert_eq!(
        statuses(addr, "127.0.39.2", "/keyed", &one, 1).await,
        [LIMITED]
    );
    assert_eq!(
        statuses(addr, "127.0.39.2", "/keyed", &two, 3).await,
        [OK, OK, LIMITED]
    );
    // An unknown key carries no extension: 401 with the challenge.
    let r = send(
        addr,
        ip("127.0.39.3"),
        "GET",
        "/keyed",
        &[("X-Api-Key", "guess")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    // A client-chosen value splits only its own address's budget.
    let eu = [("X-Region", "eu")];
    let us = [("X-Region", "us")];
    assert_eq!(
        statuses(addr, "127.0.39.4", "/region", &eu, 2).await,
        [OK, LIMITED]
    );
    assert_eq!(
        statuses(addr, "127.0.39.4", "/region", &us, 2).await,
        [OK, LIMITED]
    );
    assert_eq!(statuses(addr, "127.0.39.5", "/region", &eu, 1).await, [OK]);
    // Without the header the rule is skipped, as configured.
    assert_eq!(
        statuses(addr, "127.0.39.4", "/region", &[], 3).await,
        [OK; 3]
    );
}

/// A unit follows its cost: a content or computed cost never reads as
/// "requests" in refusals or in `RateLimit-Policy`.
#[tokio::test(flavor = "multi_thread")]
async fn a_unit_follows_its_cost() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(bucket("kib", 2))
                .on_route("/upload")
                .with_cost(Cost::content_kib()),
        )
        .rule(
            Rule::per_client_ip(bucket("rows", 5))
                .on_route("/query")
                .with_cost(Cost::computed(tollgate::Unit::Other("rows".into()), |_| {
                    Ok(9)
                })),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/upload", post(|| async { "ok" }))
        .route("/query", get(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    let r = send(
        addr,
        ip("127.0.40.1"),
        "POST",
        "/upload",
        &[],
        &[b'x'; 4096],
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(r.body.contains("costs 4 content-kib"), "{}", r.body);
    let r = send(addr, ip("127.0.40.1"), "GET", "/query", &[], b"").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body.contains("costs 9 rows"), "{}", r.body);
    let r = send(addr, ip("127.0.40.2"), "POST", "/upload", &[], b"x").await;
    assert_eq!(r.status, OK);
    let policy = r.header_joined("ratelimit-policy").unwrap();
    assert!(policy.contains("qu=\"content-kib\""), "{policy}");
}

/// `/login`: 200 with a known key, 401 otherwise, after `delay`.
fn login_app<St: tollgate::Store>(layer: RateLimitLayer<St>, delay_ms: u64) -> Router {
    let login = move |req: Request| async move {
        tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
        match req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
        {
            Some("Bearer right") => StatusCode::OK,
            _ => StatusCode::UNAUTHORIZED,
        }
    };
    Router::new().route("/login", post(login)).layer(layer)
}

fn failures_rule() -> Rule {
    Rule::per_client_ip(bucket("login-failures", 3))
        .on_route("/login")
        .charge_only_when(|status| status == StatusCode::UNAUTHORIZED)
}

async fn logins(addr: std::net::SocketAddr, from: &str, key: &str, n: usize) -> Vec<StatusCode> {
    let auth = format!("Bearer {key}");
    let mut out = Vec::new();
    for _ in 0..n {
        let r = send(
            addr,
            ip(from),
            "POST",
            "/login",
            &[("Authorization", &auth)],
            b"",
        )
        .await;
        out.push(r.status);
    }
    out
}

const DENIED: StatusCode = StatusCode::UNAUTHORIZED;

/// The right key from `from` is refused once the late charges have landed
/// (a store that needs I/O charges on a spawned task): polled, with a
/// deadline, since a right key charges nothing.
async fn eventually_limited(addr: std::net::SocketAddr, from: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match logins(addr, from, "right", 1).await[0] {
            LIMITED => return,
            OK if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            other => panic!("{from}: {other}, expected 429 once the failures are charged"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn only_failed_logins_are_charged() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(failures_rule())
        .build()
        .unwrap();
    let addr = serve(login_app(layer, 0)).await;
    // Successes charge nothing.
    assert_eq!(logins(addr, "127.0.41.1", "right", 6).await, [OK; 6]);
    // Three failures spend the budget; then even the right key waits.
    assert_eq!(logins(addr, "127.0.41.1", "wrong", 3).await, [DENIED; 3]);
    assert_eq!(logins(addr, "127.0.41.1", "right", 1).await, [LIMITED]);
    let r = send(addr, ip("127.0.41.1"), "POST", "/login", &[], b"").await;
    assert_eq!(r.status, LIMITED);
    assert_eq!(r.header("retry-after"), Some("3600"));
    // Another address is not affected.
    assert_eq!(logins(addr, "127.0.41.2", "wrong", 1).await, [DENIED]);
}

/// Concurrent failures all pass the check against one budget: at most
/// `in flight - remaining` of them are not charged, and the budget is
/// spent afterwards.
async fn concurrent_failures<St: tollgate::Store>(layer: RateLimitLayer<St>, from: &'static str) {
    let addr = serve(login_app(layer, 300)).await;
    let tasks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(async move { logins(addr, from, "wrong", 1).await[0] }))
        .collect();
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    // Requests in flight together each pass the check (all eight, unless
    // the machine is too slow to start them within the handler's 300 ms);
    // those that came later found the budget spent.
    let passed = statuses.iter().filter(|s| **s == DENIED).count();
    assert!(passed >= 3, "{statuses:?}");
    assert!(
        statuses.iter().all(|s| *s == DENIED || *s == LIMITED),
        "{statuses:?}"
    );
    eventually_limited(addr, from).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_failed_logins_spend_the_budget_in_memory() {
    concurrent_failures(
        RateLimitLayer::builder(MemoryStore::new())
            .rule(failures_rule())
            .build()
            .unwrap(),
        "127.0.42.1",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_logins_are_charged_in_redis_too() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let store = || {
        tollgate::RedisStore::builder(&server.url())
            .unwrap()
            .build()
            .unwrap()
    };
    concurrent_failures(
        RateLimitLayer::builder(store())
            .rule(failures_rule())
            .build()
            .unwrap(),
        "127.0.43.1",
    )
    .await;
    let addr = serve(login_app(
        RateLimitLayer::builder(store())
            .rule(failures_rule())
            .build()
            .unwrap(),
        0,
    ))
    .await;
    assert_eq!(logins(addr, "127.0.43.2", "right", 5).await, [OK; 5]);
    assert_eq!(logins(addr, "127.0.43.2", "wrong", 3).await, [DENIED; 3]);
    eventually_limited(addr, "127.0.43.2").await;
}

/// A store that cannot check without charging cannot take such a rule.
#[test]
fn a_rule_charged_after_the_response_needs_a_store_that_can_check() {
    struct ChargeOnly(MemoryStore);
    impl tollgate::Store for ChargeOnly {
        fn charge<'a>(
            &'a self,
            charges: &'a [Charge],
        ) -> impl std::future::Future<
            Output = Result<tollgate::store::Outcome, tollgate::StoreError>,
        > + Send
        + 'a {
            self.0.charge(charges)
        }
    }
    let e = RateLimitLayer::builder(ChargeOnly(MemoryStore::new()))
        .rule(failures_rule())
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("charge_only_when"), "{e}");
    assert!(
        RateLimitLayer::builder(ChargeOnly(MemoryStore::new()))
            .rule(Rule::per_client_ip(bucket("plain", 1)))
            .build()
            .is_ok()
    );
}

/// The application writes the refusal body; tollgate keeps the status and
/// every header (`Retry-After`, no-store, the RateLimit fields).
#[tokio::test(flavor = "multi_thread")]
async fn custom_refusal_bodies_keep_tollgate_headers() {
    let envelope = |refusal: &tollgate::RefusalInfo<'_>| {
        tollgate::RefusalBody::json(format!(
            r#"{{"error":{{"status":{},"kind":"{}","policy":"{}","retry_in":{}}}}}"#,
            refusal.status().as_u16(),
            refusal.problem_type(),
            refusal.policy().unwrap_or(""),
            // Whole seconds, rounded up as Retry-After is.
            refusal
                .retry_after()
                .map_or(0, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0)),
        ))
    };
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .refusal_body(envelope)
        .rule(Rule::per_client_ip(bucket("per-ip", 1)))
        .rule(
            Rule::per_client_ip(bucket("bytes", 1))
                .on_route("/upload")
                .with_cost(Cost::content_kib()),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }).post(|| async { "ok" }))
        .route("/upload", post(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    assert_eq!(statuses(addr, "127.0.44.1", "/", &[], 1).await, [OK]);
    let r = send(addr, ip("127.0.44.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, LIMITED);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(
        r.body,
        r#"{"error":{"status":429,"kind":"urn:tollgate:problem:rate-limited","policy":"per-ip","retry_in":3600}}"#
    );
    assert_eq!(r.header("retry-after"), Some("3600"));
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert!(r.header("ratelimit").is_some() && r.header("ratelimit-policy").is_some());
    // A cost that can never fit: 413, the same envelope.
    let r = send(
        addr,
        ip("127.0.44.2"),
        "POST",
        "/upload",
        &[],
        &[b'x'; 4096],
    )
    .await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        r.body.starts_with(r#"{"error":{"status":413"#),
        "{}",
        r.body
    );
    assert!(r.header("retry-after").is_none());
    // gRPC refusals carry no body and are unchanged.
    let r = send(
        addr,
        ip("127.0.44.1"),
        "POST",
        "/",
        &[("Content-Type", "application/grpc")],
        b"",
    )
    .await;
    assert_eq!(r.header("grpc-status"), Some("8"));
    assert_eq!(r.body, "");
}
