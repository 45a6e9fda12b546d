//! [`fair_shares`]: weighted max-min fair shares of a saturated limit, in
//! exact integers.

use std::cmp::Ordering;
use std::num::NonZeroU32;

/// One key's claim on a shared limit: how much it wants and its weight.
///
/// A weight is at least 1 by its type: a key that should get nothing is a
/// key that is not admitted, not a key with weight 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claim {
    /// What the key wants (e.g. its requests in flight plus those waiting).
    pub demand: u64,
    /// Its weight relative to the other keys (e.g. per plan).
    pub weight: NonZeroU32,
}

impl Claim {
    /// A claim for `demand` with `weight`.
    pub const fn new(demand: u64, weight: NonZeroU32) -> Self {
        Self { demand, weight }
    }
}

/// Weighted max-min fair shares of `capacity` between `claims`, in the
/// claims' order.
///
/// Exactly, by progressive filling: a water level `λ` rises, each key
/// getting `min(demand, weight × λ)`, until the capacity is used up or
/// every demand is met. So a key that wants less than its weighted share
/// keeps what it wants, and the rest of the capacity is split between the
/// others in proportion to their weights.
///
/// In integers: a key whose demand is met gets its demand; the others get
/// their exact share rounded down, and the units left by rounding (fewer
/// than there are such keys) go one each to the keys with the largest
/// fractional parts, the earlier claim first among equal ones. So:
///
/// - every share is at most its demand, and differs from the exact share by
///   less than 1;
/// - the shares add up to exactly `min(capacity, total demand)`;
/// - a key below its demand could gain a unit only from a key whose share
///   would then be, per weight, below the level (max-min fairness, as far
///   as integers allow);
/// - the same claims give the same shares.
///
/// Arithmetic is exact in `u128` for any number of claims that fits in
/// memory (below 2^32).
///
/// ```
/// use std::num::NonZeroU32;
/// use tollgate_budget::{Claim, fair_shares};
///
/// let w = |n| NonZeroU32::new(n).unwrap();
/// // 100 slots. One key wants 10 and keeps them; the other two split the
/// // other 90 by weight, 2 : 1.
/// let shares = fair_shares(
///     100,
///     &[Claim::new(10, w(1)), Claim::new(500, w(2)), Claim::new(500, w(1))],
/// );
/// assert_eq!(shares, [10, 60, 30]);
///
/// // 10 slots between three equal keys: 3⅓ each, the spare unit to the
/// // first.
/// let equal = [Claim::new(9, w(1)); 3];
/// assert_eq!(fair_shares(10, &equal), [4, 3, 3]);
///
/// // Demand below capacity: everyone gets what they want.
/// assert_eq!(fair_shares(10, &[Claim::new(2, w(5)), Claim::new(3, w(1))]), [2, 3]);
/// ```
pub fn fair_shares(capacity: u64, claims: &[Claim]) -> Vec<u64> {
    let total: u128 = claims.iter().map(|c| u128::from(c.demand)).sum();
    if total <= u128::from(capacity) {
        return claims.iter().map(|c| c.demand).collect();
    }
    let mut shares = vec![0u64; claims.len()];
    // By demand per weight, the smallest first: the keys the rising level
    // meets first.
    let mut order: Vec<usize> = (0..claims.len()).collect();
    order.sort_by(|&i, &j| per_weight_cmp(claims[i], claims[j]));
    let mut left = u128::from(capacity);
    let mut weight: u128 = claims.iter().map(|c| u128::from(c.weight.get())).sum();
    let mut rest = order.as_slice();
    // A key whose demand is at most its share at the current level
    // (`demand / weight <= left / weight_left`) is met; meeting it leaves
    // the level where it was or raises it, so the next key is compared
    // with the new level. Total demand exceeds the capacity, so at least
    // one key is not met and `weight` stays positive.
    while let Some((&i, tail)) = rest.split_first() {
        let c = claims[i];
        if u128::from(c.demand) * weight > left * u128::from(c.weight.get()) {
            break;
        }
        shares[i] = c.demand;
        left -= u128::from(c.demand);
        weight -= u128::from(c.weight.get());
        rest = tail;
    }
    // The others share `left` in proportion to their weights.
    let mut remainders = Vec::with_capacity(rest.len());
    let mut given: u128 = 0;
    for &i in rest {
        let exact = u128::from(claims[i].weight.get()) * left;
        let floor = exact / weight;
        shares[i] = u64::try_from(floor).unwrap_or(u64::MAX);
        given += floor;
        remainders.push((exact % weight, i));
    }
    // Fewer units than keys are left over (the fractional parts add up to
    // them); each goes to a key with a nonzero fractional part, so no share
    // passes its demand.
    let spare = usize::try_from(left - given).unwrap_or(usize::MAX);
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in remainders.iter().take(spare) {
        shares[i] += 1;
    }
    shares
}

/// Compares `a.demand / a.weight` with `b.demand / b.weight` exactly.
fn per_weight_cmp(a: Claim, b: Claim) -> Ordering {
    let left = u128::from(a.demand) * u128::from(b.weight.get());
    let right = u128::from(b.demand) * u128::from(a.weight.get());
    left.cmp(&right)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn no_claims_no_shares() {
        assert!(fair_shares(10, &[]).is_empty());
    }

    #[test]
    fn zero_capacity_gives_nothing() {
        let claims = [Claim::new(5, w(1)), Claim::new(0, w(3))];
        assert_eq!(fair_shares(0, &claims), [0, 0]);
    }

    #[test]
    fn small_demands_are_met_and_free_capacity_for_the_rest() {
        // Equal share would be 25 each; 5 and 10 are met, 85 left for two.
        let claims = [
            Claim::new(5, w(1)),
            Claim::new(1_000, w(1)),
            Claim::new(10, w(1)),
            Claim::new(1_000, w(1)),
        ];
        assert_eq!(fair_shares(100, &claims), [5, 43, 10, 42]);
    }

    #[test]
    fn meeting_one_demand_can_meet_the_next() {
        // Level 100/3 meets 30; then 70/2 = 35 meets 34; 36 goes to the last.
        let claims = [
            Claim::new(90, w(1)),
            Claim::new(34, w(1)),
            Claim::new(30, w(1)),
        ];
        assert_eq!(fair_shares(100, &claims), [36, 34, 30]);
    }

    #[test]
    fn weights_scale_the_level() {
        // Level λ: min(20, 3λ) + min(100, λ) + min(100, 2λ) = 100 → 20 is
        // met at λ = 6⅔; then 80 = 3λ → λ = 26⅔: 26.67 and 53.33.
        let claims = [
            Claim::new(20, w(3)),
            Claim::new(100, w(1)),
            Claim::new(100, w(2)),
        ];
        assert_eq!(fair_shares(100, &claims), [20, 27, 53]);
    }

    #[test]
    fn remainders_go_to_the_largest_fractions_then_the_earliest() {
        // 7 between weights 1, 1, 1, 1: 1.75 each; 3 spare units to the
        // first three.
        let claims = [Claim::new(100, w(1)); 4];
        assert_eq!(fair_shares(7, &claims), [2, 2, 2, 1]);
        // 10 by weights 1, 2: 3⅓ and 6⅔: the spare unit to the larger
        // fraction.
        let claims = [Claim::new(100, w(1)), Claim::new(100, w(2))];
        assert_eq!(fair_shares(10, &claims), [3, 7]);
    }

    #[test]
    fn extreme_numbers_do_not_overflow() {
        let claims = [
            Claim::new(u64::MAX, w(u32::MAX)),
            Claim::new(u64::MAX, w(1)),
            Claim::new(u64::MAX, w(u32::MAX)),
        ];
        let shares = fair_shares(u64::MAX, &claims);
        let sum: u128 = shares.iter().map(|&s| u128::from(s)).sum();
        assert_eq!(sum, u128::from(u64::MAX));
        assert_eq!(shares[0], shares[2] + 1);
    }
}
