//! Exact, runtime-agnostic budget arithmetic for [tollgate].
//!
//! This crate holds everything about rate limiting that needs neither HTTP nor
//! an async runtime:
//!
//! - [`Policy`]: a named budget (token bucket, anchored fixed window, sliding
//!   window) validated so that every decision is exact integer arithmetic;
//! - [`algorithm::decide`]: the algorithms as pure functions;
//! - [`Clock`]: monotonic elapsed time, with [`ManualClock`] for tests;
//! - [`Key`]: tuple keys with an injective text form;
//! - [`Charge`], [`Decision`], [`Outcome`]: what is asked and answered;
//! - [`Store`]: one atomic, all-or-nothing decision for a set of charges, with
//!   [`MemoryStore`] as the embedded default;
//! - [`LeaseStore`]: in-flight counts shared by a fleet, as leases that
//!   expire by themselves;
//! - [`AdaptiveLimit`]: a concurrency limit found from latency (gradient
//!   over a re-probed floor latency, back-off on failures), fed by the caller;
//! - [`fair_shares`]: weighted max-min fair shares of a saturated limit;
//! - [`Priority`]: request classes, with [`next_to_admit`] and
//!   [`displaced_by`] deciding who goes first when a limit is full;
//! - `conformance` (feature `conformance`): a trace table every store
//!   must reproduce.
//!
//! ```
//! use tollgate_budget::{Charge, Key, ManualClock, MemoryStore, Policy, Rate, Verdict};
//! # fn block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     let mut f = std::pin::pin!(f);
//! #     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
//! #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
//! # }
//! use tollgate_budget::Store;
//!
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::builder().clock(clock.clone()).build();
//! let policy = Policy::token_bucket("export", 3, Rate::per_second(2))?;
//! let charge = Charge::new(Key::new("export").with("alice"), policy, 1)?;
//!
//! for _ in 0..3 {
//!     assert!(block_on(store.charge(std::slice::from_ref(&charge)))?.is_admitted());
//! }
//! let refused = block_on(store.charge(std::slice::from_ref(&charge)))?;
//! assert_eq!(
//!     refused.verdict(),
//!     Verdict::Denied { retry_after: std::time::Duration::from_millis(500) }
//! );
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [tollgate]: https://docs.rs/tollgate
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adaptive;
pub mod algorithm;
mod clock;
#[cfg(feature = "conformance")]
pub mod conformance;
mod decision;
mod divisor;
mod fair;
mod key;
mod lease;
mod memory;
mod policy;
mod priority;
mod state;
mod store;

pub use adaptive::{
    AdaptiveConfig, AdaptiveConfigBuilder, AdaptiveLimit, Change, Failure, InvalidAdaptiveLimit,
    Sample,
};
pub use clock::{Clock, ManualClock, Nanos, SystemClock};
pub use decision::{
    Charge, Decision, InvalidCharge, Outcome, Receipt, Reservation, Reserved, Verdict,
};
pub use fair::{Claim, fair_shares};
pub use key::{InvalidKey, Key};
pub use lease::{Acquired, Lease, LeaseRequest, LeaseStore, Renewed};
pub use memory::{MemoryStore, MemoryStoreBuilder, MemoryStoreStats, OnKeyCap};
pub use policy::{
    Algorithm, Initial, InvalidName, InvalidPolicy, Policy, Rate, TokenBucket, Unit, Window,
    check_name,
};
pub use priority::{Priority, displaced_by, next_to_admit};
pub use store::{DynStore, Store, StoreError, StoreErrorKind, StoreFuture};
