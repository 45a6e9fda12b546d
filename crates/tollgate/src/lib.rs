//! Rate limiting and admission control for Rust HTTP services, as Tower
//! middleware.
//!
//! - [`RateLimitLayer`] resolves who is asking (a verified [`Principal`], or
//!   a client address through a trusted-proxy boundary) into tuple keys,
//!   charges every applicable [`Rule`] whose key and cost are known in one
//!   all-or-nothing [`Store`] call (also when it then refuses the request
//!   for its own reasons, so guessing is limited too), and answers
//!   refusals with `429`, `Retry-After` and the IETF `RateLimit-Policy` /
//!   `RateLimit` fields.
//! - [`ConcurrencyLimitLayer`] bounds requests in flight, globally and per
//!   key, until their response bodies end.
//! - Policies, rates and the in-memory store are here; what a store author
//!   needs beyond them is in [`store`] (from the `tollgate-budget` crate,
//!   re-exported so that `tollgate` is the one dependency).
//!
//! With axum, turn on the `axum` feature: without it the layer cannot read
//! axum's `ConnectInfo`, sees no client address and answers `500`
//! (logged) to rules keyed by it.
//!
//! ```toml
//! [dependencies]
//! tollgate = { version = "0.1", features = ["axum"] }
//! ```
//!
//! # Example: an axum API
//!
//! An authentication middleware verifies the caller and inserts a
//! [`Principal`]; the limiter never reads a credential itself. Every
//! request is charged to its client address, and `POST /export` also to
//! the account, per operation. The server is served with connect info so
//! the layer sees the peer address.
//!
//! ```no_run
//! use std::net::SocketAddr;
//!
//! use axum::{
//!     Router,
//!     extract::Request,
//!     http::StatusCode,
//!     middleware::{self, Next},
//!     response::Response,
//!     routing::{get, post},
//! };
//! use tollgate::{MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule};
//!
//! /// Your authentication: verify the bearer key, then say who the caller is.
//! async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
//!     let bearer = req
//!         .headers()
//!         .get("authorization")
//!         .and_then(|v| v.to_str().ok())
//!         .and_then(|v| v.strip_prefix("Bearer "));
//!     match bearer {
//!         // Look the key up in your own store; never use the secret as an id.
//!         Some("demo-key") => {
//!             let who = Principal::new("north", "alice").with_credential("key-1");
//!             req.extensions_mut().insert(who);
//!             Ok(next.run(req).await)
//!         }
//!         _ => Err(StatusCode::UNAUTHORIZED),
//!     }
//! }
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let per_ip = Policy::token_bucket("per-ip", 20, Rate::per_second(10)).unwrap();
//!     let export = Policy::token_bucket("export", 3, Rate::per_minute(6)).unwrap();
//!
//!     // Address rules go outside authentication, so a `401` for a guessed
//!     // key still spends from the guesser's address.
//!     let by_address = RateLimitLayer::builder(MemoryStore::new())
//!         .rule(Rule::per_client_ip(per_ip))
//!         .build()?;
//!     let by_account = RateLimitLayer::builder(MemoryStore::new())
//!         .rule(Rule::per_account_operation(export).on_route("/export"))
//!         .build()?;
//!
//!     let app = Router::new()
//!         .route("/", get(|| async { "hello" }))
//!         .route("/export", post(|| async { "exported" }))
//!         .layer(by_account)
//!         .layer(middleware::from_fn(authenticate))
//!         .layer(by_address);
//!
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//!     axum::serve(
//!         listener,
//!         app.into_make_service_with_connect_info::<SocketAddr>(),
//!     )
//!     .await?;
//!     Ok(())
//! }
//! ```
//!
//! Behind a reverse proxy, add
//! `.client_ip(ClientIpResolver::trusting(networks, ForwardedHeader::XForwardedFor)?)`
//! with the proxy's networks (see [`ClientIpResolver`], and the
//! [nginx recipe](guide::recipes)); without it, forwarding headers are
//! ignored and the connected peer is the client.
//!
//! # Where things are
//!
//! | module | job |
//! |---|---|
//! | [`guide`] | the guide, in chapters: every recipe and reference beyond this page |
//! | [`rate_limit`] | the rate-limit service and its builder: the table of answers ([`RateLimitLayer`], [`Rule`] and [`Cost`] are at the root), the order they are given in, when a charge is made |
//! | [`identity`] | who is asking: client addresses behind proxies, forwarding headers, peer addresses ([`Principal`], [`ClientIpResolver`], [`Operation`], [`KeyPart`] are at the root) |
//! | [`concurrency`] | the in-flight service, its builder, counters and the [`concurrency::InFlight`] handle ([`ConcurrencyLimitLayer`] is at the root) |
//! | [`store`] | for store authors and tests: charges, [`Decision`](crate::store::Decision) / [`Outcome`](crate::store::Outcome) / [`Verdict`](crate::store::Verdict), keys, leases, clocks, the in-memory store's builder |
//! | [`client`] | `Retry-After` parsing and a retry policy for callers (feature `client`) |
//! | `redis` | the Redis store's builder and counters (feature `redis`; `RedisStore` is at the root) |
//!
//! # Features
//!
//! - `axum`: read axum's `MatchedPath` (route identity) and
//!   `ConnectInfo<SocketAddr>` (peer address).
//! - `metrics`: counters and histograms through the `metrics` facade.
//! - `client`: `Retry-After` parsing and a retry policy ([`client`]).
//! - `redis`: the Redis store for fleets, re-exported as `tollgate::redis`.
//! - `serde`: policies as data (`rate_limit::PolicySet`,
//!   `RulesHandle::apply`); with `redis`, one policy set for a fleet
//!   (`redis::FleetPolicies`).
#![cfg_attr(docsrs, feature(doc_cfg))]

mod body;
#[cfg(feature = "client")]
pub mod client;
pub mod concurrency;
#[cfg(all(feature = "redis", feature = "serde"))]
mod fleet_policies;
pub mod guide;
pub mod identity;
mod observe;
pub mod rate_limit;
#[cfg(feature = "redis")]
pub mod redis;
mod response;
pub mod store;

pub use body::ResponseBody;
pub use concurrency::layer::{ConcurrencyLimitLayer, InvalidLimit};
pub use identity::client_ip::ClientIpResolver;
pub use identity::keys::{KeyPart, MissingPrincipal};
pub use identity::operation::Operation;
pub use identity::principal::Principal;
pub use observe::set_log_fingerprint_key;
pub use rate_limit::config::OnStoreError;
pub use rate_limit::exempt::Exemption;
pub use rate_limit::handle::RulesHandle;
pub use rate_limit::invalid::InvalidRule;
pub use rate_limit::layer::RateLimitLayer;
pub use rate_limit::rule::{Cost, Rule};
pub use response::{RefusalBody, RefusalInfo};
pub use tollgate_budget::{
    Initial, InvalidName, InvalidPolicy, MemoryStore, Policy, Rate, Store, StoreError, Unit,
};
#[cfg(feature = "redis")]
pub use tollgate_redis::RedisStore;

/// The README's examples, compiled as doctests so they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
