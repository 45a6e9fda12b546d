//! Shaping judged on release times, against exact rationals: whatever the
//! mix of shaped and immediate charges, waits, cancellations and clock
//! jumps on one key, the cost released in any interval is at most
//! `B + r·t`, no shaped request waits longer than it allowed, and a cost
//! that can never fit is never delayed.

use std::time::Duration;

use num_rational::Ratio;
use proptest::prelude::*;
use tollgate_budget::{Charge, Key, ManualClock, MemoryStore, Policy, Rate, Reservation, Verdict};

type Q = Ratio<i128>;

#[derive(Debug, Clone)]
enum Op {
    /// Charge `cost`, shaped up to `max_delay` ns if `Some`.
    Charge { cost: u64, max_delay: Option<u64> },
    /// Drop a request still waiting (picked by this number), as a client
    /// that goes away.
    Cancel(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..6, proptest::option::of(0u64..3_000_000_000))
            .prop_map(|(cost, max_delay)| Op::Charge { cost, max_delay }),
        1 => (0usize..8).prop_map(Op::Cancel),
    ]
}

fn bucket() -> impl Strategy<Value = (u64, u64, u64)> {
    // capacity, refill amount, period in ns: at most one token per ns.
    (
        1u64..8,
        1u64..5,
        prop_oneof![5u64..5_000, 100_000_000u64..1_500_000_000],
    )
        .prop_filter("shaping needs at most one token per ns", |&(_, a, p)| {
            a <= p
        })
}

struct Waiting {
    release: u64,
    cost: u64,
    charge: Charge,
    reservation: Reservation,
    /// Index into `released`.
    slot: usize,
}

/// A second bucket charged in the same call, on its own key: both are
/// decided together, all-or-nothing, and released (when shaped) together.
#[derive(Debug, Clone)]
struct Pair {
    /// Which buckets the call charges: first, second or both.
    which: u8,
    first_shaped: bool,
    second_shaped: bool,
}

fn pair() -> impl Strategy<Value = Pair> {
    (0u8..3, any::<bool>(), any::<bool>()).prop_map(|(which, first_shaped, second_shaped)| Pair {
        which,
        first_shaped,
        second_shaped,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    #[test]
    fn releases_stay_within_the_envelope(
        (capacity, amount, period) in bucket(),
        trace in proptest::collection::vec(
            (prop_oneof![3 => Just(0u64), 3 => 0u64..400_000_000, 1 => 0u64..4_000_000_000], op()),
            1..80,
        ),
    ) {
        let policy = Policy::token_bucket("p", capacity, Rate::new(amount, Duration::from_nanos(period))).unwrap();
        let rate = Q::new(amount.into(), period.into());
        let clock = ManualClock::new(1_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let mut now = 1_000_000_000u64;
        // Released cost by release time; `None` once cancelled.
        let mut released: Vec<Option<(u64, u64)>> = Vec::new();
        let mut waiting: Vec<Waiting> = Vec::new();
        for (dt, op) in trace {
            now += dt;
            clock.set(now);
            // Those released by now are no longer waiting.
            waiting.retain(|w| w.release > now);
            match op {
                Op::Charge { cost, max_delay } => {
                    let key = Key::client_ip(std::net::Ipv4Addr::new(198, 51, 100, 1).into(), 32);
                    let mut charge = Charge::new(key, policy.clone(), cost).unwrap();
                    if let Some(d) = max_delay {
                        charge = charge.shaped(Duration::from_nanos(d));
                    }
                    let outcome = store.charge_now(std::slice::from_ref(&charge)).unwrap();
                    if cost > capacity {
                        prop_assert_eq!(outcome.verdict(), Verdict::NeverFits);
                        prop_assert_eq!(outcome.delay(), Duration::ZERO);
                        continue;
                    }
                    if !outcome.is_admitted() {
                        continue;
                    }
                    let delay = u64::try_from(outcome.delay().as_nanos()).unwrap();
                    prop_assert!(delay <= max_delay.unwrap_or(0), "waited {} beyond {:?}", delay, max_delay);
                    released.push(Some((now + delay, cost)));
                    if let Some(reservation) = outcome.reservation() {
                        prop_assert!(delay > 0);
                        waiting.push(Waiting {
                            release: now + delay,
                            cost,
                            charge,
                            reservation: reservation.clone(),
                            slot: released.len() - 1,
                        });
                    }
                }
                Op::Cancel(pick) => {
                    if waiting.is_empty() {
                        continue;
                    }
                    let w = waiting.remove(pick % waiting.len());
                    prop_assert!(w.cost > 0);
                    store.cancel_now(std::slice::from_ref(&w.charge), &w.reservation);
                    released[w.slot] = None;
                }
            }
        }
        let mut times: Vec<(u64, u64)> = released.into_iter().flatten().collect();
        times.sort_unstable();
        for i in 0..times.len() {
            let mut total = 0u64;
            for j in i..times.len() {
                total += times[j].1;
                let span = Q::from_integer((times[j].0 - times[i].0).into());
                let limit = Q::from_integer(capacity.into()) + rate * span;
                prop_assert!(Q::from_integer(total.into()) <= limit,
                    "{} released in [{}, {}], over {}", total, times[i].0, times[j].0, limit);
            }
        }
    }

    /// Two shaped (or not) buckets charged together: a shaped charge counts
    /// at the request's release, an unshaped one when it is charged; each
    /// bucket stays within its own envelope on those times, also when the
    /// other one holds the request back (its charge is taken from the credit
    /// it will have then, not from credit it would only waste at capacity).
    #[test]
    fn two_buckets_in_one_call_stay_within_their_envelopes(
        first in bucket(),
        second in bucket(),
        trace in proptest::collection::vec(
            (prop_oneof![3 => Just(0u64), 3 => 0u64..400_000_000], 1u64..5, pair(), 0u64..2_500_000_000),
            1..70,
        ),
    ) {
        let make = |name: &str, (c, a, p): (u64, u64, u64)| {
            Policy::token_bucket(name, c, Rate::new(a, Duration::from_nanos(p))).unwrap()
        };
        let policies = [make("first", first), make("second", second)];
        let numbers = [first, second];
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let mut now = 0u64;
        let mut events: [Vec<(u64, u64)>; 2] = [Vec::new(), Vec::new()];
        for (dt, cost, pair, max_delay) in trace {
            now += dt;
            clock.set(now);
            let mut charges = Vec::new();
            let mut which = Vec::new();
            for (k, shaped) in [(0usize, pair.first_shaped), (1, pair.second_shaped)] {
                if pair.which == 2 || usize::from(pair.which) == k {
                    let mut c = Charge::new(Key::new("k").with([k as u8]), policies[k].clone(), cost).unwrap();
                    if shaped {
                        c = c.shaped(Duration::from_nanos(max_delay));
                    }
                    charges.push(c);
                    which.push((k, shaped));
                }
            }
            let outcome = store.charge_now(&charges).unwrap();
            if !outcome.is_admitted() {
                continue;
            }
            let delay = u64::try_from(outcome.delay().as_nanos()).unwrap();
            prop_assert!(delay <= max_delay);
            for (k, shaped) in which {
                events[k].push((if shaped { now + delay } else { now }, cost));
            }
        }
        for k in 0..2 {
            let (capacity, amount, period) = numbers[k];
            let rate = Q::new(amount.into(), period.into());
            let times = &mut events[k];
            times.sort_unstable();
            for i in 0..times.len() {
                let mut total = 0u64;
                for j in i..times.len() {
                    total += times[j].1;
                    let span = Q::from_integer((times[j].0 - times[i].0).into());
                    let limit = Q::from_integer(capacity.into()) + rate * span;
                    prop_assert!(Q::from_integer(total.into()) <= limit,
                        "bucket {}: {} in [{}, {}], over {}", k, total, times[i].0, times[j].0, limit);
                }
            }
        }
    }
}
