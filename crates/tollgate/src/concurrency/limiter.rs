//! In-flight accounting: a global count and per-key counts under one lock,
//! permits that give back on drop, and bounded first-come-first-served
//! waiting in which a freed slot is handed to one waiter. An adaptive
//! global limit is fed, under the same lock, by every permit given back.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::StatusCode;
use tokio::sync::oneshot;
use tollgate_budget::{AdaptiveConfig, AdaptiveLimit, Change, Failure, Nanos, Priority, Sample};

use super::key_limits::KeyLimits;
use super::share::{Ask, Demand, Shares};

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Saturated {
    Global,
    PerKey,
    /// Bounded waiting is on, but every waiting slot is taken.
    Queue,
    /// The fleet's lease store failed, and the layer fails closed.
    Unavailable,
    /// The global limit is contended and the request's tenant holds its
    /// fair share of it.
    FairShare,
    /// What is left of the global limit is kept for higher classes.
    Priority,
}

#[derive(Default)]
struct SlotCounts {
    global: usize,
    per_key: HashMap<Box<str>, usize>,
    /// Requests waiting for a permit, first come first served.
    queue: VecDeque<Waiter>,
    next_waiter: u64,
    /// The global limit found from latency, when it is adaptive.
    adaptive: Option<AdaptiveLimit>,
    /// When each request in flight still awaiting its answer (its
    /// response head) was admitted, how many at each time; kept for an
    /// adaptive global limit: the oldest tell it the backend slowed down
    /// before they end.
    started: BTreeMap<Nanos, u32>,
    /// Each key's limit found from latency, when the per-key limit is
    /// adaptive.
    key_limits: Option<KeyLimits>,
    /// Each tenant's and class's demand, for fair share and priorities
    /// (kept only when the layer has either).
    demand: Demand,
}

/// A request waiting in the queue; a freed slot is handed to it directly.
struct Waiter {
    id: u64,
    ask: Ask,
    grant: oneshot::Sender<Permit>,
}

impl SlotCounts {
    /// Shows an adaptive global limit how long its oldest requests have
    /// been in flight.
    fn overdue(&mut self, now: Nanos) -> Option<Change> {
        let adaptive = self.adaptive.as_mut()?;
        let (rank, since) = adaptive.overdue_query();
        let mut seen = 0u32;
        let started = self.started.range(since..).find_map(|(&at, &n)| {
            seen = seen.saturating_add(n);
            (seen >= rank).then_some(at)
        });
        adaptive.overdue(now, started)
    }

    /// Whether `ask` may be admitted now: under its key's limit; with fair
    /// share, when the tenants' demands exceed the global limit, below its
    /// tenant's share, or else only into slots that no other tenant below
    /// its share wants now (fair share keeps no slot idle for a tenant that
    /// is not asking); under the global limit; and, with priorities, with
    /// room left for what higher classes want now (a tenant below its fair
    /// share is not held back for other tenants' classes). A waiter is held
    /// to that room as a newcomer is: were it not, a line would be a way
    /// around it (found in the overload benchmark: a line of 20 ms let
    /// batch work take slots whenever no interactive request happened to
    /// wait, and cut interactive goodput from 0.92 to 0.75-0.81).
    ///
    /// `unmet`: what all tenants claim below their shares, if already
    /// summed (a pass over the line sums it once, not per waiter).
    fn fits(&self, limiter: &Limiter, ask: &Ask, unmet: Option<u64>) -> Result<(), Saturated> {
        if let Some(key) = ask.key.as_deref()
            && let Some(max) = self.key_max(limiter, key)
            && self.per_key.get(key).copied().unwrap_or(0) >= max
        {
            return Err(Saturated::PerKey);
        }
        let Some(max) = self.global_max(limiter) else {
            return Ok(());
        };
        let mut below_share = false;
        if let Some(shares) = self.shares(limiter)
            && ask.tenant.is_some()
        {
            if self.demand.at_share(ask, shares) {
                let free = max.saturating_sub(self.global);
                let total = unmet.unwrap_or_else(|| self.demand.unmet_total(shares));
                if free <= self.demand.unmet_by_others(ask, shares, total) {
                    return Err(Saturated::FairShare);
                }
            } else {
                below_share = true;
            }
        }
        if self.global >= max {
            return Err(Saturated::Global);
        }
        if !below_share
            && limiter.limits.priorities
            && self.global + self.demand.reserved_above(ask.class) >= max
        {
            return Err(Saturated::Priority);
        }
        Ok(())
    }

    /// The tenants' fair shares of the global limit as last computed
    /// ([`refresh`](Self::refresh)), when the layer shares it fairly and
    /// their demands exceed it.
    fn shares(&self, limiter: &Limiter) -> Option<&Shares> {
        if !limiter.limits.fair_share {
            return None;
        }
        self.demand.shares()
    }

    /// With fair share, computes the shares again if they may have changed.
    fn refresh(&mut self, limiter: &Limiter) {
        if limiter.limits.fair_share
            && let Some(max) = self.global_max(limiter)
        {
            self.demand.refresh(max);
        }
    }

    /// With fair share, when the line is full and `ask`'s tenant is below
    /// its share: the latest waiter of no higher class whose tenant holds
    /// its share, to make room (so one tenant cannot fill the line either).
    fn over_share_waiter(&self, limiter: &Limiter, ask: &Ask) -> Option<usize> {
        let shares = self.shares(limiter)?;
        if self.demand.at_share(ask, shares) {
            return None;
        }
        self.queue
            .iter()
            .rposition(|w| w.ask.class <= ask.class && self.demand.at_share(&w.ask, shares))
    }

    /// Whether a newcomer fits ([`fits`](Self::fits)).
    fn fits_now(&self, limiter: &Limiter, ask: &Ask) -> Result<(), Saturated> {
        self.fits(limiter, ask, None)
    }

    /// `key`'s limit now: its adaptive one's current value, or the fixed
    /// one.
    fn key_max(&self, limiter: &Limiter, key: &str) -> Option<usize> {
        match &self.key_limits {
            Some(limits) => Some(limits.limit(key)),
            None => limiter.limits.per_key_max,
        }
    }

    /// The global limit now: the adaptive one's current value, or the
    /// fixed one.
    fn global_max(&self, limiter: &Limiter) -> Option<usize> {
        match &self.adaptive {
            Some(adaptive) => Some(adaptive.limit() as usize),
            None => limiter.limits.global_max,
        }
    }

    /// Takes a slot for `ask`; when the limit is measured, the time it
    /// was admitted at.
    fn take(&mut self, limiter: &Limiter, ask: &Ask) -> Option<Nanos> {
        let at = limiter.limits.measured().then(|| limiter.now());
        if let (Some(at), Some(_)) = (at, &self.adaptive) {
            *self.started.entry(at).or_insert(0) += 1;
        }
        self.global += 1;
        if let Some(key) = ask.key.as_deref() {
            *self.per_key.entry(key.into()).or_insert(0) += 1;
        }
        if limiter.limits.shares() {
            self.demand.in_flight(ask, 1);
        }
        at
    }

    /// Takes one request admitted at `at` out of `started`.
    fn unlist(&mut self, at: Nanos) {
        if let Some(n) = self.started.get_mut(&at) {
            *n -= 1;
            if *n == 0 {
                self.started.remove(&at);
            }
        }
    }

    /// Gives back the slot of `ask`, admitted at `awaiting` if it is still
    /// listed as awaiting an answer.
    fn give_back(&mut self, limiter: &Limiter, ask: &Ask, awaiting: Option<Nanos>) {
        if let Some(at) = awaiting {
            self.unlist(at);
        }
        self.global = self.global.saturating_sub(1);
        if let Some(key) = ask.key.as_deref()
            && let Some(n) = self.per_key.get_mut(key)
        {
            *n -= 1;
            if *n == 0 {
                self.per_key.remove(key);
            }
        }
        if limiter.limits.shares() {
            self.demand.in_flight(ask, -1);
        }
    }
}

/// A snapshot of a concurrency limit's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ConcurrencyStats {
    /// Requests in flight now.
    pub in_flight: usize,
    /// Requests waiting for a permit now.
    pub waiting: usize,
    /// The most requests ever waiting at once.
    pub peak_waiting: usize,
    /// Requests refused by the per-key limit.
    pub refused_per_key: u64,
    /// Requests refused by the global limit, a full waiting queue, or (for
    /// a [shared](crate::concurrency::ConcurrencyLimitBuilder::shared) limit) a failed
    /// lease store.
    pub refused_global: u64,
    /// Shared limits: leases found gone while their request still ran (the
    /// process was paused, or the store unreachable, for longer than the
    /// lease; or the store lost them: flushed, restarted), and taken again
    /// at their next renewal. Until then others could take their slots.
    pub leases_restored: u64,
    /// Shared limits: leases whose release was given up because too many
    /// releases were waiting to be retried while the store failed; each
    /// holds its slot until its time to live runs out.
    pub releases_abandoned: u64,
    /// Response bodies ended because they made no progress for the layer's
    /// [`body_idle_timeout`](crate::concurrency::ConcurrencyLimitBuilder::body_idle_timeout).
    pub bodies_stalled: u64,
    /// The global limit now: the fixed one, the current value of an
    /// [adaptive](crate::concurrency::ConcurrencyLimitBuilder::adaptive)
    /// one, or `None` for a layer with only a per-key limit.
    pub global_limit: Option<usize>,
}

/// What a limiter bounds.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub(crate) name: Arc<str>,
    pub(crate) global_max: Option<usize>,
    pub(crate) per_key_max: Option<usize>,
    /// At most this many requests wait, each at most `max_wait`.
    pub(crate) waiting: Option<(usize, Duration)>,
    /// The level refusals are logged at.
    pub(crate) log_level: tracing::Level,
    /// Refuse nothing for a full limit: log and count what would have
    /// been refused, and let it through (counted) at once.
    pub(crate) dry_run: bool,
    /// A global limit found from latency instead of `global_max`.
    pub(crate) adaptive: Option<AdaptiveConfig>,
    /// Each key's limit found from latency instead of `per_key_max`.
    pub(crate) per_key_adaptive: Option<AdaptiveConfig>,
    /// Which response statuses an adaptive limit counts as failures
    /// (`None`: every `5xx`).
    pub(crate) failure_when: Option<FailureWhen>,
    /// A full global limit is shared fairly between tenants.
    pub(crate) fair_share: bool,
    /// Requests have classes, and higher ones go first.
    pub(crate) priorities: bool,
}

/// Which response statuses count as failures for an adaptive limit.
#[derive(Clone)]
pub(crate) struct FailureWhen(pub(crate) Arc<dyn Fn(StatusCode) -> bool + Send + Sync>);

impl std::fmt::Debug for FailureWhen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FailureWhen(..)")
    }
}

impl Limits {
    /// Whether requests are counted per key (a fixed or adaptive limit).
    pub(crate) fn per_key(&self) -> bool {
        self.per_key_max.is_some() || self.per_key_adaptive.is_some()
    }

    /// Whether latencies are measured: an adaptive global or per-key limit.
    fn measured(&self) -> bool {
        self.adaptive.is_some() || self.per_key_adaptive.is_some()
    }

    /// Whether each tenant's and class's demand is kept.
    pub(crate) fn shares(&self) -> bool {
        self.fair_share || self.priorities
    }

    /// How many may wait, and how long: never in dry-run (a full limit
    /// lets the request through at once).
    pub(crate) fn waits(&self) -> Option<(usize, Duration)> {
        self.waiting.filter(|_| !self.dry_run)
    }

    /// What a response with `status` tells an adaptive limit: a failure
    /// (`408` and `504` are time-outs), or nothing more than its latency.
    fn failure(&self, status: StatusCode) -> Option<Failure> {
        let failed = match &self.failure_when {
            Some(when) => (when.0)(status),
            None => status.is_server_error(),
        };
        failed.then_some(
            if status == StatusCode::GATEWAY_TIMEOUT || status == StatusCode::REQUEST_TIMEOUT {
                Failure::TimedOut
            } else {
                Failure::Error
            },
        )
    }
}

pub(crate) struct Limiter {
    pub(crate) limits: Limits,
    /// SlotCounts and the waiting queue, under one lock: a release hands its
    /// slot to the first waiter that fits before any new arrival can see
    /// it, so waiting is first come, first served, and each freed slot
    /// wakes exactly one waiter.
    counts: Mutex<SlotCounts>,
    peak_waiters: AtomicUsize,
    refused_per_key: AtomicU64,
    refused_global: AtomicU64,
    /// Where an adaptive limit's time starts (tokio's clock, so a test
    /// with paused time drives it).
    epoch: tokio::time::Instant,
}

/// Held while a request is in flight; gives its slots back on drop.
pub(crate) struct Permit {
    limiter: Arc<Limiter>,
    ask: Ask,
    /// For an adaptive limit: when the request was admitted, and how it
    /// ended (marked by the response and its body).
    sampled: Option<(Nanos, Arc<Ending>)>,
}

/// How a request held by a [`Permit`] ended, for an adaptive limit: the
/// first mark stands (a `5xx` head marks a failure before its body ends).
/// Unmarked when the permit is given back: the request was cancelled
/// (its future or body dropped before the end, or its body ended for
/// stalling, which is as likely the client's doing as the backend's).
#[derive(Debug, Default)]
pub(crate) struct Ending {
    how: AtomicU8,
    /// Its admission time has been taken out of the limiter's list of
    /// requests awaiting an answer (its head arrived).
    answered: AtomicBool,
    /// What the request asked: [`Ending::HEAD`], [`Ending::CONNECT`].
    asked: AtomicU8,
}

impl Ending {
    const UNMARKED: u8 = 0;
    const OK: u8 = 1;
    const ERROR: u8 = 2;
    const TIMED_OUT: u8 = 3;
    /// Neither a latency nor a failure: an answer that says nothing of
    /// the backend's load (`1xx`, `4xx`), or an upgraded connection, whose
    /// life is the client's.
    const IGNORED: u8 = 4;

    /// A `HEAD` request: its answer has no body to wait for.
    pub(crate) const HEAD: u8 = 1;
    /// A `CONNECT` request: a `2xx` answer is a tunnel.
    pub(crate) const CONNECT: u8 = 2;

    /// The request succeeded (its body ended), unless already marked.
    pub(crate) fn ok(&self) {
        self.mark(Self::OK);
    }

    /// The request is to be neither measured nor counted as a failure.
    pub(crate) fn ignore(&self) {
        self.mark(Self::IGNORED);
    }

    /// What the request asked ([`Ending::HEAD`], [`Ending::CONNECT`]),
    /// for reading its answer.
    pub(crate) fn asked(&self, what: u8) {
        self.asked.fetch_or(what, Ordering::Relaxed);
    }

    /// The request failed (an error, or a status counted as one), unless
    /// already marked.
    pub(crate) fn failed(&self, failure: Failure) {
        self.mark(match failure {
            Failure::TimedOut => Self::TIMED_OUT,
            Failure::Cancelled => Self::UNMARKED,
            _ => Self::ERROR,
        });
    }

    fn mark(&self, how: u8) {
        let _ =
            self.how
                .compare_exchange(Self::UNMARKED, how, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// What the request tells the controller; `None`: nothing.
    fn sample(&self, latency: Nanos) -> Option<Sample> {
        match self.how.load(Ordering::Relaxed) {
            Self::OK => Some(Sample::Ok(latency)),
            Self::ERROR => Some(Sample::Failed(Failure::Error)),
            Self::TIMED_OUT => Some(Sample::Failed(Failure::TimedOut)),
            Self::IGNORED => None,
            _ => Some(Sample::Failed(Failure::Cancelled)),
        }
    }
}

impl Permit {
    /// Where to mark how the request ended, for an adaptive limit.
    pub(crate) fn ending(&self) -> Option<&Arc<Ending>> {
        self.sampled.as_ref().map(|(_, ending)| ending)
    }

    /// The response head arrived with `status` (and a declared length,
    /// if any): for an adaptive limit, a status counted as a failure marks
    /// the request failed; an upgrade (a `101`, a `2xx` to `CONNECT`)
    /// lives as long as the client keeps it, and a `1xx` or `4xx` is
    /// decided before any real work (a missing route, a refused
    /// credential, an inner rate limit): neither is measured; an answer
    /// that has no body (to `HEAD`, `204`, `304`, a declared length of 0)
    /// ends here.
    pub(crate) fn answered(&self, status: StatusCode, declared: Option<u64>) {
        let Some((admitted, ending)) = &self.sampled else {
            return;
        };
        // Answered: no longer one of the requests whose age shows a
        // backend that stopped answering (a stream or an upgraded
        // connection lives on, but its head says the backend answered).
        // Requests are listed only for an adaptive global limit.
        if self.limiter.limits.adaptive.is_some() && !ending.answered.swap(true, Ordering::Relaxed)
        {
            self.limiter.lock().unlist(*admitted);
        }
        let asked = ending.asked.load(Ordering::Relaxed);
        if let Some(failure) = self.limiter.limits.failure(status) {
            ending.failed(failure);
        } else if status.is_informational()
            || status.is_client_error()
            || (asked & Ending::CONNECT != 0 && status.is_success())
        {
            ending.ignore();
        } else if asked & Ending::HEAD != 0
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
            || declared == Some(0)
        {
            ending.ok();
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let (handed, change, key_moved) = {
            let mut counts = self.limiter.lock();
            let awaiting = self
                .sampled
                .as_ref()
                .filter(|(_, ending)| !ending.answered.load(Ordering::Relaxed))
                .map(|(at, _)| *at);
            counts.give_back(&self.limiter, &self.ask, awaiting);
            if self.limiter.limits.shares() {
                counts.demand.advance(self.limiter.now());
            }
            let global = in_flight(counts.global);
            // The clock is read only for a measured permit (an adaptive
            // limit): releasing under a fixed limit stays a count.
            let measured = self.sampled.as_ref().map(|(admitted, ending)| {
                let now = self.limiter.now();
                (now, ending.sample(now.saturating_sub(*admitted)))
            });
            let change = match (measured, &mut counts.adaptive) {
                (Some((now, Some(sample))), Some(adaptive)) => adaptive.update(now, global, sample),
                (Some((now, None)), Some(adaptive)) => adaptive.tick(now, global),
                _ => None,
            };
            let change = match measured {
                Some((now, _)) => moves(change, counts.overdue(now)),
                None => change,
            };
            let mut key_moved = None;
            if let (Some((now, sample)), Some(key)) = (measured, self.ask.key.as_deref()) {
                let of_key = in_flight(counts.per_key.get(key).copied().unwrap_or(0));
                if let Some(limits) = &mut counts.key_limits {
                    key_moved = limits.ended(key, now, of_key, sample);
                }
            }
            (self.limiter.hand_over_all(&mut counts), change, key_moved)
        };
        // Sent outside the lock: a waiter gone in the meantime gives the
        // permit straight back, which locks again.
        for (grant, permit) in handed {
            let _ = grant.send(permit);
        }
        if let Some(change) = change {
            self.limiter.report(change);
        }
        if let (Some(change), Some(key)) = (key_moved, self.ask.key.as_deref()) {
            self.limiter.report_key(change, key);
        }
        self.limiter.gauges();
    }
}

/// Two reported moves of one limit, one after the other, as one.
fn moves(first: Option<Change>, then: Option<Change>) -> Option<Change> {
    match (first, then) {
        (Some(first), Some(then)) => Some(Change {
            from: first.from,
            to: then.to,
        }),
        (first, then) => then.or(first),
    }
}

/// A count of requests as the adaptive controller takes it.
fn in_flight(count: usize) -> u32 {
    u32::try_from(count).unwrap_or(u32::MAX)
}

impl Limiter {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            peak_waiters: AtomicUsize::new(0),
            refused_per_key: AtomicU64::new(0),
            refused_global: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
            counts: Mutex::new(SlotCounts {
                adaptive: limits.adaptive.map(|c| AdaptiveLimit::new(c, 0)),
                key_limits: limits.per_key_adaptive.map(KeyLimits::new),
                ..SlotCounts::default()
            }),
            limits,
        }
    }

    fn lock(&self) -> MutexGuard<'_, SlotCounts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Nanoseconds since the limiter was made, on tokio's clock.
    fn now(&self) -> Nanos {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Lets an adaptive limit, fair shares and priorities see the time
    /// pass before a request is decided (a probe may be due, a window over,
    /// a remembered demand lapsed); waiters that fit a limit grown by it,
    /// or shares moved by it, are handed their slots before the newcomer
    /// looks.
    fn advance(self: &Arc<Self>) {
        if self.limits.adaptive.is_none() && !self.limits.shares() {
            return;
        }
        let (handed, change) = {
            let mut counts = self.lock();
            let (now, global) = (self.now(), in_flight(counts.global));
            let change = counts.adaptive.as_mut().and_then(|a| a.tick(now, global));
            let change = moves(change, counts.overdue(now));
            (self.hand_over_all(&mut counts), change)
        };
        for (grant, permit) in handed {
            let _ = grant.send(permit);
        }
        if let Some(change) = change {
            self.report(change);
            self.gauges();
        }
    }

    fn permit(self: &Arc<Self>, ask: Ask, admitted: Option<Nanos>) -> Permit {
        let sampled = admitted.map(|at| (at, Arc::default()));
        Permit {
            limiter: self.clone(),
            ask,
            sampled,
        }
    }

    /// Every waiter that fits now, each slot taken on its behalf: one for
    /// a slot given back, more when an adaptive limit has grown. The
    /// highest class first, and in a class the one that waited longest
    /// (with fair share, only waiters whose tenant is below its share
    /// fit).
    fn hand_over_all(
        self: &Arc<Self>,
        counts: &mut SlotCounts,
    ) -> Vec<(oneshot::Sender<Permit>, Permit)> {
        let mut handed = Vec::new();
        if self.limits.shares() {
            counts.demand.advance(self.now());
        }
        // The shares do not change while waiters become in flight (each
        // tenant's demand counts both).
        counts.refresh(self);
        // (A full global limit fits no waiter: stop looking.)
        while !counts.queue.is_empty()
            && counts
                .global_max(self)
                .is_none_or(|max| counts.global < max)
        {
            // Summed once per slot handed, not per waiter (found in review:
            // a line of 1,000 beside 1,000 tenants cost 70 ms a request).
            let unmet = counts
                .shares(self)
                .map(|shares| counts.demand.unmet_total(shares));
            let mut best: Option<(usize, Priority)> = None;
            for (i, waiter) in counts.queue.iter().enumerate() {
                if best.is_none_or(|(_, class)| waiter.ask.class > class)
                    && counts.fits(self, &waiter.ask, unmet).is_ok()
                {
                    best = Some((i, waiter.ask.class));
                }
            }
            let Some(waiter) = best.and_then(|(i, _)| counts.queue.remove(i)) else {
                break;
            };
            if self.limits.shares() {
                counts.demand.waiting(&waiter.ask, -1);
            }
            let at = counts.take(self, &waiter.ask);
            handed.push((waiter.grant, self.permit(waiter.ask, at)));
        }
        handed
    }

    /// Logs (at info) and records an adaptive limit's move.
    fn report(&self, change: Change) {
        tracing::info!(
            layer = &*self.limits.name,
            from = change.from,
            to = change.to,
            "adaptive concurrency limit moved"
        );
    }

    /// Logs (at debug: one line per key would crowd the info level) a
    /// per-key adaptive limit's move.
    fn report_key(&self, change: Change, key: &str) {
        tracing::debug!(
            layer = &*self.limits.name,
            key = %crate::observe::key_shape_text(key),
            key_fingerprint = %crate::observe::fingerprint_text(key.as_bytes()),
            from = change.from,
            to = change.to,
            "adaptive per-key concurrency limit moved"
        );
    }

    /// A slot taken without checking the limits: a shared limit's lease,
    /// counted here too so that falling back to this process's counts sees
    /// it.
    /// Whether a refusal for `full` lets the request through instead: in
    /// dry-run, for a full limit (not for a failed lease store).
    pub(crate) fn dry_run_admits(&self, full: Saturated) -> bool {
        self.limits.dry_run && full != Saturated::Unavailable
    }

    pub(crate) fn take_unchecked(self: &Arc<Self>, ask: Ask) -> Permit {
        let at = self.lock().take(self, &ask);
        self.gauges();
        self.permit(ask, at)
    }

    /// `ask` arrives. With a per-key adaptive limit, its key's controller
    /// sees the time pass (kept, or made), and if that raised the key's
    /// limit, waiters that fit now are handed their slots before the
    /// newcomer looks. With fair share or priorities, its tenant and class
    /// note their demand (counting it once, however often it is noted),
    /// and the shares are brought up to date.
    ///
    /// What is handed over, and the key's move, are acted on when the
    /// returned [`Arrived`] is dropped: declare it before the lock's guard,
    /// so that the guard is dropped first.
    fn arrive<'a>(self: &'a Arc<Self>, counts: &mut SlotCounts, ask: &mut Ask) -> Arrived<'a> {
        let mut arrived = Arrived {
            limiter: self,
            handed: Vec::new(),
            moved: None,
        };
        let mut grew = false;
        let per_key = &counts.per_key;
        if let (Some(limits), Some(key)) = (&mut counts.key_limits, ask.key.as_deref()) {
            let of_key = in_flight(per_key.get(key).copied().unwrap_or(0));
            let before = limits.limit(key);
            let busy = |k: &str| per_key.contains_key(k);
            arrived.moved = limits
                .arrive(key, self.now(), of_key, busy)
                .map(|change| (change, key.into()));
            grew = limits.limit(key) > before;
        }
        if grew && !counts.queue.is_empty() {
            arrived.handed = self.hand_over_all(counts);
        }
        if self.limits.shares() {
            counts.demand.arrive(ask, self.now());
            counts.refresh(self);
        }
        arrived
    }

    /// `ask` is refused, or made to wait: with fair share or priorities,
    /// its tenant and class claim what they wanted until admitted.
    fn turned_away(&self, counts: &mut SlotCounts, ask: &Ask) {
        if self.limits.shares() {
            counts.demand.refused(ask);
        }
    }

    pub(crate) fn try_acquire(self: &Arc<Self>, ask: &mut Ask) -> Result<Permit, Saturated> {
        self.advance();
        let _arrived;
        let mut counts = self.lock();
        _arrived = self.arrive(&mut counts, ask);
        if let Err(full) = counts.fits_now(self, ask) {
            self.turned_away(&mut counts, ask);
            return Err(full);
        }
        let at = counts.take(self, ask);
        drop(counts);
        self.gauges();
        Ok(self.permit(ask.clone(), at))
    }

    /// Acquires at once, or (if waiting is configured) waits in a bounded
    /// line for at most the configured time: a freed slot goes to the
    /// highest class waiting, first come first served within a class; a
    /// full line makes room for a higher class by refusing its lowest,
    /// latest waiter.
    pub(crate) async fn acquire(self: Arc<Self>, mut ask: Ask) -> Result<Permit, Saturated> {
        let Some((max_waiters, max_wait)) = self.limits.waits() else {
            return self
                .try_acquire(&mut ask)
                .map_err(|full| self.refused(full, ask.key.as_deref()));
        };
        let (id, full, granted, shown, displaced) = {
            self.advance();
            let _arrived;
            let mut counts = self.lock();
            _arrived = self.arrive(&mut counts, &mut ask);
            let full = match counts.fits_now(&self, &ask) {
                Ok(()) => {
                    let at = counts.take(&self, &ask);
                    drop(counts);
                    self.gauges();
                    return Ok(self.permit(ask, at));
                }
                Err(full) => full,
            };
            let key = &ask.key;
            // One key may not have more waiters than it may have in flight:
            // its waiters cannot use a freed slot until one of its own is
            // freed, and must not fill the queue that other clients share.
            let waiting_for_key = |counts: &SlotCounts| match key
                .as_deref()
                .and_then(|key| Some((key, counts.key_max(&self, key)?)))
            {
                Some((key, max)) => {
                    counts
                        .queue
                        .iter()
                        .filter(|w| w.ask.key.as_deref() == Some(key))
                        .count()
                        >= max
                }
                _ => false,
            };
            if full == Saturated::PerKey && waiting_for_key(&counts) {
                self.turned_away(&mut counts, &ask);
                drop(counts);
                return Err(self.refused(Saturated::PerKey, ask.key.as_deref()));
            }
            // A full line: a waiter of a lower class makes room, or this
            // request is refused.
            let mut displaced = None;
            if counts.queue.len() >= max_waiters {
                let lowest = tollgate_budget::displaced_by(
                    counts.queue.iter().map(|w| w.ask.class),
                    ask.class,
                )
                .or_else(|| counts.over_share_waiter(&self, &ask));
                match lowest.and_then(|i| counts.queue.remove(i)) {
                    Some(waiter) => {
                        if self.limits.shares() {
                            counts.demand.waiting(&waiter.ask, -1);
                        }
                        displaced = Some(waiter);
                    }
                    None => {
                        self.turned_away(&mut counts, &ask);
                        drop(counts);
                        // Refused for the limit it is over: its own key's
                        // (429) or the shared one (503).
                        let why = match full {
                            Saturated::PerKey => Saturated::PerKey,
                            _ => Saturated::Queue,
                        };
                        return Err(self.refused(why, ask.key.as_deref()));
                    }
                }
            }
            let (grant, granted) = oneshot::channel();
            let shown = ask.key.clone();
            let id = counts.next_waiter;
            counts.next_waiter += 1;
            if self.limits.shares() {
                counts.demand.waiting(&ask, 1);
            }
            counts.queue.push_back(Waiter { id, ask, grant });
            self.peak_waiters
                .fetch_max(counts.queue.len(), Ordering::Relaxed);
            (id, full, granted, shown, displaced)
        };
        // The displaced waiter's grant is dropped: it wakes, refused.
        drop(displaced);
        self.gauges();
        // Leaves the queue however the wait ends (the future may be
        // dropped while waiting).
        let _queued = LocalWaiter { limiter: &self, id };
        let deadline = tokio::time::Instant::now().checked_add(max_wait);
        let mut granted = granted;
        loop {
            // With fair share or priorities, the waiter also wakes when a
            // period of remembered demand ends: shares that lapse may let
            // it in, and no release or arrival may come to hand it over.
            let lapse = self.limits.shares().then(|| {
                let next = self.lock().demand.next_period();
                self.epoch + Duration::from_nanos(next)
            });
            let wake = match (deadline, lapse) {
                (Some(d), Some(l)) => Some(d.min(l)),
                (d, l) => d.or(l),
            };
            let answer = match wake {
                Some(wake) => tokio::time::timeout_at(wake, &mut granted).await,
                None => Ok((&mut granted).await),
            };
            match answer {
                Ok(Ok(permit)) => return Ok(permit),
                // Its place was given to a higher class (or a tenant below
                // its share): the line was full.
                Ok(Err(_)) => return Err(self.refused(Saturated::Queue, shown.as_deref())),
                Err(_) if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) => {
                    // Timed out. Still queued: refused. Not queued any
                    // more: a slot was handed over at the last moment, and
                    // the permit it sent is in the dropped receiver, which
                    // gives it back.
                    return Err(self.refused(full, shown.as_deref()));
                }
                // A period ended: hand over what fits now (this waiter,
                // perhaps), and wait on.
                Err(_) => self.advance(),
            }
        }
    }

    /// SlotCounts (and logs, at the layer's level, with `key`'s shape and
    /// fingerprint) a refusal for `full`.
    pub(crate) fn refused(&self, full: Saturated, key: Option<&str>) -> Saturated {
        let scope = match full {
            Saturated::PerKey => "per_key",
            Saturated::Global => "global",
            Saturated::Queue => "queue",
            Saturated::Unavailable => "store_unavailable",
            Saturated::FairShare => "fair_share",
            Saturated::Priority => "priority",
        };
        if self.dry_run_admits(full) {
            tracing::info!(
                layer = &*self.limits.name,
                scope,
                key = %key.map_or_else(|| "-".to_owned(), crate::observe::key_shape_text),
                key_fingerprint = %key.map_or_else(|| "-".to_owned(), |k| crate::observe::fingerprint_text(k.as_bytes())),
                "dry run: this request would have been refused: too many in flight"
            );
            // Counter `tollgate_dry_run_refused_total{layer, scope}` (`scope`:
            // `per_key`, `global`, `queue`, `fair_share` or `priority`);
            // documented in observe.rs.
            #[cfg(feature = "metrics")]
            metrics::counter!(
                "tollgate_dry_run_refused_total",
                "layer" => self.limits.name.to_string(),
                "scope" => scope
            )
            .increment(1);
            return full;
        }
        crate::observe::event_at!(
            self.limits.log_level,
            layer = &*self.limits.name,
            scope,
            key = %key.map_or_else(|| "-".to_owned(), crate::observe::key_shape_text),
            key_fingerprint = %key.map_or_else(|| "-".to_owned(), |k| crate::observe::fingerprint_text(k.as_bytes())),
            "refused: too many in flight"
        );
        let counter = match full {
            Saturated::PerKey => &self.refused_per_key,
            Saturated::Global
            | Saturated::Queue
            | Saturated::Unavailable
            | Saturated::FairShare
            | Saturated::Priority => &self.refused_global,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // Counter `tollgate_concurrency_refused_total{layer, scope}` (`scope`:
        // `per_key`, `global`, `queue`, `fair_share`, `priority` or
        // `store_unavailable`); documented in
        // observe.rs.
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tollgate_concurrency_refused_total",
            "layer" => self.limits.name.to_string(),
            "scope" => scope
        )
        .increment(1);
        full
    }

    /// Sets the gauges `tollgate_in_flight{layer}` and
    /// `tollgate_waiting{layer}` (this process's counts) and, for an
    /// adaptive limit, `tollgate_concurrency_limit{layer}` (documented in
    /// observe.rs).
    fn gauges(&self) {
        #[cfg(feature = "metrics")]
        {
            let stats = self.stats();
            metrics::gauge!("tollgate_in_flight", "layer" => self.limits.name.to_string())
                .set(stats.in_flight as f64);
            metrics::gauge!("tollgate_waiting", "layer" => self.limits.name.to_string())
                .set(stats.waiting as f64);
            // Gauge `tollgate_concurrency_limit{layer}`, for an adaptive
            // limit; documented in observe.rs.
            if let (true, Some(limit)) = (self.limits.adaptive.is_some(), stats.global_limit) {
                metrics::gauge!("tollgate_concurrency_limit", "layer" => self.limits.name.to_string())
                    .set(limit as f64);
            }
        }
    }

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        let counts = self.lock();
        ConcurrencyStats {
            in_flight: counts.global,
            waiting: counts.queue.len(),
            peak_waiting: self.peak_waiters.load(Ordering::Relaxed),
            refused_per_key: self.refused_per_key.load(Ordering::Relaxed),
            refused_global: self.refused_global.load(Ordering::Relaxed),
            leases_restored: 0,
            releases_abandoned: 0,
            bodies_stalled: 0,
            global_limit: counts.global_max(self),
        }
    }
}

/// What an arrival leaves to do outside the lock: permits handed to
/// waiters (a key's limit grew), and a key's limit's move to log.
struct Arrived<'a> {
    limiter: &'a Arc<Limiter>,
    handed: Vec<(oneshot::Sender<Permit>, Permit)>,
    moved: Option<(Change, Box<str>)>,
}

impl Drop for Arrived<'_> {
    fn drop(&mut self) {
        // A waiter gone in the meantime gives its permit straight back,
        // which locks again: the caller's guard must be gone.
        for (grant, permit) in self.handed.drain(..) {
            let _ = grant.send(permit);
        }
        if let Some((change, key)) = self.moved.take() {
            self.limiter.report_key(change, &key);
        }
    }
}

/// Removes a waiter from the queue when its wait ends, however it ends.
struct LocalWaiter<'a> {
    limiter: &'a Limiter,
    id: u64,
}

impl Drop for LocalWaiter<'_> {
    fn drop(&mut self) {
        {
            let mut counts = self.limiter.lock();
            if let Some(i) = counts.queue.iter().position(|w| w.id == self.id)
                && let Some(waiter) = counts.queue.remove(i)
                && self.limiter.limits.shares()
            {
                counts.demand.waiting(&waiter.ask, -1);
            }
        }
        self.limiter.gauges();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(global: usize, waiting: usize) -> Arc<Limiter> {
        Arc::new(Limiter::new(Limits {
            name: "fifo".into(),
            global_max: Some(global),
            per_key_max: Some(1),
            per_key_adaptive: None,
            waiting: Some((waiting, Duration::from_secs(60))),
            log_level: tracing::Level::DEBUG,
            dry_run: false,
            adaptive: None,
            failure_when: None,
            fair_share: false,
            priorities: false,
        }))
    }

    fn key(k: &str) -> Ask {
        Ask::keyed(Some(k.into()))
    }

    /// Audit finding 7: a freed slot woke every waiter and could be taken
    /// by a new arrival first. Now waiters are served in arrival order, a
    /// release hands its slot to one of them, and nobody barges in.
    #[tokio::test(flavor = "current_thread")]
    async fn waiters_are_served_first_come_first_served_and_nobody_barges() {
        let l = limiter(1, 8);
        let held = l.try_acquire(&mut Ask::keyed(None)).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (mine, order) = (l.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let permit = mine.acquire(Ask::keyed(None)).await.unwrap();
                order.lock().unwrap().push(i);
                // Hold it a moment so the next one has to wait for it.
                tokio::task::yield_now().await;
                drop(permit);
            }));
            // Let it queue before the next one arrives.
            while l.stats().waiting < i + 1 {
                tokio::task::yield_now().await;
            }
        }
        drop(held);
        // The slot went to the first waiter: a newcomer finds none free.
        assert_eq!(
            l.try_acquire(&mut Ask::keyed(None)).err(),
            Some(Saturated::Global)
        );
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3]);
        assert_eq!(l.stats().in_flight, 0);
        assert_eq!(l.stats().waiting, 0);
    }

    /// A waiter for a full key does not hold up other keys, and is served
    /// when its key frees, before newcomers of that key.
    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_takes_its_freed_key_slot_before_newcomers() {
        let l = limiter(4, 8);
        let a = l.try_acquire(&mut key("a")).unwrap();
        let waiting = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(key("a")).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        let b = l.try_acquire(&mut key("b")).unwrap();
        drop(a);
        assert_eq!(l.try_acquire(&mut key("a")).err(), Some(Saturated::PerKey));
        waiting.await.unwrap().unwrap();
        drop(b);
        assert_eq!(l.stats().in_flight, 0);
    }

    /// Found in review: waiters over their key's limit could fill the
    /// shared queue (a freed global slot is no use to them), and the next
    /// request of that key was answered 503 "at capacity" instead of 429.
    #[tokio::test(flavor = "current_thread")]
    async fn one_key_cannot_fill_the_waiting_queue() {
        let l = limiter(2, 2);
        let a = l.try_acquire(&mut key("a")).unwrap();
        let b = l.try_acquire(&mut key("b")).unwrap();
        let a2 = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(key("a")).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        // A second waiter for "a" is refused for its own key at once.
        assert_eq!(
            l.clone().acquire(key("a")).await.err(),
            Some(Saturated::PerKey)
        );
        // Another client still finds room to wait, and gets b's slot.
        let c = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(key("c")).await.map(drop) }
        });
        while l.stats().waiting < 2 {
            tokio::task::yield_now().await;
        }
        drop(b);
        c.await.unwrap().unwrap();
        drop(a);
        a2.await.unwrap().unwrap();
        assert_eq!(l.stats().in_flight, 0);
    }

    /// A waiter whose future is dropped leaves the queue; a slot freed
    /// later goes to the next waiter.
    #[tokio::test(flavor = "current_thread")]
    async fn a_dropped_waiter_leaves_the_queue() {
        let l = limiter(1, 8);
        let held = l.try_acquire(&mut Ask::keyed(None)).unwrap();
        let gone = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(Ask::keyed(None)).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        let next = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(Ask::keyed(None)).await.map(drop) }
        });
        while l.stats().waiting < 2 {
            tokio::task::yield_now().await;
        }
        gone.abort();
        let _ = gone.await;
        assert_eq!(l.stats().waiting, 1);
        drop(held);
        next.await.unwrap().unwrap();
        assert_eq!(l.stats().in_flight, 0);
    }

    fn classed(global: usize, waiting: usize, fair_share: bool) -> Arc<Limiter> {
        Arc::new(Limiter::new(Limits {
            name: "classes".into(),
            global_max: Some(global),
            per_key_max: None,
            per_key_adaptive: None,
            waiting: Some((waiting, Duration::from_secs(60))),
            log_level: tracing::Level::DEBUG,
            dry_run: false,
            adaptive: None,
            failure_when: None,
            fair_share,
            priorities: !fair_share,
        }))
    }

    fn ask(tenant: &str, class: Priority) -> Ask {
        Ask {
            tenant: Some(tenant.into()),
            class,
            ..Ask::keyed(None)
        }
    }

    /// Queues `ask` and waits until it is in the line (the newest waiter).
    async fn queue(l: &Arc<Limiter>, a: Ask) -> tokio::task::JoinHandle<Result<Ask, Saturated>> {
        let id = l.lock().next_waiter;
        let task = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(a).await.map(|p| p.ask.clone()) }
        });
        while l.lock().queue.back().is_none_or(|w| w.id != id) {
            tokio::task::yield_now().await;
        }
        task
    }

    /// A freed slot goes to the highest class waiting, although a lower
    /// one came first; a full line makes room for a higher class by
    /// refusing its lowest, latest waiter.
    #[tokio::test(flavor = "current_thread")]
    async fn the_line_serves_higher_classes_first() {
        let l = classed(1, 2, false);
        let held = l.try_acquire(&mut ask("a", Priority::Critical)).unwrap();
        let batch = queue(&l, ask("a", Priority::Batch)).await;
        let normal = queue(&l, ask("a", Priority::Normal)).await;
        // The line is full: an interactive request displaces the batch one.
        let interactive = queue(&l, ask("a", Priority::Interactive)).await;
        assert_eq!(batch.await.unwrap().err(), Some(Saturated::Queue));
        // A batch request finds the line full of higher classes: refused.
        assert_eq!(
            l.clone().acquire(ask("a", Priority::Batch)).await.err(),
            Some(Saturated::Queue)
        );
        drop(held);
        let first = interactive.await.unwrap().unwrap();
        assert_eq!(first.class, Priority::Interactive);
        // (The interactive permit was dropped with its task: the normal
        // waiter has the slot.)
        assert_eq!(normal.await.unwrap().unwrap().class, Priority::Normal);
        assert_eq!(l.stats().in_flight, 0);
        assert_eq!(l.stats().waiting, 0);
    }

    /// With priorities, a lower class is refused while a higher class's
    /// recent demand is not in flight, even below the limit.
    #[tokio::test(flavor = "current_thread")]
    async fn slots_are_kept_for_the_demand_of_higher_classes() {
        let l = classed(4, 0, false);
        let i1 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let i2 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let i3 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        drop((i1, i2));
        // Interactive wanted 3 and holds 1: 2 of the 3 free slots are kept.
        let b = l.try_acquire(&mut ask("b", Priority::Batch)).unwrap();
        assert_eq!(
            l.try_acquire(&mut ask("b", Priority::Batch)).err(),
            Some(Saturated::Priority)
        );
        // Interactive itself is not held back by its own demand.
        let i4 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let i5 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        assert_eq!(
            l.try_acquire(&mut ask("a", Priority::Interactive)).err(),
            Some(Saturated::Global)
        );
        drop((b, i3, i4, i5));
        assert_eq!(l.stats().in_flight, 0);
    }

    /// A waiter is held to the room kept for higher classes as a newcomer
    /// is: a line is no way around it.
    #[tokio::test(flavor = "current_thread")]
    async fn a_waiter_of_a_lower_class_does_not_take_room_kept_for_a_higher_one() {
        let l = classed(3, 2, false);
        let i1 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let i2 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let i3 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        let batch = queue(&l, ask("b", Priority::Batch)).await;
        // Interactive wanted 3 and holds 2: the freed slot is kept for it,
        // not handed to the batch waiter.
        drop(i1);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!((l.stats().in_flight, l.stats().waiting), (2, 1));
        let i4 = l.try_acquire(&mut ask("a", Priority::Interactive)).unwrap();
        // Once interactive wants nothing, the batch waiter has a slot.
        drop((i2, i3, i4));
        assert_eq!(batch.await.unwrap().unwrap().class, Priority::Batch);
        assert_eq!(l.stats().in_flight, 0);
    }

    /// With fair share, a tenant at its share is refused while one below
    /// it is admitted; in a full line, a tenant below its share takes the
    /// place of the latest waiter of one at its share, and a freed slot
    /// goes to the tenant below its share.
    #[tokio::test(flavor = "current_thread")]
    async fn a_tenant_at_its_share_gives_way_in_the_line() {
        let l = classed(2, 2, true);
        let a1 = l.try_acquire(&mut ask("a", Priority::Normal)).unwrap();
        let a2 = l.try_acquire(&mut ask("a", Priority::Normal)).unwrap();
        // "a" wants 3 (2 in flight, this one): alone, not contended.
        let a3 = queue(&l, ask("a", Priority::Normal)).await;
        let a4 = queue(&l, ask("a", Priority::Normal)).await;
        // "b" arrives: demands 4 and 1 over a limit of 2, shares 1 and 1.
        // The line is full; "a" is at (above) its share: its latest waiter
        // makes room.
        let b = queue(&l, ask("b", Priority::Normal)).await;
        assert_eq!(a4.await.unwrap().err(), Some(Saturated::Queue));
        drop(a1);
        // The freed slot goes to "b", below its share, not to "a3", first
        // in line.
        assert_eq!(b.await.unwrap().unwrap().tenant.as_deref(), Some("b"));
        drop(a2);
        assert_eq!(a3.await.unwrap().unwrap().tenant.as_deref(), Some("a"));
        assert_eq!(l.stats().in_flight, 0);
    }
}
