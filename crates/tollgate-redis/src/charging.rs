//! Charging, checking, refunding and cancelling: a call's charges grouped
//! by slot, each group one script, refunds after a cross-slot refusal, and
//! the over-limit cache consulted and fed.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tollgate_budget::algorithm::State;
use tollgate_budget::{
    Charge, Decision, Nanos, Outcome, Receipt, Reservation, Reserved, StoreError,
};

use crate::keys;
use crate::script::{self, Mode, Prepared};
use crate::store::RedisStore;

impl RedisStore {
    /// The Redis keys of `charges`, in order.
    fn keys_of(&self, charges: &[Charge]) -> Vec<String> {
        charges.iter().map(|c| self.redis_key(c)).collect()
    }

    /// The indices of `keys` grouped for one script each: by cluster slot
    /// when the store charges slot by slot, else all in one group.
    fn groups(&self, keys: &[String]) -> Vec<Vec<usize>> {
        if self.inner.split {
            keys::slot_groups(keys)
        } else {
            vec![(0..keys.len()).collect()]
        }
    }

    /// The answer that needs no round trip, if there is one: a charge that
    /// can never fit (nothing is read or written), or a refusal the
    /// over-limit cache still holds. Also gives back the Redis keys.
    /// `asking`: the caller asks Redis when this answers nothing, so it may
    /// take the probe of a bucket whose deadline has passed.
    pub(crate) fn local_answer(
        &self,
        charges: &[Charge],
        asking: bool,
    ) -> (Option<Outcome>, Vec<String>) {
        if let Some(outcome) = Outcome::never_fits(charges) {
            return (Some(outcome), Vec::new());
        }
        let keys = self.keys_of(charges);
        // A remembered denial says when the cost fits, not whether a
        // shaped charge would wait for it: shaped calls always ask Redis.
        let shaped = charges.iter().any(|c| c.max_delay().is_some());
        let cached = match &self.inner.cache {
            Some(cache) if !shaped => cache.refuse(&keys, charges, asking),
            _ => None,
        };
        (cached, keys)
    }

    pub(crate) async fn charge_all(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        let keys = match self.local_answer(charges, true) {
            (Some(outcome), _) => return Ok(outcome),
            (None, keys) => keys,
        };
        // One time limit for the whole decision, however many slot groups
        // it takes (and refunds and reads after a refusal).
        let deadline = self.deadline();
        let groups = self.groups(&keys);
        // Every group is encoded before the first is sent: a policy Redis
        // cannot hold must refuse the whole call, not a later group after
        // earlier ones were charged.
        let prepared: Vec<Prepared> = groups
            .iter()
            .map(|group| Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i]))))
            .collect::<Result<_, _>>()?;
        // Shaping needs one atomic decision: a call spread over slots is
        // decided unshaped. Refundable charges are reserved either way.
        let shaping = prepared.len() == 1;
        let prepared: Vec<Prepared> = groups
            .iter()
            .zip(prepared)
            .map(|(group, p)| p.shaping(group.iter().map(|&i| &charges[i]), shaping))
            .collect();
        // Refundable charges get a receipt: where each was counted.
        let refundable = charges.iter().any(Charge::is_refundable);
        if let [one] = &prepared[..]
            && one.is_one_bucket()
            && let Some(outcome) = self
                .charge_one_bucket(one, &keys[0], &charges[0], deadline)
                .await?
        {
            // (Refundable charges are reserved: never this script.)
            return Ok(outcome);
        }
        let mut decisions = vec![Decision::unevaluated(); charges.len()];
        let mut before = vec![Decision::unevaluated(); charges.len()];
        let mut windows = vec![0; charges.len()];
        let mut admitted: Vec<(Prepared, Vec<i64>)> = Vec::new();
        let mut groups = groups.into_iter().zip(prepared);
        while let Some((group, prepared)) = groups.next() {
            let sent = Instant::now();
            let reply = match self.invoke(&prepared, Mode::Charge, deadline).await {
                Ok(reply) => reply,
                Err(e) => {
                    self.refund(admitted, deadline).await;
                    return Err(e);
                }
            };
            let mut all = true;
            for (slot, &i) in group.iter().enumerate() {
                let values = script::values(&reply, slot);
                let (d, b) = script::decision(values, charges[i].policy());
                // A key charged again in the same call was decided against
                // the earlier charge's unwritten effect: that refusal is not
                // what Redis would answer for the charge alone, so only a
                // key's first charge is remembered.
                let first = !keys[..i].contains(&keys[i]);
                // With slots charged one by one, another call's charge may be
                // refunded a moment after this refusal saw it: a refusal is
                // then not a lasting fact, and is not remembered.
                let shaped = charges[i].max_delay().is_some();
                if let (Some(cache), true, false, false) =
                    (&self.inner.cache, first, self.inner.split, shaped)
                {
                    cache.remember(&keys[i], &charges[i], sent, d);
                }
                all &= d.is_admitted();
                decisions[i] = d;
                before[i] = b;
                windows[i] = match charges[i].is_refundable() {
                    true => script::window(values),
                    false => Receipt::NOTHING,
                };
            }
            if shaping {
                let reserved: Vec<(usize, (Duration, State))> = group
                    .iter()
                    .enumerate()
                    .filter_map(|(slot, &i)| {
                        script::reserved(script::values(&reply, slot)).map(|r| (i, r))
                    })
                    .collect();
                if let Some(&(_, (delay, _))) = reserved.first() {
                    // The replaced states follow every charge's values, in
                    // the same order.
                    let tail = reply[group.len() * script::REPLY..].chunks(script::REPLACED);
                    let entries = reserved
                        .into_iter()
                        .zip(tail.map(script::replaced).chain(std::iter::repeat(None)))
                        .map(|((index, (_, written)), before)| Reserved {
                            index,
                            written,
                            before,
                        })
                        .collect();
                    let outcome = Outcome::delayed(decisions, delay, Reservation::new(entries));
                    // Refundable charges (never shaped) are reserved in a
                    // delayed call as in any other.
                    if refundable {
                        return Ok(outcome.with_receipt(Receipt::new(windows)));
                    }
                    return Ok(outcome);
                }
            }
            if all {
                // Admitted: a bucket left without room for the same cost
                // again is known exhausted until it has it (not charging
                // slot by slot, where a refund could add credit back).
                if let (Some(cache), false) = (&self.inner.cache, self.inner.split) {
                    let answered = Instant::now();
                    for &i in &group {
                        if !keys[..i].contains(&keys[i]) && charges[i].max_delay().is_none() {
                            cache.remember_spent(&keys[i], &charges[i], answered, decisions[i]);
                        }
                    }
                }
                admitted.push((prepared, reply));
            } else {
                self.refund(admitted, deadline).await;
                // The slots not charged yet are read without writing, so
                // that every limit is described as in a single script.
                for (group, prepared) in groups {
                    let Ok(reply) = self.invoke(&prepared, Mode::Check, deadline).await else {
                        continue;
                    };
                    read_group(&reply, &group, charges, &mut decisions, &mut before);
                }
                describe_as_one_call(&mut decisions, before);
                return Ok(Outcome::new(decisions));
            }
        }
        let outcome = Outcome::new(decisions);
        if refundable {
            return Ok(outcome.with_receipt(Receipt::new(windows)));
        }
        Ok(outcome)
    }

    /// The common call decided by the one-bucket script; `None` when it
    /// handed the call to the full script (having written nothing).
    async fn charge_one_bucket(
        &self,
        prepared: &Prepared,
        key: &str,
        charge: &Charge,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Outcome>, StoreError> {
        let inner = &*self.inner;
        let now = self.injected_now();
        let invocation = prepared.one_bucket_invocation(&inner.one_bucket, now);
        inner
            .scripts
            .one_bucket_calls
            .fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let reply: Vec<u8> = self
            .run(&invocation, || prepared.one_bucket_eval(now), deadline)
            .await?;
        let Some(decision) = script::one_bucket_decision(&reply, charge.policy())? else {
            inner.scripts.handed_over.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        };
        // As `charge_all` remembers a single unshaped charge (not when
        // charging slot by slot: a refund could undo what it saw).
        if let (Some(cache), false, false) = (&inner.cache, inner.split, charge.is_refundable()) {
            if decision.is_admitted() {
                cache.remember_spent(key, charge, Instant::now(), decision);
            } else {
                cache.remember(key, charge, sent, decision);
            }
        }
        Ok(Some(Outcome::new(vec![decision])))
    }

    /// What `charge_all` would answer now, read with the script's `check`
    /// mode: nothing is written. Slot groups are read one by one (there is
    /// nothing to keep atomic).
    pub(crate) async fn check_all(&self, charges: &[Charge]) -> Result<Outcome, StoreError> {
        if let Some(outcome) = Outcome::never_fits(charges) {
            return Ok(outcome);
        }
        let keys = self.keys_of(charges);
        let deadline = self.deadline();
        let mut decisions = vec![Decision::unevaluated(); charges.len()];
        let mut before = vec![Decision::unevaluated(); charges.len()];
        for group in self.groups(&keys) {
            let prepared = Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i])))?;
            let reply = self.invoke(&prepared, Mode::Check, deadline).await?;
            read_group(&reply, &group, charges, &mut decisions, &mut before);
        }
        describe_as_one_call(&mut decisions, before);
        Ok(Outcome::new(decisions))
    }

    /// Gives back admissions of earlier slot groups after a later refusal.
    /// Refunds not started by `deadline` are sent in the background, so
    /// that the decision keeps its time limit; one that times out is not
    /// sent again (it may have been applied: a second would mint credit).
    async fn refund(&self, admitted: Vec<(Prepared, Vec<i64>)>, deadline: tokio::time::Instant) {
        let mut pending = admitted.into_iter();
        for (prepared, reply) in pending.by_ref() {
            if tokio::time::Instant::now() >= deadline {
                let rest: Vec<_> = std::iter::once((prepared, reply)).chain(pending).collect();
                let store = self.clone();
                tokio::spawn(async move {
                    for (prepared, reply) in rest {
                        let late = store.deadline();
                        store.refund_one(prepared, &reply, late).await;
                    }
                });
                return;
            }
            self.refund_one(prepared, &reply, deadline).await;
        }
    }

    async fn refund_one(&self, prepared: Prepared, reply: &[i64], deadline: tokio::time::Instant) {
        let refund = prepared.with_windows(reply);
        if let Err(e) = self.invoke(&refund, Mode::Undo, deadline).await {
            // The budget stays spent: conservative, never over-admits.
            tracing::warn!(error = %e, "refund after a cross-slot refusal failed");
        }
    }

    /// [`Store::refund`] and [`Store::confirm`] (`mode`): one script per
    /// slot group. A group that fails leaves its charges reserved, to
    /// lapse as confirmed (never more given back than was charged); the
    /// first error is answered after every group was tried.
    ///
    /// [`Store::refund`]: tollgate_budget::Store::refund
    /// [`Store::confirm`]: tollgate_budget::Store::confirm
    pub(crate) async fn settle(
        &self,
        charges: &[Charge],
        receipt: &Receipt,
        mode: Mode,
    ) -> Result<(), StoreError> {
        // (Entries of charges that were not refundable settle nothing.)
        let (charges, windows): (Vec<Charge>, Vec<Nanos>) = charges
            .iter()
            .zip(receipt.windows())
            .filter(|(_, w)| **w != Receipt::NOTHING)
            .map(|(c, w)| (c.clone(), *w))
            .unzip();
        if charges.is_empty() {
            return Ok(());
        }
        let keys = self.keys_of(&charges);
        if let (Some(cache), Mode::Refund) = (&self.inner.cache, mode) {
            for (key, charge) in keys.iter().zip(&charges) {
                cache.forget(key, charge);
            }
        }
        let deadline = self.deadline();
        let mut first_error = None;
        for group in self.groups(&keys) {
            let prepared = Prepared::new(group.iter().map(|&i| (&keys[i], &charges[i])))?;
            let windows: Vec<Nanos> = group.iter().map(|&i| windows[i]).collect();
            let settle = prepared.with_receipt(&windows);
            if let Err(e) = self.invoke(&settle, mode, deadline).await {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// [`Store::cancel`]: one `cancel` script for the reservation's
    /// charges.
    ///
    /// [`Store::cancel`]: tollgate_budget::Store::cancel
    pub(crate) async fn cancel_reserved(
        &self,
        charges: &[Charge],
        reservation: &Reservation,
    ) -> Result<(), StoreError> {
        let keys: Vec<String> = reservation
            .entries()
            .iter()
            .filter_map(|r| charges.get(r.index).map(|c| self.redis_key(c)))
            .collect();
        let items = reservation
            .entries()
            .iter()
            .filter_map(|r| charges.get(r.index).map(|c| (c, *r)))
            .zip(&keys)
            .map(|((c, r), k)| (k, c, r));
        let prepared = Prepared::cancel(items)?;
        if prepared.len() == 0 {
            return Ok(());
        }
        self.invoke(&prepared, Mode::Cancel, self.deadline())
            .await
            .map(|_| ())
    }
}

/// Reads a `check` (or charge) reply for `group`: each charge's decision,
/// and its budget as it stood before, into `decisions` and `before`.
fn read_group(
    reply: &[i64],
    group: &[usize],
    charges: &[Charge],
    decisions: &mut [Decision],
    before: &mut [Decision],
) {
    for (slot, &i) in group.iter().enumerate() {
        (decisions[i], before[i]) =
            script::decision(script::values(reply, slot), charges[i].policy());
    }
}

/// A call refused as a whole spent nothing: the limits that would have
/// admitted are described as they stand (`before`). A call admitted in
/// full is left as it is.
fn describe_as_one_call(decisions: &mut [Decision], before: Vec<Decision>) {
    if decisions.iter().all(Decision::is_admitted) {
        return;
    }
    for (d, b) in decisions.iter_mut().zip(before) {
        if d.is_admitted() {
            *d = b;
        }
    }
}
