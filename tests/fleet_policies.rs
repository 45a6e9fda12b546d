//! One policy set for a fleet, on a private `redis-server`: instances in
//! this process, each with its own connections, its own layer and its own
//! `FleetPolicies`, as separate processes would have.
//!
//! - a set published through one instance is in force on the others
//!   within a second (measured over 20 changes: median and worst printed),
//!   and admits its numbers there;
//! - an instance started afterwards starts with it;
//! - a bad set changes nothing anywhere: refused before publishing, or,
//!   written to Redis behind the fleet's back, kept out and counted by
//!   every instance;
//! - Redis down: publishing fails clearly and changes nothing; Redis
//!   restarted with the set lost: the instances keep theirs and write it
//!   back.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use tollgate::identity::PeerAddr;
use tollgate::rate_limit::PolicySet;
use tollgate::redis::{FleetPolicies, PublishError};
use tollgate::{Policy, Principal, Rate, RateLimitLayer, RedisStore, Rule};
use tollgate_testkit::{RedisServer, or_skip};
use tower::{Layer, Service, ServiceExt};

struct Instance {
    layer: RateLimitLayer<RedisStore>,
    fleet: FleetPolicies<RedisStore>,
}

async fn instance(url: &str) -> Instance {
    let store = RedisStore::builder(url)
        .unwrap()
        .prefix("fleet-test")
        .build()
        .unwrap();
    let export = Policy::token_bucket("export", 3, Rate::per_minute(1)).unwrap();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::per_account(export))
        .build()
        .unwrap();
    let fleet = FleetPolicies::start(store, layer.rules_handle())
        .await
        .unwrap();
    Instance { layer, fleet }
}

/// How many of 20 requests of a fresh `account` (at once) `instance`
/// admits.
async fn admits(instance: &Instance, account: &str) -> usize {
    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let mut svc = instance.layer.layer(inner);
    let mut n = 0;
    for _ in 0..20 {
        let mut req = Request::new(String::new());
        let peer: SocketAddr = "192.0.2.1:1000".parse().unwrap();
        req.extensions_mut().insert(PeerAddr(peer));
        req.extensions_mut()
            .insert(Principal::new("acme".to_owned(), account.to_owned()));
        let response = svc.ready().await.unwrap().call(req).await.unwrap();
        if response.status() == StatusCode::OK {
            n += 1;
        }
    }
    n
}

fn capacity(n: u64) -> PolicySet {
    PolicySet::from_json(&format!(
        r#"{{"rules": {{"export": {{"policy": {{"capacity": {n}, "refill": {{"per_minute": 1}}}}}}}}}}"#
    ))
    .unwrap()
}

/// Waits (real time, at most `limit`) until `done`; how long it took.
async fn until(what: &str, limit: Duration, done: impl Fn() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what} not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    start.elapsed()
}

/// Waits (at most `limit`) until `instance` runs `version`; how long it
/// took.
async fn until_version(instance: &Instance, version: u64, limit: Duration) -> Duration {
    let what = format!("version {version} in force");
    until(&what, limit, || instance.fleet.version() >= version).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_set_is_in_force_on_every_instance_within_a_second() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let (a, b, c) = (
        instance(&url).await,
        instance(&url).await,
        instance(&url).await,
    );
    assert_eq!(
        (a.fleet.version(), b.fleet.version(), c.fleet.version()),
        (0, 0, 0)
    );
    assert_eq!(admits(&c, "before").await, 3, "the rules as built");

    // 20 changes through A, alternating 6 and 4; each measured from the
    // publish's answer to the change in force on B and on C.
    let mut times = Vec::new();
    for i in 0..20u64 {
        let n = if i % 2 == 0 { 6 } else { 4 };
        let version = a.fleet.publish(&capacity(n)).await.unwrap();
        assert_eq!(version, i + 1);
        assert_eq!(
            a.fleet.version(),
            version,
            "in force on the publisher at once"
        );
        let published = Instant::now();
        for other in [&b, &c] {
            until_version(other, version, Duration::from_secs(1)).await;
            times.push(published.elapsed());
        }
        assert_eq!(admits(&c, &format!("fresh-{i}")).await, n as usize);
    }
    times.sort_unstable();
    eprintln!(
        "propagation over {} (change, instance) pairs: median {:?}, worst {:?}",
        times.len(),
        times[times.len() / 2],
        times[times.len() - 1]
    );

    // Started afterwards: the set in force before it serves.
    let d = instance(&url).await;
    assert_eq!(d.fleet.version(), 20);
    assert_eq!(admits(&d, "late").await, 4);
    assert_eq!(d.fleet.set(), capacity(4));

    // A bad set: refused before publishing, nothing changes anywhere.
    let bad = PolicySet::from_json(r#"{"rules": {"exprot": {}}}"#).unwrap();
    match a.fleet.publish(&bad).await {
        Err(PublishError::Invalid(e)) => {
            assert_eq!(
                e.to_string(),
                "rules.exprot: no rule has a policy of this name"
            );
        }
        other => panic!("{other:?}"),
    }
    // Written to Redis behind the fleet's back (another version's code, a
    // hand edit): every instance keeps its set, counts it once, and says
    // which version it runs.
    redis
        .query(&[
            "HSET",
            "fleet-test:policies",
            "version",
            "21",
            "set",
            r#"{"rules": {"export": {"policy": {"capacity": 0}}}}"#,
        ])
        .unwrap();
    redis
        .query(&["PUBLISH", "fleet-test:policies", "21"])
        .unwrap();
    for (i, instance) in [&a, &b, &c, &d].into_iter().enumerate() {
        let start = Instant::now();
        while instance.fleet.stats().refused == 0 {
            assert!(start.elapsed() < Duration::from_secs(2), "not refused");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(instance.fleet.version(), 20);
        assert_eq!(admits(instance, &format!("after-bad-{i}")).await, 4);
    }
    // Read again and again (every half second): still counted once.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(a.fleet.stats().refused, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_a_publish_and_a_lost_set_is_written_back() {
    let mut redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let (a, b) = (instance(&url).await, instance(&url).await);
    let version = a.fleet.publish(&capacity(6)).await.unwrap();
    until_version(&b, version, Duration::from_secs(1)).await;

    redis.kill();
    match a.fleet.publish(&capacity(2)).await {
        Err(PublishError::Store(e)) => eprintln!("publishing with Redis down: {e}"),
        other => panic!("{other:?}"),
    }
    assert_eq!((a.fleet.version(), b.fleet.version()), (version, version));
    assert_eq!(a.fleet.set(), capacity(6), "nothing changed");
    // The watchers fail to read meanwhile, and count it.
    let start = Instant::now();
    while b.fleet.stats().read_errors == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "no read error seen"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Restarted without persistence: the set is gone. The instances keep
    // theirs and write it back, at the version they run.
    redis.restart();
    let start = Instant::now();
    loop {
        // (The count moves once the write-back's answer is in: after the
        // key does.)
        let counted = a.fleet.stats().restored + b.fleet.stats().restored >= 1;
        if let Ok(held) = redis.query(&["HGET", "fleet-test:policies", "version"])
            && held == version.to_string()
            && counted
        {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "not written back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((a.fleet.version(), b.fleet.version()), (version, version));
    // And the fleet goes on from there. (B's connection may still be the
    // one its manager failed to make while Redis was down: its first call
    // can fail with that error, publishing nothing, as documented; the
    // next one reconnects.)
    let start = Instant::now();
    let next = loop {
        match b.fleet.publish(&capacity(5)).await {
            Ok(next) => break next,
            Err(PublishError::Store(e)) if start.elapsed() < Duration::from_secs(3) => {
                eprintln!("publishing just after the restart: {e}");
                assert_eq!(
                    b.fleet.version(),
                    version,
                    "a failed publish changed nothing"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(next, version + 1);
    until_version(&a, next, Duration::from_secs(1)).await;
    assert_eq!(admits(&a, "after-restart").await, 5);
}

/// A store made from a connection of the application's own has no
/// announcements: the periodic check alone brings the change, within a
/// second (half a second by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_announcements_the_periodic_check_brings_the_change() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let a = instance(&url).await;
    let client = tollgate::redis::redis::Client::open(url.as_str()).unwrap();
    let manager = tollgate::redis::redis::aio::ConnectionManager::new(client)
        .await
        .unwrap();
    let store = RedisStore::with_connection_manager(manager)
        .prefix("fleet-test")
        .build()
        .unwrap();
    assert!(store.policy_announcements().await.is_none());
    let export = Policy::token_bucket("export", 3, Rate::per_minute(1)).unwrap();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::per_account(export))
        .build()
        .unwrap();
    let polled = Instance {
        fleet: FleetPolicies::start(store, layer.rules_handle())
            .await
            .unwrap(),
        layer,
    };
    let version = a.fleet.publish(&capacity(7)).await.unwrap();
    let took = until_version(&polled, version, Duration::from_secs(1)).await;
    eprintln!("by the periodic check alone: {took:?}");
    assert_eq!(admits(&polled, "polled").await, 7);
}

/// Publishing under load: a client spends one account's budget on B (a
/// request every 5 ms) while A publishes a higher and then a lower limit.
/// Across the fleet, what is admitted in any interval stays within the
/// envelope of the most generous policy published (capacity 10 plus 5 a
/// second), and lowering gives no burst: the debt carried over holds B
/// at nothing for the rest of the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_under_load_keeps_the_fleets_envelope_and_lowering_gives_no_burst() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let (a, b) = (instance(&url).await, instance(&url).await);
    let per_second = |capacity: u64, rate: u64| {
        PolicySet::from_json(&format!(
            r#"{{"rules": {{"export": {{"policy": {{"capacity": {capacity}, "refill": {{"per_second": {rate}}}}}}}}}}}"#
        ))
        .unwrap()
    };
    // Start from 3 refilled 2 a second (published: the instances' own
    // rules refill 1 a minute).
    let first = a.fleet.publish(&per_second(3, 2)).await.unwrap();
    until_version(&b, first, Duration::from_secs(1)).await;

    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let svc = b.layer.layer(inner);
    let start = Instant::now();
    let client = tokio::spawn(async move {
        let mut svc = svc;
        let mut admitted = Vec::new();
        while start.elapsed() < Duration::from_secs(6) {
            let mut req = Request::new(String::new());
            let peer: SocketAddr = "192.0.2.1:1000".parse().unwrap();
            req.extensions_mut().insert(PeerAddr(peer));
            req.extensions_mut()
                .insert(Principal::new("acme".to_owned(), "alice".to_owned()));
            let response = svc.ready().await.unwrap().call(req).await.unwrap();
            if response.status() == StatusCode::OK {
                admitted.push(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        admitted
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let high = a.fleet.publish(&per_second(10, 5)).await.unwrap();
    until_version(&b, high, Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let low = a.fleet.publish(&per_second(2, 1)).await.unwrap();
    until_version(&b, low, Duration::from_secs(1)).await;
    let lowered = start.elapsed();
    let admitted = client.await.unwrap();

    // The envelope of the most generous policy: in every interval between
    // two admissions, at most 10 + 5/s × its length (+1: both ends count).
    for (i, from) in admitted.iter().enumerate() {
        for (j, to) in admitted.iter().enumerate().skip(i) {
            // (count - 11) × 1000 <= 5 × the interval in ms, in integers.
            let count = i128::try_from(j - i + 1).unwrap();
            let ms = i128::try_from((*to - *from).as_millis()).unwrap();
            assert!(
                (count - 11) * 1000 <= 5 * ms,
                "{} admitted between {from:?} and {to:?}",
                j - i + 1
            );
        }
    }
    // After lowering: the bucket of 10 was spent, so 2 refilled 1 a second
    // starts 8 in debt: nothing for the 1.x s left of the run.
    let after: Vec<_> = admitted.iter().filter(|t| **t > lowered).collect();
    assert!(after.is_empty(), "admitted after lowering: {after:?}");
    // And the higher limit was used: more than the first 2 s gave.
    let first_two = admitted
        .iter()
        .filter(|t| **t < Duration::from_secs(2))
        .count();
    let next_two = admitted
        .iter()
        .filter(|t| (Duration::from_secs(2)..Duration::from_secs(4)).contains(t))
        .count();
    eprintln!(
        "admitted: {first_two} in the first 2 s, {next_two} in the next 2 s, {} after lowering",
        after.len()
    );
    assert!(
        next_two > first_two,
        "{next_two} under the higher limit, {first_two} before"
    );
}

fn reports(capacity: u64) -> Policy {
    Policy::token_bucket("reports", capacity, Rate::per_minute(1)).unwrap()
}

/// An instance with the budget "reports" (3 a minute, 10 on plan "pro")
/// that compares numbers every `period`.
async fn reporting(url: &str, period: Duration) -> Instance {
    let store = RedisStore::builder(url)
        .unwrap()
        .prefix("numbers-test")
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(store.clone())
        .rule(Rule::per_account(reports(3)).plan("pro", reports(10)))
        .build()
        .unwrap();
    let fleet = FleetPolicies::builder(store, layer.rules_handle())
        .compare_numbers_every(period)
        .start()
        .await
        .unwrap();
    Instance { layer, fleet }
}

/// Found in review: instances comparing at different periods, an
/// instance stopped shortly before a publication, and a record written by
/// hand with a time far ahead. A real mismatch is seen by both instances
/// whatever their periods; a stopped instance's record (not aged out yet)
/// is not taken for one that runs other numbers; garbage is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatches_are_seen_across_periods_and_stopped_instances_are_not_mismatches() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let a = reporting(&url, Duration::from_millis(100)).await;
    let b = reporting(&url, Duration::from_millis(700)).await;
    // C says its numbers every 3 s: its record outlives it by up to 9 s.
    let c = reporting(&url, Duration::from_secs(3)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(c);
    let five = PolicySet::from_json(
        r#"{"rules": {"reports": {"policy": {"capacity": 5, "refill": {"per_minute": 1}}}}}"#,
    )
    .unwrap();
    let version = a.fleet.publish(&five).await.unwrap();
    until_version(&b, version, Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        (a.fleet.stats().mismatched, b.fleet.stats().mismatched),
        (0, 0),
        "the stopped instance's old numbers counted"
    );

    // A real mismatch, between a 100 ms and a 700 ms comparer.
    b.layer.rules_handle().set_plan("pro", reports(20)).unwrap();
    let took = until("both see it", Duration::from_secs(10), || {
        !a.fleet.mismatched().is_empty() && !b.fleet.mismatched().is_empty()
    })
    .await;
    eprintln!("mismatch across periods seen by both after {took:?}");
    b.layer.rules_handle().set_plan("pro", reports(10)).unwrap();
    until("agreeing again", Duration::from_secs(10), || {
        a.fleet.mismatched().is_empty() && b.fleet.mismatched().is_empty()
    })
    .await;

    // Garbage dated far ahead: dropped at the next comparison, and never
    // a mismatch.
    let ghost = "reports/requests\nghost";
    redis
        .query(&[
            "HSET",
            "numbers-test:policies:numbers",
            ghost,
            "99999999999999 0 600000 1000 deadbeef ghostlabel",
        ])
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let left = redis
        .query(&["HEXISTS", "numbers-test:policies:numbers", ghost])
        .unwrap();
    assert_eq!(left.trim(), "0", "the ghost stays: {left:?}");
    assert!(a.fleet.mismatched().is_empty() && b.fleet.mismatched().is_empty());
}

/// Log lines written by this test's tasks (a current-thread runtime: every
/// task runs on the thread the subscriber is the default of).
#[derive(Clone, Default)]
struct Logged(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logged {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logged {
    /// How many lines have `level` and contain every one of `words`.
    fn lines(&self, level: &str, words: &[&str]) -> usize {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .filter(|l| l.contains(level) && words.iter().all(|w| l.contains(w)))
            .count()
    }
}

/// The issue's own case: plan "pro" changed on B only, while A and B
/// charge one budget on one Redis. Both count it and log it once per
/// budget and period, however many requests they serve meanwhile; both
/// stop once they agree again. Agreeing instances, and a publication that
/// reaches both, count nothing.
#[tokio::test]
async fn instances_charging_one_budget_under_different_numbers_count_and_log_it() {
    let logged = Logged::default();
    let writer = logged.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    const PERIOD: Duration = Duration::from_millis(100);
    let (a, b) = (reporting(&url, PERIOD).await, reporting(&url, PERIOD).await);
    // The same numbers, then a publication both apply: nothing counted.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let five = PolicySet::from_json(
        r#"{"rules": {"reports": {"policy": {"capacity": 5, "refill": {"per_minute": 1}}}}}"#,
    )
    .unwrap();
    let version = a.fleet.publish(&five).await.unwrap();
    until_version(&b, version, Duration::from_secs(1)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        (a.fleet.stats().mismatched, b.fleet.stats().mismatched),
        (0, 0)
    );
    assert!(a.fleet.mismatched().is_empty() && b.fleet.mismatched().is_empty());

    // B alone changes plan "pro": within a second or two both see it.
    b.layer.rules_handle().set_plan("pro", reports(20)).unwrap();
    let changed = Instant::now();
    while a.fleet.mismatched().is_empty() || b.fleet.mismatched().is_empty() {
        assert!(
            changed.elapsed() < Duration::from_secs(10),
            "not seen: A {:?}, B {:?}",
            a.fleet.mismatched(),
            b.fleet.mismatched()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("mismatch seen by both after {:?}", changed.elapsed());
    assert_eq!(a.fleet.mismatched(), ["reports"]);
    assert_eq!(b.fleet.mismatched(), ["reports"]);

    // Counted per period, not per request: 300 requests on B meanwhile.
    let (a0, b0) = (a.fleet.stats().mismatched, b.fleet.stats().mismatched);
    let measuring = Instant::now();
    for i in 0..15 {
        admits(&b, &format!("busy-{i}")).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let periods = u64::try_from(measuring.elapsed().as_millis() / PERIOD.as_millis()).unwrap();
    let (da, db) = (
        a.fleet.stats().mismatched - a0,
        b.fleet.stats().mismatched - b0,
    );
    eprintln!("over {periods} periods: A counted {da}, B {db}");
    assert!(da >= 1 && db >= 1, "still counted: {da} {db}");
    assert!(
        da <= periods + 2 && db <= periods + 2,
        "{da} {db} in {periods} periods"
    );
    let warnings = logged.lines("WARN", &["policy=\"reports\"", "other numbers"]);
    let counted = a.fleet.stats().mismatched + b.fleet.stats().mismatched;
    assert!(
        warnings >= 2 && u64::try_from(warnings).unwrap() <= counted,
        "{warnings} warnings for {counted} counted"
    );

    // B back to A's numbers: both stop counting, and say so.
    b.layer.rules_handle().set_plan("pro", reports(10)).unwrap();
    let fixed = Instant::now();
    while !a.fleet.mismatched().is_empty() || !b.fleet.mismatched().is_empty() {
        assert!(fixed.elapsed() < Duration::from_secs(10), "still differing");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let settled = (a.fleet.stats().mismatched, b.fleet.stats().mismatched);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        (a.fleet.stats().mismatched, b.fleet.stats().mismatched),
        settled
    );
    assert_eq!(
        logged.lines("INFO", &["policy=reports", "same numbers again"]),
        2
    );
}

/// Fifty changes made at once through three instances, each adding its
/// own plan to the set published last: every one takes effect (compare and
/// publish, made again after a pause when another came first), none is
/// lost or erases another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_changes_at_once_over_three_instances_all_take_effect() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let fleet = [
        instance(&url).await,
        instance(&url).await,
        instance(&url).await,
    ];
    let changes = (0..50).map(|i| {
        let on = &fleet[i % 3];
        async move {
            on.fleet
                .publish_change(|set| {
                    let data = tollgate::rate_limit::PolicyData::from_json(
                        r#"{"capacity": 2, "refill": {"per_second": 1}}"#,
                    )
                    .unwrap();
                    set.rules
                        .entry("export".into())
                        .or_default()
                        .plans
                        .insert(format!("c{i}"), data);
                })
                .await
        }
    });
    let results = futures_join_all(changes).await;
    let failed: Vec<_> = results.iter().filter(|r| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of 50 failed: {failed:?}",
        failed.len()
    );
    let last = results.iter().map(|r| r.as_ref().unwrap().0).max().unwrap();
    assert_eq!(last, 50, "one version per change");
    for on in &fleet {
        until_version(on, last, Duration::from_secs(1)).await;
        let plans = &on.fleet.set().rules["export"].plans;
        assert_eq!(plans.len(), 50, "{:?}", plans.keys());
    }
}

/// Awaits every future, concurrently (on this task).
async fn futures_join_all<F: std::future::Future>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in futures {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in set.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *slot = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|v| v.unwrap()).collect()
}

/// Found in review: versions written by hand that Lua's `tonumber` read
/// as numbers and Rust did not (`1e3`, `inf`, ` 12`, `0x10`) stopped every
/// change for good. Both now read anything but up to 15 digits as no
/// version: the instances write theirs back, and changes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_written_by_hand_in_any_form_stops_nothing() {
    let redis = or_skip!(RedisServer::start());
    let url = redis.url();
    let (a, b) = (instance(&url).await, instance(&url).await);
    let first = a.fleet.publish(&capacity(5)).await.unwrap();
    until_version(&b, first, Duration::from_secs(1)).await;
    for (i, broken) in ["1e3", "inf", " 12", "0x10", "12.0", "1234567890123456"]
        .into_iter()
        .enumerate()
    {
        redis
            .query(&["HSET", "fleet-test:policies", "version", broken])
            .unwrap();
        let n = 6 + u64::try_from(i).unwrap();
        let (version, _) = a
            .fleet
            .publish_change(|set| *set = capacity(n))
            .await
            .unwrap_or_else(|e| panic!("after version {broken:?}: {e}"));
        assert!(version > first, "{broken:?}: {version}");
        until_version(&b, version, Duration::from_secs(1)).await;
        assert_eq!(
            admits(&b, &format!("hand-{i}")).await,
            usize::try_from(n).unwrap()
        );
    }
}
