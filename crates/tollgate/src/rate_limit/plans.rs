//! Policies that depend on who is asking: plans (tiers) carried by the
//! [`Principal`], overrides for a tenant or an account, and a chooser of
//! your own. Every policy is checked when the rule is built and shares the
//! rule's budget (its name and unit), so a principal that changes plan keeps
//! what it has spent, converted to the new numbers.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use tollgate_budget::Policy;

use crate::identity::Principal;

/// Chooses a plan by name from the request head ([`Rule::plan_from`](crate::Rule::plan_from)).
pub(crate) type PlanFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The policies of one rule besides its default.
#[derive(Clone, Default)]
pub(crate) struct Plans {
    plans: HashMap<Arc<str>, Policy>,
    tenants: HashMap<Arc<str>, Policy>,
    /// Account overrides, by tenant then account.
    accounts: HashMap<Arc<str>, HashMap<Arc<str>, Policy>>,
    choose: Option<Arc<PlanFn>>,
}

/// What a policy was added as, for messages.
#[derive(Clone, Copy)]
pub(crate) enum Entry<'a> {
    Plan(&'a str),
    Tenant(&'a str),
    Account(&'a str, &'a str),
}

impl fmt::Display for Entry<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Plan(plan) => write!(f, "plan {plan:?}"),
            Entry::Tenant(tenant) => write!(f, "tenant {tenant:?}"),
            Entry::Account(tenant, account) => write!(f, "account {account:?} of {tenant:?}"),
        }
    }
}

/// A plan or override a rule cannot take: its policy is another budget
/// than the rule's (a different policy name or unit: all the policies of a
/// rule share one budget per key, so that a principal whose plan changes
/// keeps what it has spent; give a plan the rule's policy name), or the
/// rule has one for that plan, tenant or account already (one would
/// silently replace the other).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry} {reason}")]
pub(crate) struct InvalidPlan {
    entry: String,
    reason: Reason,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum Reason {
    #[error(
        "has policy {policy:?} in {unit}: every policy of a rule must have the rule's name \
         and unit ({rule_unit}), so that the budget carries over when the plan changes"
    )]
    OtherBudget {
        rule_unit: String,
        policy: String,
        unit: String,
    },
    #[error(
        "is given twice: give each plan, tenant or account one policy (change one at runtime \
         with RulesHandle::set_plan)"
    )]
    Repeated,
}

impl Plans {
    /// Adds `policy` as `entry`, if it is the same budget as `rule` and
    /// `entry` has none yet.
    pub(crate) fn add(
        &mut self,
        rule: &Policy,
        entry: Entry<'_>,
        policy: Policy,
    ) -> Result<(), InvalidPlan> {
        let invalid = |reason| InvalidPlan {
            entry: entry.to_string(),
            reason,
        };
        if !policy.same_budget(rule) {
            return Err(invalid(Reason::OtherBudget {
                rule_unit: rule.unit().as_str().to_owned(),
                policy: policy.name().to_owned(),
                unit: policy.unit().as_str().to_owned(),
            }));
        }
        let given = match entry {
            Entry::Plan(plan) => self.plans.contains_key(plan),
            Entry::Tenant(tenant) => self.tenants.contains_key(tenant),
            Entry::Account(tenant, account) => self
                .accounts
                .get(tenant)
                .is_some_and(|accounts| accounts.contains_key(account)),
        };
        if given {
            return Err(invalid(Reason::Repeated));
        }
        self.set(entry, policy);
        Ok(())
    }

    /// Makes `policy` the one for `entry` (checked by the caller).
    pub(crate) fn set(&mut self, entry: Entry<'_>, policy: Policy) {
        match entry {
            Entry::Plan(plan) => self.plans.insert(plan.into(), policy),
            Entry::Tenant(tenant) => self.tenants.insert(tenant.into(), policy),
            Entry::Account(tenant, account) => self
                .accounts
                .entry(tenant.into())
                .or_default()
                .insert(account.into(), policy),
        };
    }

    pub(crate) fn choose_with(&mut self, choose: Arc<PlanFn>) {
        self.choose = Some(choose);
    }

    /// Every policy held, for checking them against a store.
    pub(crate) fn policies(&self) -> impl Iterator<Item = &Policy> {
        self.plans
            .values()
            .chain(self.tenants.values())
            .chain(self.accounts.values().flat_map(HashMap::values))
    }

    #[cfg(all(feature = "redis", feature = "serde"))]
    /// Every policy held with where it is held (`plan NAME`, `tenant
    /// NAME`, `account TENANT/NAME`, names debug-quoted), sorted: the same
    /// on every instance that holds the same policies.
    pub(crate) fn sorted(&self) -> Vec<(String, &Policy)> {
        let mut all: Vec<(String, &Policy)> = self
            .plans
            .iter()
            .map(|(plan, p)| (format!("plan {plan:?}"), p))
            .chain(
                self.tenants
                    .iter()
                    .map(|(tenant, p)| (format!("tenant {tenant:?}"), p)),
            )
            .chain(self.accounts.iter().flat_map(|(tenant, accounts)| {
                accounts
                    .iter()
                    .map(move |(account, p)| (format!("account {tenant:?}/{account:?}"), p))
            }))
            .collect();
        all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Every policy held, to change each the same way (e.g. its unit).
    pub(crate) fn policies_mut(&mut self) -> impl Iterator<Item = &mut Policy> {
        self.plans
            .values_mut()
            .chain(self.tenants.values_mut())
            .chain(self.accounts.values_mut().flat_map(HashMap::values_mut))
    }

    /// The policy for this request, if not the default: the account's
    /// override, else the tenant's, else the plan the chooser names, else
    /// the principal's plan. A plan no policy was added for is the default.
    pub(crate) fn policy_for(&self, parts: &Parts) -> Option<&Policy> {
        let principal = parts.extensions.get::<Principal>();
        if let Some(p) = principal {
            let account = self
                .accounts
                .get(p.tenant())
                .and_then(|a| a.get(p.account()));
            if let Some(policy) = account {
                return Some(policy);
            }
            if let Some(policy) = self.tenants.get(p.tenant()) {
                return Some(policy);
            }
        }
        if let Some(choose) = &self.choose
            && let Some(policy) = choose(parts).and_then(|plan| self.plans.get(plan.as_str()))
        {
            return Some(policy);
        }
        self.plans.get(principal?.plan()?)
    }
}

impl fmt::Debug for Plans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plans")
            .field("plans", &self.plans)
            .field("tenants", &self.tenants)
            .field("accounts", &self.accounts)
            .field("chooser", &self.choose.is_some())
            .finish()
    }
}
