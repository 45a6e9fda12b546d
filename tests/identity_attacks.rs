//! The five ways around "every request counts against its address" found
//! by trying tollgate as an attacker would, as regression tests over real
//! sockets: against the quickstart binary (behind a real nginx where the
//! finding needs one) for findings 1-3, and against axum apps built here
//! for findings 4-5.

mod common;

use std::net::SocketAddr;

use axum::Router;
use axum::routing::{get, post};
use common::nginx::Nginx;
use common::{Reply, ip, logs, quickstart, send, send_bytes, serve};
use http::{Method, StatusCode};
use tollgate::{MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule};

const BOB: (&str, &str) = ("Authorization", "Bearer bob-key");

async fn get_root(server: SocketAddr, from: &str, headers: &[(&str, &[u8])]) -> Reply {
    send_bytes(server, ip(from), "GET", "/", headers, b"").await
}

/// Spends the address budget of 5 of `from` through `server`.
async fn exhaust(server: SocketAddr, from: &str) {
    for i in 0..5 {
        let r = get_root(server, from, &[]).await;
        assert_eq!(r.status, StatusCode::OK, "request {i} from {from}");
    }
    assert_eq!(
        get_root(server, from, &[]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Finding 1, as it was seen: nginx in front of the quickstart appends the
/// client's address to the client's own `X-Forwarded-For` line. A client
/// whose budget is spent sent a byte the parser refused (or a value over
/// its length limit) and was keyed to nginx's own address: a fresh budget.
#[tokio::test(flavor = "multi_thread")]
async fn client_bytes_on_the_proxy_line_do_not_escape_the_address_budget() {
    let q = quickstart(&["--trust-proxy", "127.0.0.1/32"]);
    let Some(nginx) = Nginx::start(&format!(
        "location / {{ proxy_pass http://{}; \
         proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for; }}",
        q.addr
    )) else {
        return;
    };
    exhaust(nginx.addr, "127.0.10.1").await;
    let long = vec![b'9'; 5000];
    let mut open_quote_then_comma = b"\"".to_vec();
    open_quote_then_comma.extend_from_slice(b"\xff\xfe, unknown, junk");
    for value in [&b"\xff"[..], &long, b"1.2.3.4\x80", &open_quote_then_comma] {
        let r = get_root(nginx.addr, "127.0.10.1", &[("X-Forwarded-For", value)]).await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "X-Forwarded-For {:?} escaped the budget",
            String::from_utf8_lossy(&value[..value.len().min(20)])
        );
    }
    // Another client behind the same nginx still has its own budget.
    assert_eq!(
        get_root(nginx.addr, "127.0.10.2", &[("X-Forwarded-For", b"\xff")])
            .await
            .status,
        StatusCode::OK
    );
}

/// Finding 1 again, with the exact bytes a proxy forwards, straight to the
/// quickstart from the trusted proxy's address.
#[tokio::test(flavor = "multi_thread")]
async fn raw_bytes_left_of_a_trusted_entry_are_not_read_as_the_line() {
    let q = quickstart(&["--trust-proxy", "127.0.0.1/32"]);
    // Whatever the client wrote left of the proxy's entry, it is keyed by
    // that entry: five of these spend its budget of 5.
    for junk in [&b"\xff"[..], b"0\xff", b"\x80\x81", b"\"x", b"[::1"] {
        let mut xff = junk.to_vec();
        xff.extend_from_slice(b", 127.0.11.9");
        let r = get_root(q.addr, "127.0.0.1", &[("X-Forwarded-For", &xff)]).await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let mut long = vec![b'7'; 5000];
    long.extend_from_slice(b", 127.0.11.9");
    for xff in [&b"\xff, 127.0.11.9"[..], &long] {
        let r = get_root(q.addr, "127.0.0.1", &[("X-Forwarded-For", xff)]).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    }
    // The proxy's own address was never charged.
    assert_eq!(
        get_root(q.addr, "127.0.0.1", &[]).await.status,
        StatusCode::OK
    );
}

/// Finding 2: refusals the layer made itself were never charged, so
/// credential guessing was not rate limited at all.
#[tokio::test(flavor = "multi_thread")]
async fn credential_guessing_is_limited_by_the_address_budget() {
    let q = quickstart(&[]);
    let mut statuses = Vec::new();
    let started = std::time::Instant::now();
    for i in 0..1000 {
        let key = format!("Bearer guess-{i}");
        let r = send(
            q.addr,
            ip("127.0.12.1"),
            "POST",
            "/export",
            &[("Authorization", &key)],
            b"",
        )
        .await;
        statuses.push(r.status);
    }
    // Every 401 spends the address's failed-login budget of 3, refilling
    // 1 per 20 s (and its budget of 5, refilling 1 per second): three
    // guesses are answered, then one more per 20 s that the run took (a
    // busy machine takes longer); every other guess is refused for lack of
    // it.
    let seconds = started.elapsed().as_secs() + 1;
    let answered = statuses
        .iter()
        .filter(|s| **s == StatusCode::UNAUTHORIZED)
        .count() as u64;
    assert!(statuses[..3].iter().all(|s| *s == StatusCode::UNAUTHORIZED));
    assert!(
        (3..=3 + seconds.div_ceil(20)).contains(&answered),
        "{answered} guesses answered in {seconds} s"
    );
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::UNAUTHORIZED || *s == StatusCode::TOO_MANY_REQUESTS)
    );
}

/// Finding 2, the upload refusals: over 1 MiB (413), chunked without a
/// length (411) and an unusable `Content-Length` (400) each spend one unit
/// of the address budget; once it is spent, they are 429 like the rest.
#[tokio::test(flavor = "multi_thread")]
async fn upload_refusals_count_against_the_address() {
    let q = quickstart(&[]);
    let from = ip("127.0.13.1");
    let upload = |headers: Vec<(&'static str, &'static [u8])>, body: &'static [u8]| async move {
        let mut all: Vec<(&str, &[u8])> = vec![(BOB.0, BOB.1.as_bytes())];
        all.extend(headers);
        send_bytes(q.addr, from, "POST", "/upload", &all, body).await
    };
    let too_big = upload(vec![("Content-Length", b"2097152")], b"").await;
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(too_big.header("retry-after").is_none());
    let chunked = upload(vec![("Transfer-Encoding", b"chunked")], b"0\r\n\r\n").await;
    assert_eq!(chunked.status, StatusCode::LENGTH_REQUIRED);
    let cost = send_bytes(
        q.addr,
        from,
        "POST",
        "/upload",
        &[(BOB.0, BOB.1.as_bytes())],
        b"",
    )
    .await;
    // An empty upload costs 1 KiB: admitted, the third unit.
    assert_eq!(cost.status, StatusCode::OK);
    for _ in 0..2 {
        let r = upload(vec![("Content-Length", b"2097152")], b"").await;
        assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    }
    // The address budget is spent: every kind of refusal is now 429.
    for (headers, body) in [
        (vec![("Content-Length", &b"2097152"[..])], &b""[..]),
        (
            vec![("Transfer-Encoding", &b"chunked"[..])],
            &b"0\r\n\r\n"[..],
        ),
    ] {
        let r = upload(headers, body).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(r.header("retry-after").is_some());
    }
}

/// Finding 3: a trusted network written IPv4-mapped trusted nothing, so
/// every client behind that proxy shared one budget.
#[tokio::test(flavor = "multi_thread")]
async fn an_ipv4_mapped_trusted_network_trusts_its_ipv4_proxy() {
    let q = quickstart(&["--trust-proxy", "::ffff:127.0.0.50/128"]);
    let via_proxy = |client: &'static str| async move {
        send(
            q.addr,
            ip("127.0.0.50"),
            "GET",
            "/",
            &[("X-Forwarded-For", client)],
            b"",
        )
        .await
    };
    for _ in 0..5 {
        assert_eq!(via_proxy("198.51.100.1").await.status, StatusCode::OK);
    }
    assert_eq!(
        via_proxy("198.51.100.1").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // A second client behind the same proxy has a budget of its own.
    assert_eq!(via_proxy("198.51.100.2").await.status, StatusCode::OK);
}

fn limited(capacity: u64) -> Policy {
    Policy::token_bucket("finding", capacity, Rate::per_hour(1)).unwrap()
}

/// Finding 4: axum answers HEAD with the GET handler, but a GET rule did
/// not charge HEAD.
#[tokio::test(flavor = "multi_thread")]
async fn head_is_charged_by_a_get_rule() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(Policy::token_bucket("get-only", 1, Rate::per_hour(1)).unwrap())
                .on_method(Method::GET),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/", get(|| async { "hi" }))
            .layer(layer),
    )
    .await;
    let status = |from: &'static str, method: &'static str| async move {
        send(app, ip(from), method, "/", &[], b"").await.status
    };
    assert_eq!(status("127.0.14.1", "GET").await, StatusCode::OK);
    assert_eq!(
        status("127.0.14.1", "GET").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(status("127.0.14.2", "HEAD").await, StatusCode::OK);
    assert_eq!(
        status("127.0.14.2", "HEAD").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // One budget for both methods.
    assert_eq!(status("127.0.14.3", "HEAD").await, StatusCode::OK);
    assert_eq!(
        status("127.0.14.3", "GET").await,
        StatusCode::TOO_MANY_REQUESTS
    );

    // A rule can still name HEAD alone: GET is then not charged.
    let head_only = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(Policy::token_bucket("head-only", 1, Rate::per_hour(1)).unwrap())
                .on_method(Method::HEAD),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/", get(|| async { "hi" }))
            .layer(head_only),
    )
    .await;
    for _ in 0..3 {
        assert_eq!(
            send(app, ip("127.0.14.4"), "GET", "/", &[], b"")
                .await
                .status,
            StatusCode::OK
        );
    }
    assert_eq!(
        send(app, ip("127.0.14.4"), "HEAD", "/", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, ip("127.0.14.4"), "HEAD", "/", &[], b"")
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Finding 4, per operation: HEAD is the GET operation, so alternating the
/// two methods does not double a per-operation budget.
#[tokio::test(flavor = "multi_thread")]
async fn head_and_get_share_one_operation_budget() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_account_operation(limited(2))
                .when_no_principal(tollgate::MissingPrincipal::FallbackToClientIp),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/doc", get(|| async { "doc" }))
            .layer(layer),
    )
    .await;
    let from = ip("127.0.14.9");
    assert_eq!(
        send(app, from, "GET", "/doc", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "HEAD", "/doc", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "HEAD", "/doc", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(app, from, "GET", "/doc", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Finding 5: route patterns in axum 0.7 syntax matched nothing, silently.
#[test]
fn route_patterns_in_old_syntax_are_refused_when_the_rule_is_built() {
    let built = |route: &str| {
        RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::per_client_ip(limited(1)).on_route(route))
            .build()
    };
    let e = built("/items/:id").unwrap_err();
    assert!(e.to_string().contains("/items/{id}"), "{e}");
    assert_eq!(e.policy(), limited(1).name());
    assert!(!e.is_unsupported_by_store(), "{e}");
    let e = built("/files/*rest").unwrap_err();
    assert!(e.to_string().contains("/files/{*rest}"), "{e}");
    // A valid route after an invalid one does not hide it: the first
    // problem is kept.
    let e = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(limited(1))
                .on_route("/items/:id")
                .on_route("/ok"),
        )
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("/items/{id}"), "{e}");
    // Through a RulesHandle too: nothing changes on an error.
    let layer = built("/ok").unwrap();
    let handle = layer.rules_handle();
    assert!(
        handle
            .replace([Rule::per_client_ip(limited(1)).on_route("/items/:id")])
            .is_err()
    );
    assert_eq!(handle.rules().len(), 1);
}

/// Finding 5: a second `.on_route()` replaced the first; it now adds.
#[tokio::test(flavor = "multi_thread")]
async fn repeated_on_route_adds_routes() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(Policy::token_bucket("two-routes", 1, Rate::per_hour(1)).unwrap())
                .on_route("/a")
                .on_route("/b/{id}"),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/a", get(|| async { "a" }))
            .route("/b/{id}", get(|| async { "b" }))
            .route("/c", get(|| async { "c" }))
            .layer(layer),
    )
    .await;
    let from = ip("127.0.15.1");
    assert_eq!(
        send(app, from, "GET", "/a", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "GET", "/b/7", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(app, from, "GET", "/a", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(app, from, "GET", "/c", &[], b"").await.status,
        StatusCode::OK
    );
}

async fn authenticated(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    req.extensions_mut()
        .insert(Principal::new("north", "alice"));
    next.run(req).await
}

/// Finding 5: a layer that wraps the Router from outside sees no
/// `MatchedPath`. Its route rules now match the request path, operations
/// of routed rules are the rule's pattern, and the misplacement is logged
/// as an error once.
#[tokio::test(flavor = "multi_thread")]
async fn route_rules_apply_when_the_layer_wraps_the_router_from_outside() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(
                Policy::token_bucket("outside-items", 1, Rate::per_hour(1)).unwrap(),
            )
            .on_route("/items/{id}"),
        )
        .rule(
            Rule::per_account_operation(
                Policy::token_bucket("outside-ops", 1, Rate::per_hour(1)).unwrap(),
            )
            .on_route("/x")
            .on_route("/y"),
        )
        .build()
        .unwrap();
    let router = Router::new()
        .route("/items/{id}", get(|| async { "item" }))
        .route("/x", post(|| async { "x" }))
        .route("/y", post(|| async { "y" }))
        .route("/other", get(|| async { "other" }));
    // The layer sees each request before the inner router has routed it.
    let outside = tower::Layer::layer(&layer, router);
    let app = serve(
        Router::new()
            .fallback_service(outside)
            .layer(axum::middleware::from_fn(authenticated)),
    )
    .await;
    let from = ip("127.0.16.1");
    assert_eq!(
        send(app, from, "GET", "/items/1", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "GET", "/items/2", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(app, from, "GET", "/other", &[], b"").await.status,
        StatusCode::OK
    );
    // Two routes of one per-operation rule keep separate operations.
    assert_eq!(
        send(app, from, "POST", "/x", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "POST", "/y", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(app, from, "POST", "/x", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        logs::count(tracing::Level::ERROR, "without axum's MatchedPath"),
        1,
        "reported once per layer"
    );
}

/// Found in review: a layer on the outer Router, a route nested under
/// `/api` and a rule written without the prefix matched nothing and said
/// nothing. axum's `MatchedPath` (`/api/items/{id}`) only ends with the
/// pattern, which may be another route's (`/export` and `/admin/export`):
/// the rule does not apply there, and an error names the full path, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_route_that_only_ends_with_a_rules_pattern_is_reported() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(Policy::token_bucket("outer-items", 1, Rate::per_hour(1)).unwrap())
                .on_route("/things/{id}"),
        )
        .build()
        .unwrap();
    let api = Router::new().route("/things/{id}", get(|| async { "thing" }));
    let app = serve(
        Router::new()
            .route("/things/{id}", get(|| async { "top-level thing" }))
            .nest("/v1", api)
            .layer(layer),
    )
    .await;
    let from = ip("127.0.16.9");
    let status =
        |path: &'static str| async move { send(app, from, "GET", path, &[], b"").await.status };
    assert_eq!(status("/v1/things/1").await, StatusCode::OK);
    assert_eq!(status("/v1/things/2").await, StatusCode::OK);
    assert_eq!(
        logs::count(tracing::Level::ERROR, ".on_route(\"/v1/things/{id}\")"),
        1,
        "reported once per rule, naming the full path"
    );
    // The route the pattern names is limited.
    assert_eq!(status("/things/1").await, StatusCode::OK);
    assert_eq!(status("/things/2").await, StatusCode::TOO_MANY_REQUESTS);
}

/// Finding 5: under `nest("/api")` the `MatchedPath` carries the prefix,
/// and a rule written without it matched nothing. It now applies, and the
/// error names the rule and the full path to write, once.
#[tokio::test(flavor = "multi_thread")]
async fn route_rules_inside_a_nested_router_apply_and_name_the_full_path() {
    logs::capture();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_client_ip(
                Policy::token_bucket("nested-items", 1, Rate::per_hour(1)).unwrap(),
            )
            .on_route("/items/{id}"),
        )
        .build()
        .unwrap();
    let api = Router::new()
        .route("/items/{id}", get(|| async { "item" }))
        .route("/v2/items/{id}", get(|| async { "v2" }))
        .route("/list", get(|| async { "list" }))
        .layer(layer);
    let app = serve(Router::new().nest("/api", api)).await;
    let from = ip("127.0.17.1");
    assert_eq!(
        send(app, from, "GET", "/api/items/1", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    for i in 2..5 {
        assert_eq!(
            send(app, from, "GET", &format!("/api/items/{i}"), &[], b"")
                .await
                .status,
            StatusCode::TOO_MANY_REQUESTS
        );
    }
    assert_eq!(
        send(app, from, "GET", "/api/list", &[], b"").await.status,
        StatusCode::OK
    );
    // A route that merely ends like the pattern is another route.
    assert_eq!(
        send(app, from, "GET", "/api/v2/items/1", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        logs::count(tracing::Level::ERROR, ".on_route(\"/api/items/{id}\")"),
        1,
        "reported once, naming the full path"
    );
}

/// gRPC is recognised by its exact media type: `application/grpcx` is
/// plain HTTP, gRPC-Web is answered in its own content type.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_refusals_only_for_grpc_media_types() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(
            Policy::token_bucket("grpc-kinds", 1, Rate::per_hour(1)).unwrap(),
        ))
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/svc/M", post(|| async { "" }))
            .layer(layer),
    )
    .await;
    let from = ip("127.0.18.1");
    assert_eq!(
        send(app, from, "POST", "/svc/M", &[], b"").await.status,
        StatusCode::OK
    );
    let refused = |ct: &'static str| async move {
        send(app, from, "POST", "/svc/M", &[("Content-Type", ct)], b"").await
    };
    let plain = refused("application/grpcx").await;
    assert_eq!(plain.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(plain.header("grpc-status").is_none());
    for (ct, answered) in [
        ("application/grpc", "application/grpc"),
        ("application/grpc+proto", "application/grpc"),
        ("application/grpc-web+proto", "application/grpc-web+proto"),
        (
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ),
    ] {
        let r = refused(ct).await;
        assert_eq!(r.status, StatusCode::OK, "{ct}");
        assert_eq!(r.header("grpc-status"), Some("8"), "{ct}");
        assert_eq!(r.header("content-type"), Some(answered), "{ct}");
    }
}

/// When authentication answers 401 itself, tollgate inside it never sees
/// the guesses. The layering the README shows still limits them: an
/// address-keyed layer outside the authentication layer, the account-keyed
/// rules inside it.
#[tokio::test(flavor = "multi_thread")]
async fn guessing_is_limited_when_authentication_rejects_before_tollgate() {
    async fn strict_auth(
        mut req: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        let key = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        if key != Some("Bearer right") {
            return StatusCode::UNAUTHORIZED.into_response();
        }
        req.extensions_mut()
            .insert(Principal::new("north", "alice"));
        next.run(req).await
    }
    let per_address = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_client_ip(
            Policy::token_bucket("outer-ip", 5, Rate::per_hour(1)).unwrap(),
        ))
        .build()
        .unwrap();
    let per_account = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_account(
            Policy::token_bucket("inner-account", 2, Rate::per_hour(1)).unwrap(),
        ))
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/export", post(|| async { "ok" }))
            .layer(per_account)
            .layer(axum::middleware::from_fn(strict_auth))
            .layer(per_address),
    )
    .await;
    let post_with = |from: &'static str, key: &'static str| async move {
        send(
            app,
            ip(from),
            "POST",
            "/export",
            &[("Authorization", key)],
            b"",
        )
        .await
        .status
    };
    for _ in 0..5 {
        assert_eq!(
            post_with("127.0.19.1", "Bearer guess").await,
            StatusCode::UNAUTHORIZED
        );
    }
    assert_eq!(
        post_with("127.0.19.1", "Bearer guess").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        post_with("127.0.19.1", "Bearer right").await,
        StatusCode::TOO_MANY_REQUESTS
    );
    // From another address the account budget applies inside.
    assert_eq!(
        post_with("127.0.19.2", "Bearer right").await,
        StatusCode::OK
    );
    assert_eq!(
        post_with("127.0.19.2", "Bearer right").await,
        StatusCode::OK
    );
    assert_eq!(
        post_with("127.0.19.2", "Bearer right").await,
        StatusCode::TOO_MANY_REQUESTS
    );
}

/// Found in review: per-operation keys took the method name as sent, so on
/// a route that takes any method, every invented method name was a fresh
/// budget. Every non-standard method is now one operation.
#[tokio::test(flavor = "multi_thread")]
async fn invented_method_names_share_one_operation_budget() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_account_operation(
                Policy::token_bucket("any-method", 2, Rate::per_hour(1)).unwrap(),
            )
            .when_no_principal(tollgate::MissingPrincipal::FallbackToClientIp),
        )
        .build()
        .unwrap();
    let app = serve(
        Router::new()
            .route("/x", axum::routing::any(|| async { "any" }))
            .layer(layer),
    )
    .await;
    let from = ip("127.0.21.1");
    for method in ["FOO", "BAR"] {
        assert_eq!(
            send(app, from, method, "/x", &[], b"").await.status,
            StatusCode::OK
        );
    }
    for method in ["BAZ", "post", "X1"] {
        assert_eq!(
            send(app, from, method, "/x", &[], b"").await.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{method}"
        );
    }
    // The standard methods keep their own operations.
    assert_eq!(
        send(app, from, "POST", "/x", &[], b"").await.status,
        StatusCode::OK
    );
}
