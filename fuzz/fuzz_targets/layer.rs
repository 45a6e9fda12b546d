//! The whole rate-limit layer fed arbitrary header sets (forwarding headers,
//! content types, lengths): no panic, and every answer is one of the
//! statuses the layer documents.
#![no_main]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::OnceLock;

use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use libfuzzer_sys::fuzz_target;
use tollgate::{ClientIpResolver, Cost, ForwardedHeader, MemoryStore, PeerAddr, Policy, Rate, RateLimitLayer, Rule};
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

fn layer() -> &'static RateLimitLayer<MemoryStore> {
    static LAYER: OnceLock<RateLimitLayer<MemoryStore>> = OnceLock::new();
    LAYER.get_or_init(|| {
        RateLimitLayer::new(MemoryStore::builder().max_keys(10_000, tollgate::CapPolicy::EvictNearestIdle).build())
            .client_ip(ClientIpResolver::trusting(["10.0.0.0/8".parse().unwrap()], ForwardedHeader::Forwarded))
            .rule(Rule::per_client_ip(Policy::token_bucket("ip", 5, Rate::per_second(1)).unwrap()))
            .rule(
                Rule::per_client_ip(Policy::token_bucket("bytes", 4096, Rate::per_second(1024)).unwrap())
                    .on_route("/upload")
                    .with_cost(Cost::content_bytes()),
            )
    })
}

fuzz_target!(|input: (bool, bool, Vec<(Vec<u8>, Vec<u8>)>)| {
    let (trusted_peer, upload, headers) = input;
    let inner = tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
    });
    let mut svc = layer().layer(inner);
    let mut req = Request::builder().uri(if upload { "/upload" } else { "/" }).body(()).unwrap();
    for (name, value) in headers.iter().take(32) {
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name), HeaderValue::from_bytes(value)) {
            req.headers_mut().append(n, v);
        }
    }
    let peer: SocketAddr = if trusted_peer { "10.1.2.3:1" } else { "198.51.100.9:1" }.parse().unwrap();
    req.extensions_mut().insert(PeerAddr(peer));
    let status = block_on(svc.call(req)).unwrap().status();
    assert!(
        [
            StatusCode::OK,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::LENGTH_REQUIRED,
            StatusCode::BAD_REQUEST,
            StatusCode::SERVICE_UNAVAILABLE,
        ]
        .contains(&status),
        "unexpected {status}"
    );
});
