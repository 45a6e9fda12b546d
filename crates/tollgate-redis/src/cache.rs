//! The over-limit cache: denials remembered until the time Redis said the
//! cost would fit.
//!
//! A fixed table of small sets (four ways each), each behind its own lock:
//! a key's set is picked by a keyed 128-bit digest of its Redis key, and a
//! new denial replaces the entry of the same key, else a free or expired
//! slot, else the one that expires first. Every operation is O(1) and the
//! memory per entry is fixed (48 bytes for the digest and four numbers,
//! plus a quarter of its set's lock: 52 in all), so a flood of distinct
//! exhausted keys costs the same per denial at the bound as below it.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tollgate_core::{Charge, Decision, Outcome, Policy};

/// Counters of the over-limit cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Requests refused locally, without a round trip.
    pub hits: u64,
    /// Denials remembered.
    pub remembered: u64,
}

const WAYS: usize = 4;

/// What Redis said when it refused a cost on a key. Times are nanoseconds
/// since the cache's epoch; `until == 0` marks a free slot.
#[derive(Clone, Copy, Default)]
struct Slot {
    digest: u128,
    /// The cost fits no earlier than this.
    until: u64,
    /// When the budget would be full.
    full_at: u64,
    /// The smallest cost refused (larger costs wait at least as long).
    cost: u64,
    /// Units available then: a lower bound later, since credit only grows.
    remaining: u64,
}

pub(crate) struct OverLimitCache {
    sets: Box<[Mutex<[Slot; WAYS]>]>,
    epoch: Instant,
    /// Two independent keys of the digest, drawn per cache: a client who
    /// cannot see them can neither aim keys at one set nor make two keys
    /// share a digest.
    seeds: (RandomState, RandomState),
    hits: AtomicU64,
    remembered: AtomicU64,
}

impl OverLimitCache {
    /// A cache holding at most about `max` denials (rounded up to whole
    /// sets).
    pub(crate) fn new(max: usize) -> Self {
        let sets = max.div_ceil(WAYS).max(1);
        Self {
            sets: (0..sets)
                .map(|_| Mutex::new([Slot::default(); WAYS]))
                .collect(),
            epoch: Instant::now(),
            seeds: (RandomState::new(), RandomState::new()),
            hits: AtomicU64::new(0),
            remembered: AtomicU64::new(0),
        }
    }

    /// The digest of a Redis key and the numbers it was refused under: a
    /// denial is only ever repeated for the numbers Redis refused (a plan
    /// upgrade is not refused by a denial of the old plan).
    fn digest(&self, key: &str, policy: &Policy) -> u128 {
        let what = (key, policy.algorithm());
        (u128::from(self.seeds.0.hash_one(what)) << 64) | u128::from(self.seeds.1.hash_one(what))
    }

    fn set(&self, digest: u128) -> std::sync::MutexGuard<'_, [Slot; WAYS]> {
        let len = self.sets.len() as u128;
        self.sets[(digest % len) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Nanoseconds since the epoch, at least 1 (0 marks a free slot).
    fn at(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Records Redis's refusal of `cost` on `key`. Times are measured from
    /// before the request was sent, so the local deadlines are never later
    /// than the server's.
    pub(crate) fn remember(&self, key: &str, charge: &Charge, sent: Instant, refusal: Decision) {
        let cost = charge.cost();
        let Decision::Denied {
            retry_after,
            remaining,
            reset,
        } = refusal
        else {
            return;
        };
        let seen = Slot {
            digest: self.digest(key, charge.policy()),
            until: self.at(sent + retry_after),
            full_at: self.at(sent + reset),
            cost,
            remaining,
        };
        let now = self.at(Instant::now());
        let mut set = self.set(seen.digest);
        let slot = match set
            .iter()
            .position(|s| s.until != 0 && s.digest == seen.digest)
        {
            // The same key: keep the smallest cost still refused.
            Some(i) if set[i].until > now && set[i].cost < cost => return,
            Some(i) => i,
            None => match set.iter().position(|s| s.until <= now) {
                Some(free) => free,
                // All four hold live denials: replace the one ending first.
                None => (0..WAYS).min_by_key(|&i| set[i].until).unwrap_or(0),
            },
        };
        set[slot] = seen;
        drop(set);
        self.remembered.fetch_add(1, Ordering::Relaxed);
    }

    /// A refusal without a round trip, if one of the keys is known to be
    /// over its limit for at least its cost.
    pub(crate) fn refuse(&self, keys: &[String], charges: &[Charge]) -> Option<Outcome> {
        let now_instant = Instant::now();
        let now = self.at(now_instant);
        let (i, seen) = keys
            .iter()
            .zip(charges)
            .enumerate()
            .find_map(|(i, (k, c))| {
                let digest = self.digest(k, c.policy());
                let set = self.set(digest);
                let seen = *set
                    .iter()
                    .find(|s| s.digest == digest && s.until > now && c.cost() >= s.cost)?;
                Some((i, seen))
            })?;
        self.hits.fetch_add(1, Ordering::Relaxed);
        let mut decisions = vec![Decision::Unevaluated; charges.len()];
        decisions[i] = Decision::Denied {
            retry_after: Duration::from_nanos(seen.until - now),
            remaining: seen.remaining,
            reset: Duration::from_nanos(seen.full_at.saturating_sub(now)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_core::{Key, Policy, Rate};

    fn denied(secs: u64) -> Decision {
        Decision::Denied {
            retry_after: Duration::from_secs(secs),
            remaining: 0,
            reset: Duration::from_secs(secs),
        }
    }

    fn charge(cost: u64) -> Charge {
        let p = Policy::token_bucket("p", 10, Rate::per_second(1)).unwrap();
        Charge::new(Key::new("k"), p, cost).unwrap()
    }

    #[test]
    fn remembers_until_the_wait_for_at_least_the_cost_refused() {
        let cache = OverLimitCache::new(8);
        let now = Instant::now();
        cache.remember("a", &charge(3), now, denied(60));
        let keys = ["a".to_owned()];
        assert!(cache.refuse(&keys, &[charge(3)]).is_some());
        assert!(cache.refuse(&keys, &[charge(5)]).is_some());
        assert!(cache.refuse(&keys, &[charge(2)]).is_none());
        assert!(cache.refuse(&["b".to_owned()], &[charge(3)]).is_none());
        // Other numbers on the same key (a plan upgrade) are not refused by
        // a denial under the old ones.
        let upgraded = Policy::token_bucket("p", 20, Rate::per_second(5)).unwrap();
        let upgraded = Charge::new(Key::new("k"), upgraded, 3).unwrap();
        assert!(cache.refuse(&keys, &[upgraded]).is_none());
        // A smaller refused cost replaces a larger one, not the other way.
        cache.remember("a", &charge(2), now, denied(60));
        assert!(cache.refuse(&keys, &[charge(2)]).is_some());
        cache.remember("a", &charge(7), now, denied(60));
        assert!(cache.refuse(&keys, &[charge(2)]).is_some());
        // An expired denial refuses nothing.
        cache.remember("c", &charge(1), now - Duration::from_secs(10), denied(1));
        assert!(cache.refuse(&["c".to_owned()], &[charge(1)]).is_none());
    }

    /// Audit finding 11: at its bound the cache scanned the whole map per
    /// new denial. Now the table is fixed: a flood of distinct denials
    /// keeps it at its size, and recent denials are still refused.
    #[test]
    fn a_flood_of_distinct_denials_stays_within_the_bound() {
        let cache = OverLimitCache::new(1000);
        let now = Instant::now();
        for i in 0..100_000u64 {
            cache.remember(&format!("flood-{i}"), &charge(1), now, denied(3600 + i));
        }
        assert_eq!(cache.sets.len(), 250);
        let live = cache
            .sets
            .iter()
            .map(|s| s.lock().unwrap().iter().filter(|s| s.until != 0).count())
            .sum::<usize>();
        assert_eq!(live, 1000);
        // The newest denial of each set survives (older ones end first).
        assert!(
            cache
                .refuse(&["flood-99999".to_owned()], &[charge(1)])
                .is_some()
        );
    }
}
