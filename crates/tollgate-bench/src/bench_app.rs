//! The axum apps the HTTP overhead measurements share (`bench_server` over
//! loopback, `profile_layer` in process), with equivalent quotas that admit
//! everything or, with `refuse`, refuse everything after the first request.
//!
//! Two workloads:
//! tollgate's layers answer in axum's own body type (`with_inner_body`), as
//! the guide deploys them with axum.
//!
//! - `GET /`, a hello-world: `bare`, behind tollgate (in-memory, per client
//!   address) or behind tower_governor (its default peer-address key);
//!   `tollgate-front` is tollgate's rule at the front door
//!   ([`front_door`]): around the router, so that a refusal is answered
//!   before axum routes, where the others sit inside it (`Router::layer`);
//! - `POST /export`, the quickstart's multi-rule shape: a stand-in
//!   authentication layer puts a [`Principal`] into the request (for
//!   requests carrying [`EXPORT_AUTHORIZATION`]), and `tollgate-export`
//!   charges a per-address rule and a per-(account, operation) rule on
//!   `/export` together. `bare-export` is the same app with the
//!   authentication layer and without tollgate, the baseline that leaves
//!   only tollgate's cost in the difference. With `refuse`, the
//!   per-account rule refuses (an account over its export budget, its
//!   address well within its own).

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use tollgate::{MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

/// The `Authorization` value the export workload sends; the stand-in
/// authentication answers `401` without it. `benches/http.sh` sends the same.
pub const EXPORT_AUTHORIZATION: &str = "Bearer bench-key";

/// The route the export workload posts to.
pub const EXPORT_PATH: &str = "/export";

/// The modes [`app`] knows, for usage messages.
pub const MODES: &str = "bare, tollgate, tollgate-front, governor, bare-export or tollgate-export";

/// Whether `mode` serves the export workload (`POST /export`, with
/// [`EXPORT_AUTHORIZATION`]) rather than `GET /`.
pub fn is_export(mode: &str) -> bool {
    mode.ends_with("-export")
}

/// Whether `mode` has a rate limiter, so that `refuse` changes what it
/// admits.
pub fn is_limited(mode: &str) -> bool {
    !mode.starts_with("bare")
}

/// The hello-world app, with tollgate's per-address rule around it: the
/// front door, where a request it refuses never reaches the router. Its
/// responses are axum's (`with_inner_body`), served as they are.
pub type FrontDoor =
    tollgate::rate_limit::RateLimit<Router, MemoryStore, tollgate::rate_limit::InnerBody>;

/// `tollgate-front`: the hello-world [`FrontDoor`].
pub fn front_door(refuse: bool) -> Result<FrontDoor, String> {
    let policy = if refuse {
        refusing("bench")
    } else {
        admitting("bench")
    }?;
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .headers_on_admitted(false)
        .rule(Rule::per_client_ip(policy))
        .build()
        .map_err(|e| e.to_string())?
        .with_inner_body();
    Ok(tower::Layer::layer(&layer, hello()))
}

/// The hello-world router, its handler turned into a route once, as
/// `axum::serve` does for a router it serves itself (`into_make_service`
/// calls `with_state(())`). A router used as a plain service (here, and
/// wrapped by a layer at the front door) would otherwise turn its handler
/// into a route, and apply every `Router::layer` to it, on every request.
fn hello() -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }))
        .with_state(())
}

/// The app for `mode` (one of [`MODES`] but `tollgate-front`: see
/// [`front_door`]), or why not.
pub fn app(mode: &str, refuse: bool) -> Result<Router, String> {
    let hello = hello();
    let export = Router::new()
        .route(EXPORT_PATH, post(|| async { "export started" }))
        .with_state(());
    match mode {
        "bare" => Ok(hello),
        "tollgate" => {
            let policy = if refuse {
                refusing("bench")
            } else {
                admitting("bench")
            }?;
            Ok(hello.layer(
                RateLimitLayer::builder(MemoryStore::new())
                    .headers_on_admitted(false)
                    .rule(Rule::per_client_ip(policy))
                    .build()
                    .unwrap()
                    .with_inner_body(),
            ))
        }
        "governor" => {
            let mut builder = GovernorConfigBuilder::default();
            if refuse {
                builder.per_second(3600).burst_size(1);
            } else {
                builder.per_nanosecond(1).burst_size(1_000_000_000);
            }
            let config = builder.finish().ok_or("invalid tower_governor config")?;
            Ok(hello.layer(GovernorLayer::new(config)))
        }
        "bare-export" => Ok(export.layer(middleware::from_fn(authenticate))),
        "tollgate-export" => {
            let per_ip = admitting("per-ip")?;
            let per_account = if refuse {
                refusing("export")
            } else {
                admitting("export")
            }?;
            Ok(export
                .layer(
                    RateLimitLayer::builder(MemoryStore::new())
                        .headers_on_admitted(false)
                        .rule(Rule::per_client_ip(per_ip))
                        .rule(Rule::per_account_operation(per_account).on_route(EXPORT_PATH))
                        .build()
                        .unwrap()
                        .with_inner_body(),
                )
                // Outside the limiter, as an authentication layer goes.
                .layer(middleware::from_fn(authenticate)))
        }
        "tollgate-front" => Err("tollgate-front is not a router: see front_door".into()),
        other => Err(format!("unknown mode {other:?}: {MODES}")),
    }
}

/// A billion per second with a billion of burst: never refuses here.
fn admitting(name: &str) -> Result<Policy, String> {
    Policy::token_bucket(name, 1_000_000_000, Rate::per_second(1_000_000_000))
        .map_err(|e| e.to_string())
}

/// One per hour: admits the first request only.
fn refusing(name: &str) -> Result<Policy, String> {
    Policy::token_bucket(name, 1, Rate::per_hour(1)).map_err(|e| e.to_string())
}

/// Stands in for an authentication layer, as the quickstart's demo does:
/// the bench's bearer key is (north, alice) with a stable credential id;
/// anything else is `401`, so a workload that forgot the header cannot pass
/// for a fast one.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let known = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .is_some_and(|v| v.as_bytes() == EXPORT_AUTHORIZATION.as_bytes());
    if !known {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    req.extensions_mut()
        .insert(Principal::new("north", "alice").with_credential("alice-1"));
    next.run(req).await
}
