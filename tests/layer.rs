//! The rate-limit layer over real sockets, in configurations the quickstart
//! does not cover: store failure outcomes, gRPC, the single-proxy contract,
//! per-operation keys, plain hyper, route_layer and misconfiguration.

mod common;

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use common::{ip, send, serve};
use http::StatusCode;
use tokio::net::TcpListener;
use tollgate::{
    ClientIpResolver, Cost, KeyPart, MemoryStore, MissingPrincipal, OnStoreError, Policy,
    Principal, Rate, RateLimitLayer, Rule,
    store::{DynStore, OnKeyCap},
};

fn bucket(name: &str, capacity: u64) -> Policy {
    Policy::token_bucket(name, capacity, Rate::per_hour(1)).unwrap()
}

/// A store that really fails: a MemoryStore capped at one key that refuses
/// new keys, so every client after the first gets a store error.
fn full_store() -> MemoryStore {
    let store = MemoryStore::builder()
        .max_keys(1, OnKeyCap::RefuseNewKeys)
        .shards(1)
        .build();
    let first =
        tollgate::store::Charge::new(tollgate::store::Key::new("occupied"), bucket("x", 1), 1)
            .unwrap();
    assert!(store.charge_now(&[first]).unwrap().is_admitted());
    store
}

#[tokio::test(flavor = "multi_thread")]
async fn store_failure_is_not_429_and_follows_the_configured_outcome() {
    let hello = || Router::new().route("/", get(|| async { "ok" }));
    let closed = serve(
        hello().layer(
            RateLimitLayer::builder(full_store())
                .rule(Rule::per_client_ip(bucket("per-ip", 5)))
                .build()
                .unwrap(),
        ),
    )
    .await;
    let r = send(closed, ip("127.0.8.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("cache-control"), Some("no-store"));
    assert!(r.header("retry-after").is_none());

    let open = serve(
        hello().layer(
            RateLimitLayer::builder(full_store())
                .rule(Rule::per_client_ip(bucket("per-ip", 5)))
                .on_store_error(OnStoreError::FailOpen)
                .build()
                .unwrap(),
        ),
    )
    .await;
    for _ in 0..8 {
        assert_eq!(
            send(open, ip("127.0.8.2"), "GET", "/", &[], b"")
                .await
                .status,
            StatusCode::OK
        );
    }

    let fallback: Arc<dyn DynStore> = Arc::new(MemoryStore::new());
    let fb = serve(
        hello().layer(
            RateLimitLayer::builder(full_store())
                .rule(Rule::per_client_ip(bucket("per-ip", 2)))
                .on_store_error(OnStoreError::Fallback(fallback))
                .build()
                .unwrap(),
        ),
    )
    .await;
    let statuses: Vec<StatusCode> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(send(fb, ip("127.0.8.3"), "GET", "/", &[], b"").await.status);
        }
        v
    };
    assert_eq!(
        statuses,
        [
            StatusCode::OK,
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn grpc_requests_get_resource_exhausted() {
    let app = Router::new()
        .route("/pkg.Service/Method", post(|| async { "ok" }))
        .layer(
            RateLimitLayer::builder(MemoryStore::new())
                .rule(Rule::per_client_ip(bucket("per-ip", 1)))
                .build()
                .unwrap(),
        );
    let a = serve(app).await;
    let grpc = [
        ("Content-Type", "application/grpc+proto"),
        ("TE", "trailers"),
    ];
    assert_eq!(
        send(
            a,
            ip("127.0.9.1"),
            "POST",
            "/pkg.Service/Method",
            &grpc,
            b""
        )
        .await
        .status,
        StatusCode::OK
    );
    let r = send(
        a,
        ip("127.0.9.1"),
        "POST",
        "/pkg.Service/Method",
        &grpc,
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("grpc-status"), Some("8"));
    assert_eq!(r.header("content-type"), Some("application/grpc"));
    assert!(r.header("grpc-message").unwrap().contains("rate limit"));
}

#[tokio::test(flavor = "multi_thread")]
async fn single_proxy_contract_rejects_a_list() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(MemoryStore::new())
            .client_ip(ClientIpResolver::single_proxy(
                ip("127.0.10.1"),
                http::HeaderName::from_static("x-real-ip"),
            ))
            .rule(Rule::per_client_ip(bucket("per-ip", 1)))
            .build()
            .unwrap(),
    );
    let a = serve(app).await;
    let proxy = ip("127.0.10.1");
    let r = send(
        a,
        proxy,
        "GET",
        "/",
        &[("X-Real-IP", "198.51.100.8, 203.0.113.9")],
        b"",
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body.contains("exactly one address"), "{}", r.body);
    // One address is believed; each client has its own budget.
    assert_eq!(
        send(a, proxy, "GET", "/", &[("X-Real-IP", "198.51.100.8")], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(a, proxy, "GET", "/", &[("X-Real-IP", "198.51.100.9")], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(a, proxy, "GET", "/", &[("X-Real-IP", "198.51.100.8")], b"")
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another peer's claim is ignored: keyed by itself.
    let other = ip("127.0.10.2");
    assert_eq!(
        send(a, other, "GET", "/", &[("X-Real-IP", "198.51.100.9")], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(a, other, "GET", "/", &[("X-Real-IP", "203.0.113.1")], b"")
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn operations_are_separate_keys_and_query_strings_are_ignored() {
    let per_op = Rule::per_account_operation(bucket("per-op", 1));
    let app = Router::new()
        .route(
            "/items/{id}",
            get(|| async { "item" }).delete(|| async { "deleted" }),
        )
        .route("/thumbnail", get(|| async { "thumb" }))
        .layer(
            RateLimitLayer::builder(MemoryStore::new())
                .rule(per_op)
                .build()
                .unwrap(),
        )
        // Stands in for an authentication layer that verified alice.
        .layer(axum::Extension(Principal::new("north", "alice")));
    let a = serve(app).await;
    let from = ip("127.0.11.1");
    assert_eq!(
        send(a, from, "GET", "/items/1", &[], b"").await.status,
        StatusCode::OK
    );
    // Same route pattern, other id and a query string: the same operation.
    assert_eq!(
        send(a, from, "GET", "/items/2?x=1", &[], b"").await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
    // Another method or route is another operation.
    assert_eq!(
        send(a, from, "DELETE", "/items/1", &[], b"").await.status,
        StatusCode::OK
    );
    assert_eq!(
        send(a, from, "GET", "/thumbnail", &[], b"").await.status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_principal_policies() {
    let app = |what| {
        Router::new().route("/", get(|| async { "ok" })).layer(
            RateLimitLayer::builder(MemoryStore::new())
                .rule(Rule::per_account(bucket("acct", 1)).when_no_principal(what))
                .build()
                .unwrap(),
        )
    };
    let reject = serve(app(MissingPrincipal::Reject)).await;
    let r = send(reject, ip("127.0.12.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    let skip = serve(app(MissingPrincipal::Skip)).await;
    for _ in 0..3 {
        assert_eq!(
            send(skip, ip("127.0.12.2"), "GET", "/", &[], b"")
                .await
                .status,
            StatusCode::OK
        );
    }
    let fallback = serve(app(MissingPrincipal::FallbackToClientIp)).await;
    assert_eq!(
        send(fallback, ip("127.0.12.3"), "GET", "/", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(fallback, ip("127.0.12.3"), "GET", "/", &[], b"")
            .await
            .status,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(fallback, ip("127.0.12.4"), "GET", "/", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_peer_address_is_a_clear_configuration_error() {
    let app = Router::new().route("/", get(|| async { "ok" })).layer(
        RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::per_client_ip(bucket("per-ip", 5)))
            .build()
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = listener.local_addr().unwrap();
    // Served without connect info: the layer cannot know the peer.
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let r = send(a, ip("127.0.13.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    // The client learns it is the server's fault, not how the server is
    // built; the fix is in the log (tests/operator_logs.rs).
    assert!(r.body.contains("misconfigured"), "{}", r.body);
    assert!(!r.body.contains("connect_info"), "{}", r.body);
}

#[tokio::test(flavor = "multi_thread")]
async fn route_layer_limits_one_route_and_content_length_is_required() {
    let upload = Rule::new(Policy::token_bucket("bytes", 100, Rate::per_hour(1)).unwrap())
        .keyed_by([KeyPart::ClientIp])
        .with_cost(Cost::content_bytes());
    let app = Router::new()
        .route("/free", get(|| async { "free" }))
        .route(
            "/upload",
            post(|| async { "stored" }).route_layer(
                RateLimitLayer::builder(MemoryStore::new())
                    .rule(upload)
                    .build()
                    .unwrap(),
            ),
        );
    let a = serve(app).await;
    let from = ip("127.0.14.1");
    assert_eq!(
        send(a, from, "POST", "/upload", &[], &[b'x'; 60])
            .await
            .status,
        StatusCode::OK
    );
    let r = send(a, from, "POST", "/upload", &[], &[b'x'; 60]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.header("ratelimit-policy")
            .unwrap()
            .contains("qu=\"content-bytes\"")
    );
    assert_eq!(
        send(a, from, "POST", "/upload", &[], &[b'x'; 101])
            .await
            .status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // Chunked upload: no Content-Length, so the cost is unknown.
    let r = send(
        a,
        from,
        "POST",
        "/upload",
        &[("Transfer-Encoding", "chunked")],
        b"0\r\n\r\n",
    )
    .await;
    assert_eq!(r.status, StatusCode::LENGTH_REQUIRED);
    // Other routes are not limited by the route layer.
    for _ in 0..5 {
        let r = send(a, from, "GET", "/free", &[], b"").await;
        assert_eq!(r.status, StatusCode::OK);
        assert!(r.header("ratelimit").is_none());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_hyper_server_with_peer_addr_and_infallible_inner() {
    use hyper::server::conn::http1;
    use hyper_util::rt::TokioIo;
    use tower::{Service, ServiceExt};

    let inner = tower::service_fn(|_req: http::Request<hyper::body::Incoming>| async {
        Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(
            bytes::Bytes::from("hi"),
        )))
    });
    let limited = tower::Layer::layer(
        &RateLimitLayer::builder(MemoryStore::new())
            .headers_on_admitted(false)
            .rule(Rule::per_client_ip(bucket("per-ip", 2)))
            .build()
            .unwrap(),
        inner,
    );
    // The inner error type passes through unchanged.
    fn error_is_infallible<S: Service<http::Request<hyper::body::Incoming>, Error = Infallible>>(
        _: &S,
    ) {
    }
    error_is_infallible(&limited);

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.unwrap();
            let svc = limited.clone();
            tokio::spawn(async move {
                let hyper_svc = hyper::service::service_fn(
                    move |mut req: http::Request<hyper::body::Incoming>| {
                        req.extensions_mut()
                            .insert(tollgate::identity::PeerAddr(peer));
                        svc.clone().oneshot(req)
                    },
                );
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), hyper_svc)
                    .await;
            });
        }
    });
    let from = ip("127.0.15.1");
    let r = send(a, from, "GET", "/", &[], b"").await;
    assert_eq!((r.status, r.body.as_str()), (StatusCode::OK, "hi"));
    assert!(
        r.header("ratelimit").is_none(),
        "admitted headers were switched off"
    );
    assert_eq!(
        send(a, from, "GET", "/", &[], b"").await.status,
        StatusCode::OK
    );
    let r = send(a, from, "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        r.header("ratelimit").is_some(),
        "refusals always carry the fields"
    );
}
