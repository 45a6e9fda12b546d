//! `RateLimitLayer::with_inner_body`: the same answers, byte for byte, as
//! the default body, over real sockets.
//!
//! Two apps that differ only in the layer's body mode, each with a store
//! of its own on one manual clock that never moves (so both decide at the
//! same instant), get the same requests in turn; every answer must be the
//! same on the wire but for the `date` line: status, every header line in
//! order, body. The requests go through every path a response takes
//! (admitted with and without fields, held by shaping, `429` rendered and
//! written, `401` with a challenge, `413`, gRPC's trailers-only refusal, a
//! rule charged by outcome, a dry-run rule, an exemption, a plan switched
//! at runtime) inside a `Router`, at the front door around one, and on a
//! Redis store (whose decisions come after a round trip: another path
//! through the response future).

mod common;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::time::Duration;

use axum::extract::Request;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Router, ServiceExt};
use tollgate::store::ManualClock;
use tollgate::{Cost, Exemption, MemoryStore, Policy, Rate, RateLimitLayer, Rule, Store};
use tower::Layer;

use common::{ip, test_auth};

/// A minute of budget refills in an hour: nothing refills during a test,
/// and the clock does not move anyway.
fn slow(name: &str, capacity: u64) -> Policy {
    Policy::token_bucket(name, capacity, Rate::per_hour(60)).unwrap()
}

/// Every rule kind the answers depend on.
fn layer<St: Store>(store: St) -> RateLimitLayer<St> {
    RateLimitLayer::builder(store)
        .rule(
            Rule::per_client_ip(slow("per-ip", 6))
                .exempt(Exemption::networks(["127.0.9.9/32".parse().unwrap()]).unwrap()),
        )
        .rule(
            Rule::per_account(slow("logins", 2))
                .on_route("/login")
                .charge_only_when(|status| status == http::StatusCode::UNAUTHORIZED),
        )
        .rule(
            Rule::per_account(slow("uploads", 4))
                .on_route("/upload")
                .with_cost(Cost::content_kib()),
        )
        .rule(
            Rule::per_account(Policy::token_bucket("shaped", 1, Rate::per_second(20)).unwrap())
                .on_route("/shaped")
                .shape(Duration::from_millis(200), NonZeroUsize::new(4).unwrap()),
        )
        .rule(
            Rule::per_account(slow("reports", 2))
                .on_route("/report")
                .plan("pro", slow("reports", 3)),
        )
        .rule(Rule::per_client_ip(slow("watch", 1)).dry_run(true))
        .build()
        .unwrap()
}

fn router() -> Router {
    Router::new()
        .route("/", get(|| async { "hello" }).post(|| async { "posted" }))
        .route(
            "/login",
            post(|req: Request| async move {
                let ok = req
                    .headers()
                    .get("x-password")
                    .is_some_and(|p| p == "right");
                if ok {
                    (http::StatusCode::OK, "welcome").into_response()
                } else {
                    (http::StatusCode::UNAUTHORIZED, "no").into_response()
                }
            }),
        )
        .route("/upload", post(|| async { "stored" }))
        .route("/shaped", get(|| async { "shaped" }))
        .route("/report", get(|| async { "report" }))
}

/// Serves `app` (any service answering with axum's response type) on a
/// free loopback port, with connect info.
async fn serve<A>(app: A) -> SocketAddr
where
    A: tower::Service<Request, Response = Response, Error = std::convert::Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    A::Future: Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = ServiceExt::<Request>::into_make_service_with_connect_info::<SocketAddr>(app);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One request of the script: from, method, path, headers, body.
type Step = (
    &'static str,
    &'static str,
    &'static str,
    Vec<(&'static str, &'static str)>,
    Vec<u8>,
);

fn script() -> Vec<Step> {
    let alice = ("x-test-user", "north/alice");
    let bob = ("x-test-user", "north/bob");
    let pro = ("x-test-plan", "pro");
    let grpc = ("content-type", "application/grpc");
    let mut steps: Vec<Step> = Vec::new();
    // Admitted, with fields; then the address's budget runs out (written
    // and rendered refusals: several limits, then one).
    for _ in 0..3 {
        steps.push(("127.0.7.1", "GET", "/", vec![], vec![]));
    }
    // Failed logins are charged, a success is given back; then 429.
    for password in ["wrong", "right", "wrong", "wrong", "wrong"] {
        steps.push((
            "127.0.7.2",
            "POST",
            "/login",
            vec![alice, ("x-password", password)],
            vec![],
        ));
    }
    // No principal: 401 with the challenge.
    steps.push(("127.0.7.3", "POST", "/login", vec![], vec![]));
    // An upload that can never fit (413), one that fits, one refused.
    steps.push((
        "127.0.7.4",
        "POST",
        "/upload",
        vec![alice],
        vec![b'x'; 9 * 1024],
    ));
    steps.push((
        "127.0.7.4",
        "POST",
        "/upload",
        vec![alice],
        vec![b'x'; 3 * 1024],
    ));
    steps.push((
        "127.0.7.4",
        "POST",
        "/upload",
        vec![alice],
        vec![b'x'; 2 * 1024],
    ));
    // Held by shaping, then admitted after its wait; then beyond the line.
    for _ in 0..3 {
        steps.push(("127.0.7.5", "GET", "/shaped", vec![alice], vec![]));
    }
    // A plan: bob's is "pro".
    for _ in 0..4 {
        steps.push(("127.0.7.6", "GET", "/report", vec![bob, pro], vec![]));
    }
    // gRPC: admitted, then refused trailers-only.
    for _ in 0..7 {
        steps.push(("127.0.7.7", "POST", "/", vec![grpc], vec![]));
    }
    // Exempt from the address rule, still in the dry-run one's log.
    for _ in 0..8 {
        steps.push(("127.0.9.9", "GET", "/", vec![], vec![]));
    }
    steps
}

/// The response on the wire without its `date` line.
fn without_date(raw: &[u8]) -> String {
    String::from_utf8_lossy(raw)
        .split("\r\n")
        .filter(|line| !line.to_ascii_lowercase().starts_with("date:"))
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// `step` sent from its address; the answer as it came, without `date`.
async fn exchange(server: SocketAddr, step: &Step) -> String {
    let (from, method, path, headers, body) = step;
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    let request = common::request_bytes(method, path, &headers, body);
    without_date(&common::exchange_raw(server, ip(from), &request).await)
}

/// Sends the script to both servers in turn; every answer must be the
/// same. `switch` is called once, halfway, to switch a plan on both.
async fn same_answers(wrapped: SocketAddr, inner: SocketAddr, switch: impl Fn()) -> Vec<String> {
    let steps = script();
    let mut answers = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        if i == steps.len() / 2 {
            switch();
        }
        let a = exchange(wrapped, step).await;
        let b = exchange(inner, step).await;
        assert_eq!(a, b, "step {i} {step:?}: the body modes answer differently");
        answers.push(a);
    }
    answers
}

/// The script's answers cover what they should: otherwise two apps that
/// always said "hello" alike would pass.
fn covers(answers: &[String]) {
    for status in ["200 OK", "401 Unauthorized", "413", "429 Too Many Requests"] {
        assert!(
            answers
                .iter()
                .any(|a| a.starts_with(&format!("HTTP/1.1 {status}"))),
            "no {status} among {answers:#?}"
        );
    }
    assert!(
        answers.iter().any(|a| a.contains("grpc-status: 8")),
        "{answers:#?}"
    );
    assert!(
        answers.iter().any(|a| a.contains("\r\n\r\nshaped")),
        "{answers:#?}"
    );
    assert!(
        answers.iter().any(|a| a.contains("\r\n\r\nwelcome")),
        "{answers:#?}"
    );
    assert!(
        answers
            .iter()
            .any(|a| a.contains("problem+json") && a.contains("retry_after")),
        "{answers:#?}"
    );
}

/// Two layers of the same rules on stores of their own, sharing `clock`.
fn memory_layers(
    clock: &ManualClock,
) -> (RateLimitLayer<MemoryStore>, RateLimitLayer<MemoryStore>) {
    let store = || MemoryStore::builder().clock(clock.clone()).build();
    (layer(store()), layer(store()))
}

/// Switches the "pro" plan of the reports rule on both layers at once.
fn switch_plans<St: Store>(handles: [tollgate::RulesHandle<St>; 2]) -> impl Fn() {
    move || {
        for handle in &handles {
            handle.set_plan("pro", slow("reports", 1)).unwrap();
        }
    }
}

/// `a` and `b` (the same rules on stores of their own) inside the same
/// router, `b` answering in the inner body: the script's answers alike.
async fn inside_routers<St: Store>(a: RateLimitLayer<St>, b: RateLimitLayer<St>) {
    let b = b.with_inner_body();
    let switch = switch_plans([a.rules_handle(), b.rules_handle()]);
    let app = |routes: Router| routes.layer(middleware::from_fn(test_auth)).with_state(());
    let wrapped = serve(app(router().layer(a))).await;
    let inner = serve(app(router().layer(b))).await;
    covers(&same_answers(wrapped, inner, switch).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn inside_a_router_both_body_modes_answer_alike() {
    let clock = ManualClock::new(1_000_000_000_000);
    let (a, b) = memory_layers(&clock);
    inside_routers(a, b).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn at_the_front_door_both_body_modes_answer_alike() {
    let clock = ManualClock::new(1_000_000_000_000);
    let (a, b) = memory_layers(&clock);
    let b = b.with_inner_body();
    let switch = switch_plans([a.rules_handle(), b.rules_handle()]);
    let auth = middleware::from_fn(test_auth);
    // The default body is made axum's by `map_response`; the inner body
    // is axum's already and is served as it is.
    let wrapped = tower::ServiceBuilder::new()
        .map_response(IntoResponse::into_response)
        .layer(auth.clone())
        .service(a.layer(router().with_state(())));
    let inner = auth.layer(b.layer(router().with_state(())));
    let (wrapped, inner) = (serve(wrapped).await, serve(inner).await);
    covers(&same_answers(wrapped, inner, switch).await);
}

#[tokio::test(flavor = "multi_thread")]
async fn on_redis_both_body_modes_answer_alike() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let clock = ManualClock::new(1_000_000_000_000);
    let store = |prefix: &str| {
        let clock = clock.clone();
        tollgate::RedisStore::builder(&server.url())
            .unwrap()
            .prefix(prefix)
            .injected_time(move || tollgate::store::Clock::now(&clock))
            .build()
            .unwrap()
    };
    inside_routers(layer(store("wrapped")), layer(store("inner"))).await;
}

/// A `HEAD` request over HTTP/2 with prior knowledge: its status, its
/// `content-length`, and how many body bytes came (an error if the stream
/// broke).
async fn h2_head(server: SocketAddr, from: &str) -> (http::StatusCode, Option<String>, usize) {
    use http_body_util::BodyExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(ip(from), 0)).unwrap();
    let stream = socket.connect(server).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::head(format!("http://{server}/"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let response = sender.send_request(req).await.expect("a response");
    let status = response.status();
    let length = response
        .headers()
        .get("content-length")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = tokio::time::timeout(Duration::from_secs(10), response.into_body().collect())
        .await
        .expect("the body ends within 10 s")
        .expect("the stream ends cleanly")
        .to_bytes();
    conn.abort();
    (status, length, body.len())
}

/// Found in review: a refusal to `HEAD` kept its problem+json body. Over
/// HTTP/1.1 hyper leaves it out, and inside a `Router` axum strips it;
/// at the front door over HTTP/2 nothing did, and the stream broke
/// (`PROTOCOL_ERROR`). A refusal to `HEAD` is the head a `GET` gets, its
/// body's length in `Content-Length`, and no body: for both layers, in
/// both body modes.
#[tokio::test(flavor = "multi_thread")]
async fn a_head_refused_at_the_front_door_has_no_body_on_either_protocol() {
    let per_ip = || {
        RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::per_client_ip(slow("per-ip", 1)))
            .build()
            .unwrap()
    };
    let hello = || router().with_state(());
    let wrapped = tower::ServiceBuilder::new()
        .map_response(IntoResponse::into_response)
        .service(per_ip().layer(hello()));
    let inner = per_ip().with_inner_body().layer(hello());
    // The in-flight layer refuses at once: its one slot is held by a
    // request that never ends.
    let in_flight = tollgate::ConcurrencyLimitLayer::builder("one")
        .global(NonZeroUsize::MIN)
        .build()
        .unwrap();
    let holding = std::sync::Arc::new(tokio::sync::Notify::new());
    let entered = holding.clone();
    let held = router()
        .route(
            "/hold",
            get(move || {
                entered.notify_one();
                std::future::pending::<&'static str>()
            }),
        )
        .with_state(());
    let concurrency = tower::ServiceBuilder::new()
        .map_response(IntoResponse::into_response)
        .service(in_flight.layer(held));
    let servers = [
        ("rate limit, wrapped", serve(wrapped).await, "127.0.8.1"),
        ("rate limit, inner body", serve(inner).await, "127.0.8.2"),
        ("in flight", serve(concurrency).await, "127.0.8.3"),
    ];
    // The in-flight server's slot taken by a request that never ends, for
    // as long as the test runs: sent again if another request had the
    // slot when it came (then it is refused, and its handler never runs).
    let mut _holder = None;
    let started = std::time::Instant::now();
    while _holder.is_none() {
        use tokio::io::AsyncWriteExt;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the slot was never taken"
        );
        let mut stream = tokio::net::TcpStream::connect(servers[2].1).await.unwrap();
        stream
            .write_all(b"GET /hold HTTP/1.1\r\nHost: test\r\n\r\n")
            .await
            .unwrap();
        if tokio::time::timeout(Duration::from_secs(1), holding.notified())
            .await
            .is_ok()
        {
            _holder = Some(stream);
        }
    }
    for (what, server, from) in servers {
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let (status, length, body) = h2_head(server, from).await;
            statuses.push(status);
            if status.is_client_error() || status.is_server_error() {
                assert_eq!(body, 0, "{what}: a body came with a refusal to HEAD");
                // Over HTTP/1.1, the same head as a GET's refusal.
                let get = exchange(server, &(from, "GET", "/", vec![], vec![])).await;
                let got = get.split("\r\n\r\n").nth(1).unwrap_or_default().len();
                assert_eq!(length, Some(got.to_string()), "{what}: {get}");
                // The same status and header lines (hyper puts a length it
                // computes after `connection`, a given one before it).
                let head = exchange(server, &(from, "HEAD", "/", vec![], vec![])).await;
                let lines = |text: &str| {
                    let head = text.split("\r\n\r\n").next().unwrap_or_default();
                    let mut lines: Vec<String> = head.split("\r\n").map(str::to_owned).collect();
                    lines.sort();
                    lines
                };
                assert!(
                    head.ends_with("\r\n\r\n"),
                    "{what}: a body after the head: {head}"
                );
                assert_eq!(lines(&head), lines(&get), "{what}");
            }
        }
        assert!(
            statuses
                .iter()
                .any(|s| s.is_client_error() || s.is_server_error()),
            "{what}: nothing refused: {statuses:?}"
        );
    }
}
