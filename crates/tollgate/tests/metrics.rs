//! Metrics are emitted per policy name (never per raw key) for admitted and
//! denied cost, never-fits and store errors.
#![cfg(feature = "metrics")]

use std::convert::Infallible;
use std::net::SocketAddr;

use http::{Request, Response, StatusCode};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tollgate::{
    Cost, KeyPart, MemoryStore, Policy, Rate, RateLimitLayer, Rule, identity::PeerAddr,
    store::OnKeyCap,
};
use tower::{Layer, Service, ServiceExt};

/// Every counter, as `name{label=value,...}` (labels sorted) -> value.
fn counters(
    snapshotter: &metrics_util::debugging::Snapshotter,
) -> std::collections::HashMap<String, u64> {
    let mut seen = std::collections::HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let mut labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        if let DebugValue::Counter(n) = value {
            seen.insert(format!("{}{{{}}}", key.key().name(), labels.join(",")), n);
        }
    }
    seen
}

#[test]
fn counters_are_labelled_by_policy_name_only() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        let inner = tower::service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                bytes::Bytes::from("ok"),
            )))
        });
        let per_ip = Policy::token_bucket("m-ip", 2, Rate::per_hour(1)).unwrap();
        let bytes = Policy::token_bucket("m-bytes", 10, Rate::per_hour(1)).unwrap();
        let store = MemoryStore::builder()
            .max_keys(2, OnKeyCap::RefuseNewKeys)
            .shards(1)
            .build();
        let layer = RateLimitLayer::builder(store)
            .rule(Rule::per_client_ip(per_ip))
            .rule(
                Rule::new(bytes)
                    .on_route("/upload")
                    .keyed_by([KeyPart::ClientIp])
                    .with_cost(Cost::content_bytes()),
            )
            .build()
            .unwrap();
        let mut svc = layer.layer(inner);
        let call = |svc: &mut _, path: &str, peer: &str, len: Option<usize>| {
            let mut req = Request::builder().uri(path);
            if let Some(len) = len {
                req = req.header("content-length", len);
            }
            let mut req = req.body(String::new()).unwrap();
            req.extensions_mut()
                .insert(PeerAddr(peer.parse::<SocketAddr>().unwrap()));
            let svc: &mut tollgate::rate_limit::RateLimit<_, MemoryStore> = svc;
            rt.block_on(async { svc.ready().await.unwrap().call(req).await.unwrap().status() })
        };
        assert_eq!(call(&mut svc, "/", "198.51.100.1:1", None), StatusCode::OK);
        assert_eq!(call(&mut svc, "/", "198.51.100.1:1", None), StatusCode::OK);
        assert_eq!(
            call(&mut svc, "/", "198.51.100.1:1", None),
            StatusCode::TOO_MANY_REQUESTS
        );
        // A cost that can never fit is refused by the layer, after charging
        // the address rule (a second key).
        assert_eq!(
            call(&mut svc, "/upload", "198.51.100.2:1", Some(11)),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        // The key cap (2, both used) refuses the third new key: a store error.
        assert_eq!(call(&mut svc, "/", "198.51.100.2:1", None), StatusCode::OK);
        assert_eq!(
            call(&mut svc, "/", "198.51.100.3:1", None),
            StatusCode::SERVICE_UNAVAILABLE
        );
    });
    let seen = counters(&snapshotter);
    for name in seen.keys() {
        assert!(
            !name.contains("198.51.100"),
            "raw key material in a label: {name}"
        );
    }
    assert_eq!(
        seen.get("tollgate_admitted_cost_total{policy=m-ip}"),
        Some(&4),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("tollgate_denied_cost_total{policy=m-ip}"),
        Some(&1),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("tollgate_never_fits_total{policy=m-bytes}"),
        Some(&1),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("tollgate_store_errors_total{kind=CapacityExhausted,outcome=fail_closed}"),
        Some(&1),
        "{seen:?}"
    );
}

/// Exempt requests are counted with `outcome="exempt"`, dry-run would-be
/// refusals in `tollgate_dry_run_denied_cost_total`, and neither as denied.
#[test]
fn exemptions_and_dry_run_refusals_are_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        let inner = tower::service_fn(|_req: Request<String>| async {
            Ok::<_, Infallible>(Response::new(http_body_util::Full::new(
                bytes::Bytes::from("ok"),
            )))
        });
        let trial = Policy::token_bucket("d-trial", 1, Rate::per_hour(1)).unwrap();
        let layer = RateLimitLayer::builder(MemoryStore::new())
            .rule(
                Rule::per_client_ip(trial)
                    .dry_run(true)
                    .exempt(tollgate::Exemption::when(|req| req.uri.path() == "/free")),
            )
            .build()
            .unwrap();
        let mut svc = layer.layer(inner);
        for path in ["/", "/", "/", "/free"] {
            let mut req = Request::builder().uri(path).body(String::new()).unwrap();
            req.extensions_mut()
                .insert(PeerAddr("198.51.100.9:1".parse::<SocketAddr>().unwrap()));
            let status =
                rt.block_on(async { svc.ready().await.unwrap().call(req).await.unwrap().status() });
            assert_eq!(status, StatusCode::OK);
        }
    });
    let seen = counters(&snapshotter);
    assert_eq!(
        seen.get("tollgate_admitted_cost_total{policy=d-trial}"),
        Some(&1),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("tollgate_dry_run_denied_cost_total{policy=d-trial}"),
        Some(&2),
        "{seen:?}"
    );
    assert_eq!(
        seen.get("tollgate_requests_total{outcome=exempt,policy=d-trial}"),
        Some(&1),
        "{seen:?}"
    );
    assert_eq!(seen.get("tollgate_denied_cost_total{policy=d-trial}"), None);
}

/// A request a shaping rule holds is counted in `tollgate_shaped_total`
/// (and its wait recorded), by policy name.
#[test]
fn shaped_requests_are_counted() {
    use std::num::NonZeroUsize;
    use std::time::Duration;
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        let _guard = rt.enter();
        let layer = RateLimitLayer::builder(MemoryStore::new())
            .rule(
                Rule::per_client_ip(
                    Policy::token_bucket("m-shaped", 1, Rate::per_second(1)).unwrap(),
                )
                .shape(Duration::from_secs(5), NonZeroUsize::new(3).unwrap()),
            )
            .build()
            .unwrap();
        let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(()))
        }));
        let mut held = Vec::new();
        for _ in 0..3 {
            let mut req = Request::new(());
            req.extensions_mut()
                .insert(PeerAddr("203.0.113.9:1".parse::<SocketAddr>().unwrap()));
            held.push(svc.call(req));
        }
        let seen = counters(&snapshotter);
        assert_eq!(
            seen.get("tollgate_shaped_total{policy=m-shaped}"),
            Some(&2),
            "{seen:?}"
        );
        drop(held);
    });
}
