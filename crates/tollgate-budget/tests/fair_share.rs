//! `fair_shares` against an exact rational model of weighted max-min
//! fairness, and its invariants over the whole `u64` range.

use std::num::NonZeroU32;

use num_rational::Ratio;
use proptest::prelude::*;
use tollgate_budget::{Claim, fair_shares};

type Q = Ratio<i128>;

/// The exact water level: the `λ` at which `Σ min(dᵢ, wᵢ λ)` reaches the
/// capacity, found from the breakpoints `dᵢ / wᵢ` (a different route from
/// the progressive filling under test). `None` when every demand fits.
fn level(capacity: u64, claims: &[(u64, u32)]) -> Option<Q> {
    let total: i128 = claims.iter().map(|&(d, _)| i128::from(d)).sum();
    if total <= i128::from(capacity) {
        return None;
    }
    let filled = |l: Q| -> Q {
        claims
            .iter()
            .map(|&(d, w)| Q::from_integer(d.into()).min(Q::from_integer(w.into()) * l))
            .sum()
    };
    let mut breaks: Vec<Q> = claims
        .iter()
        .map(|&(d, w)| Q::new(d.into(), w.into()))
        .collect();
    breaks.sort();
    let cap = Q::from_integer(capacity.into());
    // The first breakpoint at which the filling reaches the capacity: the
    // level lies between it and the one before, where the filling is
    // linear.
    let mut below = Q::from_integer(0);
    for b in breaks {
        if filled(b) >= cap {
            let met: Q = claims
                .iter()
                .filter(|&&(d, w)| Q::new(d.into(), w.into()) <= below)
                .map(|&(d, _)| Q::from_integer(d.into()))
                .sum();
            let weight: i128 = claims
                .iter()
                .filter(|&&(d, w)| Q::new(d.into(), w.into()) > below)
                .map(|&(_, w)| i128::from(w))
                .sum();
            let l = (cap - met) / Q::from_integer(weight);
            assert_eq!(filled(l), cap);
            return Some(l);
        }
        below = b;
    }
    unreachable!("total demand exceeds the capacity")
}

/// The model's shares: exact `min(dᵢ, wᵢ λ)`, rounded down, with the units
/// left over going to the largest fractional parts, earlier claims first
/// among equal ones (the documented rounding).
fn model(capacity: u64, claims: &[(u64, u32)]) -> Vec<u64> {
    let Some(l) = level(capacity, claims) else {
        return claims.iter().map(|&(d, _)| d).collect();
    };
    let exact: Vec<Q> = claims
        .iter()
        .map(|&(d, w)| Q::from_integer(d.into()).min(Q::from_integer(w.into()) * l))
        .collect();
    let mut shares: Vec<u64> = exact
        .iter()
        .map(|x| u64::try_from(x.floor().to_integer()).unwrap())
        .collect();
    let spare = capacity - shares.iter().sum::<u64>();
    let mut by_fraction: Vec<usize> = (0..claims.len()).collect();
    by_fraction.sort_by(|&i, &j| exact[j].fract().cmp(&exact[i].fract()).then(i.cmp(&j)));
    for &i in by_fraction.iter().take(usize::try_from(spare).unwrap()) {
        assert!(!exact[i].is_integer(), "a spare unit goes to a fraction");
        shares[i] += 1;
    }
    shares
}

fn claims_of(raw: &[(u64, u32)]) -> Vec<Claim> {
    raw.iter()
        .map(|&(d, w)| Claim::new(d, NonZeroU32::new(w).unwrap()))
        .collect()
}

/// The invariants every answer keeps, checked in `u128`.
fn check_invariants(capacity: u64, claims: &[Claim], shares: &[u64]) -> Result<(), TestCaseError> {
    prop_assert_eq!(shares.len(), claims.len());
    let total: u128 = claims.iter().map(|c| u128::from(c.demand)).sum();
    let sum: u128 = shares.iter().map(|&s| u128::from(s)).sum();
    prop_assert_eq!(sum, total.min(u128::from(capacity)));
    for (c, &s) in claims.iter().zip(shares) {
        prop_assert!(s <= c.demand);
    }
    // Max-min: a key below its demand cannot gain a unit from a key j
    // unless j's share per weight would then be below the key's own after
    // the gain: (a_j − 1) / w_j < (a_i + 1) / w_i.
    for (i, (ci, &ai)) in claims.iter().zip(shares).enumerate() {
        if ai >= ci.demand {
            continue;
        }
        for (j, (cj, &aj)) in claims.iter().zip(shares).enumerate() {
            if i == j || aj == 0 {
                continue;
            }
            let lhs = u128::from(aj - 1) * u128::from(ci.weight.get());
            let rhs = (u128::from(ai) + 1) * u128::from(cj.weight.get());
            prop_assert!(lhs < rhs, "key {} could take from key {}", i, j);
        }
    }
    Ok(())
}

fn small_claims() -> impl Strategy<Value = Vec<(u64, u32)>> {
    let demand = prop_oneof![0u64..5, 0u64..100, 0u64..1 << 40];
    let weight = prop_oneof![Just(1u32), 1u32..5, 1u32..1 << 16];
    proptest::collection::vec((demand, weight), 0..24)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn equals_the_exact_model_rounded_as_documented(
        capacity in prop_oneof![0u64..10, 0u64..1_000, 0u64..1 << 40],
        raw in small_claims(),
    ) {
        let claims = claims_of(&raw);
        let shares = fair_shares(capacity, &claims);
        prop_assert_eq!(&shares, &model(capacity, &raw));
        check_invariants(capacity, &claims, &shares)?;
    }

    #[test]
    fn keeps_its_invariants_over_the_whole_range(
        capacity in any::<u64>(),
        raw in proptest::collection::vec((any::<u64>(), 1u32..=u32::MAX), 0..24),
    ) {
        let claims = claims_of(&raw);
        let shares = fair_shares(capacity, &claims);
        check_invariants(capacity, &claims, &shares)?;
        // The claims' order only moves ties: reversed, each key's share
        // differs by at most the rounding unit.
        let mut reversed = claims.clone();
        reversed.reverse();
        let mut back = fair_shares(capacity, &reversed);
        back.reverse();
        for (a, b) in shares.iter().zip(&back) {
            prop_assert!(a.abs_diff(*b) <= 1);
        }
    }

    #[test]
    fn equal_claims_get_equal_shares_up_to_one(
        capacity in 0u64..10_000,
        demand in 0u64..10_000,
        weight in 1u32..100,
        n in 1usize..40,
    ) {
        let claims = vec![Claim::new(demand, NonZeroU32::new(weight).unwrap()); n];
        let shares = fair_shares(capacity, &claims);
        let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
        prop_assert!(hi - lo <= 1);
        // And the larger ones come first.
        prop_assert!(shares.windows(2).all(|p| p[0] >= p[1]));
    }
}
