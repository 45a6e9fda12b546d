//! The rate-limit pipeline, one way: identity -> rules -> store -> answer.
//!
//! [`plan`] turns a request head into the charges of every applicable rule
//! whose key and cost are known, plus the refusal the layer will give on its
//! own account (no principal, bad cost, a cost that can never fit). The
//! charges go to the store as one all-or-nothing decision ([`decide_now`],
//! or [`decide`] when the store needs I/O), and [`conclude`] makes the
//! answer: a lack of budget is `429` whatever else was wrong, a store
//! failure follows the configured outcome, and only an admitted request
//! gets the layer's own refusal (or, without one, the inner service).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderValue, StatusCode};
use smallvec::SmallVec;
use tollgate_budget::{Algorithm, Charge, Decision, DynStore, Outcome, Store, StoreError, Verdict};

use super::config::{Config, OnStoreError};
use super::exempt::any_matches;
use super::route::RouteMatch;
use super::rule::{Applies, CostRefusal, Shaping, StatusFilter};
use super::shaping::{Place, ShapingLine, Wait, WaitKeys};
use crate::identity::{RequestIdentity, Routed};
use crate::observe;
use crate::response::{Answer, Refusal, ratelimit_fields};

/// The `RateLimit-Policy` and `RateLimit` values to add to a response.
/// Boxed: most responses carry none, and a response future holding them
/// inline would be that much larger to move on every path.
pub(crate) type Fields = Option<Box<(HeaderValue, HeaderValue)>>;

/// The charges of one request; most requests have one or two rules, kept
/// inline without an allocation.
pub(crate) type Charges = SmallVec<[Charge; 2]>;

/// The charges of rules charged by outcome ([`Rule::charge_only_when`]):
/// each reserved (made refundable) with the request's other charges, and
/// kept only if the response's status matches. A `Vec`, like every list of
/// a feature most rule sets never use: empty, it allocates nothing, takes
/// three words in the plan and costs a test to drop (an inline `SmallVec`
/// would make every plan larger to move, for a rule that is rarely there).
pub(crate) type Settled = Vec<(Charge, StatusFilter)>;

/// What the head of a request asks of the store.
pub(crate) struct ChargePlan {
    /// Every applicable rule whose key and cost are known: the enforced
    /// ones first, then the dry-run ones.
    pub(crate) charges: Charges,
    /// How many of `charges` (from the start) are enforced.
    pub(crate) enforced: usize,
    /// The charges of rules charged by outcome, reserved among `charges`
    /// (refundable), with the statuses that keep them.
    pub(crate) settled: Settled,
    /// The layer's own refusal, given once the charges are admitted: the
    /// first in rule order.
    pub(crate) refusal: Option<Answer>,
    /// How the request may be held by shaping rules (nothing when none
    /// applies, or the layer refuses it on its own account).
    pub(crate) shaping: ShapePlan,
}

/// What shaping a request needs: the lines it would wait in, and each
/// shaped charge's longest wait. Applied only once the request has its
/// place in line ([`ShapePlan::take_place`]).
#[derive(Default)]
pub(crate) struct ShapePlan {
    keys: WaitKeys,
    waits: Vec<(usize, Duration)>,
}

impl ShapePlan {
    pub(crate) fn is_empty(&self) -> bool {
        self.waits.is_empty()
    }

    /// Takes the request's place in line (the line locked by the caller)
    /// and makes its shaping charges shaped; `None`, and the charges left
    /// unshaped (decided as if no rule shaped), when the line is full or
    /// there is no tokio runtime to hold a request on.
    pub(crate) fn take_place(
        &self,
        line: &mut ShapingLine<'_>,
        max_waiting: usize,
        charges: &mut Charges,
    ) -> Option<Place> {
        if self.is_empty() || tokio::runtime::Handle::try_current().is_err() {
            return None;
        }
        let place = line.enter(&self.keys, max_waiting)?;
        for &(i, wait) in &self.waits {
            charges[i] = charges[i].clone().shaped(wait);
        }
        Some(place)
    }
}

/// What an admitted request gets: the `RateLimit` fields, the wait before
/// it goes on when shaping rules hold it, and what its response's status
/// settles (the reservations of rules charged by outcome).
pub(crate) struct Admit {
    pub(crate) fields: Fields,
    pub(crate) wait: Option<Wait>,
    pub(crate) settle: Option<AfterResponse>,
}

pub(crate) fn charge_plan<St>(config: &Config<St>, parts: &Parts) -> ChargePlan {
    let mut who = RequestIdentity::new(parts, &config.resolver);
    let mut charges = Charges::new();
    // The lists of features most rule sets never use are `Vec`s, which
    // cost nothing while empty (see `Settled`).
    let mut dry: Vec<Charge> = Vec::new();
    // Rules charged by outcome: (charge, statuses, dry-run).
    let mut by_outcome: Vec<(Charge, StatusFilter, bool)> = Vec::new();
    let mut refusal: Option<Answer> = None;
    // Charges of shaping rules, by index, with how they shape.
    let mut shaped: Vec<(usize, Shaping)> = Vec::new();
    let layer_exempt = any_matches(&config.exemptions, &mut who, parts);
    // Where routing put the request, looked up once for every rule that
    // names routes.
    let mut routed: Option<Routed<'_>> = None;
    let rules = config.rules.load();
    for rule in rules.iter() {
        let applies = rule.applies_to(parts, &mut routed);
        if applies == Applies::No {
            continue;
        }
        if layer_exempt || any_matches(&rule.exemptions, &mut who, parts) {
            observe::exempt(rule.policy_for(parts));
            continue;
        }
        let dry_run = config.dry_run || rule.dry_run;
        let route = match applies {
            Applies::No => continue,
            Applies::Yes => None,
            Applies::ByFallback { route, how } => {
                match (how, routed.and_then(|r| r.matched)) {
                    (RouteMatch::Suffix, Some(matched)) => rule.report_suffix(route, matched),
                    _ => report_no_matched_path(config, rule.policy().name(), route),
                }
                Some(route)
            }
        };
        let policy = rule.policy_for(parts);
        let key = match who.key(&rule.key, rule.missing_principal, route) {
            Ok(Some(key)) => key,
            Ok(None) => continue,
            Err(error) => {
                if refusal.is_none() {
                    let by = observe::Refuser::Policy(policy.name());
                    observe::key_refused(&error, by, config.log_level);
                }
                refusal.get_or_insert_with(|| {
                    let mut answer = Answer::for_key(error, policy.name());
                    if answer.challenge.is_some() {
                        answer.challenge = Some(Box::new(config.www_authenticate.clone()));
                    }
                    answer
                });
                continue;
            }
        };
        let cost = match rule.cost.of(parts) {
            Ok(cost) => cost,
            Err(CostRefusal::LengthRequired) => {
                refusal.get_or_insert_with(|| {
                    let why = format!(
                        "policy {:?} charges by content length; send Content-Length",
                        policy.name()
                    );
                    observe::cost_refused(policy.name(), &key, &why, config.log_level);
                    Answer::new(Refusal::LengthRequired, why)
                });
                continue;
            }
            Err(CostRefusal::Invalid(why)) => {
                refusal.get_or_insert_with(|| {
                    observe::cost_refused(policy.name(), &key, &why, config.log_level);
                    Answer::new(Refusal::BadRequest, why)
                });
                continue;
            }
        };
        // A cost that can never fit is refused by dry-run rules too: it
        // says the request is too large for the policy, not that a budget
        // is spent.
        if cost > policy.capacity() {
            // Waiting cannot help: this rule is not charged, the others are.
            let answered = refusal.is_none();
            observe::never_fits(policy, &key, cost, config.log_level, answered);
            refusal.get_or_insert_with(|| {
                Answer::never_fits(policy, cost, rule.cost.never_fits_status())
            });
            continue;
        }
        match (Charge::new(key, policy.clone(), cost), &rule.charge_when) {
            (Ok(charge), Some(when)) => by_outcome.push((charge, when.clone(), dry_run)),
            (Ok(charge), None) if dry_run => dry.push(charge),
            (Ok(charge), None) => {
                if let Some(shaping) = rule.shaping {
                    shaped.push((charges.len(), shaping));
                }
                charges.push(charge);
            }
            (Err(e), _) => {
                refusal.get_or_insert_with(|| Answer::new(Refusal::BadRequest, e.to_string()));
            }
        }
    }
    // Shaping never holds a request the layer refuses on its own account.
    let mut shaping = ShapePlan::default();
    if refusal.is_none() && !shaped.is_empty() {
        shaping.keys = shaped
            .iter()
            .map(|&(i, s)| (line_of(&charges[i]), s.per_key.get()))
            .collect();
        shaping.waits = shaped
            .iter()
            .map(|&(i, s)| (i, longest_wait(&charges[i], s)))
            .collect();
    }
    // Rules charged by outcome: where the layer answers on its own account
    // the outcome is known now, and they are charged only if it matches,
    // with no reservation; otherwise they are reserved with the rest and
    // settled by the response (see `settle`).
    let own = refusal.as_ref().map(|answer| answer.refusal.status());
    let mut settled = Settled::new();
    for (charge, when, dry_run) in by_outcome {
        let charge = match own {
            Some(status) if when.matches(status) => charge,
            Some(_) => continue,
            None => {
                let charge = charge.refundable();
                settled.push((charge.clone(), when));
                charge
            }
        };
        if dry_run {
            dry.push(charge);
        } else {
            charges.push(charge);
        }
    }
    let enforced = charges.len();
    if !dry.is_empty() {
        charges.extend(dry);
    }
    ChargePlan {
        charges,
        enforced,
        settled,
        refusal,
        shaping,
    }
}

/// The line a shaped charge waits in: its policy's name and its key.
fn line_of(charge: &Charge) -> Box<str> {
    format!("{}:{}", charge.policy().name(), charge.key()).into()
}

/// How long a shaped charge may wait: the rule's `max_delay`, and no longer
/// than `per_key` of this request's cost take to refill. So the store itself
/// holds about `per_key` requests of one key in line and refuses the rest at
/// once, spending nothing, even when many are decided at the same time (the
/// layer's count of waiters only sees them once the store has answered).
fn longest_wait(charge: &Charge, shaping: Shaping) -> Duration {
    let Algorithm::TokenBucket(bucket) = charge.policy().algorithm() else {
        return shaping.max_delay;
    };
    let units = u128::from(charge.cost())
        * shaping.per_key.get() as u128
        * u128::from(bucket.units_per_token());
    let ns = units.div_ceil(u128::from(bucket.units_per_nanosecond()));
    shaping
        .max_delay
        .min(Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX)))
}

/// Logs, once per layer, that a rule's route matched a request path that
/// has not been through axum's routing (or a route the router lacks). A
/// plain 404 is not reported: only a path a rule names.
fn report_no_matched_path<St>(config: &Config<St>, policy: &str, route: &str) {
    if cfg!(feature = "axum")
        && !config
            .reported_no_matched_path
            .swap(true, Ordering::Relaxed)
    {
        tracing::error!(
            policy,
            route,
            "tollgate rule {policy:?} names route {route:?}, and a request path matches it, \
             but the request reached the layer without axum's MatchedPath: the layer wraps \
             the Router from outside, before routing (or the router has no such route). \
             Route patterns are matched against the request path instead, and per-operation \
             keys of rules without a route are \"METHOD *\", one budget for every route. \
             Apply the layer with Router::layer (or route_layer) to key by route"
        );
    }
}

/// What [`decide_now`] could settle without waiting.
pub(crate) enum Now {
    /// Admitted (with fields, and a wait when shaped) or refused.
    Decided(Result<Admit, Answer>),
    /// [`decide`] must finish: the store needs I/O (`None`), or it failed
    /// and the configured outcome may need the fallback store.
    Later(Option<StoreError>),
}

/// Decides at once when the store can ([`Store::try_charge_now`]). A
/// request held by shaping takes `place` into its wait.
pub(crate) fn decide_now<St: Store>(
    config: &Arc<Config<St>>,
    charges: &[Charge],
    enforced: usize,
    refusal: &mut Option<Answer>,
    place: &mut Option<Place>,
    settled: &mut Settled,
) -> Now {
    let started = observe::start();
    match config.store.try_charge_now(charges) {
        Some(Ok(outcome)) => {
            observe::store_latency(started);
            if enforced < charges.len() && Shadowed::would_shadow(charges, enforced, &outcome) {
                // A dry-run limit would refuse. Nothing was spent (the call
                // was refused): [`decide`] decides again without it.
                return Now::Later(None);
            }
            // Only a shaped call is held, and only a call with rules
            // charged by outcome has anything to settle: neither step is
            // entered for the rest.
            let wait = match outcome.reservation() {
                None => None,
                Some(_) => match hold(config, &config.store, charges, &outcome, place) {
                    Ok(wait) => wait,
                    Err(answer) => return Now::Decided(Err(answer)),
                },
            };
            let settle = match settled.is_empty() {
                true => None,
                false => settle(&config.store, charges, &outcome, std::mem::take(settled)),
            };
            Now::Decided(conclude(
                config,
                charges,
                outcome,
                &Shadowed::default(),
                refusal.take(),
                wait,
                settle,
            ))
        }
        Some(Err(error)) => Now::Later(Some(error)),
        None => Now::Later(None),
    }
}

/// Charges the store (unless `failed` says it already failed) and makes the
/// answer. Dry-run limits that would refuse are left out and the rest
/// decided again (see [`Shadowed`]).
pub(crate) async fn decide<St: Store>(
    config: Arc<Config<St>>,
    mut charges: Charges,
    enforced: usize,
    mut failed: Option<StoreError>,
    refusal: Option<Answer>,
    settled: Settled,
    mut place: Option<Place>,
) -> Result<Admit, Answer> {
    let mut shadowed = Shadowed::default();
    let mut on_fallback: Option<&Arc<dyn DynStore>> = None;
    let outcome = loop {
        if charges.is_empty() {
            // Every limit was a dry-run one that would refuse.
            break Outcome::new(Vec::new());
        }
        let result = match (failed.take(), on_fallback) {
            (Some(error), _) => Err(error),
            (None, Some(fallback)) => fallback.charge_boxed(&charges).await,
            (None, None) => {
                let started = observe::start();
                let result = config.store.charge(&charges).await;
                observe::store_latency(started);
                result
            }
        };
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(error) if on_fallback.is_some() => {
                observe::store_error(&error, "fail_closed");
                return Err(unavailable());
            }
            Err(error) => match after_error(&config, &error) {
                AfterError::Refuse(answer) => return Err(answer),
                AfterError::Open => return admitted(None, refusal, None, None),
                AfterError::Fallback(fallback) => {
                    on_fallback = Some(fallback);
                    continue;
                }
            },
        };
        if !shadowed.take_from(&mut charges, enforced, &outcome) {
            break outcome;
        }
    };
    // A reservation is given back where it was made.
    let (wait, settle) = match on_fallback {
        None => (
            hold(&config, &config.store, &charges, &outcome, &mut place)?,
            settle(&config.store, &charges, &outcome, settled),
        ),
        Some(fallback) => (
            hold(&config, fallback, &charges, &outcome, &mut place)?,
            settle(fallback, &charges, &outcome, settled),
        ),
    };
    conclude(&config, &charges, outcome, &shadowed, refusal, wait, settle)
}

/// For an outcome the store delayed: the request's wait, holding its
/// `place` in line (taken before the store decided, so there is always
/// one: only charges with a place are shaped).
fn hold<St, S: Store + Clone>(
    config: &Config<St>,
    store: &S,
    charges: &[Charge],
    outcome: &Outcome,
    place: &mut Option<Place>,
) -> Result<Option<Wait>, Answer> {
    if outcome.reservation().is_none() {
        return Ok(None);
    }
    match place.take() {
        Some(place) => Ok(Wait::of(store, charges, outcome, Some(place))),
        None => {
            // Not reached: a store holds only shaped charges. Should one
            // hold another, the request is refused after the exact wait
            // and the reservation given back at once.
            drop(Wait::of(store, charges, outcome, None));
            let verdict = Verdict::Denied {
                retry_after: outcome.delay(),
            };
            observe::outcome(charges, outcome, verdict, config.log_level);
            Err(Answer::from_outcome(charges, outcome, verdict))
        }
    }
}

/// The reservations of an admitted request's rules charged by outcome,
/// settled by its response: each is confirmed if the status matches its
/// rule ([`Store::confirm`]), else given back ([`Store::refund`]). A
/// response that never comes (the request is dropped while the inner
/// service has it, or the inner service fails) confirms them all: the
/// attempt counts. A request dropped before the inner service was called
/// (held by shaping, and its client gone) gives them all back: nothing
/// was attempted.
pub(crate) struct AfterResponse {
    settle: Option<Box<dyn FnOnce(Settlement) + Send>>,
}

/// How a request ended, for its outcome reservations.
#[derive(Clone, Copy)]
enum Settlement {
    /// The inner service answered with this status.
    Status(StatusCode),
    /// Called, and no response came.
    Gone,
    /// Never called.
    NotCalled,
}

impl AfterResponse {
    /// Settles by the response's `status`.
    pub(crate) fn status(mut self, status: StatusCode) {
        if let Some(settle) = self.settle.take() {
            settle(Settlement::Status(status));
        }
    }

    /// Gives everything back: the request never reached the inner service.
    pub(crate) fn not_called(mut self) {
        if let Some(settle) = self.settle.take() {
            settle(Settlement::NotCalled);
        }
    }
}

impl Drop for AfterResponse {
    fn drop(&mut self) {
        if let Some(settle) = self.settle.take() {
            settle(Settlement::Gone);
        }
    }
}

/// How the response settles an admitted call's reservations of rules
/// charged by outcome, in `store` (where they were made). `None` when
/// there is nothing to settle (no such rule, or a call that spent nothing:
/// refused, or let through by failing open).
fn settle<S: Store + Clone>(
    store: &S,
    charges: &[Charge],
    outcome: &Outcome,
    settled: Settled,
) -> Option<AfterResponse> {
    if settled.is_empty() || !outcome.is_admitted() {
        return None;
    }
    let receipt = outcome.receipt()?.clone();
    // Where each reserved charge is in the call (dry-run limits that
    // would have refused were left out of it, and spent nothing).
    let mut used = vec![false; charges.len()];
    let reserved: Vec<(usize, StatusFilter)> = settled
        .into_iter()
        .filter_map(|(charge, when)| {
            let i = (0..charges.len()).find(|&i| !used[i] && charges[i] == charge)?;
            used[i] = true;
            Some((i, when))
        })
        .collect();
    if reserved.is_empty() {
        return None;
    }
    let (store, charges) = (store.clone(), charges.to_vec());
    Some(AfterResponse {
        settle: Some(Box::new(move |ended: Settlement| {
            let (kept, back): (Vec<_>, Vec<_>) =
                reserved.iter().partition(|(_, when)| match ended {
                    Settlement::Status(status) => when.matches(status),
                    Settlement::Gone => true,
                    Settlement::NotCalled => false,
                });
            let part = |of: &[&(usize, StatusFilter)]| {
                let indices: Vec<usize> = of.iter().map(|(i, _)| *i).collect();
                let charges: Vec<Charge> = indices.iter().map(|&i| charges[i].clone()).collect();
                (charges, receipt.only(indices))
            };
            if !back.is_empty() {
                let (charges, receipt) = part(&back);
                let store = store.clone();
                run_now_or_later(async move {
                    match store.refund(&charges, &receipt).await {
                        Ok(()) => observe::refunded(&charges),
                        Err(error) => observe::store_error(&error, "refund_lost"),
                    }
                });
            }
            if !kept.is_empty() {
                let (charges, receipt) = part(&kept);
                let store = store.clone();
                run_now_or_later(async move {
                    if let Err(error) = store.confirm(&charges, &receipt).await {
                        observe::store_error(&error, "confirm_lost");
                    }
                });
            }
        })),
    })
}

/// Runs `work` at once when it needs no I/O (an in-process store), else
/// on a spawned task (the response is not held up, a drop cannot wait).
fn run_now_or_later(work: impl Future<Output = ()> + Send + 'static) {
    let mut boxed = Box::pin(work);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if boxed.as_mut().poll(&mut cx).is_ready() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(boxed);
        }
        Err(_) => tracing::error!(
            "no tokio runtime to settle a charge made by outcome: it lapses, counted, \
             a minute after the charge"
        ),
    }
}

/// What the layer does once the store failed ([`OnStoreError`]), logged
/// and counted here.
enum AfterError<'c> {
    /// Refuse (`503`).
    Refuse(Answer),
    /// Go on as if admitted, unchecked.
    Open,
    /// Ask the fallback store instead.
    Fallback(&'c Arc<dyn DynStore>),
}

fn after_error<'c, St>(config: &'c Config<St>, error: &StoreError) -> AfterError<'c> {
    match &config.on_store_error {
        OnStoreError::FailClosed => {
            observe::store_error(error, "fail_closed");
            AfterError::Refuse(unavailable())
        }
        OnStoreError::FailOpen => {
            observe::store_error(error, "fail_open");
            AfterError::Open
        }
        OnStoreError::Fallback(fallback) => {
            observe::store_error(error, "fallback");
            AfterError::Fallback(fallback)
        }
    }
}

fn unavailable() -> Answer {
    Answer::new(
        Refusal::StoreUnavailable,
        "the rate limiter's store is unavailable; try again later",
    )
}

/// Dry-run limits that would have refused, left out of the decision.
///
/// The rule: while a call is refused and a dry-run limit is among those
/// refusing, those limits are logged, counted and left out, and the call
/// is decided again without them (a refused call spent nothing). So the
/// request is decided as if the dry-run rules that would refuse it did not
/// apply, and the dry-run rules that would admit it are charged together
/// with the enforced ones, all-or-nothing.
#[derive(Default)]
struct Shadowed {
    // A `Vec`: most calls have none, and an empty one costs nothing.
    charges: Vec<Charge>,
    decisions: Vec<Decision>,
}

impl Shadowed {
    /// Whether `outcome` is refused with a dry-run limit among the refusing.
    fn would_shadow(charges: &[Charge], enforced: usize, outcome: &Outcome) -> bool {
        matches!(outcome.verdict(), Verdict::Denied { .. })
            && outcome.limits()[enforced.min(charges.len())..]
                .iter()
                .any(Decision::is_denied)
    }

    /// Moves the refusing dry-run limits of `outcome` out of `charges`;
    /// whether any were.
    fn take_from(&mut self, charges: &mut Charges, enforced: usize, outcome: &Outcome) -> bool {
        if !Self::would_shadow(charges, enforced, outcome) {
            return false;
        }
        for i in (enforced..charges.len()).rev() {
            let decision = outcome.limits()[i];
            if let Some(retry_after) = decision.retry_after() {
                let charge = charges.remove(i);
                observe::dry_run_denied(charge.policy(), charge.cost(), Some(retry_after));
                self.charges.push(charge);
                self.decisions.push(decision);
            }
        }
        true
    }
}

/// The answer for `outcome`: a refusal for lack of budget, or else the
/// layer's own `refusal` if there is one, or else admit (with the fields,
/// if configured). The fields describe the `shadowed` dry-run limits too.
fn conclude<St>(
    config: &Config<St>,
    charges: &[Charge],
    outcome: Outcome,
    shadowed: &Shadowed,
    refusal: Option<Answer>,
    wait: Option<Wait>,
    settle: Option<AfterResponse>,
) -> Result<Admit, Answer> {
    let verdict = outcome.verdict();
    observe::outcome(charges, &outcome, verdict, config.log_level);
    let fields = |charges: &[Charge], outcome: &Outcome| {
        if shadowed.charges.is_empty() {
            return ratelimit_fields(charges, outcome).map(Box::new);
        }
        let all: Charges = charges.iter().chain(&shadowed.charges).cloned().collect();
        let decisions = outcome.limits().iter().chain(&shadowed.decisions).copied();
        ratelimit_fields(&all, &Outcome::new(decisions.collect())).map(Box::new)
    };
    match verdict {
        Verdict::Admitted => {
            let fields = if config.headers_on_admitted || refusal.is_some() {
                fields(charges, &outcome)
            } else {
                None
            };
            if let Some(wait) = &wait {
                observe::shaped(charges, wait.delay);
            }
            admitted(fields, refusal, wait, settle)
        }
        _ => {
            let mut answer = Answer::from_outcome(charges, &outcome, verdict);
            if !shadowed.charges.is_empty() {
                answer.fields = fields(charges, &outcome);
            }
            Err(answer)
        }
    }
}

/// Admitted by the store: pass, or give the layer's own refusal, which
/// then carries the fields of the limits it was charged to.
#[inline]
fn admitted(
    fields: Fields,
    refusal: Option<Answer>,
    wait: Option<Wait>,
    settle: Option<AfterResponse>,
) -> Result<Admit, Answer> {
    match refusal {
        None => Ok(Admit {
            fields,
            wait,
            settle,
        }),
        Some(mut answer) => {
            // (A request the layer refuses is never shaped: no wait.)
            answer.fields = fields;
            Err(answer)
        }
    }
}
