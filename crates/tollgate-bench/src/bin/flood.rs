//! Cardinality flood for HARDENING.md: N distinct client addresses (from this
//! harness, not the network) against a MemoryStore with a key cap.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin flood -- 10000000 1000000 refuse
//! cargo run --release -p tollgate-bench --bin flood -- 10000000 1000000 evict
//! cargo run --release -p tollgate-bench --bin flood -- 10000000 redis://127.0.0.1:6379
//! ```
//!
//! With a Redis URL instead of a cap, the flood goes through a RedisStore
//! (128 concurrent tasks) and every key is then checked for a TTL.
//!
//! Prints RSS, tracked keys, what the cap policy did, and, for eviction,
//! the extra allowance it created (admissions of keys seen before, whose
//! state had been evicted, beyond what their budget allowed).

use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;

use tollgate::{
    MemoryStore, Policy, Rate,
    store::{Charge, Key, ManualClock, OnKeyCap},
};

fn rss_mb() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse::<u64>().ok())
        .unwrap_or(0)
        * 4096
        / 1_000_000
}

/// Floods a RedisStore and counts keys without a TTL afterwards.
fn redis_flood(n: u32, url: &str) -> ExitCode {
    use tollgate::{RedisStore, Store};
    let Ok(rt) = tokio::runtime::Runtime::new() else {
        return ExitCode::FAILURE;
    };
    rt.block_on(async {
        let store = match RedisStore::builder(url).and_then(|b| b.timeout(std::time::Duration::from_secs(5)).build()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
        let Ok(per_ip) = Policy::token_bucket("per-ip", 1, Rate::per_hour(1)) else { return ExitCode::FAILURE };
        let started = std::time::Instant::now();
        let tasks: Vec<_> = (0..128u32)
            .map(|t| {
                let (store, per_ip) = (store.clone(), per_ip.clone());
                tokio::spawn(async move {
                    let (mut ok, mut err) = (0u64, 0u64);
                    for i in (t..n).step_by(128) {
                        let ip = IpAddr::V4(Ipv4Addr::from(0x0100_0000u32.wrapping_add(i)));
                        let Ok(c) = Charge::new(Key::client_ip(ip, 32), per_ip.clone(), 1) else { continue };
                        match store.charge(&[c]).await {
                            Ok(o) if o.is_admitted() => ok += 1,
                            Ok(_) => {}
                            Err(_) => err += 1,
                        }
                    }
                    (ok, err)
                })
            })
            .collect();
        let (mut admitted, mut errors) = (0, 0);
        for t in tasks {
            if let Ok((a, e)) = t.await {
                admitted += a;
                errors += e;
            }
        }
        let flood_secs = started.elapsed().as_secs();
        let Ok(client) = redis::Client::open(url) else { return ExitCode::FAILURE };
        let Ok(mut conn) = client.get_connection() else { return ExitCode::FAILURE };
        let (mut cursor, mut keys, mut without_ttl) = (0u64, 0u64, 0u64);
        loop {
            let Ok((next, batch)): Result<(u64, Vec<String>), _> =
                redis::cmd("SCAN").arg(cursor).arg("MATCH").arg("tollgate:*").arg("COUNT").arg(5000).query(&mut conn)
            else {
                return ExitCode::FAILURE;
            };
            let mut pipe = redis::pipe();
            for k in &batch {
                pipe.cmd("PTTL").arg(k);
            }
            let ttls: Vec<i64> = pipe.query(&mut conn).unwrap_or_default();
            keys += batch.len() as u64;
            without_ttl += ttls.iter().filter(|t| **t < 0).count() as u64;
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
        let memory: String = redis::cmd("INFO").arg("memory").query(&mut conn).unwrap_or_default();
        let used = memory.lines().find_map(|l| l.strip_prefix("used_memory_human:")).unwrap_or("?").trim().to_owned();
        println!(
            "redis flood: addresses={n} in {flood_secs}s admitted={admitted} store_errors={errors} keys={keys} keys_without_ttl={without_ttl} redis_used_memory={used}"
        );
        if without_ttl == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [n, url] = args.as_slice()
        && url.starts_with("redis://")
    {
        return match n.parse() {
            Ok(n) => redis_flood(n, url),
            Err(e) => {
                eprintln!("bad address count {n:?}: {e}");
                ExitCode::from(2)
            }
        };
    }
    let (n, cap, policy) = match args.as_slice() {
        [n, cap, p] => match (n.parse::<u32>(), cap.parse::<usize>(), p.as_str()) {
            (Ok(n), Ok(cap), "refuse") => (n, cap, OnKeyCap::RefuseNewKeys),
            (Ok(n), Ok(cap), "evict") => (n, cap, OnKeyCap::EvictNearestIdle),
            _ => {
                eprintln!("usage: flood <addresses> <key cap> <refuse|evict>");
                return ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: flood <addresses> <key cap> <refuse|evict>");
            return ExitCode::from(2);
        }
    };
    // Each address may send 1 request per hour: any second admission of the
    // same address within the flood is allowance that only eviction creates.
    let Ok(per_ip) = Policy::token_bucket("per-ip", 1, Rate::per_hour(1)) else {
        return ExitCode::FAILURE;
    };
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .max_keys(cap, policy)
        .build();
    let before = rss_mb();
    let (mut admitted, mut refused_by_cap) = (0u64, 0u64);
    let charge = |i: u32| {
        let ip = IpAddr::V4(Ipv4Addr::from(0x0100_0000u32.wrapping_add(i)));
        Charge::new(Key::client_ip(ip, 32), per_ip.clone(), 1)
    };
    for i in 0..n {
        let Ok(c) = charge(i) else {
            return ExitCode::FAILURE;
        };
        match store.charge_now(&[c]) {
            Ok(o) if o.is_admitted() => admitted += 1,
            Ok(_) => {}
            Err(_) => refused_by_cap += 1,
        }
    }
    // The first million addresses come back once: with their state kept they
    // are refused; an evicted one is admitted again (extra allowance).
    let replay = n.min(1_000_000);
    let mut extra = 0u64;
    for i in 0..replay {
        let Ok(c) = charge(i) else {
            return ExitCode::FAILURE;
        };
        if store.charge_now(&[c]).is_ok_and(|o| o.is_admitted()) {
            extra += 1;
        }
    }
    let stats = store.stats();
    println!(
        "addresses={n} cap={cap} policy={policy:?} rss_before_mb={before} rss_after_mb={} tracked={} admitted={admitted} refused_by_cap={refused_by_cap} (counted {}) evicted={} replayed={replay} extra_allowance={extra}",
        rss_mb(),
        stats.keys,
        stats.refused_new_keys,
        stats.evicted
    );
    ExitCode::SUCCESS
}
