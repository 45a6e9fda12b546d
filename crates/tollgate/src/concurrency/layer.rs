//! [`ConcurrencyLimitLayer`]: the limits (global, per key, queueing) and
//! their copy-on-change builders.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use tollgate_core::{InvalidName, check_name};
use tower_layer::Layer;

use super::ConcurrencyLimit;
use super::limiter::{ConcurrencyStats, Limiter, Limits};
use crate::ClientIpResolver;
use crate::identity::{KeyPart, MissingPrincipal};

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) limiter: Arc<Limiter>,
    pub(crate) key: Vec<KeyPart>,
    pub(crate) missing: MissingPrincipal,
    pub(crate) resolver: ClientIpResolver,
}

/// Bounds the requests in flight: globally, per key, or both.
///
/// A request is in flight from admission until its response body has ended,
/// failed or been dropped. Over a per-key limit: `429` (its
/// `RateLimit-Policy` unit is `concurrent-requests`; no `Retry-After`, since
/// no time can be promised). Over the global limit: `503`. Both are
/// `no-store`, and immediate unless bounded waiting is configured.
///
/// Builder methods consume and return the layer; the counts are shared by
/// every service the layer makes, and [`ConcurrencyLimitLayer::stats`] reads
/// them.
#[must_use]
#[derive(Clone)]
pub struct ConcurrencyLimitLayer {
    config: Arc<Config>,
}

impl fmt::Debug for ConcurrencyLimitLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.config.limiter.limits;
        f.debug_struct("ConcurrencyLimitLayer")
            .field("name", &l.name)
            .field("global", &l.global_max)
            .field("per_key", &l.per_key_max)
            .field("key", &self.config.key)
            .field("waiting", &l.waiting)
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimitLayer {
    /// A limit named `name` (used in headers and metrics) with no bounds
    /// yet. Names follow the rule of policy names ([`check_name`]).
    pub fn new(name: &str) -> Result<Self, InvalidName> {
        check_name(name)?;
        Ok(Self {
            config: Arc::new(Config {
                limiter: Arc::new(Limiter::new(Limits {
                    name: name.into(),
                    global_max: None,
                    per_key_max: None,
                    waiting: None,
                })),
                key: Vec::new(),
                missing: MissingPrincipal::Reject,
                resolver: ClientIpResolver::peer_only(),
            }),
        })
    }

    /// Copy-on-change, as [`RateLimitLayer`](crate::RateLimitLayer)'s
    /// builders: services already made keep their configuration. The
    /// limiter (and its counts) is made afresh from the new limits.
    fn edit(mut self, f: impl FnOnce(&mut Config, &mut Limits)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        let mut limits = config.limiter.limits.clone();
        f(config, &mut limits);
        config.limiter = Arc::new(Limiter::new(limits));
        self
    }

    /// At most `max` requests in flight through this layer in all (503 beyond).
    pub fn global(self, max: NonZeroUsize) -> Self {
        self.edit(|_, l| l.global_max = Some(max.get()))
    }

    /// At most `max` requests in flight per key built from `parts` (429
    /// beyond), e.g. `[KeyPart::Account]`.
    pub fn per_key(self, max: NonZeroUsize, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        let parts: Vec<KeyPart> = parts.into_iter().collect();
        self.edit(|c, l| {
            l.per_key_max = Some(max.get());
            c.key = parts;
        })
    }

    /// Lets at most `max_waiters` requests wait, each at most `max_wait`,
    /// for a permit before being refused. Without it, refusal is immediate.
    pub fn wait(self, max_waiters: usize, max_wait: Duration) -> Self {
        self.edit(|_, l| l.waiting = Some((max_waiters, max_wait)))
    }

    /// What to do when the per-key parts need a principal and there is none
    /// (default: 401).
    pub fn when_no_principal(self, what: MissingPrincipal) -> Self {
        self.edit(|c, _| c.missing = what)
    }

    /// How client addresses are resolved for [`KeyPart::ClientIp`].
    pub fn client_ip(self, resolver: ClientIpResolver) -> Self {
        self.edit(|c, _| c.resolver = resolver)
    }

    /// The counters: in flight, waiting, refused.
    pub fn stats(&self) -> ConcurrencyStats {
        self.config.limiter.stats()
    }
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::from_config(inner, self.config.clone())
    }
}
