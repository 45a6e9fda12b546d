//! [`Divisor`]: division by a number fixed when a policy is made, by a
//! multiplication and shifts instead of a division instruction (which
//! takes tens of cycles and would be most of a decision's arithmetic).
//!
//! The method is Granlund and Montgomery's ("Division by invariant
//! integers using multiplication", PLDI 1994, figure 4.1): for a divisor
//! `d` with `2^(l-1) < d <= 2^l`, the magic number
//! `m = floor(2^64 (2^l - d) / d) + 1` gives, with `t = (m n) >> 64`,
//! `n / d = (t + ((n - t) >> 1)) >> (l - 1)` for every 64-bit `n`
//! (shifts of 0 for `l = 0`). Exact: the tests compare it with `/`.

/// A 64-bit divisor prepared for exact division by multiplication.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Divisor {
    d: u64,
    magic: u64,
    shift1: u8,
    shift2: u8,
}

impl Divisor {
    /// Prepares `d` (at least 1).
    pub(crate) const fn new(d: u64) -> Self {
        assert!(d > 0, "a divisor is at least 1");
        // l = ceil(log2 d): 0 for 1, 64 above 2^63.
        let l = if d == 1 {
            0
        } else {
            64 - (d - 1).leading_zeros()
        };
        let excess = (1u128 << l) - d as u128;
        let magic = ((excess << 64) / d as u128 + 1) as u64;
        Self {
            d,
            magic,
            shift1: if l == 0 { 0 } else { 1 },
            shift2: if l == 0 { 0 } else { (l - 1) as u8 },
        }
    }

    /// `n / d`, rounded down.
    #[inline(always)]
    pub(crate) const fn div(self, n: u64) -> u64 {
        let t = ((self.magic as u128 * n as u128) >> 64) as u64;
        (t + ((n - t) >> self.shift1)) >> self.shift2
    }

    /// `n / d`, rounded up.
    #[inline(always)]
    pub(crate) const fn div_ceil(self, n: u64) -> u64 {
        let q = self.div(n);
        q + (n - q * self.d != 0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::Divisor;
    use proptest::prelude::*;

    fn check(d: u64, n: u64) {
        let v = Divisor::new(d);
        assert_eq!(v.div(n), n / d, "{n} / {d}");
        assert_eq!(v.div_ceil(n), n.div_ceil(d), "{n} / {d} rounded up");
    }

    /// Where a magic number is most likely wrong: around powers of two,
    /// the largest divisors and numerators, and each divisor's multiples.
    #[test]
    fn edges_divide_exactly() {
        let mut divisors = vec![1, 2, 3, 5, 7, 10, 1_000_000_000, 3_600_000_000_000];
        for k in 1..64 {
            let p = 1u64 << k;
            divisors.extend([p - 1, p, p + 1]);
        }
        divisors.extend([u64::MAX, u64::MAX - 1, (1 << 63) + 1]);
        for &d in &divisors {
            for n in [0, 1, d - 1, d, d.saturating_add(1), u64::MAX, u64::MAX - 1] {
                check(d, n);
            }
            let top = u64::MAX / d * d;
            for n in [top, top - 1, top.saturating_add(1), top / 2, top / 2 + 1] {
                check(d, n);
            }
        }
    }

    proptest! {
        #[test]
        fn divides_as_the_instruction_does(d in 1u64.., n: u64, bits in 1u32..=64) {
            // Divisors of every size, not only the large ones a uniform
            // draw gives.
            let d = (d >> (64 - bits)).max(1);
            check(d, n);
            check(d, n / d * d);
        }
    }
}
