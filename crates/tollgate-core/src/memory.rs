//! [`MemoryStore`]: the in-process store, the embedded default.
//!
//! Keys are sharded over mutex-protected hash maps. A decision locks only the
//! shards its charges live in (in index order, so multi-shard charges cannot
//! deadlock), evaluates every charge, and writes only if all were admitted.
//!
//! A map entry is keyed by a 128-bit keyed digest of the policy and the
//! key's text, not by the text itself: memory per key is fixed whatever the
//! key's length. The digest is SipHash-1-3 with 128-bit output, in one pass
//! (a caller who cannot see the secret key cannot aim for a collision): the
//! upper half picks the shard, the lower half places the entry in its map.
//! The key is random per store; an accidental collision among ten million
//! keys has probability below 10⁻²⁴.
//!
//! Each shard has two maps. Token buckets and fixed windows, whose state is
//! one count and one time, keep (count, idle deadline) in a 32-byte slot:
//! the time follows exactly from the two and the policy. Sliding windows
//! (and the rare state whose deadline saturates) keep the whole state and
//! its deadline in a 48-byte slot. A key lives in one of the two.
//!
//! Idle entries (refilled to full, or past their window) are dropped by an
//! amortised sweep: the first access to a shard after its sweep interval
//! removes that shard's idle entries. No background task is needed.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::HashMap;

use crate::algorithm::{self, State, Step};
use crate::digest::DigestKey;
use crate::{
    Charge, Clock, Decision, Nanos, Outcome, Policy, Store, StoreError, StoreErrorKind, SystemClock,
};

/// What [`MemoryStore`] does when a shard is at its share of the key cap and
/// a charge needs a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CapPolicy {
    /// Refuse: the charge fails with [`StoreErrorKind::CapacityExhausted`]
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
    cap_policy: CapPolicy,
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
    pub fn max_keys(mut self, max_keys: usize, policy: CapPolicy) -> Self {
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
/// Keys are sharded over mutex-protected maps, keyed by a 128-bit keyed
/// digest of (policy, key text), so memory per key does not depend on the
/// key's length; the random per-store seeds make a collision both
/// unpredictable and negligible (below 10⁻²⁴ among ten million keys).
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
    per_shard: Option<usize>,
    cap_policy: CapPolicy,
    sweep_every: Nanos,
    refused_new_keys: AtomicU64,
    evicted: AtomicU64,
    swept: AtomicU64,
}

#[derive(Default)]
struct Shard {
    /// Token buckets and fixed windows, as (count, idle deadline): their
    /// state's time follows from the two and the policy
    /// ([`algorithm::time_from_idle`]). A 32-byte slot.
    compact: HashMap<u128, Compact, DigestHasher>,
    /// Everything else (sliding windows, and the rare state whose deadline
    /// saturated): the whole state and its idle deadline. A 48-byte slot.
    wide: HashMap<u128, Entry, DigestHasher>,
    next_sweep: Nanos,
}

#[derive(Clone, Copy)]
struct Entry {
    state: State,
    idle_at: Nanos,
}

#[derive(Clone, Copy)]
struct Compact {
    level: u64,
    idle_at: Nanos,
}

impl Compact {
    /// The compact form of `state`, if it gives `state` back exactly.
    fn pack(policy: &Policy, state: State, idle_at: Nanos) -> Option<Self> {
        let at = algorithm::time_from_idle(policy, state.level, idle_at);
        (state.prior == 0 && at == Some(state.at)).then_some(Self {
            level: state.level,
            idle_at,
        })
    }

    /// The state packed (with the same policy: it is part of the digest).
    fn unpack(self, policy: &Policy) -> State {
        State {
            level: self.level,
            prior: 0,
            // `pack` checked that the time is recoverable. Were it not, the
            // deadline is the conservative reading: nothing refills before it.
            at: algorithm::time_from_idle(policy, self.level, self.idle_at).unwrap_or(self.idle_at),
        }
    }
}

impl Shard {
    fn len(&self) -> usize {
        self.compact.len() + self.wide.len()
    }

    fn contains(&self, digest: &u128) -> bool {
        self.compact.contains_key(digest) || self.wide.contains_key(digest)
    }

    fn state(&self, digest: &u128, policy: &Policy) -> Option<State> {
        match self.compact.get(digest) {
            Some(c) => Some(c.unpack(policy)),
            None => self.wide.get(digest).map(|e| e.state),
        }
    }

    /// Writes `state`, compactly when it packs exactly; a key is only ever
    /// in one of the two maps.
    fn put(&mut self, digest: u128, policy: &Policy, state: State, idle_at: Nanos) {
        match Compact::pack(policy, state, idle_at) {
            Some(c) => {
                self.compact.insert(digest, c);
                if !self.wide.is_empty() {
                    self.wide.remove(&digest);
                }
            }
            None => {
                self.wide.insert(digest, Entry { state, idle_at });
                if !self.compact.is_empty() {
                    self.compact.remove(&digest);
                }
            }
        }
    }
}

/// The map key is already a keyed digest: hashing it again would be waste.
#[derive(Clone, Copy, Default)]
struct DigestHasher;

impl BuildHasher for DigestHasher {
    type Hasher = DigestBits;
    fn build_hasher(&self) -> DigestBits {
        DigestBits(0)
    }
}

#[derive(Default)]
struct DigestBits(u64);

impl Hasher for DigestBits {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached if something other than a u128 is hashed.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
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
            cap_policy: CapPolicy::default(),
            sweep_interval: Duration::from_secs(1),
        }
    }

    /// Charges `charges` all-or-nothing, synchronously. [`Store::charge`]
    /// calls this; it never blocks on anything but the shard locks.
    pub fn charge_now(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        let now = inner.clock.now();
        if charges.iter().any(|c| !c.can_fit()) {
            return Ok(self.peek(charges, now));
        }
        if let [charge] = charges {
            return self.charge_one(charge, now);
        }
        let digests: Vec<u128> = charges.iter().map(|c| inner.digest(c)).collect();
        let mut order: Vec<usize> = digests.iter().map(|d| inner.shard_of(*d)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> = order.iter().map(|&i| inner.lock(i)).collect();
        for g in &mut guards {
            inner.maybe_sweep(g, now);
        }
        let guard_of = |d: u128| order.binary_search(&inner.shard_of(d)).unwrap_or(0);

        let mut steps: Vec<(u128, Step, &Policy)> = Vec::with_capacity(charges.len());
        let mut before: Vec<Option<State>> = Vec::with_capacity(charges.len());
        for (charge, &digest) in charges.iter().zip(&digests) {
            let policy = charge.policy();
            // A repeated key in one call sees the earlier charge's effect.
            let state = steps
                .iter()
                .rev()
                .find(|(d, s, _)| *d == digest && s.next.is_some())
                .and_then(|(_, s, _)| s.next)
                .or_else(|| guards[guard_of(digest)].state(&digest, policy));
            before.push(state);
            steps.push((
                digest,
                algorithm::decide(policy, state, now, charge.cost()),
                policy,
            ));
        }
        let mut outcome = Outcome::new(steps.iter().map(|(_, s, _)| s.decision).collect());
        let admitted = outcome.is_admitted();
        if !admitted {
            outcome = unspent(charges, &before, outcome, now);
        }
        // Admissions are written only together; a refusal's state (the
        // creation of an initially-empty bucket) is written regardless.
        steps.retain(|(_, s, _)| s.next.is_some() && (admitted || !s.decision.is_admitted()));
        if inner.per_shard.is_some() {
            // Room for every new key of this call, counted before any is
            // written: one call must not take a shard past its cap. A key
            // that appears twice is one key.
            let mut fresh: Vec<u128> = steps
                .iter()
                .map(|(d, _, _)| *d)
                .filter(|d| !guards[guard_of(*d)].contains(d))
                .collect();
            fresh.sort_unstable();
            fresh.dedup();
            for (i, &g) in order.iter().enumerate() {
                let new_here = fresh.iter().filter(|d| inner.shard_of(**d) == g).count();
                if new_here > 0 {
                    inner.make_room_for(&mut guards[i], new_here, &digests, now)?;
                }
            }
        }
        for (digest, step, policy) in steps {
            if let Some(state) = step.next {
                guards[guard_of(digest)].put(digest, policy, state, step.idle_at);
            }
        }
        Ok(outcome)
    }

    /// The common case, one charge: one shard lock and no scratch vectors.
    fn charge_one(&self, charge: &Charge, now: Nanos) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        let digest = inner.digest(charge);
        let (policy, cost) = (charge.policy(), charge.cost());
        let mut shard = inner.lock(inner.shard_of(digest));
        inner.maybe_sweep(&mut shard, now);
        // A tracked key is decided and written in place: one probe.
        if let Some(slot) = shard.compact.get_mut(&digest) {
            let step = algorithm::decide(policy, Some(slot.unpack(policy)), now, cost);
            if let Some(next) = step.next {
                match Compact::pack(policy, next, step.idle_at) {
                    Some(packed) => *slot = packed,
                    None => shard.put(digest, policy, next, step.idle_at),
                }
            }
            return Ok(Outcome::one(step.decision));
        }
        let state = shard.wide.get(&digest).map(|e| e.state);
        let step = algorithm::decide(policy, state, now, cost);
        if let Some(next) = step.next {
            if state.is_none() && inner.per_shard.is_some_and(|cap| shard.len() >= cap) {
                inner.make_room_for(&mut shard, 1, &[], now)?;
            }
            shard.put(digest, policy, next, step.idle_at);
        }
        Ok(Outcome::one(step.decision))
    }

    /// Decisions for `charges` at `now` without writing anything.
    fn peek(&self, charges: &[Charge], now: Nanos) -> Outcome {
        let inner = &*self.inner;
        let states: Vec<Option<State>> = charges
            .iter()
            .map(|c| {
                let digest = inner.digest(c);
                inner
                    .lock(inner.shard_of(digest))
                    .state(&digest, c.policy())
            })
            .collect();
        let decisions = charges
            .iter()
            .zip(&states)
            .map(|(c, s)| algorithm::decide(c.policy(), *s, now, c.cost()).decision)
            .collect();
        unspent(charges, &states, Outcome::new(decisions), now)
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

/// In a refused outcome nothing was spent: admitted entries describe their
/// budget as it stands, not as it would be after the charge.
fn unspent(charges: &[Charge], before: &[Option<State>], outcome: Outcome, now: Nanos) -> Outcome {
    Outcome::new(
        outcome
            .limits()
            .iter()
            .zip(charges.iter().zip(before))
            .map(|(d, (c, s))| match d {
                Decision::Admitted { .. } => algorithm::describe(c.policy(), *s, now),
                other => *other,
            })
            .collect(),
    )
}

impl Inner {
    fn digest(&self, charge: &Charge) -> u128 {
        self.digest_key
            .digest(charge.policy().identity(), charge.key().as_bytes())
    }

    fn shard_of(&self, digest: u128) -> usize {
        ((digest >> 64) as usize) & self.mask
    }

    fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // No code holding a shard lock can panic on input, but a poisoned
        // lock must not take the whole limiter down with it.
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn maybe_sweep(&self, shard: &mut Shard, now: Nanos) {
        if now >= shard.next_sweep {
            self.sweep_shard(shard, now);
        }
    }

    fn sweep_shard(&self, shard: &mut Shard, now: Nanos) {
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
    fn make_room_for(
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
                CapPolicy::RefuseNewKeys => return refuse(),
                CapPolicy::EvictNearestIdle => {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Key, ManualClock, Policy, Rate, Verdict};

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

    #[test]
    fn key_cap_refuses_new_keys_and_counts() {
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(1)
            .max_keys(3, CapPolicy::RefuseNewKeys)
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
            .max_keys(2, CapPolicy::RefuseNewKeys)
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
            .max_keys(2, CapPolicy::EvictNearestIdle)
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
        for policy in [CapPolicy::RefuseNewKeys, CapPolicy::EvictNearestIdle] {
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
            .max_keys(2, CapPolicy::EvictNearestIdle)
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

    #[test]
    fn never_fits_touches_nothing() {
        let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let o = store
            .charge_now(&[charge("a", &p, 1), charge("b", &p, 4)])
            .unwrap();
        assert_eq!(o.verdict(), Verdict::NeverFits);
        assert_eq!(store.stats().keys, 0);
    }

    /// A token bucket whose idle deadline saturates cannot be kept compact:
    /// it moves to the wide map and stays exact, and back when it can.
    #[test]
    fn saturated_deadlines_stay_exact_in_the_wide_map() {
        let clock = ManualClock::new(2_000_000_000_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let p = Policy::token_bucket("huge", 1_800_000_000, Rate::new(1, Duration::from_secs(10)))
            .unwrap();
        let spent = store.charge_now(&[charge("k", &p, 1_700_000_000)]).unwrap();
        assert!(spent.is_admitted());
        let inner = &*store.inner;
        let shard = |d| inner.lock(inner.shard_of(d));
        let digest = inner.digest(&charge("k", &p, 1));
        assert!(shard(digest).wide.contains_key(&digest));
        assert!(!shard(digest).compact.contains_key(&digest));
        let rest = store.charge_now(&[charge("k", &p, 100_000_000)]).unwrap();
        assert_eq!(rest.limits()[0].remaining(), 0);
        assert!(rest.is_admitted());
        assert!(
            !store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().keys, 1);
        // Ten seconds refill one token: admitted again, exactly once.
        clock.advance(Duration::from_secs(10));
        assert!(
            store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert!(
            !store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().keys, 1);
    }

    /// Token buckets and fixed windows are kept in 32-byte slots, sliding
    /// windows in 48-byte ones; one store holds both, each key once.
    #[test]
    fn compact_and_wide_entries_live_side_by_side() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .build();
        let bucket = Policy::token_bucket("b", 2, Rate::per_second(1)).unwrap();
        let fixed = Policy::fixed_window("f", 2, Duration::from_secs(1)).unwrap();
        let sliding = Policy::sliding_window("s", 2, Duration::from_secs(1)).unwrap();
        for p in [&bucket, &fixed, &sliding] {
            for _ in 0..2 {
                assert!(
                    store
                        .charge_now(&[charge("k", p, 1)])
                        .unwrap()
                        .is_admitted()
                );
            }
            assert!(
                !store
                    .charge_now(&[charge("k", p, 1)])
                    .unwrap()
                    .is_admitted()
            );
        }
        {
            let shard = store.inner.lock(0);
            assert_eq!((shard.compact.len(), shard.wide.len()), (2, 1));
        }
        assert_eq!(store.stats().keys, 3);
        clock.advance(Duration::from_secs(3));
        store.sweep();
        assert_eq!(store.stats().keys, 0);
    }

    #[test]
    fn repeated_key_in_one_call_sees_its_own_charge() {
        let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let o = store
            .charge_now(&[charge("a", &p, 2), charge("a", &p, 2)])
            .unwrap();
        assert!(!o.is_admitted());
        assert!(
            store
                .charge_now(&[charge("a", &p, 3)])
                .unwrap()
                .is_admitted()
        );
    }
}
