//! The guide's recipes that need a real server beyond a doctest: nginx in
//! front of a tollgate service, with exactly the configuration the
//! repository ships (`deploy/nginx/tollgate.conf`) and the guide shows.

mod common;

use std::path::PathBuf;

use axum::Router;
use axum::http::{HeaderName, StatusCode};
use axum::routing::get;
use common::nginx::Nginx;
use common::{ip, send, serve};
use tollgate::{ClientIpResolver, MemoryStore, Policy, Rate, RateLimitLayer, Rule};

const CONFIG: &str = "deploy/nginx/tollgate.conf";
const GUIDE: &str = "crates/tollgate/guide/08-recipes.md";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The guide shows the file as it is: a reader who copies the guide gets
/// the configuration this test runs.
#[test]
fn the_guides_nginx_configuration_is_the_one_tested() {
    let guide = read(GUIDE);
    let start = guide
        .find("```nginx\n")
        .expect("an nginx block in the guide")
        + 9;
    let end = start + guide[start..].find("```").expect("the block's end");
    assert_eq!(
        &guide[start..end],
        read(CONFIG),
        "{GUIDE}'s nginx block differs from {CONFIG}"
    );
}

/// Through nginx, a client is limited by the address nginx accepted it
/// from, whatever it writes in `X-Real-IP` or `X-Forwarded-For`; a client
/// that reaches the service without nginx is limited by its own address
/// and cannot spend another's budget by naming it.
#[tokio::test(flavor = "multi_thread")]
async fn behind_nginx_clients_are_limited_by_the_address_nginx_saw() {
    // nginx connects to the service from 127.0.0.2, the one address the
    // service believes `X-Real-IP` from.
    let nginx_addr = ip("127.0.0.2");
    let limits = RateLimitLayer::builder(MemoryStore::new())
        .client_ip(ClientIpResolver::single_proxy(
            nginx_addr,
            HeaderName::from_static("x-real-ip"),
        ))
        .rule(Rule::per_client_ip(
            Policy::token_bucket("per-ip", 1, Rate::per_hour(1)).unwrap(),
        ))
        .build()
        .unwrap();
    // Answers with the X-Forwarded-For it was given: nginx must not pass
    // the client's own chain on.
    let service = serve(
        Router::new()
            .route(
                "/",
                get(|headers: axum::http::HeaderMap| async move {
                    headers
                        .get_all("x-forwarded-for")
                        .iter()
                        .map(|v| v.to_str().unwrap_or("?").to_owned())
                        .collect::<Vec<_>>()
                        .join(" | ")
                }),
            )
            .layer(limits),
    )
    .await;
    let config = read(CONFIG);
    assert!(config.contains("proxy_pass http://127.0.0.1:3000;"));
    let server = format!(
        "proxy_bind {nginx_addr};\n{}",
        config.replace("127.0.0.1:3000", &service.to_string())
    );
    let nginx = tollgate_testkit::or_skip!(Nginx::start(&server));
    let via_nginx = |from: &'static str, forged: &'static str| async move {
        send(
            nginx.addr,
            ip(from),
            "GET",
            "/",
            &[("X-Real-IP", forged), ("X-Forwarded-For", forged)],
            b"",
        )
        .await
    };

    let first = via_nginx("127.0.0.5", "203.0.113.1").await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert_eq!(first.body, "127.0.0.5", "X-Forwarded-For as nginx saw it");
    // Another forged address is the same client to nginx, and to tollgate.
    let second = via_nginx("127.0.0.5", "203.0.113.2").await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(second.header("retry-after").is_some());
    // Another client has its own budget.
    assert_eq!(
        via_nginx("127.0.0.6", "127.0.0.5").await.status,
        StatusCode::OK
    );

    // Around nginx: the header is not believed from 127.0.0.7, which is
    // limited by its own address and leaves 127.0.0.8's budget whole.
    let direct = || {
        send(
            service,
            ip("127.0.0.7"),
            "GET",
            "/",
            &[("X-Real-IP", "127.0.0.8")],
            b"",
        )
    };
    assert_eq!(direct().await.status, StatusCode::OK);
    assert_eq!(direct().await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        via_nginx("127.0.0.8", "127.0.0.9").await.status,
        StatusCode::OK
    );
}
