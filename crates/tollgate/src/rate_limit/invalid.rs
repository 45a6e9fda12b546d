//! [`InvalidRule`]: what makes a rule unusable, found by the rule's
//! builder calls or by the store, and reported once, naming the rule.

use std::sync::Arc;

use tollgate_budget::StoreError;

use super::plans::InvalidPlan;
use super::route::InvalidRoute;

/// A rule that cannot be used, refused when a layer is built
/// ([`RateLimitBuilder::build`](super::RateLimitBuilder::build)) or its
/// rules change ([`RulesHandle`](crate::RulesHandle)): a route axum 0.8
/// would not accept, a plan or override with another budget than the
/// rule's or given twice, or a policy (or [`Rule::charge_only_when`](super::Rule::charge_only_when),
/// [`Rule::shape`](super::Rule::shape)) the store cannot hold. Names the rule by its policy
/// and says what to change.
#[derive(Debug, thiserror::Error)]
#[error("rule {policy:?}: {problem}")]
pub struct InvalidRule {
    policy: String,
    problem: Arc<Problem>,
}

/// What is wrong with an [`InvalidRule`].
#[derive(Debug, thiserror::Error)]
pub(crate) enum Problem {
    #[error(transparent)]
    Route(#[from] InvalidRoute),
    #[error(transparent)]
    Plan(#[from] InvalidPlan),
    /// Wrong whatever the store (e.g. shaping a window).
    #[error("{0}")]
    Rule(String),
    #[error("this store cannot hold it: {0}")]
    Store(StoreError),
}

impl InvalidRule {
    pub(crate) fn new(policy: &str, problem: impl Into<Problem>) -> Self {
        Self {
            policy: policy.to_owned(),
            problem: Arc::new(problem.into()),
        }
    }

    /// A rule's own problem, kept by the rule from the builder call that
    /// found it.
    pub(crate) fn of_rule(policy: &str, problem: Arc<Problem>) -> Self {
        Self {
            policy: policy.to_owned(),
            problem,
        }
    }

    /// The name of the refused rule's policy.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// Whether the store (or the fallback store) refused the rule, rather
    /// than the rule being wrong in itself: the same rule may suit another
    /// store.
    pub fn is_unsupported_by_store(&self) -> bool {
        matches!(*self.problem, Problem::Store(_))
    }
}
