//! Who asks for a limit, and how much: each tenant's and each priority
//! class's demand, remembered for a second or two, from which a full global
//! limit is shared fairly between tenants and reserved for higher classes.
//!
//! A demand is what a tenant (or class) had in flight and waiting when one
//! more of its requests arrived, counting that one, whether admitted or
//! not: the most of it in the current and the previous second is the
//! demand fair share and priorities see. So a tenant whose requests come
//! and go keeps its claim between them, and a burst is remembered for at
//! least a second after it ends.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

use tollgate_budget::{Claim, Nanos, Priority, fair_shares};

/// How long one period of demand lasts: a demand is remembered for the
/// rest of its period and the whole next one.
pub(crate) const PERIOD: Nanos = 1_000_000_000;

/// At most this many tenants are told apart at once; a newcomer beyond
/// them shares one claim with every other newcomer (so a client rotating
/// addresses or accounts claims one share, not thousands, and cannot
/// crowd out the tenants already known).
pub(crate) const MAX_TENANTS: usize = 10_000;

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
    peak: Peak,
}

impl Count {
    /// The demand the shares see: the remembered peak, or more if that
    /// many are in flight and waiting now.
    fn demand(&self, period: u64) -> u32 {
        self.peak
            .at(period)
            .max(self.in_flight.saturating_add(self.waiting))
    }

    /// One more request arrived.
    fn arrived(&mut self, period: u64) {
        let demand = self
            .in_flight
            .saturating_add(self.waiting)
            .saturating_add(1);
        self.peak.note(period, demand);
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

/// The demand of every tenant and class, under the limiter's lock.
#[derive(Debug, Default)]
pub(crate) struct Demand {
    tenants: HashMap<Arc<str>, Tenant>,
    classes: [Count; 4],
    /// The latest period seen.
    period: u64,
    /// The period in which tenants gone quiet were last forgotten.
    swept: u64,
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
    /// [`MAX_TENANTS`] becomes the shared overflow tenant) and class note
    /// their demand, counting it.
    pub(crate) fn arrive(&mut self, ask: &mut Ask, now: Nanos) {
        self.advance(now);
        let period = self.period;
        if let Some(tenant) = &mut ask.tenant {
            if !self.tenants.contains_key(&**tenant) && self.tenants.len() >= MAX_TENANTS {
                *tenant = OVERFLOW.into();
            }
            let entry = self.tenants.entry(tenant.clone()).or_insert(Tenant {
                count: Count::default(),
                weight: ask.weight,
            });
            entry.weight = ask.weight;
            entry.count.arrived(period);
        }
        self.classes[class_index(ask.class)].arrived(period);
    }

    /// The time is `now`: once a period, tenants with nothing in flight or
    /// waiting and no demand left to remember are forgotten.
    pub(crate) fn advance(&mut self, now: Nanos) {
        self.period = self.period.max(now / PERIOD);
        if self.period > self.swept {
            let period = self.period;
            self.tenants.retain(|_, t| t.count.demand(period) > 0);
            self.swept = period;
        }
    }

    fn counts(&mut self, ask: &Ask) -> (Option<&mut Count>, &mut Count) {
        let tenant = ask
            .tenant
            .as_deref()
            .and_then(|t| self.tenants.get_mut(t))
            .map(|t| &mut t.count);
        (tenant, &mut self.classes[class_index(ask.class)])
    }

    /// `ask` was admitted (`by` 1) or gave its slot back (`by` -1).
    pub(crate) fn in_flight(&mut self, ask: &Ask, by: i8) {
        let (tenant, class) = self.counts(ask);
        for count in tenant.into_iter().chain([class]) {
            count.in_flight = step(count.in_flight, by);
        }
    }

    /// `ask` started (`by` 1) or stopped (`by` -1) waiting.
    pub(crate) fn waiting(&mut self, ask: &Ask, by: i8) {
        let (tenant, class) = self.counts(ask);
        for count in tenant.into_iter().chain([class]) {
            count.waiting = step(count.waiting, by);
        }
    }

    /// The slots of a limit of `max` that classes above `class` may still
    /// claim: what each remembers wanting beyond what it has in flight.
    pub(crate) fn reserved_above(&self, class: Priority) -> usize {
        self.classes[class_index(class) + 1..]
            .iter()
            .map(|c| c.demand(self.period).saturating_sub(c.in_flight) as usize)
            .sum()
    }

    /// Each tenant's weighted max-min fair share of `max`, or `None` when
    /// their demands fit in it.
    pub(crate) fn shares(&self, max: usize) -> Option<Shares> {
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

    /// Whether `ask`'s tenant holds its share (or more) of `shares`.
    pub(crate) fn at_share(&self, ask: &Ask, shares: &Shares) -> bool {
        let Some(tenant) = ask.tenant.as_deref() else {
            return false;
        };
        let held = self.tenants.get(tenant).map_or(0, |t| t.count.in_flight);
        u64::from(held) >= shares.get(tenant).copied().unwrap_or(0)
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
        // Nothing in flight, but 3 wanted this period: the share sees 3.
        let shares = |d: &Demand| d.shares(0).map(|s| s.get("a").copied());
        assert_eq!(d.tenants["a"].count.demand(0), 3);
        d.advance(PERIOD);
        assert_eq!(d.tenants["a"].count.demand(1), 3);
        assert_eq!(shares(&d), Some(Some(0)));
        d.advance(2 * PERIOD);
        // Two periods on, forgotten.
        assert_eq!(d.tenants(), 0);
        assert_eq!(shares(&d), None);
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
        // Two gone, but it wanted 4 this period: 2 are kept for it.
        assert_eq!(d.reserved_above(Priority::Batch), 2);
        assert_eq!(d.reserved_above(Priority::Normal), 2);
        assert_eq!(d.reserved_above(Priority::Interactive), 0);
    }
}
