//! Redis Sentinel with real processes: a master, a replica and a sentinel
//! the test starts. A store that finds its master through the sentinel
//! follows a `SENTINEL FAILOVER` under load: every call answers within its
//! time limit (admitted, or a classified store error), and the store
//! writes to the new master without being rebuilt.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tollgate_budget::{Charge, Key, Policy, Rate, Store, StoreErrorKind};
use tollgate_redis::RedisStore;
use tollgate_testkit::{RedisSentinel, RedisServer};

const NAME: &str = "tollgate-master";

async fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A master, a replica in sync with it, and a sentinel that sees both;
/// `None` (the test skips loudly, or fails under `CI=true`) without the
/// servers.
async fn master_replica_sentinel() -> Option<(RedisServer, RedisServer, RedisSentinel)> {
    let master = RedisServer::start()?;
    let master_port = master.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master_port])?;
    wait_until("the replica in sync", Duration::from_secs(10), || {
        replica
            .query(&["INFO", "replication"])
            .is_ok_and(|i| i.contains("master_link_status:up"))
    })
    .await;
    let sentinel = RedisSentinel::start(NAME, master.port())?;
    wait_until(
        "the sentinel sees the replica",
        Duration::from_secs(15),
        || {
            sentinel
                .query(&["SENTINEL", "REPLICAS", NAME])
                .is_ok_and(|r| r.contains(&replica.port().to_string()))
        },
    )
    .await;
    Some((master, replica, sentinel))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_follows_a_sentinel_failover_under_load() {
    let (mut master, replica, sentinel) =
        tollgate_testkit::or_skip!(master_replica_sentinel().await);
    let timeout = Duration::from_millis(300);
    let store = RedisStore::sentinel_builder(&[&sentinel.url()], NAME)
        .unwrap()
        .timeout(timeout)
        .build()
        .unwrap();
    let policy = Policy::token_bucket("failover", 1_000_000, Rate::per_second(1)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (store, policy, stop) = (store.clone(), policy.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let charge = Charge::new(Key::new("failover").with(t.to_string()), policy, 1).unwrap();
            // (elapsed, error kind) per call.
            let mut calls: Vec<(Duration, Option<StoreErrorKind>)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let result = store.charge(std::slice::from_ref(&charge)).await;
                calls.push((started.elapsed(), result.err().map(|e| e.kind())));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            calls
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    sentinel
        .query(&["SENTINEL", "FAILOVER", NAME])
        .expect("SENTINEL FAILOVER");
    let failed_over = Instant::now();
    let sentinel_view = || sentinel.master_port(NAME) == Some(replica.port());
    wait_until(
        "the sentinel promotes the replica",
        Duration::from_secs(20),
        sentinel_view,
    )
    .await;
    // Let calls run on the new master, then take the old one away for
    // good: calls that still succeed can only be landing on the new one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    master.kill();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let errors: Vec<_> = all.iter().filter_map(|(_, e)| *e).collect();
    // Every call answered within its time limit (plus scheduling slack).
    let slowest = all.iter().map(|(d, _)| *d).max().unwrap();
    assert!(
        slowest < timeout + Duration::from_millis(700),
        "a call took {slowest:?}"
    );
    // Errors during the switch are the documented kinds.
    let odd: Vec<_> = errors
        .iter()
        .filter(|k| !matches!(k, StoreErrorKind::Unavailable | StoreErrorKind::Uncertain))
        .take(3)
        .collect();
    assert!(odd.is_empty(), "{} errors, such as {odd:?}", errors.len());
    // Recovered without a rebuild: the last calls of every task succeeded.
    let tail = all.iter().rev().take(40);
    assert!(tail.clone().all(|(_, e)| e.is_none()), "not recovered");
    // And the budget now lives on the promoted replica, which is a master.
    let role = replica.query(&["INFO", "replication"]).unwrap();
    assert!(role.contains("role:master"), "{role}");
    let probe = Charge::new(Key::new("failover").with("0"), policy, 1).unwrap();
    assert!(
        replica
            .get_bytes(&store.redis_key(&probe))
            .unwrap()
            .is_some()
    );
    let kind = |k: StoreErrorKind| errors.iter().filter(|e| **e == k).count();
    eprintln!(
        "sentinel failover: {} calls, {} errors ({} unavailable, {} uncertain), slowest call \
         {slowest:?}, {:?} from SENTINEL FAILOVER to the end",
        all.len(),
        errors.len(),
        kind(StoreErrorKind::Unavailable),
        kind(StoreErrorKind::Uncertain),
        failed_over.elapsed()
    );
}

/// Found in review: a master that requires a password could not be used
/// through Sentinel (no way to give the master's password; the failure was
/// classified uncertain). Now `sentinel_builder_with_auth` passes it, and
/// without it the refusal is unavailable (nothing was sent) and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_with_a_password_is_reached_through_sentinel() {
    let master =
        tollgate_testkit::or_skip!(RedisServer::start_with(&["--requirepass", "pw-for-master"]));
    let sentinel = tollgate_testkit::or_skip!(RedisSentinel::start_with_auth(
        NAME,
        master.port(),
        Some("pw-for-master")
    ));
    let policy = Policy::token_bucket("auth", 5, Rate::per_second(1)).unwrap();
    let charge = Charge::new(Key::new("auth"), policy, 1).unwrap();
    let with =
        RedisStore::sentinel_builder_with_auth(&[&sentinel.url()], NAME, None, "pw-for-master")
            .unwrap()
            .build()
            .unwrap();
    assert!(
        with.charge(std::slice::from_ref(&charge))
            .await
            .unwrap()
            .is_admitted()
    );
    let without = RedisStore::sentinel_builder(&[&sentinel.url()], NAME)
        .unwrap()
        .build()
        .unwrap();
    let error = without
        .charge(std::slice::from_ref(&charge))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{error:?}");
    let mut why = String::new();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(s) = source {
        why.push_str(&s.to_string());
        source = s.source();
    }
    assert!(
        why.contains("NOAUTH") || why.contains("uthentication"),
        "{why}"
    );
}

/// The script calls (run or rejected) a server has received.
fn script_calls(server: &RedisServer) -> u64 {
    let Ok(stats) = server.query(&["INFO", "commandstats"]) else {
        return 0;
    };
    let field = |rest: &str, name: &str| -> u64 {
        rest.split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    stats
        .lines()
        .filter_map(|l| {
            l.strip_prefix("cmdstat_evalsha:")
                .or_else(|| l.strip_prefix("cmdstat_eval:"))
        })
        .map(|rest| field(rest, "calls") + field(rest, "rejected_calls"))
        .sum()
}

/// Found in review: after `SENTINEL FAILOVER` the store kept writing to the
/// demoted master until Sentinel reconfigured it (seconds later), and those
/// writes were lost, while other instances already wrote to the new
/// master. Now the store asks the sentinels where the master is every
/// second: with the old master left running, its calls stop within the
/// interval (plus slack) of the promotion and go to the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_no_call_goes_to_the_demoted_master() {
    let (master, replica, sentinel) = tollgate_testkit::or_skip!(master_replica_sentinel().await);
    // The default check interval, 1 s.
    let store = RedisStore::sentinel_builder(&[&sentinel.url()], NAME)
        .unwrap()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let policy = Policy::token_bucket("demoted", 1_000_000, Rate::per_second(1)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (store, policy, stop) = (store.clone(), policy.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let charge = Charge::new(Key::new("demoted").with(t.to_string()), policy, 1).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let _ = store.charge(std::slice::from_ref(&charge)).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(script_calls(&master) > 0, "calls go to the master first");
    sentinel
        .query(&["SENTINEL", "FAILOVER", NAME])
        .expect("SENTINEL FAILOVER");
    wait_until(
        "the sentinel promotes the replica",
        Duration::from_secs(20),
        || sentinel.master_port(NAME) == Some(replica.port()),
    )
    .await;
    let switched = Instant::now();
    let at_switch = script_calls(&master);
    // The interval, plus slack for the check's round trips and a new
    // connection; sampled to see when the old master's calls stopped.
    let (mut seen, mut last_call) = (at_switch, Duration::ZERO);
    while switched.elapsed() < Duration::from_millis(1500) {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let now = script_calls(&master);
        if now != seen {
            (seen, last_call) = (now, switched.elapsed());
        }
    }
    let (old_after, new_after) = (script_calls(&master), script_calls(&replica));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (old_end, new_end) = (script_calls(&master), script_calls(&replica));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let demoted = master.query(&["INFO", "replication"]).unwrap_or_default();
    eprintln!(
        "after the promotion the old master received {} script calls, the last {last_call:?} \
         after it ({} in the first 1.5 s, {} in the 3 s after), the new one {} in those 3 s; \
         old master now {}",
        old_end - at_switch,
        old_after - at_switch,
        old_end - old_after,
        new_end - new_after,
        demoted
            .lines()
            .find(|l| l.starts_with("role:"))
            .unwrap_or("?")
    );
    assert_eq!(
        old_end,
        old_after,
        "calls still reached the demoted master {:?} after the promotion",
        switched.elapsed()
    );
    assert!(new_end > new_after + 100, "the new master gets the calls");
}
