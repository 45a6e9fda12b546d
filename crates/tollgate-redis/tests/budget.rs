//! Shared budgets on a real Redis: contention across connections, the
//! cross-slot refund path, TTLs, never-fits and the over-limit cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Barrier;
use tollgate_budget::{Charge, Decision, Key, Policy, Rate, Store, StoreErrorKind, Verdict};
use tollgate_redis::RedisStore;
use tollgate_testkit::RedisServer;

fn store(server: &RedisServer) -> RedisStore {
    RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

use tollgate_testkit::charge;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_tasks_on_several_connections_admit_exactly_the_budget() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    // Slow refill: nothing comes back during a trial.
    let policy = Policy::token_bucket("contended", 20, Rate::per_hour(100)).unwrap();
    let stores: Vec<RedisStore> = (0..6).map(|_| store(&server)).collect();
    for trial in 0..25 {
        let key = format!("trial-{trial}");
        let barrier = Arc::new(Barrier::new(60));
        let mut tasks = Vec::new();
        for t in 0..60 {
            let (s, c, b) = (
                stores[t % stores.len()].clone(),
                charge(&key, &policy, 1),
                barrier.clone(),
            );
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                s.charge(&[c]).await.unwrap().is_admitted()
            }));
        }
        let mut admitted = 0;
        for t in tasks {
            admitted += usize::from(t.await.unwrap());
        }
        assert_eq!(admitted, 20, "trial {trial}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cross_slot_charges_with_refunds_never_exceed_any_budget() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    // Per-address limits of 3 and one global limit of 10: keys in different
    // slots, charged slot by slot with compensating refunds.
    let per_ip = Policy::token_bucket("per-ip", 3, Rate::per_hour(100)).unwrap();
    let global = Policy::token_bucket("global", 10, Rate::per_hour(100)).unwrap();
    let split: Vec<RedisStore> = (0..4)
        .map(|_| {
            RedisStore::builder(&server.url())
                .unwrap()
                .timeout(Duration::from_secs(2))
                .split_by_slot(true)
                .build()
                .unwrap()
        })
        .collect();
    for trial in 0..10 {
        let barrier = Arc::new(Barrier::new(48));
        let mut tasks = Vec::new();
        for t in 0..48 {
            let ip = format!("t{trial}-ip{}", t % 6);
            let charges = vec![
                charge(&ip, &per_ip, 1),
                charge(&format!("t{trial}"), &global, 1),
            ];
            let (s, b) = (split[t % split.len()].clone(), barrier.clone());
            tasks.push(tokio::spawn(async move {
                b.wait().await;
                (ip, s.charge(&charges).await.unwrap().is_admitted())
            }));
        }
        let mut per_address = std::collections::HashMap::<String, u32>::new();
        let mut total = 0;
        for t in tasks {
            let (ip, ok) = t.await.unwrap();
            if ok {
                total += 1;
                *per_address.entry(ip).or_default() += 1;
            }
        }
        assert!(
            total <= 10,
            "trial {trial}: {total} admitted over a global budget of 10"
        );
        assert!(
            per_address.values().all(|n| *n <= 3),
            "trial {trial}: {per_address:?}"
        );
        // Refunds leave no stranded spend: afterwards exactly the unspent
        // global budget is still there.
        let left = split[0]
            .charge(&[charge(&format!("t{trial}"), &global, 1)])
            .await
            .unwrap();
        let remaining_before = 10 - total;
        assert_eq!(left.is_admitted(), remaining_before > 0, "trial {trial}");
    }
}

/// Horizons of about a second, so that a busy machine pausing this test
/// for a few hundred milliseconds between the charge and the `PTTL` read
/// cannot let a key expire in between (it did, with 100 ms horizons).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_has_a_ttl_and_is_gone_after_the_horizon() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = store(&server);
    let tb = Policy::token_bucket("tb", 2, Rate::per_second(2)).unwrap();
    let fw = Policy::fixed_window("fw", 2, Duration::from_millis(1500)).unwrap();
    let sw = Policy::sliding_window("sw", 2, Duration::from_millis(1000)).unwrap();
    let charges = [
        charge("k", &tb, 2),
        charge("k", &fw, 1),
        charge("k", &sw, 1),
    ];
    assert!(s.charge(&charges).await.unwrap().is_admitted());
    for c in &charges {
        let key = s.redis_key(c);
        let ttl: i64 = server.query(&["PTTL", &key]).unwrap().parse().unwrap();
        assert!(ttl > 0 && ttl <= 2000, "{key}: PTTL {ttl}");
    }
    // No key without a TTL anywhere.
    for key in server.query(&["KEYS", "tollgate:*"]).unwrap().lines() {
        let ttl: i64 = server.query(&["PTTL", key]).unwrap().parse().unwrap();
        assert!(ttl > 0, "{key} has no TTL ({ttl})");
    }
    tokio::time::sleep(Duration::from_millis(2300)).await;
    for c in &charges {
        assert_eq!(server.query(&["EXISTS", &s.redis_key(c)]).unwrap(), "0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_fits_touches_no_redis_state_and_needs_no_redis() {
    let mut server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = store(&server);
    let p = Policy::token_bucket("upload", 1024, Rate::per_second(256)).unwrap();
    let small = charge(
        "bob",
        &Policy::token_bucket("per-ip", 5, Rate::per_second(1)).unwrap(),
        1,
    );
    let outcome = s
        .charge(&[small.clone(), charge("bob", &p, 2048)])
        .await
        .unwrap();
    assert_eq!(outcome.verdict(), Verdict::NeverFits);
    assert_eq!(outcome.limits()[0], Decision::unevaluated());
    assert_eq!(server.query(&["DBSIZE"]).unwrap(), "0");
    server.kill();
    let outcome = s.charge(&[charge("bob", &p, 2048)]).await.unwrap();
    assert_eq!(outcome.verdict(), Verdict::NeverFits);
    // Without an over-limit cache, never-fits is the only answer given
    // synchronously; anything that fits needs Redis.
    assert!(matches!(
        s.try_charge_now(&[small.clone(), charge("bob", &p, 2048)]),
        Some(Ok(o)) if o.verdict() == Verdict::NeverFits
    ));
    assert!(s.try_charge_now(&[small]).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_policies_are_refused_with_a_reason() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = store(&server);
    let p = Policy::token_bucket("huge", 1 << 30, Rate::per_second(1)).unwrap();
    let e = s.charge(&[charge("k", &p, 1)]).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unsupported);
    let e = s.check_policy(&p).unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unsupported);
    assert!(
        s.check_policy(&Policy::token_bucket("fine", 5, Rate::per_second(1)).unwrap())
            .is_ok()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_limit_cache_refuses_locally_and_never_admits_more() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let p = Policy::token_bucket("hot", 5, Rate::per_second(2)).unwrap();
    let cached = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .over_limit_cache(1000)
        .build()
        .unwrap();
    let started = Instant::now();
    let mut admitted = 0u32;
    while started.elapsed() < Duration::from_millis(1500) {
        if cached
            .charge(&[charge("k", &p, 1)])
            .await
            .unwrap()
            .is_admitted()
        {
            admitted += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    // Never more than B + r·t.
    assert!(
        f64::from(admitted) <= 5.0 + 2.0 * elapsed + 1e-9,
        "{admitted} in {elapsed}s"
    );
    assert!(admitted >= 5);
    let stats = cached.cache_stats();
    assert!(stats.hits > 100, "denials were served locally: {stats:?}");

    // A cached refusal repeats what Redis said, never promising an earlier time.
    assert!(
        cached
            .charge(&[charge("k2", &p, 5)])
            .await
            .unwrap()
            .is_admitted()
    );
    let from_redis = cached
        .charge(&[charge("k2", &p, 1)])
        .await
        .unwrap()
        .limits()[0];
    let hits = cached.cache_stats().hits;
    let from_cache = cached
        .charge(&[charge("k2", &p, 1)])
        .await
        .unwrap()
        .limits()[0];
    assert_eq!(cached.cache_stats().hits, hits + 1);
    // The cached refusal is also answered synchronously; an uncached key
    // and a charge that could fit need Redis.
    let now = cached.try_charge_now(&[charge("k2", &p, 1)]);
    assert!(matches!(&now, Some(Ok(o)) if !o.is_admitted()), "{now:?}");
    assert_eq!(cached.cache_stats().hits, hits + 2);
    assert!(cached.try_charge_now(&[charge("k3", &p, 1)]).is_none());
    assert!(matches!(
        cached.try_charge_now(&[charge("k3", &p, 6)]),
        Some(Ok(o)) if o.verdict() == Verdict::NeverFits
    ));
    let (Some(a), Some(b)) = (from_redis.retry_after(), from_cache.retry_after()) else {
        panic!("{from_redis:?} / {from_cache:?}");
    };
    let (ra, rb) = (from_redis.remaining(), from_cache.remaining());
    assert!(b <= a && b > Duration::ZERO, "{a:?} then {b:?}");
    assert_eq!((ra, rb), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_fresh_keys_leaves_no_key_without_a_ttl() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = store(&server);
    // A slow refill keeps the keys alive long enough to inspect them all.
    let p = Policy::token_bucket("flood", 5, Rate::per_hour(5)).unwrap();
    const KEYS: usize = 100_000;
    const TASKS: usize = 64;
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (s, p) = (s.clone(), p.clone());
            tokio::spawn(async move {
                for i in (t..KEYS).step_by(TASKS) {
                    let ip = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
                    assert!(s.charge(&[charge(&ip, &p, 1)]).await.unwrap().is_admitted());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    // Every key the flood created has a TTL.
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tollgate:*")
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), KEYS);
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for k in chunk {
            pipe.cmd("PTTL").arg(k);
        }
        let ttls: Vec<i64> = pipe.query(&mut conn).unwrap();
        assert!(ttls.iter().all(|t| *t > 0), "a flooded key has no TTL");
    }
}

/// States are packed doubles; a text state "level:prior:era:offset" left
/// by an earlier version is still read, and rewritten packed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_states_from_earlier_versions_are_still_read() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .injected_time(|| 5_000_000_000)
        .build()
        .unwrap();
    let p = Policy::fixed_window("legacy", 3, Duration::from_secs(10)).unwrap();
    let key = s.redis_key(&charge("k", &p, 1));
    // Two admitted in the window that started at the injected time.
    server
        .query(&["SET", &key, "2:0:0:5000000000", "PX", "10000"])
        .unwrap();
    let last = s.charge(&[charge("k", &p, 1)]).await.unwrap();
    assert!(last.is_admitted());
    assert_eq!(last.limits()[0].remaining(), 0);
    assert!(!s.charge(&[charge("k", &p, 1)]).await.unwrap().is_admitted());
    let stored = server.get_bytes(&key).unwrap().expect("state is stored");
    assert_eq!(
        tollgate_testkit::decode_state(&stored),
        Some((3, 0, 0, 5_000_000_000))
    );
}

/// Arguments that are not eight packed doubles per charge are refused
/// before anything is read or written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_script_arguments_are_refused_untouched() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let script = redis::Script::new(RedisStore::script_source());
    let result: redis::RedisResult<Vec<i64>> = script
        .key("a")
        .key("b")
        .arg("i")
        .arg(5)
        .arg(0)
        .arg(1_767_225_600)
        .arg("charge")
        .arg(&[0u8; 64][..])
        .arg("1:2:3")
        .invoke_async(&mut conn)
        .await;
    let error = result.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("neither eight packed doubles nor eight numbers"),
        "{error}"
    );
    assert_eq!(server.query(&["EXISTS", "a", "b"]).unwrap(), "0");
}

/// The text form of a charge's numbers (for redis-benchmark, which cannot
/// send binary) decides like the packed form the store sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_charge_arguments_decide_like_packed_ones() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .injected_time(|| 7_000_000_000)
        .build()
        .unwrap();
    // 5 tokens, one per 1000 ns: 1 scaled unit per ns, 1000 per token.
    let p = Policy::token_bucket("text", 5, Rate::new(1, Duration::from_micros(1))).unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let script = redis::Script::new(RedisStore::script_source());
    for round in 0..6 {
        let by_store = s.charge(&[charge("packed", &p, 1)]).await.unwrap();
        let reply: Vec<i64> = script
            .key("text-key")
            .arg("i")
            .arg(7)
            .arg(0)
            .arg(1_767_225_600)
            .arg("charge")
            .arg("1:5000:1:1000:1:1000:0:0")
            .invoke_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(reply[0] == 1, by_store.is_admitted(), "round {round}");
        assert_eq!(
            u64::try_from(reply[1]).unwrap(),
            by_store.limits()[0].remaining(),
            "round {round}"
        );
    }
}

/// Under injected time, Redis's own clock must not expire a key before the
/// injected clock says the state is idle: here the injected clock stands
/// still while real time passes well beyond the state's one-microsecond
/// horizon, and the spent budget is still spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_time_expiry_never_runs_ahead_of_injected_time() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let s = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .injected_time(|| 9_000_000_000)
        .build()
        .unwrap();
    // Full again 1 us after being emptied: a TTL of one millisecond.
    let p = Policy::token_bucket("frozen", 1, Rate::new(1, Duration::from_micros(1))).unwrap();
    assert!(s.charge(&[charge("k", &p, 1)]).await.unwrap().is_admitted());
    tokio::time::sleep(Duration::from_millis(50)).await;
    let again = s.charge(&[charge("k", &p, 1)]).await.unwrap();
    assert_eq!(
        again.verdict(),
        Verdict::Denied {
            retry_after: Duration::from_micros(1)
        }
    );
    let ttl: i64 = server
        .query(&["PTTL", &s.redis_key(&charge("k", &p, 1))])
        .unwrap()
        .parse()
        .unwrap();
    assert!(ttl > 3_000_000, "PTTL {ttl}");
}

/// Audit finding 2: with keys in several slots, a later slot's policy that
/// Redis cannot hold was found only after the earlier slots were charged,
/// and they were never refunded. Now the whole call is refused first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsupported_policy_in_a_later_slot_charges_no_earlier_slot() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let split = RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .split_by_slot(true)
        .build()
        .unwrap();
    let fine = Policy::token_bucket("fine", 1, Rate::per_hour(1)).unwrap();
    let huge = Policy::token_bucket("huge", 1 << 30, Rate::per_second(1)).unwrap();
    // Slots are charged in slot order: about half of these keys sort before
    // the unsupported one.
    for i in 0..24 {
        let key = format!("addr-{i}");
        let e = split
            .charge(&[charge(&key, &fine, 1), charge("global", &huge, 1)])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Unsupported);
        assert_eq!(
            server
                .query(&["EXISTS", &split.redis_key(&charge(&key, &fine, 1))])
                .unwrap(),
            "0",
            "{key} was charged"
        );
        assert!(
            split
                .charge(&[charge(&key, &fine, 1)])
                .await
                .unwrap()
                .is_admitted()
        );
    }
}

/// Audit finding 3: one request charging the same key twice was refused as
/// a pair (the second charge sees the first one's effect), and the cache
/// then remembered that refusal with its long wait, refusing a single
/// charge that Redis would admit. Both stores agree with and without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_charged_twice_in_one_call_is_not_remembered_as_refused() {
    use tollgate_budget::MemoryStore;
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let cached = RedisStore::builder(&server.url())
        .unwrap()
        .prefix("cached")
        .over_limit_cache(1000)
        .build()
        .unwrap();
    let plain = RedisStore::builder(&server.url())
        .unwrap()
        .prefix("plain")
        .build()
        .unwrap();
    let memory = MemoryStore::new();
    let p = Policy::token_bucket("twice", 1, Rate::per_hour(1)).unwrap();
    let pair = [charge("k", &p, 1), charge("k", &p, 1)];
    assert!(!cached.charge(&pair).await.unwrap().is_admitted());
    assert!(!plain.charge(&pair).await.unwrap().is_admitted());
    assert!(!memory.charge(&pair).await.unwrap().is_admitted());
    for store in [&cached as &dyn tollgate_budget::DynStore, &plain, &memory] {
        let single = store.charge_boxed(&pair[..1]).await.unwrap();
        assert!(single.is_admitted(), "{single:?}");
    }
    assert_eq!(cached.cache_stats().hits, 0);
}

/// Found in review: charging slot by slot, a refund that left a bucket full
/// wrote a full bucket where the memory store keeps no state, and a clock
/// stepping back then found credit a fresh initially-empty bucket lacks.
/// A refund that leaves no state now deletes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refund_that_leaves_nothing_spent_leaves_no_state() {
    use tollgate_budget::{Initial, ManualClock, MemoryStore};
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let clock = ManualClock::new(0);
    let reading = clock.clone();
    let redis = RedisStore::builder(&server.url())
        .unwrap()
        .split_by_slot(true)
        .injected_time(move || tollgate_budget::Clock::now(&reading))
        .build()
        .unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let bucket = Policy::token_bucket("p", 10, Rate::per_second(5)).unwrap();
    let gate = Policy::fixed_window("gate", 1, Duration::from_secs(3600)).unwrap();
    let (first, second) = (Key::new("r").with("b"), Key::new("r").with("a"));
    let pair = [
        Charge::new(first.clone(), bucket.clone(), 1).unwrap(),
        Charge::new(second.clone(), gate.clone(), 1).unwrap(),
    ];
    // Two slots, the bucket's charged first: the refund path runs.
    let slots: Vec<u16> = pair
        .iter()
        .map(|c| tollgate_testkit::slot(&redis.redis_key(c)))
        .collect();
    assert!(slots[0] < slots[1], "{slots:?}");
    let gate_only = [Charge::new(second, gate, 1).unwrap()];
    for store in [&redis as &dyn tollgate_budget::DynStore, &memory] {
        assert!(store.charge_boxed(&gate_only).await.unwrap().is_admitted());
    }
    clock.set(100_000_000_000);
    for store in [&redis as &dyn tollgate_budget::DynStore, &memory] {
        assert!(!store.charge_boxed(&pair).await.unwrap().is_admitted());
    }
    let stored = server.get_bytes(&redis.redis_key(&pair[0])).unwrap();
    assert_eq!(stored, None, "the refunded bucket is no state");
    // The clock steps back a second; an initially-empty bucket of the same
    // budget is new in both stores.
    clock.set(99_000_000_000);
    let empty = [Charge::new(first, bucket.with_initial(Initial::Empty), 1).unwrap()];
    let (a, b) = (
        memory.charge(&empty).await.unwrap(),
        redis.charge(&empty).await.unwrap(),
    );
    assert!(!a.is_admitted(), "{a:?}");
    assert_eq!(a, b);
}

/// A store on the application's own connection manager decides like any
/// other; the script an operator pre-loads is the one the store calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_your_own_connection_and_a_preloaded_script() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let sha = server
        .query(&["SCRIPT", "LOAD", RedisStore::script_source()])
        .unwrap();
    assert_eq!(sha, RedisStore::script_sha());
    let sha = server
        .query(&["SCRIPT", "LOAD", RedisStore::one_bucket_script_source()])
        .unwrap();
    assert_eq!(sha, RedisStore::one_bucket_script_sha());
    let manager = tollgate_redis::redis::Client::open(server.url())
        .unwrap()
        .get_connection_manager()
        .await
        .unwrap();
    let store = RedisStore::with_connection_manager(manager)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let p = Policy::token_bucket("own-conn", 2, Rate::per_hour(1)).unwrap();
    let c = charge("k", &p, 1);
    assert!(
        store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    assert!(
        store
            .charge(std::slice::from_ref(&c))
            .await
            .unwrap()
            .is_admitted()
    );
    assert!(!store.charge(&[c]).await.unwrap().is_admitted());
    // Two charges at once need the decision script.
    let pair = [charge("x", &p, 1), charge("y", &p, 1)];
    assert!(store.charge(&pair).await.unwrap().is_admitted());
    // The store called the pre-loaded scripts: nothing else was loaded.
    let scripts = server.query(&["INFO", "memory"]).unwrap();
    let count = scripts
        .lines()
        .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
        .and_then(|n| n.trim().parse::<u32>().ok());
    assert_eq!(count, Some(2), "{scripts}");
}

/// Script calls so far (`EVAL` and `EVALSHA`), from `INFO commandstats`.
fn script_calls(server: &RedisServer) -> u64 {
    let info = server.query(&["INFO", "commandstats"]).unwrap();
    info.lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// A flood of 32 concurrent tasks on one exhausted key: the cache sends
/// about one script call per refill of a cost (the probe at each
/// deadline), not one per miss of every task at once, and the key still
/// admits its refill, never more than `B + r·t`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_costs_about_one_call_per_refill() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let p = Policy::token_bucket("flooded", 2, Rate::per_second(10)).unwrap();
    let store = RedisStore::builder(&server.url()).unwrap().build().unwrap();
    // Loads the script (the first call of each task would otherwise be a
    // NOSCRIPT and a resend).
    let warm = Policy::token_bucket("warm", 2, Rate::per_second(10)).unwrap();
    store.charge(&[charge("warm", &warm, 1)]).await.unwrap();
    server.query(&["CONFIG", "RESETSTAT"]).unwrap();
    let started = Instant::now();
    let run = Duration::from_secs(2);
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (store, p) = (store.clone(), p.clone());
            tokio::spawn(async move {
                let (mut admitted, mut refused) = (0u64, 0u64);
                let c = [charge("flood", &p, 1)];
                while started.elapsed() < run {
                    // As the HTTP layer asks: without I/O first, then Redis.
                    let outcome = match store.try_charge_now(&c) {
                        Some(answer) => answer.unwrap(),
                        None => store.charge(&c).await.unwrap(),
                    };
                    if outcome.is_admitted() {
                        admitted += 1;
                    } else {
                        refused += 1;
                    }
                    tokio::task::yield_now().await;
                }
                (admitted, refused)
            })
        })
        .collect();
    let (mut admitted, mut refused) = (0, 0);
    for t in tasks {
        let (a, r) = t.await.unwrap();
        admitted += a;
        refused += r;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let calls = script_calls(&server);
    eprintln!("{admitted} admitted, {refused} refused, {calls} script calls in {elapsed:.2} s");
    assert!(
        (admitted as f64) <= 2.0 + 10.0 * elapsed + 1e-9,
        "{admitted}"
    );
    // The probes keep admitting at the refill rate (less the last refill
    // still due when the run ends, and a few probes' round trips).
    assert!(
        (admitted as f64) >= 10.0 * elapsed - 3.0,
        "{admitted} in {elapsed}"
    );
    assert!(refused > 1000, "a flood: {refused}");
    // Each task's first call finds nothing remembered (32 at once); after
    // that about one call per refill, the probe that takes the refilled
    // token. (Without the probe every refill cost a call from each task.)
    assert!(
        calls <= 32 + admitted + 6,
        "{calls} calls for {admitted} admitted"
    );
}
