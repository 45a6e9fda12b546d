//! RedisStore on a real three-node Redis Cluster: keys in one slot are one
//! script; keys in several slots are charged slot by slot with refunds and
//! never exceed any budget; and a script whose reply is lost is never sent
//! again (cluster and single node, through a proxy that cuts the reply).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tollgate_budget::{Charge, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_testkit::RedisCluster;

fn charge(key: &str, policy: &Policy) -> Charge {
    Charge::new(Key::new(policy.name()).with(key), policy.clone(), 1).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_store_keeps_every_budget_across_slots() {
    let cluster = tollgate_testkit::or_skip!(RedisCluster::start());
    let urls = cluster.urls();
    let nodes: Vec<&str> = urls.iter().map(String::as_str).collect();
    let stores: Vec<RedisStore> = (0..3)
        .map(|_| {
            RedisStore::cluster_builder(&nodes)
                .unwrap()
                .timeout(Duration::from_secs(3))
                .build()
                .unwrap()
        })
        .collect();
    let per_ip = Policy::token_bucket("per-ip", 2, Rate::per_hour(100)).unwrap();
    let global = Policy::token_bucket("global", 7, Rate::per_hour(100)).unwrap();
    // The keys of one request land in different slots.
    let a = stores[0].redis_key(&charge("ip-0", &per_ip));
    let b = stores[0].redis_key(&charge("all", &global));
    assert_ne!(slot_of(&cluster, &a), slot_of(&cluster, &b));

    let barrier = Arc::new(Barrier::new(40));
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let store = stores[i % 3].clone();
            let (per_ip, global, barrier) = (per_ip.clone(), global.clone(), barrier.clone());
            tokio::spawn(async move {
                let ip = format!("ip-{}", i % 8);
                barrier.wait().await;
                let ok = store
                    .charge(&[charge(&ip, &per_ip), charge("all", &global)])
                    .await
                    .unwrap()
                    .is_admitted();
                (ip, ok)
            })
        })
        .collect();
    let mut per_address = std::collections::HashMap::<String, u32>::new();
    let mut total = 0;
    for t in tasks {
        let (ip, ok) = t.await.unwrap();
        if ok {
            total += 1;
            *per_address.entry(ip).or_default() += 1;
        }
    }
    assert!(total <= 7, "{total} admitted over a global budget of 7");
    assert!(total >= 1);
    assert!(per_address.values().all(|n| *n <= 2), "{per_address:?}");

    // One-slot charges are a single script and exact under contention.
    let solo = Policy::token_bucket("solo", 5, Rate::per_hour(100)).unwrap();
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let (store, solo) = (stores[i % 3].clone(), solo.clone());
            tokio::spawn(async move {
                store
                    .charge(&[charge("k", &solo)])
                    .await
                    .unwrap()
                    .is_admitted()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 5);
}

fn slot_of(cluster: &RedisCluster, key: &str) -> String {
    let url = &cluster.urls()[0];
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_connection().unwrap();
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query(&mut c)
        .unwrap();
    slot.to_string()
}

/// A TCP proxy in front of a cluster node that, once armed, forwards one
/// `EVALSHA` to the node, lets it run, and then cuts both connections
/// instead of relaying the reply: the client sees a dropped connection
/// after its script was applied.
struct CuttingProxy {
    port: u16,
    target: Arc<std::sync::Mutex<Option<u16>>>,
    armed: Arc<std::sync::atomic::AtomicBool>,
    cuts: Arc<std::sync::atomic::AtomicUsize>,
    /// Script calls still forwarded before the proxy swallows every later
    /// one (no reply ever comes); `usize::MAX`: never.
    stall_after: Arc<std::sync::atomic::AtomicUsize>,
}

impl CuttingProxy {
    async fn start() -> Self {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(std::sync::Mutex::new(None::<u16>));
        let armed = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicUsize::new(0));
        let stall_after = Arc::new(AtomicUsize::new(usize::MAX));
        let (t, a, c, st) = (
            target.clone(),
            armed.clone(),
            cuts.clone(),
            stall_after.clone(),
        );
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let Some(to) = *t.lock().unwrap() else {
                    continue;
                };
                let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await else {
                    continue;
                };
                let (a, c, st) = (a.clone(), c.clone(), st.clone());
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.split();
                    let (mut sr, mut sw) = server.split();
                    let mut up = [0u8; 65536];
                    let mut down = [0u8; 65536];
                    let mut cutting = false;
                    loop {
                        tokio::select! {
                            n = cr.read(&mut up) => {
                                let Ok(n @ 1..) = n else { return };
                                let sent = &up[..n];
                                let script = sent.windows(7).any(|w| w.eq_ignore_ascii_case(b"EVALSHA"));
                                if script
                                    && st
                                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                                            (left != usize::MAX).then(|| left.saturating_sub(1))
                                        })
                                        == Ok(0)
                                {
                                    // Swallowed: the client waits for ever.
                                    continue;
                                }
                                if a.load(Ordering::SeqCst)
                                    && sent.windows(7).any(|w| w.eq_ignore_ascii_case(b"EVALSHA"))
                                    && a.swap(false, Ordering::SeqCst)
                                {
                                    cutting = true;
                                }
                                if sw.write_all(sent).await.is_err() { return }
                            }
                            n = sr.read(&mut down) => {
                                let Ok(n @ 1..) = n else { return };
                                if cutting {
                                    // The script ran; drop its reply and
                                    // both connections.
                                    c.fetch_add(1, Ordering::SeqCst);
                                    return;
                                }
                                if cw.write_all(&down[..n]).await.is_err() { return }
                            }
                        }
                    }
                });
            }
        });
        Self {
            port,
            target,
            armed,
            cuts,
            stall_after,
        }
    }
}

/// Audit finding 6: the cluster client resent a request after a dropped
/// connection, so a charge whose reply was lost was applied twice. Now
/// nothing is resent that may have run: the charge is applied once and
/// reported uncertain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_charge_whose_reply_is_lost_is_applied_once_and_uncertain() {
    use std::sync::atomic::Ordering;
    let mut proxies = Vec::new();
    for _ in 0..3 {
        proxies.push(CuttingProxy::start().await);
    }
    let announced: Vec<u16> = proxies.iter().map(|p| p.port).collect();
    let cluster = tollgate_testkit::or_skip!(RedisCluster::start_with(|i| {
        vec![
            "--cluster-announce-port".to_owned(),
            announced[i].to_string(),
        ]
    }));
    for (proxy, node) in proxies.iter().zip(cluster.nodes()) {
        *proxy.target.lock().unwrap() = Some(node.port());
        // Loaded up front, so the first EVALSHA is the one that runs.
        for source in [
            RedisStore::script_source(),
            RedisStore::one_bucket_script_source(),
        ] {
            node.query(&["SCRIPT", "LOAD", source]).unwrap();
        }
    }
    let through: Vec<String> = announced
        .iter()
        .map(|p| format!("redis://127.0.0.1:{p}"))
        .collect();
    let nodes: Vec<&str> = through.iter().map(String::as_str).collect();
    let store = RedisStore::cluster_builder(&nodes)
        .unwrap()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let policy = Policy::token_bucket("resend", 10, Rate::per_hour(1)).unwrap();
    let five = Charge::new(Key::new("resend").with("k"), policy.clone(), 5).unwrap();
    // Connect (and learn the slots) before arming.
    let warm = Charge::new(Key::new("resend").with("warm"), policy.clone(), 1).unwrap();
    assert!(store.charge(&[warm]).await.unwrap().is_admitted());
    for p in &proxies {
        p.armed.store(true, Ordering::SeqCst);
    }
    let result = store.charge(std::slice::from_ref(&five)).await;
    assert_eq!(
        proxies
            .iter()
            .map(|p| p.cuts.load(Ordering::SeqCst))
            .sum::<usize>(),
        1
    );
    let error = result.expect_err("the reply was lost");
    assert!(error.is_uncertain(), "{error}");
    // Read the state on the node itself: spent once, 5 of 10 left.
    for p in &proxies {
        p.armed.store(false, Ordering::SeqCst);
    }
    let redis_key = store.redis_key(&five);
    let owner = cluster
        .nodes()
        .iter()
        .find(|n| {
            n.get_bytes(&redis_key)
                .map(|v| v.is_some())
                .unwrap_or(false)
        })
        .expect("the charge was applied on its node");
    let state = owner.get_bytes(&redis_key).unwrap().unwrap();
    let (level, ..) = tollgate_testkit::decode_state(&state).unwrap();
    let per_token = 3_600_000_000_000u64;
    assert_eq!(
        level,
        5 * per_token,
        "charged {} times",
        (10 - level / per_token) / 5
    );
}

/// The single-node connection manager never resent either (checked here,
/// with the same proxy): a lost reply is uncertain and spent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_single_node_store_does_not_resend_a_lost_charge() {
    use std::sync::atomic::Ordering;
    use tollgate_testkit::RedisServer;
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let proxy = CuttingProxy::start().await;
    *proxy.target.lock().unwrap() = Some(server.port());
    for source in [
        RedisStore::script_source(),
        RedisStore::one_bucket_script_source(),
    ] {
        server.query(&["SCRIPT", "LOAD", source]).unwrap();
    }
    let store = RedisStore::builder(&format!("redis://127.0.0.1:{}", proxy.port))
        .unwrap()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let policy = Policy::token_bucket("resend", 10, Rate::per_hour(1)).unwrap();
    let warm = Charge::new(Key::new("resend").with("warm"), policy.clone(), 1).unwrap();
    assert!(store.charge(&[warm]).await.unwrap().is_admitted());
    proxy.armed.store(true, Ordering::SeqCst);
    let five = Charge::new(Key::new("resend").with("k"), policy, 5).unwrap();
    let error = store
        .charge(std::slice::from_ref(&five))
        .await
        .expect_err("the reply was lost");
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1);
    assert!(error.is_uncertain(), "{error}");
    let state = server.get_bytes(&store.redis_key(&five)).unwrap().unwrap();
    let (level, ..) = tollgate_testkit::decode_state(&state).unwrap();
    assert_eq!(level, 5 * 3_600_000_000_000);
}

/// Found in review: a charge whose keys span slots was bounded per Redis
/// call, not as a whole: with every later call stalled, a four-slot call
/// took four timeouts. The whole decision now keeps one time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cross_slot_decision_keeps_one_time_limit() {
    use std::sync::atomic::Ordering;
    use std::time::Instant;
    use tollgate_testkit::RedisServer;
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let proxy = CuttingProxy::start().await;
    *proxy.target.lock().unwrap() = Some(server.port());
    for source in [
        RedisStore::script_source(),
        RedisStore::one_bucket_script_source(),
    ] {
        server.query(&["SCRIPT", "LOAD", source]).unwrap();
    }
    let limit = Duration::from_millis(500);
    let store = RedisStore::builder(&format!("redis://127.0.0.1:{}", proxy.port))
        .unwrap()
        .timeout(limit)
        .split_by_slot(true)
        .build()
        .unwrap();
    let policy = Policy::token_bucket("slots", 10, Rate::per_hour(1)).unwrap();
    let charges: Vec<Charge> = ["a", "b", "c", "d"]
        .iter()
        .map(|k| Charge::new(Key::new("slots").with(*k), policy.clone(), 1).unwrap())
        .collect();
    assert!(store.charge(&charges[..1]).await.unwrap().is_admitted());
    // The first slot group goes through; every later call stalls.
    proxy.stall_after.store(1, Ordering::SeqCst);
    let started = Instant::now();
    let error = store.charge(&charges).await.unwrap_err();
    let took = started.elapsed();
    assert!(error.is_uncertain(), "{error}");
    assert!(
        took < 2 * limit,
        "the decision took {took:?} with a limit of {limit:?}"
    );
}

/// Found in review: with slots charged one by one, a refusal may have seen
/// another call's charge a moment before its refund; the over-limit cache
/// then refused for the whole wait what Redis admitted after the refund.
/// A store that charges slot by slot does not remember refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_by_slot_store_remembers_no_refusal() {
    use tollgate_testkit::RedisServer;
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let store = RedisStore::builder(&server.url())
        .unwrap()
        .split_by_slot(true)
        .over_limit_cache(100)
        .build()
        .unwrap();
    let policy = Policy::token_bucket("once", 1, Rate::per_hour(1)).unwrap();
    let k = Charge::new(Key::new("once").with("k"), policy, 1).unwrap();
    assert!(
        store
            .charge(std::slice::from_ref(&k))
            .await
            .unwrap()
            .is_admitted()
    );
    assert!(
        !store
            .charge(std::slice::from_ref(&k))
            .await
            .unwrap()
            .is_admitted()
    );
    assert_eq!(store.cache_stats().remembered, 0);
}

/// Found in review: without redis-rs's resends, an `ASK` redirection
/// (a key already moved to the node importing its slot) was never
/// followed, so every charge on such a key failed during a reshard. The
/// store now asks the importing node itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_charge_on_a_migrating_key_follows_ask() {
    let cluster = tollgate_testkit::or_skip!(RedisCluster::start());
    let urls = cluster.urls();
    let nodes: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::cluster_builder(&nodes)
        .unwrap()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let policy = Policy::token_bucket("moving", 3, Rate::per_hour(1)).unwrap();
    let k = Charge::new(Key::new("moving").with("k"), policy, 1).unwrap();
    assert!(
        store
            .charge(std::slice::from_ref(&k))
            .await
            .unwrap()
            .is_admitted()
    );
    let key = store.redis_key(&k);
    let slot = cluster.nodes()[0]
        .query(&["CLUSTER", "KEYSLOT", &key])
        .unwrap();
    let owner = cluster
        .nodes()
        .iter()
        .position(|n| n.get_bytes(&key).is_ok())
        .expect("one node owns the key");
    let target = (owner + 1) % 3;
    let id = |i: usize| cluster.nodes()[i].query(&["CLUSTER", "MYID"]).unwrap();
    let (owner_id, target_id) = (id(owner), id(target));
    let target_port = cluster.nodes()[target].port().to_string();
    cluster.nodes()[target]
        .query(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &owner_id])
        .unwrap();
    cluster.nodes()[owner]
        .query(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &target_id])
        .unwrap();
    cluster.nodes()[owner]
        .query(&[
            "MIGRATE",
            "127.0.0.1",
            &target_port,
            "",
            "0",
            "5000",
            "KEYS",
            &key,
        ])
        .unwrap();
    // Mid-migration: the owner answers ASK for the moved key.
    let during = store.charge(std::slice::from_ref(&k)).await.unwrap();
    assert!(during.is_admitted(), "{during:?}");
    assert_eq!(during.limits()[0].remaining(), 1);
    for node in cluster.nodes() {
        node.query(&["CLUSTER", "SETSLOT", &slot, "NODE", &target_id])
            .unwrap();
    }
    let after = store.charge(std::slice::from_ref(&k)).await.unwrap();
    assert!(after.is_admitted());
    assert!(
        !store
            .charge(std::slice::from_ref(&k))
            .await
            .unwrap()
            .is_admitted()
    );
}
