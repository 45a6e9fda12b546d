//! The client side of the conversation: parse `Retry-After` and retry
//! throttled requests no earlier than the server asked (feature `client`).
//!
//! This lives in `tollgate` behind a feature rather than in its own crate:
//! it is small, shares the HTTP vocabulary of the server side, and the
//! feature keeps tower's retry machinery out of server builds that do not
//! want it. (tokio's timer is there either way: the concurrency limit's
//! bounded waiting uses it; the client sleeps with it through
//! [`TokioSleep`], or with any [`Sleep`] you give it.)
//!
//! ```
//! use std::time::Duration;
//! use tollgate::client::{RetryConfig, RetryPolicy};
//! use tower::retry::RetryLayer;
//!
//! let policy = RetryPolicy::new(
//!     RetryConfig::new()
//!         .max_attempts(4)
//!         .deadline(Duration::from_secs(30))
//!         .reserve(Duration::from_secs(2)),
//! );
//! // Wrap any tower Service<http::Request<B>> (B: Clone), e.g. a hyper-util client.
//! let layer = RetryLayer::new(policy);
//! # let _ = layer;
//! ```

mod policy;
mod retry_after;

pub use policy::{Attempt, Jitter, RandomJitter, RetryConfig, RetryPolicy, Sleep, TokioSleep};
pub use retry_after::{InvalidRetryAfter, retry_after};
