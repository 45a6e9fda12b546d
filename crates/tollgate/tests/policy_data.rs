//! Policies as data: a `PolicySet` read from JSON and TOML maps one to one
//! onto the builder (the same requests are admitted under a set applied
//! at runtime as under the rules built in code with the same numbers),
//! every invalid field is named with the rule it broke, and a set that
//! fails changes nothing.
#![cfg(feature = "serde")]

use std::convert::Infallible;
use std::net::SocketAddr;

use http::{Request, Response, StatusCode};
use tollgate::identity::PeerAddr;
use tollgate::rate_limit::PolicySet;
use tollgate::{MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule};
use tower::{Layer, Service, ServiceExt};

fn export(capacity: u64, per_second: u64) -> Policy {
    Policy::token_bucket("export", capacity, Rate::per_second(per_second)).unwrap()
}

fn request(tenant: &str, account: &str, plan: &str) -> Request<String> {
    let mut req = Request::builder()
        .uri("/export")
        .body(String::new())
        .unwrap();
    let peer: SocketAddr = "192.0.2.1:1000".parse().unwrap();
    req.extensions_mut().insert(PeerAddr(peer));
    let mut principal = Principal::new(tenant.to_owned(), account.to_owned());
    if !plan.is_empty() {
        principal = principal.with_plan(plan.to_owned());
    }
    req.extensions_mut().insert(principal);
    req
}

/// How many of `n` requests at one instant are admitted for each
/// (tenant, account, plan), in order.
async fn admitted(layer: &RateLimitLayer<MemoryStore>, who: &[(&str, &str, &str)]) -> Vec<usize> {
    let inner = tower::service_fn(|_req: Request<String>| async {
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let mut svc = layer.layer(inner);
    let mut counts = Vec::new();
    for (tenant, account, plan) in who {
        let mut n = 0;
        for _ in 0..50 {
            let response = svc
                .ready()
                .await
                .unwrap()
                .call(request(tenant, account, plan))
                .await
                .unwrap();
            if response.status() == StatusCode::OK {
                n += 1;
            }
        }
        counts.push(n);
    }
    counts
}

const WHO: [(&str, &str, &str); 5] = [
    ("acme", "alice", ""),
    ("acme", "bob", "pro"),
    ("internal", "ops", ""),
    ("acme", "batch", "pro"),
    ("other", "carol", "team"),
];

#[tokio::test(start_paused = true)]
async fn a_set_applied_at_runtime_admits_what_the_same_rules_built_in_code_admit() {
    let json = r#"{"rules": {"export": {
        "policy": {"capacity": 2, "refill": {"per_second": 1}},
        "plans": {"pro": {"capacity": 6, "refill": {"per_second": 2}},
                  "team": {"algorithm": "sliding_window", "limit": 4, "window": {"minutes": 1}}},
        "tenants": {"internal": {"capacity": 9, "refill": {"per_minute": 60}}},
        "accounts": {"acme/batch": {"algorithm": "fixed_window", "limit": 7, "window": {"seconds": 10}}}
    }}}"#;
    let set = PolicySet::from_json(json).unwrap();

    // Built in code with the numbers of the set.
    let coded = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::per_account(export(2, 1))
                .plan("pro", export(6, 2))
                .plan(
                    "team",
                    Policy::sliding_window("export", 4, std::time::Duration::from_secs(60))
                        .unwrap(),
                )
                .for_tenant(
                    "internal",
                    Policy::token_bucket("export", 9, Rate::per_minute(60)).unwrap(),
                )
                .for_account(
                    "acme",
                    "batch",
                    Policy::fixed_window("export", 7, std::time::Duration::from_secs(10)).unwrap(),
                ),
        )
        .build()
        .unwrap();

    // Built with other numbers, then the set applied.
    let applied = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_account(export(100, 100)))
        .build()
        .unwrap();
    assert_eq!(applied.rules_handle().apply(&set).unwrap(), 1);
    assert_eq!(applied.rules_handle().applied_set(), set);

    let expected = vec![2, 6, 9, 7, 4];
    assert_eq!(admitted(&coded, &WHO).await, expected);
    assert_eq!(admitted(&applied, &WHO).await, expected);
}

#[tokio::test(start_paused = true)]
async fn the_same_set_reads_from_toml() {
    let toml = r#"
        [rules.export.policy]
        capacity = 2
        refill = { per_second = 1 }

        [rules.export.plans.pro]
        capacity = 6
        refill = { per_second = 2 }
        initial = "empty"
    "#;
    let set: PolicySet = toml::from_str(toml).unwrap();
    set.validate().unwrap();
    let json = PolicySet::from_json(
        r#"{"rules": {"export": {"policy": {"capacity": 2, "refill": {"per_second": 1}},
            "plans": {"pro": {"capacity": 6, "refill": {"per_second": 2}, "initial": "empty"}}}}}"#,
    )
    .unwrap();
    assert_eq!(set, json);
    // And back: what it writes, it reads.
    assert_eq!(PolicySet::from_json(&set.to_json()).unwrap(), set);
    assert_eq!(
        toml::from_str::<PolicySet>(&toml::to_string(&set).unwrap()).unwrap(),
        set
    );
}

#[test]
fn every_invalid_field_is_named_with_the_rule_it_broke() {
    let cases = [
        (
            r#"{"rules": {"export": {"plans": {"pro": {"capacity": 0, "refill": {"per_second": 2}}}}}}"#,
            "rules.export.plans.pro.capacity: must be at least 1",
        ),
        (
            r#"{"rules": {"export": {"policy": {"refill": {"per_second": 2}}}}}"#,
            "rules.export.policy.capacity: missing: a token bucket needs it",
        ),
        (
            r#"{"rules": {"export": {"policy": {"capacity": 3}}}}"#,
            "rules.export.policy.refill: missing: a token bucket needs it",
        ),
        (
            r#"{"rules": {"export": {"policy": {"capacity": 3, "refill": {"per_second": 0}}}}}"#,
            "rules.export.policy.refill.per_second: must be at least 1",
        ),
        (
            r#"{"rules": {"export": {"policy": {"capacity": 3, "refill": {"every": {"amount": 1, "millis": 0}}}}}}"#,
            "rules.export.policy.refill.every.millis: must be at least 1",
        ),
        (
            r#"{"rules": {"export": {"policy": {"capacity": 3, "refill": {"per_second": 1}, "limit": 4}}}}"#,
            "rules.export.policy.limit: not a field of a token bucket (capacity, refill, initial)",
        ),
        (
            r#"{"rules": {"export": {"tenants": {"acme": {"algorithm": "fixed_window", "limit": 4}}}}}"#,
            "rules.export.tenants.acme.window: missing: a window needs it",
        ),
        (
            r#"{"rules": {"export": {"tenants": {"acme": {"algorithm": "sliding_window", "limit": 4, "window": {"hours": 0}}}}}}"#,
            "rules.export.tenants.acme.window.hours: must be at least 1",
        ),
        (
            r#"{"rules": {"export": {"accounts": {"alice": {"capacity": 1, "refill": {"per_second": 1}}}}}}"#,
            "rules.export.accounts.alice: an account is written tenant/account",
        ),
        (
            r#"{"rules": {"export": {"plans": {"a.b": {"capacity": 0, "refill": {"per_second": 1}}}}}}"#,
            r#"rules.export.plans."a.b".capacity: must be at least 1"#,
        ),
    ];
    for (json, expected) in cases {
        let err = PolicySet::from_json(json).unwrap_err();
        assert_eq!(err.to_string(), expected, "{json}");
    }
    // Type and syntax errors name their field too.
    let typo =
        PolicySet::from_json(r#"{"rules": {"export": {"policy": {"capacty": 3}}}}"#).unwrap_err();
    assert_eq!(typo.path(), "rules.export.policy.capacty");
    assert!(typo.reason().contains("unknown field"), "{typo}");
    let kind = PolicySet::from_json(r#"{"rules": {"export": {"policy": {"capacity": "3"}}}}"#)
        .unwrap_err();
    assert_eq!(kind.path(), "rules.export.policy.capacity");
    let overflow =
        PolicySet::from_json(r#"{"rules": {"export": {"policy": {"capacity": -1}}}}"#).unwrap_err();
    assert_eq!(overflow.path(), "rules.export.policy.capacity");
    assert!(PolicySet::from_json(r#"{"rules": {}} trailing"#).is_err());
    assert!(PolicySet::from_json("").is_err());
}

#[tokio::test(start_paused = true)]
async fn a_set_that_fails_changes_nothing_and_a_new_set_replaces_the_last() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(Rule::per_account(export(2, 1)).plan("pro", export(3, 1)))
        .build()
        .unwrap();
    let handle = layer.rules_handle();
    let first = PolicySet::from_json(
        r#"{"rules": {"export": {"plans": {"pro": {"capacity": 6, "refill": {"per_second": 2}}}}}}"#,
    )
    .unwrap();
    handle.apply(&first).unwrap();
    // A rule nobody has: an error, and the first set stays in force.
    let typo = PolicySet::from_json(
        r#"{"rules": {"export": {"policy": {"capacity": 9, "refill": {"per_second": 9}}},
                      "exprot": {}}}"#,
    )
    .unwrap();
    assert_eq!(
        handle.apply(&typo).unwrap_err().to_string(),
        "rules.exprot: no rule has a policy of this name"
    );
    assert_eq!(handle.applied_set(), first);
    assert_eq!(
        admitted(&layer, &[("a", "x", ""), ("a", "y", "pro")]).await,
        vec![2, 6]
    );
    // A new set replaces the last: the plan it no longer names goes back
    // to the number it was built with (3), carrying what was spent.
    let second = PolicySet::from_json(
        r#"{"rules": {"export": {"policy": {"capacity": 4, "refill": {"per_second": 1}}}}}"#,
    )
    .unwrap();
    handle.apply(&second).unwrap();
    assert_eq!(
        admitted(&layer, &[("a", "x2", ""), ("a", "y2", "pro")]).await,
        vec![4, 3]
    );
    // An empty set: the rules as built.
    handle.apply(&PolicySet::default()).unwrap();
    assert_eq!(
        admitted(&layer, &[("a", "x3", ""), ("a", "y3", "pro")]).await,
        vec![2, 3]
    );
}

/// The guide's TOML and JSON examples are one set, and a valid one.
#[test]
fn the_guides_examples_are_the_same_valid_set() {
    let guide = include_str!("../guide/02-rate-limits.md");
    let section = &guide[guide.find("### Policies as data").unwrap()..];
    let block = |fence: &str| {
        let start = section.find(fence).unwrap() + fence.len();
        let end = start + section[start..].find("```").unwrap();
        section[start..end].to_owned()
    };
    let from_toml: PolicySet = toml::from_str(&block("```toml\n")).unwrap();
    from_toml.validate().unwrap();
    let from_json = PolicySet::from_json(&block("```json\n")).unwrap();
    assert_eq!(from_toml, from_json);
    let export = &from_json.rules["export"];
    assert_eq!(
        (
            export.plans.len(),
            export.tenants.len(),
            export.accounts.len()
        ),
        (1, 1, 1)
    );
}

/// Found in review: a list read as a set (every field in order), a key
/// given twice (the last one winning), and names quoted in one error and
/// not in another.
#[test]
fn lists_and_keys_given_twice_are_refused_and_names_are_quoted_alike() {
    for (json, expected) in [
        ("[]", "a list, where an object or a number goes"),
        (
            r#"{"rules": {"export": {"policy": [3, {"per_second": 1}]}}}"#,
            "rules.export.policy: a list, where an object or a number goes",
        ),
        (
            r#"{"rules": {"export": {"plans": {"x": {"capacity": 0, "refill": {"per_second": 1}}, "x": {"capacity": 5, "refill": {"per_second": 1}}}}}}"#,
            "rules.export.plans: \"x\" is given twice",
        ),
        (
            r#"{"rules": {"export": {"plans": {"a.b": {"capacity": "3"}}}}}"#,
            "rules.export.plans.\"a.b\".capacity: invalid type",
        ),
    ] {
        let err = PolicySet::from_json(json).unwrap_err().to_string();
        assert!(err.starts_with(expected), "{json}: {err}");
    }
}

/// Found in review: TOML (and any format with lists) read a list as a
/// policy's fields in order; a policy, a rule's policies and a default
/// policy are objects in every format.
#[test]
fn a_list_is_no_policy_in_toml_either() {
    for toml in [
        "[rules.export.plans]\npro = [\"token_bucket\", 6, { per_second = 2 }]\n",
        "[rules.export]\npolicy = [\"token_bucket\", 6, { per_second = 2 }]\n",
        "[rules]\nexport = [{ capacity = 6 }]\n",
    ] {
        let read = toml::from_str::<PolicySet>(toml);
        let error = read.expect_err(toml).to_string();
        assert!(error.contains("expected an object"), "{toml}: {error}");
    }
    // The objects themselves still read.
    let set: PolicySet =
        toml::from_str("[rules.export.plans.pro]\ncapacity = 6\nrefill = { per_second = 2 }\n")
            .unwrap();
    assert_eq!(set.rules["export"].plans["pro"].capacity, Some(6));
}
