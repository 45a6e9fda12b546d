//! Property tests against an exact rational oracle of the strict token bucket
//! (and a direct model of the anchored fixed window).

use std::time::Duration;

use num_rational::Ratio;
use proptest::prelude::*;
use tollgate_budget::{Charge, Decision, Key, ManualClock, MemoryStore, Policy, Rate};

type Q = Ratio<i128>;

/// The seed's `Bucket`, in exact rationals, with a clock that may go back:
/// time is clamped to the last update, as the design requires.
#[derive(Clone)]
struct Oracle {
    capacity: Q,
    rate: Q, // tokens per nanosecond
    tokens: Q,
    updated: Q,
}

impl Oracle {
    fn new(capacity: u64, amount: u64, period_ns: u64) -> Self {
        Self {
            capacity: Q::from_integer(capacity.into()),
            rate: Q::new(amount.into(), period_ns.into()),
            tokens: Q::from_integer(capacity.into()),
            updated: Q::from_integer(0),
        }
    }

    fn refill(&mut self, now: Q) {
        let now = now.max(self.updated);
        self.tokens = self
            .capacity
            .min(self.tokens + (now - self.updated) * self.rate);
        self.updated = now;
    }

    /// `Ok(())` if admitted, `Err(wait in ns, rounded up)` if not.
    fn take(&mut self, now: Q, cost: u64) -> Result<(), Q> {
        self.refill(now);
        let cost = Q::from_integer(cost.into());
        if self.tokens < cost {
            let lead = self.updated - now;
            return Err(lead + ((cost - self.tokens) / self.rate).ceil());
        }
        self.tokens -= cost;
        Ok(())
    }
}

/// A store that never sweeps. The oracle keeps every state forever; a store
/// drops a state that has gone idle (refilled to full), and when the clock
/// then steps back to before that instant, a swept key starts full while
/// the oracle still clamps to its old state (found by this test when both
/// keys landed in one shard). In real time nothing is minted: the bucket was
/// full when it was swept. The comparison is of the arithmetic, so sweeping
/// is off here (as in the Redis differential).
fn never_swept(clock: &ManualClock) -> MemoryStore {
    MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_secs(1 << 40))
        .build()
}

fn policy_strategy() -> impl Strategy<Value = (u64, u64, u64)> {
    // capacity, refill amount, refill period in ns (odd periods included).
    (
        1u64..20,
        1u64..10,
        prop_oneof![1u64..5_000, 1_000_000u64..3_000_000_000],
    )
}

fn trace_strategy() -> impl Strategy<Value = Vec<(i64, u64, u8)>> {
    // (time step in ns, possibly negative; cost; key)
    proptest::collection::vec(
        (
            prop_oneof![
                8 => 0i64..400_000_000,
                1 => -200_000_000i64..0,
                1 => Just(0i64),
            ],
            1u64..25,
            0u8..2,
        ),
        1..60,
    )
}

/// Key 0 is an IPv4 client address and key 1 a text key: the store keeps
/// the two in different tables, and both must decide as the oracle does.
fn charge(policy: &Policy, key: u8, cost: u64) -> Charge {
    let key = match key {
        0 => Key::client_ip(std::net::Ipv4Addr::new(203, 0, 113, 9).into(), 32),
        k => Key::new("p").with([k]),
    };
    Charge::new(key, policy.clone(), cost).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// Same decisions and exact waits as the oracle, including a clock that
    /// steps backwards; refusals and never-fits spend nothing; the envelope
    /// admitted(t0..t1) <= B + r(t1 - t0) holds on the effective time line.
    #[test]
    fn token_bucket_matches_the_oracle((cap, amount, period) in policy_strategy(), trace in trace_strategy()) {
        let policy = Policy::token_bucket("p", cap, Rate::new(amount, Duration::from_nanos(period))).unwrap();
        let clock = ManualClock::new(1_000_000_000);
        let store = never_swept(&clock);
        // A key's bucket is created, full, at its first charge.
        let mut oracles: [Option<Oracle>; 2] = [None, None];
        let mut now: i64 = 1_000_000_000;
        let mut admitted: Vec<(Q, u64, u8)> = Vec::new();
        for (dt, cost, key) in trace {
            now = (now + dt).max(0);
            clock.set(now as u64);
            let t = Q::from_integer(now.into());
            let got = store.charge_now(&[charge(&policy, key, cost)]).unwrap().limits()[0];
            if cost > cap {
                prop_assert_eq!(got, Decision::never_fitting(cost, cap));
                continue;
            }
            let oracle = oracles[usize::from(key)].get_or_insert_with(|| {
                let mut o = Oracle::new(cap, amount, period);
                o.updated = t;
                o
            });
            let before = oracle.tokens;
            match oracle.clone().take(t, cost) {
                Ok(()) => {
                    prop_assert!(got.is_admitted(), "oracle admits, store said {:?}", got);
                    oracle.take(t, cost).unwrap();
                    admitted.push((oracle.updated, cost, key));
                    prop_assert_eq!(Q::from_integer(got.remaining().into()), oracle.tokens.floor());
                }
                Err(wait) => {
                    let expected = Duration::from_nanos(u64::try_from(wait.to_integer()).unwrap());
                    prop_assert_eq!(got.retry_after(), Some(expected));
                    // A refusal spends nothing (the oracle is untouched).
                    prop_assert_eq!(oracle.tokens, before);
                }
            }
        }
        let (b, r) = (Q::from_integer(cap.into()), Q::new(amount.into(), period.into()));
        for key in 0..2u8 {
            let mine: Vec<&(Q, u64, u8)> = admitted.iter().filter(|a| a.2 == key).collect();
            for (i, start) in mine.iter().enumerate() {
                let mut sum = 0i128;
                for end in &mine[i..] {
                    sum += i128::from(end.1);
                    prop_assert!(Q::from_integer(sum) <= b + r * (end.0 - start.0));
                }
            }
        }
    }

    /// Two limits charged together: admitted only if both oracles admit, and
    /// a refusal by either spends from neither.
    #[test]
    fn multi_charges_are_all_or_nothing(
        (cap_a, amount_a, period_a) in policy_strategy(),
        (cap_b, amount_b, period_b) in policy_strategy(),
        trace in trace_strategy(),
    ) {
        let pa = Policy::token_bucket("a", cap_a, Rate::new(amount_a, Duration::from_nanos(period_a))).unwrap();
        let pb = Policy::token_bucket("b", cap_b, Rate::new(amount_b, Duration::from_nanos(period_b))).unwrap();
        let clock = ManualClock::new(0);
        let store = never_swept(&clock);
        let (mut oa, mut ob) = (Oracle::new(cap_a, amount_a, period_a), Oracle::new(cap_b, amount_b, period_b));
        let mut now: i64 = 0;
        for (dt, cost, _) in trace {
            now = (now + dt).max(0);
            clock.set(now as u64);
            let t = Q::from_integer(now.into());
            let outcome = store.charge_now(&[charge(&pa, 0, cost), charge(&pb, 0, cost)]).unwrap();
            if cost > cap_a || cost > cap_b {
                prop_assert!(!outcome.is_admitted());
                continue;
            }
            let fits = oa.clone().take(t, cost).is_ok() && ob.clone().take(t, cost).is_ok();
            prop_assert_eq!(outcome.is_admitted(), fits);
            // A refusal writes nothing, not even the refill: a later reading
            // from a clock that stepped back is clamped to the last write.
            if fits {
                oa.take(t, cost).unwrap();
                ob.take(t, cost).unwrap();
            }
        }
    }

    /// The anchored fixed window against a direct model of its rule.
    #[test]
    fn fixed_window_matches_its_rule(limit in 1u64..10, window in 1u64..1_000, trace in trace_strategy()) {
        let policy = Policy::fixed_window("w", limit, Duration::from_nanos(window)).unwrap();
        let clock = ManualClock::new(0);
        let store = never_swept(&clock);
        let mut model: [Option<(u64, u64)>; 2] = [None, None]; // (start, count)
        let mut now: i64 = 0;
        for (dt, cost, key) in trace {
            now = (now + dt / 1_000_000).max(0);
            clock.set(now as u64);
            let t = now as u64;
            let got = store.charge_now(&[charge(&policy, key, cost)]).unwrap().limits()[0];
            let slot = &mut model[usize::from(key)];
            if cost > limit {
                prop_assert!(got.never_fits(), "expected never-fits, got {:?}", got);
                continue;
            }
            let (start, count) = match *slot {
                Some((s, c)) if t < s + window => (s, c),
                _ => (t, 0),
            };
            if count + cost <= limit {
                prop_assert!(got.is_admitted());
                *slot = Some((start, count + cost));
            } else {
                prop_assert_eq!(got.retry_after(), Some(Duration::from_nanos(start + window - t.min(start + window))));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Clock faults: jumps of up to ten days either way never mint credit
    /// beyond the envelope; decisions still match the oracle, whose time is
    /// clamped to the last admission.
    #[test]
    fn large_clock_jumps_never_mint_credit(
        (cap, amount, period) in policy_strategy(),
        jumps in proptest::collection::vec((-864_000_000_000_000i64..864_000_000_000_000, 1u64..20), 1..40),
    ) {
        let policy = Policy::token_bucket("p", cap, Rate::new(amount, Duration::from_nanos(period))).unwrap();
        let start: i64 = 2_592_000_000_000_000; // 30 days
        let clock = ManualClock::new(start as u64);
        let store = never_swept(&clock);
        let mut oracle: Option<Oracle> = None;
        let mut now = start;
        let mut admitted: Vec<(Q, u64)> = Vec::new();
        for (jump, cost) in jumps {
            now = (now + jump).clamp(0, 2 * start);
            clock.set(now as u64);
            let t = Q::from_integer(now.into());
            let got = store.charge_now(&[charge(&policy, 0, cost)]).unwrap().limits()[0];
            if cost > cap {
                prop_assert!(got.never_fits(), "got {:?}", got);
                continue;
            }
            let o = oracle.get_or_insert_with(|| {
                let mut o = Oracle::new(cap, amount, period);
                o.updated = t;
                o
            });
            let fits = o.clone().take(t, cost).is_ok();
            prop_assert_eq!(got.is_admitted(), fits);
            if fits {
                o.take(t, cost).unwrap();
                admitted.push((o.updated, cost));
            }
        }
        // On the effective (clamped) time line the envelope holds.
        let (b, r) = (Q::from_integer(cap.into()), Q::new(amount.into(), period.into()));
        for i in 0..admitted.len() {
            let mut sum = 0i128;
            for end in &admitted[i..] {
                sum += i128::from(end.1);
                prop_assert!(Q::from_integer(sum) <= b + r * (end.0 - admitted[i].0));
            }
        }
    }
}
