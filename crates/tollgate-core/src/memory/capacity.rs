//! Sweeping idle entries and keeping the key cap.

use std::sync::atomic::Ordering;

use super::shard::Shard;
use super::{Inner, OnKeyCap};
use crate::{Nanos, StoreError, StoreErrorKind};

impl Inner {
    pub(super) fn maybe_sweep(&self, shard: &mut Shard, now: Nanos) {
        if now >= shard.next_sweep {
            self.sweep_shard(shard, now);
        }
    }

    pub(super) fn sweep_shard(&self, shard: &mut Shard, now: Nanos) {
        let before = shard.len();
        shard.compact.retain(|_, c| c.idle_at > now);
        shard.wide.retain(|_, e| e.idle_at > now);
        let removed = before - shard.len();
        if removed > 0 {
            self.swept.fetch_add(removed as u64, Ordering::Relaxed);
        }
        if shard.compact.capacity() > 64 && shard.compact.capacity() > 4 * shard.compact.len() {
            shard.compact.shrink_to_fit();
        }
        if shard.wide.capacity() > 64 && shard.wide.capacity() > 4 * shard.wide.len() {
            shard.wide.shrink_to_fit();
        }
        shard.next_sweep = now.saturating_add(self.sweep_every);
    }

    /// Makes room in `shard` for `new` keys not yet in it, or refuses (by
    /// the cap policy). Eviction never picks one of `keep`, the keys this
    /// call is about to write.
    pub(super) fn make_room_for(
        &self,
        shard: &mut Shard,
        new: usize,
        keep: &[u128],
        now: Nanos,
    ) -> Result<(), StoreError> {
        // At most one sweep per interval even here: under a flood of new
        // keys a sweep per request would make every refusal O(shard size).
        self.maybe_sweep(shard, now);
        let cap = self.per_shard.unwrap_or(usize::MAX);
        let refuse = || {
            self.refused_new_keys.fetch_add(1, Ordering::Relaxed);
            Err(StoreError::new(
                StoreErrorKind::CapacityExhausted,
                format!("memory store shard is at its cap of {cap} keys"),
            ))
        };
        if new > cap {
            // More new keys than the shard may ever hold: no eviction helps.
            return refuse();
        }
        while shard.len() + new > cap {
            match self.cap_policy {
                OnKeyCap::RefuseNewKeys => return refuse(),
                OnKeyCap::EvictNearestIdle => {
                    const SAMPLE: usize = 8;
                    let compact = shard.compact.iter().map(|(d, c)| (*d, c.idle_at));
                    let wide = shard.wide.iter().map(|(d, e)| (*d, e.idle_at));
                    let Some(victim) = compact
                        .chain(wide)
                        .filter(|(d, _)| !keep.contains(d))
                        .take(SAMPLE)
                        .min_by_key(|(_, idle_at)| *idle_at)
                        .map(|(d, _)| d)
                    else {
                        return refuse();
                    };
                    shard.compact.remove(&victim);
                    shard.wide.remove(&victim);
                    self.evicted.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::MemoryStore;
    use super::*;
    use crate::{Charge, Key, ManualClock, Policy, Rate};

    fn charge(key: &str, policy: &Policy, cost: u64) -> Charge {
        Charge::new(Key::new(policy.name()).with(key), policy.clone(), cost).unwrap()
    }

    #[test]
    fn key_cap_refuses_new_keys_and_counts() {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(1)
            .max_keys(3, OnKeyCap::RefuseNewKeys)
            .build();
        let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
        for k in ["a", "b", "c"] {
            assert!(store.charge_now(&[charge(k, &p, 1)]).unwrap().is_admitted());
        }
        let e = store.charge_now(&[charge("d", &p, 1)]).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::CapacityExhausted);
        assert!(
            store
                .charge_now(&[charge("a", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().refused_new_keys, 1);
        assert_eq!(store.stats().keys, 3);
    }

    #[test]
    fn idle_keys_make_room_under_the_cap() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .max_keys(2, OnKeyCap::RefuseNewKeys)
            .build();
        let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
        for k in ["a", "b"] {
            assert!(store.charge_now(&[charge(k, &p, 1)]).unwrap().is_admitted());
        }
        assert!(store.charge_now(&[charge("c", &p, 1)]).is_err());
        // Once a and b have refilled (and the sweep interval passed), a new
        // key fits again.
        clock.advance(Duration::from_secs(2));
        assert!(
            store
                .charge_now(&[charge("c", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().keys, 1);
    }

    #[test]
    fn key_cap_can_evict_and_counts() {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(1)
            .max_keys(2, OnKeyCap::EvictNearestIdle)
            .build();
        let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
        for k in ["a", "b", "c", "d"] {
            assert!(store.charge_now(&[charge(k, &p, 1)]).unwrap().is_admitted());
        }
        let stats = store.stats();
        assert_eq!((stats.keys, stats.evicted), (2, 2));
    }

    /// Audit finding 4: the cap was checked against the shard as it was
    /// before any of the call's keys were written, so one call of three
    /// new keys left three keys under a cap of one.
    #[test]
    fn one_call_cannot_take_a_shard_past_its_cap() {
        for policy in [OnKeyCap::RefuseNewKeys, OnKeyCap::EvictNearestIdle] {
            let store = MemoryStore::builder()
                .clock(ManualClock::new(0))
                .shards(1)
                .max_keys(1, policy)
                .build();
            let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
            let e = store
                .charge_now(&[charge("a", &p, 1), charge("b", &p, 1), charge("c", &p, 1)])
                .unwrap_err();
            assert_eq!(e.kind(), StoreErrorKind::CapacityExhausted, "{policy:?}");
            assert_eq!(store.stats().keys, 0, "{policy:?}");
            // A repeated key is one key.
            assert!(
                store
                    .charge_now(&[charge("a", &p, 1), charge("a", &p, 1)])
                    .unwrap()
                    .is_admitted()
            );
            assert_eq!(store.stats().keys, 1);
        }
        // Eviction makes room, but never by evicting a key of the same call
        // (x here, which would then be written back past the cap).
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(1)
            .max_keys(2, OnKeyCap::EvictNearestIdle)
            .build();
        let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
        for k in ["x", "y"] {
            assert!(store.charge_now(&[charge(k, &p, 1)]).unwrap().is_admitted());
        }
        assert!(
            store
                .charge_now(&[charge("x", &p, 1), charge("a", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        let stats = store.stats();
        assert_eq!((stats.keys, stats.evicted), (2, 1));
        assert!(
            !store
                .charge_now(&[charge("x", &p, 1)])
                .unwrap()
                .is_admitted(),
            "x kept its spent budget"
        );
    }
}
