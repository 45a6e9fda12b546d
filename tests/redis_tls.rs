//! The quickstart against a TLS Redis: `--store rediss://… --redis-ca FILE`
//! trusts a private CA, and redis-rs's `#insecure` URL form (no
//! verification, for local tries only) is accepted.

mod common;

use common::{ip, quickstart, send};
use http::StatusCode;
use tollgate_testkit::{RedisServer, TestCertificates, free_loopback_port};

#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_shares_budgets_through_a_tls_redis() {
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    let tls_port = free_loopback_port();
    let args = certs.server_args(tls_port, "server.pem");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = tollgate_testkit::or_skip!(RedisServer::start_with(&args));
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let ca = certs.path("ca.pem").to_string_lossy().into_owned();
    let verified = quickstart(&["--store", &url, "--redis-ca", &ca]);
    let insecure = quickstart(&["--store", &format!("{url}/#insecure")]);
    // One address budget of 5 shared by both instances, through TLS.
    let mut statuses = Vec::new();
    for i in 0..6 {
        let q = if i % 2 == 0 { &verified } else { &insecure };
        statuses.push(
            send(q.addr, ip("127.0.80.1"), "GET", "/", &[], b"")
                .await
                .status,
        );
    }
    assert_eq!(statuses[..5], [StatusCode::OK; 5], "{statuses:?}");
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS);
    let keys = server.query(&["KEYS", "tollgate:*"]).unwrap();
    assert!(keys.contains("per-ip"), "{keys}");
}

/// The quickstart connects to Redis (and loads the scripts) before it
/// listens, so its first requests over TLS are answered as later ones are:
/// thirty at once, right after it starts, from thirty addresses, all 200.
#[tokio::test(flavor = "multi_thread")]
async fn the_quickstart_connects_before_it_listens() {
    let certs = tollgate_testkit::or_skip!(TestCertificates::generate());
    let tls_port = free_loopback_port();
    let args = certs.server_args(tls_port, "server.pem");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = tollgate_testkit::or_skip!(RedisServer::start_with(&args));
    let url = format!("rediss://127.0.0.1:{tls_port}");
    let ca = certs.path("ca.pem").to_string_lossy().into_owned();
    let q = quickstart(&["--store", &url, "--redis-ca", &ca]);
    // Listening means connected, with the scripts loaded.
    let sha = tollgate::RedisStore::script_sha();
    assert_eq!(server.query(&["SCRIPT", "EXISTS", &sha]).unwrap(), "1");
    let first: Vec<_> = (1..=30)
        .map(|host| {
            let addr = q.addr;
            tokio::spawn(async move {
                let from = ip(&format!("127.0.86.{host}"));
                send(addr, from, "GET", "/", &[], b"").await.status
            })
        })
        .collect();
    for task in first {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
}
