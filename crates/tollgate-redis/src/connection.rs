//! The store's connection (a server, a cluster, a Sentinel-monitored
//! master), and running a script on it: within a deadline, following a
//! cluster's `ASK`, sending again only what Redis certainly did not run,
//! and telling failures that spent nothing from those that may have.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;
use tollgate_budget::{StoreError, StoreErrorKind};

use crate::lua;
use crate::sentinel::SentinelConn;

/// Where the store's calls go.
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(Box<ClusterConn>),
    Sentinel(Arc<SentinelConn>),
}

/// A cluster connection, made on first use (or given).
pub(crate) struct ClusterConn {
    pub(crate) client: Option<redis::cluster::ClusterClient>,
    pub(crate) conn: OnceCell<ClusterConnection>,
}

impl ClusterConn {
    /// The connection, made now if it was not yet.
    async fn connection(&self) -> redis::RedisResult<&ClusterConnection> {
        self.conn
            .get_or_try_init(|| async {
                match &self.client {
                    Some(client) => client.get_async_connection().await,
                    None => Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "the given cluster connection is gone",
                    ))),
                }
            })
            .await
    }
}

impl Conn {
    /// Connects within `connect_timeout` and loads every script (a
    /// cluster: connects and pings; each node loads the scripts when it
    /// first answers `NOSCRIPT`).
    pub(crate) async fn connect(&self, connect_timeout: Duration) -> Result<(), StoreError> {
        let work = async {
            match self {
                Conn::Single(manager) => load_scripts(&mut manager.clone()).await,
                Conn::Sentinel(sentinel) => load_scripts(&mut sentinel.master().await?).await,
                Conn::Cluster(cluster) => {
                    let conn = cluster.connection().await?;
                    redis::cmd("PING")
                        .query_async::<()>(&mut conn.clone())
                        .await
                }
            }
        };
        match tokio::time::timeout(connect_timeout, work).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(StoreError::new(
                classify(e.clone()).kind(),
                "connecting to Redis failed",
            )
            .with_source(e)),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                format!(
                    "could not connect to Redis within {connect_timeout:?} (the connect timeout)"
                ),
            )),
        }
    }

    /// Runs a script (finding a Sentinel master again when it may have
    /// moved; in a cluster, following `ASK` with `eval`, the same call as
    /// a plain `EVAL`, and sending again what Redis certainly did not run),
    /// answered by `deadline`. `timeout` is the store's time limit, for the
    /// error when none came.
    pub(crate) async fn run<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        eval: impl Fn() -> redis::Cmd,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<T, StoreError> {
        let call = async {
            match self {
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
                    let c = cluster.connection().await?;
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
                format!("no answer from Redis within {timeout:?}; the call may have been applied"),
            )),
        }
    }
}

/// Loads every script the store calls (`SCRIPT LOAD`), which also makes
/// the connection.
async fn load_scripts(conn: &mut impl redis::aio::ConnectionLike) -> redis::RedisResult<()> {
    for source in lua::sources() {
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
