//! A fixed workload for instruction-level profiles of the hot path
//! (BENCHMARKS.md, `benches/instructions.sh`): DECISIONS decisions (200 000
//! by default) on one key, then as many over 100 000 keys, through
//! tollgate's `MemoryStore` or (with the argument `governor`) through
//! governor's keyed limiter, so the two can be profiled alike. Every
//! decision must admit (the quota is a billion of burst); the exit status
//! is non-zero otherwise.
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin profile_hot_key
//! valgrind --tool=callgrind target/release/profile_hot_key [tollgate|governor] [hot|spread] [DECISIONS]
//! ```

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::ExitCode;

use governor::{Quota, RateLimiter};
use tollgate::{
    MemoryStore, Policy, Rate,
    store::{Charge, Key},
};

const DEFAULT_DECISIONS: usize = 200_000;
const KEYS: u32 = 100_000;

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// How many decisions of each part to run, and which parts.
struct Run {
    decisions: usize,
    hot: bool,
    spread: bool,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let governor = args.first().map(String::as_str) == Some("governor");
    // The second argument picks one part: `hot` (one key) or `spread`
    // (round robin); both by default (or with `both`).
    let part = args.get(1).map(String::as_str).unwrap_or("both");
    let decisions = match args.get(2).map(|n| n.parse::<usize>()) {
        None => DEFAULT_DECISIONS,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            eprintln!("usage: profile_hot_key [tollgate|governor] [hot|spread|both] [DECISIONS]");
            return ExitCode::from(2);
        }
    };
    let run = Run {
        decisions,
        hot: part != "spread",
        spread: part != "hot",
    };
    let expected = decisions * (usize::from(run.hot) + usize::from(run.spread));
    let admitted = if governor {
        governor_run(&run)
    } else {
        tollgate_run(&run)
    };
    println!("{admitted} of {expected} decisions admitted");
    if admitted == expected {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The decisions through tollgate's `MemoryStore`; how many admitted.
fn tollgate_run(run: &Run) -> usize {
    let Ok(policy) = Policy::token_bucket("bench", 1_000_000_000, Rate::per_second(1_000_000_000))
    else {
        return 0;
    };
    let store = MemoryStore::new();
    let keys: Vec<[Charge; 1]> = (0..KEYS)
        .filter_map(|i| Charge::new(Key::client_ip(ip(i), 32), policy.clone(), 1).ok())
        .map(|c| [c])
        .collect();
    let mut admitted = 0;
    for _ in 0..run.decisions * usize::from(run.hot) {
        admitted += usize::from(black_box(store.charge_now(&keys[0]).is_ok()));
    }
    for i in 0..run.decisions * usize::from(run.spread) {
        admitted += usize::from(black_box(store.charge_now(&keys[i % keys.len()]).is_ok()));
    }
    admitted
}

/// The decisions through governor's keyed limiter; how many admitted.
fn governor_run(run: &Run) -> usize {
    let (Some(rate), Some(burst)) = (
        NonZeroU32::new(1_000_000_000),
        NonZeroU32::new(1_000_000_000),
    ) else {
        return 0;
    };
    let gov = RateLimiter::keyed(Quota::per_second(rate).allow_burst(burst));
    let mut admitted = 0;
    for _ in 0..run.decisions * usize::from(run.hot) {
        admitted += usize::from(black_box(gov.check_key(&ip(0)).is_ok()));
    }
    for i in 0..run.decisions * usize::from(run.spread) {
        admitted += usize::from(black_box(gov.check_key(&ip(i as u32 % KEYS)).is_ok()));
    }
    admitted
}
