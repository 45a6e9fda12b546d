//! Decision cost: tollgate's MemoryStore against governor's keyed limiter
//! (DashMap state), in the same run, with real clocks on both sides and with
//! manual/fake clocks on both sides.
//!
//! Run: `cargo bench --bench decision` (see BENCHMARKS.md for the ratios).
//! The tollgate side charges pre-built `Charge`s (key text, policy, cost):
//! the store's decision, not key formatting, is measured — as governor is
//! handed a ready key.
#![allow(missing_docs)] // criterion_group! generates undocumented items.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use governor::clock::FakeRelativeClock;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{Quota, RateLimiter};
use tollgate::{
    MemoryStore, Policy, Rate,
    store::{Charge, Key, ManualClock},
};

const BIG: u32 = 1_000_000_000;

fn open_policy() -> Policy {
    Policy::token_bucket("bench", u64::from(BIG), Rate::per_second(u64::from(BIG))).unwrap()
}

/// Admits everything for the whole run without any key refilling to full:
/// a billion of burst refilled at one per 10 s. Round-robin keys use it, so that no
/// key goes idle (and is swept) between two visits: governor never sweeps.
fn steady_policy() -> Policy {
    Policy::token_bucket(
        "bench",
        u64::from(BIG),
        Rate::new(1, Duration::from_secs(10)),
    )
    .unwrap()
}

fn steady_quota() -> Quota {
    Quota::with_period(Duration::from_secs(10))
        .unwrap()
        .allow_burst(NonZeroU32::new(BIG).unwrap())
}

fn closed_policy() -> Policy {
    Policy::token_bucket("bench", 1, Rate::per_hour(1)).unwrap()
}

fn open_quota() -> Quota {
    Quota::per_second(NonZeroU32::new(BIG).unwrap()).allow_burst(NonZeroU32::new(BIG).unwrap())
}

fn closed_quota() -> Quota {
    Quota::per_hour(NonZeroU32::new(1).unwrap())
}

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

fn charges(n: u32, policy: &Policy) -> Vec<[Charge; 1]> {
    (0..n)
        .map(|i| [Charge::new(Key::client_ip(ip(i), 32), policy.clone(), 1).unwrap()])
        .collect()
}

fn single_thread(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));

    // One hot key, admitted.
    let store = MemoryStore::new();
    let hot = charges(1, &open_policy());
    g.bench_function("tollgate/hot_allow", |b| {
        b.iter(|| black_box(store.charge_now(&hot[0]).unwrap()))
    });
    let gov = RateLimiter::keyed(open_quota());
    g.bench_function("governor_ip/hot_allow", |b| {
        b.iter(|| black_box(gov.check_key(&ip(0)).is_ok()))
    });
    let gov_u64 = RateLimiter::<u64, _, _>::keyed(open_quota());
    g.bench_function("governor_u64/hot_allow", |b| {
        b.iter(|| black_box(gov_u64.check_key(&0).is_ok()))
    });

    // One hot key, denied.
    let store = MemoryStore::new();
    let hot = charges(1, &closed_policy());
    store.charge_now(&hot[0]).unwrap();
    g.bench_function("tollgate/hot_deny", |b| {
        b.iter(|| black_box(store.charge_now(&hot[0]).unwrap()))
    });
    let gov = RateLimiter::keyed(closed_quota());
    let _ = gov.check_key(&ip(0));
    g.bench_function("governor_ip/hot_deny", |b| {
        b.iter(|| black_box(gov.check_key(&ip(0)).is_ok()))
    });
    let gov_u64 = RateLimiter::<u64, _, _>::keyed(closed_quota());
    let _ = gov_u64.check_key(&0);
    g.bench_function("governor_u64/hot_deny", |b| {
        b.iter(|| black_box(gov_u64.check_key(&0).is_ok()))
    });

    // Round robin over many tracked keys.
    for n in [1_000u32, 100_000, 1_000_000] {
        let store = MemoryStore::new();
        let keys = charges(n, &steady_policy());
        for k in &keys {
            store.charge_now(k).unwrap();
        }
        let mut i = 0usize;
        g.bench_with_input(BenchmarkId::new("tollgate/round_robin", n), &n, |b, _| {
            b.iter(|| {
                i = (i + 1) % keys.len();
                black_box(store.charge_now(&keys[i]).unwrap())
            })
        });
        let gov = RateLimiter::keyed(steady_quota());
        for k in 0..n {
            let _ = gov.check_key(&ip(k));
        }
        let mut j = 0u32;
        g.bench_with_input(
            BenchmarkId::new("governor_ip/round_robin", n),
            &n,
            |b, _| {
                b.iter(|| {
                    j = (j + 1) % n;
                    black_box(gov.check_key(&ip(j)).is_ok())
                })
            },
        );
        drop(gov);
        let gov_u64 = RateLimiter::<u64, _, _>::keyed(steady_quota());
        for k in 0..u64::from(n) {
            let _ = gov_u64.check_key(&k);
        }
        let mut j = 0u64;
        g.bench_with_input(
            BenchmarkId::new("governor_u64/round_robin", n),
            &n,
            |b, _| {
                b.iter(|| {
                    j = (j + 1) % u64::from(n);
                    black_box(gov_u64.check_key(&j).is_ok())
                })
            },
        );
    }

    // First touch of new keys (insertion).
    let keys = charges(2_000_000, &open_policy());
    g.bench_function("tollgate/first_touch", |b| {
        b.iter_custom(|iters| {
            let store = MemoryStore::new();
            let start = Instant::now();
            for k in keys.iter().cycle().take(iters as usize) {
                black_box(store.charge_now(k).unwrap());
            }
            start.elapsed()
        })
    });
    g.bench_function("governor_ip/first_touch", |b| {
        b.iter_custom(|iters| {
            let gov = RateLimiter::keyed(open_quota());
            let start = Instant::now();
            for k in 0..iters {
                black_box(gov.check_key(&ip((k % 2_000_000) as u32)).is_ok());
            }
            start.elapsed()
        })
    });

    // Manual / fake clocks on both sides.
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let hot = charges(1, &open_policy());
    g.bench_function("tollgate_manual_clock/hot_allow", |b| {
        b.iter(|| black_box(store.charge_now(&hot[0]).unwrap()))
    });
    let fake = FakeRelativeClock::default();
    let gov: RateLimiter<IpAddr, DashMapStateStore<IpAddr>, FakeRelativeClock, NoOpMiddleware<_>> =
        RateLimiter::new(open_quota(), DashMapStateStore::default(), fake);
    g.bench_function("governor_fake_clock/hot_allow", |b| {
        b.iter(|| black_box(gov.check_key(&ip(0)).is_ok()))
    });
    g.finish();
}

fn two_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("two_threads");
    g.measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    let run = |f: Arc<dyn Fn(usize) + Send + Sync>, iters: u64| {
        let start = Instant::now();
        let handles: Vec<_> = (0..2)
            .map(|t| {
                let f = f.clone();
                std::thread::spawn(move || {
                    for _ in 0..iters {
                        f(t);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        // Wall time per decision per thread.
        start.elapsed()
    };

    let store = Arc::new(MemoryStore::new());
    let keys = Arc::new(charges(2, &open_policy()));
    let (s, k) = (store.clone(), keys.clone());
    let same: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |_| {
        black_box(s.charge_now(&k[0]).unwrap());
    });
    g.bench_function("tollgate/one_key", |b| {
        b.iter_custom(|n| run(same.clone(), n))
    });
    let (s, k) = (store, keys);
    let disjoint: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |t| {
        black_box(s.charge_now(&k[t]).unwrap());
    });
    g.bench_function("tollgate/disjoint_keys", |b| {
        b.iter_custom(|n| run(disjoint.clone(), n))
    });

    let gov = Arc::new(RateLimiter::keyed(open_quota()));
    let g1 = gov.clone();
    let same: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |_| {
        black_box(g1.check_key(&ip(0)).is_ok());
    });
    g.bench_function("governor_ip/one_key", |b| {
        b.iter_custom(|n| run(same.clone(), n))
    });
    let disjoint: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |t| {
        black_box(gov.check_key(&ip(t as u32)).is_ok());
    });
    g.bench_function("governor_ip/disjoint_keys", |b| {
        b.iter_custom(|n| run(disjoint.clone(), n))
    });

    let gov = Arc::new(RateLimiter::<u64, _, _>::keyed(open_quota()));
    let g1 = gov.clone();
    let same: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |_| {
        black_box(g1.check_key(&0).is_ok());
    });
    g.bench_function("governor_u64/one_key", |b| {
        b.iter_custom(|n| run(same.clone(), n))
    });
    let disjoint: Arc<dyn Fn(usize) + Send + Sync> = Arc::new(move |t| {
        black_box(gov.check_key(&(t as u64)).is_ok());
    });
    g.bench_function("governor_u64/disjoint_keys", |b| {
        b.iter_custom(|n| run(disjoint.clone(), n))
    });
    g.finish();
}

criterion_group!(benches, single_thread, two_threads);
criterion_main!(benches);
