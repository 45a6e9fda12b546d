//! In-flight accounting: a global count and per-key counts under one lock,
//! permits that give back on drop, and bounded waiting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

/// Which limit refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    Global,
    PerKey,
    /// Bounded waiting is on, but every waiting slot is taken.
    Queue,
}

#[derive(Default)]
struct Counts {
    global: usize,
    per_key: HashMap<Box<str>, usize>,
}

/// A snapshot of a concurrency limit's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConcurrencyStats {
    /// Requests in flight now.
    pub in_flight: usize,
    /// Requests waiting for a permit now.
    pub waiting: usize,
    /// The most requests ever waiting at once.
    pub peak_waiting: usize,
    /// Requests refused by the per-key limit.
    pub refused_per_key: u64,
    /// Requests refused by the global limit or a full waiting queue.
    pub refused_global: u64,
}

pub(crate) struct Limiter {
    pub(crate) name: Arc<str>,
    pub(crate) global_max: Option<usize>,
    pub(crate) per_key_max: Option<usize>,
    /// At most this many requests wait, each at most `max_wait`.
    pub(crate) waiting: Option<(usize, Duration)>,
    counts: Mutex<Counts>,
    released: Notify,
    waiters: AtomicUsize,
    peak_waiters: AtomicUsize,
    refused_per_key: AtomicU64,
    refused_global: AtomicU64,
}

/// Held while a request is in flight; gives its slots back on drop.
pub(crate) struct Permit {
    limiter: Arc<Limiter>,
    key: Option<Box<str>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        {
            let mut counts = self.limiter.lock();
            counts.global = counts.global.saturating_sub(1);
            if let Some(key) = &self.key {
                if let Some(n) = counts.per_key.get_mut(key) {
                    *n -= 1;
                    if *n == 0 {
                        counts.per_key.remove(key);
                    }
                }
            }
        }
        self.limiter.released.notify_waiters();
        self.limiter.gauges();
    }
}

impl Limiter {
    pub(crate) fn new(
        name: Arc<str>,
        global_max: Option<usize>,
        per_key_max: Option<usize>,
        waiting: Option<(usize, Duration)>,
    ) -> Self {
        Self {
            name,
            global_max,
            per_key_max,
            waiting,
            counts: Mutex::new(Counts::default()),
            released: Notify::new(),
            waiters: AtomicUsize::new(0),
            peak_waiters: AtomicUsize::new(0),
            refused_per_key: AtomicU64::new(0),
            refused_global: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn try_acquire(self: &Arc<Self>, key: Option<&str>) -> Result<Permit, Full> {
        let mut counts = self.lock();
        if let (Some(max), Some(key)) = (self.per_key_max, key) {
            if counts.per_key.get(key).copied().unwrap_or(0) >= max {
                return Err(Full::PerKey);
            }
        }
        if self.global_max.is_some_and(|max| counts.global >= max) {
            return Err(Full::Global);
        }
        counts.global += 1;
        if let Some(key) = key {
            *counts.per_key.entry(key.into()).or_insert(0) += 1;
        }
        drop(counts);
        self.gauges();
        Ok(Permit {
            limiter: self.clone(),
            key: key.map(Into::into),
        })
    }

    /// Acquires at once, or (if waiting is configured) waits in a bounded
    /// queue for at most the configured time.
    pub(crate) async fn acquire(self: Arc<Self>, key: Option<Box<str>>) -> Result<Permit, Full> {
        let first = match self.try_acquire(key.as_deref()) {
            Ok(p) => return Ok(p),
            Err(full) => full,
        };
        let Some((max_waiters, max_wait)) = self.waiting else {
            return Err(self.refused(first));
        };
        // Claim a waiting slot, never more than the bound.
        let claimed = self
            .waiters
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < max_waiters).then_some(w + 1)
            });
        let Ok(before) = claimed else {
            return Err(self.refused(Full::Queue));
        };
        self.peak_waiters.fetch_max(before + 1, Ordering::Relaxed);
        self.gauges();
        let _slot = WaitSlot(&self);
        let deadline = tokio::time::Instant::now() + max_wait;
        loop {
            // Register for a release before trying, so none is missed.
            let notified = self.released.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let full = match self.try_acquire(key.as_deref()) {
                Ok(p) => return Ok(p),
                Err(full) => full,
            };
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(self.refused(full));
            }
        }
    }

    pub(crate) fn refused(&self, full: Full) -> Full {
        let counter = match full {
            Full::PerKey => &self.refused_per_key,
            Full::Global | Full::Queue => &self.refused_global,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tollgate_concurrency_refused_total",
            "layer" => self.name.to_string(),
            "scope" => match full { Full::PerKey => "per_key", Full::Global => "global", Full::Queue => "queue" }
        )
        .increment(1);
        full
    }

    fn gauges(&self) {
        #[cfg(feature = "metrics")]
        {
            let stats = self.stats();
            metrics::gauge!("tollgate_in_flight", "layer" => self.name.to_string())
                .set(stats.in_flight as f64);
            metrics::gauge!("tollgate_waiting", "layer" => self.name.to_string())
                .set(stats.waiting as f64);
        }
    }

    pub(crate) fn stats(&self) -> ConcurrencyStats {
        ConcurrencyStats {
            in_flight: self.lock().global,
            waiting: self.waiters.load(Ordering::Acquire),
            peak_waiting: self.peak_waiters.load(Ordering::Relaxed),
            refused_per_key: self.refused_per_key.load(Ordering::Relaxed),
            refused_global: self.refused_global.load(Ordering::Relaxed),
        }
    }
}

/// Gives a waiting slot back however the wait ends (admitted, timed out, or
/// the request future dropped).
struct WaitSlot<'a>(&'a Limiter);

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
        self.0.gauges();
    }
}
