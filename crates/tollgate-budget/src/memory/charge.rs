//! The all-or-nothing decision: every charge of a call is decided under
//! the locks of the shards it touches, and written only if all fit.

use parking_lot::MutexGuard;

use super::MemoryStore;
use super::shard::{Id, Shard};
use crate::algorithm::{self, State, Step};
use crate::decision::Answer;
use crate::{Charge, Decision, Nanos, Outcome, Policy, Receipt, Reservation, Reserved, StoreError};

/// Scratch of one call, inline for up to four charges.
type Few<T> = smallvec::SmallVec<[T; 4]>;

/// One charge of a call as decided: its slot key, the step, its policy,
/// and the sibling space its state was carried over from, if any.
struct Decided<'a> {
    id: Id,
    step: Step,
    policy: &'a Policy,
    from: Option<u32>,
}

/// Whether a key repeats among a call's charges (under one policy name).
fn repeats(steps: &[Decided<'_>]) -> bool {
    (1..steps.len()).any(|i| {
        steps[..i]
            .iter()
            .any(|d| same_budget((&d.id, d.policy), (&steps[i].id, steps[i].policy)))
    })
}

/// Whether `policy` is a token bucket that starts empty.
fn starts_empty(policy: &Policy) -> bool {
    matches!(
        policy.algorithm(),
        crate::Algorithm::TokenBucket(b) if b.initial() == crate::Initial::Empty
    )
}

/// Whether two charges spend one budget: the same key under the same
/// policy name and unit (their numbers may differ).
fn same_budget(a: (&Id, &Policy), b: (&Id, &Policy)) -> bool {
    a.0.key == b.0.key && a.1.same_budget(b.1)
}

impl MemoryStore {
    /// Charges `charges` all-or-nothing, synchronously. [`Store::charge`](crate::Store::charge)
    /// calls this; it never blocks on anything but the shard locks.
    pub fn charge_now(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        let now = inner.clock.now();
        if let [charge] = charges
            && charge.is_plain()
        {
            return self.charge_one(charge, now);
        }
        self.charge_many(charges, now)
    }

    /// Every other call: several charges, or one shaped, refundable or
    /// never fitting. Kept out of line, so that the one-charge path above
    /// does not carry this one's stack frame and saved registers.
    #[inline(never)]
    fn charge_many(&self, charges: &[Charge], now: Nanos) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        if let Some(outcome) = Outcome::never_fits(charges) {
            return Ok(outcome);
        }
        // A call has a few charges: its scratch stays on the stack.
        let ids = charges
            .iter()
            .map(|c| inner.id(c))
            .collect::<Result<Few<Id>, StoreError>>()?;
        let mut order: Few<usize> = ids.iter().map(|id| inner.shard_of(id)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Few<MutexGuard<'_, Shard>> = order.iter().map(|&i| inner.lock(i)).collect();
        for g in &mut guards {
            inner.maybe_sweep(g, now);
        }
        let guard_of = |id: &Id| order.binary_search(&inner.shard_of(id)).unwrap_or(0);

        let mut steps: Few<Decided<'_>> = Few::new();
        let mut before: Few<Option<State>> = Few::new();
        for (charge, id) in charges.iter().zip(&ids) {
            let policy = charge.policy();
            // A repeated key in one call sees the earlier charge's effect.
            let earlier = steps
                .iter()
                .rev()
                .find(|d| same_budget((&d.id, d.policy), (id, policy)) && d.step.next.is_some());
            let (state, from) = match earlier {
                Some(d) => (
                    d.step.next.and_then(|next| {
                        algorithm::carry_over(d.policy.algorithm(), next, policy.algorithm(), now)
                    }),
                    None,
                ),
                None => {
                    let first = !steps
                        .iter()
                        .any(|d| same_budget((&d.id, d.policy), (id, policy)));
                    let (state, from) = inner.state(&mut guards[guard_of(id)], id, policy, now);
                    // Only the first charge of a key moves it from a
                    // sibling space; later ones read it where it was.
                    (state, from.filter(|_| first))
                }
            };
            before.push(state);
            // Every cost fits (checked above): decided as the hot path is.
            let step = match state {
                _ if charge.is_refundable() => {
                    algorithm::reserve(policy, state, now, charge.cost())
                }
                Some(state) => algorithm::decide_fitting(policy, state, now, charge.cost()),
                None => algorithm::decide(policy, None, now, charge.cost()),
            };
            steps.push(Decided {
                id: *id,
                step,
                policy,
                from,
            });
        }
        let mut outcome = Outcome::new(steps.iter().map(|d| d.step.decision).collect());
        let mut admitted = outcome.is_admitted();
        if !admitted {
            if let Some(delayed) = shape(charges, &before, &mut steps, &outcome, now) {
                outcome = delayed;
                admitted = true;
            } else {
                outcome = unspent(charges, &before, outcome, now);
            }
        }
        // Refundable charges of an admitted call: where each was counted
        // (also in a call delayed by its shaped charges: refundable ones
        // are never shaped, and are reserved as in any other call).
        if admitted && charges.iter().any(Charge::is_refundable) {
            let windows = steps
                .iter()
                .zip(charges)
                .map(|(d, c)| match c.is_refundable() {
                    true => algorithm::receipt(d.policy, &d.step),
                    false => Receipt::NOTHING,
                })
                .collect();
            outcome = outcome.with_receipt(Receipt::new(windows));
        }
        // A refused call keeps the initially-empty buckets it found with
        // room as they stand, dated now: a client told to come back must
        // not find them forgotten (see `algorithm::as_of`).
        // (Not when a key repeats: its later charges saw effects that did
        // not land.)
        let touched: Vec<(Id, State)> = if admitted || repeats(&steps) {
            Vec::new()
        } else {
            steps
                .iter()
                .zip(&before)
                .filter(|(d, _)| {
                    d.step.decision.is_admitted() && d.from.is_none() && starts_empty(d.policy)
                })
                .filter_map(|(d, state)| Some((d.id, algorithm::as_of(d.policy, *state, now)?)))
                .collect()
        };
        // Admissions are written only together; a refusal's state (the
        // creation of an initially-empty bucket) is written regardless.
        let writes =
            |d: &Decided<'_>| d.step.next.is_some() && (admitted || !d.step.decision.is_admitted());
        // A state carried over from a sibling space and not otherwise
        // written is written as converted (it moves to its own space).
        let conversions: Vec<(Id, u32, Option<State>)> = steps
            .iter()
            .zip(&before)
            .filter(|(d, _)| !writes(d))
            .filter_map(|(d, state)| d.from.map(|from| (d.id, from, *state)))
            .collect();
        steps.retain(|d| writes(d));
        if inner.per_shard.is_some() {
            // Room for every new key of this call, counted before any is
            // written: one call must not take a shard past its cap. A key
            // that appears twice is one key; a key moving from a sibling
            // space is not a new one.
            let mut fresh: Vec<Id> = steps
                .iter()
                .filter(|d| d.from.is_none() && !guards[guard_of(&d.id)].contains(&d.id))
                .map(|d| d.id)
                .collect();
            fresh.sort_unstable_by_key(|id| (id.space, id.hash));
            fresh.dedup();
            // Every shard is checked before any is changed: a call refused
            // in one shard evicts nothing in another.
            let mut evictions = Vec::with_capacity(order.len());
            for (i, &g) in order.iter().enumerate() {
                let new_here = fresh.iter().filter(|id| inner.shard_of(id) == g).count();
                evictions.push(if new_here > 0 {
                    inner.room_for(&mut guards[i], new_here, &ids, now)?
                } else {
                    0
                });
            }
            for (guard, count) in guards.iter_mut().zip(evictions) {
                inner.evict(guard, count, &ids);
            }
        }
        for (id, from, state) in conversions {
            let shard = &mut guards[guard_of(&id)];
            inner.convert_in_place(shard, &id, from, state);
        }
        for (id, state) in touched {
            let shard = &mut guards[guard_of(&id)];
            inner.write(shard, &id, state);
        }
        for d in steps {
            if let Some(state) = d.step.next {
                let shard = &mut guards[guard_of(&d.id)];
                inner.write(shard, &d.id, state);
            }
        }
        Ok(outcome)
    }

    /// The common case, one charge: one shard lock and no scratch vectors.
    fn charge_one(&self, charge: &Charge, now: Nanos) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        let id = inner.id(charge)?;
        let (policy, cost) = (charge.policy(), charge.cost());
        let mut shard = inner.lock(inner.shard_of(&id));
        inner.maybe_sweep(&mut shard, now);
        // A key tracked in its own space is decided and written in place:
        // one probe.
        // (`charge_now` checked that the cost fits.)
        if let Some(decision) = shard.decide_in_place(&id, policy, now, cost) {
            return Ok(Outcome::one(decision));
        }
        self.charge_one_moved(shard, charge, now)
    }

    /// [`charge_one`](Self::charge_one) for a key not decided in place
    /// (new, in the wide table, or of another space). Out of line, and
    /// it works the key's id out again rather than being handed it: so
    /// the in-place path keeps the id in registers instead of storing it
    /// for this one (8 instructions a hot-key decision, against about 26
    /// more for an address key's first touch: BENCHMARKS.md, "Fourth
    /// round, the table on the final code"). A text key's digest is taken
    /// a second time here, under the shard lock, on these paths only.
    #[inline(never)]
    fn charge_one_moved(
        &self,
        mut shard: MutexGuard<'_, Shard>,
        charge: &Charge,
        now: Nanos,
    ) -> Result<Outcome, StoreError> {
        let inner = &*self.inner;
        let id = inner.id(charge)?;
        let (policy, cost) = (charge.policy(), charge.cost());
        let existed = shard.contains(&id);
        let (state, from) = inner.state(&mut shard, &id, policy, now);
        let step = algorithm::decide(policy, state, now, cost);
        match step.next {
            Some(next) => {
                let fresh = !existed && from.is_none();
                if fresh && inner.per_shard.is_some_and(|cap| shard.len() >= cap) {
                    let count = inner.room_for(&mut shard, 1, &[id], now)?;
                    inner.evict(&mut shard, count, &[id]);
                }
                if from.is_some() {
                    inner.write(&mut shard, &id, next);
                } else {
                    shard.put(&id, next, &inner.hashes);
                }
            }
            // Stored under other numbers and refused: converted once, so
            // that the change takes effect for the key now.
            None => {
                if let Some(from) = from {
                    inner.convert_in_place(&mut shard, &id, from, state);
                }
            }
        }
        Ok(Outcome::one(step.decision))
    }

    /// Gives back a delayed outcome's reservation ([`Store::cancel`](crate::Store::cancel)),
    /// synchronously: each shaped charge whose key still holds the state
    /// the reservation wrote gets the state it replaced back.
    pub fn cancel_now(&self, charges: &[Charge], reservation: &Reservation) {
        let inner = &*self.inner;
        for r in reservation.entries() {
            let Some(charge) = charges.get(r.index) else {
                continue;
            };
            let Ok(id) = inner.id(charge) else {
                continue;
            };
            let mut shard = inner.lock(inner.shard_of(&id));
            // Its own space: written under these numbers.
            if shard.read(&id) == Some(r.written) {
                match r.before {
                    Some(before) => shard.put(&id, before, &inner.hashes),
                    None => {
                        shard.remove(&id);
                    }
                }
            }
        }
    }

    /// Gives back `charges`, admitted earlier as refundable ones, with
    /// `receipt` their part of that call's receipt
    /// ([`Store::refund`](crate::Store::refund)), synchronously: each
    /// key's state (carried over to the charge's numbers, if a policy
    /// changed meanwhile) gets the cost back by [`algorithm::refund`].
    /// Charges without an entry in `receipt` are left alone.
    pub fn refund_now(&self, charges: &[Charge], receipt: &Receipt) -> Result<(), StoreError> {
        self.settle_now(charges, receipt, algorithm::refund)
    }

    /// Confirms `charges`, admitted earlier as refundable ones, with
    /// `receipt` their part of that call's receipt
    /// ([`Store::confirm`](crate::Store::confirm)), synchronously, by
    /// [`algorithm::confirm`].
    pub fn confirm_now(&self, charges: &[Charge], receipt: &Receipt) -> Result<(), StoreError> {
        self.settle_now(charges, receipt, algorithm::confirm)
    }

    fn settle_now(
        &self,
        charges: &[Charge],
        receipt: &Receipt,
        settle: fn(&Policy, Option<State>, Nanos, u64, Nanos) -> Option<State>,
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let now = inner.clock.now();
        for (charge, &window) in charges.iter().zip(receipt.windows()) {
            if window == Receipt::NOTHING {
                continue;
            }
            let id = inner.id(charge)?;
            let mut shard = inner.lock(inner.shard_of(&id));
            let (state, from) = inner.state(&mut shard, &id, charge.policy(), now);
            if from.is_some() {
                // Written under other numbers since (a plan switched, a
                // limit changed): carried over, what was reserved counts
                // as spent, and there is nothing left to settle. The key
                // stays as it is until a charge converts it, as in Redis.
                continue;
            }
            match settle(charge.policy(), state, now, charge.cost(), window) {
                back if back == state => {}
                Some(back) => inner.write(&mut shard, &id, back),
                None => {
                    shard.remove(&id);
                }
            }
        }
        Ok(())
    }

    /// What [`MemoryStore::charge_now`] would answer now, without spending
    /// or writing anything ([`Store::check`](crate::Store::check)). Each
    /// key is read under its own shard lock, so the answer is a snapshot
    /// that can be stale by the time it is acted on.
    pub fn check_now(&self, charges: &[Charge]) -> Outcome {
        if let Some(outcome) = Outcome::never_fits(charges) {
            return outcome;
        }
        let inner = &*self.inner;
        let now = inner.clock.now();
        let mut seen: Vec<(Id, State, &Policy)> = Vec::new();
        let mut before: Vec<Option<State>> = Vec::with_capacity(charges.len());
        let mut decisions = Vec::with_capacity(charges.len());
        for charge in charges {
            let policy = charge.policy();
            let Ok(id) = inner.id(charge) else {
                // Numbers this store cannot tell apart any more: a charge
                // would fail; nothing is known of the budget.
                before.push(None);
                decisions.push(Decision::unevaluated());
                continue;
            };
            // A repeated key sees the earlier charge's effect, as in a charge.
            let earlier = seen
                .iter()
                .rev()
                .find(|(other, _, p)| same_budget((other, p), (&id, policy)));
            let state = match earlier {
                Some((_, s, p)) => {
                    algorithm::carry_over(p.algorithm(), *s, policy.algorithm(), now)
                }
                None => {
                    inner
                        .state(&mut inner.lock(inner.shard_of(&id)), &id, policy, now)
                        .0
                }
            };
            let step = algorithm::decide(policy, state, now, charge.cost());
            if let Some(next) = step.next {
                seen.push((id, next, policy));
            }
            before.push(state);
            decisions.push(step.decision);
        }
        let outcome = Outcome::new(decisions);
        if outcome.is_admitted() {
            outcome
        } else {
            unspent(charges, &before, outcome, now)
        }
    }

    /// The budgets of `charges` as they stand now, without charging or
    /// writing anything: each decision is [admitted](Decision::admitted) with the
    /// units available and the time until the budget is full (the costs
    /// are not looked at). For status pages and tests; a decision made on
    /// it can be stale by the time it is acted on.
    pub fn describe(&self, charges: &[Charge]) -> Outcome {
        let inner = &*self.inner;
        let now = inner.clock.now();
        Outcome::new(
            charges
                .iter()
                .map(|c| {
                    let state = inner.id(c).ok().and_then(|id| {
                        let mut shard = inner.lock(inner.shard_of(&id));
                        inner.state(&mut shard, &id, c.policy(), now).0
                    });
                    algorithm::describe(c.policy(), state, now)
                })
                .collect(),
        )
    }
}

impl super::Inner {
    /// Writes `state`, a state carried over to `id`'s numbers from sibling
    /// space `from`, in `id`'s own space: the key is under the new
    /// numbers from now on. Nothing is spent; an idle state is dropped.
    fn convert_in_place(&self, shard: &mut Shard, id: &Id, from: u32, state: Option<State>) {
        shard.remove(&Id { space: from, ..*id });
        if let Some(s) = state {
            self.write(shard, id, s);
        }
    }
}

/// Shaping: when every charge that refused is shaped ([`Charge::shaped`])
/// and fits within its wait, the call is admitted as delayed: the release
/// time is the latest of their earliest fits, every shaped charge is
/// charged as of it ([`algorithm::charge_at`]) and the unshaped ones now.
/// `None` (the call stays refused) otherwise, or when a key repeats.
fn shape(
    charges: &[Charge],
    before: &[Option<State>],
    steps: &mut [Decided<'_>],
    refused: &Outcome,
    now: Nanos,
) -> Option<Outcome> {
    if !charges.iter().any(|c| c.max_delay().is_some()) || repeats(steps) {
        return None;
    }
    let mut release = now;
    for (i, decision) in refused.limits().iter().enumerate() {
        match decision.0 {
            Answer::Admitted { .. } => {}
            Answer::Denied { .. } => {
                let c = &charges[i];
                let fit = algorithm::earliest_fit(c.policy(), before[i], now, c.cost())?;
                let wait = u128::from(fit - now);
                if wait > c.max_delay()?.as_nanos() {
                    return None;
                }
                release = release.max(fit);
            }
            _ => return None,
        }
    }
    // Every shaped charge is held until the release: none past its own
    // longest wait (the release may be another charge's later fit).
    let wait = u128::from(release - now);
    if charges
        .iter()
        .any(|c| c.max_delay().is_some_and(|max| wait > max.as_nanos()))
    {
        return None;
    }
    let mut written = Vec::new();
    for (i, c) in charges.iter().enumerate() {
        if c.max_delay().is_some()
            && algorithm::earliest_fit(c.policy(), before[i], now, c.cost()).is_some()
        {
            let step = algorithm::charge_at(c.policy(), before[i], now, release, c.cost());
            written.push(Reserved {
                index: i,
                written: step.next?,
                before: before[i],
            });
            steps[i].step = step;
        }
    }
    let decisions = steps.iter().map(|d| d.step.decision).collect();
    Some(Outcome::delayed(
        decisions,
        std::time::Duration::from_nanos(release - now),
        Reservation::new(written),
    ))
}

/// In a refused outcome nothing was spent: admitted entries describe their
/// budget as it stands, not as it would be after the charge.
fn unspent(charges: &[Charge], before: &[Option<State>], outcome: Outcome, now: Nanos) -> Outcome {
    Outcome::new(
        outcome
            .limits()
            .iter()
            .zip(charges.iter().zip(before))
            .map(|(d, (c, s))| {
                if d.is_admitted() {
                    algorithm::describe(c.policy(), *s, now)
                } else {
                    *d
                }
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Key, ManualClock, Rate, Verdict};

    fn charge(key: &str, policy: &Policy, cost: u64) -> Charge {
        Charge::new(Key::new(policy.name()).with(key), policy.clone(), cost).unwrap()
    }

    #[test]
    fn never_fits_touches_nothing() {
        let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let o = store
            .charge_now(&[charge("a", &p, 1), charge("b", &p, 4)])
            .unwrap();
        assert_eq!(o.verdict(), Verdict::NeverFits);
        assert_eq!(store.stats().keys, 0);
    }

    /// A token bucket whose idle deadline would pass 2^64 ns stays exact
    /// (slots keep the state's time, not its deadline).
    #[test]
    fn deadlines_past_the_horizon_stay_exact() {
        let clock = ManualClock::new(2_000_000_000_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let p = Policy::token_bucket("huge", 1_800_000_000, Rate::new(1, Duration::from_secs(10)))
            .unwrap();
        let spent = store.charge_now(&[charge("k", &p, 1_700_000_000)]).unwrap();
        assert!(spent.is_admitted());
        let inner = &*store.inner;
        let id = inner.id(&charge("k", &p, 1)).unwrap();
        assert_eq!(inner.lock(inner.shard_of(&id)).counts(), (1, 0));
        let rest = store.charge_now(&[charge("k", &p, 100_000_000)]).unwrap();
        assert_eq!(rest.limits()[0].remaining(), 0);
        assert!(rest.is_admitted());
        assert!(
            !store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().keys, 1);
        // Ten seconds refill one token: admitted again, exactly once.
        clock.advance(Duration::from_secs(10));
        assert!(
            store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert!(
            !store
                .charge_now(&[charge("k", &p, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.stats().keys, 1);
    }

    /// States of one count and one time are kept in compact slots, a
    /// sliding window that counts its previous window in a wide one; one
    /// store holds both, each key once.
    #[test]
    fn compact_and_wide_entries_live_side_by_side() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder()
            .clock(clock.clone())
            .shards(1)
            .build();
        let bucket = Policy::token_bucket("b", 2, Rate::per_second(1)).unwrap();
        let fixed = Policy::fixed_window("f", 2, Duration::from_secs(1)).unwrap();
        let sliding = Policy::sliding_window("s", 2, Duration::from_secs(1)).unwrap();
        for p in [&bucket, &fixed, &sliding] {
            for _ in 0..2 {
                assert!(
                    store
                        .charge_now(&[charge("k", p, 1)])
                        .unwrap()
                        .is_admitted()
                );
            }
            assert!(
                !store
                    .charge_now(&[charge("k", p, 1)])
                    .unwrap()
                    .is_admitted()
            );
        }
        // All three are one count and one time so far.
        assert_eq!(store.inner.lock(0).counts(), (3, 0));
        // Half a window into the next window, the sliding window counts
        // its previous window too: its state moves to a wide slot; the
        // bucket stays compact (the fixed window is over, swept by this
        // access).
        clock.advance(Duration::from_millis(1500));
        assert!(
            store
                .charge_now(&[charge("k", &sliding, 1)])
                .unwrap()
                .is_admitted()
        );
        assert_eq!(store.inner.lock(0).counts(), (1, 1));
        assert_eq!(store.stats().keys, 2);
        clock.advance(Duration::from_secs(2));
        store.sweep();
        assert_eq!(store.stats().keys, 0);
    }

    #[test]
    fn repeated_key_in_one_call_sees_its_own_charge() {
        let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let p = Policy::token_bucket("p", 3, Rate::per_second(2)).unwrap();
        let o = store
            .charge_now(&[charge("a", &p, 2), charge("a", &p, 2)])
            .unwrap();
        assert!(!o.is_admitted());
        assert!(
            store
                .charge_now(&[charge("a", &p, 3)])
                .unwrap()
                .is_admitted()
        );
    }

    /// An idle state decides like no state, whether or not a sweep removed
    /// it (a sliding window two windows on used to stay on its old grid
    /// unless swept), and `check_now` answers what the next charge answers.
    #[test]
    fn idle_state_decides_like_no_state_and_check_matches_charge() {
        let clock = ManualClock::new(0);
        let never_swept = MemoryStore::builder()
            .clock(clock.clone())
            .sweep_interval(Duration::from_secs(1 << 30))
            .build();
        let swept = MemoryStore::builder()
            .clock(clock.clone())
            .sweep_interval(Duration::ZERO)
            .build();
        let policies = [
            Policy::sliding_window("sw", 4, Duration::from_secs(10)).unwrap(),
            Policy::fixed_window("fw", 4, Duration::from_secs(10)).unwrap(),
            Policy::token_bucket("tb", 4, Rate::per_second(1)).unwrap(),
        ];
        let mut t = 0u64;
        for step in 0..300u64 {
            t += [1, 3, 7, 25, 33][(step % 5) as usize] * 1_000_000_000 / 2;
            clock.set(t);
            let p = &policies[(step % 3) as usize];
            let c = [charge("k", p, 1 + step % 3)];
            let checked = never_swept.check_now(&c);
            let a = never_swept.charge_now(&c).unwrap();
            let b = swept.charge_now(&c).unwrap();
            assert_eq!(a, b, "step {step}, {}", p.name());
            assert_eq!(checked, a, "step {step}, {}", p.name());
        }
    }
}

#[cfg(test)]
mod shaping_tests {
    use std::time::Duration;

    use super::*;
    use crate::{Key, ManualClock, Rate, Verdict};

    const MS: u64 = 1_000_000;

    fn shaped(policy: &Policy) -> Charge {
        Charge::new(Key::new("k"), policy.clone(), 1)
            .unwrap()
            .shaped(Duration::from_secs(2))
    }

    /// Review finding: with two shaping rules, the release (the later of
    /// their fits) held the request past the other rule's own longest
    /// wait. Every shaped charge is held at most its own `max_delay`.
    #[test]
    fn no_shaped_charge_is_held_past_its_own_longest_wait() {
        let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
        let quick = Policy::token_bucket("quick", 1, Rate::per_second(2)).unwrap();
        let slow = Policy::token_bucket("slow", 1, Rate::new(1, Duration::from_secs(4))).unwrap();
        let call = |quick_wait: u64| {
            [
                Charge::new(Key::new("k"), quick.clone(), 1)
                    .unwrap()
                    .shaped(Duration::from_secs(quick_wait)),
                Charge::new(Key::new("k"), slow.clone(), 1)
                    .unwrap()
                    .shaped(Duration::from_secs(10)),
            ]
        };
        assert_eq!(store.charge_now(&call(1)).unwrap().delay(), Duration::ZERO);
        // Quick fits in 0.5 s, slow in 4 s: quick would wait 4 s > 1 s.
        let refused = store.charge_now(&call(1)).unwrap();
        assert_eq!(
            refused.verdict(),
            Verdict::Denied {
                retry_after: Duration::from_secs(4)
            }
        );
        // Allowed to wait 5 s, it is held 4 s.
        assert_eq!(
            store.charge_now(&call(5)).unwrap().delay(),
            Duration::from_secs(4)
        );
    }

    /// Review finding: a request held by another rule's later fit and then
    /// dropped gave its first rule back only its cost, not the refill the
    /// reservation had taken with it, so later callers waited for nothing.
    /// A dropped last-in-line request leaves every budget as if it had
    /// never come.
    #[test]
    fn a_dropped_waiter_leaves_its_budgets_as_if_it_never_came() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let quick = Policy::token_bucket("quick", 1, Rate::per_second(2)).unwrap();
        let slow = Policy::token_bucket("slow", 1, Rate::new(1, Duration::from_secs(4))).unwrap();
        let call = [
            Charge::new(Key::new("k"), quick.clone(), 1)
                .unwrap()
                .shaped(Duration::from_secs(10)),
            Charge::new(Key::new("k"), slow.clone(), 1)
                .unwrap()
                .shaped(Duration::from_secs(10)),
        ];
        assert_eq!(store.charge_now(&call).unwrap().delay(), Duration::ZERO);
        let held = store.charge_now(&call).unwrap();
        assert_eq!(held.delay(), Duration::from_secs(4));
        store.cancel_now(&call, held.reservation().unwrap());
        // Quick refilled its one token 0.5 s after the first request.
        clock.set(600 * MS);
        let alone = [Charge::new(Key::new("k"), quick.clone(), 1).unwrap()];
        assert!(store.charge_now(&alone).unwrap().is_admitted());
        // Slow is as the first request left it: empty until 4 s.
        let slow_alone = [Charge::new(Key::new("k"), slow.clone(), 1).unwrap()];
        assert_eq!(
            store.charge_now(&slow_alone).unwrap().verdict(),
            Verdict::Denied {
                retry_after: Duration::from_millis(3400)
            }
        );
        // A key that had no state before its reservation has none again.
        let empty = Policy::token_bucket("empty", 1, Rate::per_second(1))
            .unwrap()
            .with_initial(crate::Initial::Empty);
        let fresh = [Charge::new(Key::new("fresh"), empty, 1)
            .unwrap()
            .shaped(Duration::from_secs(10))];
        let keys = store.stats().keys;
        let first = store.charge_now(&fresh).unwrap();
        assert_eq!(first.delay(), Duration::from_secs(1));
        assert_eq!(store.stats().keys, keys + 1);
        store.cancel_now(&fresh, first.reservation().unwrap());
        assert_eq!(store.stats().keys, keys);
    }

    /// A bucket of 1 refilling 2 per second, shaped up to 2 s: a burst of
    /// six is released 0, 0.5, 1, 1.5 and 2 s from now, and the sixth is
    /// refused with the exact wait. Dropping the last one gives its
    /// reservation back; dropping one with others behind it does not.
    #[test]
    fn shaped_charges_are_released_at_the_instant_they_fit() {
        let clock = ManualClock::new(0);
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let p = Policy::token_bucket("p", 1, Rate::per_second(2)).unwrap();
        let mut delays = Vec::new();
        let mut last = None;
        for _ in 0..5 {
            let o = store.charge_now(&[shaped(&p)]).unwrap();
            assert!(o.is_admitted(), "{o:?}");
            delays.push(o.delay().as_millis());
            last = o.reservation().cloned();
        }
        assert_eq!(delays, [0, 500, 1000, 1500, 2000]);
        let sixth = store.charge_now(&[shaped(&p)]).unwrap();
        assert_eq!(
            sixth.verdict(),
            Verdict::Denied {
                retry_after: Duration::from_millis(2500)
            }
        );
        // The last in line is given back: the next one takes its place.
        store.cancel_now(&[shaped(&p)], &last.unwrap());
        let again = store.charge_now(&[shaped(&p)]).unwrap();
        assert_eq!(again.delay(), Duration::from_millis(2000));
        // Time passes; an unshaped charge waits behind the reservations.
        clock.set(1_000 * MS);
        let plain = Charge::new(Key::new("k"), p.clone(), 1).unwrap();
        assert_eq!(
            store.charge_now(&[plain]).unwrap().verdict(),
            Verdict::Denied {
                retry_after: Duration::from_millis(1500)
            }
        );
    }
}
