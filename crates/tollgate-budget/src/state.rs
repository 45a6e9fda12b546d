//! [`State`]: what a store keeps per key (its own module, so that the
//! decisions and the algorithms both name it without importing each
//! other).

use crate::Nanos;

/// The stored state of one key. Its meaning depends on the algorithm:
///
/// | algorithm      | `level`                        | `prior`                  | `at`                    |
/// |----------------|--------------------------------|--------------------------|-------------------------|
/// | token bucket   | credit in `1/denominator` units | a hold, see below        | time of that credit     |
/// | fixed window   | admitted cost in the window    | 0                        | window start            |
/// | sliding window | admitted cost, current window  | admitted cost, previous  | current window's start  |
///
/// A token bucket's `prior` says whether a request is held for later
/// (shaping, [`charge_at`](crate::algorithm::charge_at)) and until when: 0 when none is, else 1 plus
/// how long after `at` the last held request is released. Every write of
/// the bucket keeps it until then, so that no conversion to other numbers
/// ([`carry_over`](crate::algorithm::carry_over)) can release new requests alongside the held ones.
///
/// A token bucket's reserved units are charges made to be settled later
/// ([`reserve`](crate::algorithm::reserve): a charge kept only for some outcomes), already taken
/// from `level`, not yet confirmed ([`confirm`](crate::algorithm::confirm)) or given back
/// ([`refund`](crate::algorithm::refund)). Until they are, the bucket refills to its capacity less
/// them, so that giving them back never returns units the capacity has
/// cut off meanwhile. Time is cut into epochs of [`MAX_RESERVATION`](crate::algorithm::MAX_RESERVATION)
/// (from the clock's origin): `reserved` counts the units reserved in
/// epoch `epoch`, `reserved_earlier` those of the epoch before, and each
/// epoch's units lapse, as confirmed, when the epoch after it ends (one to
/// two epochs after their charge), however many are reserved later. Zero
/// for every other state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct State {
    /// See the table above.
    pub level: u64,
    /// See the table above.
    pub prior: u64,
    /// See the table above.
    pub at: Nanos,
    /// A token bucket's units reserved in epoch `epoch` and not yet
    /// settled, in `1/denominator` units (see above).
    pub reserved: u64,
    /// Those reserved in the epoch before `epoch`.
    pub reserved_earlier: u64,
    /// The epoch `reserved` was counted in (its start over
    /// [`MAX_RESERVATION`](crate::algorithm::MAX_RESERVATION)).
    pub epoch: u64,
}
