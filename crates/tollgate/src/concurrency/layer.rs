//! [`ConcurrencyLimitLayer`] and its [`ConcurrencyLimitBuilder`]: the
//! limits (global, per key, queueing), checked once when built.

use std::fmt;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use tollgate_budget::{AdaptiveConfig, InvalidName, LeaseStore, Priority, check_name};
use tower_layer::Layer;

use super::ConcurrencyLimit;
use super::config::{ClassFn, Config, FairShare, LeaseOptions, WeightFn};
use super::leases::{Leases, MAX_LEASE, MIN_LEASE, OnLeaseError, Sharing};
use super::limiter::{ConcurrencyStats, FailureWhen, Limiter, Limits};
use super::stall::{DEFAULT_BODY_IDLE_TIMEOUT, Stalls};
use crate::ClientIpResolver;
use crate::identity::{KeyPart, MissingPrincipal};
use crate::rate_limit::Exemption;
use crate::response::{RefusalBody, RefusalInfo, Shape};
use http::{HeaderValue, StatusCode};

/// A shared limit's lease must last at least this many times its lease
/// store's timeout ([`LeaseStore::timeout`]): renewals go every third of
/// the lease, and one may reach the store a timeout after it was sent, so
/// a lease at least three timeouts long is renewed in time even when one
/// renewal times out and the next takes the whole timeout to arrive.
pub const MIN_LEASE_PER_STORE_TIMEOUT: u32 = 3;

/// A shared limit's lease too short for its store's timeout: a renewal
/// could arrive after the lease expired, and others take the slot of a
/// request still running (more than the limit in flight, with no process
/// paused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "lease_ttl {ttl:?} is shorter than {MIN_LEASE_PER_STORE_TIMEOUT} times the lease \
     store's timeout ({timeout:?}): a renewal could arrive after the lease expired; make \
     lease_ttl at least {:?} or the store's timeout shorter",
    timeout.saturating_mul(MIN_LEASE_PER_STORE_TIMEOUT)
)]
pub(crate) struct InvalidLease {
    ttl: Duration,
    timeout: Duration,
}

/// A concurrency limit that cannot be built, from
/// [`ConcurrencyLimitBuilder::build`]: a name that is not a valid limit
/// name (the rule of policy names, [`check_name`]), no bound at all, or a
/// shared limit's
/// lease ([`lease_ttl`](ConcurrencyLimitBuilder::lease_ttl)) shorter than
/// [`MIN_LEASE_PER_STORE_TIMEOUT`] times its store's
/// [timeout](LeaseStore::timeout). Names the limit and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("concurrency limit {name:?}: {problem}")]
pub struct InvalidLimit {
    name: String,
    problem: LimitProblem,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum LimitProblem {
    #[error(transparent)]
    Name(InvalidName),
    #[error(transparent)]
    Lease(InvalidLease),
    #[error("no bound: give it a global limit, a per-key limit or both")]
    NoBound,
    #[error("both a fixed global limit and an adaptive one: give it one of them")]
    TwoGlobalLimits,
    #[error("both a fixed per-key limit and an adaptive one: give it one of them")]
    TwoPerKeyLimits,
    #[error(
        "an adaptive limit is this process's own: a shared (fleet-wide) limit keeps a fixed \
         global bound"
    )]
    AdaptiveShared,
    #[error("fair share and priorities share a global limit: give it one (global or adaptive)")]
    NothingToShare,
    #[error(
        "fair share and priorities use this process's counts: a shared (fleet-wide) limit \
         keeps a fixed global bound for every request alike"
    )]
    SharesShared,
    #[error("a fair-share weight without fair share: add fair_share(parts)")]
    WeightWithoutFairShare,
    #[error(
        "an adaptive limit cannot be dry-run: it is found from the latency of a backend it \
         protects, and one nothing is refused for shows none of what it would enforce"
    )]
    AdaptiveDryRun,
}

impl InvalidLimit {
    /// The name the limit was given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The refused lease and the lease store's timeout, when the lease is
    /// what is wrong.
    pub fn lease(&self) -> Option<(Duration, Duration)> {
        match &self.problem {
            LimitProblem::Lease(e) => Some((e.ttl, e.timeout)),
            LimitProblem::Name(_)
            | LimitProblem::NoBound
            | LimitProblem::TwoGlobalLimits
            | LimitProblem::TwoPerKeyLimits
            | LimitProblem::AdaptiveShared
            | LimitProblem::AdaptiveDryRun
            | LimitProblem::NothingToShare
            | LimitProblem::SharesShared
            | LimitProblem::WeightWithoutFairShare => None,
        }
    }
}

/// Refuses a lease of `ttl` shorter than [`MIN_LEASE_PER_STORE_TIMEOUT`]
/// times `store`'s timeout, if it tells one.
fn check_lease(ttl: Duration, store: &dyn LeaseStore) -> Result<(), InvalidLease> {
    match store.timeout() {
        Some(timeout) if ttl < timeout.saturating_mul(MIN_LEASE_PER_STORE_TIMEOUT) => {
            Err(InvalidLease { ttl, timeout })
        }
        _ => Ok(()),
    }
}

/// Bounds the requests in flight: globally, per key, or both. Made by
/// [`ConcurrencyLimitLayer::builder`].
///
/// A request is in flight from admission until its response body has ended,
/// failed or been dropped. Over a per-key limit: `429` (its
/// `RateLimit-Policy` unit is `concurrent-requests`; no `Retry-After`, since
/// no time can be promised). Over the global limit: `503`. Both are
/// `no-store`, and immediate unless bounded waiting is configured.
///
/// The counts are shared by every clone of the layer and every service it
/// makes, and [`ConcurrencyLimitLayer::stats`] reads them.
///
/// ```
/// use std::num::NonZeroUsize;
/// use tollgate::{ConcurrencyLimitLayer, KeyPart};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let limit = ConcurrencyLimitLayer::builder("in-flight")
///     .global(NonZeroUsize::new(64).unwrap())
///     .per_key(NonZeroUsize::new(8).unwrap(), [KeyPart::Account])
///     .build()?;
/// # let _ = limit;
/// # Ok(()) }
/// ```
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
            .field("per_key_adaptive", &l.per_key_adaptive.is_some())
            .field("key", &self.config.key)
            .field("waiting", &l.waiting)
            .field("shared", &self.config.lease_store.is_some())
            .field("lease", &self.config.lease)
            .field("body_idle_timeout", &self.config.body_idle)
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimitLayer {
    /// Starts a limit named `name` (used in headers and metrics; names
    /// follow the rule of policy names, [`check_name`], checked by
    /// [`build`](ConcurrencyLimitBuilder::build)) with no bounds yet.
    pub fn builder(name: &str) -> ConcurrencyLimitBuilder {
        ConcurrencyLimitBuilder {
            limits: Limits {
                name: name.into(),
                global_max: None,
                per_key_max: None,
                waiting: None,
                log_level: tracing::Level::DEBUG,
                dry_run: false,
                adaptive: None,
                per_key_adaptive: None,
                failure_when: None,
                fair_share: false,
                priorities: false,
            },
            lease_store: None,
            lease: LeaseOptions::default(),
            key: Vec::new(),
            missing: MissingPrincipal::Reject,
            resolver: ClientIpResolver::peer_only(),
            body_idle: DEFAULT_BODY_IDLE_TIMEOUT,
            exemptions: Vec::new(),
            shape: None,
            www_authenticate: HeaderValue::from_static("Bearer"),
            fair: None,
            weight: None,
            priority: None,
        }
    }

    /// The counters: in flight, waiting, refused. For a
    /// [shared](ConcurrencyLimitBuilder::shared) limit, in flight and
    /// waiting count this process's requests (holding a lease, polling for
    /// one).
    pub fn stats(&self) -> ConcurrencyStats {
        let mut stats = self.config.limiter.stats();
        if let Some(leases) = &self.config.leases {
            // Leases held count in `limiter` too (as do requests counted
            // locally when the store fails, OnLeaseError::Local).
            let (_held, waiting, peak, restored, abandoned) = leases.counts();
            stats.waiting += waiting;
            stats.peak_waiting = stats.peak_waiting.max(peak);
            stats.leases_restored = restored;
            stats.releases_abandoned = abandoned;
        }
        stats.bodies_stalled = self.config.stalls.stalled();
        stats
    }
}

/// Configures a [`ConcurrencyLimitLayer`], from
/// [`ConcurrencyLimitLayer::builder`]: every method consumes and returns
/// the builder, and [`build`](Self::build) checks the name and the lease
/// once.
#[must_use]
#[derive(Clone)]
pub struct ConcurrencyLimitBuilder {
    limits: Limits,
    lease_store: Option<Arc<dyn LeaseStore>>,
    lease: LeaseOptions,
    key: Vec<KeyPart>,
    missing: MissingPrincipal,
    resolver: ClientIpResolver,
    body_idle: Duration,
    exemptions: Vec<Exemption>,
    shape: Option<Shape>,
    www_authenticate: HeaderValue,
    /// The parts of a tenant's key, with fair share.
    fair: Option<Vec<KeyPart>>,
    weight: Option<WeightFn>,
    priority: Option<ClassFn>,
}

impl fmt::Debug for ConcurrencyLimitBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimitBuilder")
            .field("name", &self.limits.name)
            .field("global", &self.limits.global_max)
            .field("per_key", &self.limits.per_key_max)
            .field("shared", &self.lease_store.is_some())
            .finish_non_exhaustive()
    }
}

impl ConcurrencyLimitBuilder {
    fn edit(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }

    /// The layer, once its name and (for a [shared](Self::shared) limit)
    /// its lease are checked. Its counts start at zero.
    ///
    /// # Errors
    ///
    /// [`InvalidLimit`] when the name is not a valid limit name, the limit
    /// has no bound (none of [`global`](Self::global),
    /// [`adaptive`](Self::adaptive), [`per_key`](Self::per_key) and
    /// [`per_key_adaptive`](Self::per_key_adaptive): it would limit
    /// nothing), it has both a fixed and an adaptive global limit or
    /// per-key limit, an adaptive limit is [shared](Self::shared) or
    /// [dry-run](Self::dry_run), [fair share](Self::fair_share) or
    /// [priorities](Self::priority) are asked for without a global limit
    /// or with a shared one, a
    /// [weight](Self::fair_share_weight) without fair share, or the
    /// lease ([`lease_ttl`](Self::lease_ttl), 10 s by default) is shorter
    /// than [`MIN_LEASE_PER_STORE_TIMEOUT`] times the store's
    /// [timeout](LeaseStore::timeout).
    pub fn build(self) -> Result<ConcurrencyLimitLayer, InvalidLimit> {
        let invalid = |problem| InvalidLimit {
            name: self.limits.name.to_string(),
            problem,
        };
        check_name(&self.limits.name).map_err(|e| invalid(LimitProblem::Name(e)))?;
        let adaptive = self.limits.adaptive.is_some();
        if self.limits.global_max.is_none() && !self.limits.per_key() && !adaptive {
            return Err(invalid(LimitProblem::NoBound));
        }
        if adaptive && self.limits.global_max.is_some() {
            return Err(invalid(LimitProblem::TwoGlobalLimits));
        }
        if self.limits.per_key_max.is_some() && self.limits.per_key_adaptive.is_some() {
            return Err(invalid(LimitProblem::TwoPerKeyLimits));
        }
        let any_adaptive = adaptive || self.limits.per_key_adaptive.is_some();
        if any_adaptive && self.lease_store.is_some() {
            return Err(invalid(LimitProblem::AdaptiveShared));
        }
        if any_adaptive && self.limits.dry_run {
            return Err(invalid(LimitProblem::AdaptiveDryRun));
        }
        if self.weight.is_some() && self.fair.is_none() {
            return Err(invalid(LimitProblem::WeightWithoutFairShare));
        }
        let shares = self.fair.is_some() || self.priority.is_some();
        if shares && self.limits.global_max.is_none() && !adaptive {
            return Err(invalid(LimitProblem::NothingToShare));
        }
        if shares && self.lease_store.is_some() {
            return Err(invalid(LimitProblem::SharesShared));
        }
        if let Some(store) = &self.lease_store {
            check_lease(self.lease.ttl, &**store).map_err(|e| invalid(LimitProblem::Lease(e)))?;
        }
        let mut limits = self.limits;
        limits.fair_share = self.fair.is_some();
        limits.priorities = self.priority.is_some();
        let name = limits.name.clone();
        let leases = self.lease_store.clone().map(|store| {
            Arc::new(Leases::new(Sharing {
                store,
                ttl: self.lease.ttl,
                poll: self.lease.poll,
                on_error: self.lease.on_error,
            }))
        });
        Ok(ConcurrencyLimitLayer {
            config: Arc::new(Config {
                stalls: Arc::new(Stalls::new(name, self.body_idle)),
                body_idle: self.body_idle,
                limiter: Arc::new(Limiter::new(limits)),
                lease_store: self.lease_store,
                lease: self.lease,
                leases,
                key: self.key,
                missing: self.missing,
                resolver: self.resolver,
                exemptions: self.exemptions,
                shape: self.shape,
                www_authenticate: self.www_authenticate,
                fair: self.fair.map(|parts| FairShare {
                    parts,
                    weight: self.weight,
                }),
                priority: self.priority,
            }),
        })
    }

    /// Makes the limit hold across every instance that shares `store`
    /// (the Redis store implements [`LeaseStore`]): each request in flight
    /// holds a lease there, for its key and in all, from admission until
    /// its response body ends.
    ///
    /// - A lease lasts [`lease_ttl`](Self::lease_ttl) (10 s by default)
    ///   unless renewed; it is renewed every third of that while the
    ///   request runs, and given back when it ends. An instance that dies
    ///   (`kill -9`, a lost host) stops holding its slots at most one lease
    ///   after its last renewal.
    /// - Never more than the limit in flight while leases are renewed in
    ///   time. A lease lost while its request still runs (the process was
    ///   paused or cut off from the store for longer than the lease, or the
    ///   store lost it: `FLUSHALL`, a restart without persistence) is taken
    ///   again at its next renewal, even above the limit, so within a third
    ///   of a lease after the store answers again the shared count is at
    ///   least what is in flight, and newcomers are refused until it drops
    ///   below the limit. Between the loss and that renewal others may take
    ///   those slots: the one window in which the fleet can exceed the
    ///   limit. Logged and counted ([`ConcurrencyStats::leases_restored`],
    ///   `tollgate_lease_restored_total{layer}`).
    /// - Waiting ([`wait`](Self::wait)) works across instances by polling:
    ///   the first waiter of this instance asks again every
    ///   [`poll_every`](Self::poll_every) (50 ms by default), one store
    ///   round trip each, and hands the turn to the next waiter that could
    ///   be admitted, until its wait is over (the guide's "Fleet-wide in-flight limits" says
    ///   exactly who). Within an instance, first come first served as the
    ///   guide's "Bounding work in flight" details; across instances, not.
    /// - When the store fails: [`on_lease_error`](Self::on_lease_error)
    ///   (fail closed with `503` by default).
    ///
    /// Every decision is one atomic script on the store's clock; the
    /// limit's leases share one cluster hash slot.
    ///
    /// [`build`](Self::build) refuses a lease ([`lease_ttl`](Self::lease_ttl),
    /// 10 s by default) shorter than [`MIN_LEASE_PER_STORE_TIMEOUT`] times
    /// the store's [timeout](LeaseStore::timeout).
    pub fn shared(self, store: Arc<dyn LeaseStore>) -> Self {
        self.edit(|b| b.lease_store = Some(store))
    }

    /// How long a shared limit's lease lasts unless renewed (default 10 s;
    /// from 100 ms to 24 h, anything outside is the nearest of those).
    /// Shorter frees the slots of a dead instance sooner and costs more
    /// renewals (one store round trip per request in flight every third of
    /// it); a process paused for longer loses its leases. No effect unless
    /// [`shared`](Self::shared); checked against the store's timeout by
    /// [`build`](Self::build).
    pub fn lease_ttl(self, ttl: Duration) -> Self {
        let ttl = ttl.clamp(MIN_LEASE, MAX_LEASE);
        self.edit(|b| b.lease.ttl = ttl)
    }

    /// How often a shared limit's first waiting request asks again
    /// (default 50 ms, at least 1 ms); each ask hands the turn on to the
    /// waiters behind that could be admitted. No effect unless
    /// [`shared`](Self::shared).
    pub fn poll_every(self, every: Duration) -> Self {
        self.edit(|b| b.lease.poll = every.max(Duration::from_millis(1)))
    }

    /// What a shared limit does when its store fails or does not answer in
    /// time (default [`OnLeaseError::FailClosed`]). No effect unless
    /// [`shared`](Self::shared).
    pub fn on_lease_error(self, what: OnLeaseError) -> Self {
        self.edit(|b| b.lease.on_error = what)
    }

    /// At most `max` requests in flight through this layer in all (503 beyond).
    pub fn global(self, max: NonZeroUsize) -> Self {
        self.edit(|b| b.limits.global_max = Some(max.get()))
    }

    /// A global limit found from latency instead of a fixed
    /// [`global`](Self::global) one: at most the controller's current
    /// limit in flight through this layer (503 beyond, or a place in the
    /// [line](Self::wait)). Each request's latency, from admission until
    /// its response body ends (or, over HTTP/1.1, until its declared
    /// `Content-Length` is sent; an answer to `HEAD`, a `204` or a `304`
    /// at its head), is fed to an
    /// [`AdaptiveLimit`](crate::concurrency::AdaptiveLimit) running
    /// `config`. A request that fails (an error from the service, a status
    /// counted by [`adaptive_failure_when`](Self::adaptive_failure_when))
    /// is fed as a failure; one cancelled (its body or future dropped
    /// before the end, or its body ended for stalling, which is as likely
    /// the client's doing) as a cancellation, which does not cut the limit
    /// by default. Not fed at all: `1xx` and `4xx` answers not counted as
    /// failures (a missing route, a refused credential, an inner rate
    /// limit: answers decided before the work whose latency matters), and
    /// upgraded connections (a `101`, or a `2xx` to `CONNECT`: their slot
    /// lives as long as the client keeps the connection). The latency includes the time the client takes to
    /// read the body: put the layer on routes of similar cost
    /// (`route_layer`), as one mean latency is compared per window. The
    /// layer also keeps when each request still waiting for its response
    /// head was admitted, and on every arrival and departure shows the
    /// controller the one it asks about
    /// ([`AdaptiveLimit::overdue`](crate::concurrency::AdaptiveLimit::overdue)),
    /// so a backend that slows down or stops answering brings the limit
    /// down before its slowed requests end (by at most half until windows
    /// measure again, since a long poll ages too; an answered stream or
    /// upgraded connection does not count). It acts only where latencies
    /// are shorter than about one window. A
    /// [per-key adaptive](Self::per_key_adaptive) limit moves on latencies
    /// alone. The
    /// limit is
    /// [`ConcurrencyStats::global_limit`] and the gauge
    /// `tollgate_concurrency_limit{layer}`; moves larger than the
    /// configured fraction are logged at INFO.
    ///
    /// The limit is this process's own: [`build`](Self::build) refuses it
    /// together with [`global`](Self::global) or [`shared`](Self::shared)
    /// (a fleet's leases keep a fixed global bound), and with
    /// [`dry_run`](Self::dry_run) (a limit found from the latency of a
    /// backend nothing is refused for says nothing of what it would
    /// enforce: in review it read 4 where enforcing found 25). It works
    /// with [`per_key`](Self::per_key), [`wait`](Self::wait) (a grown
    /// limit hands its new slots to waiters in order) and exemptions
    /// (exempt requests are neither counted nor measured).
    ///
    /// ```
    /// use tollgate::ConcurrencyLimitLayer;
    /// use tollgate::concurrency::AdaptiveConfig;
    ///
    /// let config = AdaptiveConfig::builder().bounds(4, 256).build()?;
    /// let layer = ConcurrencyLimitLayer::builder("database")
    ///     .adaptive(config)
    ///     .build()?;
    /// // It starts by measuring the floor (the unloaded latency), at the probe limit
    /// // (3, raised to the lower bound).
    /// assert_eq!(layer.stats().global_limit, Some(4));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn adaptive(self, config: AdaptiveConfig) -> Self {
        self.edit(|b| b.limits.adaptive = Some(config))
    }

    /// Which response statuses an [adaptive](Self::adaptive) limit counts
    /// as failures (default: every `5xx`, so `408` is not one unless
    /// chosen here); of those chosen, `408` and `504` count as time-outs,
    /// the others as errors ([`Failure`](crate::concurrency::Failure); which
    /// kinds cut the limit is the
    /// [`AdaptiveConfig`](crate::concurrency::AdaptiveConfig)'s). An error
    /// from the service itself is always a failure. No effect without an
    /// adaptive limit.
    pub fn adaptive_failure_when(
        self,
        failed: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.edit(|b| b.limits.failure_when = Some(FailureWhen(Arc::new(failed))))
    }

    /// Shares a full global limit (fixed or [adaptive](Self::adaptive))
    /// fairly between the tenants whose keys are built from `parts`, e.g.
    /// `[KeyPart::Tenant]`: weighted max-min fairness over their demand.
    ///
    /// A tenant's demand is the most it had in flight and waiting when one
    /// more of its requests arrived (counting that one, admitted or not),
    /// over the current and the previous second. While the demands add up
    /// to no more than the limit, nobody is held to a share. When they
    /// exceed it, each tenant's share is its weighted max-min share of the
    /// limit ([`fair_shares`](crate::concurrency::fair_shares)): a tenant
    /// that wants less than an equal share keeps what it wants, the rest is
    /// split by weight ([`fair_share_weight`](Self::fair_share_weight), 1
    /// each by default). A tenant at its share may still take the slots
    /// that no other tenant below its share wants *now* (one with requests
    /// in flight or waiting, or refused since its last slot): no slot is
    /// kept idle for a tenant that is not asking. Beyond that, its request
    /// is refused with `503` and `Retry-After: 1`, or waits in the
    /// [line](Self::wait), where a freed slot goes to a tenant below its
    /// share, and a tenant below its share finding the line full takes the
    /// place of the latest waiter of a tenant at its share.
    ///
    /// So one tenant's flood takes what the others leave, and a tenant
    /// whose requests come and go keeps its claim while it has any in
    /// flight. The global limit is never exceeded: a tenant below its share
    /// whose slots are held by a flood admitted before it came waits (or,
    /// without a line, is refused, and from then on claims a slot, kept
    /// free for it until it is admitted) until one of them ends. Give the
    /// limit a short line so that a tenant that comes rarely is served at
    /// once rather than on its next try. At most 1,024 tenants are told
    /// apart within two seconds; newcomers beyond them share one claim (of
    /// weight 1). The shares are computed again at once when demand rises
    /// with up to 64 tenants, at most every millisecond with more, and at
    /// least every 5 ms. A request without the key's principal follows
    /// [`when_no_principal`](Self::when_no_principal) (with `Skip`, it is
    /// held to no share). Exempt requests are neither counted nor held.
    /// This process's counts only: [`build`](Self::build) refuses it with
    /// [`shared`](Self::shared), and without a global limit.
    ///
    /// ```
    /// use tollgate::{ConcurrencyLimitLayer, KeyPart};
    /// use tollgate::concurrency::AdaptiveConfig;
    ///
    /// let layer = ConcurrencyLimitLayer::builder("work")
    ///     .adaptive(AdaptiveConfig::default())
    ///     .fair_share([KeyPart::Tenant])
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn fair_share(self, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        let parts: Vec<KeyPart> = parts.into_iter().collect();
        self.edit(|b| b.fair = Some(parts))
    }

    /// Each tenant's weight for [`fair_share`](Self::fair_share) (default
    /// 1), read from each request, e.g. by plan from the
    /// [`Principal`](crate::Principal) in its extensions: a tenant of
    /// weight 2 gets twice the share of one of weight 1 when both want more
    /// than they get. A tenant's latest request sets its weight, so a plan
    /// switched at runtime counts from its next request. Without
    /// [`fair_share`](Self::fair_share), [`build`](Self::build) refuses it
    /// (there would be nothing to weigh).
    pub fn fair_share_weight(
        self,
        weight: impl Fn(&Parts) -> NonZeroU32 + Send + Sync + 'static,
    ) -> Self {
        let weight: WeightFn = Arc::new(weight);
        self.edit(|b| b.weight = Some(weight))
    }

    /// Gives each request a [`Priority`] class (by route, plan, header…):
    /// the global limit (fixed or [adaptive](Self::adaptive)) is kept for
    /// higher classes first. A request is admitted only if the slots left
    /// after it cover what the classes above its own want beyond what they
    /// hold: their demand, counted as for [`fair_share`](Self::fair_share)
    /// (the most they had in flight and waiting over the current and the
    /// previous second). So when the limit is full, lower classes are
    /// refused first (`503`, `Retry-After: 1`), and batch work gets what
    /// interactive work leaves. In the [line](Self::wait), a freed slot
    /// goes to the highest class waiting (first come, first served within a
    /// class), a waiter is held to the room kept for higher classes as a
    /// newcomer is, and a full line makes room for a higher class by
    /// refusing its lowest, latest waiter. Requests of one class are not
    /// held back for each other. A short line (tens of milliseconds) lets
    /// a higher class whose demand alone fills the limit keep its bursts
    /// (see the guide's [in flight](crate::guide::in_flight) chapter).
    /// This process's counts only, and it needs a global limit, as
    /// [`fair_share`](Self::fair_share).
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use tollgate::ConcurrencyLimitLayer;
    /// use tollgate::concurrency::Priority;
    ///
    /// let layer = ConcurrencyLimitLayer::builder("api")
    ///     .global(NonZeroUsize::new(64).unwrap())
    ///     .priority(|req| match req.uri.path() {
    ///         p if p.starts_with("/export") => Priority::Batch,
    ///         _ => Priority::Interactive,
    ///     })
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), tollgate::InvalidLimit>(())
    /// ```
    pub fn priority(self, class: impl Fn(&Parts) -> Priority + Send + Sync + 'static) -> Self {
        self.edit(|b| b.priority = Some(Arc::new(class)))
    }

    /// At most `max` requests in flight per key built from `parts` (429
    /// beyond), e.g. `[KeyPart::Account]`. For a limit found from each
    /// key's latency, see [`per_key_adaptive`](Self::per_key_adaptive).
    pub fn per_key(self, max: NonZeroUsize, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        let parts: Vec<KeyPart> = parts.into_iter().collect();
        self.edit(|b| {
            b.limits.per_key_max = Some(max.get());
            b.key = parts;
        })
    }

    /// A limit per key built from `parts` found from that key's own
    /// latency, instead of a fixed [`per_key`](Self::per_key) one: each key
    /// gets its own [`AdaptiveLimit`](crate::concurrency::AdaptiveLimit)
    /// running `config`, fed only by the key's requests (measured as for
    /// [`adaptive`](Self::adaptive), with the same
    /// [failures](Self::adaptive_failure_when)); beyond its limit a
    /// request is refused with `429` (no `RateLimit` fields and no
    /// `Retry-After`: the number moves and no time can be promised) or
    /// waits in the [line](Self::wait) (no more of a key's waiters than its
    /// limit). For backends whose capacity is per key: a database shard or
    /// a downstream account per tenant, where one tenant's slow backend
    /// must not cut the others' limits, as it would cut a global adaptive
    /// one.
    ///
    /// A key's controller starts with a probe of its floor, at the probe
    /// limit, then runs at the configured initial limit. Controllers of up
    /// to 8,192 keys are kept, besides those of keys with requests in
    /// flight (never forgotten): a key with nothing in flight that has not
    /// been seen while 4,096 to 8,192 other keys came (new ones, or ones
    /// not seen for as long) starts again from a new controller. So a
    /// flood of new keys costs bounded memory, but it can make an idle key
    /// forget a low limit it learned: an attacker with many keys (client
    /// addresses over IPv6) can do that, and with more than about 8,000
    /// keys active in turn nothing is learned. Give the layer a
    /// [`global`](Self::global) (or [adaptive](Self::adaptive)) limit too:
    /// it is the bound that holds whatever the keys do.
    /// Its moves are logged at DEBUG with the key's shape and fingerprint;
    /// no gauge is kept per key (one per key would be a metric of unbounded
    /// cardinality). [`build`](Self::build) refuses it together with
    /// [`per_key`](Self::per_key), [`shared`](Self::shared) and
    /// [`dry_run`](Self::dry_run), as for [`adaptive`](Self::adaptive). It
    /// composes with a global limit, fixed or adaptive, and with fair
    /// share and priorities, which share the global one.
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use tollgate::{ConcurrencyLimitLayer, KeyPart};
    /// use tollgate::concurrency::AdaptiveConfig;
    ///
    /// // Each tenant's shard finds its own limit (2..64); the process keeps
    /// // at most 256 in flight in all.
    /// let config = AdaptiveConfig::builder().bounds(2, 64).build()?;
    /// let layer = ConcurrencyLimitLayer::builder("shards")
    ///     .per_key_adaptive(config, [KeyPart::Tenant])
    ///     .global(NonZeroUsize::new(256).unwrap())
    ///     .build()?;
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn per_key_adaptive(
        self,
        config: AdaptiveConfig,
        parts: impl IntoIterator<Item = KeyPart>,
    ) -> Self {
        let parts: Vec<KeyPart> = parts.into_iter().collect();
        self.edit(|b| {
            b.limits.per_key_adaptive = Some(config);
            b.key = parts;
        })
    }

    /// Lets at most `max_waiters` requests wait, each at most `max_wait`
    /// (`Duration::MAX`: as long as it takes), for a permit before being
    /// refused. Without it, refusal is immediate.
    pub fn wait(self, max_waiters: usize, max_wait: Duration) -> Self {
        self.edit(|b| b.limits.waiting = Some((max_waiters, max_wait)))
    }

    /// The level refusals are logged at (default `DEBUG`): the layer, the
    /// limit that refused (`per_key`, `global`, `queue`, `fair_share`,
    /// `priority`,
    /// `store_unavailable`), the shape of the key and a fingerprint of it,
    /// never the key
    /// ([`set_log_fingerprint_key`](crate::set_log_fingerprint_key)); a
    /// request refused for want of a principal (`401`) or an unusable
    /// address (`400`) too, naming the layer (it has no key to show).
    pub fn log_refusals(self, level: tracing::Level) -> Self {
        self.edit(|b| b.limits.log_level = level)
    }

    /// How long a response body may make no progress before it is ended
    /// and its slot (and fleet lease) released (default
    /// [`DEFAULT_BODY_IDLE_TIMEOUT`](super::DEFAULT_BODY_IDLE_TIMEOUT), a
    /// minute; at least 1 ms). Progress is a frame the server takes from
    /// the body; the time counts from the response head. A client that
    /// stops reading (an HTTP/2 window left at zero, a full TCP window)
    /// stops the server from polling the body at all: the layer's
    /// watchdog releases the slot anyway, within a quarter of this time
    /// more (at most a second), and the body ends with
    /// [`BodyStalled`](super::BodyStalled) when it is next polled (the
    /// stream is reset, or the connection closed). Counted in
    /// [`ConcurrencyStats::bodies_stalled`] and
    /// `tollgate_stalled_bodies_total{layer}`, and logged. Raise it for
    /// streams that are quiet for longer by design (server-sent events
    /// with rare heartbeats, long polls).
    pub fn body_idle_timeout(self, idle: Duration) -> Self {
        let idle = idle.max(Duration::from_millis(1));
        self.edit(|b| b.body_idle = idle)
    }

    /// Dry-run: a full limit refuses nothing. The request that would have
    /// been refused is logged at `INFO` ("dry run: this request would have
    /// been refused"), counted in `tollgate_dry_run_refused_total{layer,scope}`,
    /// and let through at once, counted in flight (so
    /// [`ConcurrencyStats::in_flight`] can go above the limit); nothing
    /// waits. A shared limit's request let through holds no lease: it is
    /// counted in this process only. Refusals that are not about a full
    /// limit are still given: `401` for a missing principal, `400` for an
    /// unusable address, `503` when a shared limit's store fails and the
    /// layer fails closed.
    pub fn dry_run(self, yes: bool) -> Self {
        self.edit(|b| b.limits.dry_run = yes)
    }

    /// What to do when the per-key parts need a principal and there is none
    /// (default: 401).
    pub fn when_no_principal(self, what: MissingPrincipal) -> Self {
        self.edit(|b| b.missing = what)
    }

    /// How client addresses are resolved for [`KeyPart::ClientIp`].
    pub fn client_ip(self, resolver: ClientIpResolver) -> Self {
        self.edit(|b| b.resolver = resolver)
    }

    /// Lets requests that `exemption` matches skip this limit (repeat to
    /// add more; any one exempts), as
    /// [`RateLimitBuilder::exempt`](crate::rate_limit::RateLimitBuilder::exempt) does: an
    /// exempt request is not counted in flight, never waits and is never
    /// refused, so a health check or a `/metrics` route stays up when the
    /// service is at capacity. Exemptions by network read the client
    /// address as [`client_ip`](Self::client_ip) resolves it.
    ///
    /// ```
    /// use std::num::NonZeroUsize;
    /// use tollgate::{ConcurrencyLimitLayer, Exemption};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let limit = ConcurrencyLimitLayer::builder("in-flight")
    ///     .global(NonZeroUsize::new(64).unwrap())
    ///     .exempt(Exemption::when(|req| req.uri.path() == "/metrics"))
    ///     .build()?;
    /// # Ok(()) }
    /// ```
    pub fn exempt(self, exemption: Exemption) -> Self {
        self.edit(|b| b.exemptions.push(exemption))
    }

    /// Writes the body of this layer's HTTP refusals (`429`, `503`, `401`,
    /// `400`) with `body`, as
    /// [`RateLimitLayer::refusal_body`](crate::rate_limit::RateLimitBuilder::refusal_body)
    /// does (the same [`RefusalInfo`], so one function can serve both
    /// layers); the status and every header stay tollgate's, gRPC refusals
    /// are unchanged. [`RefusalInfo::retry_after`] is `None` here (no time
    /// can be promised for a slot).
    pub fn refusal_body(
        self,
        body: impl Fn(&RefusalInfo<'_>) -> RefusalBody + Send + Sync + 'static,
    ) -> Self {
        self.edit(|b| b.shape = Some(Shape(Arc::new(body))))
    }

    /// The `WWW-Authenticate` challenge sent with `401` when the per-key
    /// parts need a principal and the request has none (default:
    /// `Bearer`), as
    /// [`RateLimitLayer::www_authenticate`](crate::rate_limit::RateLimitBuilder::www_authenticate).
    pub fn www_authenticate(self, challenge: HeaderValue) -> Self {
        self.edit(|b| b.www_authenticate = challenge)
    }
}

impl<S> Layer<S> for ConcurrencyLimitLayer {
    type Service = ConcurrencyLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ConcurrencyLimit::from_config(inner, self.config.clone())
    }
}
