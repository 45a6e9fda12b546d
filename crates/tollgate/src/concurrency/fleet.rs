//! Fleet-wide in-flight limits ([`ConcurrencyLimitLayer::shared`]): each
//! request holds a lease in a [`LeaseStore`] shared by every instance, renewed
//! while it runs and given back when its response body ends; an instance
//! that dies holds nothing for longer than one lease.
//!
//! [`ConcurrencyLimitLayer::shared`]: super::ConcurrencyLimitLayer::shared

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tollgate_core::{Acquired, Lease, LeaseRequest, LeaseStore, StoreError, StoreErrorKind};

use super::limiter::{Limiter, Permit, Saturated};
use crate::observe::Throttle;
use crate::rate_limit::shaping::Waiters;

/// What a fleet-wide concurrency limit does when its lease store fails or
/// does not answer in time ([`ConcurrencyLimitLayer::shared`](super::ConcurrencyLimitLayer::shared)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLeaseError {
    /// Refuse with `503 Service Unavailable` (default): never more in
    /// flight than the limit.
    #[default]
    FailClosed,
    /// Admit the request uncounted, and log and count that it was.
    FailOpen,
    /// Count the request in this process only, against the same limits
    /// (so a fleet of `n` instances may have up to `n` times the limit in
    /// flight while the store is down).
    Local,
}

/// How a layer shares its limit: the store, the lease and what to do when
/// the store fails.
#[derive(Clone)]
pub(crate) struct Sharing {
    pub(crate) store: Arc<dyn LeaseStore>,
    pub(crate) ttl: Duration,
    pub(crate) poll: Duration,
    pub(crate) on_error: OnLeaseError,
}

impl fmt::Debug for Sharing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sharing")
            .field("ttl", &self.ttl)
            .field("poll", &self.poll)
            .field("on_error", &self.on_error)
            .finish_non_exhaustive()
    }
}

/// The shortest lease: renewals go every third of it, and a shorter one
/// would be renewed faster than a store round trip can be relied on.
pub(crate) const MIN_LEASE: Duration = Duration::from_millis(100);

/// A layer's sharing, with the counters of this process.
pub(crate) struct Fleet {
    pub(crate) sharing: Sharing,
    /// Lease ids: a random half per process, a counter for the other.
    seed: u64,
    next: AtomicU64,
    /// Leases this process holds now.
    held: AtomicUsize,
    /// Requests of this process polling for a lease.
    waiters: Arc<Waiters>,
    peak_waiting: AtomicUsize,
    expired: AtomicU64,
}

impl Fleet {
    pub(crate) fn new(sharing: Sharing) -> Self {
        Self {
            sharing,
            seed: RandomState::new().hash_one(std::process::id()),
            next: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            waiters: Arc::new(Waiters::default()),
            peak_waiting: AtomicUsize::new(0),
            expired: AtomicU64::new(0),
        }
    }

    fn next_id(&self) -> u128 {
        (u128::from(self.seed) << 64) | u128::from(self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Leases held by this process, requests of it waiting, the most ever
    /// waiting, and leases that expired while their request still ran.
    pub(crate) fn counts(&self) -> (usize, usize, usize, u64) {
        (
            self.held.load(Ordering::Relaxed),
            self.waiters.len(),
            self.peak_waiting.load(Ordering::Relaxed),
            self.expired.load(Ordering::Relaxed),
        )
    }
}

/// What a request holds while it is in flight.
pub(crate) enum Slot {
    /// A slot of this process's own counts.
    Local { _permit: Permit },
    /// A lease shared by the fleet.
    Fleet { _lease: FleetPermit },
    /// Admitted uncounted: the lease store failed and the layer fails open.
    Unchecked,
}

impl Slot {
    pub(crate) fn local(permit: Permit) -> Self {
        Slot::Local { _permit: permit }
    }
}

/// A lease held for a request: renewed every third of its time to live
/// until dropped, then given back.
pub(crate) struct FleetPermit {
    fleet: Arc<Fleet>,
    lease: Lease,
    renewal: Option<tokio::task::AbortHandle>,
}

impl FleetPermit {
    fn start(fleet: Arc<Fleet>, lease: Lease) -> Self {
        fleet.held.fetch_add(1, Ordering::Relaxed);
        let renewal = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            runtime
                .spawn(renew(fleet.clone(), lease.clone()))
                .abort_handle()
        });
        Self {
            fleet,
            lease,
            renewal,
        }
    }
}

impl Drop for FleetPermit {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        self.fleet.held.fetch_sub(1, Ordering::Relaxed);
        give_back(&self.fleet, self.lease.clone());
    }
}

/// Releases `lease` on a spawned task (a drop cannot wait); without a
/// runtime it expires by itself, one time to live after its last renewal.
fn give_back(fleet: &Arc<Fleet>, lease: Lease) {
    let store = fleet.sharing.store.clone();
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                if let Err(error) = store.release(&lease).await {
                    static THROTTLE: Throttle = Throttle::new();
                    if let Some(suppressed) = THROTTLE.admit() {
                        tracing::warn!(
                            %error,
                            limit = &*lease.request.limit,
                            suppressed,
                            "could not release an in-flight lease; it expires by itself"
                        );
                    }
                }
            });
        }
        Err(_) => tracing::warn!(
            limit = &*lease.request.limit,
            "no tokio runtime to release an in-flight lease; it expires by itself"
        ),
    }
}

/// Renews `lease` every third of its time to live, until aborted. A lease
/// found expired is not taken again (its slot may be someone else's now):
/// the request runs on uncounted, which is logged and counted.
async fn renew(fleet: Arc<Fleet>, lease: Lease) {
    let every = lease.request.ttl / 3;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::time::sleep_until(next).await;
        next += every;
        match fleet.sharing.store.renew(&lease).await {
            Ok(true) => {}
            Ok(false) => {
                fleet.expired.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    limit = &*lease.request.limit,
                    "an in-flight lease expired while its request was still running \
                     (this process was paused, or the store unreachable, for longer \
                     than the lease): the limit may be exceeded until it ends"
                );
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    "tollgate_lease_expired_total",
                    "layer" => lease.request.limit.to_string()
                )
                .increment(1);
                return;
            }
            Err(error) => {
                static THROTTLE: Throttle = Throttle::new();
                if let Some(suppressed) = THROTTLE.admit() {
                    tracing::warn!(
                        %error,
                        limit = &*lease.request.limit,
                        suppressed,
                        "could not renew an in-flight lease; trying again"
                    );
                }
            }
        }
    }
}

/// Acquires a lease for `key` (polling every `poll` while bounded waiting
/// allows), or follows [`OnLeaseError`] when the store fails.
pub(crate) async fn acquire(
    limiter: Arc<Limiter>,
    fleet: Arc<Fleet>,
    key: Option<Box<str>>,
) -> Result<Slot, Saturated> {
    let limits = &limiter.limits;
    let request = LeaseRequest {
        limit: limits.name.clone(),
        key: key.clone().filter(|_| limits.per_key_max.is_some()),
        per_key: limits.per_key_max.map(|n| n as u64),
        global: limits.global_max.map(|n| n as u64),
        ttl: fleet.sharing.ttl,
    };
    let id = fleet.next_id();
    let mut place = None;
    let mut deadline = None;
    loop {
        let full = match fleet.sharing.store.acquire(&request, id).await {
            Ok(Acquired::Granted(lease)) => {
                return Ok(Slot::Fleet {
                    _lease: FleetPermit::start(fleet, lease),
                });
            }
            Ok(Acquired::PerKeyFull) => Saturated::PerKey,
            Ok(Acquired::GlobalFull) => Saturated::Global,
            Err(error) => return failed(&limiter, &fleet, request, id, key, error).await,
        };
        let Some((max_waiters, max_wait)) = limits.waiting else {
            return Err(limiter.refused(full, key.as_deref()));
        };
        if place.is_none() {
            // One key waits no more than it may have in flight, and the
            // layer no more than `max_waiters`.
            let keys = match (&request.key, limits.per_key_max) {
                (Some(key), Some(max)) => vec![(key.clone(), max)],
                _ => Vec::new(),
            };
            match fleet.waiters.enter(keys, max_waiters) {
                Some(entered) => place = Some(entered),
                None => {
                    let why = match full {
                        Saturated::PerKey => Saturated::PerKey,
                        _ => Saturated::Queue,
                    };
                    return Err(limiter.refused(why, key.as_deref()));
                }
            }
            fleet
                .peak_waiting
                .fetch_max(fleet.waiters.len(), Ordering::Relaxed);
            deadline = Some(tokio::time::Instant::now() + max_wait);
        }
        let deadline = deadline.unwrap_or_else(tokio::time::Instant::now);
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(limiter.refused(full, key.as_deref()));
        }
        // Polls until the deadline, the last try at the deadline itself.
        tokio::time::sleep_until((now + fleet.sharing.poll).min(deadline)).await;
    }
}

/// The store failed: the configured outcome. An uncertain acquire may have
/// taken the lease, so it is given back (the id makes that exact).
async fn failed(
    limiter: &Arc<Limiter>,
    fleet: &Arc<Fleet>,
    request: LeaseRequest,
    id: u128,
    key: Option<Box<str>>,
    error: StoreError,
) -> Result<Slot, Saturated> {
    if error.kind() == StoreErrorKind::Uncertain {
        give_back(fleet, Lease { request, id });
    }
    match fleet.sharing.on_error {
        OnLeaseError::FailClosed => {
            crate::observe::store_error(&error, "fail_closed");
            Err(limiter.refused(Saturated::Unavailable, key.as_deref()))
        }
        OnLeaseError::FailOpen => {
            crate::observe::store_error(&error, "fail_open");
            Ok(Slot::Unchecked)
        }
        OnLeaseError::Local => {
            crate::observe::store_error(&error, "local");
            limiter.clone().acquire(key).await.map(Slot::local)
        }
    }
}
