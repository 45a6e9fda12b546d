//! [`RedisStoreBuilder`]: where the store connects (a server, a cluster, a
//! connection you made, a Sentinel-monitored master), with which TLS
//! certificates, and its settings; and `RedisStore`'s constructors.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tollgate_budget::{Nanos, StoreError, StoreErrorKind};

use crate::cache::OverLimitCache;
use crate::connection::{ClusterConn, Conn};
use crate::lua;
use crate::redact::redact_url;
use crate::sentinel::{DEFAULT_SENTINEL_CHECK, SentinelConn};
use crate::store::{Inner, RedisStore, ScriptCounters, TimeSource};

/// rustls needs one process-wide crypto provider: ring, unless the
/// application installed another first.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Denials the over-limit cache remembers unless told otherwise
/// ([`RedisStoreBuilder::over_limit_cache`]).
pub const DEFAULT_OVER_LIMIT_CACHE: usize = 65_536;

/// How long [`RedisStore::connect`] (and each connection the store makes)
/// may take unless told otherwise
/// ([`RedisStoreBuilder::connect_timeout`]): 2 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

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
        let pubsub = match &target {
            Target::Single(client) => Some(client.clone()),
            _ => None,
        };
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
                script: lua::decide_script(),
                one_bucket: lua::one_bucket_script(),
                scripts: ScriptCounters::default(),
                prefix: self.prefix,
                timeout: self.timeout,
                connect_timeout: self.connect_timeout,
                time: self.time,
                split,
                cache: cache.map(|n| OverLimitCache::new(n, self.timeout)),
                pubsub,
            }),
        })
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
}
