use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use smallvec::SmallVec;
use tollgate_core::{Charge, Outcome, Store, StoreError, Verdict};
use tower_service::Service;

use super::layer::{Config, OnStoreError};
use super::rule::CostRefusal;
use super::{ResponseFuture, Rule};
use crate::identity::RequestIdentity;
use crate::observe;
use crate::response::{Answer, Refusal, is_grpc, ratelimit_fields};

/// Rate-limits requests to an inner service; made by
/// [`RateLimitLayer`](super::RateLimitLayer).
pub struct RateLimit<S, St> {
    inner: S,
    config: Arc<Config<St>>,
}

impl<S: Clone, St> Clone for RateLimit<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug, St> fmt::Debug for RateLimit<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.config.rules)
            .finish_non_exhaustive()
    }
}

impl<S, St> RateLimit<S, St> {
    pub(crate) fn from_config(inner: S, config: Arc<Config<St>>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The `RateLimit-Policy` and `RateLimit` values to add to a response.
pub(crate) type Fields = Option<(HeaderValue, HeaderValue)>;

/// The charges of one request; most requests have one or two rules, kept
/// inline without an allocation.
pub(crate) type Charges = SmallVec<[Charge; 2]>;

/// The never-fits status of each charge's rule, in the same order.
pub(crate) type Statuses = SmallVec<[StatusCode; 2]>;

/// What the head of a request asks of the store.
// Built and taken apart once per request, on the stack: boxing the large
// variant would cost the allocation the inline charges are there to save.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Plan {
    /// No rule applies.
    Pass,
    /// Refused before asking the store.
    Refuse(Answer),
    /// These charges, with the never-fits status of each charge's rule.
    Charge(Charges, Statuses),
}

pub(crate) fn plan(rules: &[Rule], resolver: &crate::ClientIpResolver, parts: &Parts) -> Plan {
    let mut who = RequestIdentity::new(parts, resolver);
    let mut charges = Charges::new();
    let mut statuses = Statuses::new();
    for rule in rules.iter().filter(|r| r.applies_to(parts)) {
        let key = match who.key(rule.policy.name(), &rule.key, rule.missing_principal) {
            Ok(Some(key)) => key,
            Ok(None) => continue,
            Err(answer) => return Plan::Refuse(answer),
        };
        let cost = match rule.cost.of(parts) {
            Ok(cost) => cost,
            Err(CostRefusal::LengthRequired) => {
                return Plan::Refuse(Answer::new(
                    Refusal::LengthRequired,
                    format!(
                        "policy {:?} charges by content length; send Content-Length",
                        rule.policy.name()
                    ),
                ));
            }
            Err(CostRefusal::Invalid(why)) => {
                return Plan::Refuse(Answer::new(Refusal::BadRequest, why));
            }
        };
        match Charge::new(key, rule.policy.clone(), cost) {
            Ok(charge) => {
                charges.push(charge);
                statuses.push(rule.cost.never_fits_status());
            }
            Err(e) => return Plan::Refuse(Answer::new(Refusal::BadRequest, e.to_string())),
        }
    }
    if charges.is_empty() {
        Plan::Pass
    } else {
        Plan::Charge(charges, statuses)
    }
}

/// What [`decide_now`] could settle without waiting.
pub(crate) enum Now {
    /// Admitted (with fields) or refused.
    Decided(Result<Fields, Answer>),
    /// [`decide`] must finish: the store needs I/O (`None`), or it failed
    /// and the configured outcome may need the fallback store.
    Later(Option<StoreError>),
}

/// Decides at once when the store can ([`Store::try_charge_now`]).
pub(crate) fn decide_now<St: Store>(
    config: &Config<St>,
    charges: &[Charge],
    statuses: &[StatusCode],
) -> Now {
    let started = observe::start();
    match config.store.try_charge_now(charges) {
        Some(Ok(outcome)) => {
            observe::store_latency(started);
            Now::Decided(conclude(config, charges, statuses, outcome))
        }
        Some(Err(error)) => Now::Later(Some(error)),
        None => Now::Later(None),
    }
}

/// Charges the store (unless `failed` says it already failed) and turns the
/// outcome into admit (with fields) or a refusal.
pub(crate) async fn decide<St: Store>(
    config: Arc<Config<St>>,
    charges: Charges,
    statuses: Statuses,
    failed: Option<StoreError>,
) -> Result<Fields, Answer> {
    let result = match failed {
        Some(error) => Err(error),
        None => {
            let started = observe::start();
            let result = config.store.charge(&charges).await;
            observe::store_latency(started);
            result
        }
    };
    let outcome: Outcome = match result {
        Ok(outcome) => outcome,
        Err(error) => match &config.on_store_error {
            OnStoreError::FailClosed => {
                observe::store_error(&error, "fail_closed");
                return Err(Answer::new(
                    Refusal::StoreUnavailable,
                    "the rate limiter's store is unavailable; try again later",
                ));
            }
            OnStoreError::FailOpen => {
                observe::store_error(&error, "fail_open");
                return Ok(None);
            }
            OnStoreError::Fallback(fallback) => {
                observe::store_error(&error, "fallback");
                match fallback.charge_boxed(&charges).await {
                    Ok(outcome) => outcome,
                    Err(second) => {
                        observe::store_error(&second, "fail_closed");
                        return Err(Answer::new(
                            Refusal::StoreUnavailable,
                            "the rate limiter's stores are unavailable; try again later",
                        ));
                    }
                }
            }
        },
    };
    conclude(&config, &charges, &statuses, outcome)
}

/// Admit (with fields, if configured) or the refusal for `outcome`.
fn conclude<St>(
    config: &Config<St>,
    charges: &[Charge],
    statuses: &[StatusCode],
    outcome: Outcome,
) -> Result<Fields, Answer> {
    observe::outcome(charges, &outcome);
    match outcome.verdict() {
        Verdict::Admitted => Ok(if config.headers_on_admitted {
            ratelimit_fields(charges, &outcome)
        } else {
            None
        }),
        _ => {
            let idx = outcome.most_restrictive().unwrap_or(0);
            let status = statuses
                .get(idx)
                .copied()
                .unwrap_or(StatusCode::BAD_REQUEST);
            Err(Answer::from_outcome(charges, &outcome, status))
        }
    }
}

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    St: Store,
    ReqB: Send + 'static,
{
    type Response = Response<crate::ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The limiter itself never waits: only the inner service's readiness
        // is passed on.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The inner service was driven to readiness in poll_ready; keep that
        // ready instance for this request and leave a fresh clone behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let (parts, body) = req.into_parts();
        let grpc = is_grpc(&parts.headers);
        match plan(&self.config.rules, &self.config.resolver, &parts) {
            Plan::Pass => ResponseFuture::calling(inner, Request::from_parts(parts, body), None),
            Plan::Refuse(answer) => ResponseFuture::refused(answer.into_response(grpc)),
            Plan::Charge(charges, statuses) => {
                match decide_now(&self.config, &charges, &statuses) {
                    Now::Decided(Ok(fields)) => {
                        ResponseFuture::calling(inner, Request::from_parts(parts, body), fields)
                    }
                    Now::Decided(Err(answer)) => {
                        ResponseFuture::refused(answer.into_response(grpc))
                    }
                    Now::Later(failed) => {
                        let decision =
                            Box::pin(decide(self.config.clone(), charges, statuses, failed));
                        ResponseFuture::deciding(
                            decision,
                            inner,
                            Request::from_parts(parts, body),
                            grpc,
                        )
                    }
                }
            }
        }
    }
}
