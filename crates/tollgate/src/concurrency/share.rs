//! Who asks for a limit, and how much: each tenant's and each priority
//! class's demand, remembered for a second or two, from which a full global
//! limit is shared fairly between tenants and reserved for higher classes.
//!
//! A demand is what a tenant (or class) had in flight and waiting when one
//! more of its requests arrived, counting that one, whether admitted or
//! not: the most of it in the current and the previous second is the
//! demand the shares are computed from. Only a tenant (or class) that
//! wants slots now keeps them from others, though: one with requests in
//! flight or waiting, or refused since it last got a slot.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use tollgate_budget::{Claim, Nanos, Priority, fair_shares};

/// How long one period of demand lasts: a demand is remembered for the
/// rest of its period and the whole next one.
pub(crate) const PERIOD: Nanos = 1_000_000_000;

/// At most this many tenants are told apart at once; a newcomer beyond
/// them shares one claim (of weight 1) with every other newcomer, so a
/// client rotating addresses or accounts past that claims one share, and
/// the cost of computing the shares stays bounded.
pub(crate) const MAX_TENANTS: usize = 1024;

/// The claim newcomers beyond [`MAX_TENANTS`] share (no key text starts
/// with a control character).
const OVERFLOW: &str = "\u{1}overflow";

/// What one request asks of a limit, and of whom it is counted.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    /// Its key for the per-key limit, if there is one.
    pub(crate) key: Option<Box<str>>,
    /// Its tenant for fair share, if the layer shares fairly.
    pub(crate) tenant: Option<Arc<str>>,
    /// Its tenant's weight.
    pub(crate) weight: NonZeroU32,
    /// Its class.
    pub(crate) class: Priority,
}

impl Ask {
    /// A request with only a per-key key (or none): no tenant, the default
    /// class.
    pub(crate) fn keyed(key: Option<Box<str>>) -> Self {
        Self {
            key,
            tenant: None,
            weight: NonZeroU32::MIN,
            class: Priority::default(),
        }
    }
}

/// The most demand seen in the current period and the one before.
#[derive(Debug, Default, Clone, Copy)]
struct Peak {
    period: u64,
    current: u32,
    previous: u32,
}

impl Peak {
    fn note(&mut self, period: u64, demand: u32) {
        if period != self.period {
            self.previous = if period == self.period + 1 {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.period = period;
        }
        self.current = self.current.max(demand);
    }

    fn at(&self, period: u64) -> u32 {
        match period.saturating_sub(self.period) {
            0 => self.current.max(self.previous),
            1 => self.current,
            _ => 0,
        }
    }
}

/// A tenant's or a class's requests now, and its remembered demand.
#[derive(Debug, Default, Clone, Copy)]
struct Count {
    in_flight: u32,
    waiting: u32,
    /// The most in flight and waiting at an arrival, counting it.
    peak: Peak,
    /// The same, at arrivals that were refused, until one is admitted.
    refused: Peak,
}

impl Count {
    fn now(&self) -> u32 {
        self.in_flight.saturating_add(self.waiting)
    }

    /// The demand the shares are computed from: the remembered peak, or
    /// more if that many are in flight and waiting now.
    fn demand(&self, period: u64) -> u32 {
        self.peak
            .at(period)
            .max(self.refused.at(period))
            .max(self.now())
    }

    /// Whether it claims slots it does not hold: it has requests in flight
    /// or waiting (so its remembered peak is a live claim), or one of its
    /// requests was refused since it last got a slot. A tenant that only
    /// *was* busy a second ago claims nothing: its slots are for others to
    /// use until it comes back.
    fn claims(&self, period: u64) -> bool {
        self.now() > 0 || self.refused.at(period) > 0
    }

    /// What it claims beyond what it holds, up to `share` (its share, or
    /// its demand).
    fn unmet(&self, period: u64, share: u64) -> u64 {
        if self.claims(period) {
            share.saturating_sub(u64::from(self.in_flight))
        } else {
            0
        }
    }

    /// One more request arrived; `true` if that raised the demand.
    fn arrived(&mut self, period: u64) -> bool {
        let before = self.demand(period);
        self.peak.note(period, self.now().saturating_add(1));
        self.demand(period) > before
    }

    /// A request was refused; `true` if that raised the demand.
    fn refused(&mut self, period: u64) -> bool {
        let before = self.demand(period);
        self.refused.note(period, self.now().saturating_add(1));
        self.demand(period) > before
    }
}

#[derive(Debug)]
struct Tenant {
    count: Count,
    weight: NonZeroU32,
}

/// Each tenant's share of a full limit (`None` from [`Demand::shares`]:
/// the demands fit, nobody is held to a share).
pub(crate) type Shares = HashMap<Arc<str>, u64>;

/// How long shares computed for many tenants are used before they are
/// computed again, unless the limit changed: a change of demand is seen
/// at once with few tenants, within [`SHARES_AFTER_CHANGE`] with many.
const SHARES_FOR: Nanos = 5_000_000;
/// With more than [`FEW_TENANTS`] tenants, the shares are computed at most
/// this often when demand rises (each time costs a sort of the tenants).
const SHARES_AFTER_CHANGE: Nanos = 1_000_000;
const FEW_TENANTS: usize = 64;

/// The demand of every tenant and class, under the limiter's lock.
#[derive(Debug, Default)]
pub(crate) struct Demand {
    tenants: HashMap<Arc<str>, Tenant>,
    classes: [Count; 4],
    /// The latest time seen, and its period.
    now: Nanos,
    period: u64,
    /// The period in which tenants gone quiet were last forgotten.
    swept: u64,
    /// The shares last computed, for which limit, and when.
    shares: Option<Shares>,
    shares_max: usize,
    shares_at: Option<Nanos>,
    /// Demand rose (or tenants came or went) since.
    changed: bool,
}

fn class_index(class: Priority) -> usize {
    match class {
        Priority::Batch => 0,
        Priority::Normal => 1,
        Priority::Interactive => 2,
        Priority::Critical => 3,
    }
}

impl Demand {
    /// `ask` arrives at `now`: its tenant (a newcomer beyond
    /// [`MAX_TENANTS`] becomes the shared overflow tenant, of weight 1) and
    /// class note their demand, counting it.
    pub(crate) fn arrive(&mut self, ask: &mut Ask, now: Nanos) {
        self.advance(now);
        let period = self.period;
        if let Some(tenant) = &mut ask.tenant {
            if !self.tenants.contains_key(&**tenant) && self.tenants.len() >= MAX_TENANTS {
                *tenant = OVERFLOW.into();
                ask.weight = NonZeroU32::MIN;
            }
            let entry = self.tenants.entry(tenant.clone()).or_insert_with(|| {
                self.changed = true;
                Tenant {
                    count: Count::default(),
                    weight: ask.weight,
                }
            });
            if entry.weight != ask.weight {
                entry.weight = ask.weight;
                self.changed = true;
            }
            self.changed |= entry.count.arrived(period);
        }
        self.classes[class_index(ask.class)].arrived(period);
    }

    /// `ask` was refused: its tenant and class claim what they wanted
    /// until one of their requests is admitted (or for the rest of this
    /// period and the next).
    pub(crate) fn refused(&mut self, ask: &Ask) {
        let period = self.period;
        if let Some(tenant) = ask.tenant.as_deref().and_then(|t| self.tenants.get_mut(t)) {
            self.changed |= tenant.count.refused(period);
        }
        self.classes[class_index(ask.class)].refused(period);
    }

    /// The time is `now`: once a period, tenants with nothing in flight or
    /// waiting and no demand left to remember are forgotten.
    pub(crate) fn advance(&mut self, now: Nanos) {
        self.now = self.now.max(now);
        self.period = self.period.max(now / PERIOD);
        if self.period > self.swept {
            let period = self.period;
            let before = self.tenants.len();
            self.tenants.retain(|_, t| t.count.demand(period) > 0);
            self.changed |= self.tenants.len() != before;
            self.swept = period;
        }
    }

    /// When the next period starts, in nanoseconds.
    pub(crate) fn next_period(&self) -> Nanos {
        self.period.saturating_add(1).saturating_mul(PERIOD)
    }

    fn counts(&mut self, ask: &Ask) -> (Option<&mut Count>, &mut Count) {
        let tenant = ask
            .tenant
            .as_deref()
            .and_then(|t| self.tenants.get_mut(t))
            .map(|t| &mut t.count);
        (tenant, &mut self.classes[class_index(ask.class)])
    }

    /// `ask` was admitted (`by` 1: its refusals are forgotten) or gave its
    /// slot back (`by` -1).
    pub(crate) fn in_flight(&mut self, ask: &Ask, by: i8) {
        let (tenant, class) = self.counts(ask);
        for count in tenant.into_iter().chain([class]) {
            count.in_flight = step(count.in_flight, by);
            if by > 0 {
                count.refused = Peak::default();
            }
        }
    }

    /// `ask` started (`by` 1) or stopped (`by` -1) waiting.
    pub(crate) fn waiting(&mut self, ask: &Ask, by: i8) {
        let (tenant, class) = self.counts(ask);
        for count in tenant.into_iter().chain([class]) {
            count.waiting = step(count.waiting, by);
        }
    }

    /// The slots that classes above `class` claim beyond what they hold
    /// (what each remembers wanting, while it has requests in flight or
    /// waiting, or was refused since it last got a slot).
    pub(crate) fn reserved_above(&self, class: Priority) -> usize {
        let period = self.period;
        self.classes[class_index(class) + 1..]
            .iter()
            .map(|c| c.unmet(period, u64::from(c.demand(period))) as usize)
            .sum()
    }

    /// Computes the tenants' weighted max-min fair shares of `max` again if
    /// they may have changed: the limit moved, demand rose (at once with
    /// few tenants, at most every millisecond with many), or they are 5 ms
    /// old.
    pub(crate) fn refresh(&mut self, max: usize) {
        let age = self.shares_at.map(|at| self.now.saturating_sub(at));
        let due = match age {
            None => true,
            Some(age) => {
                max != self.shares_max
                    || age >= SHARES_FOR
                    || (self.changed
                        && (self.tenants.len() <= FEW_TENANTS || age >= SHARES_AFTER_CHANGE))
            }
        };
        if due {
            self.shares = self.compute(max);
            self.shares_max = max;
            self.shares_at = Some(self.now);
            self.changed = false;
        }
    }

    /// The shares last computed by [`refresh`](Self::refresh), or `None`
    /// when the demands fit in the limit.
    pub(crate) fn shares(&self) -> Option<&Shares> {
        self.shares.as_ref()
    }

    fn compute(&self, max: usize) -> Option<Shares> {
        let period = self.period;
        let total: u64 = self
            .tenants
            .values()
            .map(|t| u64::from(t.count.demand(period)))
            .sum();
        let max = u64::try_from(max).unwrap_or(u64::MAX);
        if total <= max {
            return None;
        }
        // In the order of the tenants' keys, so that the units left by
        // rounding go to the same tenants however the map is laid out.
        let mut tenants: Vec<(&Arc<str>, &Tenant)> = self.tenants.iter().collect();
        tenants.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let claims: Vec<Claim> = tenants
            .iter()
            .map(|(_, t)| Claim::new(u64::from(t.count.demand(period)), t.weight))
            .collect();
        let shares = fair_shares(max, &claims);
        Some(
            tenants
                .into_iter()
                .map(|(k, _)| k.clone())
                .zip(shares)
                .collect(),
        )
    }

    /// Whether `ask`'s tenant holds its share (or more) of `shares`. A
    /// tenant the shares do not know yet (computed, with many tenants, up
    /// to a millisecond before it came) is below its share (found in
    /// review: it was read as a share of 0 and refused).
    pub(crate) fn at_share(&self, ask: &Ask, shares: &Shares) -> bool {
        let Some(tenant) = ask.tenant.as_deref() else {
            return false;
        };
        let (Some(t), Some(&share)) = (self.tenants.get(tenant), shares.get(tenant)) else {
            return false;
        };
        u64::from(t.count.in_flight) >= share
    }

    /// What `tenant` claims below its share (a tenant the shares do not
    /// know yet: below its demand).
    fn unmet_of(&self, tenant: &str, t: &Tenant, shares: &Shares) -> u64 {
        let share = shares
            .get(tenant)
            .copied()
            .unwrap_or_else(|| u64::from(t.count.demand(self.period)));
        t.count.unmet(self.period, share)
    }

    /// The slots all tenants claim below their shares (only tenants with
    /// requests in flight or waiting, or refused since they last got a
    /// slot).
    pub(crate) fn unmet_total(&self, shares: &Shares) -> u64 {
        self.tenants
            .iter()
            .map(|(k, t)| self.unmet_of(k, t, shares))
            .sum()
    }

    /// `total` ([`unmet_total`](Self::unmet_total)) less what `ask`'s own
    /// tenant claims: the slots a tenant at its share must leave free.
    pub(crate) fn unmet_by_others(&self, ask: &Ask, shares: &Shares, total: u64) -> usize {
        let own = ask
            .tenant
            .as_deref()
            .and_then(|k| Some(self.unmet_of(k, self.tenants.get(k)?, shares)))
            .unwrap_or(0);
        usize::try_from(total.saturating_sub(own)).unwrap_or(usize::MAX)
    }

    /// How many tenants are told apart now.
    #[cfg(test)]
    pub(crate) fn tenants(&self) -> usize {
        self.tenants.len()
    }
}

fn step(n: u32, by: i8) -> u32 {
    if by >= 0 {
        n.saturating_add(1)
    } else {
        n.saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(tenant: &str, class: Priority) -> Ask {
        Ask {
            key: None,
            tenant: Some(tenant.into()),
            weight: NonZeroU32::MIN,
            class,
        }
    }

    #[test]
    fn a_demand_is_remembered_for_the_next_period_and_then_forgotten() {
        let mut d = Demand::default();
        let mut a = ask("a", Priority::Normal);
        for _ in 0..3 {
            d.arrive(&mut a, 0);
            d.in_flight(&a, 1);
        }
        for _ in 0..3 {
            d.in_flight(&a, -1);
        }
        // Nothing in flight, but 3 wanted this period: the shares see 3.
        let share = |d: &mut Demand| {
            d.refresh(2);
            d.shares().map(|s| s.get("a").copied())
        };
        assert_eq!(d.tenants["a"].count.demand(0), 3);
        d.advance(PERIOD);
        assert_eq!(d.tenants["a"].count.demand(1), 3);
        assert_eq!(share(&mut d), Some(Some(2)));
        // It claims nothing it does not hold, though: nothing is in flight.
        assert!(!d.tenants["a"].count.claims(1));
        d.advance(2 * PERIOD);
        // Two periods on, forgotten.
        assert_eq!(d.tenants(), 0);
        assert_eq!(share(&mut d), None);
    }

    #[test]
    fn newcomers_beyond_the_cap_share_one_claim() {
        let mut d = Demand::default();
        for i in 0..MAX_TENANTS + 5 {
            let mut a = ask(&format!("t{i}"), Priority::Normal);
            d.arrive(&mut a, 0);
            if i >= MAX_TENANTS {
                assert_eq!(a.tenant.as_deref(), Some(OVERFLOW));
            }
        }
        assert_eq!(d.tenants(), MAX_TENANTS + 1);
        // The overflow claim remembers the most of them at once (1 each,
        // arriving one after another with none in flight).
        assert_eq!(d.tenants[OVERFLOW].count.demand(0), 1);
    }

    #[test]
    fn higher_classes_reserve_what_they_remember_wanting() {
        let mut d = Demand::default();
        let mut i = ask("a", Priority::Interactive);
        for _ in 0..4 {
            d.arrive(&mut i, 0);
            d.in_flight(&i, 1);
        }
        // Interactive holds all 4 it wants: nothing more is reserved.
        assert_eq!(d.reserved_above(Priority::Batch), 0);
        d.in_flight(&i, -1);
        d.in_flight(&i, -1);
        // Two gone, but it wanted 4 this period and is still busy: 2 are
        // kept for it.
        assert_eq!(d.reserved_above(Priority::Batch), 2);
        assert_eq!(d.reserved_above(Priority::Normal), 2);
        assert_eq!(d.reserved_above(Priority::Interactive), 0);
        // Gone quiet, it keeps nothing; refused, it claims what it wanted
        // until it is admitted again.
        d.in_flight(&i, -1);
        d.in_flight(&i, -1);
        assert_eq!(d.reserved_above(Priority::Batch), 0);
        d.refused(&i);
        assert_eq!(d.reserved_above(Priority::Batch), 4);
        d.in_flight(&i, 1);
        assert_eq!(d.reserved_above(Priority::Batch), 3);
        d.in_flight(&i, -1);
        assert_eq!(d.reserved_above(Priority::Batch), 0);
    }

    /// Found in review: tenants that each sent a request a second claimed
    /// a slot each for a second or two without holding one. Only tenants
    /// with requests in flight or waiting, or refused since their last
    /// slot, keep slots from others.
    #[test]
    fn only_tenants_that_want_slots_now_keep_them_from_others() {
        let mut d = Demand::default();
        let mut victim = ask("zz", Priority::Normal);
        d.arrive(&mut victim, 0);
        d.in_flight(&victim, 1);
        for t in ["a0", "a1", "a2", "a3"] {
            let mut a = ask(t, Priority::Normal);
            d.arrive(&mut a, 0);
            d.in_flight(&a, 1);
            d.in_flight(&a, -1);
        }
        d.refresh(4);
        let shares = d.shares().unwrap().clone();
        // Five claims of 1 for 4 slots: the victim's share rounds to 0...
        assert_eq!(shares["zz"], 0);
        assert!(d.at_share(&victim, &shares));
        // ...but nobody else wants a slot now: none need be left free.
        let total = d.unmet_total(&shares);
        assert_eq!(d.unmet_by_others(&victim, &shares, total), 0);
        let mut a0 = ask("a0", Priority::Normal);
        d.arrive(&mut a0, 1);
        d.refused(&a0);
        let total = d.unmet_total(&shares);
        assert_eq!(d.unmet_by_others(&victim, &shares, total), 1);
    }

    /// Found in review: with more than 64 tenants the shares are computed
    /// at most every millisecond, and a tenant arriving in between was
    /// read as a share of 0, at its share, and refused.
    #[test]
    fn a_tenant_the_shares_do_not_know_yet_is_below_its_share() {
        let mut d = Demand::default();
        for i in 0..100 {
            let mut a = ask(&format!("t{i}"), Priority::Normal);
            d.arrive(&mut a, 0);
            d.in_flight(&a, 1);
        }
        d.refresh(50);
        let mut late = ask("late", Priority::Normal);
        d.arrive(&mut late, 0);
        d.refresh(50);
        let shares = d.shares().unwrap();
        assert!(!shares.contains_key("late"));
        assert!(!d.at_share(&late, shares));
    }
}
