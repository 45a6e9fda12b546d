//! A Redis-backed [`Store`] for tollgate: one shared, atomic budget for a
//! fleet.
//!
//! Every decision is **one Lua script** run with `EVALSHA` (reloaded on
//! `NOSCRIPT`, e.g. after a restart or `SCRIPT FLUSH`): refill, compare and
//! deduct for every charge of a request happen inside it, all-or-nothing. A
//! refusal writes nothing and extends no TTL (the one exception: the
//! creation time of an initially-empty token bucket, which spends nothing).
//! The most common call, one token-bucket charge (unshaped, of a bucket
//! that starts full), goes to a second, small script
//! ([`RedisStore::one_bucket_script_source`]) that decides it exactly as the
//! full one would for a fraction of the Redis CPU; when the key's state
//! needs more (other numbers, an earlier format), it writes nothing and
//! the store sends the call to the full script
//! ([`RedisStore::script_stats`] counts these second round trips).
//!
//! - **Time** is the server's `TIME`, read inside the script, so a fleet
//!   shares one clock. It is handled as integers below 2^53 (exact in Lua's
//!   doubles): nanoseconds within 4·10⁶-second eras since 2026-01-01. A
//!   server clock that steps backwards never mints credit. Tests may inject
//!   time instead ([`RedisStoreBuilder::injected_time`]); that is a
//!   test/diagnostic option, not for production.
//! - **Same algorithms** as `tollgate-budget`, with the same results on the
//!   same traces (the core's conformance table runs against a real Redis).
//!   Policies whose numbers do not fit the exact range are refused with
//!   [`StoreErrorKind::Unsupported`] by [`Store::check_policy`], which
//!   the HTTP layer calls when a rule is added.
//! - **Keys**: `PREFIX:{KEY}:NAME/UNIT`, where `KEY` is the injective text
//!   of the tuple key (`{`/`}` escaped) followed by the policy's name and
//!   unit: state belongs to the key and the policy's name and unit, as in
//!   `MemoryStore`, not to its numbers. The braces are a Redis Cluster hash
//!   tag: each key's slot depends only on the key. Values are nine
//!   little-endian doubles: the state (level, prior, era, offset) and the
//!   numbers that wrote it, so that a charge under other numbers (a plan, a
//!   limit changed at runtime) carries what was spent over by the core's
//!   rule ([`tollgate_budget::algorithm::carry_over`]), in the script, on the
//!   same exact integers. Charges travel to the script packed the same way.
//!   Text values from earlier versions are still read.
//! - **TTL**: every write sets a TTL equal to the time until the state is
//!   indistinguishable from none (bucket full, window over): idle state
//!   disappears by itself and no key is immortal.
//! - **Cluster**: charges whose keys share a slot run in one script. Keys
//!   in different slots (e.g. a per-address and a global limit) cannot be
//!   one atomic step in Redis Cluster: they are charged slot by slot in a
//!   fixed order, and if one refuses, the earlier admissions are refunded
//!   (and the later slots are read without writing, so that the outcome
//!   describes every limit as one script would).
//!   Between the charge and the refund other requests may be refused that
//!   would have fitted, but nothing is ever admitted beyond a budget.
//! - **Failures**: the store starts even when Redis is unreachable and
//!   (re)connects by itself. Every call has a timeout (default 200 ms).
//!   Connection refused is [`StoreErrorKind::Unavailable`] (nothing spent);
//!   a timeout or a connection lost after sending is
//!   [`StoreErrorKind::Uncertain`] (budget may have been spent). The layer's
//!   fail-closed / fail-open / fallback setting decides the HTTP answer.
//! - **Over-limit cache** (on by default, [`DEFAULT_OVER_LIMIT_CACHE`]):
//!   denials are remembered locally until the time Redis said the cost
//!   would fit, and so are admissions that left a token bucket without room
//!   for the same cost; repeats in that time are refused without a round
//!   trip. When such a deadline passes, one request probes Redis while the
//!   others are refused until one more cost has refilled, so a flood costs
//!   about one call per key per refill. It only ever refuses, so it never
//!   admits anything Redis would not; and it only remembers what Redis
//!   would refuse for that charge alone (a key charged twice in one call is
//!   remembered by its first charge). It is a fixed table: O(1) per
//!   decision and 68 bytes per entry, also at its bound.
//!
//! Requires Redis 7 or later (the script declares its flags with `#!lua`).
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use tollgate_budget::{Charge, Key, Policy, Rate, Store};
//! use tollgate_redis::RedisStore;
//!
//! let store = RedisStore::builder("redis://127.0.0.1:6379")?
//!     .prefix("myapp")
//!     .build()?;
//! let policy = Policy::token_bucket("export", 3, Rate::per_second(2))?;
//! let charge = Charge::new(Key::new("export").with("alice"), policy, 1)?;
//! let outcome = store.charge(&[charge]).await?;
//! println!("{:?}", outcome.verdict());
//! # Ok(()) }
//! ```
//!
//! [`Store`]: tollgate_budget::Store
//! [`Store::check_policy`]: tollgate_budget::Store::check_policy
//! [`StoreErrorKind::Unsupported`]: tollgate_budget::StoreErrorKind::Unsupported
//! [`StoreErrorKind::Unavailable`]: tollgate_budget::StoreErrorKind::Unavailable
//! [`StoreErrorKind::Uncertain`]: tollgate_budget::StoreErrorKind::Uncertain
#![cfg_attr(docsrs, feature(doc_cfg))]

// Modules by job; lib.rs defines nothing itself, so that no module imports
// the crate root (every item is imported from the module that defines it).
mod builder;
mod cache;
mod charging;
mod connection;
mod keys;
mod leases;
mod lua;
mod policies;
mod redact;
mod script;
mod sentinel;
mod store;

pub use builder::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_OVER_LIMIT_CACHE, RedisStoreBuilder};
pub use cache::CacheStats;
pub use policies::{NumbersCompared, PolicyAnnouncements, PublishedPolicies};
pub use redact::redact_url;
/// The redis-rs this store is built on, for connections you hand it
/// ([`RedisStore::with_connection_manager`]).
pub use redis;
pub use sentinel::DEFAULT_SENTINEL_CHECK;
pub use store::{RedisStore, ScriptStats};
