//! In-flight leases on a real redis-server: the bounds per key and in all,
//! renewal and expiry on Redis time, resent acquires, a cluster, and a
//! contention test over several connections and two processes in which
//! the test itself tracks how many hold a lease at once.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tollgate_budget::{Acquired, Lease, LeaseRequest, LeaseStore, Renewed};
use tollgate_redis::RedisStore;
use tollgate_testkit::{RedisCluster, RedisServer};

fn request(
    limit: &str,
    key: Option<&str>,
    per_key: u64,
    global: u64,
    ttl: Duration,
) -> LeaseRequest {
    LeaseRequest {
        limit: limit.into(),
        key: key.map(Into::into),
        per_key: Some(per_key),
        global: Some(global),
        ttl,
    }
}

async fn granted(store: &RedisStore, r: &LeaseRequest, id: u128) -> Lease {
    match store.acquire(r, id).await.unwrap() {
        Acquired::Granted(lease) => lease,
        other => panic!("lease {id} for {:?}: {other:?}", r.key),
    }
}

/// Two per key and three in all: each bound refuses when full, taking
/// nothing; a release frees its slot; the same id twice is one lease.
async fn bounds_hold(store: &RedisStore, limit: &str) {
    let ttl = Duration::from_secs(30);
    let a = request(limit, Some("a"), 2, 3, ttl);
    let b = request(limit, Some("b"), 2, 3, ttl);
    let c = request(limit, Some("c"), 2, 3, ttl);
    let a1 = granted(store, &a, 1).await;
    // Sent again (a retry after a lost reply): still one lease.
    granted(store, &a, 1).await;
    granted(store, &a, 2).await;
    assert_eq!(store.acquire(&a, 3).await.unwrap(), Acquired::PerKeyFull);
    granted(store, &b, 4).await;
    assert_eq!(store.acquire(&c, 5).await.unwrap(), Acquired::GlobalFull);
    assert_eq!(store.acquire(&a, 9).await.unwrap(), Acquired::BothFull);
    // The refusals took nothing: freeing one of a's lets c in.
    store.release(&a1).await.unwrap();
    granted(store, &c, 6).await;
    assert_eq!(store.acquire(&a, 7).await.unwrap(), Acquired::GlobalFull);
    // Releasing twice, or a lease never held, is harmless.
    store.release(&a1).await.unwrap();
    assert_eq!(store.acquire(&b, 8).await.unwrap(), Acquired::GlobalFull);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_per_key_and_in_all_hold_and_refusals_take_nothing() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url()).unwrap().build().unwrap();
    bounds_hold(&store, "bounds").await;
    // A key with braces stays inside the limit's hash tag.
    let odd = request("bounds", Some("{x}"), 1, 10, Duration::from_secs(30));
    granted(&store, &odd, 20).await;
    assert_eq!(store.acquire(&odd, 21).await.unwrap(), Acquired::PerKeyFull);
    let keys = store.lease_keys(&odd);
    assert_eq!(keys[1], "tollgate:{inflight/bounds}:k:%7Bx%7D");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_holds_the_bounds_in_one_slot() {
    let cluster = tollgate_testkit::or_skip!(RedisCluster::start());
    let urls = cluster.urls();
    let nodes: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::cluster_builder(&nodes)
        .unwrap()
        .build()
        .unwrap();
    bounds_hold(&store, "clustered").await;
}

/// A lease not renewed expires on Redis's clock and frees its slot; a
/// renewal keeps it; a lease found gone at a renewal (expired while its
/// holder was paused, or lost by the store) is taken again, even above the
/// bound, since its request still runs; and its sets do not outlive their
/// leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_expire_unless_renewed() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url()).unwrap().build().unwrap();
    let r = request("expiry", Some("k"), 1, 1, Duration::from_millis(300));
    let kept = granted(&store, &r, 1).await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            store.renew(&kept).await.unwrap(),
            Renewed::Extended,
            "renewed in time"
        );
    }
    // 600 ms after the first acquire, renewed: still held (one per key
    // and one in all: both full).
    assert_eq!(store.acquire(&r, 2).await.unwrap(), Acquired::BothFull);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Expired: the slot is free, and another holder takes it.
    let next = granted(&store, &r, 2).await;
    // The old holder's request still runs: its renewal takes the lease
    // again, above the bound of one, and newcomers are refused.
    assert_eq!(store.renew(&kept).await.unwrap(), Renewed::Restored);
    assert_eq!(store.renew(&kept).await.unwrap(), Renewed::Extended);
    assert_eq!(store.acquire(&r, 3).await.unwrap(), Acquired::BothFull);
    store.release(&kept).await.unwrap();
    assert_eq!(store.acquire(&r, 3).await.unwrap(), Acquired::BothFull);
    store.release(&next).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    for key in store.lease_keys(&r) {
        assert_eq!(
            server.query(&["EXISTS", &key]).unwrap().trim(),
            "0",
            "{key}"
        );
    }
}

const HOLDERS: usize = 24;
const LIMIT: u64 = 3;
const ROUNDS: usize = 60;
const WORKER: &str = "TOLLGATE_LEASE_WORKER";

fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// Many tasks on several connections acquire one key with a limit of
/// `LIMIT`, hold it a moment and release it; each records when it held
/// (from after its acquire answered to before its release was sent), on
/// the machine's wall clock, which both processes share.
async fn contend(url: &str, tag: &str) -> Vec<(u128, u128)> {
    let stores: Vec<RedisStore> = (0..4)
        .map(|_| RedisStore::builder(url).unwrap().build().unwrap())
        .collect();
    let intervals = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..HOLDERS)
        .map(|t| {
            let store = stores[t % stores.len()].clone();
            let intervals = intervals.clone();
            let tag = tag.to_owned();
            tokio::spawn(async move {
                let r = request(
                    "contended",
                    Some("one"),
                    LIMIT,
                    1000,
                    Duration::from_secs(30),
                );
                for round in 0..ROUNDS {
                    let id = (u128::from(tag.as_bytes()[0]) << 64) | ((t * ROUNDS + round) as u128);
                    let lease = loop {
                        match store.acquire(&r, id).await.unwrap() {
                            Acquired::Granted(lease) => break lease,
                            _ => tokio::task::yield_now().await,
                        }
                    };
                    let start = wall_ns();
                    tokio::time::sleep(Duration::from_micros(200 + (round as u64 * 37) % 800))
                        .await;
                    let end = wall_ns();
                    store.release(&lease).await.unwrap();
                    intervals.lock().unwrap().push((start, end));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    Arc::into_inner(intervals).unwrap().into_inner().unwrap()
}

/// Run by the test below in a second process: contends, then prints its
/// intervals. Does nothing when run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contention_worker() {
    let Ok(url) = std::env::var(WORKER) else {
        return;
    };
    for (start, end) in contend(&url, "w").await {
        println!("HELD {start} {end}");
    }
}

/// The most intervals that overlap at any instant.
fn most_at_once(intervals: &[(u128, u128)]) -> usize {
    let mut edges: Vec<(u128, i32)> = intervals
        .iter()
        .flat_map(|&(s, e)| [(s, 1), (e, -1)])
        .collect();
    // Ends before starts at the same instant: touching is not overlapping.
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        most = most.max(now);
    }
    most as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_more_than_the_limit_hold_a_key_across_connections_and_processes() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let url = server.url();
    let exe = std::env::current_exe().unwrap();
    let worker = tokio::process::Command::new(exe)
        .args([
            "contention_worker",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WORKER, &url)
        .output();
    let started = Instant::now();
    let (mine, theirs) = tokio::join!(contend(&url, "m"), worker);
    let theirs = theirs.unwrap();
    assert!(
        theirs.status.success(),
        "{}",
        String::from_utf8_lossy(&theirs.stderr)
    );
    let theirs: Vec<(u128, u128)> = String::from_utf8_lossy(&theirs.stdout)
        .lines()
        .filter_map(|l| {
            // libtest may print its own words before the first line.
            let mut w = l[l.find("HELD ")? + 5..].split(' ');
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect();
    assert_eq!(mine.len(), HOLDERS * ROUNDS);
    assert_eq!(theirs.len(), HOLDERS * ROUNDS, "the worker's intervals");
    // The two processes did contend: their holds interleave in time.
    let (first_theirs, last_theirs) = (
        theirs.iter().map(|i| i.0).min().unwrap(),
        theirs.iter().map(|i| i.1).max().unwrap(),
    );
    assert!(mine.iter().any(|i| i.0 > first_theirs && i.1 < last_theirs));
    let all: Vec<(u128, u128)> = mine.into_iter().chain(theirs).collect();
    let most = most_at_once(&all);
    assert!(most <= LIMIT as usize, "{most} held at once, limit {LIMIT}");
    // And the limit was reached: the test could have seen a breach.
    assert_eq!(most, LIMIT as usize);
    eprintln!(
        "{} holds by two processes in {:?}, at most {most} at once",
        all.len(),
        started.elapsed()
    );
}

/// Found in review: only the decision script could be pre-loaded. The
/// lease script's source and SHA are public too: `SCRIPT LOAD` of the
/// source answers the SHA, and a store then runs it by that SHA without
/// loading it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_script_can_be_preloaded() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let sha = server
        .query(&["SCRIPT", "LOAD", RedisStore::lease_script_source()])
        .unwrap();
    assert_eq!(sha, RedisStore::lease_script_sha());
    assert_ne!(sha, RedisStore::script_sha());
    let store = RedisStore::builder(&server.url()).unwrap().build().unwrap();
    let r = request("preload", Some("a"), 1, 1, Duration::from_secs(30));
    let lease = granted(&store, &r, 1).await;
    assert_eq!(store.renew(&lease).await.unwrap(), Renewed::Extended);
    store.release(&lease).await.unwrap();
    let stats = server.query(&["INFO", "commandstats"]).unwrap();
    let calls = |cmd: &str| {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
            .and_then(|rest| rest.split(',').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert_eq!(calls("evalsha"), 3, "{stats}");
    // Only the test's own SCRIPT LOAD: the store found it loaded.
    assert_eq!(calls("script|load"), 1, "{stats}");
}
