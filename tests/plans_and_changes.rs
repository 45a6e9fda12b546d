//! Policies that depend on who is asking (plans, overrides) and limits
//! changed while serving, over real sockets: what a key has spent carries
//! over, a downgrade or a lowered limit admits no burst, and under
//! concurrent load the cost admitted stays within the envelope of the
//! numbers in force.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::middleware;
use axum::routing::get;
use common::{ip, param, send, serve, sf_list, test_auth};
use http::StatusCode;
use num_rational::Ratio;
use tollgate::{
    MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule, Store,
    store::{Clock, ManualClock},
};

fn export(capacity: u64, per_second: u64) -> Policy {
    Policy::token_bucket("export", capacity, Rate::per_second(per_second)).unwrap()
}

/// One request; its status and the `export` limit's `r` and `q`.
async fn ask(
    addr: std::net::SocketAddr,
    user: &str,
    plan: Option<&str>,
) -> (StatusCode, Option<i64>, Option<i64>) {
    let mut headers = vec![("X-Test-User", user)];
    if let Some(plan) = plan {
        headers.push(("X-Test-Plan", plan));
    }
    let r = send(addr, ip("127.0.0.1"), "GET", "/export", &headers, b"").await;
    let field = |name: &str, key: &str| {
        let list = sf_list(r.header(name)?);
        let export = list.iter().find(|m| m.0 == "export")?;
        param(export, key)
    };
    (
        r.status,
        field("ratelimit", "r"),
        field("ratelimit-policy", "q"),
    )
}

const OK: StatusCode = StatusCode::OK;
const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;

/// Alice's plan goes up, down and up again while her budget is spent, the
/// store's clock held still or moved by the test: what she has spent
/// carries over in full, so no switch mints credit.
async fn upgrade_and_downgrade<St: Store>(store: St, clock: ManualClock) {
    let rule = Rule::per_account(export(3, 2)).plan("pro", export(10, 5));
    let app = Router::new()
        .route("/export", get(|| async { "ok" }))
        .layer(RateLimitLayer::builder(store).rule(rule).build().unwrap())
        .layer(middleware::from_fn(test_auth));
    let addr = serve(app).await;
    let alice = "north/alice";

    // The default plan: 3, then refused.
    for left in [2, 1, 0] {
        assert_eq!(ask(addr, alice, None).await, (OK, Some(left), Some(3)));
    }
    assert_eq!(ask(addr, alice, None).await.0, LIMITED);
    // Upgraded: the 3 spent are kept, 7 of 10 are left.
    assert_eq!(ask(addr, alice, Some("pro")).await, (OK, Some(6), Some(10)));
    for left in (0..6).rev() {
        assert_eq!(
            ask(addr, alice, Some("pro")).await,
            (OK, Some(left), Some(10))
        );
    }
    assert_eq!(ask(addr, alice, Some("pro")).await.0, LIMITED);
    // Downgraded with 10 spent: the small bucket is empty, and the 7 it
    // cannot hold are a debt of 3.5 s at 2 per second. The refusal spends
    // nothing; the key is under the default's numbers from here.
    assert_eq!(ask(addr, alice, None).await, (LIMITED, Some(0), Some(3)));
    clock.set(3_900_000_000);
    assert_eq!(ask(addr, alice, None).await.0, LIMITED);
    clock.set(4_000_000_000);
    assert_eq!(ask(addr, alice, None).await, (OK, Some(0), Some(3)));
    assert_eq!(ask(addr, alice, None).await.0, LIMITED);
    // Upgraded again with 3 spent: 7 of 10 left, nothing forgotten.
    assert_eq!(ask(addr, alice, Some("pro")).await, (OK, Some(6), Some(10)));
    // A plan no policy was added for is the default, and it owes: 4 of
    // 10 spent is more than 3.
    assert_eq!(
        ask(addr, alice, Some("gold")).await,
        (LIMITED, Some(0), Some(3))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_upgrade_and_downgrade_carry_the_budget_over_in_memory() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    upgrade_and_downgrade(store, clock).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_plan_upgrade_and_downgrade_carry_the_budget_over_in_redis() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let clock = ManualClock::new(0);
    let reading = clock.clone();
    let store = tollgate::RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .injected_time(move || reading.now())
        .build()
        .unwrap();
    upgrade_and_downgrade(Arc::new(store), clock).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn overrides_come_before_plans_and_the_chooser_before_the_principals_plan() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let rule = Rule::per_account(export(3, 2))
        .plan("pro", export(10, 5))
        .plan("trial", export(1, 1))
        .for_tenant("internal", export(100, 50))
        .for_account("north", "vip", export(50, 25))
        // Requests of tenant "beta" are on the trial plan, whatever their
        // principal says.
        .plan_from(|parts| {
            let p = parts.extensions.get::<Principal>()?;
            (p.tenant() == "beta").then(|| "trial".to_owned())
        });
    let app = Router::new()
        .route("/export", get(|| async { "ok" }))
        .layer(RateLimitLayer::builder(store).rule(rule).build().unwrap())
        .layer(middleware::from_fn(test_auth));
    let addr = serve(app).await;
    let q = |r: (StatusCode, Option<i64>, Option<i64>)| r.2;
    assert_eq!(q(ask(addr, "north/alice", None).await), Some(3));
    assert_eq!(q(ask(addr, "north/bob", Some("pro")).await), Some(10));
    assert_eq!(q(ask(addr, "internal/svc", Some("trial")).await), Some(100));
    assert_eq!(q(ask(addr, "north/vip", Some("pro")).await), Some(50));
    assert_eq!(q(ask(addr, "beta/eve", Some("pro")).await), Some(1));
    assert_eq!(ask(addr, "beta/eve", Some("pro")).await.0, LIMITED);
}

/// `rule` as a layer's `build` checks it, on the in-memory store.
fn checked(rule: Rule) -> Result<(), tollgate::InvalidRule> {
    RateLimitLayer::builder(tollgate::MemoryStore::new())
        .rule(rule)
        .build()
        .map(drop)
}

#[test]
fn a_plan_must_share_the_rules_budget() {
    let other_name = Policy::token_bucket("export-pro", 10, Rate::per_second(5)).unwrap();
    let e = checked(Rule::per_account(export(3, 2)).plan("pro", other_name)).unwrap_err();
    assert_eq!(e.policy(), "export");
    assert!(e.to_string().contains("\"export-pro\""), "{e}");
    let bytes = export(10, 5).with_unit(tollgate::Unit::Bytes);
    assert!(checked(Rule::per_account(export(3, 2)).for_tenant("t", bytes)).is_err());
    // A plan counting in requests takes the rule's unit.
    let rule =
        Rule::per_account(export(3, 2).with_unit(tollgate::Unit::Bytes)).plan("pro", export(10, 5));
    assert_eq!(rule.policy().unit(), &tollgate::Unit::Bytes);
    checked(rule).unwrap();
}

/// A store that refuses one policy's numbers, as a Redis store refuses
/// numbers it cannot decide exactly.
#[tokio::test]
async fn a_plan_the_store_cannot_hold_is_refused_when_the_rule_is_added() {
    let huge = Policy::token_bucket("export", 1 << 30, Rate::per_second(1)).unwrap();
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let store = tollgate::RedisStore::builder(&server.url())
        .unwrap()
        .build()
        .unwrap();
    let e = RateLimitLayer::builder(store)
        .rule(Rule::per_account(export(3, 2)).plan("big", huge))
        .build()
        .unwrap_err();
    assert_eq!(e.policy(), "export");
    assert!(e.to_string().contains("2^53"), "{e}");
}

type Q = Ratio<i128>;

/// One answer of the load: when, whether admitted, and the `q` of the
/// policy that decided it (its capacity).
struct Answer {
    at: u64,
    admitted: bool,
    capacity: u64,
}

/// Rounds of 12 concurrent requests, 100 ms apart on the store's clock;
/// between rounds the global limit changes: lowered at round 8, raised at
/// round 16. Returns every answer.
async fn change_under_load<St: Store>(store: St, clock: ManualClock) -> Vec<Answer> {
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::new(export(20, 10)))
        .build()
        .unwrap();
    let handle = layer.rules_handle();
    let app = Router::new()
        .route("/export", get(|| async { "ok" }))
        .layer(layer);
    let addr = serve(app).await;
    let mut answers = Vec::new();
    for round in 0..24u64 {
        if round == 8 {
            assert_eq!(handle.set_policy(export(5, 2)).unwrap(), 1);
        }
        if round == 16 {
            assert_eq!(handle.set_policy(export(40, 30)).unwrap(), 1);
        }
        let at = round * 100_000_000;
        clock.set(at);
        let tasks: Vec<_> = (0..12)
            .map(|_| {
                tokio::spawn(async move {
                    let r = send(addr, ip("127.0.0.1"), "GET", "/export", &[], b"").await;
                    let q = r.header("ratelimit-policy").map(|v| {
                        let list = sf_list(v);
                        param(&list[0], "q").unwrap()
                    });
                    (r.status, q)
                })
            })
            .collect();
        for t in tasks {
            let (status, q) = t.await.unwrap();
            assert!(status == OK || status == LIMITED, "{status}");
            answers.push(Answer {
                at,
                admitted: status == OK,
                capacity: u64::try_from(q.expect("answered with fields")).unwrap(),
            });
        }
    }
    answers
}

/// For every interval `[a, b]` of admissions, across any number of changes:
/// the cost admitted is at most the largest capacity in force plus each policy's rate
/// over the time it was in force, a policy being in force from its key's
/// first charge under it (which the `q` of the answers shows, admitted or
/// not).
fn assert_within_the_envelope(answers: &[Answer]) {
    let rate = |capacity: u64| match capacity {
        20 => Q::new(10, 1_000_000_000),
        5 => Q::new(2, 1_000_000_000),
        40 => Q::new(30, 1_000_000_000),
        other => panic!("unexpected capacity {other}"),
    };
    let mut starts: Vec<(u64, u64)> = Vec::new();
    for a in answers {
        if starts.last().is_none_or(|&(_, c)| c != a.capacity) {
            starts.push((a.at, a.capacity));
        }
    }
    assert_eq!(
        starts.iter().map(|s| s.1).collect::<Vec<_>>(),
        [20, 5, 40],
        "each limit answered in turn"
    );
    // The lowered limit admits no burst: nothing in its first round (the
    // old budget was spent); the raised one admits its new room at once.
    let admitted_at = |at: u64| answers.iter().filter(|a| a.at == at && a.admitted).count();
    assert_eq!(admitted_at(800_000_000), 0, "no burst when lowered");
    assert_eq!(
        admitted_at(1_600_000_000),
        12,
        "a raised limit admits at once"
    );
    let admitted: Vec<&Answer> = answers.iter().filter(|a| a.admitted).collect();
    for (i, first) in admitted.iter().enumerate() {
        let mut total = 0u64;
        for last in &admitted[i..] {
            total += 1;
            let (a, b) = (first.at, last.at);
            let spans: Vec<(u64, u64, u64)> = starts
                .iter()
                .enumerate()
                .map(|(k, &(start, capacity))| {
                    let end = starts.get(k + 1).map_or(u64::MAX, |s| s.0);
                    (start, end, capacity)
                })
                .filter(|&(start, end, _)| start <= b && end > a)
                .collect();
            let mut limit = Q::from_integer(0);
            let mut biggest = 0;
            for (start, end, capacity) in spans {
                let (from, to) = (a.max(start), b.min(end));
                limit += rate(capacity) * Q::from_integer(i128::from(to.saturating_sub(from)));
                biggest = biggest.max(capacity);
            }
            limit += Q::from_integer(i128::from(biggest));
            assert!(
                Q::from_integer(i128::from(total)) <= limit,
                "{total} admitted in [{a}, {b}], over {limit}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_limit_changed_under_load_keeps_to_the_envelope_in_memory() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let answers = change_under_load(store, clock).await;
    assert_within_the_envelope(&answers);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_limit_changed_under_load_keeps_to_the_envelope_in_redis() {
    let server = tollgate_testkit::or_skip!(tollgate_testkit::RedisServer::start());
    let clock = ManualClock::new(0);
    let reading = clock.clone();
    let store = tollgate::RedisStore::builder(&server.url())
        .unwrap()
        .timeout(Duration::from_secs(2))
        .injected_time(move || reading.now())
        .build()
        .unwrap();
    let answers = change_under_load(Arc::new(store), clock).await;
    assert_within_the_envelope(&answers);
}

#[tokio::test(flavor = "multi_thread")]
async fn replacing_the_rules_checks_them_first_and_keeps_the_budget() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = RateLimitLayer::builder(store)
        .rule(Rule::per_account(export(3, 2)))
        .build()
        .unwrap();
    let handle = layer.rules_handle();
    let app = Router::new()
        .route("/export", get(|| async { "ok" }))
        .layer(layer)
        .layer(middleware::from_fn(test_auth));
    let addr = serve(app).await;
    for _ in 0..2 {
        assert_eq!(ask(addr, "north/alice", None).await.0, OK);
    }
    // A whole new rule set with the same budget name, raised: the 2 spent
    // are kept.
    handle
        .replace([
            Rule::per_account(export(6, 2)),
            Rule::new(export(100, 1).with_unit(tollgate::Unit::Bytes)),
        ])
        .unwrap();
    assert_eq!(handle.rules().len(), 2);
    assert_eq!(ask(addr, "north/alice", None).await, (OK, Some(3), Some(6)));
    // No rule has a policy named "other": nothing changes.
    let other = Policy::token_bucket("other", 1, Rate::per_second(1)).unwrap();
    assert_eq!(handle.set_policy(other).unwrap(), 0);
}

/// Found in review: `set_policy` compared units before applying the
/// rule's, so a rule with a content cost (counting in `content-kib`) was
/// never changed.
#[test]
fn set_policy_takes_the_rules_unit() {
    let upload =
        |capacity| Policy::token_bucket("upload", capacity, Rate::per_second(256)).unwrap();
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_account(upload(1024)).with_cost(tollgate::Cost::content_kib()))
        .build()
        .unwrap();
    let handle = layer.rules_handle();
    assert_eq!(handle.set_policy(upload(2048)).unwrap(), 1);
    let rules = handle.rules();
    assert_eq!(rules[0].policy().capacity(), 2048);
    assert_eq!(rules[0].policy().unit().as_str(), "content-kib");
}

/// One plan changed at runtime (`RulesHandle::set_plan`): the default and
/// the other plans keep their numbers, the plan's principals carry what
/// they spent over to the new ones, a plan not given before is added, and
/// a policy of another budget changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn one_plan_changes_at_runtime_and_keeps_what_was_spent() {
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let rule = Rule::per_account(export(3, 2))
        .plan("pro", export(10, 5))
        .plan("team", export(20, 5));
    let layer = RateLimitLayer::builder(store).rule(rule).build().unwrap();
    let handle = layer.rules_handle();
    let app = Router::new()
        .route("/export", get(|| async { "ok" }))
        .layer(layer)
        .layer(middleware::from_fn(test_auth));
    let addr = serve(app).await;
    // Alice (pro) spends 4 of 10.
    for left in [9, 8, 7, 6] {
        assert_eq!(
            ask(addr, "north/alice", Some("pro")).await,
            (OK, Some(left), Some(10))
        );
    }
    // "pro" becomes 5: the 4 spent carry over, 1 is left.
    assert_eq!(handle.set_plan("pro", export(5, 1)).unwrap(), 1);
    assert_eq!(
        ask(addr, "north/alice", Some("pro")).await,
        (OK, Some(0), Some(5))
    );
    assert_eq!(ask(addr, "north/alice", Some("pro")).await.0, LIMITED);
    // The default and "team" are as they were.
    assert_eq!(ask(addr, "north/bob", None).await, (OK, Some(2), Some(3)));
    assert_eq!(
        ask(addr, "north/carol", Some("team")).await,
        (OK, Some(19), Some(20))
    );
    // A plan not given before is added; another budget changes nothing.
    assert_eq!(handle.set_plan("gold", export(100, 50)).unwrap(), 1);
    assert_eq!(
        ask(addr, "north/dave", Some("gold")).await,
        (OK, Some(99), Some(100))
    );
    let other = Policy::token_bucket("upload", 1, Rate::per_second(1)).unwrap();
    assert_eq!(handle.set_plan("pro", other).unwrap(), 0);
    assert_eq!(ask(addr, "north/alice", Some("pro")).await.0, LIMITED);
}

/// A plan, tenant or account given twice on one rule is an error, not the
/// last one silently kept.
#[test]
fn a_plan_given_twice_is_an_error() {
    let e = checked(
        Rule::per_account(export(3, 2))
            .plan("pro", export(10, 5))
            .plan("pro", export(20, 5)),
    )
    .unwrap_err();
    assert_eq!(e.policy(), "export");
    assert!(e.to_string().contains("given twice"), "{e}");
    let twice = Rule::per_account(export(3, 2))
        .for_tenant("t", export(10, 5))
        .for_tenant("t", export(10, 5));
    assert!(checked(twice).is_err());
    let twice = Rule::per_account(export(3, 2))
        .for_account("t", "a", export(10, 5))
        .for_account("t", "a", export(10, 5));
    assert!(checked(twice).is_err());
    // The same name as a plan and as a tenant are different entries.
    assert!(
        checked(
            Rule::per_account(export(3, 2))
                .plan("x", export(10, 5))
                .for_tenant("x", export(10, 5))
        )
        .is_ok()
    );
}

/// Found in review: `set_policy` checked the rules it loaded, then applied
/// the change to whatever rules were in force by then, so a `replace`
/// landing in between got the new policy unchecked (a shaping rule with a
/// window). Every rule in force must pass the checks `build` makes, after
/// any interleaving of changes.
#[test]
fn a_change_racing_another_never_puts_an_unchecked_rule_in_force() {
    use std::num::NonZeroUsize;
    let bucket = Policy::token_bucket("s", 10, Rate::per_second(1)).unwrap();
    let window = Policy::fixed_window("s", 10, std::time::Duration::from_secs(1)).unwrap();
    let shaping = Rule::per_client_ip(bucket.clone())
        .shape(std::time::Duration::from_secs(1), NonZeroUsize::MIN);
    for _ in 0..2_000 {
        let layer = RateLimitLayer::builder(tollgate::MemoryStore::new())
            .rule(Rule::per_client_ip(bucket.clone()))
            .build()
            .unwrap();
        let handle = layer.rules_handle();
        let (replacing, changing) = (handle.clone(), handle.clone());
        let shaping = shaping.clone();
        let window = window.clone();
        let a = std::thread::spawn(move || replacing.replace([shaping]).is_ok());
        let b = std::thread::spawn(move || changing.set_policy(window).is_ok());
        let (replaced, changed) = (a.join().unwrap(), b.join().unwrap());
        for rule in handle.rules().iter() {
            assert!(
                checked(rule.clone()).is_ok(),
                "replace {replaced}, set_policy {changed}: {rule:?} is in force unchecked"
            );
        }
    }
}

/// Found in review: two rules naming one budget with other numbers were
/// accepted and charged one state twice under numbers that flipped from
/// call to call. Rules that share a budget must give it the same numbers;
/// the same numbers on several routes stay one shared budget.
#[test]
fn rules_that_share_a_budget_must_give_it_the_same_numbers() {
    let clash = RateLimitLayer::builder(tollgate::MemoryStore::new())
        .rule(Rule::per_client_ip(export(2, 1)).on_route("/a"))
        .rule(Rule::per_client_ip(export(100, 1)).on_route("/b"))
        .build()
        .unwrap_err();
    assert_eq!(clash.policy(), "export");
    assert!(clash.to_string().contains("same budget"), "{clash}");
    assert!(!clash.is_unsupported_by_store());
    let layer = RateLimitLayer::builder(tollgate::MemoryStore::new())
        .rule(Rule::per_client_ip(export(2, 1)).on_route("/a"))
        .rule(Rule::per_client_ip(export(2, 1)).on_route("/b"))
        .build()
        .unwrap();
    let handle = layer.rules_handle();
    assert!(
        handle
            .replace([
                Rule::per_client_ip(export(2, 1)),
                Rule::per_account(export(3, 1)),
            ])
            .is_err()
    );
    assert_eq!(handle.rules().len(), 2, "nothing changed");
}

/// Found in review: `Unit::Other` must be a valid name (it is written into
/// `RateLimit-Policy` and metric labels), but a quote or a newline in it
/// was accepted and broke the headers of every answer.
#[test]
fn a_unit_that_is_not_a_valid_name_is_refused() {
    for unit in ["a\"b", "a\nb", ""] {
        let policy = export(3, 1).with_unit(tollgate::Unit::Other(unit.into()));
        let e = checked(Rule::per_account(policy)).unwrap_err();
        assert!(e.to_string().contains("invalid unit"), "{unit:?}: {e}");
    }
    let kib = export(3, 1).with_unit(tollgate::Unit::Other("kib".into()));
    checked(Rule::per_account(kib)).unwrap();
}
