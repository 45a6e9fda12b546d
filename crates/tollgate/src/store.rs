//! What a store author, or a test of budgets, needs beyond the crate root:
//! the [`Store`](crate::Store) contract's charges and answers, fleet
//! leases, clocks, keys, the in-memory store's builder and counters, and
//! the policy's algorithms.
//!
//! An application configures rules with the root's [`Policy`](crate::Policy),
//! [`Rate`](crate::Rate) and stores ([`MemoryStore`](crate::MemoryStore),
//! `RedisStore`); it names nothing here unless it tunes the in-memory store
//! ([`MemoryStoreBuilder`]) or tests with a [`ManualClock`]. Everything here
//! is the `tollgate-budget` crate's, re-exported so that `tollgate` stays
//! the one dependency.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::store::{ManualClock, OnKeyCap};
//! use tollgate::MemoryStore;
//!
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::builder()
//!     .clock(clock.clone())
//!     .max_keys(100_000, OnKeyCap::EvictNearestIdle)
//!     .build();
//! clock.advance(Duration::from_secs(1));
//! # let _ = store;
//! ```

pub use tollgate_budget::algorithm;
pub use tollgate_budget::{
    Acquired, Algorithm, Charge, Clock, Decision, DynStore, InvalidCharge, InvalidKey, Key, Lease,
    LeaseRequest, LeaseStore, ManualClock, MemoryStoreBuilder, MemoryStoreStats, Nanos, OnKeyCap,
    Outcome, Receipt, Renewed, Reservation, Reserved, StoreErrorKind, StoreFuture, SystemClock,
    TokenBucket, Verdict, Window, check_name,
};
