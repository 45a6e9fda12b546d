//! The over-limit cache: denials remembered until the time Redis said the
//! cost would fit, and token buckets that an admission left without room
//! for another such cost, until they have it again.
//!
//! When such a bucket's deadline passes, its next cost is due to fit, and
//! every request waiting at that moment would go to Redis at once (a
//! flood's connections all miss together). Instead, one request *probes*:
//! it asks Redis while the others are refused locally, for as long as the
//! bucket cannot hold two costs (one refill of a cost after the deadline),
//! which is exactly when only one of them could have been admitted. The
//! probe's answer is remembered again (a denial, or an admission that
//! left too little), so a flood costs Redis about one call per key per
//! refill of a cost. Windows do not probe: at a window's end the whole
//! limit is back at once.
//!
//! A fixed table of small sets (four ways each), each behind its own lock:
//! a key's set is picked by a keyed 128-bit digest of its Redis key, and a
//! new denial replaces the entry of the same key, else a free or expired
//! slot, else the one that expires first. Every operation is O(1) and the
//! memory per entry is fixed (64 bytes for the digest and six numbers,
//! plus a quarter of its set's lock: 68 in all), so a flood of distinct
//! exhausted keys costs the same per denial at the bound as below it.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tollgate_budget::{Charge, Decision, Outcome, Policy};

/// Counters of the over-limit cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
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
    /// Token buckets: the refill time of one `cost` (0 for windows: they
    /// do not probe).
    step: u64,
    /// A probe is asking Redis until then (0: none).
    probe: u64,
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
    /// How long a probe owns its key: the store's time limit per call.
    probe_for: Duration,
}

/// The refill time of `cost` in `policy`'s token bucket, rounded up; 0
/// for windows.
fn step(policy: &Policy, cost: u64) -> u64 {
    match policy.algorithm() {
        tollgate_budget::Algorithm::TokenBucket(b) => {
            let units = u128::from(cost) * u128::from(b.units_per_token());
            u64::try_from(units.div_ceil(u128::from(b.units_per_nanosecond()))).unwrap_or(u64::MAX)
        }
        _ => 0,
    }
}

impl OverLimitCache {
    /// A cache holding at most about `max` denials (rounded up to whole
    /// sets), whose probes own their key for `probe_for`.
    pub(crate) fn new(max: usize, probe_for: Duration) -> Self {
        let sets = max.div_ceil(WAYS).max(1);
        Self {
            sets: (0..sets)
                .map(|_| Mutex::new([Slot::default(); WAYS]))
                .collect(),
            epoch: Instant::now(),
            seeds: (RandomState::new(), RandomState::new()),
            hits: AtomicU64::new(0),
            remembered: AtomicU64::new(0),
            probe_for,
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
        let Some(retry_after) = refusal.retry_after() else {
            return;
        };
        let (remaining, reset) = (refusal.remaining(), refusal.reset());
        self.keep(
            key,
            charge,
            self.at(sent + retry_after),
            self.at(sent + reset),
            remaining,
        );
    }

    /// Records an admission of `charge` on `key` that left a token bucket
    /// without room for the same cost again: it is refused until the time
    /// it fits, computed from what Redis answered (the time until full, a
    /// lower bound on the credit), counted from when the answer came
    /// (`answered`). That is later than Redis's instant by up to the round
    /// trip, so the probe at the deadline finds the cost refilled and takes
    /// it in one call (counted from before sending, it would arrive a
    /// moment early, be refused with a wait of microseconds and probe
    /// again). A request in that moment is refused though Redis might have
    /// taken it; the credit is not lost, it is there for the probe.
    pub(crate) fn remember_spent(
        &self,
        key: &str,
        charge: &Charge,
        answered: Instant,
        admitted: Decision,
    ) {
        let (true, tollgate_budget::Algorithm::TokenBucket(b)) =
            (admitted.is_admitted(), charge.policy().algorithm())
        else {
            return;
        };
        let (remaining, reset) = (admitted.remaining(), admitted.reset());
        if remaining >= charge.cost() {
            return;
        }
        // Full after `reset`: the credit is at least capacity - reset·rate
        // (less one ns of rounding), so `cost` fits no earlier than
        // reset - (capacity - cost)/rate, rounded down.
        let (den, num) = (
            u128::from(b.units_per_token()),
            u128::from(b.units_per_nanosecond()),
        );
        let spare = (u128::from(b.capacity()) - u128::from(charge.cost())) * den / num + 1;
        let Some(wait) = reset.as_nanos().checked_sub(spare) else {
            return;
        };
        let wait = Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX));
        self.keep(
            key,
            charge,
            self.at(answered + wait),
            self.at(answered + reset),
            remaining,
        );
    }

    /// Forgets what is remembered of `charge` on `key`: credit was given
    /// back to it ([`Store::refund`](tollgate_budget::Store::refund)), so a
    /// refusal remembered before may no longer be Redis's answer.
    pub(crate) fn forget(&self, key: &str, charge: &Charge) {
        let digest = self.digest(key, charge.policy());
        let mut set = self.set(digest);
        for slot in set.iter_mut().filter(|s| s.digest == digest) {
            slot.until = 0;
        }
    }

    fn keep(&self, key: &str, charge: &Charge, until: u64, full_at: u64, remaining: u64) {
        // A charge that may be given back is never remembered: its credit
        // can come back before any deadline computed now.
        if charge.is_refundable() {
            return;
        }
        let cost = charge.cost();
        let seen = Slot {
            digest: self.digest(key, charge.policy()),
            until,
            full_at,
            cost,
            remaining,
            step: step(charge.policy(), cost),
            probe: 0,
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
    /// over its limit for at least its cost, or another request is probing
    /// a bucket that cannot yet hold two costs. Otherwise `None`, and, when
    /// the caller will ask Redis (`asking`), this request is the probe of
    /// every bucket whose deadline has just passed.
    pub(crate) fn refuse(
        &self,
        keys: &[String],
        charges: &[Charge],
        asking: bool,
    ) -> Option<Outcome> {
        let now = self.at(Instant::now());
        let probe = self.at(Instant::now() + self.probe_for);
        // Probes this request took, given back if another charge refuses.
        let mut probes: Vec<(u128, usize)> = Vec::new();
        for (i, (k, c)) in keys.iter().zip(charges).enumerate() {
            let digest = self.digest(k, c.policy());
            let mut set = self.set(digest);
            let Some(w) = set
                .iter()
                .position(|s| s.until != 0 && s.digest == digest && c.cost() >= s.cost)
            else {
                continue;
            };
            let seen = set[w];
            // Until then at most one cost fits, so at most one request.
            let single = seen.until.saturating_add(seen.step);
            let until = if seen.until > now {
                seen.until
            } else if seen.step > 0 && now < single && seen.probe > now {
                single
            } else {
                if asking && seen.step > 0 && now < single {
                    // Taken under the set's lock: one probe at a time.
                    set[w].probe = probe;
                    probes.push((digest, w));
                }
                continue;
            };
            drop(set);
            for (digest, w) in probes {
                let mut set = self.set(digest);
                if set[w].digest == digest && set[w].probe == probe {
                    set[w].probe = 0;
                }
            }
            self.hits.fetch_add(1, Ordering::Relaxed);
            let mut decisions = vec![Decision::unevaluated(); charges.len()];
            decisions[i] = Decision::denied(
                Duration::from_nanos(until - now),
                seen.remaining,
                Duration::from_nanos(seen.full_at.saturating_sub(now)),
            );
            return Some(Outcome::new(decisions));
        }
        // Not refused: this request asks Redis, holding its probes.
        None
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

    impl OverLimitCache {
        fn refuse_asking(&self, keys: &[String], charges: &[Charge]) -> Option<Outcome> {
            self.refuse(keys, charges, true)
        }
    }
    use tollgate_budget::{Key, Policy, Rate};

    fn denied(secs: u64) -> Decision {
        Decision::denied(Duration::from_secs(secs), 0, Duration::from_secs(secs))
    }

    fn charge(cost: u64) -> Charge {
        let p = Policy::token_bucket("p", 10, Rate::per_second(1)).unwrap();
        Charge::new(Key::new("k"), p, cost).unwrap()
    }

    #[test]
    fn remembers_until_the_wait_for_at_least_the_cost_refused() {
        let cache = OverLimitCache::new(8, Duration::from_millis(200));
        let now = Instant::now();
        cache.remember("a", &charge(3), now, denied(60));
        let keys = ["a".to_owned()];
        assert!(cache.refuse_asking(&keys, &[charge(3)]).is_some());
        assert!(cache.refuse_asking(&keys, &[charge(5)]).is_some());
        assert!(cache.refuse_asking(&keys, &[charge(2)]).is_none());
        assert!(
            cache
                .refuse_asking(&["b".to_owned()], &[charge(3)])
                .is_none()
        );
        // Other numbers on the same key (a plan upgrade) are not refused by
        // a denial under the old ones.
        let upgraded = Policy::token_bucket("p", 20, Rate::per_second(5)).unwrap();
        let upgraded = Charge::new(Key::new("k"), upgraded, 3).unwrap();
        assert!(cache.refuse_asking(&keys, &[upgraded]).is_none());
        // A smaller refused cost replaces a larger one, not the other way.
        cache.remember("a", &charge(2), now, denied(60));
        assert!(cache.refuse_asking(&keys, &[charge(2)]).is_some());
        cache.remember("a", &charge(7), now, denied(60));
        assert!(cache.refuse_asking(&keys, &[charge(2)]).is_some());
        // An expired denial refuses nothing.
        cache.remember("c", &charge(1), now - Duration::from_secs(10), denied(1));
        assert!(
            cache
                .refuse_asking(&["c".to_owned()], &[charge(1)])
                .is_none()
        );
    }

    /// An admission that left a bucket without room for the same cost is
    /// remembered until the cost fits again (never later than Redis would
    /// say); one that left room is not.
    #[test]
    fn a_spent_bucket_is_refused_until_it_has_the_cost_again() {
        let cache = OverLimitCache::new(8, Duration::from_millis(200));
        let sent = Instant::now();
        let keys = ["a".to_owned()];
        // Bucket of 10 at 1/s, empty after this admission: full in 10 s,
        // so one token in just under 1 s.
        let empty = Decision::admitted(0, Duration::from_secs(10));
        cache.remember_spent("a", &charge(1), sent, empty);
        let refused = cache
            .refuse_asking(&keys, &[charge(1)])
            .expect("known spent");
        let wait = refused.limits()[0].retry_after().unwrap();
        assert!(wait <= Duration::from_secs(1) && wait > Duration::from_millis(900));
        // Room left for another: nothing remembered.
        let room = Decision::admitted(3, Duration::from_secs(7));
        cache.remember_spent("b", &charge(1), sent, room);
        assert!(
            cache
                .refuse_asking(&["b".to_owned()], &[charge(1)])
                .is_none()
        );
    }

    /// When a bucket's deadline passes, one request probes Redis; the
    /// others are refused locally until one more cost has refilled (only
    /// one of them could have fitted), then ask again. A probe that never
    /// answers owns its key only for the store's time limit.
    #[test]
    fn one_request_probes_a_bucket_whose_deadline_has_passed() {
        let cache = OverLimitCache::new(8, Duration::from_secs(60));
        let keys = ["a".to_owned()];
        // Denied 10 ms ago with a 5 ms wait at 1 token/s: the deadline has
        // passed, and one more token takes another second.
        let sent = Instant::now() - Duration::from_millis(10);
        cache.remember("a", &charge(1), sent, denied_ms(5));
        // Found measuring: the HTTP layer first asks without I/O
        // (`try_charge_now`), then asks Redis; only the second may take the
        // probe, or the request would be refused behind its own.
        assert!(cache.refuse(&keys, &[charge(1)], false).is_none());
        assert!(
            cache.refuse_asking(&keys, &[charge(1)]).is_none(),
            "the probe"
        );
        let behind = cache
            .refuse_asking(&keys, &[charge(1)])
            .expect("behind the probe");
        let wait = behind.limits()[0].retry_after().unwrap();
        assert!(wait < Duration::from_secs(1) && wait > Duration::from_millis(900));
        // A smaller cost than the one refused is not covered.
        cache.remember("s", &charge(2), sent, denied_ms(5));
        assert!(
            cache
                .refuse_asking(&["s".to_owned()], &[charge(1)])
                .is_none()
        );
        // Two costs' refill after the deadline: everyone asks.
        // (A bucket of 1 000 per second: a cost refills in 1 ms.)
        let fast = Policy::token_bucket("f", 10, Rate::per_second(1000)).unwrap();
        let fast = Charge::new(Key::new("k"), fast, 1).unwrap();
        cache.remember("c", &fast, Instant::now(), denied_ms(0));
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            cache
                .refuse_asking(&["c".to_owned()], std::slice::from_ref(&fast))
                .is_none()
        );
        assert!(cache.refuse_asking(&["c".to_owned()], &[fast]).is_none());
        // A lost probe: with no time to own the key, the next asks too.
        let quick = OverLimitCache::new(8, Duration::ZERO);
        quick.remember("a", &charge(1), sent, denied_ms(5));
        assert!(quick.refuse_asking(&keys, &[charge(1)]).is_none());
        assert!(quick.refuse_asking(&keys, &[charge(1)]).is_none());
        // Windows never probe: at a window's end the whole limit is back.
        let w = Policy::fixed_window("w", 5, Duration::from_secs(1)).unwrap();
        let w = Charge::new(Key::new("k"), w, 1).unwrap();
        cache.remember("w", &w, sent, denied_ms(5));
        assert!(
            cache
                .refuse_asking(&["w".to_owned()], std::slice::from_ref(&w))
                .is_none()
        );
        assert!(cache.refuse_asking(&["w".to_owned()], &[w]).is_none());
    }

    fn denied_ms(ms: u64) -> Decision {
        Decision::denied(Duration::from_millis(ms), 0, Duration::from_secs(10))
    }

    /// Audit finding 11: at its bound the cache scanned the whole map per
    /// new denial. Now the table is fixed: a flood of distinct denials
    /// keeps it at its size, and recent denials are still refused.
    #[test]
    fn a_flood_of_distinct_denials_stays_within_the_bound() {
        let cache = OverLimitCache::new(1000, Duration::from_millis(200));
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
                .refuse_asking(&["flood-99999".to_owned()], &[charge(1)])
                .is_some()
        );
    }
}
