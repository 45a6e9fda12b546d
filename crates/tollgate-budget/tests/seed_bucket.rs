//! The field notes' `bucket_check.py`, ported exactly, against `MemoryStore`.

use num_rational::Ratio;
use tollgate_budget::{Charge, Key, ManualClock, MemoryStore, Policy, Rate, Verdict};

type Q = Ratio<i128>;
const S: i128 = 1_000_000_000;

fn bucket() -> Policy {
    Policy::token_bucket("seed", 3, Rate::per_second(2)).unwrap()
}

fn take(store: &MemoryStore, clock: &ManualClock, now: Q, cost: u64) -> Verdict {
    let ns = now * Q::from_integer(S);
    assert!(ns.is_integer());
    clock.set(u64::try_from(ns.to_integer()).unwrap());
    let charge = Charge::new(Key::new("seed").with("k"), bucket(), cost).unwrap();
    store.charge_now(&[charge]).unwrap().verdict()
}

#[test]
fn seed_trace_envelope_and_oversized_cost() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let q = |n, d| Q::new(n, d);
    let mut events = vec![(q(0, 1), 1); 4];
    events.extend([(q(1, 4), 1), (q(1, 2), 1), (q(3, 2), 2)]);
    events.extend(vec![(q(100, 1), 1); 4]);

    let results: Vec<(Q, u64, Verdict)> = events
        .iter()
        .map(|&(now, cost)| (now, cost, take(&store, &clock, now, cost)))
        .collect();
    let allowed: Vec<bool> = results.iter().map(|r| r.2 == Verdict::Admitted).collect();
    assert_eq!(
        allowed,
        [
            true, true, true, false, false, true, true, true, true, true, false
        ]
    );
    // bucket.tokens == 0: the last refusal needs exactly one token at 2/s.
    assert_eq!(
        results[10].2,
        Verdict::Denied {
            retry_after: std::time::Duration::from_millis(500)
        }
    );

    // Every event-bounded interval obeys admitted cost <= B + r * elapsed.
    let (b, r) = (Q::from_integer(3), Q::from_integer(2));
    let mut marks: Vec<Q> = events.iter().map(|e| e.0).collect();
    marks.sort();
    marks.dedup();
    for &start in &marks {
        for &end in marks.iter().filter(|&&e| e >= start) {
            let consumed: i128 = results
                .iter()
                .filter(|(t, _, v)| *v == Verdict::Admitted && start <= *t && *t <= end)
                .map(|(_, c, _)| i128::from(*c))
                .sum();
            assert!(Q::from_integer(consumed) <= b + r * (end - start));
        }
    }

    // Cost above capacity never fits; rejection does not consume tokens.
    assert_eq!(take(&store, &clock, q(200, 1), 4), Verdict::NeverFits);
    assert_eq!(take(&store, &clock, q(200, 1), 3), Verdict::Admitted);
    assert!(matches!(
        take(&store, &clock, q(200, 1), 1),
        Verdict::Denied { .. }
    ));
}

#[test]
fn four_local_buckets_admit_twelve_one_shared_admits_three() {
    let clock = ManualClock::new(0);
    let workers: Vec<MemoryStore> = (0..4)
        .map(|_| MemoryStore::builder().clock(clock.clone()).build())
        .collect();
    let local: usize = workers
        .iter()
        .map(|w| {
            (0..4)
                .filter(|_| take(w, &clock, Q::from_integer(0), 1) == Verdict::Admitted)
                .count()
        })
        .sum();
    let shared = MemoryStore::builder().clock(clock.clone()).build();
    let shared_admitted = (0..16)
        .filter(|_| take(&shared, &clock, Q::from_integer(0), 1) == Verdict::Admitted)
        .count();
    assert_eq!((local, shared_admitted), (12, 3));
}
