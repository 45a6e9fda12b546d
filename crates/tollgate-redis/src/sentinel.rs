//! The master of a Sentinel-monitored group: found through the sentinels,
//! and found again when it moves.
//!
//! A call that fails in a way that says the master moved (connection lost,
//! `READONLY`) forgets it. That alone is not enough: during a failover the
//! demoted master keeps accepting writes until Sentinel reconfigures it (a
//! few seconds), and writes sent to it then are lost when it becomes a
//! replica, while other instances already write to the new master. So the
//! sentinels are also asked for the master's address periodically, in the
//! background: at most one check in flight, started by a call when the
//! last one is older than the interval, so no call waits for it. A master
//! at another address is connected to (and checked to be a master by
//! redis-rs) before calls switch to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::sentinel::SentinelClient;

/// How often the sentinels are asked where the master is unless told
/// otherwise ([`RedisStoreBuilder::sentinel_check_every`]).
///
/// [`RedisStoreBuilder::sentinel_check_every`]: crate::RedisStoreBuilder::sentinel_check_every
pub const DEFAULT_SENTINEL_CHECK: Duration = Duration::from_secs(1);

/// The master in use and where it is.
#[derive(Clone)]
struct Master {
    manager: ConnectionManager,
    /// `(host, port)` as the sentinels name it; `None` for an address
    /// without a port (never compared equal: a check then switches).
    addr: Option<(String, u16)>,
}

pub(crate) struct SentinelConn {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    /// The group's name, as the sentinels know it.
    name: String,
    /// The master last found; cleared when a call fails in a way that says
    /// it may have moved. Held across a discovery, so that calls waiting
    /// for a master wait for that one rather than each starting another.
    master: tokio::sync::Mutex<Option<Master>>,
    config: redis::aio::ConnectionManagerConfig,
    timeout: Duration,
    /// How often the sentinels are asked where the master is.
    check_every: Duration,
    /// A connection to a sentinel for the periodic check, kept between
    /// checks (one round trip each) and remade after a failure.
    watch: tokio::sync::Mutex<Option<MultiplexedConnection>>,
    /// When the last check started, in ns since `origin`.
    checked: AtomicU64,
    /// Whether a check is in flight: at most one is.
    checking: AtomicBool,
    origin: Instant,
}

/// `(host, port)` of a TCP address.
fn host_port(info: &redis::ConnectionInfo) -> Option<(String, u16)> {
    match info.addr() {
        redis::ConnectionAddr::Tcp(host, port) => Some((host.clone(), *port)),
        redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
        _ => None,
    }
}

impl SentinelConn {
    pub(crate) fn new(
        sentinel: SentinelClient,
        name: String,
        config: redis::aio::ConnectionManagerConfig,
        timeout: Duration,
        check_every: Duration,
    ) -> Self {
        Self {
            sentinel: tokio::sync::Mutex::new(sentinel),
            name,
            master: tokio::sync::Mutex::new(None),
            config,
            timeout,
            check_every,
            watch: tokio::sync::Mutex::new(None),
            checked: AtomicU64::new(0),
            checking: AtomicBool::new(false),
            origin: Instant::now(),
        }
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The master's connection, asking the sentinels when there is none;
    /// starts a background check of where the master is when one is due.
    pub(crate) async fn master(self: &Arc<Self>) -> redis::RedisResult<ConnectionManager> {
        let mut master = self.master.lock().await;
        if let Some(m) = &*master {
            let manager = m.manager.clone();
            drop(master);
            self.check_if_due();
            return Ok(manager);
        }
        let found = self.discover().await?;
        *master = Some(found.clone());
        // Just found: the next check is one interval from now.
        self.checked.store(self.now_ns(), Ordering::Relaxed);
        Ok(found.manager)
    }

    /// Forgets the master's connection: the next call asks the sentinels.
    pub(crate) async fn lost(&self) {
        *self.master.lock().await = None;
    }

    /// Asks the sentinels for the master and connects to it.
    async fn discover(&self) -> redis::RedisResult<Master> {
        let client = self.sentinel.lock().await.async_get_client().await?;
        let addr = host_port(client.get_connection_info());
        let manager = ConnectionManager::new_with_config(client, self.config.clone()).await?;
        Ok(Master { manager, addr })
    }

    /// Starts a check on a spawned task if the last one is older than the
    /// interval and none is in flight.
    fn check_if_due(self: &Arc<Self>) {
        let now = self.now_ns();
        let every = u64::try_from(self.check_every.as_nanos()).unwrap_or(u64::MAX);
        if now.saturating_sub(self.checked.load(Ordering::Relaxed)) < every {
            return;
        }
        if self
            .checking
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        self.checked.store(now, Ordering::Relaxed);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.checking.store(false, Ordering::Release);
            return;
        };
        let this = self.clone();
        runtime.spawn(async move {
            // Bounded: a sentinel that does not answer must not stop the
            // checks for good.
            let bound = this.timeout.saturating_mul(4).max(Duration::from_secs(1));
            if let Err(e) = tokio::time::timeout(bound, this.check())
                .await
                .unwrap_or_else(|_| {
                    Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no answer from the sentinels in time",
                    )))
                })
            {
                tracing::debug!(error = %e, "checking the Sentinel master's address failed");
            }
            this.checking.store(false, Ordering::Release);
        });
    }

    /// Asks a sentinel where the master is, and switches to it if it is
    /// not where the calls go now.
    async fn check(&self) -> redis::RedisResult<()> {
        let said = match self.sentinel_says().await {
            Ok(said) => said,
            Err(e) => {
                // Remade at the next check (another sentinel may answer).
                *self.watch.lock().await = None;
                return Err(e);
            }
        };
        let current = self.master.lock().await.as_ref().map(|m| m.addr.clone());
        match current {
            // None: the next call finds the master itself.
            None => return Ok(()),
            Some(Some(addr)) if Some(&addr) == said.as_ref() => return Ok(()),
            Some(_) => {}
        }
        let found = self.discover().await?;
        let mut master = self.master.lock().await;
        tracing::info!(
            master = %self.name,
            from = ?master.as_ref().and_then(|m| m.addr.clone()),
            to = ?found.addr,
            "the Sentinel master moved; calls go to the new one"
        );
        *master = Some(found);
        Ok(())
    }

    /// The master's `(host, port)` as a sentinel says now.
    async fn sentinel_says(&self) -> redis::RedisResult<Option<(String, u16)>> {
        let mut watch = self.watch.lock().await;
        let conn = match &mut *watch {
            Some(conn) => conn,
            None => {
                let client = self
                    .sentinel
                    .lock()
                    .await
                    .async_get_sentinel_client()
                    .await?;
                let config = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(self.timeout))
                    .set_response_timeout(Some(self.timeout));
                watch.insert(
                    client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await?,
                )
            }
        };
        let reply: Option<(String, String)> = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.name)
            .query_async(conn)
            .await?;
        Ok(reply.and_then(|(host, port)| Some((host, port.parse().ok()?))))
    }
}
