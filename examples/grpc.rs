//! tollgate in front of a gRPC service: tonic 0.14's generated health
//! service (`tonic-health`, no code generation needed) behind tollgate's
//! layers, served over HTTP/2 (and HTTP/1.1) on one port, and a tonic
//! client that calls it until it is refused.
//!
//! ```text
//! cargo run --example grpc                        # serve, run the client, exit
//! cargo run --example grpc -- --serve 127.0.0.1:50051   # serve only
//! cargo run --example grpc -- --store redis://127.0.0.1:6379
//! ```
//!
//! The contract (tests/grpc.rs relies on it):
//! - every call: per client address, a token bucket of 20 refilled 10 per
//!   second;
//! - per account (from the `authorization: Bearer KEY` metadata: `alice-key`
//!   is (north, alice), `bob-key` is (north, bob)): 3 refilled 1 per second;
//!   a call without a known key is refused `UNAUTHENTICATED`;
//! - per account at most 1 call in flight: a `Watch` stream holds its slot
//!   until it ends;
//! - refusals: `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms` and the
//!   `ratelimit-policy` / `ratelimit` fields as metadata, `UNAVAILABLE` when
//!   `--store` is unreachable (fail closed).
//!
//! tollgate's log (warnings and errors, e.g. the store unreachable) goes to
//! stderr. With `--serve` it prints `listening on http://ADDR` and serves
//! until killed; without it, it serves on a free port, runs the client below and
//! exits 0 when every answer was as the contract says.

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use tokio::net::TcpListener;
use tollgate::{
    ConcurrencyLimitLayer, KeyPart, MemoryStore, Policy, Principal, Rate, RateLimitLayer,
    RedisStore, Rule, store::DynStore,
};
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Stand-in authentication (not a pattern to copy): the bearer key in the
/// call's metadata names the principal.
async fn auth(mut req: Request, next: Next) -> Response {
    let principal = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|key| match key {
            "alice-key" => Some(Principal::new("north", "alice")),
            "bob-key" => Some(Principal::new("north", "bob")),
            _ => None,
        });
    if let Some(p) = principal {
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

async fn app(store: Arc<dyn DynStore>) -> Result<Router, Box<dyn std::error::Error>> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let limits = RateLimitLayer::builder(store)
        .rule(Rule::per_client_ip(Policy::token_bucket(
            "per-ip",
            20,
            Rate::per_second(10),
        )?))
        .rule(Rule::per_account(Policy::token_bucket(
            "per-account",
            3,
            Rate::per_second(1),
        )?))
        .build()?;
    let in_flight = ConcurrencyLimitLayer::builder("calls")
        .per_key(
            NonZeroUsize::new(1).ok_or("1 is not zero")?,
            [KeyPart::Account],
        )
        .build()?;
    // Keep the reporter alive with the service it reports for.
    let keep = Arc::new(reporter);
    Ok(tonic::service::Routes::new(health)
        .into_axum_router()
        .layer(in_flight)
        .layer(limits)
        .layer(middleware::from_fn(auth))
        .layer(axum::Extension(keep)))
}

fn check(key: Option<&str>) -> tonic::Request<HealthCheckRequest> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(Ok(v)) = key.map(|key| format!("Bearer {key}").parse()) {
        req.metadata_mut().insert("authorization", v);
    }
    req
}

/// What a refused call told the client, printed for a reader.
fn describe(status: &tonic::Status) -> String {
    let meta = |name: &str| {
        status
            .metadata()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_owned()
    };
    format!(
        "{:?} \"{}\" pushback-ms={} ratelimit={}",
        status.code(),
        status.message(),
        meta("grpc-retry-pushback-ms"),
        meta("ratelimit")
    )
}

/// The client: calls until refused, then shows the other refusals.
async fn client(addr: SocketAddr) -> Result<bool, Box<dyn std::error::Error>> {
    let channel = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let mut health = HealthClient::new(channel);
    let mut ok = true;
    // Alice's budget of 3: three answers, then RESOURCE_EXHAUSTED.
    for n in 1..=4 {
        match health.check(check(Some("alice-key"))).await {
            Ok(r) => {
                println!("call {n}: {:?}", r.into_inner().status());
                ok &= n <= 3;
            }
            Err(status) => {
                println!("call {n}: {}", describe(&status));
                ok &= n == 4 && status.code() == Code::ResourceExhausted;
            }
        }
    }
    // No key: UNAUTHENTICATED.
    let unknown = health.check(check(None)).await;
    match &unknown {
        Ok(_) => ok = false,
        Err(status) => {
            println!("no key: {}", describe(status));
            ok &= status.code() == Code::Unauthenticated;
        }
    }
    // Bob's Watch stream holds his one slot: a Check of his meanwhile is
    // refused; once the stream is dropped, it is admitted.
    let mut watch = health.watch(check(Some("bob-key"))).await?.into_inner();
    let first = watch.message().await?;
    println!("bob's watch: {:?}", first.map(|m| m.status()));
    match health.check(check(Some("bob-key"))).await {
        Ok(_) => ok = false,
        Err(status) => {
            println!("bob while watching: {}", describe(&status));
            ok &= status.code() == Code::ResourceExhausted;
        }
    }
    drop(watch);
    let mut admitted = false;
    for _ in 0..100 {
        if health.check(check(Some("bob-key"))).await.is_ok() {
            admitted = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    println!("bob after the stream ended: admitted {admitted}");
    ok &= admitted;
    Ok(ok)
}

#[tokio::main]
async fn main() -> ExitCode {
    // tollgate's log on stderr: what an operator sees, e.g. the store
    // unreachable (once, then at most every ten seconds with a count).
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let (mut serve, mut store_url) = (None, None);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--serve", Some(addr)) => serve = Some(addr),
            ("--store", Some(url)) => store_url = Some(url),
            _ => {
                eprintln!("usage: grpc [--serve HOST:PORT] [--store redis://HOST:PORT]");
                return ExitCode::from(2);
            }
        }
    }
    let store: Arc<dyn DynStore> = match store_url {
        None => Arc::new(MemoryStore::new()),
        Some(url) => match RedisStore::builder(&url).and_then(|b| b.build()) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                eprintln!("--store {url}: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let app = match app(store).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("bad configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    let bind = serve.clone().unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let listener = match TcpListener::bind(&bind).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {bind}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(addr) = listener.local_addr() else {
        return ExitCode::FAILURE;
    };
    println!("listening on http://{addr}");
    // axum::serve speaks HTTP/1.1 and HTTP/2 (prior knowledge) on one port.
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    if serve.is_some() {
        return match server.await {
            Ok(Ok(())) => ExitCode::SUCCESS,
            _ => ExitCode::FAILURE,
        };
    }
    let result = client(addr).await;
    server.abort();
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("an answer was not what the contract says");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("client error: {e}");
            ExitCode::FAILURE
        }
    }
}
