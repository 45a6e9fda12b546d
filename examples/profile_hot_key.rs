//! A fixed workload for instruction-level profiles of the hot path
//! (BENCHMARKS.md): 200 000 decisions on one key, then 200 000 over 100 000
//! keys.
//!
//! ```text
//! cargo build --release --example profile_hot_key
//! valgrind --tool=callgrind target/release/examples/profile_hot_key
//! ```

use std::hint::black_box;

use tollgate::{Charge, Key, MemoryStore, Policy, Rate};

fn main() {
    let Ok(policy) = Policy::token_bucket("bench", 1_000_000_000, Rate::per_second(1_000_000_000))
    else {
        return;
    };
    let store = MemoryStore::new();
    let keys: Vec<[Charge; 1]> = (0..100_000u32)
        .filter_map(|i| Charge::new(Key::new("bench").with(i.to_string()), policy.clone(), 1).ok())
        .map(|c| [c])
        .collect();
    for _ in 0..200_000 {
        black_box(store.charge_now(&keys[0]).is_ok());
    }
    for i in 0..200_000 {
        black_box(store.charge_now(&keys[i % keys.len()]).is_ok());
    }
}
