//! Policies whose numbers change under one name (plans, runtime changes):
//! the store's carry-over against an exact rational model of the rule, and
//! the envelope across a change.

use std::time::Duration;

use num_rational::Ratio;
use proptest::prelude::*;
use tollgate_budget::{Charge, Decision, Key, ManualClock, MemoryStore, Policy, Rate};

type Q = Ratio<i128>;

fn q(n: u64) -> Q {
    Q::from_integer(n.into())
}

/// One set of token-bucket numbers, exactly.
#[derive(Clone, Copy, Debug)]
struct Numbers {
    capacity: u64,
    amount: u64,
    period: u64,
}

impl Numbers {
    fn rate(&self) -> Q {
        Q::new(self.amount.into(), self.period.into())
    }

    /// The policy's scaled unit is 1/den of a token, with the rate in
    /// lowest terms num/den tokens per nanosecond.
    fn den(&self) -> i128 {
        *self.rate().denom()
    }

    fn policy(&self) -> Policy {
        Policy::token_bucket(
            "plan",
            self.capacity,
            Rate::new(self.amount, Duration::from_nanos(self.period)),
        )
        .unwrap()
    }
}

/// A key's credit in exact tokens, the time it holds at and the numbers it
/// was written under, as the documented rule says.
#[derive(Clone, Copy)]
struct Model {
    credit: Q,
    at: Q,
    by: usize,
}

/// The longest debt a conversion keeps, as the store's `MAX_CARRIED_DEBT`.
const MAX_DEBT: u64 = 2_000_000_000_000_000;

/// The state `plans[j]` reads at `now`: `None` for no state.
fn read(model: Option<Model>, plans: &[Numbers], j: usize, now: Q) -> Option<Model> {
    let m = model?;
    let (old, new) = (plans[m.by], plans[j]);
    if m.by == j {
        return Some(m);
    }
    // Brought to now under the numbers that wrote it (a state dated later
    // counts the refill until then as spent too); idle: no state.
    let spent = if now >= m.at {
        q(old.capacity) - q(old.capacity).min(m.credit + (now - m.at) * old.rate())
    } else {
        q(old.capacity) - m.credit + (m.at - now) * old.rate()
    };
    if spent == q(0) {
        return None;
    }
    // Spent tokens kept in full, rounded up to the new unit; beyond the new
    // capacity, a debt: empty until it has refilled.
    let den = Q::from_integer(new.den());
    let spent = (spent * den).ceil() / den;
    Some(if spent <= q(new.capacity) {
        Model {
            credit: q(new.capacity) - spent,
            at: now,
            by: j,
        }
    } else {
        let wait = ((spent - q(new.capacity)) / new.rate())
            .ceil()
            .min(q(MAX_DEBT));
        Model {
            credit: q(0),
            at: now + wait,
            by: j,
        }
    })
}

/// Charges `cost` under `plans[j]` at `now`: the decision the store must
/// give and the model after it.
fn charge_model(
    model: Option<Model>,
    plans: &[Numbers],
    j: usize,
    now: Q,
    cost: u64,
) -> (Result<u64, Q>, Option<Model>) {
    let p = plans[j];
    let carried = read(model, plans, j, now);
    let m = carried.unwrap_or(Model {
        credit: q(p.capacity),
        at: now,
        by: j,
    });
    let t = now.max(m.at);
    let credit = q(p.capacity).min(m.credit + (t - m.at) * p.rate());
    let cost = q(cost);
    if credit >= cost {
        let left = credit - cost;
        let next = Model {
            credit: left,
            at: t,
            by: j,
        };
        (Ok(left.floor().to_integer() as u64), Some(next))
    } else {
        // Nothing is spent; a state stored under other numbers is
        // converted, once.
        let wait = (t - now) + ((cost - credit) / p.rate()).ceil();
        (Err(wait), carried)
    }
}

fn numbers() -> impl Strategy<Value = Numbers> {
    (
        1u64..12,
        1u64..7,
        prop_oneof![1u64..3_000, 100_000_000u64..2_000_000_000],
    )
        .prop_map(|(capacity, amount, period)| Numbers {
            capacity,
            amount,
            period,
        })
}

/// Key 0 is an IPv6 client address and key 1 a text key, kept in
/// different tables: both carry over alike.
fn charge(policy: &Policy, key: u8, cost: u64) -> Charge {
    let key = match key {
        0 => Key::client_ip(
            std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 9).into(),
            128,
        ),
        k => Key::new("plan").with([k]),
    };
    Charge::new(key, policy.clone(), cost).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// Plans flipping under one name mid-trace (upgrades, downgrades,
    /// clock steps back): every decision, remaining count and wait equals
    /// the rational model of the carry-over rule.
    #[test]
    fn plan_changes_match_the_model(
        plans in proptest::collection::vec(numbers(), 2..4),
        trace in proptest::collection::vec(
            (prop_oneof![6 => 0i64..600_000_000, 1 => -100_000_000i64..0, 2 => Just(0i64)],
             1u64..8, 0usize..4, 0u8..2),
            1..60,
        ),
    ) {
        let policies: Vec<Policy> = plans.iter().map(Numbers::policy).collect();
        let clock = ManualClock::new(1_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).sweep_interval(Duration::from_secs(1 << 40)).build();
        let mut models: [Option<Model>; 2] = [None, None];
        let mut now: i64 = 1_000_000_000;
        for (dt, cost, plan, key) in trace {
            let j = plan % plans.len();
            now = (now + dt).max(0);
            clock.set(now as u64);
            let got = store.charge_now(&[charge(&policies[j], key, cost)]).unwrap().limits()[0];
            if cost > plans[j].capacity {
                prop_assert_eq!(got, Decision::never_fitting(cost, plans[j].capacity));
                continue;
            }
            let (expected, next) = charge_model(models[usize::from(key)], &plans, j, q(now as u64), cost);
            match expected {
                Ok(remaining) => {
                    prop_assert!(got.is_admitted(), "model admits, store said {:?}", got);
                    prop_assert_eq!(got.remaining(), remaining);
                }
                Err(wait) => {
                    let wait = Duration::from_nanos(u64::try_from(wait.to_integer()).unwrap());
                    prop_assert_eq!(got.retry_after(), Some(wait), "store said {:?}", got);
                }
            }
            models[usize::from(key)] = next;
        }
    }

    /// A limit changed under load: for every interval `[a, b]`, the cost
    /// admitted is at most
    /// `max(B_old, B_new) + r_old·(time of [a, b] before T) + r_new·(time after)`,
    /// where `T` is the key's first charge under the new numbers (a key
    /// stays under the old numbers until then, and changes over at it,
    /// admitted or not). Right at the change,
    /// lowering the capacity admits no burst and raising it forgets nothing
    /// spent.
    #[test]
    fn a_change_at_runtime_stays_in_the_envelope(
        old in numbers(),
        new in numbers(),
        before in proptest::collection::vec((0u64..300_000_000, 1u64..6), 1..30),
        after in proptest::collection::vec((0u64..300_000_000, 1u64..6), 1..30),
    ) {
        let (p_old, p_new) = (old.policy(), new.policy());
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let mut now = 0u64;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        let run = |policy: &Policy, steps: &[(u64, u64)], now: &mut u64, admitted: &mut Vec<(u64, u64)>| {
            for &(dt, cost) in steps {
                *now += dt;
                clock.set(*now);
                if store.charge_now(&[charge(policy, 0, cost)]).unwrap().is_admitted() {
                    admitted.push((*now, cost));
                }
            }
        };
        run(&p_old, &before, &mut now, &mut admitted);
        let change = now;
        let probe = |p: &Policy| store.describe(&[charge(p, 0, 1)]).limits()[0].remaining();
        let (left_old, left_new) = (probe(&p_old), probe(&p_new));
        if new.capacity <= old.capacity {
            prop_assert!(left_new <= left_old, "lowering gave {} after {}", left_new, left_old);
        }
        let spent_old = old.capacity - left_old;
        // Whole tokens: at most one more is seen as spent (rounding up).
        prop_assert!(new.capacity - left_new >= spent_old.min(new.capacity));
        // A cost that can never fit touches nothing: the key changes over
        // at the first charge under the new numbers that could fit.
        let mut change = change;
        for &(dt, cost) in &after {
            change += dt;
            if cost <= new.capacity {
                break;
            }
        }
        run(&p_new, &after, &mut now, &mut admitted);
        let bound_b = q(old.capacity.max(new.capacity));
        for (i, &(a, _)) in admitted.iter().enumerate() {
            let mut total = 0u64;
            for &(b, cost) in &admitted[i..] {
                total += cost;
                let before_t = change.min(b).saturating_sub(a);
                let after_t = b.saturating_sub(change.max(a));
                let limit = bound_b + old.rate() * q(before_t) + new.rate() * q(after_t);
                prop_assert!(q(total) <= limit, "{} admitted in [{}, {}] over {}", total, a, b, limit);
            }
        }
    }

    /// Plans flipping back and forth on one key, the clock frozen or
    /// moving: for every interval, the cost admitted is at most the largest
    /// capacity in force in it plus each plan's rate over the time it was in
    /// force (a plan is in force from the first charge under it that could
    /// fit, until the next plan's). Flipping never mints credit.
    #[test]
    fn flipping_plans_never_mints_credit(
        plans in proptest::collection::vec(numbers(), 2..4),
        trace in proptest::collection::vec(
            (prop_oneof![3 => Just(0u64), 2 => 0u64..200_000_000], 1u64..8, 0usize..4),
            1..80,
        ),
    ) {
        let policies: Vec<Policy> = plans.iter().map(Numbers::policy).collect();
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let mut now = 0u64;
        // (time, plan) at each change of the plan in force.
        let mut in_force: Vec<(u64, usize)> = Vec::new();
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (dt, cost, plan) in trace {
            let j = plan % plans.len();
            now += dt;
            clock.set(now);
            if cost <= plans[j].capacity && in_force.last().is_none_or(|&(_, k)| k != j) {
                in_force.push((now, j));
            }
            if store.charge_now(&[charge(&policies[j], 0, cost)]).unwrap().is_admitted() {
                admitted.push((now, cost));
            }
        }
        for (i, &(a, _)) in admitted.iter().enumerate() {
            let mut total = 0u64;
            for &(b, cost) in &admitted[i..] {
                total += cost;
                let mut limit = q(0);
                let mut biggest = 0;
                for (k, &(start, j)) in in_force.iter().enumerate() {
                    let end = in_force.get(k + 1).map_or(u64::MAX, |s| s.0);
                    // At a change's instant both plans are in force.
                    if start <= b && end >= a {
                        let (from, to) = (a.max(start), b.min(end));
                        limit += plans[j].rate() * q(to.saturating_sub(from));
                        biggest = biggest.max(plans[j].capacity);
                    }
                }
                limit += q(biggest);
                prop_assert!(q(total) <= limit, "{} admitted in [{}, {}] over {}", total, a, b, limit);
            }
        }
    }
}
