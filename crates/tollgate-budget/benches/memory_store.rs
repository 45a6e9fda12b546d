//! Decision cost of `MemoryStore`: one hot key, 100k keys round-robin, and two
//! threads on one key. Run: `cargo bench -p tollgate-budget --bench memory_store`.

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate_budget::{Charge, Key, MemoryStore, Policy, Rate};

fn charges(n: usize, policy: &Policy) -> Vec<[Charge; 1]> {
    (0..n)
        .map(|i| [Charge::new(Key::new("ip").with(i.to_string()), policy.clone(), 1).unwrap()])
        .collect()
}

fn decisions(c: &mut Criterion) {
    // Generous enough that every decision is an admission.
    let policy =
        Policy::token_bucket("bench", 1_000_000_000, Rate::per_second(1_000_000_000)).unwrap();
    let mut group = c.benchmark_group("memory_store");

    let store = MemoryStore::new();
    let hot = charges(1, &policy);
    group.bench_function("hot_key", |b| {
        b.iter(|| black_box(store.charge_now(&hot[0]).unwrap()))
    });

    let store = MemoryStore::new();
    let keys = charges(100_000, &policy);
    for k in &keys {
        store.charge_now(k).unwrap();
    }
    let mut i = 0;
    group.bench_function("100k_keys_round_robin", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(store.charge_now(&keys[i]).unwrap())
        })
    });

    let store = Arc::new(MemoryStore::new());
    let hot = Arc::new(charges(1, &policy));
    group.bench_function("two_threads_one_key", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let (store, hot) = (store.clone(), hot.clone());
                    std::thread::spawn(move || {
                        for _ in 0..iters {
                            black_box(store.charge_now(&hot[0]).unwrap());
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
            // Time per decision: two threads did `iters` each.
            start.elapsed() / 2
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = decisions
}
criterion_main!(benches);
