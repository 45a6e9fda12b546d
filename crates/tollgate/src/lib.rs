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
//! - The budget arithmetic, keys and stores come from [`tollgate_core`],
//!   re-exported here.
//!
//! See the [`rate_limit`] module for the full table of answers and an axum
//! example.
//!
//! # Features
//!
//! - `axum`: read axum's `MatchedPath` (route identity) and
//!   `ConnectInfo<SocketAddr>` (peer address).
//! - `metrics`: counters and histograms through the `metrics` facade.
//! - `client`: `Retry-After` parsing and a retry policy ([`client`]).
//! - `redis`: the Redis store for fleets, re-exported as `tollgate::redis`.

mod body;
#[cfg(feature = "client")]
pub mod client;
pub mod concurrency;
pub mod identity;
mod observe;
pub mod rate_limit;
mod response;

pub use body::ResponseBody;
pub use concurrency::{ConcurrencyLimit, ConcurrencyLimitLayer};
pub use identity::{
    ClientIp, ClientIpError, ClientIpResolver, ForwardedHeader, InvalidPrefix,
    InvalidTrustedNetwork, KeyPart, MissingPrincipal, Operation, PeerAddr, Principal,
};
pub use rate_limit::{
    Cost, CostError, InvalidRoute, OnStoreError, RateLimit, RateLimitLayer, Rule,
};
pub use tollgate_core::{
    self as core, Algorithm, Charge, Clock, Decision, DynStore, Initial, InvalidCharge, InvalidKey,
    InvalidName, InvalidPolicy, Key, ManualClock, MemoryStore, MemoryStoreBuilder,
    MemoryStoreStats, OnKeyCap, Outcome, Policy, Rate, Store, StoreError, StoreErrorKind,
    SystemClock, Unit, Verdict,
};
/// The Redis store (feature `redis`): see [`tollgate_redis`].
#[cfg(feature = "redis")]
pub use tollgate_redis as redis;
#[cfg(feature = "redis")]
pub use tollgate_redis::RedisStore;

/// The README's examples, compiled as doctests so they stay true.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
