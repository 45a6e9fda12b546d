//! [`Rule`]: which requests a policy applies to, how its key is built and
//! what a request costs.

use std::fmt;
use std::num::{NonZeroU64, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::request::Parts;
use http::{Method, StatusCode};
#[cfg(all(feature = "redis", feature = "serde"))]
use tollgate_budget::Algorithm;
use tollgate_budget::{Policy, Unit};

use super::exempt::Exemption;
use super::invalid::Problem;
use super::plans::{Entry, Plans};
use super::route::{RouteMatch, RoutePattern};
use crate::identity::{KeyPart, MissingPrincipal, Routed};

/// A cost computed from the request.
pub type CostFn = dyn Fn(&Parts) -> Result<u64, CostError> + Send + Sync;

/// Why a cost could not be computed; answered with `400 Bad Request`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CostError(pub String);

/// What a request costs, in the rule policy's unit. Built with its
/// constructors or variants; match it with a `_` arm (new ways to cost a
/// request may come).
#[derive(Clone)]
#[non_exhaustive]
pub enum Cost {
    /// A fixed cost (default: 1).
    Fixed(NonZeroU64),
    /// The declared `Content-Length` in units of `unit_bytes`, rounded up,
    /// at least 1. A request without `Content-Length` is answered
    /// `411 Length Required`; one whose cost exceeds the capacity never fits
    /// and is answered `413 Content Too Large`.
    ContentLength {
        /// Bytes per unit of cost (1 for bytes, 1024 for KiB).
        unit_bytes: NonZeroU64,
    },
    /// A cost computed from the request head, in `unit`. Zero or an error
    /// is answered `400 Bad Request`.
    Computed {
        /// What one unit of the computed cost stands for.
        unit: Unit,
        /// The computation.
        cost: Arc<CostFn>,
    },
}

impl Cost {
    /// One unit per request.
    pub const ONE: Cost = Cost::Fixed(NonZeroU64::MIN);

    /// The content length in KiB, rounded up, at least 1.
    pub fn content_kib() -> Self {
        Cost::ContentLength {
            unit_bytes: NonZeroU64::new(1024).unwrap_or(NonZeroU64::MIN),
        }
    }

    /// The content length in bytes, at least 1.
    pub fn content_bytes() -> Self {
        Cost::ContentLength {
            unit_bytes: NonZeroU64::MIN,
        }
    }

    /// A cost computed by `f` from the request head, in `unit` (e.g.
    /// `Unit::Other("rows".into())`), which names the cost in refusals and
    /// in the `RateLimit-Policy` field.
    pub fn computed(
        unit: Unit,
        f: impl Fn(&Parts) -> Result<u64, CostError> + Send + Sync + 'static,
    ) -> Self {
        Cost::Computed {
            unit,
            cost: Arc::new(f),
        }
    }

    /// The unit this cost counts in, when it is not one request:
    /// `content-bytes`, `content-kib` (or `content-N-bytes`) for content
    /// costs, the named unit for computed ones.
    pub fn unit(&self) -> Option<Unit> {
        match self {
            Cost::Fixed(_) => None,
            Cost::ContentLength { unit_bytes } => Some(match unit_bytes.get() {
                1 => Unit::Bytes,
                1024 => Unit::Other("content-kib".into()),
                n => Unit::Other(format!("content-{n}-bytes").into()),
            }),
            Cost::Computed { unit, .. } => Some(unit.clone()),
        }
    }

    #[inline]
    pub(crate) fn of(&self, parts: &Parts) -> Result<u64, CostRefusal> {
        // The common cost is fixed: answered here, inlined where it is
        // asked, without a call.
        match self {
            Cost::Fixed(n) => Ok(n.get()),
            _ => self.of_request(parts),
        }
    }

    /// A cost read from the request: its length, or the application's.
    fn of_request(&self, parts: &Parts) -> Result<u64, CostRefusal> {
        match self {
            Cost::Fixed(n) => Ok(n.get()),
            Cost::ContentLength { unit_bytes } => {
                let Some(value) = parts.headers.get(http::header::CONTENT_LENGTH) else {
                    return Err(CostRefusal::LengthRequired);
                };
                let len: u64 = value
                    .to_str()
                    .ok()
                    .filter(|s| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| {
                        CostRefusal::Invalid("Content-Length is not a valid length".into())
                    })?;
                Ok(len.div_ceil(unit_bytes.get()).max(1))
            }
            Cost::Computed { cost: f, .. } => match f(parts) {
                Ok(0) => Err(CostRefusal::Invalid(
                    "computed cost is 0; a cost must be positive".into(),
                )),
                Ok(n) => Ok(n),
                Err(e) => Err(CostRefusal::Invalid(e.0)),
            },
        }
    }

    /// The status for a cost that can never fit: 413 for content costs,
    /// 400 otherwise. Neither carries `Retry-After`: waiting cannot help.
    pub(crate) fn never_fits_status(&self) -> StatusCode {
        match self {
            Cost::ContentLength { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// How a rule shapes ([`Rule::shape`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shaping {
    /// The longest a request is held.
    pub(crate) max_delay: Duration,
    /// How many requests of one key may wait at once.
    pub(crate) per_key: NonZeroUsize,
}

/// Which response statuses charge a rule that is charged after the
/// response ([`Rule::charge_only_when`]).
#[derive(Clone)]
pub(crate) struct StatusFilter(Arc<dyn Fn(StatusCode) -> bool + Send + Sync>);

impl StatusFilter {
    pub(crate) fn matches(&self, status: StatusCode) -> bool {
        (self.0)(status)
    }
}

impl fmt::Debug for StatusFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StatusFilter(..)")
    }
}

pub(crate) enum CostRefusal {
    LengthRequired,
    Invalid(String),
}

impl fmt::Debug for Cost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cost::Fixed(n) => write!(f, "Fixed({n})"),
            Cost::ContentLength { unit_bytes } => {
                write!(f, "ContentLength({unit_bytes} bytes per unit)")
            }
            Cost::Computed { unit, .. } => write!(f, "Computed(in {})", unit.as_str()),
        }
    }
}

/// One limit: a policy, the requests it applies to, how its key is built
/// and what a request costs.
///
/// # Which requests a rule applies to
///
/// - **Methods** ([`Rule::on_method`], repeatable): a rule on `GET` also
///   applies to `HEAD`, because axum answers `HEAD` with the `GET` handler;
///   a rule can still name `HEAD` alone.
/// - **Routes** ([`Rule::on_route`], repeatable): axum 0.8 patterns such as
///   `/items/{id}` or `/files/{*path}`, checked when the rule is built
///   (axum 0.7's `:id` and `*rest` are refused with the fix). A pattern is
///   compared with axum's `MatchedPath`, which is the *full* path of the
///   route, nest prefix included (`/api/items/{id}` under
///   `nest("/api", ..)`). Two situations would otherwise make a rule apply
///   to nothing, and in both the rule applies rather than not at all
///   (limiting too much is safer than not limiting), and tollgate logs an
///   error once, naming the rule and the fix:
///   - the layer sits inside a router nested at `N` (axum's `NestedPath`)
///     and the `MatchedPath` is `N` followed by the pattern (the pattern
///     lacks the nest prefix): the rule applies to that route;
///   - the request has no `MatchedPath` (the layer wraps the `Router` from
///     outside, where routing has not happened yet): the pattern is matched
///     against the request path itself, segment by segment, or against its
///     end, since a router nested under a prefix the pattern lacks cannot
///     be told from the path (`/items/{id}` applies to `/api/items/7`, and
///     also to `/admin/items/7`).
///
///   A pattern that the `MatchedPath` only ends with, when the layer does
///   not sit under that nest (it is applied to the outer router, which
///   nests the route under `/api`), does **not** apply: it may name another
///   route that ends the same way (`/export` and `/admin/export`). The
///   first such request logs an error naming the rule and the full path to
///   write.
///
///   Without the `axum` feature there is never a `MatchedPath`, and
///   patterns are always matched against the request path, silently.
///
/// ```
/// use tollgate::{Cost, KeyPart, Policy, Rate, Rule};
/// let export = Rule::new(Policy::token_bucket("export", 3, Rate::per_second(2)).unwrap())
///     .on_route("/export")
///     .on_method(http::Method::POST)
///     .keyed_by([KeyPart::Account, KeyPart::Operation]);
/// let upload = Rule::per_account(Policy::token_bucket("upload", 1024, Rate::per_second(256)).unwrap())
///     .on_route("/upload")
///     .with_cost(Cost::content_kib());
/// ```
#[derive(Debug, Clone)]
pub struct Rule {
    /// The default policy; `plans` may hold others of the same budget.
    pub(crate) policy: Policy,
    plans: Option<Arc<Plans>>,
    /// The first problem a builder call found ([`Rule::on_route`],
    /// [`Rule::plan`], ...), reported when a layer is built with the rule.
    invalid: Option<Arc<Problem>>,
    routes: Vec<RoutePattern>,
    methods: Option<Vec<Method>>,
    pub(crate) key: Vec<KeyPart>,
    pub(crate) cost: Cost,
    pub(crate) missing_principal: MissingPrincipal,
    pub(crate) exemptions: Vec<Exemption>,
    pub(crate) dry_run: bool,
    /// Charged only after a response whose status matches.
    pub(crate) charge_when: Option<StatusFilter>,
    /// Delay requests up to a bound instead of refusing them.
    pub(crate) shaping: Option<Shaping>,
    /// Set once a misplaced route (matched only by its tail) was reported,
    /// so that the error is logged once per rule, not per request. Shared
    /// by clones of the rule: they are the same rule.
    reported_suffix: Arc<AtomicBool>,
    /// Set once a route that only ends with one of the rule's patterns was
    /// reported (see [`Rule::report_ends_with`]).
    reported_ends_with: Arc<AtomicBool>,
}

/// Whether, and how, a rule applies to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applies<'r> {
    /// Not to this request.
    No,
    /// Yes; the rule names no route, or axum matched one of its routes.
    Yes,
    /// Yes, by a fallback: `route` matched the request path (there is no
    /// `MatchedPath`) or only the tail of the `MatchedPath`.
    ByFallback {
        /// The pattern that matched.
        route: &'r str,
        /// How it matched.
        how: RouteMatch,
    },
}

impl Rule {
    /// A rule for every request, with one key shared by all of them (a
    /// global limit) and cost 1. Narrow it with the builder methods.
    pub fn new(policy: Policy) -> Self {
        Self {
            policy,
            plans: None,
            invalid: None,
            routes: Vec::new(),
            methods: None,
            key: Vec::new(),
            cost: Cost::ONE,
            missing_principal: MissingPrincipal::Reject,
            exemptions: Vec::new(),
            dry_run: false,
            charge_when: None,
            shaping: None,
            reported_suffix: Arc::new(AtomicBool::new(false)),
            reported_ends_with: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A rule keyed by client address.
    pub fn per_client_ip(policy: Policy) -> Self {
        Self::new(policy).keyed_by([KeyPart::ClientIp])
    }

    /// A rule keyed by (tenant, account).
    pub fn per_account(policy: Policy) -> Self {
        Self::new(policy).keyed_by([KeyPart::Account])
    }

    /// A rule keyed by (tenant, account, operation).
    pub fn per_account_operation(policy: Policy) -> Self {
        Self::new(policy).keyed_by([KeyPart::Account, KeyPart::Operation])
    }

    /// Applies only to requests of the route `route`, an axum 0.8 pattern
    /// such as `/users/{id}` (see [which requests a rule applies
    /// to](Rule#which-requests-a-rule-applies-to)). Repeat to add routes.
    ///
    /// A pattern axum 0.8 would not accept, e.g. axum 0.7's `/items/:id`,
    /// makes the rule invalid: the layer's
    /// [`build`](crate::rate_limit::RateLimitBuilder::build) (or a
    /// [`RulesHandle`](crate::RulesHandle) change) returns an
    /// [`InvalidRule`](crate::InvalidRule) naming the fix.
    #[must_use]
    pub fn on_route(mut self, route: &str) -> Self {
        match RoutePattern::parse(route) {
            Ok(pattern) => self.routes.push(pattern),
            Err(e) => self.keep_first_problem(e.into()),
        }
        self
    }

    /// Keeps the first problem a builder call found, for the layer's
    /// `build` to report; later calls still apply, so that the rule reads
    /// as written.
    fn keep_first_problem(&mut self, problem: Problem) {
        if self.invalid.is_none() {
            self.invalid = Some(Arc::new(problem));
        }
    }

    /// The first problem of the rule, if any.
    pub(crate) fn invalid(&self) -> Option<&Arc<Problem>> {
        self.invalid.as_ref()
    }

    /// Applies only to requests with `method` (repeat for several). A rule
    /// on `GET` also applies to `HEAD`, as axum routes it.
    #[must_use]
    pub fn on_method(mut self, method: Method) -> Self {
        self.methods.get_or_insert_with(Vec::new).push(method);
        self
    }

    /// Sets the key components. The policy's name is not one of them: a
    /// store keeps the budgets of different policy names (and units) apart
    /// by itself, so rules keyed alike never share a budget.
    #[must_use]
    pub fn keyed_by(mut self, parts: impl IntoIterator<Item = KeyPart>) -> Self {
        self.key = parts.into_iter().collect();
        self
    }

    /// Sets the cost of a request. The policy takes the cost's unit
    /// ([`Cost::unit`]) unless it names a unit of its own, so that refusals
    /// and the `RateLimit-Policy` field never call bytes "requests" (the
    /// policies of [plans and overrides](Rule::plan) too).
    #[must_use]
    pub fn with_cost(mut self, cost: Cost) -> Self {
        if let Some(unit) = cost.unit() {
            let unit_for = |p: &mut Policy| {
                if *p.unit() == Unit::Requests {
                    *p = p.clone().with_unit(unit.clone());
                }
            };
            unit_for(&mut self.policy);
            if let Some(plans) = &mut self.plans {
                Arc::make_mut(plans).policies_mut().for_each(unit_for);
            }
        }
        self.cost = cost;
        self
    }

    /// Uses `policy` for principals on `plan` ([`Principal::with_plan`](crate::Principal::with_plan)),
    /// instead of the rule's own policy, which stays the default (for
    /// other plans, no plan, and requests without a principal).
    ///
    /// Every policy of a rule is one budget per key: `policy` must have the
    /// rule's policy name (and unit), and a principal whose plan changes
    /// keeps what it has spent, converted exactly to the new plan's numbers
    /// ([`carry_over`](crate::store::algorithm::carry_over)): an upgrade
    /// never forgets what was spent and a downgrade never gives a burst.
    /// Which policy applies, first match wins: the account's override
    /// ([`Rule::for_account`]), the tenant's ([`Rule::for_tenant`]), the
    /// plan [`Rule::plan_from`] names, the principal's plan, the default.
    /// A plan no policy was added for gets the default. A plan (tenant,
    /// account) given twice on one rule is an error; change one at runtime
    /// with [`RulesHandle::set_plan`](crate::RulesHandle::set_plan).
    ///
    /// ```
    /// use tollgate::{Policy, Rate, Rule};
    /// let export = Rule::per_account_operation(Policy::token_bucket("export", 3, Rate::per_second(2)).unwrap())
    ///     .on_route("/export")
    ///     .plan("pro", Policy::token_bucket("export", 10, Rate::per_second(5)).unwrap())
    ///     .for_tenant("internal", Policy::token_bucket("export", 1000, Rate::per_second(500)).unwrap());
    /// ```
    ///
    /// A plan's policy with another name or unit than the rule's, or a
    /// plan given twice, makes the rule invalid: the layer's
    /// [`build`](crate::rate_limit::RateLimitBuilder::build) returns an
    /// [`InvalidRule`](crate::InvalidRule).
    #[must_use]
    pub fn plan(self, plan: &str, policy: Policy) -> Self {
        self.add_policy(Entry::Plan(plan), policy)
    }

    /// Uses `policy` for every principal of `tenant` (see [`Rule::plan`]
    /// for the order and the rules every policy of a rule follows).
    #[must_use]
    pub fn for_tenant(self, tenant: &str, policy: Policy) -> Self {
        self.add_policy(Entry::Tenant(tenant), policy)
    }

    /// Uses `policy` for the account `account` of `tenant` (see
    /// [`Rule::plan`]).
    #[must_use]
    pub fn for_account(self, tenant: &str, account: &str, policy: Policy) -> Self {
        self.add_policy(Entry::Account(tenant, account), policy)
    }

    /// Names the plan of a request with `choose`, for anything the
    /// principal's plan does not say (e.g. a plan an extension of your own
    /// carries). A name no [`Rule::plan`] was added for, or `None`, falls
    /// through to the principal's plan, then the default; the overrides
    /// for an account or tenant come first. `choose` runs per request:
    /// keep it to a lookup; the policies it picks from were checked when
    /// they were added.
    ///
    /// `choose` sees the whole request head, **including what the client
    /// writes**: choosing a plan by a header or query parameter lets any
    /// client pick the most generous plan. Read extensions your own trusted
    /// layers set (the principal, a verified token's claims).
    #[must_use]
    pub fn plan_from(
        mut self,
        choose: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(self.plans.get_or_insert_with(Default::default))
            .choose_with(Arc::new(choose));
        self
    }

    /// The same rule with `policy` for `plan`, given or not before
    /// ([`RulesHandle::set_plan`](crate::RulesHandle::set_plan)); `policy`
    /// is this rule's budget (checked by the caller).
    pub(crate) fn with_plan_policy(self, plan: &str, policy: Policy) -> Self {
        self.with_entry_policy(Entry::Plan(plan), policy)
    }

    #[cfg(all(feature = "redis", feature = "serde"))]
    /// Every number this rule may charge its budget under, as text: the
    /// default policy's and each plan's and override's, sorted, so that
    /// two instances with the same numbers write the same text whatever
    /// order they were added in. For telling instances of a fleet that
    /// charge one budget under different numbers apart.
    pub(crate) fn numbers_text(&self) -> String {
        let mut text = numbers(&self.policy);
        for (place, policy) in self.plans.iter().flat_map(|p| p.sorted()) {
            text.push_str("; ");
            text.push_str(&place);
            text.push(' ');
            text.push_str(&numbers(policy));
        }
        text
    }

    /// The same rule with `policy` for `entry` (a plan, tenant or
    /// account), given or not before; `policy` is this rule's budget
    /// (checked by the caller).
    pub(crate) fn with_entry_policy(mut self, entry: Entry<'_>, policy: Policy) -> Self {
        let policy = self.in_rule_unit(policy);
        Arc::make_mut(self.plans.get_or_insert_with(Default::default)).set(entry, policy);
        self
    }

    fn add_policy(mut self, entry: Entry<'_>, policy: Policy) -> Self {
        let policy = self.in_rule_unit(policy);
        let plans = Arc::make_mut(self.plans.get_or_insert_with(Default::default));
        if let Err(e) = plans.add(&self.policy, entry, policy) {
            self.keep_first_problem(e.into());
        }
        self
    }

    /// The policy for this request: a plan's or an override's, or the
    /// rule's own.
    pub(crate) fn policy_for(&self, parts: &Parts) -> &Policy {
        self.plans
            .as_deref()
            .and_then(|plans| plans.policy_for(parts))
            .unwrap_or(&self.policy)
    }

    /// Every policy of the rule: its own, then its plans' and overrides'.
    pub(crate) fn policies(&self) -> impl Iterator<Item = &Policy> {
        std::iter::once(&self.policy).chain(self.plans.iter().flat_map(|p| p.policies()))
    }

    /// What to do when the key needs a principal and there is none.
    #[must_use]
    pub fn when_no_principal(mut self, what: MissingPrincipal) -> Self {
        self.missing_principal = what;
        self
    }

    /// Does not charge requests that `exemption` matches (repeat to add
    /// more; any one exempts). See [`Exemption`] for what each kind trusts.
    #[must_use]
    pub fn exempt(mut self, exemption: Exemption) -> Self {
        self.exemptions.push(exemption);
        self
    }

    /// Dry-run (shadow) mode: the rule is decided and, while its budget
    /// lasts, charged as usual, but a request it would refuse for lack of
    /// budget goes through, spends nothing from this rule, and is logged
    /// and counted in `tollgate_dry_run_denied_cost_total{policy}` (see
    /// [dry-run rules](super#dry-run-rules) for how they mix with enforced
    /// ones). Refusals about the request itself (no principal, no
    /// `Content-Length`, an invalid cost, a cost above the policy's
    /// capacity, which no budget could ever take) are still given.
    #[must_use]
    pub fn dry_run(mut self, yes: bool) -> Self {
        self.dry_run = yes;
        self
    }

    /// Charges the rule only for requests whose response status satisfies
    /// `charged` (e.g. failed logins:
    /// `|status| status == StatusCode::UNAUTHORIZED`), and never admits
    /// more of them than its budget, however many arrive at once.
    ///
    /// When the request is checked, the rule's cost is **reserved**: charged
    /// in the same all-or-nothing store decision as the request's other
    /// rules, so when its budget is spent the request is refused with
    /// `429` (spending nothing anywhere, like every refusal for lack of
    /// budget). When the inner service's response head comes, the
    /// reservation is settled: confirmed if its status matches
    /// ([`Store::confirm`](crate::Store::confirm)), given back
    /// otherwise ([`Store::refund`](crate::Store::refund)): a
    /// successful login costs nothing. So at most as many requests of one
    /// key can be in flight on the rule as its budget has units left (a
    /// budget of 3 failed logins lets 3 logins per key run at once; the
    /// fourth is `429` until one of them answers), and no matching response
    /// ever goes unpaid, whether the requests come one at a time, pipelined
    /// or as HTTP/2 streams.
    ///
    /// Exact, on both stores: while units are reserved, a token bucket
    /// refills to its capacity less them, so a reservation given back
    /// restores exactly the credit the bucket would have had without it
    /// (it never returns units the capacity would have cut off), and a
    /// refusal's `Retry-After` counts on them lapsing if it must. Units
    /// not settled lapse as confirmed between one and two minutes after
    /// the charge (reservations are counted by minute,
    /// [`MAX_RESERVATION`](crate::store::algorithm::MAX_RESERVATION), and
    /// a minute's lapse when the next one ends, however many are made
    /// later). A bucket with units reserved does not shape.
    ///
    /// - Where the layer answers on its own account (its `401` for a
    ///   missing principal, `411`, `413`, `400`), the outcome is known
    ///   before anything is called: the rule is charged at once if that
    ///   status matches, with no reservation, and not at all otherwise.
    /// - A request whose response never comes (the client went away, the
    ///   future was dropped, the inner service failed) has its reservation
    ///   confirmed: the attempt counts. One dropped before the inner
    ///   service was called (held by another rule's shaping, and its
    ///   client gone) has it given back: nothing was attempted.
    /// - A request held by shaping keeps its reservation while it waits,
    ///   and is settled by its response like any other.
    /// - The statuses are those of the inner service's response (or of this
    ///   layer's own refusals, above), never of a `429` for lack of budget.
    /// - Dry-run and exemptions apply as to any rule; a rule charged by
    ///   outcome does not shape.
    /// - A settlement that fails (Redis unreachable) leaves the charge
    ///   spent, to lapse as confirmed, counted as
    ///   `tollgate_store_errors_total{outcome="refund_lost"}` (or
    ///   `confirm_lost`); refunds are counted in
    ///   `tollgate_refunded_cost_total{policy}`.
    ///
    /// The store must give charges back ([`Store::can_refund`](crate::Store::can_refund):
    /// [`MemoryStore`](crate::MemoryStore) and the Redis store do);
    /// [`RateLimitBuilder::build`](crate::rate_limit::RateLimitBuilder::build)
    /// refuses the rule otherwise.
    #[must_use]
    pub fn charge_only_when(
        mut self,
        charged: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.charge_when = Some(StatusFilter(Arc::new(charged)));
        self
    }

    /// Shapes instead of refusing: a request this rule's budget cannot take
    /// now but can within `max_delay` is held until the exact instant it
    /// fits, its credit reserved now; beyond `max_delay` it is refused with
    /// `429` as usual (with the exact wait in `Retry-After`). At most
    /// `per_key` requests of one key wait at once (and at most
    /// [`RateLimitBuilder::max_waiting`](crate::rate_limit::RateLimitBuilder::max_waiting)
    /// in the whole layer); beyond that a request is decided as if the rule
    /// did not shape. The store enforces the per-key bound too, atomically:
    /// a request may wait no longer than `per_key` of its own cost take to
    /// refill, so a burst decided all at once (on Redis, many in flight to
    /// the store together) is refused beyond it without spending anything.
    /// See [shaping](super#shaping-delay-instead-of-refusing).
    ///
    /// Token buckets only (every policy of the rule, plans included), on a
    /// store that can shape ([`Store::can_shape`](crate::Store::can_shape));
    /// [`RateLimitBuilder::build`](crate::rate_limit::RateLimitBuilder::build)
    /// refuses the rule otherwise, and a `max_delay` of zero. Waits beyond
    /// [`Charge::MAX_DELAY`](crate::store::Charge::MAX_DELAY) (about 23
    /// days) are that long. A dry-run rule, and a rule charged after the
    /// response, do not shape.
    #[must_use]
    pub fn shape(mut self, max_delay: Duration, per_key: NonZeroUsize) -> Self {
        self.shaping = Some(Shaping { max_delay, per_key });
        self
    }

    /// The rule's policy (the default, when it has [plans](Rule::plan)).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The same rule with `policy` as its default policy; plans and
    /// overrides are kept (for [`RulesHandle::set_policy`](crate::RulesHandle::set_policy)).
    pub(crate) fn with_default_policy(mut self, policy: Policy) -> Self {
        self.policy = self.in_rule_unit(policy);
        self
    }

    /// `policy` counting in the rule's unit, unless it names one of its own.
    pub(crate) fn in_rule_unit(&self, policy: Policy) -> Policy {
        if *policy.unit() == Unit::Requests && *self.policy.unit() != Unit::Requests {
            policy.with_unit(self.policy.unit().clone())
        } else {
            policy
        }
    }

    /// Whether the rule applies to the request `parts`; `routed` is where
    /// routing put it, looked up by the first rule that names routes and
    /// kept for the others.
    #[inline]
    pub(crate) fn applies_to<'p>(
        &self,
        parts: &'p Parts,
        routed: &mut Option<Routed<'p>>,
    ) -> Applies<'_> {
        // A rule for every method and route applies to all, answered
        // where it is asked, without a call.
        if self.methods.is_none() && self.routes.is_empty() {
            return Applies::Yes;
        }
        self.applies_by_route(parts, routed)
    }

    /// [`applies_to`](Self::applies_to) for a rule that names methods or
    /// routes.
    fn applies_by_route<'p>(
        &self,
        parts: &'p Parts,
        routed: &mut Option<Routed<'p>>,
    ) -> Applies<'_> {
        if let Some(methods) = &self.methods {
            let head_as_get = parts.method == Method::HEAD && methods.contains(&Method::GET);
            if !head_as_get && !methods.contains(&parts.method) {
                return Applies::No;
            }
        }
        if self.routes.is_empty() {
            return Applies::Yes;
        }
        let Routed { matched, nested } = *routed.get_or_insert_with(|| Routed::of(parts));
        let mut fallback = None;
        let mut ends_with = None;
        for route in &self.routes {
            match route.matches(matched, nested, parts.uri.path()) {
                RouteMatch::Exact => return Applies::Yes,
                RouteMatch::No => {}
                RouteMatch::EndsWith => ends_with = ends_with.or(Some(route.as_str())),
                how => {
                    fallback.get_or_insert(Applies::ByFallback {
                        route: route.as_str(),
                        how,
                    });
                }
            }
        }
        if let (None, Some(route), Some(matched)) = (fallback, ends_with, matched) {
            self.report_ends_with(route, matched);
        }
        fallback.unwrap_or(Applies::No)
    }

    /// Logs, once per rule, that axum matched a route that only ends with
    /// one of the rule's patterns (which then does not apply).
    fn report_ends_with(&self, route: &str, matched: &str) {
        if !self.reported_ends_with.swap(true, Ordering::Relaxed) {
            tracing::error!(
                policy = self.policy.name(),
                route,
                matched,
                "tollgate rule {:?} names route {route:?}; the router matched {matched:?}, \
                 which only ends with it, and the rule does not apply there. If the rule is \
                 meant for it (the route is nested under a prefix), write the full path, \
                 .on_route({matched:?})",
                self.policy.name()
            );
        }
    }

    /// Logs, once per rule, that a route matched only the tail of axum's
    /// `MatchedPath`.
    pub(crate) fn report_suffix(&self, route: &str, matched: &str) {
        if !self.reported_suffix.swap(true, Ordering::Relaxed) {
            tracing::error!(
                policy = self.policy.name(),
                route,
                matched,
                "tollgate rule {:?} names route {route:?}, but the router matched {matched:?}: \
                 the layer sits inside a nested router. The rule applies to {matched:?}; \
                 write the full path, .on_route({matched:?}), to say so",
                self.policy.name()
            );
        }
    }
}

#[cfg(all(feature = "redis", feature = "serde"))]
/// A policy's numbers as exact integers (a refill as scaled units per
/// nanosecond over units per token: two rates that refill alike read
/// alike), without its name and unit.
fn numbers(policy: &Policy) -> String {
    match policy.algorithm() {
        Algorithm::TokenBucket(b) => format!(
            "token bucket {} {}/{} {:?}",
            b.capacity(),
            b.units_per_nanosecond(),
            b.units_per_token(),
            b.initial()
        ),
        Algorithm::FixedWindow(w) => {
            format!("fixed window {} {}", w.limit(), w.length().as_nanos())
        }
        Algorithm::SlidingWindow(w) => {
            format!("sliding window {} {}", w.limit(), w.length().as_nanos())
        }
    }
}
