//! [`MemoryStore`]: the in-process store, the embedded default.
//!
//! Keys are sharded over mutex-protected tables. A decision locks only the
//! shards its charges live in (in index order, so multi-shard charges cannot
//! deadlock), evaluates every charge, and writes only if all were admitted.
//!
//! Each distinct (policy name, unit, numbers) the store meets gets a
//! *space* ([`spaces`]): the tables a state lives in belong to its space,
//! so a slot holds nothing but the key and the state. A key is stored
//! exactly where it can be: an IPv4 client address as its 32 bits, an IPv6
//! one as its 128 bits; any other key as the keyed 128-bit digest of its
//! text (SipHash-1-3, random secret per store: a caller who cannot see it
//! cannot aim for a collision, and an accidental one among ten million keys
//! has probability below 10⁻²³). A policy whose numbers changed (a plan,
//! a limit changed at runtime) finds the key's state in a sibling space of
//! the same name and unit and converts it
//! ([`carry_over`](crate::algorithm::carry_over)).
//!
//! Each space has, per kind of key, two tables. Token buckets and fixed
//! windows, whose state is one count and one time, keep (count, idle
//! deadline) in a compact slot — 20 bytes for an IPv4 address, 32 for a
//! 128-bit key: the time follows exactly from the two and the numbers.
//! Sliding windows (and the rare state whose deadline saturates, or that
//! holds requests for later) keep the whole state and its deadline.
//!
//! Idle entries (refilled to full, or past their window) are dropped by an
//! amortised sweep: the first access to a shard after its sweep interval
//! removes that shard's idle entries. No background task is needed.
//!
//! The parts: this file is the public store and its settings; [`shard`] is
//! the storage layout, [`charge`] the all-or-nothing decision, [`capacity`]
//! sweeping and the key cap, [`digest`] the keyed hashes, [`spaces`] the
//! spaces of the numbers states were written under.

mod capacity;
mod charge;
mod digest;
mod shard;
mod spaces;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use std::time::Duration;

use crate::algorithm::{self, State};
use crate::{Charge, Clock, Nanos, Outcome, Policy, Store, StoreError, SystemClock};
use digest::Hashes;
use shard::{Id, Shard};
use spaces::Spaces;

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
    clock: Time,
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
        self.clock = Time::Other(Arc::new(clock));
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
    ///
    /// An entry is idle at a reading when its state is the one a new key
    /// has there (a bucket full again, a window over): dropping it changes
    /// no decision at that reading or later. A [`Clock`](crate::Clock) that
    /// steps back behind a sweep (a custom one, or
    /// [`ManualClock::set`](crate::ManualClock::set); the system clock never
    /// does) finds the keys that sweep dropped new, where a store that had
    /// kept them would decide on their old state: as the Redis store does
    /// on its server's clock with a key that clock expired before stepping
    /// back. (With tollgate-redis's `RedisStoreBuilder::injected_time`, a
    /// test's clock, Redis keeps every key for at least an hour of real
    /// time, so it does not.) Each such step back can give a dropped key
    /// its policy's capacity again; with the system clock that never
    /// happens. [`Duration::MAX`] sweeps each shard at most once, at the
    /// first decision in it; [`MemoryStore::sweep`] and a key cap's
    /// eviction still drop keys.
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
                hashes: Hashes::random(),
                spaces: Spaces::new(),
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
/// Keys are sharded over mutex-protected tables, one set per policy name,
/// unit and numbers. A client address is kept as its own bits (a key of
/// one IPv4 address and a token bucket take a 20-byte slot); any other key
/// as a keyed 128-bit digest of its text, so memory per key does not
/// depend on the key's length, and the random per-store secret makes a
/// collision both unpredictable and negligible (below 10⁻²³ among ten
/// million keys). A policy whose numbers change under the same name reads
/// the same state, converted ([`carry_over`](crate::algorithm::carry_over));
/// a store tells apart up to 16,777,215 distinct sets of numbers in its
/// lifetime, after which charges under new numbers fail with
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
    clock: Time,
    /// The secret hashes: a key's slot key, its shard and its placement.
    hashes: Hashes,
    /// The spaces of the numbers states were written under.
    spaces: Spaces,
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
            clock: Time::System(SystemClock::new()),
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

/// The store's clock: the system's, read inline, or one the builder was
/// given (a test's manual clock), through its trait object.
#[derive(Clone)]
enum Time {
    System(SystemClock),
    Other(Arc<dyn Clock>),
}

impl Time {
    #[inline]
    fn now(&self) -> Nanos {
        match self {
            Time::System(clock) => clock.now(),
            Time::Other(clock) => clock.now(),
        }
    }
}

impl Inner {
    /// The slot key of `charge` in its policy's space.
    #[inline(always)]
    pub(super) fn id(&self, charge: &Charge) -> Result<Id, StoreError> {
        let space = self.spaces.space(charge.policy())?;
        Ok(self.hashes.id(charge.key(), space))
    }

    /// The state of `id` for a reader with `policy`'s numbers (the numbers
    /// of `id`'s space): as stored, or carried over from a sibling space,
    /// with that space when it was one.
    pub(super) fn state(
        &self,
        shard: &mut Shard,
        id: &Id,
        policy: &Policy,
        now: Nanos,
    ) -> (Option<State>, Option<u32>) {
        let algorithm = policy.algorithm();
        if let Some(stored) = shard.read(id) {
            return (Some(stored), None);
        }
        self.load_siblings(shard, id.space);
        let mut i = 0;
        while let Some(sibling) = shard.sibling(id.space, i) {
            i += 1;
            if sibling == id.space {
                continue;
            }
            let other = Id {
                space: sibling,
                ..*id
            };
            let Some(state) = shard.read(&other) else {
                continue;
            };
            // Every space in a shard was given by this store.
            let Some(from) = self.spaces.numbers(sibling) else {
                continue;
            };
            return (
                algorithm::carry_over(&from, state, algorithm, now),
                Some(sibling),
            );
        }
        (None, None)
    }

    /// Makes sure `shard` knows the siblings of `space`.
    fn load_siblings(&self, shard: &mut Shard, space: u32) {
        let tables = shard.tables_mut(space);
        if tables.siblings.is_none() {
            tables.siblings = Some(self.spaces.siblings(space));
        }
    }

    /// Writes `state` for `id` in its own space and drops what its sibling
    /// spaces hold for the key: a budget lives in one space at a time (the
    /// last one written), so no stale copy is read later under other
    /// numbers.
    pub(super) fn write(&self, shard: &mut Shard, id: &Id, state: State) {
        shard.put(id, state, &self.hashes);
        self.load_siblings(shard, id.space);
        let mut i = 0;
        while let Some(sibling) = shard.sibling(id.space, i) {
            i += 1;
            if sibling == id.space {
                continue;
            }
            shard.remove(&Id {
                space: sibling,
                ..*id
            });
        }
    }

    pub(super) fn shard_of(&self, id: &Id) -> usize {
        Hashes::shard_of(id, self.mask)
    }

    /// Shard `i`, locked, with its copy of the spaces' siblings brought up
    /// to date.
    pub(super) fn lock(&self, i: usize) -> MutexGuard<'_, Shard> {
        // parking_lot's mutex does not poison: a panic while a shard is
        // held (none can happen on input) cannot take the limiter down.
        let mut shard = self.shards[i].lock();
        let generation = self.spaces.generation();
        if shard.generation != generation {
            shard.forget_siblings();
            shard.generation = generation;
        }
        shard
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

    /// Gives refundable charges back ([`MemoryStore::refund_now`]).
    fn can_refund(&self) -> bool {
        true
    }

    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a crate::Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        std::future::ready(self.refund_now(charges, receipt))
    }

    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a crate::Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        std::future::ready(self.confirm_now(charges, receipt))
    }

    /// Every policy's numbers get their space here, when a rule (or a
    /// changed policy) is configured: a store that has met all the sets of
    /// numbers it can tell apart refuses the new one now, as a
    /// configuration error, never at runtime.
    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        self.inner.spaces.space(policy).map(|_| ())
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

    /// Every address and text key is its own budget, in every table: an
    /// exhausted budget leaves every other one (a neighbouring address, the
    /// same address aggregated or as IPv6, the same text under another
    /// policy name) untouched.
    #[test]
    fn addresses_and_text_keys_are_separate_budgets() {
        use std::net::IpAddr;
        let store = MemoryStore::builder()
            .clock(ManualClock::new(0))
            .shards(4)
            .build();
        let p = Policy::token_bucket("p", 1, Rate::per_hour(1)).unwrap();
        let q = Policy::token_bucket("q", 1, Rate::per_hour(1)).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut keys = Vec::new();
        for i in 0..300u32 {
            keys.push(Key::client_ip(
                IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i * 257)),
                32,
            ));
            keys.push(Key::client_ip(
                IpAddr::V6(std::net::Ipv6Addr::from(u128::from(i) << 64 | 1)),
                128,
            ));
            keys.push(Key::new("t=north").with(format!("a={i}")));
        }
        keys.push(Key::client_ip(ip("10.0.0.0"), 24));
        keys.push(Key::client_ip(ip("::ffff:10.0.0.0"), 128));
        keys.push(Key::client_ip(ip("2001:db8::"), 64));
        keys.push(Key::client_ip(ip("2001:db8::"), 128));
        for policy in [&p, &q] {
            for key in &keys {
                let c = [Charge::new(key.clone(), policy.clone(), 1).unwrap()];
                assert!(
                    store.charge_now(&c).unwrap().is_admitted(),
                    "{key:?} {}",
                    policy.name()
                );
                assert!(
                    !store.charge_now(&c).unwrap().is_admitted(),
                    "{key:?} {}",
                    policy.name()
                );
            }
        }
        assert_eq!(store.stats().keys, 2 * keys.len() as u64);
    }

    /// Found in review: every space of one name (a rule with a thousand
    /// account overrides of their own numbers has a thousand) kept, in
    /// every shard that read a key under it, its own copy of the list of
    /// its siblings: memory quadratic in the number of spaces (here 4
    /// keys under each of 1,000 sets of numbers held about 4 million
    /// sibling entries, 16 MB; 10,000 overrides would hold gigabytes).
    /// The lists a store holds stay linear in its spaces.
    #[test]
    fn sibling_lists_stay_linear_in_the_spaces() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(4)
            .build();
        let spaces = 1_000u64;
        let policies: Vec<Policy> = (0..spaces)
            .map(|i| Policy::token_bucket("plan", 1 + i, Rate::per_hour(1)).unwrap())
            .collect();
        // Every policy is configured first (as a rule's overrides are);
        // then each key is charged, goes idle and is swept, and comes back.
        for p in &policies {
            store.check_policy(p).unwrap();
        }
        for _ in 0..2 {
            for (i, p) in policies.iter().enumerate() {
                for k in 0..4 {
                    let key = Key::new(format!("a={i}")).with(format!("op={k}"));
                    let c = [Charge::new(key, p.clone(), 1).unwrap()];
                    assert!(store.charge_now(&c).unwrap().is_admitted());
                }
            }
            clock.advance(Duration::from_secs(3600));
        }
        let inner = &*store.inner;
        let mut seen = std::collections::HashSet::new();
        let mut held = 0;
        for i in 0..inner.shards.len() {
            let shard = inner.lock(i);
            for list in shard.sibling_lists() {
                if seen.insert(list.as_ptr()) {
                    held += list.len();
                }
            }
        }
        assert!(held <= 4 * spaces as usize, "{held} sibling entries held");
    }

    /// A shard holds tables only for the spaces it has keys of: 1,000
    /// sets of numbers with one key each on 64 shards make 1,000 tables,
    /// not 64,000 (304 bytes each), and a sweep that empties a space
    /// frees its tables.
    #[test]
    fn a_shard_holds_tables_only_for_spaces_it_uses() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(64)
            .build();
        let spaces = 1_000u64;
        for i in 0..spaces {
            let p = Policy::token_bucket("plan", 1 + i, Rate::per_second(1)).unwrap();
            let c = [Charge::new(Key::new(format!("a={i}")), p, 1).unwrap()];
            assert!(store.charge_now(&c).unwrap().is_admitted());
        }
        let inner = &*store.inner;
        let held = |inner: &Inner| {
            (0..inner.shards.len())
                .map(|i| inner.lock(i).spaces_held())
                .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
        };
        let (tables, indexes) = held(inner);
        // A miss may load a space's siblings into the shard it missed in
        // (at most one shard per key), so at most one table per key.
        assert!(
            tables <= spaces as usize,
            "{tables} tables for {spaces} keys"
        );
        assert!(indexes > 10 * tables, "{indexes} indexes, {tables} tables");
        // Every bucket refills (the largest in 1,000 s) and is swept.
        clock.advance(Duration::from_secs(2_000));
        for i in 0..inner.shards.len() {
            let mut shard = inner.lock(i);
            inner.maybe_sweep(&mut shard, clock.now());
        }
        assert_eq!(held(inner).0, 0);
        assert!((0..inner.shards.len()).all(|i| inner.lock(i).len() == 0));
    }

    /// The inline tables belong to the first space that touches a shard;
    /// once a sweep empties them they go to the next space that touches
    /// it, and every space keeps its own budgets throughout.
    #[test]
    fn the_inline_tables_pass_to_the_next_space_once_swept_empty() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .sweep_interval(Duration::from_secs(1))
            .build();
        let fast = Policy::token_bucket("fast", 2, Rate::per_second(2)).unwrap();
        let slow = Policy::token_bucket("slow", 3, Rate::per_hour(1)).unwrap();
        let later = Policy::token_bucket("later", 2, Rate::per_hour(1)).unwrap();
        let spend = |p: &Policy, key: &str| store.charge_now(&[charge(key, p, 1)]).unwrap();
        let space = |p: &Policy| store.inner.spaces.space(p).unwrap();
        let inline = || store.inner.lock(0).inline_space();
        assert_eq!(inline(), None);
        assert!(spend(&fast, "a").is_admitted());
        assert_eq!(inline(), Some(space(&fast)));
        assert!(spend(&slow, "b").is_admitted());
        assert!(spend(&slow, "b").is_admitted());
        assert_eq!(inline(), Some(space(&fast)), "the second space is boxed");
        assert_eq!(store.inner.lock(0).spaces_held().0, 2);
        // "fast" refills within a second, "slow" does not: the sweep
        // empties the inline tables only.
        clock.advance(Duration::from_secs(2));
        assert!(spend(&later, "c").is_admitted());
        assert_eq!(inline(), Some(space(&later)));
        assert_eq!(store.inner.lock(0).spaces_held().0, 2);
        // Each budget is where it was: "slow" has one unit of three left,
        // "later" one of two, "fast" is whole again.
        assert_eq!(spend(&slow, "b").limits()[0].remaining(), 0);
        assert!(!spend(&slow, "b").is_admitted());
        assert_eq!(spend(&later, "c").limits()[0].remaining(), 0);
        assert_eq!(spend(&fast, "a").limits()[0].remaining(), 1);
        assert_eq!(store.stats().keys, 3);
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
