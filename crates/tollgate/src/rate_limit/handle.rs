//! [`RulesHandle`]: changes a layer's rules while it serves, without a
//! fresh budget.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tollgate_budget::{DynStore, Policy, Store};

use super::Rule;
use super::config::{Applied, RuleSet, check, check_together};
#[cfg(feature = "serde")]
use super::data::{InvalidPolicySet, Place, PolicySet};
use super::invalid::InvalidRule;
#[cfg(feature = "serde")]
use super::plans::Entry;

/// Replaces the rules (or one policy) of a [`RateLimitLayer`](crate::RateLimitLayer)
/// while it serves, from [`RateLimitLayer::rules_handle`](crate::RateLimitLayer::rules_handle).
///
/// A request reads the rule set once, when it arrives: requests already in
/// flight finish under the rules they started with, new ones use the new
/// set. Budget state belongs to a policy's name (and unit) and the key, not
/// to its numbers, so a policy changed under the same name keeps what every
/// key has spent, converted exactly by
/// [`carry_over`](crate::store::algorithm::carry_over): lowering a limit
/// never admits a burst, raising it never forgets what was spent, and a
/// change of algorithm (bucket to window) carries the units spent. A key
/// changes over at its first request under the new numbers. A policy under
/// a *new* name starts a new budget.
///
/// Every new policy is checked against the layer's store (and fallback
/// store) first; on an error nothing changes.
///
/// ```
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .rule(Rule::per_client_ip(Policy::token_bucket("per-ip", 5, Rate::per_second(1))?))
///     .build()?;
/// let handle = layer.rules_handle();
/// // ... serve with `layer`; later, from an admin endpoint or a config watcher:
/// handle.set_policy(Policy::token_bucket("per-ip", 2, Rate::per_second(1))?)?;
/// # Ok(()) }
/// ```
pub struct RulesHandle<St> {
    rules: RuleSet,
    applied: Arc<Mutex<Applied>>,
    store: Arc<St>,
    fallback: Option<Arc<dyn DynStore>>,
}

impl<St> Clone for RulesHandle<St> {
    fn clone(&self) -> Self {
        Self {
            rules: self.rules.clone(),
            applied: self.applied.clone(),
            store: self.store.clone(),
            fallback: self.fallback.clone(),
        }
    }
}

impl<St> fmt::Debug for RulesHandle<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RulesHandle")
            .field("rules", &self.rules.load())
            .finish_non_exhaustive()
    }
}

impl<St: Store> RulesHandle<St> {
    pub(crate) fn new(
        rules: RuleSet,
        applied: Arc<Mutex<Applied>>,
        store: Arc<St>,
        fallback: Option<Arc<dyn DynStore>>,
    ) -> Self {
        Self {
            rules,
            applied,
            store,
            fallback,
        }
    }

    fn applied(&self) -> MutexGuard<'_, Applied> {
        self.applied.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Replaces every rule, in order, once each is checked as
    /// [`RateLimitBuilder::build`](super::RateLimitBuilder::build) checks
    /// them. On an error the rules are unchanged. These rules are in
    /// force as given: a set [applied](Self::apply) before is forgotten
    /// (apply it again to put it on top of them).
    pub fn replace(&self, rules: impl IntoIterator<Item = Rule>) -> Result<(), InvalidRule> {
        let rules: Vec<Rule> = rules.into_iter().collect();
        check_together(&rules)?;
        for rule in &rules {
            self.check(rule)?;
        }
        let mut applied = self.applied();
        *applied = Applied::default();
        self.rules.store(Arc::new(rules));
        Ok(())
    }

    /// Puts a [`PolicySet`] (policies as data) in force on top of the
    /// layer's rules as they were when the first set was applied (as
    /// built, [replaced](Self::replace), or changed in code before then):
    /// each rule whose own policy has a name the set names gets the set's
    /// default policy, plans, tenants' and accounts' overrides, as
    /// [`Rule::plan`], [`Rule::for_tenant`] and [`Rule::for_account`] would
    /// give them, in the rule's unit; what the set leaves out stays as it
    /// was. A set replaces the one applied before: a change it no longer
    /// has goes back to those rules, and changes made in between with
    /// [`set_policy`](Self::set_policy) or [`set_plan`](Self::set_plan)
    /// are dropped. Keys carry what they spent over to the new numbers, as
    /// with [`set_policy`](Self::set_policy). Returns how many rules the
    /// set changed. Checked whole first (numbers, names, the store); on an
    /// error nothing changes.
    ///
    /// ```
    /// use tollgate::rate_limit::PolicySet;
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let export = Policy::token_bucket("export", 3, Rate::per_second(1))?;
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .rule(Rule::per_account(export))
    ///     .build()?;
    /// let handle = layer.rules_handle();
    /// let set = PolicySet::from_json(
    ///     r#"{"rules": {"export": {"plans": {"pro": {"capacity": 6, "refill": {"per_second": 2}}}}}}"#,
    /// )?;
    /// assert_eq!(handle.apply(&set)?, 1);
    /// // A rule the set names must exist.
    /// let typo = PolicySet::from_json(r#"{"rules": {"exprot": {}}}"#)?;
    /// assert_eq!(
    ///     handle.apply(&typo).unwrap_err().to_string(),
    ///     "rules.exprot: no rule has a policy of this name",
    /// );
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidPolicySet`] naming the field: a policy the builder would
    /// refuse, a rule name no rule has, a policy the layer's store (or
    /// fallback store) cannot hold.
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub fn apply(&self, set: &PolicySet) -> Result<usize, InvalidPolicySet> {
        let mut applied = self.applied();
        let base = applied
            .base
            .clone()
            .unwrap_or_else(|| self.rules.load_full());
        let (next, changed) = self.with_set(&base, set)?;
        applied.base = Some(base);
        applied.set = set.clone();
        self.rules.store(Arc::new(next));
        Ok(changed)
    }

    /// Whether [`apply`](Self::apply) would take `set`, without applying
    /// it (for checking a set before publishing it to a fleet).
    ///
    /// # Errors
    ///
    /// What [`apply`](Self::apply) would answer.
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub fn check_set(&self, set: &PolicySet) -> Result<(), InvalidPolicySet> {
        let applied = self.applied();
        let base = applied
            .base
            .clone()
            .unwrap_or_else(|| self.rules.load_full());
        self.with_set(&base, set).map(|_| ())
    }

    /// `base` with `set` in force, every changed rule checked against the
    /// store; and how many rules changed.
    #[cfg(feature = "serde")]
    fn with_set(
        &self,
        base: &[Rule],
        set: &PolicySet,
    ) -> Result<(Vec<Rule>, usize), InvalidPolicySet> {
        set.validate()?;
        let mut next: Vec<Rule> = base.to_vec();
        let mut changed = 0;
        for (name, policies) in &set.rules {
            let mut found = false;
            for rule in next.iter_mut().filter(|r| r.policy().name() == name) {
                found = true;
                let mut edited = rule.clone();
                policies.each(name, |place, path, data| {
                    let policy = data.policy(name, &path)?;
                    edited = match place {
                        Place::Default => edited.clone().with_default_policy(policy),
                        Place::Plan(plan) => {
                            edited.clone().with_entry_policy(Entry::Plan(plan), policy)
                        }
                        Place::Tenant(tenant) => edited
                            .clone()
                            .with_entry_policy(Entry::Tenant(tenant), policy),
                        Place::Account(tenant, account) => edited
                            .clone()
                            .with_entry_policy(Entry::Account(tenant, account), policy),
                    };
                    Ok(())
                })?;
                self.check(&edited).map_err(|e| {
                    InvalidPolicySet::new(format!("rules.{}", super::data::segment(name)), e)
                })?;
                *rule = edited;
                changed += 1;
            }
            if !found {
                return Err(InvalidPolicySet::new(
                    format!("rules.{}", super::data::segment(name)),
                    "no rule has a policy of this name",
                ));
            }
        }
        Ok((next, changed))
    }

    /// The set last [applied](Self::apply) (empty before any, and after
    /// [`replace`](Self::replace)).
    #[cfg(feature = "serde")]
    #[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
    pub fn applied_set(&self) -> PolicySet {
        self.applied().set.clone()
    }

    /// Makes `policy` the policy of every rule whose own (default) policy
    /// has its name and unit, keeping each rule's routes, key, cost, plans
    /// and overrides; how many rules changed (0 when none has that
    /// policy, and nothing changed). A `policy` counting in requests takes
    /// each rule's unit first (a rule with a content cost counts in
    /// `content-kib`, say), as [`Rule::plan`] does. Checked against the
    /// store first.
    pub fn set_policy(&self, policy: Policy) -> Result<usize, InvalidRule> {
        self.change_budget(&policy, |rule, policy| rule.with_default_policy(policy))
    }

    /// Makes `policy` the policy of principals on `plan`
    /// ([`Rule::plan`]) in every rule whose own policy has its name and
    /// unit, given for that plan before or not, keeping everything else
    /// of each rule (its default policy, other plans, overrides); how many
    /// rules changed (0 when none has that policy's budget, and nothing
    /// changed). Keys on the plan carry what they spent over to the new
    /// numbers, as with [`RulesHandle::set_policy`]. Checked against the
    /// store first; on an error nothing changes.
    ///
    /// ```
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let export = |n, per_s| Policy::token_bucket("export", n, Rate::per_second(per_s));
    /// let layer = RateLimitLayer::builder(MemoryStore::new())
    ///     .rule(Rule::per_account(export(3, 1)?).plan("pro", export(30, 10)?))
    ///     .build()?;
    /// let handle = layer.rules_handle();
    /// // Later: the "pro" plan gets more; the default and other plans stay.
    /// assert_eq!(handle.set_plan("pro", export(60, 20)?)?, 1);
    /// # Ok(()) }
    /// ```
    pub fn set_plan(&self, plan: &str, policy: Policy) -> Result<usize, InvalidRule> {
        self.change_budget(&policy, |rule, policy| rule.with_plan_policy(plan, policy))
    }

    /// Applies `change` (with `policy`) to every rule whose own policy is
    /// `policy`'s budget (its name and unit, in the rule's unit), once
    /// each changed rule is checked against the store; how many changed.
    /// Applied to the latest rules: another change may have landed since.
    fn change_budget(
        &self,
        policy: &Policy,
        change: impl Fn(Rule, Policy) -> Rule,
    ) -> Result<usize, InvalidRule> {
        let matches = |r: &Rule| r.policy().same_budget(&r.in_rule_unit(policy.clone()));
        let changed = |rules: &[Rule]| -> Vec<Rule> {
            rules
                .iter()
                .map(|r| match matches(r) {
                    true => change(r.clone(), policy.clone()),
                    false => r.clone(),
                })
                .collect()
        };
        // Checked and swapped as one: if another change landed between
        // the check and the swap, start again from it, so that no rule
        // comes into force unchecked.
        loop {
            let current = self.rules.load_full();
            let next = changed(&current);
            for (before, after) in current.iter().zip(&next) {
                if matches(before) {
                    self.check(after)?;
                }
            }
            let count = current.iter().filter(|r| matches(r)).count();
            if count == 0 {
                return Ok(0);
            }
            let previous = self.rules.compare_and_swap(&current, Arc::new(next));
            if Arc::ptr_eq(&previous, &current) {
                return Ok(count);
            }
        }
    }

    /// The rules now in force.
    pub fn rules(&self) -> Arc<Vec<Rule>> {
        self.rules.load_full()
    }

    fn check(&self, rule: &Rule) -> Result<(), InvalidRule> {
        check(&*self.store, rule)?;
        if let Some(fallback) = &self.fallback {
            check(fallback, rule)?;
        }
        Ok(())
    }
}
