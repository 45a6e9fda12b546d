//! Memory per tracked key, for BENCHMARKS.md: RSS before and after tracking
//! N client addresses, in this fresh process.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin mem_probe -- tollgate 1000000
//! cargo run --release -p tollgate-bench --bin mem_probe -- governor 1000000
//! ```
//!
//! Prints `impl keys bytes_per_key rss_idle_delta_bytes`. For tollgate the
//! idle figure is measured after the keys have refilled and the store was
//! merely used again (no user task); for governor after the same time with
//! no user task (governor needs `retain_recent` + `shrink_to_fit` to give
//! memory back).
#![allow(clippy::float_arithmetic)] // Reports measurements; decides nothing.

use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::process::ExitCode;
use std::time::Duration;

use tollgate::{
    MemoryStore, Policy, Rate,
    store::{Charge, Key, ManualClock},
};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (which, n) = match args.as_slice() {
        [w, n] => match n.parse::<u32>() {
            Ok(n) => (w.as_str(), n),
            Err(e) => {
                eprintln!("bad key count {n:?}: {e}");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: mem_probe <tollgate|governor> <keys>");
            return ExitCode::from(2);
        }
    };
    // A policy that refills 5 per second: full again 1 s after one charge.
    let policy = match Policy::token_bucket("per-ip", 5, Rate::per_second(5)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let before = rss_bytes();
    let idle_delta;
    match which {
        "tollgate" => {
            let clock = ManualClock::new(0);
            let store = MemoryStore::builder().clock(clock.clone()).build();
            for i in 0..n {
                let c = Charge::new(Key::client_ip(ip(i), 32), policy.clone(), 1);
                if let Ok(c) = c {
                    let _ = store.charge_now(&[c]);
                }
            }
            let tracked = rss_bytes();
            println!(
                "tollgate {n} {:.1} keys_tracked={}",
                (tracked - before) as f64 / f64::from(n),
                store.stats().keys
            );
            // Past the refill horizon, ordinary traffic sweeps idle entries.
            clock.advance(Duration::from_secs(5));
            for i in 0..10_000u32 {
                if let Ok(c) = Charge::new(Key::client_ip(ip(n + i), 32), policy.clone(), 1) {
                    let _ = store.charge_now(&[c]);
                }
            }
            idle_delta = rss_bytes().saturating_sub(before);
            println!(
                "tollgate idle_rss_delta_bytes={idle_delta} keys_tracked={}",
                store.stats().keys
            );
        }
        "governor" => {
            let quota = governor::Quota::per_second(NonZeroU32::new(5).unwrap_or(NonZeroU32::MIN));
            let gov = governor::RateLimiter::<IpAddr, _, _>::keyed(quota);
            for i in 0..n {
                let _ = gov.check_key(&ip(i));
            }
            let tracked = rss_bytes();
            println!(
                "governor {n} {:.1} keys_tracked={}",
                (tracked - before) as f64 / f64::from(n),
                gov.len()
            );
            std::thread::sleep(Duration::from_millis(1100));
            for i in 0..10_000u32 {
                let _ = gov.check_key(&ip(n + i));
            }
            idle_delta = rss_bytes().saturating_sub(before);
            println!(
                "governor idle_rss_delta_bytes={idle_delta} keys_tracked={} (no user task)",
                gov.len()
            );
            gov.retain_recent();
            gov.shrink_to_fit();
            println!(
                "governor after_retain_recent_and_shrink_rss_delta_bytes={} keys_tracked={}",
                rss_bytes().saturating_sub(before),
                gov.len()
            );
        }
        other => {
            eprintln!("unknown implementation {other:?}");
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}
