//! The concurrency-limit layer over real sockets: permits held until the
//! response body ends, released on disconnect, bounded waiting.

mod common;

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use bytes::Bytes;
use common::driven::ChannelBody;
use common::{ip, open, param, quickstart, send, serve, sf_list};
use http::StatusCode;
use http_body::Frame;
use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;
use tollgate::{ConcurrencyLimitLayer, KeyPart, MemoryStore, Policy, Rate, RateLimitLayer, Rule};

fn n(v: usize) -> NonZeroUsize {
    NonZeroUsize::new(v).unwrap()
}

const ALICE: (&str, &str) = ("Authorization", "Bearer alice-key-1");
const BOB: (&str, &str) = ("Authorization", "Bearer bob-key");

#[tokio::test(flavor = "multi_thread")]
async fn quickstart_slow_route_limits_each_account_to_two_in_flight() {
    let q = quickstart(&[]);
    let a = q.addr;
    // Two slow requests of alice, from two addresses so that only the
    // in-flight limit is in play.
    let first = tokio::spawn(async move {
        send(a, ip("127.0.30.1"), "GET", "/slow?ms=1500", &[ALICE], b"").await
    });
    let second = tokio::spawn(async move {
        send(a, ip("127.0.30.2"), "GET", "/slow?ms=1500", &[ALICE], b"").await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let third = send(a, ip("127.0.30.3"), "GET", "/slow?ms=10", &[ALICE], b"").await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(
        started.elapsed() < Duration::from_millis(700),
        "refused at once, not queued"
    );
    assert!(third.header("retry-after").is_none());
    assert_eq!(third.header("cache-control"), Some("no-store"));
    let policies = sf_list(&third.header_joined("ratelimit-policy").unwrap());
    let slow = policies
        .iter()
        .find(|m| m.0 == "slow")
        .expect("the concurrency policy is described");
    assert_eq!(param(slow, "q"), Some(2));
    assert!(
        slow.1
            .iter()
            .any(|(k, v)| k == "qu" && v == "concurrent-requests"),
        "{slow:?}"
    );
    // Bob is another account.
    let bob = send(a, ip("127.0.30.4"), "GET", "/slow?ms=10", &[BOB], b"").await;
    assert_eq!(bob.status, StatusCode::OK);
    assert_eq!(bob.body, "tick 1\ntick 2\ntick 3\n");
    // When one of alice's finishes, she is admitted again.
    assert_eq!(first.await.unwrap().status, StatusCode::OK);
    let again = send(a, ip("127.0.30.3"), "GET", "/slow?ms=10", &[ALICE], b"").await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(second.await.unwrap().status, StatusCode::OK);
    // Bad input is a clear 400.
    let bad = send(a, ip("127.0.30.5"), "GET", "/slow?ms=99999", &[ALICE], b"").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

/// An app whose `/stream` responses are driven by the test: each request
/// hands its body sender over `senders`.
fn streaming_app(
    limit: ConcurrencyLimitLayer,
) -> (
    Router,
    Arc<Mutex<mpsc::UnboundedReceiver<mpsc::Sender<Bytes>>>>,
) {
    let (tx, rx) = mpsc::unbounded_channel::<mpsc::Sender<Bytes>>();
    let app = Router::new()
        .route(
            "/stream",
            get(move || {
                let tx = tx.clone();
                async move {
                    let (body_tx, body_rx) = mpsc::channel(8);
                    body_tx.send(Bytes::from_static(b"first\n")).await.unwrap();
                    tx.send(body_tx).unwrap();
                    axum::response::Response::new(axum::body::Body::new(ChannelBody(body_rx)))
                }
            }),
        )
        .route("/quick", get(|| async { "quick" }))
        .layer(limit);
    (app, Arc::new(Mutex::new(rx)))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_streaming_body_holds_its_permit_until_fully_sent() {
    let limit = ConcurrencyLimitLayer::builder("stream")
        .global(n(1))
        .build()
        .unwrap();
    let (app, senders) = streaming_app(limit.clone());
    let a = serve(app).await;
    let (mut stream, head) = open(a, ip("127.0.31.1"), "/stream", &[], 6).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let body_tx = senders.lock().unwrap().try_recv().unwrap();
    // The head has been sent, the body has not ended: still in flight.
    assert_eq!(limit.stats().in_flight, 1);
    let r = send(a, ip("127.0.31.2"), "GET", "/quick", &[], b"").await;
    assert_eq!(
        r.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "global limit of 1 is held by the stream"
    );
    // Finish the body; read it to the end.
    body_tx.send(Bytes::from_static(b"last\n")).await.unwrap();
    drop(body_tx);
    let mut rest = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await.unwrap();
        rest.extend_from_slice(&buf[..n]);
        if n == 0 || rest.ends_with(b"0\r\n\r\n") {
            break;
        }
    }
    assert!(String::from_utf8_lossy(&rest).contains("last"));
    wait_until(|| limit.stats().in_flight == 0).await;
    assert_eq!(
        send(a, ip("127.0.31.2"), "GET", "/quick", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
}

async fn wait_until(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(Instant::now() < deadline, "condition not met within 5 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_disconnects_mid_body_frees_its_permit() {
    let limit = ConcurrencyLimitLayer::builder("stream")
        .global(n(1))
        .build()
        .unwrap();
    let (app, senders) = streaming_app(limit.clone());
    let a = serve(app).await;
    let (stream, _) = open(a, ip("127.0.32.1"), "/stream", &[], 6).await;
    let body_tx = senders.lock().unwrap().try_recv().unwrap();
    assert_eq!(limit.stats().in_flight, 1);
    drop(stream);
    // The server notices when it next writes; it keeps streaming.
    let deadline = Instant::now() + Duration::from_secs(5);
    while limit.stats().in_flight > 0 {
        assert!(
            Instant::now() < deadline,
            "permit not released after disconnect"
        );
        let _ = body_tx.send(Bytes::from_static(b"more\n")).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        send(a, ip("127.0.32.2"), "GET", "/quick", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
}

fn slow_app(limit: ConcurrencyLimitLayer) -> Router {
    Router::new()
        .route(
            "/sleep/{ms}",
            get(
                |axum::extract::Path(ms): axum::extract::Path<u64>| async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    "slept"
                },
            ),
        )
        .layer(limit)
}

#[tokio::test(flavor = "multi_thread")]
async fn bounded_waiting_admits_within_its_time_or_refuses_after_it() {
    let limit = ConcurrencyLimitLayer::builder("wait")
        .global(n(1))
        .wait(4, Duration::from_millis(600))
        .build()
        .unwrap();
    let a = serve(slow_app(limit.clone())).await;
    // Held for 200 ms: a waiter gets in after it.
    let holder =
        tokio::spawn(async move { send(a, ip("127.0.33.1"), "GET", "/sleep/200", &[], b"").await });
    wait_until(|| limit.stats().in_flight == 1).await;
    let started = Instant::now();
    let waited = send(a, ip("127.0.33.2"), "GET", "/sleep/0", &[], b"").await;
    assert_eq!(waited.status, StatusCode::OK);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(100),
        "admitted only after the holder finished ({took:?})"
    );
    assert_eq!(holder.await.unwrap().status, StatusCode::OK);

    // Held for 3 s: the waiter is refused once its 600 ms are up.
    let holder =
        tokio::spawn(
            async move { send(a, ip("127.0.33.1"), "GET", "/sleep/3000", &[], b"").await },
        );
    wait_until(|| limit.stats().in_flight == 1).await;
    let started = Instant::now();
    let refused = send(a, ip("127.0.33.3"), "GET", "/sleep/0", &[], b"").await;
    let took = started.elapsed();
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        took >= Duration::from_millis(550) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    assert_eq!(refused.header("cache-control"), Some("no-store"));
    holder.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_waiting_queue_never_exceeds_its_bound_under_a_burst() {
    let limit = ConcurrencyLimitLayer::builder("burst")
        .global(n(1))
        .wait(3, Duration::from_millis(800))
        .build()
        .unwrap();
    let a = serve(slow_app(limit.clone())).await;
    let holder =
        tokio::spawn(
            async move { send(a, ip("127.0.34.1"), "GET", "/sleep/1500", &[], b"").await },
        );
    wait_until(|| limit.stats().in_flight == 1).await;
    let burst: Vec<_> = (0..40)
        .map(|i| {
            tokio::spawn(async move {
                let from = ip(&format!("127.0.34.{}", 10 + i));
                send(a, from, "GET", "/sleep/0", &[], b"").await.status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for t in burst {
        statuses.push(t.await.unwrap());
    }
    let stats = limit.stats();
    assert!(stats.peak_waiting <= 3, "{stats:?}");
    assert_eq!(
        stats.peak_waiting, 3,
        "the queue filled up to its bound: {stats:?}"
    );
    assert!(
        statuses
            .iter()
            .all(|s| *s == StatusCode::SERVICE_UNAVAILABLE),
        "{statuses:?}"
    );
    assert_eq!(stats.refused_global, 40);
    assert_eq!(stats.waiting, 0);
    holder.await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn composes_with_the_rate_limiter_in_either_order() {
    let rate = || {
        RateLimitLayer::builder(MemoryStore::new())
            .rule(Rule::per_client_ip(
                Policy::token_bucket("per-ip", 2, Rate::per_hour(1)).unwrap(),
            ))
            .build()
            .unwrap()
    };
    let conc = || {
        ConcurrencyLimitLayer::builder("conc")
            .per_key(n(1), [KeyPart::ClientIp])
            .build()
            .unwrap()
    };
    let inner_rate = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(rate())
        .layer(conc());
    let outer_rate = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(conc())
        .layer(rate());
    for app in [inner_rate, outer_rate] {
        let a = serve(app).await;
        let from = ip("127.0.35.1");
        assert_eq!(
            send(a, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
        assert_eq!(
            send(a, from, "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
        // The third is refused by the rate limiter, and frees its slot.
        assert_eq!(
            send(a, from, "GET", "/", &[], b"").await.status,
            StatusCode::TOO_MANY_REQUESTS
        );
        assert_eq!(
            send(a, ip("127.0.35.2"), "GET", "/", &[], b"").await.status,
            StatusCode::OK
        );
    }
}

/// Audit finding 8: a `101` answer has an empty body, so the permit was
/// released when the connection switched protocols while the upgraded
/// connection lived on. A handler that keeps the request's `InFlight`
/// counts the connection for its whole life.
#[tokio::test(flavor = "multi_thread")]
async fn an_upgraded_connection_holds_its_slot_while_it_lives() {
    use axum::extract::Request;
    use tokio::io::AsyncWriteExt;
    use tollgate::concurrency::InFlight;

    async fn echo(mut req: Request) -> axum::response::Response {
        let slot = req.extensions_mut().remove::<InFlight>();
        let upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            let _slot = slot;
            if let Ok(upgraded) = upgrade.await {
                let mut io = hyper_util::rt::TokioIo::new(upgraded);
                let mut buf = [0u8; 64];
                while let Ok(n @ 1..) = io.read(&mut buf).await {
                    if io.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        });
        axum::response::Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "echo")
            .header("connection", "upgrade")
            .body(axum::body::Body::empty())
            .unwrap()
    }

    let limit = ConcurrencyLimitLayer::builder("tunnels")
        .per_key(n(1), [KeyPart::ClientIp])
        .build()
        .unwrap();
    let app = serve(Router::new().route("/ws", get(echo)).layer(limit)).await;
    let from = ip("127.0.31.1");
    let upgrade_headers = [("Upgrade", "echo"), ("Connection", "upgrade")];
    let (mut first, head) = open(app, from, "/ws", &upgrade_headers, 0).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    first.write_all(b"ping").await.unwrap();
    let mut echoed = [0u8; 4];
    first.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping");
    // While the upgraded connection is open, its slot is taken.
    let refused = send(app, from, "GET", "/ws", &upgrade_headers, b"").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    // Closing it frees the slot.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_again, head) = open(app, from, "/ws", &upgrade_headers, 0).await;
        if head.starts_with("HTTP/1.1 101") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was never freed: {head}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Found in review: a second concurrency layer replaced the first one's
/// `InFlight`, so with a global layer on the app and a per-route one, the
/// upgraded connection stayed counted by the inner layer only.
#[tokio::test]
async fn nested_layers_all_count_an_upgraded_connection() {
    use axum::extract::Request;
    use tollgate::concurrency::InFlight;
    use tower::ServiceExt;

    static KEPT: Mutex<Vec<InFlight>> = Mutex::new(Vec::new());
    async fn upgrade(mut req: Request) -> axum::response::Response {
        if let Some(slot) = req.extensions_mut().remove::<InFlight>() {
            KEPT.lock().unwrap().push(slot);
        }
        axum::response::Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .body(axum::body::Body::empty())
            .unwrap()
    }
    let outer = ConcurrencyLimitLayer::builder("outer")
        .global(n(10))
        .build()
        .unwrap();
    let inner = ConcurrencyLimitLayer::builder("inner")
        .global(n(10))
        .build()
        .unwrap();
    let app: Router = Router::new()
        .route("/ws", get(upgrade).route_layer(inner.clone()))
        .layer(outer.clone());
    let req = http::Request::get("/ws")
        .header("upgrade", "echo")
        .header("connection", "upgrade")
        .body(axum::body::Body::empty())
        .unwrap();
    let res = app.oneshot(req).await.unwrap();
    let _ = http_body_util::BodyExt::collect(res.into_body()).await;
    assert_eq!((outer.stats().in_flight, inner.stats().in_flight), (1, 1));
    KEPT.lock().unwrap().clear();
    assert_eq!((outer.stats().in_flight, inner.stats().in_flight), (0, 0));
}

/// A body that makes no progress for the layer's idle time is ended, and
/// its slot released, even while the server does not poll it; a body that
/// keeps yielding frames is not, however long it runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_body_that_makes_no_progress_frees_its_slot() {
    let limit = ConcurrencyLimitLayer::builder("stream")
        .global(n(1))
        .body_idle_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let (app, senders) = streaming_app(limit.clone());
    let a = serve(app).await;
    // A body that yields a frame every 100 ms for a second keeps its slot.
    let close = [("Connection", "close")];
    let (mut stream, head) = open(a, ip("127.0.36.1"), "/stream", &close, 6).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let body_tx = senders.lock().unwrap().try_recv().unwrap();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        body_tx.send(Bytes::from_static(b"tick\n")).await.unwrap();
        assert_eq!(limit.stats().in_flight, 1);
    }
    drop(body_tx);
    let all = read_all(&mut stream).await;
    assert!(all.ends_with("0\r\n\r\n"), "{all}");
    assert_eq!(limit.stats().bodies_stalled, 0);
    wait_until(|| limit.stats().in_flight == 0).await;

    // A body that yields nothing after its first frame: its slot comes
    // back once 300 ms have passed without progress (within a quarter
    // more), and the response is cut short, not completed.
    let (mut stream, _) = open(a, ip("127.0.36.2"), "/stream", &close, 6).await;
    let _quiet = senders.lock().unwrap().try_recv().unwrap();
    let started = Instant::now();
    assert_eq!(
        send(a, ip("127.0.36.3"), "GET", "/quick", &[], b"")
            .await
            .status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    wait_until(|| limit.stats().in_flight == 0).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(limit.stats().bodies_stalled, 1);
    assert_eq!(
        send(a, ip("127.0.36.3"), "GET", "/quick", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    let rest = read_all(&mut stream).await;
    assert!(!rest.ends_with("0\r\n\r\n"), "{rest}");
}

/// A body of `left` data frames of 8 MiB each, every one ready at once.
struct Big {
    left: usize,
}

impl http_body::Body for Big {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'x'; 8 << 20])))))
    }
}

/// Found in review: progress was a frame taken from the body, so a client
/// reading a large frame steadily, slower than its size per idle timeout,
/// was cut off as stalled (its slot given away while it still read). Large
/// frames are passed on in pieces now: 16 MiB read at about 2 MiB/s with a
/// 1 s idle timeout arrive whole, and the slot is held until they have.
#[tokio::test(flavor = "multi_thread")]
async fn a_steady_reader_of_large_frames_is_not_taken_for_stalled() {
    use tokio::io::AsyncWriteExt;
    let limit = ConcurrencyLimitLayer::builder("download")
        .global(n(1))
        .body_idle_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/big",
            get(|| async { axum::body::Body::new(Big { left: 2 }) }),
        )
        .route("/quick", get(|| async { "ok" }))
        .layer(limit.clone());
    let a = serve(app).await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(64 * 1024).unwrap();
    socket
        .bind(std::net::SocketAddr::new(ip("127.0.38.1"), 0))
        .unwrap();
    let mut stream = socket.connect(a).await.unwrap();
    stream
        .write_all(b"GET /big HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (mut total, mut tail, mut during) = (0, Vec::new(), None);
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        let n = match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        total += n;
        tail.extend_from_slice(&buf[..n]);
        tail.drain(..tail.len().saturating_sub(16));
        // Well past the idle timeout, and still reading: the slot is held.
        if during.is_none() && started.elapsed() > Duration::from_millis(2500) {
            during = Some(
                send(a, ip("127.0.38.2"), "GET", "/quick", &[], b"")
                    .await
                    .status,
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(total > 16 << 20, "{total} bytes");
    assert!(tail.ends_with(b"0\r\n\r\n"), "the download was cut short");
    assert_eq!(during, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(limit.stats().bodies_stalled, 0);
}

/// What is left on `stream` until the server closes it (within 10 s).
async fn read_all(stream: &mut tokio::net::TcpStream) -> String {
    let mut all = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut all));
    let _ = read
        .await
        .expect("the server closes the connection within 10 s");
    String::from_utf8_lossy(&all).into_owned()
}

/// Opens an HTTP/2 connection from `from` whose flow-control window is
/// zero (`SETTINGS_INITIAL_WINDOW_SIZE = 0`): the server can send response
/// heads but no body, and never hears that one ended. Sends `count`
/// requests for `path` as `who`, and gives back their statuses with the
/// connection (kept open while it is held).
async fn stalled_h2(
    server: std::net::SocketAddr,
    from: &str,
    path: &str,
    who: (&str, &str),
    count: usize,
) -> (Vec<StatusCode>, impl Drop) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(std::net::SocketAddr::new(ip(from), 0)).unwrap();
    let stream = socket.connect(server).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(0)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let mut statuses = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..count {
        let req = http::Request::get(format!("http://{server}{path}"))
            .header(who.0, who.1)
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let r = sender.clone().send_request(req).await.unwrap();
        statuses.push(r.status());
        bodies.push(r.into_body());
    }
    /// The connection, and the bodies never read: held open, then closed.
    struct Held<S, B> {
        connection: tokio::task::JoinHandle<S>,
        _bodies: Vec<B>,
    }
    impl<S, B> Drop for Held<S, B> {
        fn drop(&mut self) {
            self.connection.abort();
        }
    }
    let held = Held {
        connection: conn,
        _bodies: bodies,
    };
    (statuses, held)
}

/// Found where features meet: over HTTP/2 with a window of zero, the
/// quickstart's `/slow` answered its head and never its body, and held its
/// in-flight slots for as long as the client kept the connection open.
/// Now a body that makes no progress for 5 s ends and frees its slots:
/// bob is refused while his two stalled streams hold his slots, and
/// admitted again once they have been idle for 5 s, the connection still
/// open. With `--store`, the same for the fleet's leases.
async fn stalled_streams_free_their_slots(args: &[&str]) {
    const BOB: (&str, &str) = ("Authorization", "Bearer bob-key");
    let q = quickstart(args);
    let started = Instant::now();
    let (statuses, _connection) = stalled_h2(q.addr, "127.0.37.1", "/slow?ms=0", BOB, 2).await;
    assert_eq!(statuses, [StatusCode::OK, StatusCode::OK]);
    let bob = |from: &'static str| async move {
        send(q.addr, ip(from), "GET", "/slow?ms=0", &[BOB], b"")
            .await
            .status
    };
    assert_eq!(bob("127.0.37.2").await, StatusCode::TOO_MANY_REQUESTS);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(bob("127.0.37.3").await, StatusCode::TOO_MANY_REQUESTS);
    // Idle for 5 s, found within a second more: free by ~6.5 s.
    let deadline = started + Duration::from_secs(15);
    let mut from = 4;
    while bob(Box::leak(format!("127.0.37.{from}").into_boxed_str())).await != StatusCode::OK {
        assert!(
            Instant::now() < deadline,
            "bob's stalled streams still hold his slots"
        );
        from += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(5));
    let log = q.log.lock().unwrap().clone();
    assert!(log.contains("a response body made no progress"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn stalled_http2_streams_free_their_slots_in_memory() {
    stalled_streams_free_their_slots(&[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stalled_http2_streams_free_their_leases_in_redis() {
    let redis = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    stalled_streams_free_their_slots(&["--store", &redis.url()]).await;
}

/// Found in review: a limit with neither a global nor a per-key bound was
/// built, and limited nothing. It is a configuration error, as a bad name.
#[test]
fn a_limit_without_a_bound_is_refused() {
    let e = ConcurrencyLimitLayer::builder("nothing")
        .build()
        .unwrap_err();
    assert_eq!(e.name(), "nothing");
    assert!(e.to_string().contains("no bound"), "{e}");
    let e = ConcurrencyLimitLayer::builder("bad name!")
        .global(std::num::NonZeroUsize::MIN)
        .build()
        .unwrap_err();
    assert_eq!(e.lease(), None, "{e}");
    assert!(
        ConcurrencyLimitLayer::builder("one")
            .global(std::num::NonZeroUsize::MIN)
            .build()
            .is_ok()
    );
}

/// An adaptive global limit over real sockets: the layer enforces the
/// controller's limit (bounds 2..=2: it can only say 2), the handler's
/// answers and their bodies are what it measures, and a server error it
/// counts cuts the limit it then enforces.
#[tokio::test(flavor = "multi_thread")]
async fn an_adaptive_limit_is_enforced_and_fed_over_real_sockets() {
    use tollgate::concurrency::AdaptiveConfig;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = {
        let gate = gate.clone();
        move || {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                "done"
            }
        }
    };
    let config = AdaptiveConfig::builder().bounds(2, 2).build().unwrap();
    let layer = ConcurrencyLimitLayer::builder("adaptive")
        .adaptive(config)
        .build()
        .unwrap();
    let app = Router::new().route("/held", get(held)).layer(layer.clone());
    let a = serve(app).await;
    let first: Vec<_> = (0..2)
        .map(|i| {
            tokio::spawn(async move {
                send(
                    a,
                    ip(&format!("127.0.31.{}", i + 1)),
                    "GET",
                    "/held",
                    &[],
                    b"",
                )
                .await
            })
        })
        .collect();
    wait_until(|| layer.stats().in_flight == 2).await;
    let third = send(a, ip("127.0.31.3"), "GET", "/held", &[], b"").await;
    assert_eq!(third.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(layer.stats().global_limit, Some(2));
    gate.add_permits(2);
    for call in first {
        assert_eq!(call.await.unwrap().status, StatusCode::OK);
    }
    wait_until(|| layer.stats().in_flight == 0).await;

    // Server errors counted as failures cut the limit, window after window.
    let config = AdaptiveConfig::builder()
        .bounds(1, 10)
        .initial(10)
        .window(Duration::from_millis(20))
        .probe_interval(Duration::from_secs(3600))
        .probe_limit(10)
        .probe_samples(1)
        .build()
        .unwrap();
    let layer = ConcurrencyLimitLayer::builder("adaptive")
        .adaptive(config)
        .build()
        .unwrap();
    let app = Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/fail", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .layer(layer.clone());
    let a = serve(app).await;
    // One success ends the first probe.
    assert_eq!(
        send(a, ip("127.0.31.4"), "GET", "/ok", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    let before = layer.stats().global_limit.unwrap();
    for _ in 0..40 {
        let reply = send(a, ip("127.0.31.5"), "GET", "/fail", &[], b"").await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let after = layer.stats().global_limit.unwrap();
    assert!(
        after < before,
        "40 server errors over 40 windows: {before} -> {after}"
    );
}

/// One data frame, then the end, with `is_end_stream` left at its default
/// (false), as a stream body's (a file, a proxied body) is.
struct OneFrame(Option<Bytes>);

impl http_body::Body for OneFrame {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().0.take().map(|b| Ok(Frame::data(b))))
    }
}

/// Found in review: over HTTP/1.1 the server never polls the body of an
/// answer to `HEAD`, nor a stream body past its declared `Content-Length`,
/// so those requests were taken for cancelled and never gave a latency:
/// an adaptive limit serving only them never left its first probe (3).
#[tokio::test(flavor = "multi_thread")]
async fn answers_whose_bodies_are_not_polled_to_the_end_are_still_measured() {
    use tollgate::concurrency::AdaptiveConfig;
    for (method, path) in [("HEAD", "/plain"), ("GET", "/declared"), ("GET", "/empty")] {
        let layer = ConcurrencyLimitLayer::builder("adaptive")
            .adaptive(AdaptiveConfig::builder().bounds(1, 1000).build().unwrap())
            .build()
            .unwrap();
        let app = Router::new()
            .route("/plain", get(|| async { "plain body" }))
            .route(
                "/declared",
                get(|| async {
                    axum::response::Response::builder()
                        .header("content-length", "5")
                        .body(axum::body::Body::new(OneFrame(Some(Bytes::from_static(
                            b"12345",
                        )))))
                        .unwrap()
                }),
            )
            .route(
                "/empty",
                get(|| async {
                    axum::response::Response::builder()
                        .header("content-length", "0")
                        .body(axum::body::Body::new(OneFrame(None)))
                        .unwrap()
                }),
            )
            .layer(layer.clone());
        let a = serve(app).await;
        assert_eq!(layer.stats().global_limit, Some(3), "probing at first");
        for _ in 0..30 {
            let reply = send(a, ip("127.0.32.1"), method, path, &[], b"").await;
            assert_eq!(reply.status, StatusCode::OK);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        wait_until(|| layer.stats().in_flight == 0).await;
        // (An arrival lets the controller see the time.)
        send(a, ip("127.0.32.1"), "GET", "/plain", &[], b"").await;
        assert_ne!(
            layer.stats().global_limit,
            Some(3),
            "{method} {path}: 30 answers measured, the first probe is over"
        );
    }
}
