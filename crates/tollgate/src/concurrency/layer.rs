use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::ConcurrencyLimit;
use super::limiter::{ConcurrencyStats, Limiter};
use crate::ClientIpResolver;
use crate::identity::{KeyPart, MissingPrincipal};

/// A concurrency limit's name was not usable in headers and metrics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid concurrency limit name {0:?}: use 1..=64 ASCII letters, digits, '-', '_' or '.'")]
pub struct InvalidLimitName(String);

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
        let l = &self.config.limiter;
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
    /// yet.
    pub fn new(name: &str) -> Result<Self, InvalidLimitName> {
        let ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !ok {
            return Err(InvalidLimitName(name.to_owned()));
        }
        Ok(Self {
            config: Arc::new(Config {
                limiter: Arc::new(Limiter::new(name.into(), None, None, None)),
                key: Vec::new(),
                missing: MissingPrincipal::Reject,
                resolver: ClientIpResolver::peer_only(),
            }),
        })
    }

    fn rebuild(self, f: impl FnOnce(&mut Settings)) -> Self {
        let c = &*self.config;
        let l = &*c.limiter;
        let mut s = Settings {
            name: l.name.clone(),
            global: l.global_max,
            per_key: l.per_key_max,
            waiting: l.waiting,
            key: c.key.clone(),
            missing: c.missing,
            resolver: c.resolver.clone(),
        };
        f(&mut s);
        Self {
            config: Arc::new(Config {
                limiter: Arc::new(Limiter::new(s.name, s.global, s.per_key, s.waiting)),
                key: s.key,
                missing: s.missing,
                resolver: s.resolver,
            }),
        }
    }

    /// At most `max` requests in flight through this layer in all (503 beyond).
    pub fn global(self, max: NonZeroUsize) -> Self {
        self.rebuild(|s| s.global = Some(max.get()))
    }

    /// At most `max` requests in flight per key built from `parts` (429
    /// beyond), e.g. `[KeyPart::Account]`.
    pub fn per_key(self, max: NonZeroUsize, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        let parts: Vec<KeyPart> = parts.into_iter().collect();
        self.rebuild(|s| {
            s.per_key = Some(max.get());
            s.key = parts;
        })
    }

    /// Lets at most `max_waiters` requests wait, each at most `max_wait`,
    /// for a permit before being refused. Without it, refusal is immediate.
    pub fn wait(self, max_waiters: usize, max_wait: Duration) -> Self {
        self.rebuild(|s| s.waiting = Some((max_waiters, max_wait)))
    }

    /// What to do when the per-key parts need a principal and there is none
    /// (default: 401).
    pub fn when_no_principal(self, what: MissingPrincipal) -> Self {
        self.rebuild(|s| s.missing = what)
    }

    /// How client addresses are resolved for [`KeyPart::ClientIp`].
    pub fn client_ip(self, resolver: ClientIpResolver) -> Self {
        self.rebuild(|s| s.resolver = resolver)
    }

    /// The counters: in flight, waiting, refused.
    pub fn stats(&self) -> ConcurrencyStats {
        self.config.limiter.stats()
    }
}

struct Settings {
    name: Arc<str>,
    global: Option<usize>,
    per_key: Option<usize>,
    waiting: Option<(usize, Duration)>,
    key: Vec<KeyPart>,
    missing: MissingPrincipal,
    resolver: ClientIpResolver,
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::from_config(inner, self.config.clone())
    }
}
