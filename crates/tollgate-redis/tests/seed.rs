//! The field notes' shared-budget check ("Rate limiting is a shared
//! budget"), ported to Rust against a private redis-server.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tollgate_budget::{Charge, Key, Policy, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::{RedisServer, decode_state};

const LIMIT: u64 = 5;
const WORKERS: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn split_check_overspends_and_the_script_admits_exactly_five() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let url = server.url();

    // The broken path: every caller reads before any increments.
    server.query(&["SET", "budget:unsafe", "0"]).unwrap();
    let barrier = Arc::new(Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (url, barrier) = (url.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            let client = redis::Client::open(url).unwrap();
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let observed: u64 = redis::cmd("GET")
                .arg("budget:unsafe")
                .query_async(&mut conn)
                .await
                .unwrap();
            barrier.wait().await;
            if observed >= LIMIT {
                return false;
            }
            let _: u64 = redis::cmd("INCR")
                .arg("budget:unsafe")
                .query_async(&mut conn)
                .await
                .unwrap();
            true
        }));
    }
    let mut unsafe_admitted = 0;
    for t in tasks {
        unsafe_admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(unsafe_admitted, WORKERS);
    assert_eq!(server.query(&["GET", "budget:unsafe"]).unwrap(), "16");

    // The store: one atomic script per decision, 16 independent connections.
    let policy = Policy::fixed_window("budget", LIMIT, Duration::from_secs(60)).unwrap();
    let charge = Charge::new(Key::new("budget").with("shared"), policy, 1).unwrap();
    let barrier = Arc::new(Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let (url, barrier, charge) = (url.clone(), barrier.clone(), charge.clone());
        tasks.push(tokio::spawn(async move {
            let store = RedisStore::builder(&url)
                .unwrap()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap();
            barrier.wait().await;
            store.charge(&[charge]).await.unwrap().limits()[0]
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let mut counts: Vec<u64> = results
        .iter()
        .filter(|d| d.is_admitted())
        .map(|d| LIMIT - d.remaining())
        .collect();
    counts.sort_unstable();
    assert_eq!(counts, [1, 2, 3, 4, 5], "each count 1..=5 exactly once");
    assert!(
        results
            .iter()
            .filter(|d| !d.is_admitted())
            .all(|d| d.remaining() == 0)
    );
    // The test expires the key behind the store's back below: a cached
    // refusal would (rightly, for a store that owns its keys) outlive it.
    let store = RedisStore::builder(&url)
        .unwrap()
        .over_limit_cache(0)
        .build()
        .unwrap();
    let key = store.redis_key(&charge);
    let stored = server.get_bytes(&key).unwrap().expect("state is stored");
    let (count, ..) = decode_state(&stored).expect("a packed state");
    assert_eq!(count, 5, "stored count is 5");
    let ttl: i64 = server.query(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(ttl > 0 && ttl <= 60_000, "{ttl}");

    // A refusal neither spends more nor refreshes the window.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let refused = store.charge(std::slice::from_ref(&charge)).await.unwrap();
    assert!(refused.limits()[0].is_denied());
    let after: i64 = server.query(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(
        after > 0 && after <= ttl,
        "refusal must not extend the TTL: {ttl} -> {after}"
    );
    assert_eq!(server.get_bytes(&key).unwrap(), Some(stored));

    // Shorten the window deliberately, wait for real expiry, start again at 1.
    server.query(&["PEXPIRE", &key, "50"]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while server.query(&["EXISTS", &key]).unwrap() == "1" {
        assert!(std::time::Instant::now() < deadline, "key did not expire");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first = store
        .charge(std::slice::from_ref(&charge))
        .await
        .unwrap()
        .limits()[0];
    assert!(first.is_admitted());
    assert_eq!(LIMIT - first.remaining(), 1);
    let ttl: i64 = server.query(&["PTTL", &key]).unwrap().parse().unwrap();
    assert!(ttl > 0 && ttl <= 60_000);
}
