//! gRPC over HTTP/2 with a real tonic client: the `grpc` example (tonic's
//! generated health service behind tollgate) answers each refusal with the
//! gRPC code a client acts on, a readable message, retry pushback and the
//! RateLimit fields as metadata; a server-streaming call holds its
//! concurrency slot until the stream ends; gRPC-Web callers get the
//! gRPC-Web form; the quickstart speaks HTTP/2 too.

mod common;

use std::time::Duration;

use common::{example, ip, quickstart, send};
use http::StatusCode;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn check(key: Option<&str>) -> tonic::Request<HealthCheckRequest> {
    let mut req = tonic::Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(key) = key {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
    }
    req
}

async fn client(addr: std::net::SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

fn meta<'a>(status: &'a tonic::Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).and_then(|v| v.to_str().ok())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tonic_client_reads_every_refusal_as_its_grpc_code() {
    let server = example("grpc", &["--serve", "127.0.0.1:0"]);
    let mut health = client(server.addr).await;
    for _ in 0..3 {
        health.check(check(Some("alice-key"))).await.unwrap();
    }
    // Over the account's budget: RESOURCE_EXHAUSTED, with when to retry.
    let status = health.check(check(Some("alice-key"))).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("per-account"),
        "{}",
        status.message()
    );
    let pushback: u64 = meta(&status, "grpc-retry-pushback-ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=1000).contains(&pushback), "{pushback}");
    // The message says the same wait as the pushback, in its unit.
    assert!(
        status
            .message()
            .ends_with(&format!("; retry after {pushback} ms")),
        "{} (pushback {pushback})",
        status.message()
    );
    assert!(
        meta(&status, "ratelimit")
            .unwrap()
            .contains("\"per-account\";r=0")
    );
    assert!(
        meta(&status, "ratelimit-policy")
            .unwrap()
            .contains("\"per-account\";q=3")
    );
    // After the pushback the call goes through.
    tokio::time::sleep(Duration::from_millis(pushback)).await;
    health.check(check(Some("alice-key"))).await.unwrap();
    // No principal: UNAUTHENTICATED, naming what is missing.
    let status = health.check(check(None)).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("authenticated principal"));
    assert!(meta(&status, "grpc-retry-pushback-ms").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_failure_is_unavailable() {
    let server = example(
        "grpc",
        &["--serve", "127.0.0.1:0", "--store", "redis://127.0.0.1:1"],
    );
    let mut health = client(server.addr).await;
    let status = health.check(check(Some("alice-key"))).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("unavailable"),
        "{}",
        status.message()
    );
    // The operator sees why on the example's stderr.
    let mut logged = false;
    for _ in 0..50 {
        logged = server.log.lock().unwrap().contains("store failed");
        if logged {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        logged,
        "no store failure in the log: {}",
        server.log.lock().unwrap()
    );
}

/// A server-streaming `Watch` holds the account's one in-flight slot until
/// the stream ends: a call of the same account meanwhile is refused, and
/// admitted once the client has dropped the stream.
#[tokio::test(flavor = "multi_thread")]
async fn a_stream_holds_its_slot_until_it_ends() {
    let server = example("grpc", &["--serve", "127.0.0.1:0"]);
    let mut health = client(server.addr).await;
    let mut watch = health
        .watch(check(Some("bob-key")))
        .await
        .unwrap()
        .into_inner();
    assert!(watch.message().await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = health.check(check(Some("bob-key"))).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("in flight"),
        "{}",
        status.message()
    );
    // Alice is not bob: her slot is her own.
    health.check(check(Some("alice-key"))).await.unwrap();
    drop(watch);
    // Bob's budget of 3 had two calls; the slot comes free with the stream.
    let mut admitted = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        if health.check(check(Some("bob-key"))).await.is_ok() {
            admitted = true;
            break;
        }
    }
    assert!(admitted, "the slot was not freed when the stream ended");
}

/// gRPC-Web (here over HTTP/1.1, as browsers send it): a trailers-only
/// answer in gRPC-Web's content type, the status in the headers.
#[tokio::test(flavor = "multi_thread")]
async fn grpc_web_callers_get_the_grpc_web_form() {
    let server = example("grpc", &["--serve", "127.0.0.1:0"]);
    let r = send(
        server.addr,
        ip("127.0.0.1"),
        "POST",
        "/grpc.health.v1.Health/Check",
        &[
            ("content-type", "application/grpc-web+proto"),
            ("x-grpc-web", "1"),
        ],
        b"\x00\x00\x00\x00\x00",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("content-type"), Some("application/grpc-web+proto"));
    assert_eq!(r.header("grpc-status"), Some("16"));
    assert!(r.body.is_empty());
    // Each caller is answered in its own content type, its message format
    // included.
    let r = send(
        server.addr,
        ip("127.0.0.1"),
        "POST",
        "/grpc.health.v1.Health/Check",
        &[
            ("content-type", "application/grpc-web-text+thrift"),
            ("x-grpc-web", "1"),
        ],
        b"AAAAAAA=",
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(
        r.header("content-type"),
        Some("application/grpc-web-text+thrift")
    );
    assert_eq!(r.header("grpc-status"), Some("16"));
}

/// The quickstart serves HTTP/2 (prior knowledge) and HTTP/1.1 on one port,
/// with the same limits: the sixth `GET /` in a burst is refused either way.
#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_speaks_http2_on_its_port() {
    use http_body_util::BodyExt;
    let q = quickstart(&[]);
    let stream = tokio::net::TcpStream::connect(q.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let req = http::Request::get(format!("http://{}/", q.addr))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let r = sender.send_request(req).await.unwrap();
        assert_eq!(r.version(), http::Version::HTTP_2);
        statuses.push(r.status());
        let _ = r.into_body().collect().await.unwrap();
    }
    assert_eq!(statuses[..5], [StatusCode::OK; 5]);
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS);
    // HTTP/1.1 from the same address shares the budget.
    let r = send(q.addr, ip("127.0.0.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
}
