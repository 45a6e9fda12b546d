//! The whole rate-limit layer fed arbitrary requests (methods, routes,
//! principals, forwarding headers, content types and lengths): no panic,
//! every answer is one the layer documents, and every request spends one
//! unit from its address or is refused for lack of budget (429, or gRPC
//! status 8) without spending.
#![no_main]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use libfuzzer_sys::fuzz_target;
use tollgate::{
    ClientIpResolver, Cost, MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule,
    identity::{ForwardedHeader, PeerAddr},
    rate_limit::CostError,
    store::{Charge, Key},
};
use tower::{Layer, Service};

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

fn per_ip() -> Policy {
    // Large, on a clock that stands still: a fuzz run never spends it, and
    // nothing refills between the reads before and after a request.
    Policy::token_bucket("ip", 1 << 20, Rate::per_hour(1)).unwrap()
}

fn setup() -> &'static (Arc<MemoryStore>, RateLimitLayer<Arc<MemoryStore>>) {
    static LAYER: OnceLock<(Arc<MemoryStore>, RateLimitLayer<Arc<MemoryStore>>)> = OnceLock::new();
    LAYER.get_or_init(|| {
        let store = Arc::new(
            MemoryStore::builder()
                .clock(tollgate::store::ManualClock::new(0))
                .build(),
        );
        let layer = RateLimitLayer::builder(store.clone())
            .client_ip(
                ClientIpResolver::trusting(
                    ["10.0.0.0/8".parse().unwrap()],
                    ForwardedHeader::Forwarded,
                )
                .unwrap(),
            )
            .rule(Rule::per_client_ip(per_ip()))
            .rule(
                Rule::per_client_ip(
                    Policy::token_bucket("bytes", 4096, Rate::per_second(1024)).unwrap(),
                )
                .on_route("/upload")
                .with_cost(Cost::content_bytes()),
            )
            .rule(
                Rule::per_account(Policy::token_bucket("acct", 3, Rate::per_second(1)).unwrap())
                    .on_route("/export"),
            )
            .rule(
                Rule::per_account_operation(
                    Policy::token_bucket("work", 50, Rate::per_second(1)).unwrap(),
                )
                .on_route("/items/{id}")
                .when_no_principal(tollgate::MissingPrincipal::FallbackToClientIp)
                .with_cost(Cost::computed(
                    tollgate::Unit::Other("work".into()),
                    |parts| {
                        parts
                            .headers
                            .get("x-cost")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.parse().ok())
                            .ok_or_else(|| CostError("x-cost".into()))
                    },
                )),
            )
            .build()
            .unwrap();
        (store, layer)
    })
}

fn remaining(store: &MemoryStore, ip: &str) -> Option<u64> {
    let probe = Charge::new(Key::client_ip(ip.parse().ok()?, 32), per_ip(), 1).ok()?;
    Some(store.describe(&[probe]).limits()[0].remaining())
}

fuzz_target!(|input: (u8, u8, u8, bool, Vec<(Vec<u8>, Vec<u8>)>)| {
    let (method, route, peer, principal, headers) = input;
    let (store, layer) = setup();
    let inner = tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
    });
    let mut svc = layer.layer(inner);
    let method = ["GET", "HEAD", "POST", "PUT"][usize::from(method % 4)];
    let path = ["/", "/upload", "/export", "/items/7", "/items/", "/other"][usize::from(route % 6)];
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .body(())
        .unwrap();
    for (name, value) in headers.iter().take(32) {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            req.headers_mut().append(n, v);
        }
    }
    if principal {
        req.extensions_mut()
            .insert(Principal::new("north", "alice"));
    }
    // An untrusted peer (keyed by itself) or a trusted one (keyed by what
    // its Forwarded header says: only the untrusted peers are checked).
    let peer_ip = if peer % 2 == 0 {
        format!("198.51.100.{peer}")
    } else {
        "10.1.2.3".to_owned()
    };
    req.extensions_mut()
        .insert(PeerAddr(SocketAddr::new(peer_ip.parse().unwrap(), 1)));
    let before = remaining(store, &peer_ip);
    let response = block_on(svc.call(req)).unwrap();
    let status = response.status();
    assert!(
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::LENGTH_REQUIRED,
            StatusCode::BAD_REQUEST,
            StatusCode::UNAUTHORIZED,
            StatusCode::SERVICE_UNAVAILABLE,
        ]
        .contains(&status),
        "unexpected {status}"
    );
    if peer % 2 == 0 {
        let after = remaining(store, &peer_ip);
        let for_budget = match response.headers().get("grpc-status") {
            Some(code) => code == "8",
            None => status == StatusCode::TOO_MANY_REQUESTS,
        };
        if for_budget {
            assert_eq!(after, before, "refused for budget, yet spent");
        } else if status != StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(
                after.map(|a| a + 1),
                before,
                "answered {status} without spending"
            );
        }
    }
});
