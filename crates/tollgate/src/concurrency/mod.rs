//! The concurrency-limit middleware: bound the work still in flight.
//!
//! A token bucket bounds admitted work, not running work: slow requests stay
//! active while tokens refill. [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) protects scarce
//! worker or database capacity by counting a request from admission until
//! its response body has been fully sent, has failed, or has been dropped
//! (a client that disconnects mid-stream frees its slot).
//!
//! - per key (principal, client address, operation — the same key parts as
//!   the rate-limit layer; a fixed number, or found from each key's own
//!   latency with
//!   [`ConcurrencyLimitBuilder::per_key_adaptive`](crate::concurrency::ConcurrencyLimitBuilder::per_key_adaptive)):
//!   over the limit is `429`, whose (fixed limit)
//!   `RateLimit-Policy` names the unit `concurrent-requests`; no
//!   `Retry-After`, since no time can be promised;
//! - global: over the limit is `503`. The global limit is a fixed number
//!   ([`ConcurrencyLimitBuilder::global`](crate::concurrency::ConcurrencyLimitBuilder::global))
//!   or found from latency
//!   ([`ConcurrencyLimitBuilder::adaptive`](crate::concurrency::ConcurrencyLimitBuilder::adaptive),
//!   an [`AdaptiveLimit`]): fixed when you know what the backend can take
//!   and it does not move; adaptive when the right number moves with
//!   deploys, caches and the backend's own load, so that a number set too
//!   high lets a slow backend queue up until every request times out and
//!   one set too low refuses work it could do;
//! - a full global limit can be shared fairly between tenants
//!   ([`ConcurrencyLimitBuilder::fair_share`](crate::concurrency::ConcurrencyLimitBuilder::fair_share):
//!   weighted max-min over their recent demand, so a flood from one
//!   cannot take the slots the others need) and kept for higher
//!   [`Priority`] classes first
//!   ([`ConcurrencyLimitBuilder::priority`](crate::concurrency::ConcurrencyLimitBuilder::priority));
//! - refusal is immediate unless [`ConcurrencyLimitBuilder::wait`](crate::concurrency::ConcurrencyLimitBuilder::wait) allows a
//!   bounded number of waiters for a bounded time, served first come,
//!   first served; there is never an unbounded queue;
//! - an upgraded connection (WebSocket, `CONNECT`) answers with an empty
//!   body and lives on: keep the request's [`InFlight`] in the task that
//!   serves it to count it for its whole life.
//!
//! It composes with [`RateLimitLayer`](crate::RateLimitLayer) in either
//! order. A response body that makes no progress for
//! [`ConcurrencyLimitBuilder::body_idle_timeout`](crate::concurrency::ConcurrencyLimitBuilder::body_idle_timeout) (a minute by default) is
//! ended and its slot released at once, even when the client has stopped
//! reading and the server no longer polls it (an HTTP/2 stream whose
//! window stays at zero, a full TCP window); counted in
//! [`ConcurrencyStats::bodies_stalled`] and
//! `tollgate_stalled_bodies_total{layer}`. Put a timeout inside it too,
//! so a stuck request cannot hold a slot before its response head:
//! `tower_http::timeout::TimeoutLayer` bounds that time.
//!
//! By default the counts are this process's. With
//! [`ConcurrencyLimitBuilder::shared`](crate::concurrency::ConcurrencyLimitBuilder::shared) they hold across a fleet: every
//! request in flight holds a lease in a shared [`LeaseStore`](crate::store::LeaseStore)
//! (the Redis store is one), renewed while it runs and expiring on its own
//! if its instance dies; see there for what a paused process can do and
//! what a store failure does ([`OnLeaseError`]).
//!
//! ```
//! use std::num::NonZeroUsize;
//! use axum::{Router, routing::get};
//! use tollgate::{ConcurrencyLimitLayer, KeyPart};
//!
//! let slow = ConcurrencyLimitLayer::builder("slow")
//!     .per_key(NonZeroUsize::new(2).unwrap(), [KeyPart::Account])
//!     .global(NonZeroUsize::new(8).unwrap())
//!     .build()?;
//! let app: Router = Router::new().route("/slow", get(|| async { "done" }).route_layer(slow));
//! # let _ = app;
//! # Ok::<(), tollgate::InvalidLimit>(())
//! ```

mod body;
mod config;
mod future;
mod in_flight;
mod key_limits;
pub(crate) mod layer;
mod leases;
mod limiter;
mod refusal;
mod release;
mod service;
mod share;
mod stall;

pub use body::{BoxError, PermitBody};
pub use future::ResponseFuture;
pub use in_flight::InFlight;
pub use layer::{ConcurrencyLimitBuilder, MIN_LEASE_PER_STORE_TIMEOUT};
pub use leases::OnLeaseError;
pub use limiter::ConcurrencyStats;
pub use service::ConcurrencyLimit;
pub use stall::{BodyStalled, DEFAULT_BODY_IDLE_TIMEOUT};
pub use tollgate_budget::{
    AdaptiveConfig, AdaptiveConfigBuilder, AdaptiveLimit, Change, Claim, Failure,
    InvalidAdaptiveLimit, Priority, Sample, fair_shares,
};
