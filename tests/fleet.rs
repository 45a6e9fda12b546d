//! Two quickstart processes with `--store redis://...` share one budget:
//! together they admit exactly the account budget of 3.

mod common;

use common::{ip, quickstart, send};
use http::StatusCode;
use tollgate_testkit::RedisServer;

#[tokio::test(flavor = "multi_thread")]
async fn two_quickstart_processes_admit_exactly_the_shared_budget() {
    let redis = tollgate_testkit::or_skip!(RedisServer::start());
    let url = redis.url();
    let a = quickstart(&["--store", &url]);
    let b = quickstart(&["--store", &url]);
    for (trial, key) in ["alice-key-1", "bob-key", "carol-key"]
        .into_iter()
        .enumerate()
    {
        let auth = format!("Bearer {key}");
        let tasks: Vec<_> = (0..40)
            .map(|i| {
                let server = if i % 2 == 0 { a.addr } else { b.addr };
                // Distinct source addresses: only the account budget is shared.
                let from = ip(&format!("127.0.{}.{}", 40 + trial, 10 + i));
                let auth = auth.clone();
                tokio::spawn(async move {
                    send(
                        server,
                        from,
                        "POST",
                        "/export",
                        &[("Authorization", &auth)],
                        b"",
                    )
                    .await
                    .status
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            let status = t.await.unwrap();
            assert!(
                status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                "{status}"
            );
            ok += usize::from(status == StatusCode::OK);
        }
        assert_eq!(
            ok, 3,
            "{key}: two processes admitted {ok} against one budget of 3"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_outage_fails_closed_with_503_not_429() {
    let mut redis = tollgate_testkit::or_skip!(RedisServer::start());
    let q = quickstart(&["--store", &redis.url()]);
    assert_eq!(
        send(q.addr, ip("127.0.50.1"), "GET", "/", &[], b"")
            .await
            .status,
        StatusCode::OK
    );
    redis.kill();
    let r = send(q.addr, ip("127.0.50.1"), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.header("cache-control"), Some("no-store"));
    // The health check is exempt from every rule: no store call, 200.
    let r = send(q.addr, ip("127.0.50.1"), "GET", "/healthz", &[], b"").await;
    assert_eq!(r.status, StatusCode::OK);
    redis.restart();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let r = send(q.addr, ip("127.0.50.2"), "GET", "/", &[], b"").await;
        if r.status == StatusCode::OK {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "did not recover: {}",
            r.status
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
