//! Fleet-wide in-flight limits ([`ConcurrencyLimitBuilder::shared`]): each
//! request holds a lease in a [`LeaseStore`] shared by every instance, renewed
//! while it runs and given back when its response body ends; an instance
//! that dies holds nothing for longer than one lease.
//!
//! [`ConcurrencyLimitBuilder::shared`]: super::ConcurrencyLimitBuilder::shared

use std::collections::hash_map::RandomState;
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use tollgate_budget::{
    Acquired, Lease, LeaseRequest, LeaseStore, Renewed, StoreError, StoreErrorKind,
};

use super::limiter::{Ending, Limiter, Permit, Saturated};
use super::release::{Owner, Releases, give_back};
use super::share::Ask;
use crate::observe::Throttle;

/// What a fleet-wide concurrency limit does when its lease store fails or
/// does not answer in time ([`ConcurrencyLimitBuilder::shared`](crate::concurrency::ConcurrencyLimitBuilder::shared)).
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

/// The longest lease: a slot held longer than a day by a dead instance is
/// a leak in all but name (and the store's expiry arithmetic has a range).
pub(crate) const MAX_LEASE: Duration = Duration::from_secs(24 * 3600);

/// A layer's sharing, with the counters of this process.
pub(crate) struct Leases {
    pub(crate) sharing: Sharing,
    /// Lease ids: a random half per process, a counter for the other.
    seed: u64,
    next: AtomicU64,
    /// Leases this process holds now.
    held: AtomicUsize,
    /// This process's requests waiting for a lease, in arrival order.
    line: Mutex<WaiterLine>,
    peak_waiting: AtomicUsize,
    /// Leases found gone at a renewal, and taken again.
    restored: AtomicU64,
    /// Releases that failed, to be tried again.
    pub(crate) releases: Releases,
}

/// Requests waiting for a lease, first come first served (a request's
/// place is taken when it arrives, before its first ask): the first polls
/// the store, and each one that has asked (admitted or not) hands the turn
/// to the next, so within a process nobody is asked before those who came
/// earlier, and room found by one reaches those behind it.
#[derive(Default)]
pub(crate) struct WaiterLine {
    waiting: VecDeque<InLine>,
    next: u64,
    /// Slots this process has given back.
    freed: u64,
    /// `freed` when a turn was last handed to nobody: a newcomer whose
    /// first ask was out when a slot came free, and later a turn was
    /// lost, asks again at once if nobody ahead holds it up.
    lost_at: u64,
}

struct InLine {
    id: u64,
    key: Option<Box<str>>,
    /// Last refused by the limit in all (alone or with its key's), or not
    /// asked yet: it holds up waiters of every key behind it, see
    /// [`WaiterLine::free`]. Otherwise it was refused by its own key's limit
    /// alone.
    global: bool,
    /// Last refused with its key's limit full (alone or with the limit in
    /// all), or, not asked yet, held up by an earlier waiter of its key
    /// that was: a newcomer of its key held up behind it is refused as by
    /// the key (429), else as by the limit in all (503).
    by_key: bool,
    turn: Arc<Notify>,
}

impl WaiterLine {
    /// The waiters nobody ahead holds up, in line order. Walking from the
    /// front: a waiter behind an earlier one of its own key waits for that
    /// one (whatever it was last refused for, it could not be admitted
    /// first) and holds up nobody else; a waiter last refused by the limit
    /// in all, or that has not asked yet, holds up everyone behind it.
    fn free(&self) -> impl Iterator<Item = &InLine> + '_ {
        // Lazily, with a set of keys seen: `pass` and `may_ask` stop at
        // the waiter they look for (a round of the hand-over is then
        // quadratic in the line, not cubic), and nothing is allocated
        // until a keyed waiter is seen.
        self.waiting
            .iter()
            .scan((HashSet::new(), false), |(keys, done), w| {
                if *done {
                    return None;
                }
                let held = w.key.as_deref().is_some_and(|k| !keys.insert(k));
                *done = !held && w.global;
                Some((!held).then_some(w))
            })
            .flatten()
    }

    /// What a newcomer for `key` would wait behind, if anything: an
    /// earlier waiter of its key, or one holding up the limit in all.
    fn blocks(&self, key: Option<&str>) -> Option<Saturated> {
        if let Some(w) = key.and_then(|k| self.waiting.iter().find(|w| w.key.as_deref() == Some(k)))
        {
            return Some(if w.by_key {
                Saturated::PerKey
            } else {
                Saturated::Global
            });
        }
        let last_free = self.free().last();
        last_free.filter(|w| w.global).map(|_| Saturated::Global)
    }

    /// Hands the turn to the first waiter after `id` (or to the first of
    /// all, without `id`) that nobody ahead holds up ([`WaiterLine::free`]).
    /// Those held up would overtake the one ahead if room appeared between
    /// its ask and theirs; their turn comes when it has been refused by
    /// its key's limit only, admitted, or gone.
    pub(crate) fn pass(&mut self, after: Option<u64>) {
        if let Some(w) = self.free().find(|w| after.is_none_or(|id| w.id > id)) {
            w.turn.notify_one();
            return;
        }
        self.lost_at = self.freed;
    }

    /// A slot of this process came free: the turn goes to the first waiter.
    pub(crate) fn slot_freed(&mut self) {
        self.freed += 1;
        self.pass(None);
    }

    /// Whether waiter `id` may ask now: woken by a turn handed to it, if
    /// nobody ahead holds it up (since); by its own poll, if still first.
    fn may_ask(&self, id: u64, notified: bool) -> bool {
        if notified {
            self.free().take_while(|w| w.id <= id).any(|w| w.id == id)
        } else {
            self.waiting.front().is_some_and(|w| w.id == id)
        }
    }
}

impl Owner for Leases {
    fn store(&self) -> &dyn LeaseStore {
        &*self.sharing.store
    }

    fn releases(&self) -> &Releases {
        &self.releases
    }

    fn slot_freed(&self) {
        self.line().slot_freed();
    }
}

impl Leases {
    pub(crate) fn new(sharing: Sharing) -> Self {
        Self {
            sharing,
            seed: RandomState::new().hash_one(std::process::id()),
            next: AtomicU64::new(0),
            held: AtomicUsize::new(0),
            line: Mutex::new(WaiterLine::default()),
            peak_waiting: AtomicUsize::new(0),
            restored: AtomicU64::new(0),
            releases: Releases::default(),
        }
    }

    fn next_id(&self) -> u128 {
        (u128::from(self.seed) << 64) | u128::from(self.next.fetch_add(1, Ordering::Relaxed))
    }

    pub(crate) fn line(&self) -> std::sync::MutexGuard<'_, WaiterLine> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leases held by this process, requests of it waiting, the most ever
    /// waiting, leases found gone while their request still ran (and taken
    /// again), and leases left to expire because too many releases were
    /// pending.
    pub(crate) fn counts(&self) -> (usize, usize, usize, u64, u64) {
        (
            self.held.load(Ordering::Relaxed),
            self.line().waiting.len(),
            self.peak_waiting.load(Ordering::Relaxed),
            self.restored.load(Ordering::Relaxed),
            self.releases.abandoned(),
        )
    }
}

/// What a request holds while it is in flight.
pub(crate) enum Slot {
    /// A slot of this process's own counts.
    Local { _permit: Permit },
    /// A lease shared by the fleet.
    Leases { _lease: LeasePermit },
    /// Admitted uncounted: the lease store failed and the layer fails open.
    Unchecked,
}

impl Slot {
    pub(crate) fn local(permit: Permit) -> Self {
        Slot::Local { _permit: permit }
    }

    /// Where to mark how the request ended, for an adaptive limit (only
    /// this process's own slots have one).
    pub(crate) fn ending(&self) -> Option<&Arc<Ending>> {
        match self {
            Slot::Local { _permit } => _permit.ending(),
            Slot::Leases { .. } | Slot::Unchecked => None,
        }
    }

    /// See [`Permit::answered`].
    pub(crate) fn answered(&self, status: http::StatusCode, declared: Option<u64>) {
        if let Slot::Local { _permit } = self {
            _permit.answered(status, declared);
        }
    }
}

/// A lease held for a request: renewed every third of its time to live
/// until dropped, then given back. It also counts in this process's own
/// counts (`_local`), so that falling back to them when the store fails
/// ([`OnLeaseError::Local`]) sees the requests already in flight.
pub(crate) struct LeasePermit {
    leases: Arc<Leases>,
    lease: Lease,
    renewal: Option<tokio::task::AbortHandle>,
    _local: Permit,
}

impl LeasePermit {
    fn start(leases: Arc<Leases>, lease: Lease, local: Permit) -> Self {
        leases.held.fetch_add(1, Ordering::Relaxed);
        let renewal = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            runtime
                .spawn(renew(leases.clone(), lease.clone()))
                .abort_handle()
        });
        Self {
            leases,
            lease,
            renewal,
            _local: local,
        }
    }
}

impl Drop for LeasePermit {
    fn drop(&mut self) {
        if let Some(renewal) = self.renewal.take() {
            renewal.abort();
        }
        self.leases.held.fetch_sub(1, Ordering::Relaxed);
        give_back(&self.leases, self.lease.clone(), false);
    }
}

/// Renews `lease` every third of its time to live, until aborted. A lease
/// found gone (expired during a pause, or lost by the store: flushed,
/// restarted) is taken again, even above the bounds, so that the shared
/// count is again at least what is in flight within one renewal period;
/// logged and counted. Between the loss and that renewal others may be
/// admitted in its place: the one window in which the fleet can exceed
/// the limit.
async fn renew(leases: Arc<Leases>, lease: Lease) {
    let every = lease.request.ttl / 3;
    let mut next = tokio::time::Instant::now() + every;
    loop {
        tokio::time::sleep_until(next).await;
        next += every;
        match leases.sharing.store.renew(&lease).await {
            Ok(Renewed::Extended) => {}
            Ok(Renewed::Restored) => {
                leases.restored.fetch_add(1, Ordering::Relaxed);
                crate::observe::lease_restored(&lease.request.limit);
                // Counter `tollgate_lease_restored_total{layer}`; documented
                // in observe.rs.
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    "tollgate_lease_restored_total",
                    "layer" => lease.request.limit.to_string()
                )
                .increment(1);
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

/// An acquire call on its way: if the request is dropped before the
/// answer (a client gone, a timeout), the lease it may have taken is given
/// back by its id, which makes that exact.
struct Sent<'a> {
    leases: &'a Arc<Leases>,
    request: &'a LeaseRequest,
    id: u128,
    armed: bool,
    /// The answer was lost: the store is failing now, so the release is
    /// queued for the retrying task rather than sent at once.
    failing: bool,
}

impl Drop for Sent<'_> {
    fn drop(&mut self) {
        if self.armed {
            give_back(
                self.leases,
                Lease {
                    request: self.request.clone(),
                    id: self.id,
                },
                self.failing,
            );
        }
    }
}

/// One acquire, given back if dropped on the way or if its answer is lost
/// (uncertain: it may have been applied).
async fn ask(
    leases: &Arc<Leases>,
    request: &LeaseRequest,
    id: u128,
) -> Result<Acquired, StoreError> {
    let mut sent = Sent {
        leases,
        request,
        id,
        armed: true,
        failing: false,
    };
    let answer = leases.sharing.store.acquire(request, id).await;
    sent.armed = matches!(&answer, Err(e) if e.kind() == StoreErrorKind::Uncertain);
    sent.failing = sent.armed;
    answer
}

/// Leaves the line however the wait ends, and hands the turn to the
/// next waiter: also when leaving with a lease, since the answer that
/// admitted this one may have found more room (another instance freed
/// several slots), and the waiter behind, first in line now, would
/// otherwise not ask until someone freed a slot in this process.
struct LeaseWaiter<'a> {
    leases: &'a Leases,
    id: u64,
}

impl Drop for LeaseWaiter<'_> {
    fn drop(&mut self) {
        let mut line = self.leases.line();
        line.waiting.retain(|w| w.id != self.id);
        line.pass(Some(self.id));
    }
}

/// Acquires a lease for `key`, waiting in line (when bounded waiting is
/// on) behind this process's earlier waiters, or follows [`OnLeaseError`]
/// when the store fails.
pub(crate) async fn acquire(
    limiter: Arc<Limiter>,
    leases: Arc<Leases>,
    key: Option<Box<str>>,
) -> Result<Slot, Saturated> {
    let limits = &limiter.limits;
    let request = LeaseRequest {
        limit: limits.name.clone(),
        key: key.clone().filter(|_| limits.per_key_max.is_some()),
        per_key: limits.per_key_max.map(|n| n as u64),
        global: limits.global_max.map(|n| n as u64),
        ttl: leases.sharing.ttl,
    };
    let id = leases.next_id();
    let granted = |lease: Lease| {
        let local = limiter.take_unchecked(Ask::keyed(key.clone()));
        Ok(Slot::Leases {
            _lease: LeasePermit::start(leases.clone(), lease, local),
        })
    };
    // A newcomer takes its place in the order of arrival now, and asks at
    // once unless this process has earlier waiters it would overtake. If
    // it has to wait, it waits at that place: two newcomers whose first
    // asks were answered in the other order (the replies' tasks woken in
    // either order) still wait in the order they came.
    let (place, behind, freed) = if limits.waits().is_some() {
        let mut line = leases.line();
        let place = line.next;
        line.next += 1;
        (place, line.blocks(request.key.as_deref()), line.freed)
    } else {
        (0, None, 0)
    };
    let (full, holds_all) = match behind {
        // Not asked yet: holds up everyone behind until it has.
        Some(reason) => (reason, true),
        None => match ask(&leases, &request, id).await {
            Ok(Acquired::Granted(lease)) => return granted(lease),
            Ok(refused) => refusal(&refused),
            Err(error) => return failed(&limiter, &leases, key, error).await,
        },
    };
    let Some((max_waiters, max_wait)) = limits.waits() else {
        return Err(limiter.refused(full, key.as_deref()));
    };
    let deadline = later(tokio::time::Instant::now(), max_wait);
    let turn = {
        let mut line = leases.line();
        // One key waits no more than it may have in flight, and the layer
        // no more than `max_waiters`.
        let of_key = line
            .waiting
            .iter()
            .filter(|w| w.key.is_some() && w.key == request.key)
            .count();
        let key_full = limits.per_key_max.is_some_and(|max| of_key >= max);
        if line.waiting.len() >= max_waiters || key_full {
            // The line is full, maybe of later arrivals whose first asks
            // came back before this one's: the latest of them (of this
            // key, if the key's bound is the one reached) leaves for it,
            // as it would have been refused had they joined in order.
            let latest = line
                .waiting
                .iter()
                .enumerate()
                .filter(|(_, w)| !key_full || (w.key.is_some() && w.key == request.key))
                .max_by_key(|(_, w)| w.id)
                .filter(|(_, w)| w.id > place)
                .map(|(i, _)| i);
            match latest {
                Some(i) => {
                    // Whatever turn it held goes on to the one after it.
                    // (It passes it on its way out, once this one is in
                    // line and can block those behind.)
                    if let Some(bumped) = line.waiting.remove(i) {
                        bumped.turn.notify_one();
                    }
                }
                None => {
                    drop(line);
                    return Err(limiter.refused(full_line(full), key.as_deref()));
                }
            }
        }
        let turn = Arc::new(Notify::new());
        let at = line
            .waiting
            .iter()
            .position(|w| w.id > place)
            .unwrap_or(line.waiting.len());
        line.waiting.insert(
            at,
            InLine {
                id: place,
                key: request.key.clone(),
                global: holds_all,
                by_key: full == Saturated::PerKey,
                turn: turn.clone(),
            },
        );
        // Only if a turn was handed to nobody since a slot came free (not
        // while a waiter ahead still holds it: this one would ask beside
        // it), and nobody ahead holds this one up.
        if behind.is_none() && line.lost_at > freed && line.free().any(|w| w.id == place) {
            // A slot came free while the first ask was out: ask again now.
            turn.notify_one();
        }
        leases
            .peak_waiting
            .fetch_max(line.waiting.len(), Ordering::Relaxed);
        turn
    };
    let queued = LeaseWaiter {
        leases: &leases,
        id: place,
    };
    let mut full = full;
    loop {
        // The first in line asks again every `poll` (a slot freed by
        // another instance); the others when the one before them has
        // asked (found no room, or was admitted and left) or left the
        // line, or at once when this process frees a slot.
        let first = leases.line().waiting.front().is_some_and(|w| w.id == place);
        let wake = if first {
            later(tokio::time::Instant::now(), leases.sharing.poll).min(deadline)
        } else {
            deadline
        };
        let notified = tokio::time::timeout_at(wake, turn.notified()).await.is_ok();
        if !leases.line().waiting.iter().any(|w| w.id == place) {
            // Made room for an earlier arrival in a full line.
            return Err(limiter.refused(full_line(full), key.as_deref()));
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(limiter.refused(full, key.as_deref()));
        }
        // A poll set up while first in line is not this one's to use once
        // an earlier arrival has been inserted ahead (its first ask came
        // back later): that one polls now, and hands the turn on. Nor is a
        // turn handed over before someone ahead was refused by the limit
        // in all (a wake-up kept while this one's own ask was out).
        if !leases.line().may_ask(place, notified) {
            continue;
        }
        // Bounded by the wait: an answer after it is given back.
        match tokio::time::timeout_at(deadline, ask(&leases, &request, id)).await {
            Ok(Ok(Acquired::Granted(lease))) => return granted(lease),
            Ok(Ok(refused)) => {
                let holds_all;
                (full, holds_all) = refusal(&refused);
                let mut line = leases.line();
                if let Some(me) = line.waiting.iter_mut().find(|w| w.id == place) {
                    me.global = holds_all;
                    me.by_key = full == Saturated::PerKey;
                }
                line.pass(Some(place));
            }
            Ok(Err(error)) => {
                // Out of line first: falling back to this process's own
                // counts may wait there, and those behind get their turn.
                drop(queued);
                return failed(&limiter, &leases, key, error).await;
            }
            Err(_) => return Err(limiter.refused(full, key.as_deref())),
        }
    }
}

/// `now + wait`, saturating (`Duration::MAX` waits as long as it takes,
/// as with a local limit's `tokio::time::timeout`).
fn later(now: tokio::time::Instant, wait: Duration) -> tokio::time::Instant {
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600))
}

/// What a refusal answers (by the key's limit, or the limit in all), and
/// whether the waiter refused holds up the waiters of every key behind it
/// ([`WaiterLine::free`]): unless its key alone is known to be full.
fn refusal(answer: &Acquired) -> (Saturated, bool) {
    match answer {
        Acquired::PerKeyFull => (Saturated::PerKey, false),
        Acquired::BothFull => (Saturated::PerKey, true),
        _ => (Saturated::Global, true),
    }
}

/// Why a request is refused for a full line of waiters.
fn full_line(full: Saturated) -> Saturated {
    match full {
        Saturated::PerKey => Saturated::PerKey,
        _ => Saturated::Queue,
    }
}

/// The store failed: the configured outcome (an uncertain acquire was
/// given back already, see [`ask`]).
async fn failed(
    limiter: &Arc<Limiter>,
    leases: &Arc<Leases>,
    key: Option<Box<str>>,
    error: StoreError,
) -> Result<Slot, Saturated> {
    match leases.sharing.on_error {
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
            limiter
                .clone()
                .acquire(Ask::keyed(key))
                .await
                .map(Slot::local)
        }
    }
}
