//! What an operator reads: refusals logged at the level the layer was
//! given, with the policy, the key's shape and a fingerprint, never the key
//! or a credential; errors that repeat per request (the store unreachable,
//! the server's own misconfiguration) logged once and then at a bounded
//! rate with a count; a misconfiguration answered 500 without internals.

mod common;

use std::net::SocketAddr;
use std::num::NonZeroUsize;

use axum::Router;
use axum::routing::get;
use common::{ip, logs, quickstart, send, serve};
use http::StatusCode;
use tollgate::{
    ConcurrencyLimitLayer, Cost, KeyPart, MemoryStore, OnStoreError, Policy, Principal, Rate,
    RateLimitLayer, RedisStore, Rule, Unit, rate_limit::CostError,
};
use tracing::Level;

fn with_principal(app: Router) -> Router {
    app.layer(axum::middleware::from_fn(
        |mut req: axum::extract::Request, next: axum::middleware::Next| async move {
            if req.headers().contains_key("authorization") {
                req.extensions_mut()
                    .insert(Principal::new("north", "alice").with_credential("s3cret-cred"));
            }
            next.run(req).await
        },
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn refusals_are_logged_at_the_chosen_level_without_the_key() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .log_refusals(Level::WARN)
        .rule(Rule::per_client_ip(
            Policy::token_bucket("logged-ip", 2, Rate::per_hour(1)).unwrap(),
        ))
        .rule(
            Rule::per_account(
                Policy::token_bucket("logged-account", 5, Rate::per_hour(1)).unwrap(),
            )
            .on_route("/private"),
        )
        .build()
        .unwrap();
    let in_flight = ConcurrencyLimitLayer::builder("logged-slow")
        .per_key(NonZeroUsize::new(1).unwrap(), [KeyPart::ClientIp])
        .log_refusals(Level::WARN)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/private", get(|| async { "ok" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                "done"
            })
            .route_layer(in_flight),
        )
        .layer(layer);
    let addr = serve(with_principal(app)).await;
    let from = ip("127.0.81.7");
    for _ in 0..2 {
        assert_eq!(
            send(addr, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(addr, from, "GET", "/", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A 401 is logged too (no principal on a per-account rule).
    let other = ip("127.0.81.8");
    assert_eq!(
        send(addr, other, "GET", "/private", &[], b"").await.status,
        StatusCode::UNAUTHORIZED
    );
    // And a concurrency refusal.
    let third = ip("127.0.81.9");
    let slow = tokio::spawn(async move { send(addr, third, "GET", "/slow", &[], b"").await });
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let r = send(addr, third, "GET", "/slow", &[], b"").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(r.body.contains("at most 1 request of yours"), "{}", r.body);
    assert_eq!(slow.await.unwrap().status, StatusCode::OK);

    let warn = |needle: &str| logs::count(Level::WARN, needle);
    assert!(warn("refused: rate limited") >= 1);
    assert!(warn("policy=\"logged-ip\"") >= 1);
    assert!(warn("key=ip") >= 1);
    assert!(warn("key_fingerprint=") >= 2);
    assert!(warn("refused: the rule needs a principal") >= 1);
    assert!(warn("refused: too many in flight") >= 1);
    assert!(warn("layer=\"logged-slow\"") >= 1);
    // Never the key text, the address or a credential.
    for text in logs::texts() {
        for secret in ["127.0.81", "s3cret", "alice", "ip=127"] {
            assert!(!text.contains(secret), "{secret:?} in the log: {text}");
        }
    }
}

/// Errors that repeat per request are logged once, then at most once per
/// ten seconds with how many were left out; a server that forgot the peer
/// address answers 500 with no internals in the body.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_errors_are_logged_at_a_bounded_rate() {
    logs::capture();
    // The store is unreachable: 40 requests, 40 503s, one log line.
    let down = RedisStore::builder("redis://127.0.0.1:1")
        .unwrap()
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(down)
        .rule(Rule::per_client_ip(
            Policy::token_bucket("down", 5, Rate::per_second(1)).unwrap(),
        ))
        .build()
        .unwrap();
    let addr = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer),
    )
    .await;
    for i in 0..40u8 {
        let r = send(addr, ip(&format!("127.0.82.{i}")), "GET", "/", &[], b"").await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    }
    assert_eq!(
        logs::count_all(Level::WARN, &["store failed", "outcome=\"fail_closed\""]),
        1
    );

    // No peer address: the app is served without connect info.
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(
            Policy::token_bucket("no-peer", 5, Rate::per_second(1)).unwrap(),
        ))
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bare: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    for _ in 0..20 {
        let r = send(bare, ip("127.0.0.1"), "GET", "/", &[], b"").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        for internal in ["peer", "connect_info", "PeerAddr", "SocketAddr"] {
            assert!(!r.body.contains(internal), "{internal:?} in {}", r.body);
        }
    }
    assert_eq!(
        logs::count_all(
            Level::ERROR,
            &["into_make_service_with_connect_info", "policy=\"no-peer\""]
        ),
        1
    );
}

/// Serves `app` without connect info: requests carry no peer address.
async fn serve_without_peer(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The in-flight limit logs the refusals it makes on its own account, as
/// the rate limiter does: a `401` at the level it was given, naming the
/// layer; a server without peer addresses as an error that says what to
/// fix, once, then at a bounded rate (not hidden behind the rate
/// limiter's own report of the same mistake).
#[tokio::test(flavor = "multi_thread")]
async fn the_in_flight_limit_logs_its_own_refusals() {
    logs::capture();
    let by_account = ConcurrencyLimitLayer::builder("slots-by-account")
        .per_key(NonZeroUsize::new(1).unwrap(), [KeyPart::Account])
        .log_refusals(Level::WARN)
        .build()
        .unwrap();
    let addr = serve(with_principal(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(by_account),
    ))
    .await;
    let r = send(addr, ip("127.0.84.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        logs::count_all(
            Level::WARN,
            &[
                "refused: the rule needs a principal",
                "layer=\"slots-by-account\""
            ]
        ),
        1
    );

    let by_ip = ConcurrencyLimitLayer::builder("slots-no-peer")
        .per_key(NonZeroUsize::new(1).unwrap(), [KeyPart::ClientIp])
        .log_refusals(Level::WARN)
        .build()
        .unwrap();
    let bare = serve_without_peer(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(by_ip),
    )
    .await;
    for _ in 0..3 {
        let r = send(bare, ip("127.0.0.1"), "GET", "/", &[], b"").await;
        assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
        for internal in ["peer", "connect_info", "PeerAddr", "SocketAddr"] {
            assert!(!r.body.contains(internal), "{internal:?} in {}", r.body);
        }
    }
    assert_eq!(
        logs::count_all(
            Level::ERROR,
            &[
                "into_make_service_with_connect_info",
                "tollgate::identity::PeerAddr",
                "layer=\"slots-no-peer\""
            ]
        ),
        1
    );
}

/// Requests the layer refuses because of their cost are logged like a
/// `429`: at the chosen level, with the policy, the key's shape and its
/// fingerprint: a cost that can never fit (`413`), no `Content-Length`
/// (`411`), a computed cost that failed (`400`).
#[tokio::test(flavor = "multi_thread")]
async fn cost_refusals_are_logged_at_the_chosen_level_with_the_key() {
    logs::capture();
    let rows = |parts: &http::request::Parts| {
        parts
            .headers
            .get("x-rows")
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .ok_or_else(|| CostError("x-rows is not a count of rows".into()))
    };
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .log_refusals(Level::INFO)
        .rule(
            Rule::per_client_ip(Policy::token_bucket("uploads", 4, Rate::per_hour(1)).unwrap())
                .with_cost(Cost::content_kib())
                .on_route("/upload"),
        )
        .rule(
            Rule::per_client_ip(Policy::token_bucket("rows", 10, Rate::per_hour(1)).unwrap())
                .with_cost(Cost::computed(Unit::Other("rows".into()), rows))
                .on_route("/rows"),
        )
        .build()
        .unwrap();
    let app = Router::new()
        .route("/upload", get(|| async { "ok" }).post(|| async { "ok" }))
        .route("/rows", get(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    let from = ip("127.0.85.3");
    let big = vec![b'x'; 10 * 1024];
    let r = send(addr, from, "POST", "/upload", &[], &big).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    let r = send(addr, from, "GET", "/upload", &[], b"").await;
    assert_eq!(r.status, StatusCode::LENGTH_REQUIRED);
    let r = send(addr, from, "GET", "/rows", &[("x-rows", "many")], b"").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);

    let info = |needles: &[&str]| logs::count_all(Level::INFO, needles);
    let keyed = ["key=ip", "key_fingerprint="];
    assert_eq!(
        info(
            &[
                &[
                    "refused: cost can never fit",
                    "policy=\"uploads\"",
                    "cost=10"
                ][..],
                &keyed
            ]
            .concat()
        ),
        1
    );
    assert_eq!(
        info(
            &[
                &[
                    "refused: the request's cost cannot be computed",
                    "policy=\"uploads\"",
                    "send Content-Length"
                ][..],
                &keyed
            ]
            .concat()
        ),
        1
    );
    assert_eq!(
        info(
            &[
                &[
                    "refused: the request's cost cannot be computed",
                    "policy=\"rows\"",
                    "x-rows is not a count"
                ][..],
                &keyed
            ]
            .concat()
        ),
        1
    );
    for text in logs::texts() {
        assert!(!text.contains("127.0.85"), "the address in the log: {text}");
    }
}

/// The fingerprints of the events at `level` that carry every one of
/// `needles`.
fn fingerprints(level: Level, needles: &[&str]) -> Vec<String> {
    logs::texts_at(level)
        .iter()
        .filter(|text| needles.iter().all(|n| text.contains(n)))
        .filter_map(|text| {
            let at = text.find("key_fingerprint=")? + "key_fingerprint=".len();
            Some(text.get(at..at + 16)?.to_owned())
        })
        .collect()
}

/// A fingerprint is of the key, and a key names the client, not the policy:
/// one address has one fingerprint in a rule keyed by address and in the
/// in-flight limit keyed by address; a key of other parts (the account) has
/// its own.
#[tokio::test(flavor = "multi_thread")]
async fn one_address_has_one_fingerprint_in_every_layer() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .log_refusals(Level::WARN)
        .rule(
            Rule::per_client_ip(Policy::token_bucket("fp-ip", 1, Rate::per_hour(1)).unwrap())
                .on_route("/"),
        )
        .rule(
            Rule::per_account(Policy::token_bucket("fp-account", 1, Rate::per_hour(1)).unwrap())
                .on_route("/account"),
        )
        .build()
        .unwrap();
    let in_flight = ConcurrencyLimitLayer::builder("fp-slots")
        .per_key(NonZeroUsize::new(1).unwrap(), [KeyPart::ClientIp])
        .log_refusals(Level::WARN)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/account", get(|| async { "ok" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                "done"
            })
            .route_layer(in_flight),
        )
        .layer(layer);
    let addr = serve(with_principal(app)).await;
    let from = ip("127.0.87.1");
    let auth = [("authorization", "Bearer x")];
    for (path, headers) in [("/", &[][..]), ("/account", &auth[..])] {
        assert_eq!(
            send(addr, from, "GET", path, headers, b"").await.status,
            StatusCode::OK
        );
        assert_eq!(
            send(addr, from, "GET", path, headers, b"").await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    let slow = tokio::spawn(async move { send(addr, from, "GET", "/slow", &[], b"").await });
    tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    let r = send(addr, from, "GET", "/slow", &[], b"").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(slow.await.unwrap().status, StatusCode::OK);

    let by_rule = fingerprints(Level::WARN, &["policy=\"fp-ip\"", "key=ip "]);
    let in_flight = fingerprints(Level::WARN, &["layer=\"fp-slots\"", "key=ip "]);
    let account = fingerprints(Level::WARN, &["policy=\"fp-account\"", "key=t,a "]);
    assert_eq!(by_rule.len(), 1, "{by_rule:?}");
    assert_eq!(in_flight, by_rule);
    assert_eq!(account.len(), 1, "{account:?}");
    assert_ne!(account, by_rule);
}

/// Each kind of store failure has its own bounded rate: a fallback taken
/// is not hidden behind admissions made unchecked (nor behind an outage's
/// refusals), even when they alternate.
#[tokio::test(flavor = "multi_thread")]
async fn each_kind_of_store_failure_is_logged() {
    logs::capture();
    let down = || {
        RedisStore::builder("redis://127.0.0.1:1")
            .unwrap()
            .build()
            .unwrap()
    };
    let layer = |name: &str, on_error: OnStoreError| {
        RateLimitLayer::builder(down())
            .on_store_error(on_error)
            .rule(Rule::per_client_ip(
                Policy::token_bucket(name, 5, Rate::per_second(1)).unwrap(),
            ))
            .build()
            .unwrap()
    };
    let open = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer("down-open", OnStoreError::FailOpen)),
    )
    .await;
    let fallback = serve(
        Router::new()
            .route("/", get(|| async { "ok" }))
            .layer(layer(
                "down-fallback",
                OnStoreError::Fallback(std::sync::Arc::new(MemoryStore::new())),
            )),
    )
    .await;
    for i in 0..10u8 {
        let from = ip(&format!("127.0.86.{i}"));
        assert_eq!(
            send(open, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
        assert_eq!(
            send(fallback, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
    }
    let warned = |outcome: &str| logs::count_all(Level::WARN, &["store failed", outcome]);
    assert_eq!(warned("outcome=\"fail_open\""), 1);
    assert_eq!(warned("outcome=\"fallback\""), 1);
}

/// Log messages read as prose: a string continued over source lines
/// without `\` carried the indentation into the log as runs of spaces (the
/// report of a rule whose route the matched one only ends with).
#[tokio::test(flavor = "multi_thread")]
async fn messages_carry_no_source_indentation() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(Policy::token_bucket("ends-with", 5, Rate::per_hour(1)).unwrap())
                .on_route("/things/{id}"),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/things/{id}", get(|| async { "thing" }))
            .nest(
                "/v1",
                Router::new().route("/things/{id}", get(|| async { "v1 thing" })),
            )
            .layer(layer),
    )
    .await;
    let r = send(app, ip("127.0.88.1"), "GET", "/v1/things/1", &[], b"").await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        logs::count_all(
            Level::ERROR,
            &[
                "policy=\"ends-with\"",
                "matched \"/v1/things/{id}\", which only ends with it"
            ]
        ),
        1
    );
    for text in logs::texts() {
        assert!(!text.contains("  "), "a run of spaces in: {text}");
    }
}

/// The quickstart shows refusals when asked to (`--log-refusals LEVEL`), as
/// an operator would see them, and by default does not.
#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_logs_refusals_when_asked() {
    let quiet = quickstart(&[]);
    let loud = quickstart(&["--log-refusals", "warn"]);
    for q in [&quiet, &loud] {
        let mut last = StatusCode::OK;
        for _ in 0..6 {
            last = send(q.addr, ip("127.0.0.1"), "GET", "/", &[], b"")
                .await
                .status;
        }
        assert_eq!(last, StatusCode::TOO_MANY_REQUESTS);
    }
    let refused = |log: &str| {
        log.lines()
            .filter(|l| l.contains("refused: rate limited"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let mut lines = Vec::new();
    for _ in 0..50 {
        lines = refused(&loud.log.lock().unwrap());
        if !lines.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(lines.len(), 1, "{lines:?}");
    for needle in ["WARN", "policy=\"per-ip\"", "key=ip", "key_fingerprint="] {
        assert!(lines[0].contains(needle), "{needle:?} not in {}", lines[0]);
    }
    assert!(!lines[0].contains("127.0.0.1"), "{}", lines[0]);
    assert!(refused(&quiet.log.lock().unwrap()).is_empty());
}
