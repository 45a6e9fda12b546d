//! The field notes' shared-budget check, in process: 16 concurrent callers on
//! one anchored window of 5 admit exactly 5, every time.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use tollgate_budget::{Charge, Decision, Key, ManualClock, MemoryStore, Policy, Verdict};

const LIMIT: u64 = 5;
const WORKERS: usize = 16;

fn window() -> Policy {
    Policy::fixed_window("budget", LIMIT, Duration::from_secs(60)).unwrap()
}

fn charge() -> Charge {
    Charge::new(Key::new("budget").with("shared"), window(), 1).unwrap()
}

#[test]
fn sixteen_threads_admit_exactly_five_every_trial() {
    for trial in 0..200 {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let barrier = Arc::new(Barrier::new(WORKERS));
        let handles: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (store, barrier) = (store.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    store.charge_now(&[charge()]).unwrap().limits()[0]
                })
            })
            .collect();
        let results: Vec<Decision> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let admitted: Vec<u64> = results
            .iter()
            .filter(|d| d.is_admitted())
            .map(|d| LIMIT - d.remaining())
            .collect();
        assert_eq!(admitted.len(), 5, "trial {trial}");
        // Each count 1..=5 was handed out exactly once.
        let mut counts = admitted.clone();
        counts.sort_unstable();
        assert_eq!(counts, [1, 2, 3, 4, 5], "trial {trial}");
        assert!(
            results
                .iter()
                .filter(|d| !d.is_admitted())
                .all(|d| d.remaining() == 0)
        );
    }
}

#[test]
fn refusal_neither_counts_nor_extends_and_expiry_restarts_at_one() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    for _ in 0..LIMIT {
        assert!(store.charge_now(&[charge()]).unwrap().is_admitted());
    }
    clock.set(30_000_000_000);
    let refused = store.charge_now(&[charge()]).unwrap();
    assert_eq!(
        refused.verdict(),
        Verdict::Denied {
            retry_after: Duration::from_secs(30)
        }
    );
    clock.set(59_999_999_999);
    assert_eq!(
        store.charge_now(&[charge()]).unwrap().verdict(),
        Verdict::Denied {
            retry_after: Duration::from_nanos(1)
        }
    );
    clock.set(60_000_000_000);
    let first = store.charge_now(&[charge()]).unwrap().limits()[0];
    assert_eq!(
        first,
        Decision::admitted(LIMIT - 1, Duration::from_secs(60))
    );
}
