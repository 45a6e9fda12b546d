//! [`RedisStore`]: what it holds, what it tells about itself, its
//! [`Store`] implementation, and its calls to the decision script.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate_budget::{
    Charge, Nanos, Outcome, Policy, Receipt, Reservation, Store, StoreError, StoreErrorKind,
};

use crate::cache::{CacheStats, OverLimitCache};
use crate::connection::Conn;
use crate::keys;
use crate::lua;
use crate::script::{self, Mode, Prepared};

/// Where time comes from.
#[derive(Clone)]
pub(crate) enum TimeSource {
    Server,
    Injected(Arc<dyn Fn() -> Nanos + Send + Sync>),
}

/// Counters of the decision scripts ([`RedisStore::script_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ScriptStats {
    /// Calls sent to the one-bucket script ([`RedisStore::one_bucket_script_source`]):
    /// one token-bucket charge, unshaped, of a bucket that starts full.
    pub one_bucket_calls: u64,
    /// Of those, the calls it handed to the full script (a second round
    /// trip): the key's state was written under other numbers (a changed
    /// limit, once per key), in an earlier format, or is dated in a later
    /// era than the server's clock.
    pub handed_over: u64,
}

#[derive(Default)]
pub(crate) struct ScriptCounters {
    pub(crate) one_bucket_calls: AtomicU64,
    pub(crate) handed_over: AtomicU64,
}

/// A [`Store`] backed by Redis. Cloning shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) conn: Conn,
    pub(crate) script: redis::Script,
    /// The common call's script, which hands anything else to `script`.
    pub(crate) one_bucket: redis::Script,
    pub(crate) scripts: ScriptCounters,
    pub(crate) prefix: String,
    pub(crate) timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) time: TimeSource,
    pub(crate) split: bool,
    pub(crate) cache: Option<OverLimitCache>,
    /// A store made from a URL: its client, for the policy announcements'
    /// own connection (pub/sub).
    pub(crate) pubsub: Option<redis::Client>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("timeout", &self.inner.timeout)
            .field("split_by_slot", &self.inner.split)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// The Lua source of the decision script, for operators who pre-load
    /// it (`SCRIPT LOAD`) or audit it. The store loads it itself when Redis
    /// answers `NOSCRIPT`.
    pub fn script_source() -> &'static str {
        lua::decide_source()
    }

    /// The SHA-1 the store calls the script by (`EVALSHA`).
    pub fn script_sha() -> String {
        lua::decide_script().get_hash().to_owned()
    }

    /// The Lua source of the one-bucket script: the store's most common
    /// call (one token-bucket charge, unshaped, of a bucket that starts
    /// full) decided with a fraction of the [decision
    /// script](RedisStore::script_source)'s work, on the same keys and
    /// values; it hands whatever else the key's state needs (another
    /// policy's numbers, an earlier format) to the decision script. Pre-load
    /// both, or neither: the store loads each after `NOSCRIPT`.
    pub fn one_bucket_script_source() -> &'static str {
        lua::one_bucket_source()
    }

    /// The SHA-1 the store calls the one-bucket script by.
    pub fn one_bucket_script_sha() -> String {
        lua::one_bucket_script().get_hash().to_owned()
    }

    /// How many calls went to the one-bucket script, and how many of those
    /// it handed to the decision script (each a second round trip).
    pub fn script_stats(&self) -> ScriptStats {
        let c = &self.inner.scripts;
        ScriptStats {
            one_bucket_calls: c.one_bucket_calls.load(Ordering::Relaxed),
            handed_over: c.handed_over.load(Ordering::Relaxed),
        }
    }

    /// Connects now, within the [connect
    /// timeout](crate::RedisStoreBuilder::connect_timeout), and loads the
    /// decision, one-bucket and lease scripts, so that the first requests
    /// are answered like every later one (a store built with
    /// [`build`](crate::RedisStoreBuilder::build) connects on its first call
    /// otherwise, within that call's 200 ms, TCP, TLS handshake and `AUTH`
    /// included). Call it before serving; an error says why Redis cannot
    /// be used (refused, a TLS certificate not trusted, `NOAUTH`, no such
    /// master), and the store still works, connecting in the background,
    /// once Redis answers.
    ///
    /// For a cluster, connects to the cluster (the scripts are loaded on
    /// each node when it first answers `NOSCRIPT`).
    pub async fn connect(&self) -> Result<(), StoreError> {
        self.inner.conn.connect(self.inner.connect_timeout).await
    }

    /// The Redis key that holds `charge`'s state.
    pub fn redis_key(&self, charge: &Charge) -> String {
        keys::redis_key(&self.inner.prefix, charge)
    }

    /// Counters of the over-limit cache (zero if it is off).
    pub fn cache_stats(&self) -> CacheStats {
        self.inner
            .cache
            .as_ref()
            .map(OverLimitCache::stats)
            .unwrap_or_default()
    }

    /// When a call started now must be answered.
    pub(crate) fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.inner.timeout
    }

    /// The injected time, if the store has it (`None`: the server's).
    pub(crate) fn injected_now(&self) -> Option<Nanos> {
        match &self.inner.time {
            TimeSource::Server => None,
            TimeSource::Injected(f) => Some(f()),
        }
    }

    /// Runs a script on the store's connection, answered by `deadline`
    /// ([`Conn::run`]).
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        eval: impl Fn() -> redis::Cmd,
        deadline: tokio::time::Instant,
    ) -> Result<T, StoreError> {
        self.inner
            .conn
            .run(invocation, eval, deadline, self.inner.timeout)
            .await
    }

    /// Runs the decision script for `prepared` in `mode`, answering by
    /// `deadline`; a reply of the wrong length is a protocol error.
    pub(crate) async fn invoke(
        &self,
        prepared: &Prepared,
        mode: Mode,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<i64>, StoreError> {
        let now = self.injected_now();
        let invocation = prepared.invocation(&self.inner.script, now, mode);
        let reply: Vec<i64> = self
            .run(&invocation, || prepared.eval(now, mode), deadline)
            .await?;
        let own = script::REPLY * prepared.len();
        // A delayed call adds the states its reservations replaced.
        let extra = reply.len().saturating_sub(own);
        if reply.len() >= own
            && extra.is_multiple_of(script::REPLACED)
            && extra / script::REPLACED <= prepared.len()
        {
            Ok(reply)
        } else {
            Err(StoreError::new(
                StoreErrorKind::Protocol,
                format!(
                    "script returned {} values for {} charges",
                    reply.len(),
                    prepared.len()
                ),
            ))
        }
    }
}

impl Store for RedisStore {
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        self.charge_all(charges)
    }

    /// `Some` for what needs no round trip (a charge that can never fit, a
    /// refusal the over-limit cache holds), so the HTTP layer answers those
    /// without allocating a future; `None` (nothing touched) otherwise.
    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        // Without a cache only never-fits can be answered here: do not build
        // keys that `charge` would build again.
        if self.inner.cache.is_none() && charges.iter().all(Charge::can_fit) {
            return None;
        }
        // Not asking Redis itself: it leaves the probe to `charge`.
        self.local_answer(charges, false).0.map(Ok)
    }

    /// Refuses the numbers the script cannot decide exactly (e.g. a window
    /// or a time to full beyond what Redis's doubles hold to the
    /// nanosecond); the error names the number.
    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        script::params(policy, 1).map(|_| ())
    }

    /// One `check` script per slot group; nothing is written.
    fn check<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        self.check_all(charges)
    }

    fn can_check(&self) -> bool {
        true
    }

    /// Shapes token buckets in the script, on Redis time, for calls whose
    /// keys share a slot (a call spread over slots is decided unshaped).
    fn can_shape(&self) -> bool {
        true
    }

    fn can_refund(&self) -> bool {
        true
    }

    /// Settles refundable charges: one `refund` or `confirm` script per
    /// slot group; a refund also forgets what the over-limit cache
    /// remembered of them.
    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.settle(charges, receipt, Mode::Refund)
    }

    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.settle(charges, receipt, Mode::Confirm)
    }

    /// One `cancel` script for the reservation's charges (they share a
    /// slot: a delayed call was one script).
    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        self.cancel_reserved(charges, reservation)
    }
}
