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
pub const MODES: &str = "bare, tollgate, tollgate-front, governor, bare-export, tollgate-export, \
                         floor-empty or floor-refusal";

/// Whether `mode` serves the export workload (`POST /export`, with
/// [`EXPORT_AUTHORIZATION`]) rather than `GET /`.
pub fn is_export(mode: &str) -> bool {
    mode.ends_with("-export")
}

/// Whether `mode` has a rate limiter, so that `refuse` changes what it
/// admits.
pub fn is_limited(mode: &str) -> bool {
    !mode.starts_with("bare") && !mode.starts_with("floor")
}

/// The floors a limiter's figures are compared with, as services that
/// answer every request alike and do nothing else: concrete types (not
/// boxed: a clone per request copies two words) whose answers are built
/// from `'static` parts (no reference counts).
/// - `floor-empty` ([`Floor::empty`]) answers an empty `200`: what the
///   harness and the server cost on their own;
/// - `floor-refusal` ([`Floor::refusal`]) answers a copy of the front
///   door's refusal (its status, its head in a map sized to it, as
///   tollgate's template is, and its body, taken from one real refusal),
///   deciding and rendering nothing: what any limiter that answers with
///   that refusal pays at least, however fast it decides.
///
/// `B` is the body type: the in-process count takes the cheapest
/// (`http_body_util::Full<Bytes>`: no box), `axum::serve` takes axum's
/// `Body`.
#[derive(Clone, Copy, Debug)]
pub struct Floor {
    /// `None` for the empty floor.
    refusal: Option<&'static Refusal>,
}

/// The parts of the copied refusal, made `'static` once.
#[derive(Debug)]
struct Refusal {
    status: StatusCode,
    headers: http::HeaderMap,
    body: &'static [u8],
}

impl Floor {
    /// The floor `mode` names (`floor-empty`, `floor-refusal`), or `None`
    /// for a mode that is not a floor.
    pub async fn of(mode: &str) -> Option<Result<Self, String>> {
        match mode {
            "floor-empty" => Some(Ok(Self::empty())),
            "floor-refusal" => Some(Self::refusal().await),
            _ => None,
        }
    }

    /// The empty floor.
    pub fn empty() -> Self {
        Self { refusal: None }
    }

    /// The refusal floor: a copy of one refusal of the [`front_door`],
    /// kept for the rest of the process.
    pub async fn refusal() -> Result<Self, String> {
        let (status, copied, body) = refusal_copy().await?;
        let leak = |bytes: &[u8]| -> Result<&'static str, String> {
            let text = String::from_utf8(bytes.to_vec()).map_err(|e| e.to_string())?;
            Ok(Box::leak(text.into_boxed_str()))
        };
        let mut headers = http::HeaderMap::with_capacity(copied.len());
        for (name, value) in &copied {
            headers.append(
                http::HeaderName::from_static(leak(name.as_str().as_bytes())?),
                http::HeaderValue::from_static(leak(value.as_bytes())?),
            );
        }
        let refusal = Refusal {
            status,
            headers,
            body: Box::leak(body.to_vec().into_boxed_slice()),
        };
        Ok(Self {
            refusal: Some(Box::leak(Box::new(refusal))),
        })
    }

    /// The answer, in body type `B`.
    pub fn answer<B: From<bytes::Bytes> + Default>(&self) -> http::Response<B> {
        let Some(refusal) = self.refusal else {
            return http::Response::new(B::default());
        };
        let mut res = http::Response::new(B::from(bytes::Bytes::from_static(refusal.body)));
        *res.status_mut() = refusal.status;
        *res.headers_mut() = refusal.headers.clone();
        res
    }

    /// As a service answering [`Floor::answer`] in body type `B` to every
    /// request.
    pub fn service<B>(
        self,
    ) -> impl tower::Service<
        Request,
        Response = http::Response<B>,
        Error = std::convert::Infallible,
        Future = std::future::Ready<Result<http::Response<B>, std::convert::Infallible>>,
    > + Clone
    + Send
    + Sync
    + 'static
    where
        B: From<bytes::Bytes> + Default + Send + 'static,
    {
        tower::service_fn(move |_req: Request| std::future::ready(Ok(self.answer::<B>())))
    }
}

/// One refusal of the [`front_door`], taken apart: its status, head and
/// body.
async fn refusal_copy() -> Result<(StatusCode, http::HeaderMap, bytes::Bytes), String> {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let app = front_door(true)?;
    let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 40_000));
    let mut last = None;
    // The first request is admitted, the second refused.
    for _ in 0..2 {
        let req = Request::builder()
            .uri("/")
            .extension(axum::extract::ConnectInfo(peer))
            .body(axum::body::Body::empty())
            .map_err(|e| e.to_string())?;
        let Ok(res) = app.clone().oneshot(req).await;
        last = Some(res);
    }
    let res = last.ok_or("no response")?;
    if res.status() != StatusCode::TOO_MANY_REQUESTS {
        return Err(format!("expected a refusal, got {}", res.status()));
    }
    let (parts, body) = res.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((parts.status, parts.headers, body))
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
