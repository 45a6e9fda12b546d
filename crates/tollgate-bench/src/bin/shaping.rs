//! Shaping costs, for BENCHMARKS.md: CPU per held request and memory per
//! waiter, through the whole `RateLimitLayer` (in-memory store), in this
//! fresh process.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin shaping -- 200000
//! ```
//!
//! For N client addresses (one shaped rule per address: a bucket of 1,
//! held up to an hour), it first sends each address one request (admitted
//! at once), then a second (held): it prints the median nanoseconds per
//! request of each kind over five rounds (a held request's cost includes
//! making and dropping its future, which gives its reservation back), and
//! the resident memory of N held requests per request.
#![allow(clippy::float_arithmetic)] // Reports measurements; decides nothing.

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use http::{Request, Response};
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule, identity::PeerAddr};
use tower::{Layer, Service};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn request(i: u32) -> Request<()> {
    let mut req = Request::new(());
    let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
    req.extensions_mut()
        .insert(PeerAddr(SocketAddr::new(ip, 40_000)));
    req
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> ExitCode {
    let n: u32 = match std::env::args().nth(1).map(|a| a.parse()) {
        Some(Ok(n)) if n > 0 => n,
        None => 200_000,
        _ => {
            eprintln!("usage: shaping [addresses]");
            return ExitCode::from(2);
        }
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
    else {
        eprintln!("no tokio runtime");
        return ExitCode::FAILURE;
    };
    let _guard = rt.enter();
    let policy = match Policy::token_bucket("shaped", 1, Rate::per_hour(1)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let one = NonZeroUsize::MIN;
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .max_waiting(usize::MAX)
        .headers_on_admitted(false)
        .rule(Rule::per_client_ip(policy).shape(Duration::from_secs(3600), one))
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let (mut immediate, mut held) = (Vec::new(), Vec::new());
    let mut per_waiter = 0.0;
    for round in 0..5u32 {
        // Fresh addresses each round: the first request of each is at once.
        let base = round * n;
        let started = Instant::now();
        for i in 0..n {
            drop(svc.call(request(base + i)));
        }
        immediate.push(started.elapsed().as_nanos() as f64 / f64::from(n));
        let before = rss_bytes();
        let started = Instant::now();
        let waiting: Vec<_> = (0..n).map(|i| svc.call(request(base + i))).collect();
        let made = started.elapsed();
        let rss = rss_bytes().saturating_sub(before);
        let started = Instant::now();
        drop(waiting);
        held.push((made + started.elapsed()).as_nanos() as f64 / f64::from(n));
        if round == 0 {
            per_waiter = rss as f64 / f64::from(n);
        }
    }
    println!(
        "addresses {n}: immediate {:.0} ns/request, held (made and dropped) {:.0} ns/request, {:.0} bytes per waiter",
        median(immediate),
        median(held),
        per_waiter
    );
    ExitCode::SUCCESS
}
