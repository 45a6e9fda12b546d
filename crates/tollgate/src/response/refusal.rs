//! The catalogue of refusals (status, problem type, gRPC code) and the
//! answer under construction, encoded for the caller's protocol.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use tollgate_budget::{Charge, Outcome, Policy, Verdict};

use super::custom::{RefusalInfo, Shape};
use super::fields::{RATELIMIT, RATELIMIT_POLICY, ceil_secs, push_int, retry_after_value};
use super::grpc::{self, Protocol};
use super::problem;
use super::rendered::{Numbers, Rendered, ratelimit_fields};
use crate::identity::ClientIpError;
use crate::identity::KeyError;

/// What kind of refusal, with its status, problem type and gRPC code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    RateLimited,
    /// A per-key concurrency limit is full.
    TooManyInFlight,
    /// A global concurrency limit (or its waiting queue) is full.
    Overloaded,
    NeverFits(StatusCode),
    StoreUnavailable,
    Unauthenticated,
    BadRequest,
    LengthRequired,
    Misconfigured,
}

impl Refusal {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            Refusal::RateLimited | Refusal::TooManyInFlight => StatusCode::TOO_MANY_REQUESTS,
            Refusal::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::NeverFits(status) => status,
            Refusal::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Unauthenticated => StatusCode::UNAUTHORIZED,
            Refusal::BadRequest => StatusCode::BAD_REQUEST,
            Refusal::LengthRequired => StatusCode::LENGTH_REQUIRED,
            Refusal::Misconfigured => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn problem_type(self) -> &'static str {
        match self {
            Refusal::RateLimited => problem::RATE_LIMITED,
            Refusal::TooManyInFlight => "urn:tollgate:problem:too-many-in-flight",
            Refusal::Overloaded => "urn:tollgate:problem:overloaded",
            Refusal::NeverFits(_) => "urn:tollgate:problem:cost-exceeds-capacity",
            Refusal::StoreUnavailable => "urn:tollgate:problem:limiter-unavailable",
            Refusal::Unauthenticated => "urn:tollgate:problem:principal-required",
            Refusal::BadRequest => "urn:tollgate:problem:bad-request",
            Refusal::LengthRequired => "urn:tollgate:problem:length-required",
            Refusal::Misconfigured => "urn:tollgate:problem:limiter-misconfigured",
        }
    }

    /// gRPC status codes: RESOURCE_EXHAUSTED (8), INVALID_ARGUMENT (3),
    /// UNAVAILABLE (14), UNAUTHENTICATED (16), INTERNAL (13).
    fn grpc_code(self) -> u16 {
        match self {
            Refusal::RateLimited | Refusal::TooManyInFlight => 8,
            Refusal::Overloaded => 14,
            Refusal::NeverFits(_) | Refusal::BadRequest | Refusal::LengthRequired => 3,
            Refusal::StoreUnavailable => 14,
            Refusal::Unauthenticated => 16,
            Refusal::Misconfigured => 13,
        }
    }
}

/// The limit a refusal names: a rate-limit policy, or an in-flight limit.
#[derive(Debug)]
pub(crate) enum Limit {
    Policy(Policy),
    InFlight(Arc<str>),
}

impl Limit {
    fn name(&self) -> &str {
        match self {
            Limit::Policy(p) => p.name(),
            Limit::InFlight(name) => name,
        }
    }
}

/// A refusal response under construction.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) refusal: Refusal,
    pub(crate) detail: Detail,
    /// The limit the refusal is about.
    pub(crate) policy: Option<Limit>,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) fields: Option<Box<(HeaderValue, HeaderValue)>>,
    /// The `WWW-Authenticate` challenge of a `401` (boxed: rare, and an
    /// answer is moved whole through every decision's result).
    pub(crate) challenge: Option<Box<HeaderValue>>,
}

/// What a refusal says.
#[derive(Debug)]
pub(crate) enum Detail {
    Text(String),
    /// A lone policy's refusal for lack of budget: the detail and the
    /// fields are written from the policy's pre-rendered parts
    /// ([`Rendered`]) with these numbers.
    Rendered(Numbers),
}

impl Answer {
    pub(crate) fn new(refusal: Refusal, detail: impl Into<String>) -> Self {
        Self {
            refusal,
            detail: Detail::Text(detail.into()),
            policy: None,
            retry_after: None,
            fields: None,
            challenge: None,
        }
    }

    /// This answer, written from its policy's pre-rendered parts with
    /// `numbers`.
    fn rendered(self, numbers: Numbers) -> Self {
        Self {
            detail: Detail::Rendered(numbers),
            ..self
        }
    }

    /// The refusal for a cost that can never fit `policy`.
    pub(crate) fn never_fits(policy: &Policy, cost: u64, status: StatusCode) -> Self {
        Self {
            refusal: Refusal::NeverFits(status),
            detail: Detail::Text(format!(
                "this request costs {cost} {} but policy {:?} holds at most {}; it can never be admitted",
                policy.unit().as_str(),
                policy.name(),
                policy.capacity()
            )),
            policy: Some(Limit::Policy(policy.clone())),
            retry_after: None,
            fields: None,
            challenge: None,
        }
    }

    /// The refusal for a key that could not be built.
    pub(crate) fn for_key(error: KeyError, first: &str) -> Self {
        match error {
            KeyError::NoPrincipal => Answer {
                challenge: Some(Box::new(HeaderValue::from_static("Bearer"))),
                ..Answer::new(
                    Refusal::Unauthenticated,
                    format!("{first:?} needs an authenticated principal"),
                )
            },
            // The server's configuration, not the client's doing: the log
            // says what to fix (`observe::key_refused`); the body says
            // nothing of the server's internals.
            KeyError::ClientIp(ClientIpError::MissingPeer) => Answer::new(
                Refusal::Misconfigured,
                "the server's rate limiter is misconfigured; this is not the client's fault",
            ),
            KeyError::ClientIp(e) => Answer::new(Refusal::BadRequest, e.to_string()),
            KeyError::MissingPart(name) => Answer {
                challenge: Some(Box::new(HeaderValue::from_static("Bearer"))),
                ..Answer::new(
                    Refusal::Unauthenticated,
                    format!("{first:?} is keyed by {name:?}, which this request does not carry"),
                )
            },
        }
    }

    /// The answer to a denied outcome (or, defensively, a never-fitting
    /// one: the layer does not send those to the store).
    pub(crate) fn from_outcome(charges: &[Charge], outcome: &Outcome, verdict: Verdict) -> Self {
        let idx = match charges.len() {
            1 => 0,
            _ => outcome.most_restrictive().unwrap_or(0),
        };
        // Out of budget (the flood's case): the most restrictive policy's
        // parts are rendered once; only its numbers are kept, and with one
        // policy (the common case) the fields are written from them too.
        // Several limits' fields are their own (none when none can be said).
        let fields = match charges.len() {
            1 => None,
            _ => ratelimit_fields(charges, outcome).map(Box::new),
        };
        if let (Some(charge), Some(decision), Verdict::Denied { retry_after }) =
            (charges.get(idx), outcome.limits().get(idx), verdict)
            && decision.is_evaluated()
            && !decision.never_fits()
            && (charges.len() == 1 || fields.is_some())
            && Rendered::of(charge.policy()).is_some()
        {
            return Self {
                policy: Some(Limit::Policy(charge.policy().clone())),
                retry_after: Some(retry_after),
                fields,
                ..Self::new(Refusal::RateLimited, String::new())
            }
            .rendered(Numbers::new(decision.remaining(), decision.reset()));
        }
        let fields = match charges.len() {
            1 => ratelimit_fields(charges, outcome).map(Box::new),
            _ => fields,
        };
        let policy = charges.get(idx).map(|c| Limit::Policy(c.policy().clone()));
        match (outcome.limits().get(idx), charges.get(idx)) {
            (Some(d), Some(charge)) if d.never_fits() => Self {
                fields,
                ..Self::never_fits(charge.policy(), charge.cost(), StatusCode::BAD_REQUEST)
            },
            _ => {
                let wait = match verdict {
                    Verdict::Denied { retry_after } => retry_after,
                    _ => Duration::ZERO,
                };
                // Policy names are [A-Za-z0-9._-]: no quoting needed. The
                // wait is added when the protocol is known
                // (`into_shaped_response`), in the unit the answer gives it.
                let mut detail = String::with_capacity(64);
                detail.push_str("rate limit of policy ");
                detail.push_str(policy.as_ref().map_or("", Limit::name));
                detail.push_str(" exceeded");
                Self {
                    refusal: Refusal::RateLimited,
                    detail: Detail::Text(detail),
                    policy,
                    retry_after: Some(wait),
                    fields,
                    challenge: None,
                }
            }
        }
    }

    pub(crate) fn into_response(self, protocol: Protocol) -> Response<Bytes> {
        self.into_shaped_response(protocol, None)
    }

    /// The response to a request of `method`: with an HTTP body written by
    /// `shape` when there is one (the status and every header stay
    /// tollgate's), and none for `HEAD` ([`without_body`]).
    pub(crate) fn answer(
        self,
        protocol: Protocol,
        shape: Option<&Shape>,
        method: &Method,
    ) -> Response<Bytes> {
        let response = self.into_shaped_response(protocol, shape);
        if method == Method::HEAD {
            without_body(response)
        } else {
            response
        }
    }

    /// The response, with an HTTP body written by `shape` when there is
    /// one (the status and every header stay tollgate's).
    pub(crate) fn into_shaped_response(
        mut self,
        protocol: Protocol,
        shape: Option<&Shape>,
    ) -> Response<Bytes> {
        // A lone policy's refusal for lack of budget: its parts rendered
        // once (`from_outcome`).
        let numbers = match self.detail {
            Detail::Rendered(numbers) => Some(numbers),
            Detail::Text(_) => None,
        };
        let rendered = match (numbers, &self.policy) {
            (Some(_), Some(Limit::Policy(policy))) => Rendered::of(policy),
            _ => None,
        };
        // The flood's case, the whole answer from the rendered parts.
        if let (Protocol::Http, None, None, Some(rendered), Some(numbers), Some(wait)) = (
            protocol,
            shape,
            &self.challenge,
            rendered,
            numbers,
            self.retry_after,
        ) {
            let secs = ceil_secs(wait).max(1);
            // Taken: a head is made whenever fields are given (only the
            // `RateLimit` value of `numbers` can fail to be one).
            let fields = self.fields.take().map(|both| *both);
            if let Some(head) = rendered.http_head(numbers, fields, secs) {
                let mut response = Response::new(rendered.body(secs));
                *response.status_mut() = self.refusal.status();
                *response.headers_mut() = head;
                return response;
            }
        }
        // Cache-Control, the two RateLimit fields, Content-Type, and
        // Retry-After or WWW-Authenticate (gRPC: its status and message).
        let mut headers = HeaderMap::with_capacity(6);
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        let fields = match (self.fields, rendered, numbers) {
            (Some(both), _, _) => Some(*both),
            (None, Some(rendered), Some(numbers)) => rendered.fields(numbers),
            _ => None,
        };
        if let Some((policy, current)) = fields {
            headers.insert(RATELIMIT_POLICY.clone(), policy);
            headers.insert(RATELIMIT.clone(), current);
        }
        headers.insert(CONTENT_TYPE, protocol.content_type());
        // The message says the wait as the answer's own field does: whole
        // seconds beside `Retry-After`, milliseconds beside
        // `grpc-retry-pushback-ms` (a gRPC caller told "1 s" with a
        // pushback of 39 ms would not know which to believe).
        let detail = |wait: Option<(u64, &str)>| {
            let mut detail = match self.detail {
                Detail::Text(text) => text,
                // A shaped body or gRPC's message from a rendered answer
                // (`from_outcome` makes one only for a policy that renders).
                Detail::Rendered(_) => rendered.map_or_else(String::new, |r| r.detail().to_owned()),
            };
            if let Some((n, unit)) = wait {
                detail.push_str("; retry after ");
                push_int(&mut detail, n);
                detail.push_str(unit);
            }
            detail
        };
        let (status, body) = if protocol == Protocol::Http {
            let secs = self.retry_after.map(|wait| ceil_secs(wait).max(1));
            if let Some(secs) = secs {
                headers.insert(RETRY_AFTER, retry_after_value(secs));
            }
            if let Some(challenge) = self.challenge {
                headers.insert(WWW_AUTHENTICATE, *challenge);
            }
            let status = self.refusal.status();
            let (problem_type, policy) = (
                self.refusal.problem_type(),
                self.policy.as_ref().map(Limit::name),
            );
            let body = match (shape, rendered, secs) {
                (None, Some(rendered), Some(secs)) => rendered.body(secs),
                (shape, _, _) => {
                    let detail = detail(secs.map(|secs| (secs, " s")));
                    match shape {
                        Some(shape) => {
                            let written = (shape.0)(&RefusalInfo {
                                status,
                                problem_type,
                                detail: &detail,
                                policy,
                                retry_after: self.retry_after,
                            });
                            headers.insert(CONTENT_TYPE, written.content_type);
                            written.body
                        }
                        None => {
                            problem::body(problem_type, status, &detail, policy, self.retry_after)
                        }
                    }
                }
            };
            (status, body)
        } else {
            let code = self.refusal.grpc_code();
            let ms = self.retry_after.map(grpc::pushback_ms);
            if let Some(ms) = ms {
                // gRPC's own Retry-After (retry pushback, gRFC A6): a
                // client with a retry policy waits this long before trying
                // again.
                grpc::pushback(&mut headers, ms);
            }
            match (rendered, ms) {
                (Some(rendered), Some(ms)) => match rendered.grpc_message(ms) {
                    Some(message) => grpc::status_with(&mut headers, code, message),
                    None => grpc::status(&mut headers, code, &detail(Some((ms, " ms")))),
                },
                _ => grpc::status(&mut headers, code, &detail(ms.map(|ms| (ms, " ms")))),
            }
            (StatusCode::OK, Bytes::new())
        };
        let mut response = Response::new(body);
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }
}

/// `response` as the answer to a `HEAD` request: the same head, with its
/// body's length in `Content-Length`, and no body. A response to `HEAD`
/// carries none: HTTP/1.1 servers leave it out, but over HTTP/2 a body
/// there is a protocol error, and a layer around a `Router` (the front
/// door) answers before axum's routing, which would strip it. A response
/// without a body (gRPC's trailers-only) is left as it is.
pub(crate) fn without_body(mut response: Response<Bytes>) -> Response<Bytes> {
    let length = response.body().len();
    if length > 0 {
        response
            .headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from(length));
        *response.body_mut() = Bytes::new();
    }
    response
}

/// A future polled after it completed gets a 500 rather than a panic.
#[cold]
pub(crate) fn polled_after_completion() -> Response<Bytes> {
    Answer::new(
        Refusal::Misconfigured,
        "tollgate response future polled after completion",
    )
    .into_response(Protocol::Http)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response::fields::written_fields;

    #[test]
    fn a_grpc_refusal_is_trailers_only_with_its_code() {
        let r = Answer::new(Refusal::Unauthenticated, "who are you").into_response(Protocol::Grpc);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "16");
        assert_eq!(r.headers()["grpc-message"], "who are you");
        assert_eq!(r.headers()[CACHE_CONTROL], "no-store");
        let r = Answer::new(Refusal::Unauthenticated, "who are you").into_response(Protocol::Http);
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
    }

    fn body_text(r: Response<Bytes>) -> String {
        String::from_utf8(r.into_body().to_vec()).unwrap()
    }

    /// A refusal for lack of budget, written from its policy's
    /// pre-rendered parts, is byte for byte the answer the general writers
    /// give (`problem::body`, `ratelimit_fields`, gRPC's percent-encoded
    /// message), in both protocols, alone or beside a second limit that
    /// admitted or refused too.
    fn pre_rendered_matches_the_general_writers(
        name: &str,
        capacity: u64,
        rate: tollgate_budget::Rate,
        numbers: (u64, Duration),
        wait: Duration,
        beside: Option<tollgate_budget::Decision>,
    ) {
        use tollgate_budget::{Decision, Key, Rate};
        let policy = Policy::token_bucket(name, capacity, rate).unwrap();
        let other = Policy::token_bucket("other", 10, Rate::per_second(1)).unwrap();
        let (remaining, reset) = numbers;
        let mut charges = vec![Charge::new(Key::tagged("t", "k"), policy, 1).unwrap()];
        let mut decisions = vec![Decision::denied(wait, remaining, reset)];
        if let Some(decision) = beside {
            charges.push(Charge::new(Key::tagged("t", "k"), other, 1).unwrap());
            decisions.push(decision);
        }
        let outcome = Outcome::new(decisions);
        let verdict = outcome.verdict();
        let idx = outcome.most_restrictive().unwrap();
        let refusing = charges[idx].policy().clone();
        let Verdict::Denied { retry_after } = verdict else {
            panic!("{verdict:?}")
        };
        // A body of the application's, which sees the detail and the rest.
        let shape = Shape(std::sync::Arc::new(|info: &RefusalInfo<'_>| {
            let text = format!(
                "{} {} {} {:?} {:?}",
                info.status(),
                info.problem_type(),
                info.detail(),
                info.policy(),
                info.retry_after()
            );
            super::super::RefusalBody::new(HeaderValue::from_static("text/plain"), text)
        }));
        for (protocol, shape) in [
            (Protocol::Http, None),
            (Protocol::Grpc, None),
            (Protocol::Http, Some(&shape)),
        ] {
            let fast = Answer::from_outcome(&charges, &outcome, verdict);
            assert!(matches!(fast.detail, Detail::Rendered(_)));
            let general = Answer {
                policy: Some(Limit::Policy(refusing.clone())),
                retry_after: Some(retry_after),
                fields: written_fields(&charges, &outcome).map(Box::new),
                ..Answer::new(
                    Refusal::RateLimited,
                    format!("rate limit of policy {} exceeded", refusing.name()),
                )
            };
            let (fast, general) = (
                fast.into_shaped_response(protocol, shape),
                general.into_shaped_response(protocol, shape),
            );
            assert_eq!(fast.status(), general.status());
            assert_eq!(fast.headers(), general.headers(), "{protocol:?} {shape:?}");
            // In the same order on the wire too.
            let order = |r: &Response<Bytes>| r.headers().keys().cloned().collect::<Vec<_>>();
            assert_eq!(order(&fast), order(&general));
            assert_eq!(body_text(fast), body_text(general));
        }
    }

    proptest::proptest! {
        #[test]
        fn a_pre_rendered_refusal_is_the_general_one(
            name in "[A-Za-z0-9._-]{1,64}",
            capacity in 1u64..=100_000,
            amount in 1u64..1_000_000,
            period_ms in 1u64..=3_600_000,
            remaining in proptest::prelude::any::<u64>(),
            reset in (proptest::prelude::any::<u64>(), 0u32..1_000_000_000),
            wait_ns in 1u64..=u64::MAX,
            beside in proptest::option::of((0u8..3, 0u64..=10, 0u64..=u64::MAX)),
        ) {
            let rate = tollgate_budget::Rate::new(amount, Duration::from_millis(period_ms));
            // Numbers the exact arithmetic cannot hold are refused at
            // construction; proptest fails if it has to skip too many.
            proptest::prop_assume!(Policy::token_bucket("p", capacity, rate).is_ok());
            let beside = beside.map(|(kind, remaining, ns)| decision(kind, remaining, ns));
            pre_rendered_matches_the_general_writers(
                &name,
                capacity,
                rate,
                (remaining % capacity.saturating_add(1), Duration::new(reset.0, reset.1)),
                Duration::from_nanos(wait_ns),
                beside,
            );
        }
    }

    /// A decision of each kind a store gives.
    fn decision(kind: u8, remaining: u64, ns: u64) -> tollgate_budget::Decision {
        use tollgate_budget::Decision;
        let ns = Duration::from_nanos(ns);
        match kind {
            0 => Decision::denied(ns, remaining, ns),
            1 => Decision::admitted(remaining, ns),
            2 => Decision::unevaluated(),
            _ => Decision::never_fitting(remaining + 1, remaining),
        }
    }

    proptest::proptest! {
        /// The fields of one to three limits, in any state, written from
        /// the rendered parts are the general writer's.
        #[test]
        fn rendered_fields_are_the_written_ones(
            limits in proptest::collection::vec(
                ("[A-Za-z0-9._-]{1,20}", 1u64..=1000, 1u64..=3600, 0u8..4, 0u64..=1000, proptest::prelude::any::<u64>()),
                1..=3,
            ),
        ) {
            use tollgate_budget::{Key, Rate};
            let mut charges = Vec::new();
            let mut decisions = Vec::new();
            for (name, capacity, period, kind, remaining, ns) in limits {
                let rate = Rate::new(1, Duration::from_secs(period));
                let policy = Policy::token_bucket(name, capacity, rate).unwrap();
                charges.push(Charge::new(Key::tagged("t", "k"), policy, 1).unwrap());
                decisions.push(decision(kind, remaining, ns));
            }
            let outcome = Outcome::new(decisions);
            proptest::prop_assert_eq!(
                ratelimit_fields(&charges, &outcome),
                written_fields(&charges, &outcome)
            );
        }
    }

    /// The numbers ride where the text would be: a rendered answer is no
    /// larger than a written one (every decision's result carries an
    /// answer's room, admitted or not).
    #[test]
    fn an_answer_stays_small() {
        assert_eq!(size_of::<Detail>(), size_of::<String>());
        assert!(size_of::<Answer>() <= 96, "{}", size_of::<Answer>());
    }

    /// A policy's rendering is made once and kept with it: the second
    /// refusal finds it, a changed policy (a new one) renders its own.
    #[test]
    fn a_rendering_is_kept_with_its_policy() {
        let policy =
            Policy::token_bucket("per-ip", 5, tollgate_budget::Rate::per_second(1)).unwrap();
        let first = Rendered::of(&policy).unwrap() as *const Rendered;
        assert_eq!(
            Rendered::of(&policy.clone()).unwrap() as *const Rendered,
            first
        );
        let changed =
            Policy::token_bucket("per-ip", 6, tollgate_budget::Rate::per_second(1)).unwrap();
        let fields = Rendered::of(&changed)
            .unwrap()
            .fields(Numbers::new(0, Duration::from_millis(1500)))
            .unwrap();
        assert_eq!(fields.0, "\"per-ip\";q=6;w=6");
        assert_eq!(fields.1, "\"per-ip\";r=0;t=2");
    }

    /// The wait in a refusal's message agrees with the answer's own field:
    /// whole seconds with `Retry-After`, the pushback's milliseconds for
    /// gRPC.
    #[test]
    fn the_message_says_the_wait_in_the_answers_unit() {
        let limited = || Answer {
            retry_after: Some(Duration::from_micros(38_200)),
            ..Answer::new(Refusal::RateLimited, "rate limit of policy per-ip exceeded")
        };
        let r = limited().into_response(Protocol::Grpc);
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "39");
        assert_eq!(
            r.headers()["grpc-message"],
            "rate limit of policy per-ip exceeded; retry after 39 ms"
        );
        let r = limited().into_response(Protocol::Http);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
        let body = body_text(r);
        assert!(
            body.contains("rate limit of policy per-ip exceeded; retry after 1 s"),
            "{body}"
        );
    }
}
