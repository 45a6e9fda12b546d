//! Every request counts against its address: for any request, whatever the
//! layer answers, the per-address rule's remaining budget went down by the
//! request's cost, or the answer is 429 and nothing was spent.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use proptest::prelude::*;
use tollgate::{
    Cost, MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule,
    identity::PeerAddr,
    rate_limit::CostError,
    store::{Charge, Key, ManualClock},
};
use tower::{Layer, Service, ServiceExt};

const PEERS: [&str; 2] = ["198.51.100.1", "198.51.100.2"];

fn per_ip() -> Policy {
    Policy::token_bucket("per-ip", 8, Rate::per_hour(1)).unwrap()
}

/// The per-address budget left for `ip`, read without spending.
fn remaining(store: &MemoryStore, ip: &str) -> u64 {
    let probe = Charge::new(Key::client_ip(ip.parse().unwrap(), 32), per_ip(), 1).unwrap();
    store.describe(&[probe]).limits()[0].remaining()
}

#[derive(Debug, Clone)]
struct Req {
    peer: usize,
    method: &'static str,
    path: &'static str,
    principal: Option<&'static str>,
    content_length: Option<&'static str>,
    chunked: bool,
    cost_header: Option<&'static str>,
    grpc: bool,
}

fn request() -> impl Strategy<Value = Req> {
    (
        0..PEERS.len(),
        prop::sample::select(vec!["GET", "POST", "HEAD", "PUT"]),
        prop::sample::select(vec!["/", "/export", "/upload", "/compute", "/x"]),
        prop::option::of(prop::sample::select(vec!["alice", "bob"])),
        prop::option::of(prop::sample::select(vec![
            "0", "1024", "5000", "70000", "abc", "1,1", "-1",
        ])),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec!["1", "0", "abc", "3", "100"])),
        any::<bool>(),
    )
        .prop_map(
            |(peer, method, path, principal, content_length, chunked, cost_header, grpc)| Req {
                peer,
                method,
                path,
                principal,
                content_length,
                chunked,
                cost_header,
                grpc,
            },
        )
}

fn header_cost(parts: &http::request::Parts) -> Result<u64, CostError> {
    let value = parts
        .headers
        .get("x-cost")
        .ok_or_else(|| CostError("send x-cost".into()))?;
    value
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| CostError("x-cost is not a number".into()))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn every_request_spends_from_its_address_or_is_429(trace in prop::collection::vec(request(), 1..40)) {
        let store = Arc::new(MemoryStore::builder().clock(ManualClock::new(0)).build());
        let layer = RateLimitLayer::builder(store.clone())
            .rule(Rule::per_client_ip(per_ip()))
            .rule(
                Rule::per_account_operation(
                    Policy::token_bucket("export", 3, Rate::per_hour(1)).unwrap(),
                )
                .on_route("/export"),
            )
            .rule(
                Rule::per_account(Policy::token_bucket("upload", 64, Rate::per_hour(1)).unwrap())
                    .on_route("/upload")
                    .with_cost(Cost::content_kib()),
            )
            .rule(
                Rule::per_account(Policy::token_bucket("work", 10, Rate::per_hour(1)).unwrap())
                    .on_route("/compute")
                    .when_no_principal(tollgate::MissingPrincipal::FallbackToClientIp)
                    .with_cost(Cost::computed(tollgate::Unit::Other("work".into()), header_cost)),
            ).build().unwrap();
        let inner = tower::service_fn(|_req: Request<()>| async {
            Ok::<_, Infallible>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
        });
        let mut svc = layer.layer(inner);
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        for (i, r) in trace.iter().enumerate() {
            let ip = PEERS[r.peer];
            let mut req = Request::builder().method(r.method).uri(r.path);
            if let Some(len) = r.content_length {
                req = req.header("content-length", len);
            }
            if r.chunked {
                req = req.header("transfer-encoding", "chunked");
            }
            if let Some(cost) = r.cost_header {
                req = req.header("x-cost", cost);
            }
            if r.grpc {
                req = req.header("content-type", "application/grpc");
            }
            let mut req = req.body(()).unwrap();
            req.extensions_mut().insert(PeerAddr(SocketAddr::new(ip.parse().unwrap(), 1)));
            if let Some(account) = r.principal {
                req.extensions_mut().insert(Principal::new("north", account));
            }
            let before = remaining(&store, ip);
            let response = rt
                .block_on(async {
                    tokio::time::timeout(Duration::from_secs(5), svc.ready().await.unwrap().call(req))
                        .await
                })
                .expect("in-process store answers at once")
                .unwrap();
            let after = remaining(&store, ip);
            // gRPC refusals are HTTP 200 with a grpc-status; 8 is the 429.
            let refused_for_budget = match response.headers().get("grpc-status") {
                Some(code) => code == "8" && r.grpc,
                None => response.status() == StatusCode::TOO_MANY_REQUESTS,
            };
            if refused_for_budget {
                prop_assert_eq!(after, before, "step {}: {:?} refused for budget yet spent", i, r);
            } else {
                prop_assert!(before > 0, "step {}: {:?} answered {} with the address budget spent", i, r, response.status());
                prop_assert_eq!(after, before - 1, "step {}: {:?} answered {} without spending", i, r, response.status());
            }
        }
    }
}
