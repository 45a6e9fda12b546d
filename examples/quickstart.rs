//! tollgate quickstart: an axum app with per-address, per-account and
//! byte-cost limits on the in-memory store.
//!
//! ```text
//! cargo run --example quickstart                 # serve on 127.0.0.1:3000
//! cargo run --example quickstart -- --demo       # serve, drive a scripted client, exit
//! cargo run --example quickstart -- --addr 127.0.0.1:8080 --trust-proxy 10.0.0.0/8
//! cargo run --example quickstart -- --store redis://127.0.0.1:6379  # share budgets via Redis
//! cargo run --example quickstart -- --store rediss://127.0.0.1:6380 --redis-ca ca.pem  # over TLS
//! cargo run --example quickstart -- --log-refusals warn  # every refusal on stderr
//! ```
//!
//! It speaks HTTP/1.1 and HTTP/2 (cleartext, prior knowledge) on the same
//! port, with the same limits.
//!
//! The contract (other checks rely on it):
//! - every route but `/work`: per client address, token bucket of 5,
//!   refilled 1 per second;
//! - `POST /export` (needs a principal): also per (tenant, account, operation),
//!   3 refilled 2 per second, charged together with the address rule; on
//!   plan `pro` (dave) 10 refilled 5 per second, one budget across plans;
//! - `POST /upload` (needs a principal): cost = body size in KiB (rounded up,
//!   at least 1) per account, 1024 refilled 256 per second; over 1 MiB never fits;
//! - `GET /`: public, the address rule only;
//! - `GET /slow?ms=N` (needs a principal): sleeps N ms (default 1000, at most
//!   10000), then streams a short body; at most 2 in flight per account and 8
//!   in all (429 / 503 beyond), held until the body has been sent (a body
//!   that makes no progress for 5 s, a client that stopped reading, is ended
//!   and its slots released); with
//!   `--store` these limits hold across every quickstart on that Redis
//!   (leases of 2 s: a killed instance's slots are free again within 2 s);
//! - `GET /work?ms=N` (needs a principal): N ms of work (default 100, at
//!   most 10000; else 400) on a simulated backend that serves 16 at full
//!   speed and slows down beyond (processor sharing: each of n requests in
//!   it progresses at 16/max(n,16) of its speed), behind an adaptive
//!   in-flight limit (from 4 to 256, starting at 20) shared fairly between
//!   tenants; a request beyond its tenant's share waits up to 1 s (at most
//!   64 waiting), then 503. Not under the per-address rate rule; like
//!   every route that needs a principal, at most 3 of one address's
//!   requests are in flight on it at once (the `login-failures`
//!   reservation, below), so a flood comes from several addresses. This
//!   process's own limit, with `--store` too; in `--dry-run` a fixed 16,
//!   dry-run;
//! - `POST /login`: 200 when the bearer key is known, 401 otherwise; besides
//!   the address rule, per address `login-failures`: 3, refilled 1 per 20
//!   seconds, reserved when the request is checked and kept only for 401
//!   answers (three wrong keys, then 429 even for a right key; at most 3
//!   logins of one address at once). Every 401 on a route that needs a
//!   principal spends it too, and once it is spent those routes answer
//!   429 to that address, whatever key it sends;
//! - `GET /healthz` (and `HEAD`): exempt from every rule (200 even while
//!   `--store` is down); other methods on it are charged like any request;
//! - `GET /shaped` (needs a principal): also per account a token bucket of 1,
//!   refilled 2 per second, *shaped* up to 2 s with at most 4 waiting per
//!   account: a burst is released 0.5 s apart instead of refused, and what
//!   would wait longer is refused at once with `Retry-After`;
//! - with `--admin-token TOKEN`: `PUT /admin/policies/{rule}` and
//!   `PUT /admin/policies/{rule}/plans/{plan}` (body: one policy as data,
//!   e.g. `{"capacity": 6, "refill": {"per_second": 2}}`, the name from the
//!   path) make it that rule's default policy or its plan's;
//!   `GET /admin/policies` answers `{"version": N, "set": {...},
//!   "mismatched": [...]}` (policies another quickstart on the same Redis
//!   charges under other numbers).
//!   `Authorization: Bearer TOKEN` or 401 (which spends the address's
//!   `login-failures` budget); an unknown rule 404; a bad body 400 naming
//!   the field; Redis failing 503. Charged to the address like any route.
//!   With `--store` the set is the fleet's: published to every quickstart
//!   on that Redis (in force within a second; one started later starts
//!   with it), and followed by every quickstart with `--store`, token or
//!   not; without, this process's;
//! - admitted requests get 200 and a short text body.
//!
//! Flags: `--exempt CIDR` (repeatable) lets clients in those networks skip
//! the per-address rule; `--dry-run` makes every rule and every in-flight
//! limit dry-run (nothing is refused for lack of budget or room; would-be
//! refusals are logged; 401, 411, 413 and 400 are answered as without it);
//! `--log-refusals LEVEL` (`error`, `warn`, `info`, `debug`, `trace`; off by
//! default) logs every refusal of both layers on stderr at that level, as
//! an operator would see it: policy, key shape, key fingerprint, never the
//! key; `--admin-token TOKEN` (at least 8 visible ASCII characters) turns
//! on the admin routes.
//!
//! Demo authentication (a stand-in for real authentication, not a pattern to
//! copy): `Authorization: Bearer KEY` with `alice-key-1` or `alice-key-2` is
//! (north, alice), `bob-key` is (north, bob), `carol-key` is (south, alice),
//! `dave-key` is (north, dave) on plan `pro`. An unknown or missing key on a
//! route that needs a principal gets 401 (with `WWW-Authenticate: Bearer`,
//! as does `/login`'s own 401).

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use http::{StatusCode, Uri};
use http_body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket};
use tollgate::{
    ClientIpResolver, ConcurrencyLimitLayer, Cost, Exemption, KeyPart, MemoryStore, Policy,
    Principal, Rate, RateLimitLayer, RedisStore, Rule,
    concurrency::AdaptiveConfig,
    identity::ForwardedHeader,
    store::{DynStore, LeaseStore},
};
use tower_http::timeout::TimeoutLayer;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// How long `/slow`'s shared in-flight leases last unless renewed.
const SLOW_LEASE: Duration = Duration::from_secs(2);

/// How long a `/slow` response body may make no progress before it is
/// ended and its slots released.
const SLOW_BODY_IDLE: Duration = Duration::from_secs(5);

/// The routes whose 401s spend the address's `login-failures` budget: the
/// login route, and every route that needs a principal.
/// The admin routes' 401s (a wrong token) spend it too.
const GUESSED: [&str; 9] = [
    "/login",
    "/export",
    "/upload",
    "/slow",
    "/shaped",
    "/work",
    "/admin/policies",
    "/admin/policies/{rule}",
    "/admin/policies/{rule}/plans/{plan}",
];

/// How many requests `/work`'s simulated backend serves at full speed.
const WORK_CAPACITY: u64 = 16;

#[path = "support/admin.rs"]
mod admin;
#[path = "support/processor_sharing.rs"]
mod processor_sharing;
use processor_sharing::ProcessorSharing;

const USAGE: &str = "usage: quickstart [--addr HOST:PORT] [--trust-proxy CIDR]... [--exempt CIDR]... [--dry-run] [--log-refusals LEVEL] [--store redis://HOST:PORT|rediss://HOST:PORT] [--redis-ca FILE] [--redis-cert FILE --redis-key FILE] [--admin-token TOKEN] [--demo]";

struct Args {
    addr: SocketAddr,
    trusted: Vec<ipnet::IpNet>,
    exempt: Vec<ipnet::IpNet>,
    dry_run: bool,
    /// The level refusals are logged at; `None`: the layers' default
    /// (`DEBUG`), below what the quickstart shows.
    log_refusals: Option<tracing::Level>,
    store: Option<String>,
    /// A CA to trust for a `rediss://` store.
    redis_ca: Option<Vec<u8>>,
    /// A client certificate and its key, for a TLS Redis that asks for one.
    redis_cert: Option<Vec<u8>>,
    redis_key: Option<Vec<u8>>,
    /// Turns on the admin routes, for `Authorization: Bearer TOKEN`.
    admin_token: Option<String>,
    demo: bool,
}

/// What the command line chose, beyond where to listen.
struct Options {
    trusted: Vec<ipnet::IpNet>,
    exempt: Vec<ipnet::IpNet>,
    dry_run: bool,
    log_refusals: Option<tracing::Level>,
    /// With `--store`: where `/slow`'s in-flight leases are shared.
    leases: Option<Arc<dyn LeaseStore>>,
    /// With `--store`: where the fleet's policy set is kept.
    redis: Option<RedisStore>,
    /// With `--admin-token`: the token of the admin routes.
    admin_token: Option<String>,
}

/// A CIDR, or a bare address as its single-address network.
fn cidr(flag: &str, v: Option<String>) -> Result<ipnet::IpNet, String> {
    let v = v.ok_or_else(|| format!("{flag} needs a CIDR, e.g. 10.0.0.0/8"))?;
    v.parse::<ipnet::IpNet>()
        .or_else(|_| v.parse::<IpAddr>().map(ipnet::IpNet::from))
        .map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        trusted: Vec::new(),
        exempt: Vec::new(),
        dry_run: false,
        log_refusals: None,
        store: None,
        redis_ca: None,
        redis_cert: None,
        redis_key: None,
        admin_token: None,
        demo: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--addr" => {
                let v = it.next().ok_or("--addr needs HOST:PORT")?;
                args.addr = v.parse().map_err(|e| format!("--addr {v:?}: {e}"))?;
            }
            "--trust-proxy" => args.trusted.push(cidr("--trust-proxy", it.next())?),
            "--exempt" => args.exempt.push(cidr("--exempt", it.next())?),
            "--dry-run" => args.dry_run = true,
            "--log-refusals" => {
                let v = it
                    .next()
                    .ok_or("--log-refusals needs a level: error, warn, info, debug or trace")?;
                let level = v.parse::<tracing::Level>().map_err(|_| {
                    format!("--log-refusals {v:?}: not one of error, warn, info, debug, trace")
                })?;
                args.log_refusals = Some(level);
            }
            "--store" => {
                let v = it
                    .next()
                    .ok_or("--store needs a URL, e.g. redis://127.0.0.1:6379")?;
                if !["redis://", "rediss://", "redis+unix://"]
                    .iter()
                    .any(|scheme| v.starts_with(scheme))
                {
                    // Redacted: a URL with a wrong scheme still carries
                    // its password.
                    return Err(format!(
                        "--store {:?}: only redis://, rediss:// and redis+unix:// URLs are \
                         supported (the default is in-memory)",
                        tollgate::redis::redact_url(&v)
                    ));
                }
                args.store = Some(v);
            }
            "--redis-ca" => {
                let v = it.next().ok_or("--redis-ca needs a PEM file")?;
                args.redis_ca =
                    Some(std::fs::read(&v).map_err(|e| format!("--redis-ca {v:?}: {e}"))?);
            }
            "--redis-cert" | "--redis-key" => {
                let v = it.next().ok_or_else(|| format!("{arg} needs a PEM file"))?;
                let pem = std::fs::read(&v).map_err(|e| format!("{arg} {v:?}: {e}"))?;
                if arg == "--redis-cert" {
                    args.redis_cert = Some(pem);
                } else {
                    args.redis_key = Some(pem);
                }
            }
            "--admin-token" => {
                let v = it.next().ok_or("--admin-token needs a token")?;
                if v.len() < 8 || !v.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(
                        "--admin-token: at least 8 visible ASCII characters, no spaces".into(),
                    );
                }
                args.admin_token = Some(v);
            }
            "--demo" => args.demo = true,
            "-h" | "--help" => {
                // Asked for: on stdout, and success.
                println!("{USAGE}");
                std::process::exit(0);
            }
            // Redacted: `--store=redis://:pw@host` lands here.
            other => {
                return Err(format!(
                    "unknown argument {:?}\n{USAGE}",
                    tollgate::redis::redact_url(other)
                ));
            }
        }
    }
    Ok(args)
}

/// Demo stand-in for authentication: maps a few fixed bearer keys to
/// principals with stable credential ids. Real services verify credentials.
async fn demo_auth(mut req: Request, next: Next) -> Response {
    let principal = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .and_then(|key| match key {
            "alice-key-1" => Some(Principal::new("north", "alice").with_credential("alice-1")),
            "alice-key-2" => Some(Principal::new("north", "alice").with_credential("alice-2")),
            "bob-key" => Some(Principal::new("north", "bob").with_credential("bob-1")),
            "carol-key" => Some(Principal::new("south", "alice").with_credential("carol-1")),
            "dave-key" => Some(
                Principal::new("north", "dave")
                    .with_credential("dave-1")
                    .with_plan("pro"),
            ),
            _ => None,
        });
    if let Some(p) = principal {
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

/// A body that yields a few lines, 50 ms apart: a stand-in for streaming
/// work that keeps its concurrency slot until the last byte is sent.
struct Ticks {
    left: u8,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl http_body::Body for Ticks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        if self.timer.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.left -= 1;
        let next = tokio::time::Instant::now() + Duration::from_millis(50);
        self.timer.as_mut().reset(next);
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
            "tick {}\n",
            3 - self.left
        ))))))
    }
}

/// An error with its causes, for a reader: `what: why: why`.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `POST /login`: 200 when the demo authentication knew the bearer key,
/// else 401 with the challenge RFC 9110 requires.
async fn login(req: Request) -> Response {
    use axum::response::IntoResponse;
    if req.extensions().get::<Principal>().is_some() {
        (StatusCode::OK, "logged in\n").into_response()
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(http::header::WWW_AUTHENTICATE, "Bearer")],
            "unknown key\n",
        )
            .into_response()
    }
}

/// The query's `ms=N` (0 to 10000), or `default`; 400 for anything else.
fn ms_of(uri: &Uri, default: u64) -> Result<u64, (StatusCode, String)> {
    match uri
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("ms=")))
    {
        None => Ok(default),
        Some(v) => v.parse::<u64>().ok().filter(|ms| *ms <= 10_000).ok_or((
            StatusCode::BAD_REQUEST,
            format!("ms must be 0..=10000, got {v:?}\n"),
        )),
    }
}

/// `GET /work?ms=N`: N ms of work (default 100) on the processor-sharing
/// backend, which takes longer once more than 16 requests are in it.
async fn work(
    backend: ProcessorSharing,
    uri: Uri,
) -> Result<axum::response::Response, (StatusCode, String)> {
    let ms = ms_of(&uri, 100)?;
    backend.serve(Duration::from_millis(ms)).await;
    Ok(axum::response::Response::new(axum::body::Body::from(
        format!("worked {ms} ms\n"),
    )))
}

async fn slow(uri: Uri) -> Result<axum::response::Response, (StatusCode, String)> {
    let ms = ms_of(&uri, 1000)?;
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let body = Ticks {
        left: 3,
        timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
    };
    Ok(axum::response::Response::new(axum::body::Body::new(body)))
}

async fn app(
    options: Options,
    store: Arc<dyn DynStore>,
) -> Result<Router, Box<dyn std::error::Error>> {
    let per_ip = Policy::token_bucket("per-ip", 5, Rate::per_second(1))?;
    let export = Policy::token_bucket("export", 3, Rate::per_second(2))?;
    // The `pro` plan's numbers for the same budget: a principal that
    // changes plan keeps what it has spent.
    let export_pro = Policy::token_bucket("export", 10, Rate::per_second(5))?;
    let login_failures =
        Policy::token_bucket("login-failures", 3, Rate::new(1, Duration::from_secs(20)))?;
    let shaped = Policy::token_bucket("shaped", 1, Rate::per_second(2))?;
    let upload = Policy::token_bucket("upload", 1024, Rate::per_second(256))?
        .with_unit(tollgate::Unit::Other("kib".into()));

    // `build` refuses, here at start, a rule that cannot be used: a bad
    // route, a plan of another budget, or a policy the store cannot hold
    // (a Redis store refuses numbers it cannot decide exactly).
    let limits = RateLimitLayer::builder(store)
        .client_ip(ClientIpResolver::trusting(
            options.trusted,
            ForwardedHeader::XForwardedFor,
        )?)
        // The health check answers even while the store is down (GET and
        // HEAD only: other methods are charged like any request).
        .exempt(Exemption::when(|req| {
            req.uri.path() == "/healthz"
                && (req.method == http::Method::GET || req.method == http::Method::HEAD)
        }))
        .dry_run(options.dry_run)
        // `/work` is bounded by its own in-flight limit instead (below).
        .rule(
            Rule::per_client_ip(per_ip)
                .exempt(Exemption::networks(options.exempt)?)
                .exempt(Exemption::when(|req| req.uri.path() == "/work")),
        )
        .rule(
            Rule::per_account_operation(export)
                .on_route("/export")
                .plan("pro", export_pro),
        )
        // Failed logins, and every other 401 of a route that needs a
        // principal: reserved with the request, kept only for a 401.
        .rule(
            GUESSED
                .iter()
                .fold(Rule::per_client_ip(login_failures), |rule, route| {
                    rule.on_route(route)
                })
                .charge_only_when(|status| status == StatusCode::UNAUTHORIZED),
        )
        // Held up to 2 s instead of refused, at most 4 waiting per account.
        .rule(Rule::per_account(shaped).on_route("/shaped").shape(
            Duration::from_secs(2),
            NonZeroUsize::new(4).ok_or("4 is not zero")?,
        ))
        .rule(
            Rule::per_account(upload)
                .on_route("/upload")
                .with_cost(Cost::content_kib()),
        );
    // Answers in axum's own body type: axum then passes the responses
    // through without boxing them again (the same answers either way).
    let limits = match options.log_refusals {
        Some(level) => limits.log_refusals(level),
        None => limits,
    }
    .build()?
    .with_inner_body();

    // Slow work: per account at most 2 in flight, 8 in all, each bounded by a
    // timeout inside the limit so a stuck request cannot hold its slot.
    let in_flight = ConcurrencyLimitLayer::builder("slow")
        .per_key(
            NonZeroUsize::new(2).ok_or("2 is not zero")?,
            [KeyPart::Account],
        )
        .global(NonZeroUsize::new(8).ok_or("8 is not zero")?)
        // A client that stops reading frees its slots after 5 s.
        .body_idle_timeout(SLOW_BODY_IDLE)
        .dry_run(options.dry_run);
    // With `--store`, the limits hold across every instance on that Redis:
    // leases of 2 s, renewed every 2/3 s, so a dead instance's slots are
    // free again at most 2 s after its last renewal.
    let in_flight = match options.leases {
        Some(leases) => in_flight.shared(leases).lease_ttl(SLOW_LEASE),
        None => in_flight,
    };
    let in_flight = match options.log_refusals {
        Some(level) => in_flight.log_refusals(level),
        None => in_flight,
    }
    .build()?;
    let slow_route = get(slow)
        .route_layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_secs(12),
        ))
        .route_layer(in_flight);

    // Work on a backend that slows down beyond 16 at once: an adaptive
    // limit finds how many it takes, shared fairly between tenants; a
    // request beyond its tenant's share waits (up to 1 s, at most 64
    // waiting) for a slot. This process's own, with `--store` too: a
    // limit found from this instance's latency. In `--dry-run` a fixed 16
    // instead (an adaptive limit cannot be dry-run).
    let work_limit = ConcurrencyLimitLayer::builder("work")
        .fair_share([KeyPart::Tenant])
        .body_idle_timeout(SLOW_BODY_IDLE);
    let work_limit = if options.dry_run {
        work_limit
            .global(NonZeroUsize::new(16).ok_or("16 is not zero")?)
            .dry_run(true)
    } else {
        work_limit
            .adaptive(AdaptiveConfig::builder().bounds(4, 256).build()?)
            .wait(64, Duration::from_secs(1))
    };
    let work_limit = match options.log_refusals {
        Some(level) => work_limit.log_refusals(level),
        None => work_limit,
    }
    .build()?;
    let backend = ProcessorSharing::new(WORK_CAPACITY);
    let work_route = get(move |uri: Uri| work(backend.clone(), uri))
        .route_layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_secs(12),
        ))
        .route_layer(work_limit);

    // With `--store`, every quickstart on that Redis follows one policy
    // set (loaded now, before serving; followed while it runs). With
    // `--admin-token`, the admin routes change it.
    let policies = admin::Policies::start(limits.rules_handle(), options.redis).await;
    let admin_routes = match options.admin_token {
        Some(token) => admin::routes(token, policies),
        None => {
            // Kept for as long as the process runs: dropping it would
            // stop following the fleet (found in review).
            tokio::spawn(async move {
                let _following = policies;
                std::future::pending::<()>().await;
            });
            Router::new()
        }
    };

    Ok(Router::new()
        .route("/", get(|| async { "hello from tollgate\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/shaped", get(|| async { "shaped\n" }))
        .route("/slow", slow_route)
        .route("/work", work_route)
        .route("/export", post(|| async { "export started\n" }))
        .route("/login", post(login))
        .route(
            "/upload",
            post(|body: Bytes| async move { format!("uploaded {} bytes\n", body.len()) }),
        )
        .merge(admin_routes)
        .layer(limits)
        .layer(middleware::from_fn(demo_auth)))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    // tollgate's log on stderr: warnings, errors, in --dry-run the would-be
    // refusals, and with --log-refusals every refusal, shown even at DEBUG
    // or TRACE (for tollgate only: the server's own crates stay at INFO).
    let shown = match args.log_refusals {
        Some(level) if level > tracing::Level::INFO => level,
        _ => tracing::Level::INFO,
    };
    let only = tracing_subscriber::filter::Targets::new()
        .with_default(tracing::Level::INFO)
        .with_target("tollgate", shown);
    tracing_subscriber::fmt()
        .with_max_level(shown)
        .with_writer(std::io::stderr)
        .finish()
        .with(only)
        .init();
    let redis: Option<RedisStore>;
    let (store, leases): (Arc<dyn DynStore>, Option<Arc<dyn LeaseStore>>) = match &args.store {
        None => {
            redis = None;
            (Arc::new(MemoryStore::new()), None)
        }
        Some(url) => match RedisStore::builder(url).and_then(|b| {
            let b = match args.redis_ca.clone() {
                Some(ca) => b.tls_root_certificate(ca),
                None => b,
            };
            match (args.redis_cert.clone(), args.redis_key.clone()) {
                (Some(cert), Some(key)) => b.tls_client_certificate(cert, key),
                (None, None) => b,
                _ => {
                    return Err(tollgate::StoreError::new(
                        tollgate::store::StoreErrorKind::Config,
                        "--redis-cert and --redis-key go together",
                    ));
                }
            }
            .build()
        }) {
            Ok(store) => {
                redis = Some(store.clone());
                (Arc::new(store.clone()), Some(Arc::new(store)))
            }
            Err(e) => {
                eprintln!(
                    "--store {}: {}",
                    tollgate::redis::redact_url(url),
                    chain(&e)
                );
                return ExitCode::from(2);
            }
        },
    };
    // Connected (TCP, TLS, AUTH) and the scripts loaded before listening, so
    // that the first requests are answered like every later one. A Redis
    // that does not answer yet is reported; the store keeps trying, and
    // requests are answered 503 until it answers.
    let connected = match &redis {
        Some(redis) => redis.connect().await,
        None => Ok(()),
    };
    if let (Some(url), Err(e)) = (&args.store, connected) {
        eprintln!(
            "--store {}: {} (serving anyway: 503 until Redis answers)",
            tollgate::redis::redact_url(url),
            chain(&e)
        );
    }
    let options = Options {
        trusted: args.trusted,
        exempt: args.exempt,
        dry_run: args.dry_run,
        log_refusals: args.log_refusals,
        leases,
        redis: redis.clone(),
        admin_token: args.admin_token,
    };
    let app = match app(options, store).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("bad configuration: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = if args.demo && args.addr.port() == 3000 {
        SocketAddr::new(args.addr.ip(), 0)
    } else {
        args.addr
    };
    let listener = match TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let local = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("no local address: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("tollgate quickstart listening on http://{local}");
    match &args.store {
        None => println!("store: in-memory"),
        Some(url) => println!(
            "store: {} (fail closed with 503 while it is unreachable)",
            tollgate::redis::redact_url(url)
        ),
    }
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    if args.demo {
        let ok = demo(local).await;
        server.abort();
        return if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    println!("try:");
    println!("  for i in 1 2 3 4 5 6; do curl -si http://{local}/ | head -1; done");
    println!("  curl -si -X POST -H 'Authorization: Bearer alice-key-1' http://{local}/export");
    println!(
        "  curl -si -X POST -H 'Authorization: Bearer bob-key' --data-binary @Cargo.toml http://{local}/upload"
    );
    match server.await {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("server error: {e}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("server task failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One raw HTTP/1.1 exchange from a chosen loopback source address.
async fn send(
    server: SocketAddr,
    from: IpAddr,
    head: &str,
    body: &[u8],
) -> std::io::Result<String> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    let mut stream = socket.connect(server).await?;
    stream
        .write_all(format!("{head}\r\nHost: {server}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    if !body.is_empty() {
        // The server may refuse before reading the body and close.
        let _ = stream.write_all(body).await;
    }
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no response in 5 s"))??;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn summary(response: &str) -> String {
    let mut lines = response.split("\r\n");
    let status = lines.next().unwrap_or("").to_owned();
    let mut shown = vec![status];
    for line in lines.take_while(|l| !l.is_empty()) {
        let lower = line.to_ascii_lowercase();
        if lower.starts_with("retry-after:") || lower.starts_with("ratelimit") {
            shown.push(line.to_owned());
        }
    }
    shown.join(" | ")
}

async fn demo(server: SocketAddr) -> bool {
    let steps: Vec<(&str, IpAddr, String, Vec<u8>)> = {
        let a: IpAddr = [127, 0, 0, 2].into();
        let b: IpAddr = [127, 0, 0, 3].into();
        let c: IpAddr = [127, 0, 0, 4].into();
        let mut s = Vec::new();
        for _ in 0..6 {
            s.push((
                "public route, per-address budget of 5",
                a,
                "GET / HTTP/1.1".to_owned(),
                vec![],
            ));
        }
        for _ in 0..4 {
            s.push((
                "alice exports: account budget of 3",
                b,
                "POST /export HTTP/1.1\r\nAuthorization: Bearer alice-key-1\r\nContent-Length: 0"
                    .to_owned(),
                vec![],
            ));
        }
        s.push((
            "bob, same address, own account budget",
            b,
            "POST /export HTTP/1.1\r\nAuthorization: Bearer bob-key\r\nContent-Length: 0"
                .to_owned(),
            vec![],
        ));
        let d: IpAddr = [127, 0, 0, 8].into();
        for _ in 0..4 {
            s.push((
                "dave on plan pro exports: account budget of 10",
                d,
                "POST /export HTTP/1.1\r\nAuthorization: Bearer dave-key\r\nContent-Length: 0"
                    .to_owned(),
                vec![],
            ));
        }
        s.push((
            "no credential on a principal route",
            c,
            "POST /export HTTP/1.1\r\nContent-Length: 0".to_owned(),
            vec![],
        ));
        s.push((
            "upload of 10 KiB costs 10",
            c,
            "POST /upload HTTP/1.1\r\nAuthorization: Bearer bob-key\r\nContent-Length: 10240"
                .to_owned(),
            vec![b'x'; 10240],
        ));
        s.push((
            "upload of 2 MiB never fits",
            c,
            "POST /upload HTTP/1.1\r\nAuthorization: Bearer bob-key\r\nContent-Length: 2097152"
                .to_owned(),
            vec![],
        ));
        s
    };
    let mut ok = true;
    for (what, from, head, body) in steps {
        ok &= step(server, what, from, &head, &body).await;
    }
    // Concurrency: three slow requests of alice at once (from three
    // addresses, so only the in-flight limit is in play): two run, one is
    // refused at once.
    println!("alice starts 3 slow requests at once: at most 2 in flight per account");
    let head = "GET /slow?ms=400 HTTP/1.1\r\nAuthorization: Bearer alice-key-1";
    let mut tasks = Vec::new();
    for last in [5u8, 6, 7] {
        let from = IpAddr::from([127, 0, 0, last]);
        tasks.push(tokio::spawn(async move {
            (from, send(server, from, head, b"").await)
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for task in tasks {
        match task.await {
            Ok((from, Ok(response))) => println!(
                "  GET /slow?ms=400 from {from}\n  -> {}",
                summary(&response)
            ),
            Ok((from, Err(e))) => {
                println!("  GET /slow from {from} failed: {e}");
                ok = false;
            }
            Err(e) => {
                println!("  task failed: {e}");
                ok = false;
            }
        }
    }
    ok &= shaped_burst(server).await;
    ok
}

/// Shaping: eight requests of alice at once, from eight addresses (so only
/// the shaped rule is in play): five are released 0.5 s apart, three are
/// refused at once.
async fn shaped_burst(server: SocketAddr) -> bool {
    println!("alice sends 8 GET /shaped at once: a bucket of 1, 2 per second, shaped up to 2 s");
    let head = "GET /shaped HTTP/1.1\r\nAuthorization: Bearer alice-key-1";
    let started = tokio::time::Instant::now();
    let tasks: Vec<_> = (20u8..28)
        .map(|last| {
            let from = IpAddr::from([127, 0, 0, last]);
            tokio::spawn(async move {
                let response = send(server, from, head, b"").await;
                (response, started.elapsed())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        match task.await {
            Ok((Ok(response), after)) => answers.push((after, summary(&response))),
            Ok((Err(e), _)) => {
                println!("  GET /shaped failed: {e}");
                return false;
            }
            Err(e) => {
                println!("  task failed: {e}");
                return false;
            }
        }
    }
    answers.sort_by_key(|a| a.0);
    for (after, line) in answers {
        println!("  after {:>4} ms -> {line}", after.as_millis());
    }
    true
}

async fn step(server: SocketAddr, what: &str, from: IpAddr, head: &str, body: &[u8]) -> bool {
    let request_line = head.split("\r\n").next().unwrap_or("");
    match send(server, from, head, body).await {
        Ok(response) => {
            println!(
                "{what}\n  {request_line} from {from}\n  -> {}",
                summary(&response)
            );
            true
        }
        Err(e) => {
            println!("{what}: {request_line} from {from} failed: {e}");
            false
        }
    }
}
