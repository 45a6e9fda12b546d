//! The quickstart's admin routes over loopback: three quickstarts on one
//! private `redis-server`; a change of `export` published through A is
//! in force on B and C within a second (from the `PUT`'s answer to C's
//! version, then a fresh account admitted 6 times on C); a fourth started
//! afterwards admits 6; a bad body, a wrong token, a rule nobody has
//! change nothing anywhere. Without `--store`, the same routes change the
//! one process.

mod common;

use std::time::{Duration, Instant};

use common::{Quickstart, ip, quickstart, send};
use http::StatusCode;
use tollgate_testkit::{RedisServer, or_skip};

const TOKEN: &str = "admin-token-for-tests";

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// `PUT path` with `body` and the token; from its own address so that the
/// per-address rule does not run out.
async fn put(q: &Quickstart, path: &str, body: &str, from: &str) -> common::Reply {
    send(
        q.addr,
        ip(from),
        "PUT",
        path,
        &[
            ("Authorization", &bearer()),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    )
    .await
}

/// `GET /admin/policies` with the token.
async fn show(q: &Quickstart, from: &str) -> common::Reply {
    send(
        q.addr,
        ip(from),
        "GET",
        "/admin/policies",
        &[("Authorization", &bearer())],
        b"",
    )
    .await
}

/// The version `q` runs (`GET /admin/policies`).
async fn version(q: &Quickstart, from: &str) -> u64 {
    let reply = show(q, from).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let json: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    json["version"].as_u64().unwrap()
}

/// How many of 8 `POST /export` of `key`'s account `q` admits, each from
/// its own address (only the account's budget counts).
async fn exports(q: &Quickstart, key: &str, net: u8) -> usize {
    let mut admitted = 0;
    for i in 0..8 {
        let reply = send(
            q.addr,
            ip(&format!("127.0.{net}.{}", 10 + i)),
            "POST",
            "/export",
            &[("Authorization", &format!("Bearer {key}"))],
            b"",
        )
        .await;
        if reply.status == StatusCode::OK {
            admitted += 1;
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread")]
async fn a_change_through_one_quickstart_is_in_force_on_every_one() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let args = ["--store", url.as_str(), "--admin-token", TOKEN];
    let (a, b, c) = (quickstart(&args), quickstart(&args), quickstart(&args));
    assert_eq!(version(&c, "127.0.1.1").await, 0);

    let reply = put(
        &a,
        "/admin/policies/export",
        r#"{"capacity": 6, "refill": {"per_second": 2}}"#,
        "127.0.1.2",
    )
    .await;
    let answered = Instant::now();
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let json: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(json["version"], 1);
    assert_eq!(json["set"]["rules"]["export"]["policy"]["capacity"], 6);
    for q in [&b, &c] {
        while version(q, "127.0.1.3").await < 1 {
            assert!(
                answered.elapsed() < Duration::from_secs(1),
                "not in force within 1 s"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    eprintln!(
        "in force on B and C {:?} after the PUT's answer",
        answered.elapsed()
    );
    // A fresh account (bob) on C: 6 at once.
    assert_eq!(exports(&c, "bob-key", 20).await, 6);

    // Started afterwards: the set before it serves.
    let d = quickstart(&args);
    assert_eq!(version(&d, "127.0.1.4").await, 1);
    assert_eq!(exports(&d, "carol-key", 21).await, 6);

    // A plan: dave (pro) gets 2 on every quickstart.
    let reply = put(
        &b,
        "/admin/policies/export/plans/pro",
        r#"{"capacity": 2, "refill": {"per_minute": 1}}"#,
        "127.0.1.5",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    let json: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(json["version"], 2);
    assert_eq!(
        json["set"]["rules"]["export"]["policy"]["capacity"], 6,
        "kept"
    );
    while version(&d, "127.0.1.6").await < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(exports(&d, "dave-key", 22).await, 2);

    // Bad input changes nothing anywhere.
    let bad = [
        (
            "/admin/policies/export",
            r#"{"capacity": 0, "refill": {"per_second": 2}}"#,
            StatusCode::BAD_REQUEST,
            "rules.export.policy.capacity: must be at least 1",
        ),
        (
            "/admin/policies/export",
            r#"{"capacity": 6}"#,
            StatusCode::BAD_REQUEST,
            "rules.export.policy.refill: missing",
        ),
        (
            "/admin/policies/export",
            "not json",
            StatusCode::BAD_REQUEST,
            "not JSON",
        ),
        (
            "/admin/policies/export",
            r#"{"capacity": 6, "refill": {"per_second": 2}, "plans": {"pro": {}}}"#,
            StatusCode::BAD_REQUEST,
            "unknown field",
        ),
        (
            "/admin/policies/nope",
            r#"{"capacity": 6, "refill": {"per_second": 2}}"#,
            StatusCode::NOT_FOUND,
            "no rule",
        ),
    ];
    for (i, (path, body, status, says)) in bad.into_iter().enumerate() {
        let reply = put(&a, path, body, &format!("127.0.2.{}", 10 + i)).await;
        assert_eq!(reply.status, status, "{body}: {}", reply.body);
        assert!(reply.body.contains(says), "{body}: {}", reply.body);
    }
    let wrong = send(
        a.addr,
        ip("127.0.3.1"),
        "PUT",
        "/admin/policies/export",
        &[("Authorization", "Bearer not-the-token")],
        br#"{"capacity": 99, "refill": {"per_second": 99}}"#,
    )
    .await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert_eq!(wrong.header("www-authenticate"), Some("Bearer"));
    tokio::time::sleep(Duration::from_millis(700)).await;
    for (i, q) in [&a, &b, &c, &d].into_iter().enumerate() {
        assert_eq!(version(q, &format!("127.0.4.{}", 10 + i)).await, 2);
    }
    // Guessing the token spends the address's login-failures budget (3).
    for _ in 0..3 {
        let r = send(a.addr, ip("127.0.3.2"), "GET", "/admin/policies", &[], b"").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    let r = show(&a, "127.0.3.2").await;
    assert_eq!(
        r.status,
        StatusCode::TOO_MANY_REQUESTS,
        "even with the token"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_store_the_routes_change_the_one_process_and_without_a_token_there_are_none() {
    let q = quickstart(&["--admin-token", TOKEN]);
    let reply = put(
        &q,
        "/admin/policies/export",
        r#"{"capacity": 6, "refill": {"per_second": 2}}"#,
        "127.0.5.1",
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(version(&q, "127.0.5.2").await, 1);
    assert_eq!(exports(&q, "bob-key", 23).await, 6);

    let plain = quickstart(&[]);
    let reply = show(&plain, "127.0.5.3").await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "no admin routes");
}
