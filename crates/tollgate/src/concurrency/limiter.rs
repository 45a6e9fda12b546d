//! In-flight accounting: a global count and per-key counts under one lock,
//! permits that give back on drop, and bounded first-come-first-served
//! waiting in which a freed slot is handed to one waiter. An adaptive
//! global limit is fed, under the same lock, by every permit given back.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::StatusCode;
use tokio::sync::oneshot;
use tollgate_budget::{AdaptiveConfig, AdaptiveLimit, Change, Failure, Nanos, Sample};

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Saturated {
    Global,
    PerKey,
    /// Bounded waiting is on, but every waiting slot is taken.
    Queue,
    /// The fleet's lease store failed, and the layer fails closed.
    Unavailable,
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
}

/// A request waiting in the queue; a freed slot is handed to it directly.
struct Waiter {
    id: u64,
    key: Option<Box<str>>,
    grant: oneshot::Sender<Permit>,
}

impl SlotCounts {
    fn fits(&self, limiter: &Limiter, key: Option<&str>) -> Result<(), Saturated> {
        if let (Some(max), Some(key)) = (limiter.limits.per_key_max, key)
            && self.per_key.get(key).copied().unwrap_or(0) >= max
        {
            return Err(Saturated::PerKey);
        }
        if self
            .global_max(limiter)
            .is_some_and(|max| self.global >= max)
        {
            return Err(Saturated::Global);
        }
        Ok(())
    }

    /// The global limit now: the adaptive one's current value, or the
    /// fixed one.
    fn global_max(&self, limiter: &Limiter) -> Option<usize> {
        match &self.adaptive {
            Some(adaptive) => Some(adaptive.limit() as usize),
            None => limiter.limits.global_max,
        }
    }

    fn take(&mut self, key: Option<&str>) {
        self.global += 1;
        if let Some(key) = key {
            *self.per_key.entry(key.into()).or_insert(0) += 1;
        }
    }

    fn give_back(&mut self, key: Option<&str>) {
        self.global = self.global.saturating_sub(1);
        if let Some(key) = key
            && let Some(n) = self.per_key.get_mut(key)
        {
            *n -= 1;
            if *n == 0 {
                self.per_key.remove(key);
            }
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
    /// Which response statuses an adaptive limit counts as failures
    /// (`None`: every `5xx`).
    pub(crate) failure_when: Option<FailureWhen>,
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
    key: Option<Box<str>>,
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
        let Some((_, ending)) = &self.sampled else {
            return;
        };
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
        let (handed, change) = {
            let mut counts = self.limiter.lock();
            counts.give_back(self.key.as_deref());
            let global = in_flight(counts.global);
            let change = match (&self.sampled, &mut counts.adaptive) {
                (Some((admitted, ending)), Some(adaptive)) => {
                    let now = self.limiter.now();
                    match ending.sample(now.saturating_sub(*admitted)) {
                        Some(sample) => adaptive.update(now, global, sample),
                        None => adaptive.tick(now, global),
                    }
                }
                _ => None,
            };
            (self.limiter.hand_over_all(&mut counts), change)
        };
        // Sent outside the lock: a waiter gone in the meantime gives the
        // permit straight back, which locks again.
        for (grant, permit) in handed {
            let _ = grant.send(permit);
        }
        if let Some(change) = change {
            self.limiter.report(change);
        }
        self.limiter.gauges();
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

    /// Lets an adaptive limit see the time pass before a request is
    /// decided (a probe may be due, or a window over); waiters that fit a
    /// limit grown by it are handed their slots before the newcomer looks.
    fn advance(self: &Arc<Self>) {
        if self.limits.adaptive.is_none() {
            return;
        }
        let (handed, change) = {
            let mut counts = self.lock();
            let (now, global) = (self.now(), in_flight(counts.global));
            let change = counts.adaptive.as_mut().and_then(|a| a.tick(now, global));
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

    fn permit(self: &Arc<Self>, key: Option<Box<str>>) -> Permit {
        let sampled = self
            .limits
            .adaptive
            .is_some()
            .then(|| (self.now(), Arc::default()));
        Permit {
            limiter: self.clone(),
            key,
            sampled,
        }
    }

    /// Every waiter that fits now, in order of arrival, each slot taken on
    /// its behalf: one for a slot given back, more when an adaptive limit
    /// has grown.
    fn hand_over_all(
        self: &Arc<Self>,
        counts: &mut SlotCounts,
    ) -> Vec<(oneshot::Sender<Permit>, Permit)> {
        let mut handed = Vec::new();
        let mut i = 0;
        // (A full global limit fits no waiter: stop looking.)
        while i < counts.queue.len()
            && counts
                .global_max(self)
                .is_none_or(|max| counts.global < max)
        {
            if counts.fits(self, counts.queue[i].key.as_deref()).is_ok()
                && let Some(waiter) = counts.queue.remove(i)
            {
                counts.take(waiter.key.as_deref());
                handed.push((waiter.grant, self.permit(waiter.key)));
            } else {
                i += 1;
            }
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

    /// A slot taken without checking the limits: a shared limit's lease,
    /// counted here too so that falling back to this process's counts sees
    /// it.
    /// Whether a refusal for `full` lets the request through instead: in
    /// dry-run, for a full limit (not for a failed lease store).
    pub(crate) fn dry_run_admits(&self, full: Saturated) -> bool {
        self.limits.dry_run && full != Saturated::Unavailable
    }

    pub(crate) fn take_unchecked(self: &Arc<Self>, key: Option<&str>) -> Permit {
        self.lock().take(key);
        self.gauges();
        self.permit(key.map(Into::into))
    }

    pub(crate) fn try_acquire(self: &Arc<Self>, key: Option<&str>) -> Result<Permit, Saturated> {
        self.advance();
        let mut counts = self.lock();
        counts.fits(self, key)?;
        counts.take(key);
        drop(counts);
        self.gauges();
        Ok(self.permit(key.map(Into::into)))
    }

    /// Acquires at once, or (if waiting is configured) waits in a bounded
    /// first-come-first-served queue for at most the configured time.
    pub(crate) async fn acquire(
        self: Arc<Self>,
        key: Option<Box<str>>,
    ) -> Result<Permit, Saturated> {
        let Some((max_waiters, max_wait)) = self.limits.waits() else {
            return self
                .try_acquire(key.as_deref())
                .map_err(|full| self.refused(full, key.as_deref()));
        };
        let (id, full, granted, shown) = {
            self.advance();
            let mut counts = self.lock();
            let full = match counts.fits(&self, key.as_deref()) {
                Ok(()) => {
                    counts.take(key.as_deref());
                    drop(counts);
                    self.gauges();
                    return Ok(self.permit(key));
                }
                Err(full) => full,
            };
            // One key may not have more waiters than it may have in flight:
            // its waiters cannot use a freed slot until one of its own is
            // freed, and must not fill the queue that other clients share.
            let waiting_for_key = |counts: &SlotCounts| match (&key, self.limits.per_key_max) {
                (Some(key), Some(max)) => {
                    counts
                        .queue
                        .iter()
                        .filter(|w| w.key.as_deref() == Some(&**key))
                        .count()
                        >= max
                }
                _ => false,
            };
            if full == Saturated::PerKey && waiting_for_key(&counts) {
                drop(counts);
                return Err(self.refused(Saturated::PerKey, key.as_deref()));
            }
            if counts.queue.len() >= max_waiters {
                drop(counts);
                // Refused for the limit it is over: its own key's (429) or
                // the shared one (503).
                let why = match full {
                    Saturated::PerKey => Saturated::PerKey,
                    _ => Saturated::Queue,
                };
                return Err(self.refused(why, key.as_deref()));
            }
            let (grant, granted) = oneshot::channel();
            let shown = key.clone();
            let id = counts.next_waiter;
            counts.next_waiter += 1;
            counts.queue.push_back(Waiter { id, key, grant });
            self.peak_waiters
                .fetch_max(counts.queue.len(), Ordering::Relaxed);
            (id, full, granted, shown)
        };
        self.gauges();
        // Leaves the queue however the wait ends (the future may be
        // dropped while waiting).
        let _queued = LocalWaiter { limiter: &self, id };
        match tokio::time::timeout(max_wait, granted).await {
            Ok(Ok(permit)) => Ok(permit),
            _ => {
                // Timed out. Still queued: refused. Not queued any more: a
                // slot was handed over at the last moment, and the permit
                // it sent is in the dropped receiver, which gives it back.
                Err(self.refused(full, shown.as_deref()))
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
            // `per_key`, `global` or `queue`); documented in observe.rs.
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
            Saturated::Global | Saturated::Queue | Saturated::Unavailable => &self.refused_global,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        // Counter `tollgate_concurrency_refused_total{layer, scope}` (`scope`:
        // `per_key`, `global`, `queue` or `store_unavailable`); documented in
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

/// Removes a waiter from the queue when its wait ends, however it ends.
struct LocalWaiter<'a> {
    limiter: &'a Limiter,
    id: u64,
}

impl Drop for LocalWaiter<'_> {
    fn drop(&mut self) {
        {
            let mut counts = self.limiter.lock();
            if let Some(i) = counts.queue.iter().position(|w| w.id == self.id) {
                counts.queue.remove(i);
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
            waiting: Some((waiting, Duration::from_secs(60))),
            log_level: tracing::Level::DEBUG,
            dry_run: false,
            adaptive: None,
            failure_when: None,
        }))
    }

    /// Audit finding 7: a freed slot woke every waiter and could be taken
    /// by a new arrival first. Now waiters are served in arrival order, a
    /// release hands its slot to one of them, and nobody barges in.
    #[tokio::test(flavor = "current_thread")]
    async fn waiters_are_served_first_come_first_served_and_nobody_barges() {
        let l = limiter(1, 8);
        let held = l.try_acquire(None).unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (mine, order) = (l.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let permit = mine.acquire(None).await.unwrap();
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
        assert_eq!(l.try_acquire(None).err(), Some(Saturated::Global));
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
        let a = l.try_acquire(Some("a")).unwrap();
        let waiting = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(Some("a".into())).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        let b = l.try_acquire(Some("b")).unwrap();
        drop(a);
        assert_eq!(l.try_acquire(Some("a")).err(), Some(Saturated::PerKey));
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
        let a = l.try_acquire(Some("a")).unwrap();
        let b = l.try_acquire(Some("b")).unwrap();
        let a2 = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(Some("a".into())).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        // A second waiter for "a" is refused for its own key at once.
        assert_eq!(
            l.clone().acquire(Some("a".into())).await.err(),
            Some(Saturated::PerKey)
        );
        // Another client still finds room to wait, and gets b's slot.
        let c = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(Some("c".into())).await.map(drop) }
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
        let held = l.try_acquire(None).unwrap();
        let gone = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(None).await.map(drop) }
        });
        while l.stats().waiting < 1 {
            tokio::task::yield_now().await;
        }
        let next = tokio::spawn({
            let l = l.clone();
            async move { l.acquire(None).await.map(drop) }
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
}
