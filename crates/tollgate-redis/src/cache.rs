//! The optional over-limit cache: denials remembered until the time Redis
//! said the cost would fit.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tollgate_core::{Charge, Decision, Outcome};

/// Counters of the over-limit cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Requests refused locally, without a round trip.
    pub hits: u64,
    /// Denials remembered.
    pub remembered: u64,
}

pub(crate) struct OverLimitCache {
    max: usize,
    /// Redis key -> (refused until, smallest cost refused).
    entries: Mutex<HashMap<String, (Instant, u64)>>,
    hits: AtomicU64,
    remembered: AtomicU64,
}

impl OverLimitCache {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            entries: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            remembered: AtomicU64::new(0),
        }
    }

    /// Records that `cost` on `key` does not fit before `until`, measured
    /// from before the request was sent, so the local deadline is never
    /// later than the server's.
    pub(crate) fn remember(&self, key: &str, cost: u64, until: Instant) {
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if entries.len() >= self.max && !entries.contains_key(key) {
            let now = Instant::now();
            entries.retain(|_, (t, _)| *t > now);
            if entries.len() >= self.max {
                return;
            }
        }
        let entry = entries.entry(key.to_owned()).or_insert((until, cost));
        if cost <= entry.1 {
            *entry = (until, cost);
        }
        self.remembered.fetch_add(1, Ordering::Relaxed);
    }

    /// A refusal without a round trip, if one of the keys is known to be
    /// over its limit for at least its cost.
    pub(crate) fn refuse(&self, keys: &[String], charges: &[Charge]) -> Option<Outcome> {
        let now = Instant::now();
        let entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (i, wait) = keys
            .iter()
            .zip(charges)
            .enumerate()
            .find_map(|(i, (k, c))| {
                let (until, cost) = entries.get(k)?;
                (*until > now && c.cost() >= *cost).then(|| (i, *until - now))
            })?;
        drop(entries);
        self.hits.fetch_add(1, Ordering::Relaxed);
        let mut decisions = vec![Decision::Unevaluated; charges.len()];
        decisions[i] = Decision::Denied {
            retry_after: wait,
            remaining: 0,
            reset: wait,
        };
        Some(Outcome::new(decisions))
    }

    pub(crate) fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            remembered: self.remembered.load(Ordering::Relaxed),
        }
    }
}
