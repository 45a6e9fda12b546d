//! Scaling with tracked keys (BENCHMARKS.md, table 2): nanoseconds per
//! decision, round robin over N tracked keys, tollgate's `MemoryStore`
//! against governor's keyed limiter (DashMap state, IpAddr keys) in the same
//! process, alternating passes, medians. Outside criterion because ten
//! million prepared keys do not fit criterion's sampling in one run.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin scaling -- [--keys 1000,100000,1000000,10000000] [--passes 5]
//! ```
//!
//! Two tollgate columns. "prepared": as in `benches/decision.rs`, tollgate
//! is handed ready `Charge`s, streamed from a vector (136 bytes each plus
//! the key text) that competes with the store's table for the caches.
//! "built": each decision builds its `Charge` (key text allocation
//! included), as the HTTP layer does per request, touching no prepared
//! memory. Governor gets its `IpAddr` keys computed from the index, which
//! costs it nothing in either case.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use governor::{Quota, RateLimiter};
use tollgate::{
    MemoryStore, Policy, Rate,
    store::{Charge, Key},
};

const BIG: u32 = 1_000_000_000;
/// Decisions per pass: at least this many, and at least one per key.
const MIN_DECISIONS: usize = 2_000_000;

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn median(mut v: Vec<u128>) -> u128 {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() -> ExitCode {
    let mut sizes = vec![1_000u32, 100_000, 1_000_000, 10_000_000];
    let mut passes = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next().unwrap_or_default();
        match a.as_str() {
            "--keys" => match value.split(',').map(str::parse).collect() {
                Ok(v) => sizes = v,
                Err(e) => {
                    eprintln!("--keys takes a comma-separated list of counts: {e}");
                    return ExitCode::from(2);
                }
            },
            "--passes" => match value.parse() {
                Ok(p) if p > 0 => passes = p,
                _ => {
                    eprintln!("--passes takes a positive count");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("usage: scaling [--keys N,N,...] [--passes P]");
                return ExitCode::from(2);
            }
        }
    }
    // A billion of burst refilled at one per 10 s: admits everything for
    // the whole run, and no key refills to full, so none goes idle and is
    // swept between its visits (governor never sweeps).
    let (Ok(policy), Some(quota)) = (
        Policy::token_bucket(
            "bench",
            u64::from(BIG),
            Rate::new(1, Duration::from_secs(10)),
        ),
        NonZeroU32::new(BIG).and_then(|big| {
            Quota::with_period(Duration::from_secs(10)).map(|q| q.allow_burst(big))
        }),
    ) else {
        return ExitCode::FAILURE;
    };
    println!(
        "| tracked keys | tollgate, prepared | tollgate, built | governor | ratio prepared | ratio built |"
    );
    println!("|---|---|---|---|---|---|");
    let build = |i: u32| -> Option<[Charge; 1]> {
        Charge::new(Key::client_ip(ip(i), 32), policy.clone(), 1)
            .ok()
            .map(|c| [c])
    };
    for n in sizes {
        let charges: Vec<[Charge; 1]> = (0..n).filter_map(build).collect();
        let store = MemoryStore::new();
        for c in &charges {
            black_box(store.charge_now(c).is_ok());
        }
        let gov = RateLimiter::keyed(quota);
        for i in 0..n {
            black_box(gov.check_key(&ip(i)).is_ok());
        }
        let decisions = MIN_DECISIONS.max(charges.len());
        let (mut ours, mut built, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..passes {
            let start = Instant::now();
            for c in charges.iter().cycle().take(decisions) {
                black_box(store.charge_now(c).is_ok());
            }
            ours.push(start.elapsed().as_nanos() * 100 / decisions as u128);
            let start = Instant::now();
            for i in (0..n).cycle().take(decisions) {
                if let Some(c) = build(i) {
                    black_box(store.charge_now(&c).is_ok());
                }
            }
            built.push(start.elapsed().as_nanos() * 100 / decisions as u128);
            let start = Instant::now();
            for i in (0..n).cycle().take(decisions) {
                black_box(gov.check_key(&ip(i)).is_ok());
            }
            theirs.push(start.elapsed().as_nanos() * 100 / decisions as u128);
        }
        let (t, b, g) = (median(ours), median(built), median(theirs));
        // Hundredths, printed with two decimals.
        let fixed = |v: u128| format!("{}.{:02}", v / 100, v % 100);
        println!(
            "| {n} | {} | {} | {} | {} | {} |",
            fixed(t),
            fixed(b),
            fixed(g),
            fixed(t * 100 / g.max(1)),
            fixed(b * 100 / g.max(1))
        );
        if store.stats().keys != u64::from(n) {
            eprintln!("expected {n} tracked keys, found {}", store.stats().keys);
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
