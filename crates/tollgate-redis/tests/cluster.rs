//! RedisStore on a real three-node Redis Cluster: keys in one slot are one
//! script; keys in several slots are charged slot by slot with refunds and
//! never exceed any budget.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;
use tollgate_core::{Charge, Key, Policy, Rate, Store};
use tollgate_redis::RedisStore;
use tollgate_redis::testing::RedisCluster;

fn charge(key: &str, policy: &Policy) -> Charge {
    Charge::new(Key::new(policy.name()).with(key), policy.clone(), 1).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_store_keeps_every_budget_across_slots() {
    let Some(cluster) = RedisCluster::start() else {
        return;
    };
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
