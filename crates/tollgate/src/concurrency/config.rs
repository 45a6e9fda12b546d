//! What a [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer) is made
//! of, shared by the layer, its services and their futures.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use tollgate_budget::LeaseStore;

use super::leases::{Leases, OnLeaseError};
use super::limiter::Limiter;
use super::stall::Stalls;
use crate::ClientIpResolver;
use crate::identity::{KeyPart, MissingPrincipal};
use crate::rate_limit::Exemption;
use crate::response::Shape;

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) limiter: Arc<Limiter>,
    /// Where the limit is shared by a fleet, if it is, and how.
    pub(crate) lease_store: Option<Arc<dyn LeaseStore>>,
    pub(crate) lease: LeaseOptions,
    /// The shared limit's counters in this process (made with `limiter`).
    pub(crate) leases: Option<Arc<Leases>>,
    pub(crate) key: Vec<KeyPart>,
    pub(crate) missing: MissingPrincipal,
    pub(crate) resolver: ClientIpResolver,
    /// How long a response body may make no progress.
    pub(crate) body_idle: Duration,
    /// The watch over response bodies in flight (made with `limiter`).
    pub(crate) stalls: Arc<Stalls>,
    /// Requests that skip the limit.
    pub(crate) exemptions: Vec<Exemption>,
    /// The application's refusal bodies, if it writes them.
    pub(crate) shape: Option<Shape>,
    /// The challenge sent with `401` (RFC 9110 requires one).
    pub(crate) www_authenticate: HeaderValue,
}

/// A shared limit's lease: how long, how often waiters poll, what a store
/// failure does.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseOptions {
    pub(crate) ttl: Duration,
    pub(crate) poll: Duration,
    pub(crate) on_error: OnLeaseError,
}

impl Default for LeaseOptions {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(10),
            poll: Duration::from_millis(50),
            on_error: OnLeaseError::FailClosed,
        }
    }
}
