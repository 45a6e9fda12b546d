//! [`MemoryStore`]: the in-process store, the embedded default.
//!
//! Keys are sharded over mutex-protected hash maps. A decision locks only the
//! shards its charges live in (in index order, so multi-shard charges cannot
//! deadlock), evaluates every charge, and writes only if all were admitted.
//!
//! A map entry is keyed by a keyed digest of the policy's name and unit and
//! the key's text, not by the text itself: memory per key is fixed whatever
//! the key's length. The digest is SipHash-1-3 with 128-bit output, in one
//! pass (a caller who cannot see the secret key cannot aim for a
//! collision): bits 64 and up pick the shard, the lower half places the
//! entry in its map, and 104 bits identify it; the top 24 bits of a stored
//! key tag the numbers its state was written under ([`numbers`]), so that a
//! policy whose numbers changed (a plan, a limit changed at runtime) reads
//! the same state and converts it
//! ([`carry_over`](crate::algorithm::carry_over)). The digest key is
//! random per store; an accidental collision among ten million keys has
//! probability below 10⁻¹⁷.
//!
//! Each shard has two tables. Token buckets and fixed windows, whose state is
//! one count and one time, keep (count, idle deadline) in a 32-byte slot:
//! the time follows exactly from the two and the policy. Sliding windows
//! (and the rare state whose deadline saturates) keep the whole state and
//! its deadline in a 48-byte slot. A key lives in one of the two.
//!
//! Idle entries (refilled to full, or past their window) are dropped by an
//! amortised sweep: the first access to a shard after its sweep interval
//! removes that shard's idle entries. No background task is needed.
//!
//! The parts: this file is the public store and its settings; [`shard`] is
//! the storage layout, [`charge`] the all-or-nothing decision, [`capacity`]
//! sweeping and the key cap, [`digest`] the keyed digest, [`numbers`] the
//! tags of the numbers states were written under.

mod capacity;
mod charge;
mod digest;
mod numbers;
mod shard;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::algorithm::{self, State};
use crate::{Charge, Clock, Nanos, Outcome, Policy, Store, StoreError, SystemClock};
use digest::DigestKey;
use numbers::Numbers;
use shard::{ID_MASK, Shard};

/// What [`MemoryStore`] does when a shard is at its share of the key cap and
/// a charge needs a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnKeyCap {
    /// Refuse: the charge fails with [`StoreErrorKind::CapacityExhausted`](crate::StoreErrorKind::CapacityExhausted)
    /// (counted), so the layer applies its store-failure outcome. Keys already
    /// tracked are unaffected. Never creates extra allowance (default).
    #[default]
    RefuseNewKeys,
    /// Evict the entry nearest to idle among a small sample of the shard
    /// (counted). The evicted key starts again from a fresh budget, so every
    /// eviction can create up to one policy capacity of extra allowance for
    /// that key.
    EvictNearestIdle,
}

/// Counters kept by a [`MemoryStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MemoryStoreStats {
    /// Keys currently tracked.
    pub keys: u64,
    /// New keys refused because of the cap.
    pub refused_new_keys: u64,
    /// Entries evicted because of the cap.
    pub evicted: u64,
    /// Idle entries dropped by sweeps.
    pub swept: u64,
}

/// Builder for [`MemoryStore`].
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    shards: usize,
    max_keys: Option<usize>,
    cap_policy: OnKeyCap,
    sweep_interval: Duration,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("shards", &self.shards)
            .field("max_keys", &self.max_keys)
            .field("cap_policy", &self.cap_policy)
            .field("sweep_interval", &self.sweep_interval)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// Uses `clock` instead of the [`SystemClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Number of shards, rounded up to a power of two (default: 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16).next_power_of_two();
        self
    }

    /// Caps tracked keys at about `max_keys` (each shard holds at most its
    /// share, rounded up), applying `policy` when a shard is full.
    pub fn max_keys(mut self, max_keys: usize, policy: OnKeyCap) -> Self {
        self.max_keys = Some(max_keys.max(1));
        self.cap_policy = policy;
        self
    }

    /// How often each shard is swept for idle entries (default: 1 s).
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let per_shard = self.max_keys.map(|m| m.div_ceil(self.shards));
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..self.shards)
                    .map(|_| Mutex::new(Shard::default()))
                    .collect(),
                mask: self.shards - 1,
                clock: self.clock,
                digest_key: DigestKey::random(),
                numbers: Numbers::new(),
                per_shard,
                cap_policy: self.cap_policy,
                sweep_every: u64::try_from(self.sweep_interval.as_nanos()).unwrap_or(u64::MAX),
                refused_new_keys: AtomicU64::new(0),
                evicted: AtomicU64::new(0),
                swept: AtomicU64::new(0),
            }),
        }
    }
}

/// The in-process [`Store`]. Cloning shares the same budgets.
///
/// Keys are sharded over mutex-protected maps, keyed by a keyed digest of
/// (policy name and unit, key text), so memory per key does not depend on
/// the key's length; the random per-store seeds make a collision both
/// unpredictable and negligible (below 10⁻¹⁷ among ten million keys). A
/// policy whose numbers change under the same name reads the same state,
/// converted ([`carry_over`](crate::algorithm::carry_over)); a store tells
/// apart up to 16,777,215 distinct sets of numbers in its lifetime, after
/// which charges under new numbers fail with
/// [`StoreErrorKind::Unsupported`](crate::StoreErrorKind::Unsupported).
/// A decision locks only its charges' shards, in index order, and writes
/// only when every charge was admitted. Every decision is O(1) in the number
/// of tracked keys. Idle entries (refilled to full, or past their window)
/// are dropped by the first access to their shard after each sweep interval
/// (default 1 s): no background task is needed.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("per_shard_cap", &self.inner.per_shard)
            .field("cap_policy", &self.inner.cap_policy)
            .finish_non_exhaustive()
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    mask: usize,
    clock: Arc<dyn Clock>,
    /// The secret key of the SipHash-1-3-128 digest: its upper 64 bits pick
    /// the shard, its lower 64 bits place the entry in its map.
    digest_key: DigestKey,
    /// The tags of the numbers states were written under.
    numbers: Numbers,
    per_shard: Option<usize>,
    cap_policy: OnKeyCap,
    sweep_every: Nanos,
    refused_new_keys: AtomicU64,
    evicted: AtomicU64,
    swept: AtomicU64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store on the system clock with default settings and no key cap.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// A builder to set the clock, shards, key cap and sweep interval.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            clock: Arc::new(SystemClock::new()),
            shards: 64,
            max_keys: None,
            cap_policy: OnKeyCap::default(),
            sweep_interval: Duration::from_secs(1),
        }
    }

    /// Current counters. Counting keys locks every shard in turn.
    pub fn stats(&self) -> MemoryStoreStats {
        let inner = &*self.inner;
        MemoryStoreStats {
            keys: (0..inner.shards.len())
                .map(|i| inner.lock(i).len() as u64)
                .sum(),
            refused_new_keys: inner.refused_new_keys.load(Ordering::Relaxed),
            evicted: inner.evicted.load(Ordering::Relaxed),
            swept: inner.swept.load(Ordering::Relaxed),
        }
    }

    /// Drops every idle entry now, in every shard.
    pub fn sweep(&self) {
        let inner = &*self.inner;
        let now = inner.clock.now();
        for i in 0..inner.shards.len() {
            let mut g = inner.lock(i);
            inner.sweep_shard(&mut g, now);
        }
    }
}

impl Inner {
    /// The budget of `charge`: 104 bits of the keyed digest of its policy's
    /// name and unit and its key text (whatever the policy's numbers).
    pub(super) fn digest(&self, charge: &Charge) -> u128 {
        self.digest_key
            .digest(charge.policy().state_identity(), charge.key().as_bytes())
            & ID_MASK
    }

    /// The state of budget `id` for a reader with `policy`'s numbers: as
    /// stored, or carried over from the numbers it was written under.
    pub(super) fn state(
        &self,
        shard: &Shard,
        id: u128,
        policy: &Policy,
        now: Nanos,
    ) -> Option<State> {
        let stored = shard.read(id)?;
        let algorithm = policy.algorithm();
        if self.numbers.is_tag_of(policy, stored.tag) {
            return Some(stored.state(algorithm));
        }
        // Every tag in a slot was given by this store.
        let from = self.numbers.numbers(stored.tag)?;
        if from == *algorithm {
            return Some(stored.state(algorithm));
        }
        algorithm::carry_over(&from, stored.state(&from), algorithm, now)
    }

    pub(super) fn shard_of(&self, digest: u128) -> usize {
        ((digest >> 64) as usize) & self.mask
    }

    pub(super) fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // No code holding a shard lock can panic on input, but a poisoned
        // lock must not take the whole limiter down with it.
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Store for MemoryStore {
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        std::future::ready(self.charge_now(charges))
    }

    /// Always `Some`: the in-process store never waits on I/O.
    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        Some(self.charge_now(charges))
    }

    fn check<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        std::future::ready(Ok(self.check_now(charges)))
    }

    /// Shapes token buckets ([`Charge::shaped`](crate::Charge::shaped)).
    fn can_shape(&self) -> bool {
        true
    }

    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a crate::Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.cancel_now(charges, reservation);
        std::future::ready(Ok(()))
    }

    /// Every policy's numbers get their tag here, when a rule (or a
    /// changed policy) is configured: a store that has met all the sets of
    /// numbers it can tell apart refuses the new one now, as a
    /// configuration error, never at runtime.
    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        self.inner.numbers.tag(policy).map(|_| ())
    }

    fn can_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Key, ManualClock, Policy, Rate};

    fn charge(key: &str, policy: &Policy, cost: u64) -> Charge {
        Charge::new(Key::new(policy.name()).with(key), policy.clone(), cost).unwrap()
    }

    #[test]
    fn idle_entries_are_swept_on_access() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .sweep_interval(Duration::from_secs(1))
            .build();
        let p = Policy::token_bucket("p", 2, Rate::per_second(1)).unwrap();
        for i in 0..100 {
            store.charge_now(&[charge(&i.to_string(), &p, 1)]).unwrap();
        }
        assert_eq!(store.stats().keys, 100);
        clock.advance(Duration::from_secs(2));
        store.charge_now(&[charge("x", &p, 1)]).unwrap();
        let stats = store.stats();
        assert_eq!((stats.keys, stats.swept), (1, 100));
    }
}
