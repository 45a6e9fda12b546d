//! Store faults against a real redis-server: unreachable at start, killed
//! mid-run and restarted, scripts flushed, paused past the timeout, full
//! memory. Every call gets an answer within the timeout plus a margin; the
//! store recovers by itself.

use std::time::{Duration, Instant};

use tollgate_budget::{Charge, Key, Policy, Rate, Store, StoreErrorKind};
use tollgate_redis::RedisStore;
use tollgate_testkit::RedisServer;

const TIMEOUT: Duration = Duration::from_millis(200);
const MARGIN: Duration = Duration::from_millis(300);

fn charge(key: &str) -> Charge {
    let p = Policy::token_bucket("f", 1_000_000, Rate::per_second(1000)).unwrap();
    Charge::new(Key::new("f").with(key), p, 1).unwrap()
}

async fn timed(store: &RedisStore, key: &str) -> (Result<bool, StoreErrorKind>, Duration) {
    let started = Instant::now();
    let r = store
        .charge(&[charge(key)])
        .await
        .map(|o| o.is_admitted())
        .map_err(|e| e.kind());
    (r, started.elapsed())
}

async fn until_ok(store: &RedisStore) -> Duration {
    let started = Instant::now();
    loop {
        let (r, took) = timed(store, "probe").await;
        assert!(took <= TIMEOUT + MARGIN, "a call took {took:?}");
        if r == Ok(true) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "store did not recover: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_while_unreachable_then_connects_by_itself() {
    let mut server = tollgate_testkit::or_skip!(RedisServer::start());
    let url = server.url();
    server.kill();
    let store = RedisStore::builder(&url)
        .unwrap()
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    for _ in 0..5 {
        let (r, took) = timed(&store, "a").await;
        assert!(
            matches!(
                r,
                Err(StoreErrorKind::Unavailable | StoreErrorKind::Uncertain)
            ),
            "{r:?}"
        );
        assert!(took <= TIMEOUT + MARGIN, "{took:?}");
    }
    server.restart();
    until_ok(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_run_and_restarted_recovers_without_a_new_store() {
    let mut server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    let load = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut outcomes = (0u32, 0u32, Duration::ZERO);
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(2) {
                let (r, took) = timed(&store, "load").await;
                outcomes.2 = outcomes.2.max(took);
                match r {
                    Ok(_) => outcomes.0 += 1,
                    Err(_) => outcomes.1 += 1,
                }
            }
            outcomes
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill();
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.restart();
    let (ok, failed, worst) = load.await.unwrap();
    assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
    assert!(worst <= TIMEOUT + MARGIN, "worst call {worst:?}");
    until_ok(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_is_survived() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    assert_eq!(timed(&store, "s").await.0, Ok(true));
    server.query(&["SCRIPT", "FLUSH"]).unwrap();
    assert_eq!(timed(&store, "s").await.0, Ok(true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_past_the_timeout_is_uncertain_then_recovers() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    assert_eq!(timed(&store, "p").await.0, Ok(true));
    server.signal("STOP");
    let (r, took) = timed(&store, "p").await;
    assert_eq!(r, Err(StoreErrorKind::Uncertain));
    assert!(took >= TIMEOUT && took <= TIMEOUT + MARGIN, "{took:?}");
    server.signal("CONT");
    until_ok(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_memory_with_noeviction_is_unavailable_not_an_empty_counter() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(TIMEOUT)
        .build()
        .unwrap();
    assert_eq!(timed(&store, "m").await.0, Ok(true));
    server
        .query(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .unwrap();
    server.query(&["CONFIG", "SET", "maxmemory", "1"]).unwrap();
    let (r, took) = timed(&store, "m2").await;
    assert_eq!(r, Err(StoreErrorKind::Unavailable));
    assert!(took <= TIMEOUT + MARGIN);
    server.query(&["CONFIG", "SET", "maxmemory", "0"]).unwrap();
    assert_eq!(timed(&store, "m2").await.0, Ok(true));
}
