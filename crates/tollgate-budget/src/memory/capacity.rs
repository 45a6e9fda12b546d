//! Sweeping idle entries and keeping the key cap.

use std::sync::atomic::Ordering;

use super::shard::{Id, Shard};
use super::{Inner, OnKeyCap};
use crate::algorithm;
use crate::{Nanos, StoreError, StoreErrorKind};

impl Inner {
    pub(super) fn maybe_sweep(&self, shard: &mut Shard, now: Nanos) {
        if now >= shard.next_sweep {
            self.sweep_shard(shard, now);
        }
    }

    pub(super) fn sweep_shard(&self, shard: &mut Shard, now: Nanos) {
        let removed = shard.drop_idle(now, &self.hashes, |space| self.spaces.numbers(space));
        if removed > 0 {
            self.swept.fetch_add(removed as u64, Ordering::Relaxed);
        }
        shard.next_sweep = now.saturating_add(self.sweep_every);
    }

    /// Whether `shard` has room for `new` keys not yet in it, evicting if
    /// the cap policy allows: how many entries must be evicted, or the
    /// refusal. Nothing is evicted yet, so that a call refused in one of
    /// its shards changes nothing in the others; the entries of `keep`'s
    /// keys (the keys the call writes, in any space: a key moving from a
    /// sibling space replaces its entry there) are never counted as
    /// evictable.
    pub(super) fn room_for(
        &self,
        shard: &mut Shard,
        new: usize,
        keep: &[Id],
        now: Nanos,
    ) -> Result<usize, StoreError> {
        // At most one sweep per interval even here: under a flood of new
        // keys a sweep per request would make every refusal O(shard size).
        // (A sweep removes only entries idle at its reading: it changes
        // no decision at that reading or a later one. A custom clock that
        // then steps back behind it finds those keys new, as Redis finds
        // a key its own clock expired; `sweep_interval` says so.)
        self.maybe_sweep(shard, now);
        let cap = self.per_shard.unwrap_or(usize::MAX);
        let over = (shard.len() + new).saturating_sub(cap);
        if over == 0 {
            return Ok(0);
        }
        let evictable = match self.cap_policy {
            OnKeyCap::RefuseNewKeys => 0,
            OnKeyCap::EvictNearestIdle => {
                // A call has a few keys: each counted once, with its
                // entries in every space of this shard.
                let kept: usize = keep
                    .iter()
                    .enumerate()
                    .filter(|&(i, id)| !keep[..i].iter().any(|k| k.key == id.key))
                    .map(|(_, id)| shard.holders_of(id))
                    .sum();
                shard.len().saturating_sub(kept)
            }
        };
        if new > cap || over > evictable {
            self.refused_new_keys.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::new(
                StoreErrorKind::CapacityExhausted,
                format!("memory store shard is at its cap of {cap} keys"),
            ));
        }
        Ok(over)
    }

    /// Evicts `count` entries, each the nearest to idle among a small
    /// sample, never one of `keep`'s keys in any space (evicting a key's
    /// entry in a sibling space would leave the call's write to add the
    /// key without the removal [`Inner::room_for`] counted on).
    /// [`Inner::room_for`] said there are enough.
    pub(super) fn evict(&self, shard: &mut Shard, count: usize, keep: &[Id]) {
        const SAMPLE: usize = 8;
        for _ in 0..count {
            let Some(victim) = shard
                .states(&self.hashes)
                .filter(|(id, _)| !keep.iter().any(|k| k.key == id.key))
                .take(SAMPLE)
                .min_by_key(|(id, state)| {
                    // Every space with entries was given by the store.
                    self.spaces
                        .numbers(id.space)
                        .map_or(0, |numbers| algorithm::idle_since(&numbers, *state))
                })
                .map(|(id, _)| id)
            else {
                return;
            };
            shard.remove(&victim);
            self.evicted.fetch_add(1, Ordering::Relaxed);
        }
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

    /// What `sweep_interval` documents: a clock stepping back behind a
    /// sweep finds the key it dropped new; a store whose interval is
    /// `Duration::MAX` (swept once, at its first decision, when it is
    /// empty) still holds the key's spent state.
    #[test]
    fn a_clock_stepping_back_behind_a_sweep_finds_the_swept_key_new() {
        let p = Policy::token_bucket("tb", 1, Rate::per_second(1)).unwrap();
        let store = |every| {
            let clock = ManualClock::new(0);
            let store = MemoryStore::builder()
                .clock(clock.clone())
                .shards(1)
                .sweep_interval(every)
                .build();
            (clock, store)
        };
        let second = |again: bool| -> [bool; 2] {
            [Duration::ZERO, Duration::MAX].map(|every| {
                let (clock, store) = store(every);
                assert!(
                    store
                        .charge_now(&[charge("a", &p, 1)])
                        .unwrap()
                        .is_admitted()
                );
                clock.set(2_000_000_000);
                assert!(
                    store
                        .charge_now(&[charge("b", &p, 1)])
                        .unwrap()
                        .is_admitted()
                );
                clock.set(if again { 500_000_000 } else { 2_000_000_000 });
                store
                    .charge_now(&[charge("a", &p, 1)])
                    .unwrap()
                    .is_admitted()
            })
        };
        // At the sweep's reading or later, the sweep changes nothing.
        assert_eq!(second(false), [true, true]);
        // Behind it: new where it was swept, spent where it was kept.
        assert_eq!(second(true), [true, false]);
    }

    /// A key moving from a sibling space (a plan switched) while the shard
    /// is at its cap keeps its entry there until the move replaces it: an
    /// eviction that took it would leave the shard a key over its cap.
    #[test]
    fn evicting_never_takes_a_moving_keys_sibling_entry() {
        let capped = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(1)
            .max_keys(2, OnKeyCap::EvictNearestIdle)
            .build();
        let free = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let small = Policy::token_bucket("plan", 3, Rate::per_second(1)).unwrap();
        let large = Policy::token_bucket("plan", 5, Rate::per_second(1)).unwrap();
        // a moves to the large plan's space while c is new: one entry must
        // go, and it may not be a's old one.
        let calls = [
            vec![charge("a", &small, 1)],
            vec![charge("b", &small, 3)],
            vec![charge("a", &large, 1), charge("c", &small, 1)],
        ];
        for call in &calls {
            assert!(capped.charge_now(call).unwrap().is_admitted());
            assert!(free.charge_now(call).unwrap().is_admitted());
        }
        let stats = capped.stats();
        assert_eq!((stats.keys, stats.evicted), (2, 1));
        // b went (a's entries, in either space, are the call's), and a
        // kept its spending across the move.
        let a = [charge("a", &large, 1)];
        assert_eq!(capped.describe(&a), free.describe(&a));
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
    /// Found in review: room was made shard by shard, so a call could
    /// evict in one shard and then be refused in another, leaving an
    /// exhausted key reset although the call changed nothing.
    #[test]
    fn a_refused_call_evicts_nothing_anywhere() {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(2)
            .max_keys(2, OnKeyCap::EvictNearestIdle)
            .build();
        let p = Policy::token_bucket("p", 1, Rate::per_hour(1)).unwrap();
        // Fill both shards with exhausted keys.
        let mut k = 0;
        while store.stats().keys < 2 {
            store
                .charge_now(&[charge(&format!("old{k}"), &p, 1)])
                .unwrap();
            k += 1;
        }
        let before = store.stats();
        // One new key for the first shard (room by eviction), two for the
        // second (more than it may ever hold): refused as a whole.
        let shard = |c: &Charge| store.inner.shard_of(&store.inner.id(c).unwrap());
        let fresh: Vec<Charge> = (0..64).map(|i| charge(&format!("new{i}"), &p, 1)).collect();
        let first = fresh.iter().find(|c| shard(c) == 0).unwrap().clone();
        let second: Vec<Charge> = fresh
            .iter()
            .filter(|c| shard(c) == 1)
            .take(2)
            .cloned()
            .collect();
        let call = [first, second[0].clone(), second[1].clone()];
        assert!(store.charge_now(&call).is_err());
        let after = store.stats();
        assert_eq!(after.evicted, before.evicted, "a refused call evicted");
        assert_eq!(after.keys, 2);
    }

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
