//! Shaping over real sockets: the quickstart's `GET /shaped` releases a
//! burst at the sustained rate instead of refusing it (seen from the
//! client), on the in-memory store and on Redis; a request the layer
//! refuses itself is never held; the waiting caps hold; a waiter that goes
//! away gives its reservation back.

mod common;

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use common::{ip, quickstart, send, serve};
use http::StatusCode;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};

const ALICE: (&str, &str) = ("Authorization", "Bearer alice-key-1");

/// Eight concurrent `GET /shaped` of alice from eight addresses: five 200,
/// released about 0.5 s apart (0, 0.5, 1, 1.5, 2 s), and three 429 at once
/// with `Retry-After`. Releases are never early, so the lower bounds are
/// exact; the upper bounds only allow for a busy machine.
///
/// Through a store with a round trip (Redis) a request holds its place in
/// line while it is decided, so a request admitted at once may have taken
/// one of the four places: four or five are admitted then, and a request
/// refused unshaped early in the burst waits less (`Retry-After` 1).
async fn eight_at_once(
    addr: std::net::SocketAddr,
    first_octet: u8,
    admitted_range: (usize, usize),
) {
    let started = Instant::now();
    let tasks: Vec<_> = (0..8u8)
        .map(|i| {
            let from = ip(&format!("127.0.{first_octet}.{}", 10 + i));
            tokio::spawn(async move {
                let r = send(addr, from, "GET", "/shaped", &[ALICE], b"").await;
                (r, started.elapsed())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    let shortest_wait = if admitted_range.0 == admitted_range.1 {
        2
    } else {
        1
    };
    for t in tasks {
        let (r, after) = t.await.unwrap();
        match r.status {
            StatusCode::OK => admitted.push(after),
            StatusCode::TOO_MANY_REQUESTS => {
                let wait: u64 = r.header("retry-after").unwrap().parse().unwrap();
                assert!((shortest_wait..=3).contains(&wait), "Retry-After {wait}");
                refused.push(after);
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(
        (admitted_range.0..=admitted_range.1).contains(&admitted.len())
            && admitted.len() + refused.len() == 8,
        "{admitted:?} {refused:?}"
    );
    admitted.sort();
    for (k, after) in admitted.iter().enumerate() {
        let due = Duration::from_millis(500 * k as u64);
        // Never released before its instant (less the spread of arrivals).
        assert!(
            *after + Duration::from_millis(60) >= due,
            "release {k} after {after:?}"
        );
        assert!(
            *after < due + Duration::from_millis(900),
            "release {k} after {after:?}"
        );
    }
    for after in refused {
        assert!(
            after < Duration::from_millis(900),
            "a refusal took {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_is_released_at_the_sustained_rate_in_memory() {
    let q = quickstart(&[]);
    eight_at_once(q.addr, 70, (5, 5)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_is_released_at_the_sustained_rate_in_redis() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let q = quickstart(&["--store", &server.url()]);
    eight_at_once(q.addr, 71, (4, 5)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_refused_for_its_own_reasons_is_never_held() {
    let q = quickstart(&[]);
    let started = Instant::now();
    for _ in 0..3 {
        let r = send(q.addr, ip("127.0.72.1"), "GET", "/shaped", &[], b"").await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    }
    assert!(started.elapsed() < Duration::from_millis(900));
}

fn shaped_app(per_key: usize, layer_max: usize) -> Router {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .max_waiting(layer_max)
        .rule(
            Rule::new(Policy::token_bucket("held", 1, Rate::per_second(4)).unwrap())
                .keyed_by([tollgate::KeyPart::ClientIp])
                .shape(Duration::from_secs(5), NonZeroUsize::new(per_key).unwrap()),
        )
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// At most `per_key` of one key wait, and at most `max_waiting` in the
/// layer: beyond them a request is decided unshaped (here: refused).
#[tokio::test(flavor = "multi_thread")]
async fn waiting_is_bounded_per_key_and_per_layer() {
    for (per_key, layer_max, from) in [(2, 100, "127.0.73.1"), (100, 2, "127.0.73.2")] {
        let addr = serve(shaped_app(per_key, layer_max)).await;
        let started = Instant::now();
        let tasks: Vec<_> = (0..5)
            .map(|_| {
                tokio::spawn(async move { send(addr, ip(from), "GET", "/", &[], b"").await.status })
            })
            .collect();
        let mut statuses = Vec::new();
        for t in tasks {
            statuses.push(t.await.unwrap());
        }
        let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
        // One at once, then two held (0.25 s, 0.5 s); the rest refused.
        assert_eq!(ok, 3, "per_key {per_key}, layer {layer_max}: {statuses:?}");
        assert!(started.elapsed() < Duration::from_secs(3));
    }
}

/// A bucket of 1 at 2/s that may hold a request 10 s, but at most two of
/// one address at once.
fn tight_app<St: tollgate::Store + Clone>(store: St) -> Router {
    let layer = RateLimitLayer::builder(store)
        .rule(
            Rule::new(Policy::token_bucket("tight", 1, Rate::per_second(2)).unwrap())
                .keyed_by([tollgate::KeyPart::ClientIp])
                .shape(Duration::from_secs(10), NonZeroUsize::new(2).unwrap()),
        )
        .build()
        .unwrap();
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(layer)
}

/// Found in review: on Redis, twenty requests of one address decided at
/// the same time were all reserved before any entered the line; the
/// seventeen beyond `per_key` were then refused, but their reservations
/// (not last in line) stayed spent, and the one request that did get a
/// place waited 9 s. The store now bounds the line itself: one at once,
/// two held (0.5 s, 1 s), the rest refused at once spending nothing, so
/// the next request waits for the line, not for seventeen ghosts.
async fn a_burst_beyond_per_key_spends_nothing(
    addr: std::net::SocketAddr,
    from: &'static str,
    admits: std::ops::RangeInclusive<usize>,
) {
    let started = Instant::now();
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            tokio::spawn(async move {
                let r = send(addr, ip(from), "GET", "/", &[], b"").await;
                (r.status, started.elapsed())
            })
        })
        .collect();
    let mut admitted = Vec::new();
    for t in tasks {
        let (status, after) = t.await.unwrap();
        match status {
            StatusCode::OK => admitted.push(after),
            StatusCode::TOO_MANY_REQUESTS => assert!(after < Duration::from_millis(900)),
            other => panic!("unexpected {other}"),
        }
    }
    admitted.sort();
    assert!(admits.contains(&admitted.len()), "{admitted:?}");
    // Released 0.5 s apart at most: nothing waited behind ghosts.
    assert!(
        admitted[admitted.len() - 1] < Duration::from_millis(1900),
        "{admitted:?}"
    );
    // The line ended at 1 s: a request now is held to 1.5 s at most.
    let r = send(addr, ip(from), "GET", "/", &[], b"").await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(started.elapsed() < Duration::from_millis(2400));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_beyond_per_key_spends_nothing_in_memory() {
    let addr = serve(tight_app(MemoryStore::new())).await;
    a_burst_beyond_per_key_spends_nothing(addr, "127.0.74.1", 3..=3).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_beyond_per_key_spends_nothing_in_redis() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let store = tollgate::RedisStore::builder(&server.url())
        .unwrap()
        .build()
        .unwrap();
    let addr = serve(tight_app(store)).await;
    // A request whose decision is on its way to Redis holds its place in
    // line (README, shaping): when all twenty arrive before the first
    // reply, the first two places are the first two requests, one
    // admitted at once and one held, and the rest are refused; when the
    // first reply comes back before the later requests arrive, its place
    // is free again and a third is held. A CI run here saw two.
    a_burst_beyond_per_key_spends_nothing(addr, "127.0.74.2", 2..=3).await;
}
