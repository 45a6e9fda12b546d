//! [`Principal`]: the verified identity an authentication layer inserts.

use std::fmt;
use std::sync::Arc;

/// An authenticated identity, inserted into request extensions by an
/// authentication layer after it has verified the caller's credential.
///
/// The rate limiter reads only this for per-account keys. Use stable ids,
/// never secrets: the credential id names a credential, it is not the
/// credential.
///
/// A plan (tier) may come with it ([`Principal::with_plan`]): rules with
/// [plans](crate::Rule::plan) choose their policy by it. It is never part
/// of a key, so a principal whose plan changes keeps its budget (converted
/// to the new plan's numbers).
///
/// ```
/// use tollgate::Principal;
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(
///     Principal::new("north", "alice").with_credential("key-1").with_plan("pro"),
/// );
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal {
    tenant: Arc<str>,
    account: Arc<str>,
    credential: Option<Arc<str>>,
    plan: Option<Arc<str>>,
}

impl Principal {
    /// The account `account` of tenant `tenant`.
    pub fn new(tenant: impl Into<Arc<str>>, account: impl Into<Arc<str>>) -> Self {
        Self {
            tenant: tenant.into(),
            account: account.into(),
            credential: None,
            plan: None,
        }
    }

    /// The same principal, on the plan (tier) `plan`, as your
    /// authentication layer knows it (e.g. from the account's record or a
    /// verified token's claim; never from a header the caller sends).
    #[must_use]
    pub fn with_plan(mut self, plan: impl Into<Arc<str>>) -> Self {
        self.plan = Some(plan.into());
        self
    }

    /// The plan, if the authenticator set one.
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// The same principal, authenticated with the credential whose stable id
    /// is `id`.
    #[must_use]
    pub fn with_credential(mut self, id: impl Into<Arc<str>>) -> Self {
        self.credential = Some(id.into());
        self
    }

    /// The tenant id.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The account id, unique within the tenant.
    pub fn account(&self) -> &str {
        &self.account
    }

    /// The credential's stable id, if the authenticator set one.
    pub fn credential(&self) -> Option<&str> {
        self.credential.as_deref()
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Principal")
            .field("tenant", &self.tenant)
            .field("account", &self.account)
            .field("credential", &self.credential)
            .field("plan", &self.plan)
            .finish()
    }
}
