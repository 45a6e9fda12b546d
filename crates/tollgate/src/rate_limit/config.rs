//! What a [`RateLimitLayer`](super::RateLimitLayer) is made of, shared by
//! the layer, its services and its [`RulesHandle`](super::RulesHandle):
//! the configuration, what a store failure means, and the check of a rule
//! against the store.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arc_swap::ArcSwap;
use http::HeaderValue;
use tollgate_budget::{Algorithm, DynStore, Store, StoreError, StoreErrorKind, Unit, check_name};

use super::invalid::{InvalidRule, Problem};
use super::shaping::Waiters;
use super::{Exemption, Rule};
use crate::ClientIpResolver;
use crate::response::Shape;

/// The rules of a layer, swapped whole: a request reads one set, start to
/// end.
pub(crate) type RuleSet = Arc<ArcSwap<Vec<Rule>>>;

/// What [`RulesHandle::apply`](super::RulesHandle::apply) has put in
/// force: the rules it started from, and the set.
#[derive(Debug, Default)]
pub(crate) struct Applied {
    /// `None` until a set is applied.
    #[cfg(feature = "serde")]
    pub(crate) base: Option<Arc<Vec<Rule>>>,
    #[cfg(feature = "serde")]
    pub(crate) set: super::data::PolicySet,
}

/// What the layer does when the store fails or times out.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Refuse with `503 Service Unavailable` and `Cache-Control: no-store`
    /// (gRPC: UNAVAILABLE). Never admits beyond the budget (default).
    #[default]
    FailClosed,
    /// Admit the request, and count and log that it was admitted unchecked.
    FailOpen,
    /// Ask another store (e.g. a local [`MemoryStore`](crate::MemoryStore)); if it
    /// fails too, fail closed.
    Fallback(Arc<dyn DynStore>),
}

impl fmt::Debug for OnStoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OnStoreError::FailClosed => f.write_str("FailClosed"),
            OnStoreError::FailOpen => f.write_str("FailOpen"),
            OnStoreError::Fallback(_) => f.write_str("Fallback(..)"),
        }
    }
}

/// A copy starts with nothing reported: it may be a different layer.
impl<St> Clone for Config<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            rules: self.rules.clone(),
            // Shared with the rules it goes with.
            applied: self.applied.clone(),
            resolver: self.resolver.clone(),
            on_store_error: self.on_store_error.clone(),
            headers_on_admitted: self.headers_on_admitted,
            exemptions: self.exemptions.clone(),
            dry_run: self.dry_run,
            www_authenticate: self.www_authenticate.clone(),
            log_level: self.log_level,
            shape: self.shape.clone(),
            max_waiting: self.max_waiting,
            waiters: Arc::default(),
            reported_no_matched_path: AtomicBool::new(false),
        }
    }
}

pub(crate) struct Config<St> {
    pub(crate) store: Arc<St>,
    /// Swapped whole by a [`RulesHandle`](super::RulesHandle); every builder call that changes
    /// the rules makes a new set, so that services already made (and
    /// handles already taken) keep theirs.
    pub(crate) rules: RuleSet,
    /// What [`RulesHandle::apply`](super::RulesHandle::apply) has put in
    /// force, shared by every handle of the layer.
    pub(crate) applied: Arc<std::sync::Mutex<Applied>>,
    pub(crate) resolver: ClientIpResolver,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) headers_on_admitted: bool,
    pub(crate) exemptions: Vec<Exemption>,
    /// Every rule is dry-run.
    pub(crate) dry_run: bool,
    /// The challenge sent with `401` (RFC 9110 requires one).
    pub(crate) www_authenticate: HeaderValue,
    /// The level refusals are logged at.
    pub(crate) log_level: tracing::Level,
    /// The application's refusal body writer, if any.
    pub(crate) shape: Option<Shape>,
    /// At most this many requests held by shaping rules at once.
    pub(crate) max_waiting: usize,
    /// The requests shaping rules hold now.
    pub(crate) waiters: Arc<Waiters>,
    /// Set once requests without axum's `MatchedPath` were reported, so the
    /// error is logged once per layer, not per request.
    pub(crate) reported_no_matched_path: AtomicBool,
}

/// Whether `rules` can serve side by side: rules whose policies are one
/// budget (a name and unit) must give it the same numbers, since a key's
/// budget state is one (two rules naming "export" with 3 and 100 would
/// charge one state twice under numbers that flip from call to call).
pub(crate) fn check_together(rules: &[Rule]) -> Result<(), InvalidRule> {
    for (i, later) in rules.iter().enumerate() {
        let clash = rules[..i].iter().find(|earlier| {
            earlier.policy().same_budget(later.policy()) && earlier.policy() != later.policy()
        });
        if let Some(earlier) = clash {
            return Err(InvalidRule::new(
                later.policy().name(),
                Problem::Rule(format!(
                    "another rule has the same budget (policy name and unit) with other \
                     numbers ({} against {}); rules that share a budget must give it the same \
                     numbers: give one of them another policy name",
                    earlier.policy(),
                    later.policy()
                )),
            ));
        }
    }
    Ok(())
}

/// Whether `store` can serve `rule`: every policy of it (plans and
/// overrides too), and [`Rule::charge_only_when`]'s refunds.
pub(crate) fn check(store: &(impl Store + ?Sized), rule: &Rule) -> Result<(), InvalidRule> {
    if let Some(problem) = rule.invalid() {
        return Err(InvalidRule::of_rule(rule.policy().name(), problem.clone()));
    }
    for policy in rule.policies() {
        // A unit is a structured-field string and a metric label, as a
        // name is: `Unit::Other("a\"b")` would break every header.
        if let Unit::Other(unit) = policy.unit() {
            check_name(unit).map_err(|e| {
                InvalidRule::new(
                    rule.policy().name(),
                    Problem::Rule(format!("policy {policy} has an invalid unit: {e}")),
                )
            })?;
        }
    }
    let refuse = |source| InvalidRule::new(rule.policy().name(), Problem::Store(source));
    for policy in rule.policies() {
        store.check_policy(policy).map_err(refuse)?;
    }
    if rule.charge_when.is_some() && !store.can_refund() {
        return Err(refuse(StoreError::new(
            StoreErrorKind::Unsupported,
            "charge_only_when needs a store that can give a charge back (Store::refund): \
             it reserves when the request is checked and gives back when the response \
             does not match",
        )));
    }
    if let Some(shaping) = &rule.shaping {
        let wrong = |what: String| InvalidRule::new(rule.policy().name(), Problem::Rule(what));
        if shaping.max_delay.is_zero() {
            return Err(wrong(
                "shape needs a longest wait above zero (a zero wait shapes nothing)".into(),
            ));
        }
        if !store.can_shape() {
            return Err(refuse(StoreError::new(
                StoreErrorKind::Unsupported,
                "shape needs a store that can reserve credit for later (Store::can_shape)",
            )));
        }
        for policy in rule.policies() {
            let shapes = match policy.algorithm() {
                Algorithm::TokenBucket(b) => b.units_per_nanosecond() <= b.units_per_token(),
                _ => false,
            };
            if !shapes {
                return Err(wrong(format!(
                    "shape needs token buckets refilling at most one token per nanosecond; \
                     {policy} cannot be shaped"
                )));
            }
        }
    }
    Ok(())
}
