//! The decision scripts' calls: charges encoded as their arguments
//! ([`Prepared`], [`params`]) and their replies decoded.

use std::time::Duration;

use redis::{Script, ScriptInvocation};
use tollgate_budget::{
    Algorithm, Charge, Decision, Initial, Nanos, Policy, StoreError, StoreErrorKind,
};

use crate::lua::{self, EPOCH_UNIX_SECS, ERA_NS, EXACT, MAX_HORIZON_NS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Charge,
    /// Decide without writing anything.
    Check,
    /// Give back reserved admissions ([`Store::refund`](tollgate_budget::Store::refund)).
    Refund,
    /// Undo a call charged slot by slot and refused: plain admissions
    /// given back at once (a window of (0, 0)), reserved ones as by
    /// `Refund`. Only the store sends it, with the windows its own charge
    /// reported: a receipt never takes this path.
    Undo,
    /// Settle reserved admissions as counted
    /// ([`Store::confirm`](tollgate_budget::Store::confirm)).
    Confirm,
    /// Give back a delayed call's reservations.
    Cancel,
}

/// The seven script arguments of one charge (the last one, the window of a
/// refund, is filled in later).
pub(crate) fn params(policy: &Policy, cost: u64) -> Result<[u128; 6], StoreError> {
    let unsupported = |why: String| {
        StoreError::new(
            StoreErrorKind::Unsupported,
            format!(
                "policy {:?} cannot be decided exactly in Redis: {why}",
                policy.name()
            ),
        )
    };
    let cost = u128::from(cost);
    match *policy.algorithm() {
        Algorithm::TokenBucket(b) => {
            let (capacity, initial) = (b.capacity(), b.initial());
            let (num, den) = (
                u128::from(b.units_per_nanosecond()),
                u128::from(b.units_per_token()),
            );
            let cap = u128::from(capacity) * den;
            if cap + num >= EXACT {
                return Err(unsupported(format!(
                    "capacity {capacity} in scaled units ({cap}) plus the refill per \
                     nanosecond ({num}) is not below 2^53"
                )));
            }
            if cap.div_ceil(num) > MAX_HORIZON_NS {
                return Err(unsupported(format!(
                    "refilling from empty takes {:?}, over the {:?} limit",
                    Duration::from_nanos(u64::try_from(cap.div_ceil(num)).unwrap_or(u64::MAX)),
                    Duration::from_nanos(MAX_HORIZON_NS as u64)
                )));
            }
            let full = u128::from(initial == Initial::Full);
            Ok([1, cap, num, den, full, cost * den])
        }
        Algorithm::FixedWindow(w) => {
            let (limit, window) = (w.limit(), w.nanos());
            if u128::from(window) > MAX_HORIZON_NS || u128::from(limit) >= EXACT {
                return Err(unsupported(format!(
                    "window {window} ns or limit {limit} out of range"
                )));
            }
            Ok([2, u128::from(limit), u128::from(window), 0, 0, cost])
        }
        Algorithm::SlidingWindow(sw) => {
            let (limit, window) = (sw.limit(), sw.nanos());
            let (l, w) = (u128::from(limit), u128::from(window));
            if 2 * w > MAX_HORIZON_NS || 3 * l * w >= EXACT {
                return Err(unsupported(format!(
                    "limit x window = {limit} x {window} ns must stay below 2^53 / 3"
                )));
            }
            Ok([3, l, w, 0, 0, cost])
        }
    }
}

/// Charges encoded for one script call.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    keys: Vec<String>,
    params: Vec<[u128; 6]>,
    /// Per charge, the window (era, offset) a refund gives back to.
    windows: Vec<(i64, i64)>,
    /// Arguments after the charges' own (a cancel's replaced states).
    tail: Vec<[u8; 64]>,
}

/// One charge's script argument: its six parameters and the refund window
/// as eight little-endian doubles. Every value is an integer below 2^53
/// ([`params`] refuses policies otherwise), so the doubles are exact.
fn packed(params: &[u128; 6], window: (i64, i64)) -> [u8; 64] {
    let mut out = [0u8; 64];
    let values = params
        .iter()
        .map(|&v| v as f64)
        .chain([window.0 as f64, window.1 as f64]);
    for (slot, v) in out.chunks_exact_mut(8).zip(values) {
        slot.copy_from_slice(&v.to_le_bytes());
    }
    out
}

impl Prepared {
    pub(crate) fn new<'a>(
        items: impl Iterator<Item = (&'a String, &'a Charge)>,
    ) -> Result<Self, StoreError> {
        let mut p = Prepared {
            keys: Vec::new(),
            params: Vec::new(),
            windows: Vec::new(),
            tail: Vec::new(),
        };
        for (key, charge) in items {
            p.keys.push(key.clone());
            p.params.push(params(charge.policy(), charge.cost())?);
            p.windows.push((0, 0));
        }
        Ok(p)
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether this is the call the one-bucket script decides: one
    /// token-bucket charge of a bucket that starts full, not shaped (it
    /// hands back to the full script whatever its key's state needs more).
    pub(crate) fn is_one_bucket(&self) -> bool {
        matches!(
            (&self.params[..], &self.windows[..]),
            ([[1, _, _, _, 1, _]], [(0, 0)])
        ) && self.tail.is_empty()
    }

    /// The one-bucket script's call: the key, the charge packed as for the
    /// full script, and injected time if any.
    pub(crate) fn one_bucket_invocation<'s>(
        &self,
        script: &'s Script,
        now: Option<Nanos>,
    ) -> ScriptInvocation<'s> {
        let mut inv = script.prepare_invoke();
        inv.key(&self.keys[0]);
        inv.arg(&packed(&self.params[0], self.windows[0])[..]);
        if let Some(t) = now {
            inv.arg(t / 1_000_000_000).arg(t % 1_000_000_000);
        }
        inv
    }

    /// The same call as [`Prepared::one_bucket_invocation`], as an `EVAL`.
    pub(crate) fn one_bucket_eval(&self, now: Option<Nanos>) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(lua::one_bucket_source()).arg(1).arg(&self.keys[0]);
        cmd.arg(&packed(&self.params[0], self.windows[0])[..]);
        if let Some(t) = now {
            cmd.arg(t / 1_000_000_000).arg(t % 1_000_000_000);
        }
        cmd
    }

    /// The same charges, with each shaped one's longest wait
    /// ([`Charge::shaped`]) for the script to shape by (when `shaping`),
    /// and each refundable one marked to be reserved
    /// ([`Charge::refundable`]).
    pub(crate) fn shaping<'a>(
        mut self,
        charges: impl Iterator<Item = &'a Charge>,
        shaping: bool,
    ) -> Self {
        for (w, charge) in self.windows.iter_mut().zip(charges) {
            if let (Some(wait), true) = (charge.max_delay(), shaping) {
                // Waits beyond the horizon are the horizon: exact below 2^53.
                let ns = wait.as_nanos().min(MAX_HORIZON_NS);
                w.0 = i64::try_from(ns).unwrap_or(0);
            }
            if charge.is_refundable() {
                w.1 = 1;
            }
        }
        self
    }

    /// A cancel call for the reservation's shaped charges: each written
    /// state's level and prior ride in the fifth and sixth numbers, its time
    /// in the window; the state it replaced follows all the charges.
    pub(crate) fn cancel<'a>(
        items: impl Iterator<Item = (&'a String, &'a Charge, tollgate_budget::Reserved)>,
    ) -> Result<Self, StoreError> {
        let mut p = Prepared {
            keys: Vec::new(),
            params: Vec::new(),
            windows: Vec::new(),
            tail: Vec::new(),
        };
        for (key, charge, reserved) in items {
            let mut params = params(charge.policy(), charge.cost())?;
            params[4] = u128::from(reserved.written.level);
            params[5] = u128::from(reserved.written.prior);
            p.keys.push(key.clone());
            p.params.push(params);
            p.windows.push(era_offset(reserved.written.at));
            p.tail.push(match reserved.before {
                Some(b) => {
                    let (era, offset) = era_offset(b.at);
                    packed(
                        &[
                            1,
                            u128::from(b.level),
                            u128::from(b.prior),
                            era as u128,
                            offset as u128,
                            0,
                        ],
                        (0, 0),
                    )
                }
                None => packed(&[0; 6], (0, 0)),
            });
        }
        Ok(p)
    }

    /// The same charges, to be refunded against `windows` (a receipt's,
    /// in the store's time: nanoseconds since its epoch).
    pub(crate) fn with_receipt(mut self, windows: &[Nanos]) -> Self {
        for (w, &at) in self.windows.iter_mut().zip(windows) {
            *w = era_offset(at);
        }
        self
    }

    /// The same charges, to be refunded against the windows `reply` reported.
    pub(crate) fn with_windows(mut self, reply: &[i64]) -> Self {
        for (i, w) in self.windows.iter_mut().enumerate() {
            *w = (reply[i * REPLY + 4], reply[i * REPLY + 5]);
        }
        self
    }

    /// The same call as [`Prepared::invocation`], as an `EVAL` that
    /// carries the script itself.
    pub(crate) fn eval(&self, now: Option<Nanos>, mode: Mode) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(lua::decide_source()).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        self.args(&mut cmd, now, mode);
        cmd
    }

    pub(crate) fn invocation<'s>(
        &self,
        script: &'s Script,
        now: Option<Nanos>,
        mode: Mode,
    ) -> ScriptInvocation<'s> {
        let mut inv = script.prepare_invoke();
        for k in &self.keys {
            inv.key(k);
        }
        let mut args = redis::Cmd::new();
        self.args(&mut args, now, mode);
        for arg in args.args_iter() {
            if let redis::Arg::Simple(bytes) = arg {
                inv.arg(bytes);
            }
        }
        inv
    }

    /// The script's arguments: the time source, the epoch, the mode and
    /// each charge packed.
    fn args(&self, cmd: &mut redis::Cmd, now: Option<Nanos>, mode: Mode) {
        match now {
            None => cmd.arg("s").arg(0).arg(0),
            Some(t) => cmd.arg("i").arg(t / 1_000_000_000).arg(t % 1_000_000_000),
        };
        cmd.arg(EPOCH_UNIX_SECS);
        cmd.arg(match mode {
            Mode::Charge => "charge",
            Mode::Check => "check",
            Mode::Refund => "refund",
            Mode::Undo => "undo",
            Mode::Confirm => "confirm",
            Mode::Cancel => "cancel",
        });
        for (p, w) in self.params.iter().zip(&self.windows) {
            cmd.arg(&packed(p, *w)[..]);
        }
        for t in &self.tail {
            cmd.arg(&t[..]);
        }
    }
}

/// A time in the script's (era, offset) form.
fn era_offset(at: Nanos) -> (i64, i64) {
    let era = at / ERA_NS;
    (
        i64::try_from(era).unwrap_or(i64::MAX),
        i64::try_from(at - era * ERA_NS).unwrap_or(0),
    )
}

/// Reply values per charge.
pub(crate) const REPLY: usize = 8;

/// The [`REPLY`] values of the `slot`-th charge of a call.
pub(crate) fn values(reply: &[i64], slot: usize) -> &[i64] {
    &reply[slot * REPLY..(slot + 1) * REPLY]
}

/// Where an admitted charge was counted (its window's start), from its
/// [`REPLY`] values, in nanoseconds since the store's epoch.
pub(crate) fn window(values: &[i64]) -> Nanos {
    let n = |i: usize| u64::try_from(values[i]).unwrap_or(0);
    n(4).saturating_mul(ERA_NS).saturating_add(n(5))
}

/// A shaped charge's reservation from its reply values in a delayed call:
/// the call's delay and the state the script wrote, in the store's time
/// (nanoseconds since its epoch, or the injected clock's).
pub(crate) fn reserved(values: &[i64]) -> Option<(Duration, tollgate_budget::algorithm::State)> {
    if values[0] != 2 {
        return None;
    }
    let n = |i: usize| u64::try_from(values[i]).unwrap_or(0);
    Some((
        Duration::from_nanos(n(3)),
        tollgate_budget::algorithm::State {
            level: n(6),
            prior: n(7),
            at: n(4).saturating_mul(ERA_NS).saturating_add(n(5)),
            ..tollgate_budget::algorithm::State::default()
        },
    ))
}

/// Reply values per shaped charge after every charge's own, in a delayed
/// call: the state its reservation replaced.
pub(crate) const REPLACED: usize = 5;

/// The state a reservation replaced, from its [`REPLACED`] reply values.
pub(crate) fn replaced(values: &[i64]) -> Option<tollgate_budget::algorithm::State> {
    let n = |i: usize| u64::try_from(values[i]).unwrap_or(0);
    (values[0] == 1).then(|| tollgate_budget::algorithm::State {
        level: n(1),
        prior: n(2),
        at: n(3).saturating_mul(ERA_NS).saturating_add(n(4)),
        ..tollgate_budget::algorithm::State::default()
    })
}

/// One charge's decision from its reply values: as charged, and the
/// budget as it stood before the charge (for a call refused as a whole).
pub(crate) fn decision(values: &[i64], policy: &Policy) -> (Decision, Decision) {
    let n = |i: usize| u64::try_from(values[i]).unwrap_or(0);
    let remaining = n(1).min(policy.capacity());
    let reset = Duration::from_nanos(n(2));
    let charged = if values[0] == 1 || values[0] == 2 {
        Decision::admitted(remaining, reset)
    } else {
        Decision::denied(Duration::from_nanos(n(3)), remaining, reset)
    };
    let before = Decision::admitted(n(6).min(policy.capacity()), Duration::from_nanos(n(7)));
    (charged, before)
}

/// The one-bucket script's decision from its reply, little-endian doubles:
/// `Ok(None)` when it handed the call to the full script (an empty reply),
/// an error for a reply of any other length.
pub(crate) fn one_bucket_decision(
    reply: &[u8],
    policy: &Policy,
) -> Result<Option<Decision>, StoreError> {
    let value = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&reply[i * 8..i * 8 + 8]);
        // Integers below 2^53: exact, and never negative.
        f64::from_le_bytes(b) as u64
    };
    match reply.len() {
        0 => Ok(None),
        16 => Ok(Some(Decision::admitted(
            value(0).min(policy.capacity()),
            Duration::from_nanos(value(1)),
        ))),
        24 => Ok(Some(Decision::denied(
            Duration::from_nanos(value(2)),
            value(0).min(policy.capacity()),
            Duration::from_nanos(value(1)),
        ))),
        n => Err(StoreError::new(
            StoreErrorKind::Protocol,
            format!("the one-bucket script returned {n} bytes"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_budget::Rate;

    #[test]
    fn out_of_range_policies_are_refused_with_the_reason() {
        let huge = Policy::token_bucket("big", 1 << 30, Rate::per_second(1)).unwrap();
        let e = params(&huge, 1).unwrap_err();
        assert_eq!(e.kind(), StoreErrorKind::Unsupported);
        assert!(e.to_string().contains("2^53"), "{e}");
        let slow =
            Policy::token_bucket("slow", 100, Rate::new(1, Duration::from_secs(86_400))).unwrap();
        assert!(
            params(&slow, 1)
                .unwrap_err()
                .to_string()
                .contains("refilling from empty takes")
        );
        assert!(
            params(
                &Policy::token_bucket("ok", 3, Rate::per_second(2)).unwrap(),
                1
            )
            .is_ok()
        );
    }
}
