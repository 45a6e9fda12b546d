//! The over-limit cache under a flood of distinct exhausted keys: the cost
//! of remembering one more denial when the cache is at its bound, and of
//! looking a key up. The cache is private; this bench compiles its module
//! directly.
#![allow(missing_docs, dead_code, unreachable_pub)]

#[path = "../src/cache.rs"]
mod cache;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate_budget::{Charge, Decision, Key, Policy, Rate};

const BOUND: usize = 100_000;

fn denied() -> Decision {
    Decision::denied(Duration::from_secs(3600), 0, Duration::from_secs(3600))
}

fn flood(c: &mut Criterion) {
    let cache = cache::OverLimitCache::new(BOUND, std::time::Duration::from_millis(200));
    let policy = Policy::token_bucket("per-ip", 5, Rate::per_second(1)).unwrap();
    let charge = [Charge::new(Key::new("per-ip"), policy, 1).unwrap()];
    let now = Instant::now();
    let keys: Vec<String> = (0..4 * BOUND)
        .map(|i| {
            format!(
                "tollgate:{{per-ip:ip=10.{}.{}.{}}}:per-ip/requests",
                i >> 16,
                (i >> 8) & 255,
                i & 255
            )
        })
        .collect();
    for k in &keys[..BOUND] {
        cache.remember(k, &charge[0], now, denied());
    }
    let mut next = BOUND;
    c.bench_function("over_limit_cache/remember_distinct_at_bound", |b| {
        b.iter(|| {
            let k = &keys[next % keys.len()];
            next += 1;
            cache.remember(black_box(k), &charge[0], now, denied());
        })
    });
    let mut i = 0;
    c.bench_function("over_limit_cache/refuse_lookup", |b| {
        b.iter(|| {
            i += 1;
            let k = std::slice::from_ref(&keys[i % keys.len()]);
            black_box(cache.refuse(k, &charge, true))
        })
    });
}

criterion_group!(benches, flood);
criterion_main!(benches);
