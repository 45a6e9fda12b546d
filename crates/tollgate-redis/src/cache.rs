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

/// What Redis said when it refused a cost on a key.
#[derive(Clone, Copy)]
struct Remembered {
    /// The cost fits no earlier than this.
    until: Instant,
    /// The smallest cost refused (larger costs wait at least as long).
    cost: u64,
    /// Units available then: a lower bound later, since credit only grows.
    remaining: u64,
    /// When the budget would be full.
    full_at: Instant,
}

pub(crate) struct OverLimitCache {
    max: usize,
    entries: Mutex<HashMap<String, Remembered>>,
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

    /// Records Redis's refusal of `cost` on `key`. Times are measured from
    /// before the request was sent, so the local deadlines are never later
    /// than the server's.
    pub(crate) fn remember(&self, key: &str, cost: u64, sent: Instant, refusal: Decision) {
        let Decision::Denied {
            retry_after,
            remaining,
            reset,
        } = refusal
        else {
            return;
        };
        let seen = Remembered {
            until: sent + retry_after,
            cost,
            remaining,
            full_at: sent + reset,
        };
        let mut entries = self
            .entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if entries.len() >= self.max && !entries.contains_key(key) {
            let now = Instant::now();
            entries.retain(|_, r| r.until > now);
            if entries.len() >= self.max {
                return;
            }
        }
        let entry = entries.entry(key.to_owned()).or_insert(seen);
        if cost <= entry.cost {
            *entry = seen;
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
        let (i, seen) = keys
            .iter()
            .zip(charges)
            .enumerate()
            .find_map(|(i, (k, c))| {
                let seen = *entries.get(k)?;
                (seen.until > now && c.cost() >= seen.cost).then_some((i, seen))
            })?;
        drop(entries);
        self.hits.fetch_add(1, Ordering::Relaxed);
        let mut decisions = vec![Decision::Unevaluated; charges.len()];
        decisions[i] = Decision::Denied {
            retry_after: seen.until - now,
            remaining: seen.remaining,
            reset: seen.full_at.saturating_duration_since(now),
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
