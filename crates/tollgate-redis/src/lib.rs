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
#![cfg_attr(docsrs, feature(doc_cfg))]

mod cache;
mod leases;
mod redact;
mod script;
mod sentinel;
#[cfg(feature = "testing")]
pub mod testing;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tollgate_budget::algorithm::State;
use tollgate_budget::{
    Charge, Decision, Nanos, Outcome, Policy, Receipt, Reservation, Reserved, Store, StoreError,
    StoreErrorKind,
};

pub use cache::CacheStats;
use cache::OverLimitCache;
pub use redact::redact_url;
/// The redis-rs this store is built on, for connections you hand it
/// ([`RedisStore::with_connection_manager`]).
pub use redis;
use script::{Mode, Prepared};
pub use sentinel::DEFAULT_SENTINEL_CHECK;
use sentinel::SentinelConn;

/// Where time comes from.
#[derive(Clone)]
enum TimeSource {
    Server,
    Injected(Arc<dyn Fn() -> Nanos + Send + Sync>),
}

enum Conn {
    Single(ConnectionManager),
    Cluster(Box<ClusterConn>),
    Sentinel(Arc<SentinelConn>),
}

/// A cluster connection, made on first use (or given).
struct ClusterConn {
    client: Option<redis::cluster::ClusterClient>,
    conn: OnceCell<ClusterConnection>,
}

/// rustls needs one process-wide crypto provider: ring, unless the
/// application installed another first.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Denials the over-limit cache remembers unless told otherwise
/// ([`RedisStoreBuilder::over_limit_cache`]).
pub const DEFAULT_OVER_LIMIT_CACHE: usize = 65_536;

/// Builder for [`RedisStore`].
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    /// The URLs the target was made from (a single server's, or a
    /// cluster's nodes), to rebuild its client with TLS certificates.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    urls: Vec<String>,
    #[cfg(feature = "tls")]
    tls: Option<redis::TlsCertificates>,
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    time: TimeSource,
    split: bool,
    cache: Option<usize>,
    sentinel_check: Duration,
}

/// How long [`RedisStore::connect`] (and each connection the store makes)
/// may take unless told otherwise
/// ([`RedisStoreBuilder::connect_timeout`]): 2 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

enum Target {
    Single(redis::Client),
    Cluster(redis::cluster::ClusterClient),
    /// A connection the application made.
    Manager(ConnectionManager),
    /// A cluster connection the application made.
    ClusterConnection(ClusterConnection),
    /// The master of a Sentinel-monitored group, and the group's name.
    Sentinel(redis::sentinel::SentinelClient, String),
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("split_by_slot", &self.split)
            .field("over_limit_cache", &self.cache)
            .finish_non_exhaustive()
    }
}

/// How the store's own connections time out and reconnect: making a
/// connection (TCP, TLS, `AUTH`) may take `connect`, an answer `timeout`
/// (a call never waits longer than the decision's time limit either way),
/// and reconnects happen in the background.
fn manager_config(connect: Duration, timeout: Duration) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(20))
        .set_max_delay(Duration::from_millis(500))
}

/// `target` rebuilt to use `certs` (a private CA, a client certificate)
/// for its `rediss://` URLs `urls`: a single server's, or every cluster
/// node's (nodes found later get the same certificates).
#[cfg(feature = "tls")]
fn with_certificates(
    target: Target,
    urls: &[String],
    certs: redis::TlsCertificates,
) -> Result<Target, StoreError> {
    if let Some(url) = urls.iter().find(|u| !u.starts_with("rediss://")) {
        return Err(StoreError::new(
            StoreErrorKind::Config,
            format!(
                "TLS certificates were given for {}, which is not a rediss:// URL",
                redact_url(url)
            ),
        ));
    }
    let pem = |bytes: &[u8]| String::from_utf8_lossy(bytes).contains("-----BEGIN CERTIFICATE-----");
    if certs.root_cert.as_deref().is_some_and(|ca| !pem(ca)) {
        return Err(StoreError::new(
            StoreErrorKind::Config,
            "the CA given for Redis TLS holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    install_crypto_provider();
    let invalid = |e: redis::RedisError| {
        StoreError::new(
            StoreErrorKind::Config,
            "invalid TLS certificates or key for Redis",
        )
        .with_source(e)
    };
    match (target, urls) {
        (Target::Single(_), [url]) => Ok(Target::Single(
            redis::Client::build_with_tls(url.as_str(), certs).map_err(invalid)?,
        )),
        (Target::Cluster(_), nodes) if !nodes.is_empty() => Ok(Target::Cluster(
            // No resends by redis-rs, as in `cluster_builder`.
            redis::cluster::ClusterClient::builder(nodes.to_vec())
                .retries(0)
                .certs(certs)
                .build()
                .map_err(invalid)?,
        )),
        _ => Err(StoreError::new(
            StoreErrorKind::Config,
            "TLS certificates are set on RedisStore::builder and cluster_builder only (a \
             connection you made carries its own TLS settings; Sentinel masters over TLS are \
             not supported)",
        )),
    }
}

fn config_error(e: impl std::error::Error + Send + Sync + 'static, what: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Unavailable, what.to_owned()).with_source(e)
}

impl RedisStoreBuilder {
    /// The key prefix (default `tollgate`). Use one per application.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The time limit for each decision (default 200 ms), also when its
    /// keys span slots: refunds still owed when it runs out are sent in
    /// the background. A call that has to wait for a connection to be
    /// made waits within it too: connect first ([`RedisStore::connect`])
    /// so that the first requests do not pay for the TCP connection, the
    /// TLS handshake and `AUTH`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long making a connection may take: [`RedisStore::connect`], and
    /// each reconnection in the background (default
    /// [`DEFAULT_CONNECT_TIMEOUT`], 2 s). Separate from the per-call
    /// [`timeout`](Self::timeout): a TLS handshake on a busy machine can
    /// take longer than a decision may.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Remembers up to `max_keys` denials (and token buckets an admission
    /// left without room for the same cost) locally until the time the
    /// cost fits, refusing repeats without a round trip; `0` turns the
    /// cache off. On by default with [`DEFAULT_OVER_LIMIT_CACHE`] entries
    /// (68 bytes each: about 4.5 MB), so that a client flooding a
    /// spent budget costs the fleet's Redis about one call per key per
    /// refill interval, not one per request; off by default with
    /// [`injected_time`] (the cache keeps real time) and when charging slot
    /// by slot (below).
    ///
    /// [`injected_time`]: RedisStoreBuilder::injected_time
    ///
    /// It relies on credit only growing with time between charges. A store
    /// that charges slot by slot (a cluster, or [`split_by_slot`]) refunds
    /// earlier slots when a later one refuses, so a refusal it sees may be
    /// undone a moment later: such a store remembers no refusal. Every
    /// store sharing keys should run in the same mode.
    ///
    /// [`split_by_slot`]: RedisStoreBuilder::split_by_slot
    pub fn over_limit_cache(mut self, max_keys: usize) -> Self {
        self.cache = Some(max_keys);
        self
    }

    /// Trusts `ca_pem` (a PEM certificate, or several) for a `rediss://`
    /// server, or every node of a `rediss://` cluster
    /// ([`RedisStore::cluster_builder`]), instead of the system's roots: a
    /// managed Redis with a private CA, or your own. Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn tls_root_certificate(mut self, ca_pem: impl Into<Vec<u8>>) -> Self {
        self.tls
            .get_or_insert(redis::TlsCertificates {
                client_tls: None,
                root_cert: None,
            })
            .root_cert = Some(ca_pem.into());
        self
    }

    /// Presents `cert_pem` with its private key `key_pem` to a `rediss://`
    /// server (or each node of a `rediss://` cluster) that asks clients
    /// for certificates (mutual TLS). Feature `tls`.
    #[cfg(feature = "tls")]
    pub fn tls_client_certificate(
        mut self,
        cert_pem: impl Into<Vec<u8>>,
        key_pem: impl Into<Vec<u8>>,
    ) -> Self {
        self.tls
            .get_or_insert(redis::TlsCertificates {
                client_tls: None,
                root_cert: None,
            })
            .client_tls = Some(redis::ClientTlsConfig {
            client_cert: cert_pem.into(),
            client_key: key_pem.into(),
        });
        self
    }

    /// How often a store on a Sentinel-monitored master
    /// ([`RedisStore::sentinel_builder`]) asks the sentinels where the
    /// master is (default [`DEFAULT_SENTINEL_CHECK`], 1 s); no effect on
    /// other stores. After a failover, calls go to the new master within
    /// about this long, even while the demoted master still accepts writes
    /// (which it then loses). The check runs in the background, at most
    /// one at a time, started by a call when the last is older than this:
    /// one round trip to a sentinel per interval, none added to a call.
    pub fn sentinel_check_every(mut self, every: Duration) -> Self {
        self.sentinel_check = every;
        self
    }

    /// Charges keys slot by slot with compensating refunds even on a single
    /// node, as on a cluster. For tests of that path; a cluster store always
    /// does this when a request's keys span slots.
    pub fn split_by_slot(mut self, yes: bool) -> Self {
        self.split = yes;
        self
    }

    /// **Test/diagnostic option.** Uses `now` (nanoseconds on any fixed
    /// origin) instead of the server's `TIME`. Every client of the same keys
    /// must then use the same clock.
    ///
    /// Redis still expires keys on its own clock, which an injected clock
    /// need not follow (a test may hold it still while real time passes).
    /// So that expiry can never run ahead of the injected clock, keys
    /// written under injected time get a TTL of at least one hour of real
    /// time. Expiry then never changes a decision of the table's algorithms
    /// (an idle state decides like none), except that an idle
    /// initially-empty token bucket reads as full for that longer time, as
    /// it does in a `MemoryStore` until its next sweep.
    pub fn injected_time(mut self, now: impl Fn() -> Nanos + Send + Sync + 'static) -> Self {
        self.time = TimeSource::Injected(Arc::new(now));
        self
    }

    /// Builds the store without connecting: the connection is made on first
    /// use and remade after failures, in the background. Must be called
    /// inside a tokio runtime.
    pub fn build(self) -> Result<RedisStore, StoreError> {
        #[cfg(feature = "tls")]
        let target = match self.tls {
            Some(certs) => with_certificates(self.target, &self.urls, certs)?,
            None => {
                install_crypto_provider();
                self.target
            }
        };
        #[cfg(not(feature = "tls"))]
        let target = self.target;
        let conn = match target {
            Target::Single(client) => Conn::Single(
                ConnectionManager::new_lazy_with_config(
                    client,
                    manager_config(self.connect_timeout, self.timeout),
                )
                .map_err(|e| config_error(e, "creating the Redis connection manager"))?,
            ),
            Target::Cluster(client) => Conn::Cluster(Box::new(ClusterConn {
                client: Some(client),
                conn: OnceCell::new(),
            })),
            Target::Manager(manager) => Conn::Single(manager),
            Target::Sentinel(client, name) => Conn::Sentinel(Arc::new(SentinelConn::new(
                client,
                name,
                manager_config(self.connect_timeout, self.timeout),
                self.timeout,
                self.sentinel_check,
            ))),
            Target::ClusterConnection(conn) => Conn::Cluster(Box::new(ClusterConn {
                client: None,
                conn: OnceCell::new_with(Some(conn)),
            })),
        };
        let split = self.split || matches!(conn, Conn::Cluster(_));
        // The cache keeps real time: with injected time, or when charging
        // slot by slot (refunds can undo a refusal), only if asked for.
        let cache = match self.cache {
            Some(0) => None,
            Some(n) => Some(n),
            None if split || matches!(self.time, TimeSource::Injected(_)) => None,
            None => Some(DEFAULT_OVER_LIMIT_CACHE),
        };
        Ok(RedisStore {
            inner: Arc::new(Inner {
                conn,
                script: script::script(),
                one_bucket: script::one_bucket_script(),
                scripts: ScriptCounters::default(),
                prefix: self.prefix,
                timeout: self.timeout,
                connect_timeout: self.connect_timeout,
                time: self.time,
                split,
                cache: cache.map(|n| OverLimitCache::new(n, self.timeout)),
            }),
        })
    }
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
struct ScriptCounters {
    one_bucket_calls: AtomicU64,
    handed_over: AtomicU64,
}

/// A [`Store`] backed by Redis. Cloning shares the connection.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Conn,
    script: redis::Script,
    /// The common call's script, which hands anything else to `script`.
    one_bucket: redis::Script,
    scripts: ScriptCounters,
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    time: TimeSource,
    split: bool,
    cache: Option<OverLimitCache>,
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
    /// A builder for a single Redis server at `url` (`redis://host:port/db`
    /// or `redis+unix:///path`).
    pub fn builder(url: &str) -> Result<RedisStoreBuilder, StoreError> {
        #[cfg(feature = "tls")]
        install_crypto_provider();
        let client = redis::Client::open(url).map_err(|e| {
            let hint = if url.starts_with("rediss://") && !cfg!(feature = "tls") {
                " (rediss:// needs the `tls` feature)"
            } else {
                ""
            };
            StoreError::new(
                StoreErrorKind::Config,
                format!("invalid Redis URL {:?}{hint}", redact_url(url)),
            )
            .with_source(e)
        })?;
        Ok(RedisStoreBuilder {
            urls: vec![url.to_owned()],
            ..Self::builder_for(Target::Single(client))
        })
    }

    /// A builder for a Redis Cluster reachable through `nodes`.
    pub fn cluster_builder(nodes: &[&str]) -> Result<RedisStoreBuilder, StoreError> {
        // No resends by redis-rs: after a dropped connection it would send
        // the script again, and a charge whose reply was lost would be
        // applied twice (a refund, minted twice). `invoke` resends itself,
        // and only what Redis certainly did not run.
        let client = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .retries(0)
            .build()
            .map_err(|e| {
                StoreError::new(StoreErrorKind::Config, "invalid Redis Cluster nodes")
                    .with_source(e)
            })?;
        Ok(RedisStoreBuilder {
            urls: nodes.iter().map(|n| (*n).to_owned()).collect(),
            ..Self::builder_for(Target::Cluster(client))
        })
    }

    /// A builder for a store on a connection your application already
    /// has. Set the manager's response timeout no longer than the store's
    /// [`timeout`](RedisStoreBuilder::timeout); the store never resends a
    /// script itself, and a connection manager does not either.
    pub fn with_connection_manager(manager: ConnectionManager) -> RedisStoreBuilder {
        Self::builder_for(Target::Manager(manager))
    }

    /// A builder for a store on a cluster connection your application
    /// already has. **Build it with `ClusterClient::builder(..).retries(0)`**:
    /// with redis-rs's default retries, a script whose reply was lost would
    /// be sent again and a charge applied twice (tollgate cannot see a
    /// connection's retry setting). Charges whose keys span slots are
    /// charged slot by slot, as with [`RedisStore::cluster_builder`].
    pub fn with_cluster_connection(conn: ClusterConnection) -> RedisStoreBuilder {
        Self::builder_for(Target::ClusterConnection(conn))
    }

    /// The Lua source of the decision script, for operators who pre-load
    /// it (`SCRIPT LOAD`) or audit it. The store loads it itself when Redis
    /// answers `NOSCRIPT`.
    pub fn script_source() -> &'static str {
        script::SOURCE
    }

    /// A builder for the master of the Sentinel-monitored group `master`,
    /// found through any of `sentinels` (`redis://host:port` URLs of
    /// sentinels). After a failover the store finds the new master by
    /// itself: it asks the sentinels where the master is every
    /// [`sentinel_check_every`](RedisStoreBuilder::sentinel_check_every)
    /// (1 s by default) in the background and switches when it moved, and
    /// a call that fails because the master went away or became a replica
    /// (`READONLY`) gets the configured store-failure outcome, and the
    /// next call asks the sentinels again. What a failover can lose, see
    /// the README.
    pub fn sentinel_builder(
        sentinels: &[&str],
        master: &str,
    ) -> Result<RedisStoreBuilder, StoreError> {
        Self::sentinel_target(sentinels, master, None)
    }

    /// As [`RedisStore::sentinel_builder`], for a master (and replicas)
    /// that require a password (`requirepass`, or an ACL user when
    /// `username` is given). A password for the sentinels themselves goes
    /// in their URLs (`redis://:pw@sentinel:26379`). Masters reached over
    /// TLS through Sentinel are not supported.
    pub fn sentinel_builder_with_auth(
        sentinels: &[&str],
        master: &str,
        username: Option<&str>,
        password: &str,
    ) -> Result<RedisStoreBuilder, StoreError> {
        let mut info = redis::RedisConnectionInfo::default().set_password(password);
        if let Some(user) = username {
            info = info.set_username(user);
        }
        let node =
            redis::sentinel::SentinelNodeConnectionInfo::default().set_redis_connection_info(info);
        Self::sentinel_target(sentinels, master, Some(node))
    }

    fn sentinel_target(
        sentinels: &[&str],
        master: &str,
        node: Option<redis::sentinel::SentinelNodeConnectionInfo>,
    ) -> Result<RedisStoreBuilder, StoreError> {
        // A `String`: redis-rs takes one without TLS, any `AsRef<str>` with.
        let name = String::from(master);
        let client = redis::sentinel::SentinelClient::build(
            sentinels.to_vec(),
            name,
            node,
            redis::sentinel::SentinelServerType::Master,
        )
        .map_err(|e| {
            StoreError::new(StoreErrorKind::Config, "invalid Redis Sentinel nodes").with_source(e)
        })?;
        Ok(Self::builder_for(Target::Sentinel(
            client,
            master.to_owned(),
        )))
    }

    /// The SHA-1 the store calls the script by (`EVALSHA`).
    pub fn script_sha() -> String {
        script::script().get_hash().to_owned()
    }

    /// The Lua source of the one-bucket script: the store's most common
    /// call (one token-bucket charge, unshaped, of a bucket that starts
    /// full) decided with a fraction of the [decision
    /// script](RedisStore::script_source)'s work, on the same keys and
    /// values; it hands whatever else the key's state needs (another
    /// policy's numbers, an earlier format) to the decision script. Pre-load
    /// both, or neither: the store loads each after `NOSCRIPT`.
    pub fn one_bucket_script_source() -> &'static str {
        script::ONE_BUCKET_SOURCE
    }

    /// The SHA-1 the store calls the one-bucket script by.
    pub fn one_bucket_script_sha() -> String {
        script::one_bucket_script().get_hash().to_owned()
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

    fn builder_for(target: Target) -> RedisStoreBuilder {
        RedisStoreBuilder {
            target,
            urls: Vec::new(),
            #[cfg(feature = "tls")]
            tls: None,
            prefix: "tollgate".to_owned(),
            timeout: Duration::from_millis(200),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            time: TimeSource::Server,
            split: false,
            cache: None,
            sentinel_check: DEFAULT_SENTINEL_CHECK,
        }
    }

    /// Connects now, within the [connect
    /// timeout](RedisStoreBuilder::connect_timeout), and loads the
    /// decision, one-bucket and lease scripts, so that the first requests
    /// are answered like every later one (a store built with
    /// [`build`](RedisStoreBuilder::build) connects on its first call
    /// otherwise, within that call's 200 ms, TCP, TLS handshake and `AUTH`
    /// included). Call it before serving; an error says why Redis cannot
    /// be used (refused, a TLS certificate not trusted, `NOAUTH`, no such
    /// master), and the store still works, connecting in the background,
    /// once Redis answers.
    ///
    /// For a cluster, connects to the cluster (the scripts are loaded on
    /// each node when it first answers `NOSCRIPT`).
    pub async fn connect(&self) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let work = async {
            match &inner.conn {
                Conn::Single(manager) => load_scripts(&mut manager.clone()).await,
                Conn::Sentinel(sentinel) => load_scripts(&mut sentinel.master().await?).await,
                Conn::Cluster(cluster) => {
                    let conn = cluster
                        .conn
                        .get_or_try_init(|| async {
                            match &cluster.client {
                                Some(client) => client.get_async_connection().await,
                                None => Err(redis::RedisError::from((
                                    redis::ErrorKind::Io,
                                    "the given cluster connection is gone",
                                ))),
                            }
                        })
                        .await?;
                    redis::cmd("PING")
                        .query_async::<()>(&mut conn.clone())
                        .await
                }
            }
        };
        match tokio::time::timeout(inner.connect_timeout, work).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::new(
                classify(e.clone()).kind(),
                "connecting to Redis failed",
            )
            .with_source(e)),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!(
                    "could not connect to Redis within {:?} (the connect timeout)",
                    inner.connect_timeout
                ),
            )),
        }
    }

    /// The Redis key that holds `charge`'s state.
    pub fn redis_key(&self, charge: &Charge) -> String {
        script::redis_key(&self.inner.prefix, charge)
    }

    /// Counters of the over-limit cache (zero if it is off).
    pub fn cache_stats(&self) -> CacheStats {
        self.inner
            .cache
            .as_ref()
            .map(OverLimitCache::stats)
            .unwrap_or_default()
    }

    /// Runs the script for `prepared` in `mode`, answering by `deadline`.
    async fn invoke(
        &self,
        prepared: &Prepared,
        mode: Mode,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<i64>, StoreError> {
        let inner = &*self.inner;
        let now = match &inner.time {
            TimeSource::Server => None,
            TimeSource::Injected(f) => Some(f()),
        };
        let invocation = prepared.invocation(&inner.script, now, mode);
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

    /// When a call started now must be answered.
    pub(crate) fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.inner.timeout
    }

    /// Runs a script on the connection (finding a Sentinel master again
    /// when it may have moved; in a cluster, following `ASK` with `eval`,
    /// the same call as a plain `EVAL`, and sending again what Redis
    /// certainly did not run), answered by `deadline`.
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        eval: impl Fn() -> redis::Cmd,
        deadline: tokio::time::Instant,
    ) -> Result<T, StoreError> {
        let inner = &*self.inner;
        let call = async {
            match &inner.conn {
                Conn::Single(manager) => {
                    let mut c = manager.clone();
                    invocation.invoke_async::<T>(&mut c).await
                }
                Conn::Sentinel(sentinel) => {
                    let result = match sentinel.master().await {
                        Ok(mut c) => invocation.invoke_async::<T>(&mut c).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = &result
                        && master_may_have_moved(e)
                    {
                        sentinel.lost().await;
                    }
                    result
                }
                Conn::Cluster(cluster) => {
                    let c = cluster
                        .conn
                        .get_or_try_init(|| async {
                            match &cluster.client {
                                Some(client) => client.get_async_connection().await,
                                None => Err(redis::RedisError::from((
                                    redis::ErrorKind::Io,
                                    "the given cluster connection is gone",
                                ))),
                            }
                        })
                        .await?;
                    let mut attempt = 0;
                    let mut result = invocation.invoke_async::<T>(&mut c.clone()).await;
                    loop {
                        match result {
                            Err(e) if attempt < 3 && not_run(&e) => {
                                attempt += 1;
                                result = match e.kind() {
                                    // The key has moved to the node importing
                                    // its slot: ask that node directly.
                                    redis::ErrorKind::Server(redis::ServerErrorKind::Ask) => {
                                        ask(&mut c.clone(), &e, eval()).await
                                    }
                                    // Refused before running (the slot moved,
                                    // the cluster is re-forming): safe to
                                    // send again once redis-rs has refreshed
                                    // its slot map.
                                    _ => {
                                        tokio::time::sleep(Duration::from_millis(10 << attempt))
                                            .await;
                                        invocation.invoke_async::<T>(&mut c.clone()).await
                                    }
                                };
                            }
                            result => break result,
                        }
                    }
                }
            }
        };
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(classify(e)),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Uncertain,
                format!(
                    "no answer from Redis within {:?}; the call may have been applied",
                    inner.timeout
                ),
            )),
        }
    }

    /// The answer that needs no round trip, if there is one: a charge that
    /// can never fit (nothing is read or written), or a refusal the
    /// over-limit cache still holds. Also gives back the Redis keys.
    /// `asking`: the caller asks Redis when this answers nothing, so it may
    /// take the probe of a bucket whose deadline has passed.
    fn local_answer(&self, charges: &[Charge], asking: bool) -> (Option<Outcome>, Vec<String>) {
        if let Some(outcome) = Outcome::never_fits(charges) {
            return (Some(outcome), Vec::new());
        }
        let keys: Vec<String> = charges.iter().map(|c| self.redis_key(c)).collect();
        // A remembered denial says when the cost fits, not whether a
        // shaped charge would wait for it: shaped calls always ask Redis.
        let shaped = charges.iter().any(|c| c.max_delay().is_some());
        let cached = match &self.inner.cache {
            Some(cache) if !shaped => cache.refuse(&keys, charges, asking),
            _ => None,
        };
        (cached, keys)
    }

    async fn charge_all(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        let keys = match self.local_answer(charges, true) {
            (Some(outcome), _) => return Ok(outcome),
            (None, keys) => keys,
        };
        // One time limit for the whole decision, however many slot groups
        // it takes (and refunds and reads after a refusal).
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        let groups = if self.inner.split {
            script::slot_groups(&keys)
        } else {
            vec![(0..charges.len()).collect()]
        };
        // Every group is encoded before the first is sent: a policy Redis
        // cannot hold must refuse the whole call, not a later group after
        // earlier ones were charged.
        let prepared: Vec<Prepared> = groups
            .iter()
            .map(|group| Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i]))))
            .collect::<Result<_, _>>()?;
        // Shaping needs one atomic decision: a call spread over slots is
        // decided unshaped. Refundable charges are reserved either way.
        let shaping = prepared.len() == 1;
        let prepared: Vec<Prepared> = groups
            .iter()
            .zip(prepared)
            .map(|(group, p)| p.shaping(group.iter().map(|&i| &charges[i]), shaping))
            .collect();
        // Refundable charges get a receipt: where each was counted.
        let refundable = charges.iter().any(Charge::is_refundable);
        if let [one] = &prepared[..]
            && one.is_one_bucket()
            && let Some(outcome) = self
                .charge_one_bucket(one, &keys[0], &charges[0], deadline)
                .await?
        {
            // (Refundable charges are reserved: never this script.)
            return Ok(outcome);
        }
        let mut decisions = vec![Decision::Unevaluated; charges.len()];
        let mut before = vec![Decision::Unevaluated; charges.len()];
        let mut windows = vec![0; charges.len()];
        let mut admitted: Vec<(Prepared, Vec<i64>)> = Vec::new();
        let mut groups = groups.into_iter().zip(prepared);
        while let Some((group, prepared)) = groups.next() {
            let sent = Instant::now();
            let reply = match self.invoke(&prepared, Mode::Charge, deadline).await {
                Ok(reply) => reply,
                Err(e) => {
                    self.refund(admitted, deadline).await;
                    return Err(e);
                }
            };
            let mut all = true;
            for (slot, &i) in group.iter().enumerate() {
                let values = &reply[slot * script::REPLY..(slot + 1) * script::REPLY];
                let (d, b) = script::decision(values, charges[i].policy());
                // A key charged again in the same call was decided against
                // the earlier charge's unwritten effect: that refusal is not
                // what Redis would answer for the charge alone, so only a
                // key's first charge is remembered.
                let first = !keys[..i].contains(&keys[i]);
                // With slots charged one by one, another call's charge may be
                // refunded a moment after this refusal saw it: a refusal is
                // then not a lasting fact, and is not remembered.
                let shaped = charges[i].max_delay().is_some();
                if let (Some(cache), true, false, false) =
                    (&self.inner.cache, first, self.inner.split, shaped)
                {
                    cache.remember(&keys[i], &charges[i], sent, d);
                }
                all &= d.is_admitted();
                decisions[i] = d;
                before[i] = b;
                windows[i] = match charges[i].is_refundable() {
                    true => script::window(values),
                    false => Receipt::NOTHING,
                };
            }
            if shaping {
                let reserved: Vec<(usize, (Duration, State))> = group
                    .iter()
                    .enumerate()
                    .filter_map(|(slot, &i)| {
                        let values = &reply[slot * script::REPLY..(slot + 1) * script::REPLY];
                        script::reserved(values).map(|r| (i, r))
                    })
                    .collect();
                if let Some(&(_, (delay, _))) = reserved.first() {
                    // The replaced states follow every charge's values, in
                    // the same order.
                    let tail = reply[group.len() * script::REPLY..].chunks(script::REPLACED);
                    let entries = reserved
                        .into_iter()
                        .zip(tail.map(script::replaced).chain(std::iter::repeat(None)))
                        .map(|((index, (_, written)), before)| Reserved {
                            index,
                            written,
                            before,
                        })
                        .collect();
                    let outcome = Outcome::delayed(decisions, delay, Reservation::new(entries));
                    // Refundable charges (never shaped) are reserved in a
                    // delayed call as in any other.
                    if refundable {
                        return Ok(outcome.with_receipt(Receipt::new(windows)));
                    }
                    return Ok(outcome);
                }
            }
            if all {
                // Admitted: a bucket left without room for the same cost
                // again is known exhausted until it has it (not charging
                // slot by slot, where a refund could add credit back).
                if let (Some(cache), false) = (&self.inner.cache, self.inner.split) {
                    let answered = Instant::now();
                    for &i in &group {
                        if !keys[..i].contains(&keys[i]) && charges[i].max_delay().is_none() {
                            cache.remember_spent(&keys[i], &charges[i], answered, decisions[i]);
                        }
                    }
                }
                admitted.push((prepared, reply));
            } else {
                self.refund(admitted, deadline).await;
                // The slots not charged yet are read without writing, so
                // that every limit is described as in a single script.
                for (group, prepared) in groups {
                    let Ok(reply) = self.invoke(&prepared, Mode::Check, deadline).await else {
                        continue;
                    };
                    for (slot, &i) in group.iter().enumerate() {
                        let values = &reply[slot * script::REPLY..(slot + 1) * script::REPLY];
                        (decisions[i], before[i]) = script::decision(values, charges[i].policy());
                    }
                }
                // Refused as a whole: nothing was spent, and the limits that
                // would have admitted are described as they stand.
                for (d, b) in decisions.iter_mut().zip(before) {
                    if d.is_admitted() {
                        *d = b;
                    }
                }
                return Ok(Outcome::new(decisions));
            }
        }
        let outcome = Outcome::new(decisions);
        if refundable {
            return Ok(outcome.with_receipt(Receipt::new(windows)));
        }
        Ok(outcome)
    }

    /// The common call decided by the one-bucket script; `None` when it
    /// handed the call to the full script (having written nothing).
    async fn charge_one_bucket(
        &self,
        prepared: &Prepared,
        key: &str,
        charge: &Charge,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Outcome>, StoreError> {
        let inner = &*self.inner;
        let now = match &inner.time {
            TimeSource::Server => None,
            TimeSource::Injected(f) => Some(f()),
        };
        let invocation = prepared.one_bucket_invocation(&inner.one_bucket, now);
        inner
            .scripts
            .one_bucket_calls
            .fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let reply: Vec<u8> = self
            .run(&invocation, || prepared.one_bucket_eval(now), deadline)
            .await?;
        let Some(decision) = script::one_bucket_decision(&reply, charge.policy())? else {
            inner.scripts.handed_over.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        };
        // As `charge_all` remembers a single unshaped charge (not when
        // charging slot by slot: a refund could undo what it saw).
        if let (Some(cache), false, false) = (&inner.cache, inner.split, charge.is_refundable()) {
            if decision.is_admitted() {
                cache.remember_spent(key, charge, Instant::now(), decision);
            } else {
                cache.remember(key, charge, sent, decision);
            }
        }
        Ok(Some(Outcome::new(vec![decision])))
    }

    /// What `charge_all` would answer now, read with the script's `check`
    /// mode: nothing is written. Slot groups are read one by one (there is
    /// nothing to keep atomic).
    async fn check_all(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        if let Some(outcome) = Outcome::never_fits(charges) {
            return Ok(outcome);
        }
        let keys: Vec<String> = charges.iter().map(|c| self.redis_key(c)).collect();
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        let groups = if self.inner.split {
            script::slot_groups(&keys)
        } else {
            vec![(0..charges.len()).collect()]
        };
        let mut decisions = vec![Decision::Unevaluated; charges.len()];
        let mut before = vec![Decision::Unevaluated; charges.len()];
        for group in groups {
            let prepared = Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i])))?;
            let reply = self.invoke(&prepared, Mode::Check, deadline).await?;
            for (slot, &i) in group.iter().enumerate() {
                let values = &reply[slot * script::REPLY..(slot + 1) * script::REPLY];
                (decisions[i], before[i]) = script::decision(values, charges[i].policy());
            }
        }
        if !decisions.iter().all(Decision::is_admitted) {
            for (d, b) in decisions.iter_mut().zip(before) {
                if d.is_admitted() {
                    *d = b;
                }
            }
        }
        Ok(Outcome::new(decisions))
    }

    /// Gives back admissions of earlier slot groups after a later refusal.
    /// Refunds not started by `deadline` are sent in the background, so
    /// that the decision keeps its time limit; one that times out is not
    /// sent again (it may have been applied: a second would mint credit).
    async fn refund(&self, admitted: Vec<(Prepared, Vec<i64>)>, deadline: tokio::time::Instant) {
        let mut pending = admitted.into_iter();
        for (prepared, reply) in pending.by_ref() {
            if tokio::time::Instant::now() >= deadline {
                let rest: Vec<_> = std::iter::once((prepared, reply)).chain(pending).collect();
                let store = self.clone();
                tokio::spawn(async move {
                    for (prepared, reply) in rest {
                        let late = tokio::time::Instant::now() + store.inner.timeout;
                        store.refund_one(prepared, &reply, late).await;
                    }
                });
                return;
            }
            self.refund_one(prepared, &reply, deadline).await;
        }
    }

    async fn refund_one(&self, prepared: Prepared, reply: &[i64], deadline: tokio::time::Instant) {
        let refund = prepared.with_windows(reply);
        if let Err(e) = self.invoke(&refund, Mode::Undo, deadline).await {
            // The budget stays spent: conservative, never over-admits.
            tracing::warn!(error = %e, "refund after a cross-slot refusal failed");
        }
    }
}

/// Loads every script the store calls (`SCRIPT LOAD`), which also makes
/// the connection.
async fn load_scripts(conn: &mut impl redis::aio::ConnectionLike) -> redis::RedisResult<()> {
    for source in [script::SOURCE, script::ONE_BUCKET_SOURCE, leases::SOURCE] {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query_async::<String>(conn)
            .await?;
    }
    Ok(())
}

/// Sends the script to the node an `ASK` redirection names, after
/// `ASKING`, as the cluster protocol asks during a slot migration. The
/// script travels whole (`EVAL`): the importing node may not have loaded it.
async fn ask<T: redis::FromRedisValue>(
    conn: &mut ClusterConnection,
    redirect: &redis::RedisError,
    eval: redis::Cmd,
) -> redis::RedisResult<T> {
    let Some((host, port)) = redirect
        .redirect_node()
        .and_then(|(addr, _)| addr.rsplit_once(':'))
        .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
    else {
        return Err(redis::RedisError::from((
            redis::ErrorKind::Client,
            "ASK redirection without a node address",
        )));
    };
    let mut pipe = redis::pipe();
    pipe.cmd("ASKING").ignore();
    pipe.add_command(eval);
    let route = redis::cluster_routing::SingleNodeRoutingInfo::ByAddress { host, port };
    let mut values = conn.route_pipeline(pipe, 1, 1, route).await?;
    Ok(redis::from_redis_value(
        values.pop().unwrap_or(redis::Value::Nil),
    )?)
}

/// Whether Redis certainly did not run the command: it refused it for where
/// the slot lives or for the cluster's state, or no connection was made.
fn not_run(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as S;
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                S::Moved | S::Ask | S::TryAgain | S::ClusterDown | S::MasterDown
            )
        )
}

/// Maps a redis-rs error to unavailable (nothing was applied) or uncertain
/// (it may have been).
fn classify(e: redis::RedisError) -> StoreError {
    // Refused at connection set-up (TLS, a wrong password, a sentinel that
    // knows no such master): no command was sent.
    let setup = matches!(
        e.kind(),
        redis::ErrorKind::AuthenticationFailed
            | redis::ErrorKind::MasterNameNotFoundBySentinel
            | redis::ErrorKind::EmptySentinelList
            | redis::ErrorKind::InvalidClientConfig
    );
    let kind = if e.is_connection_refusal() || tls_refused(&e) || setup {
        StoreErrorKind::Unavailable
    } else if e.is_timeout() || e.is_connection_dropped() || e.is_io_error() {
        StoreErrorKind::Uncertain
    } else if matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    ) {
        // The server refused the command (OOM, BUSY, ...). The script is
        // declared with `#!lua`, so Redis checks memory before it runs, and
        // its writes all come last: nothing was applied.
        StoreErrorKind::Unavailable
    } else if matches!(
        e.kind(),
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType
    ) {
        StoreErrorKind::Protocol
    } else {
        StoreErrorKind::Uncertain
    };
    StoreError::new(kind, "Redis call failed").with_source(e)
}

/// Whether a failure says the master may be elsewhere now: it is gone,
/// unreachable, or a replica (`READONLY`).
fn master_may_have_moved(e: &redis::RedisError) -> bool {
    e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_io_error()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
        )
}

/// Whether `e` is a TLS failure (a certificate not trusted, expired, for
/// another name): TLS is set up before any command is sent, so nothing
/// was applied.
#[cfg(feature = "tls")]
fn tls_refused(e: &redis::RedisError) -> bool {
    type Shared = Arc<dyn std::error::Error + Send + Sync>;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        // redis-rs keeps I/O errors behind an `Arc`; rustls's error is the
        // custom error inside the `io::Error`.
        let io = s.downcast_ref::<std::io::Error>().or_else(|| {
            s.downcast_ref::<Shared>()
                .and_then(|shared| shared.downcast_ref::<std::io::Error>())
        });
        let tls = io
            .and_then(std::io::Error::get_ref)
            .is_some_and(|inner| inner.is::<rustls::Error>());
        if tls || s.is::<rustls::Error>() {
            return true;
        }
        source = s.source();
    }
    false
}

#[cfg(not(feature = "tls"))]
fn tls_refused(_: &redis::RedisError) -> bool {
    false
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

    /// Settles refundable charges: one `refund` or `confirm` script per
    /// slot group; a refund also forgets what the over-limit cache
    /// remembered of them.
    fn can_refund(&self) -> bool {
        true
    }

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

impl RedisStore {
    /// [`Store::refund`] and [`Store::confirm`] (`mode`): one script per
    /// slot group. A group that fails leaves its charges reserved, to
    /// lapse as confirmed (never more given back than was charged); the
    /// first error is answered after every group was tried.
    async fn settle(
        &self,
        charges: &[Charge],
        receipt: &Receipt,
        mode: Mode,
    ) -> Result<(), StoreError> {
        // (Entries of charges that were not refundable settle nothing.)
        let (charges, windows): (Vec<Charge>, Vec<Nanos>) = charges
            .iter()
            .zip(receipt.windows())
            .filter(|(_, w)| **w != Receipt::NOTHING)
            .map(|(c, w)| (c.clone(), *w))
            .unzip();
        let n = charges.len();
        if n == 0 {
            return Ok(());
        }
        let keys: Vec<String> = charges.iter().map(|c| self.redis_key(c)).collect();
        if let (Some(cache), Mode::Refund) = (&self.inner.cache, mode) {
            for (key, charge) in keys.iter().zip(&charges) {
                cache.forget(key, charge);
            }
        }
        let groups = if self.inner.split {
            script::slot_groups(&keys)
        } else {
            vec![(0..n).collect()]
        };
        let deadline = self.deadline();
        let mut first_error = None;
        for group in groups {
            let prepared = Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i])))?;
            let windows: Vec<Nanos> = group.iter().map(|&i| windows[i]).collect();
            let settle = prepared.with_receipt(&windows);
            if let Err(e) = self.invoke(&settle, mode, deadline).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// [`Store::cancel`]: one `cancel` script for the reservation's
    /// charges.
    async fn cancel_reserved(
        &self,
        charges: &[Charge],
        reservation: &Reservation,
    ) -> Result<(), StoreError> {
        let keys: Vec<String> = reservation
            .entries()
            .iter()
            .filter_map(|r| charges.get(r.index).map(|c| self.redis_key(c)))
            .collect();
        let items = reservation
            .entries()
            .iter()
            .filter_map(|r| charges.get(r.index).map(|c| (c, *r)))
            .zip(&keys)
            .map(|((c, r), k)| (k, c, r));
        let prepared = Prepared::cancel(items)?;
        if prepared.len() == 0 {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + self.inner.timeout;
        self.invoke(&prepared, Mode::Cancel, deadline)
            .await
            .map(|_| ())
    }
}
