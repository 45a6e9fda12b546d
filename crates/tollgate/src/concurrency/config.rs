//! What a [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer) is made
//! of, shared by the layer, its services and their futures.

use std::sync::Arc;
use std::time::Duration;

use std::num::NonZeroU32;

use http::HeaderValue;
use http::request::Parts;
use tollgate_budget::{LeaseStore, Priority};

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
    /// With fair share: the parts of a tenant's key, and its weight.
    pub(crate) fair: Option<FairShare>,
    /// With priorities: each request's class.
    pub(crate) priority: Option<ClassFn>,
}

/// A request's weight for fair share.
pub(crate) type WeightFn = Arc<dyn Fn(&Parts) -> NonZeroU32 + Send + Sync>;

/// A request's priority class.
pub(crate) type ClassFn = Arc<dyn Fn(&Parts) -> Priority + Send + Sync>;

/// Who a full global limit is shared between, and by what weights.
#[derive(Clone)]
pub(crate) struct FairShare {
    pub(crate) parts: Vec<KeyPart>,
    /// `None`: every tenant weighs 1.
    pub(crate) weight: Option<WeightFn>,
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
