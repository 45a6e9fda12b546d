//! A fixed workload for instruction-level profiles of the hot path
//! (BENCHMARKS.md): 200 000 decisions on one key, then 200 000 over 100 000
//! keys, through tollgate's `MemoryStore` or (with the argument `governor`)
//! through governor's keyed limiter, so the two can be profiled alike.
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin profile_hot_key
//! valgrind --tool=callgrind target/release/profile_hot_key [tollgate|governor] [hot|spread]
//! ```

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;

use governor::{Quota, RateLimiter};
use tollgate::{Charge, Key, MemoryStore, Policy, Rate};

const DECISIONS: usize = 200_000;
const KEYS: u32 = 100_000;

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn main() {
    // The second argument picks one part: `hot` (one key) or `spread`
    // (round robin); both by default.
    let part = std::env::args().nth(2).unwrap_or_default();
    let (hot, spread) = (part != "spread", part != "hot");
    if std::env::args().nth(1).as_deref() == Some("governor") {
        governor_run(hot, spread);
    } else {
        tollgate_run(hot, spread);
    }
}

fn tollgate_run(hot: bool, spread: bool) {
    let Ok(policy) = Policy::token_bucket("bench", 1_000_000_000, Rate::per_second(1_000_000_000))
    else {
        return;
    };
    let store = MemoryStore::new();
    let keys: Vec<[Charge; 1]> = (0..KEYS)
        .filter_map(|i| Charge::new(Key::client_ip(ip(i), 32), policy.clone(), 1).ok())
        .map(|c| [c])
        .collect();
    for _ in 0..DECISIONS * usize::from(hot) {
        black_box(store.charge_now(&keys[0]).is_ok());
    }
    for i in 0..DECISIONS * usize::from(spread) {
        black_box(store.charge_now(&keys[i % keys.len()]).is_ok());
    }
}

fn governor_run(hot: bool, spread: bool) {
    let (Some(rate), Some(burst)) = (
        NonZeroU32::new(1_000_000_000),
        NonZeroU32::new(1_000_000_000),
    ) else {
        return;
    };
    let gov = RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst));
    for _ in 0..DECISIONS * usize::from(hot) {
        black_box(gov.check_key(&ip(0)).is_ok());
    }
    for i in 0..DECISIONS * usize::from(spread) {
        black_box(gov.check_key(&ip(i as u32 % KEYS)).is_ok());
    }
}
