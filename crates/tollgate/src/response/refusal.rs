//! The catalogue of refusals (status, problem type, gRPC code) and the
//! answer under construction, encoded for the caller's protocol.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use tollgate_budget::{Charge, Outcome, Policy, Verdict};

use super::custom::{RefusalInfo, Shape};
use super::fields::{
    RATELIMIT, RATELIMIT_POLICY, ceil_secs, push_int, ratelimit_fields, retry_after_value,
};
use super::grpc::{self, Protocol};
use super::problem;
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
            Refusal::RateLimited => "urn:tollgate:problem:rate-limited",
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
    pub(crate) detail: String,
    /// The limit the refusal is about.
    pub(crate) policy: Option<Limit>,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) fields: Option<Box<(HeaderValue, HeaderValue)>>,
    /// The `WWW-Authenticate` challenge of a `401`.
    pub(crate) challenge: Option<HeaderValue>,
}

impl Answer {
    pub(crate) fn new(refusal: Refusal, detail: impl Into<String>) -> Self {
        Self {
            refusal,
            detail: detail.into(),
            policy: None,
            retry_after: None,
            fields: None,
            challenge: None,
        }
    }

    /// The refusal for a cost that can never fit `policy`.
    pub(crate) fn never_fits(policy: &Policy, cost: u64, status: StatusCode) -> Self {
        Self {
            refusal: Refusal::NeverFits(status),
            detail: format!(
                "this request costs {cost} {} but policy {:?} holds at most {}; it can never be admitted",
                policy.unit().as_str(),
                policy.name(),
                policy.capacity()
            ),
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
                challenge: Some(HeaderValue::from_static("Bearer")),
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
                challenge: Some(HeaderValue::from_static("Bearer")),
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
        let idx = outcome.most_restrictive().unwrap_or(0);
        let policy = charges.get(idx).map(|c| Limit::Policy(c.policy().clone()));
        let fields = ratelimit_fields(charges, outcome).map(Box::new);
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
                    detail,
                    policy,
                    retry_after: Some(wait),
                    fields,
                    challenge: None,
                }
            }
        }
    }

    pub(crate) fn into_response(self, protocol: Protocol) -> Response<Full<Bytes>> {
        self.into_shaped_response(protocol, None)
    }

    /// The response, with an HTTP body written by `shape` when there is
    /// one (the status and every header stay tollgate's).
    pub(crate) fn into_shaped_response(
        self,
        protocol: Protocol,
        shape: Option<&Shape>,
    ) -> Response<Full<Bytes>> {
        // Cache-Control, the two RateLimit fields, Content-Type, and
        // Retry-After or WWW-Authenticate (gRPC: its status and message).
        let mut headers = HeaderMap::with_capacity(6);
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(fields) = self.fields {
            let (policy, current) = *fields;
            headers.insert(RATELIMIT_POLICY.clone(), policy);
            headers.insert(RATELIMIT.clone(), current);
        }
        headers.insert(CONTENT_TYPE, protocol.content_type());
        // The message says the wait as the answer's own field does: whole
        // seconds beside `Retry-After`, milliseconds beside
        // `grpc-retry-pushback-ms` (a gRPC caller told "1 s" with a
        // pushback of 39 ms would not know which to believe).
        let mut detail = self.detail;
        let (status, body) = if protocol == Protocol::Http {
            if let Some(wait) = self.retry_after {
                let secs = ceil_secs(wait).max(1);
                headers.insert(RETRY_AFTER, retry_after_value(secs));
                detail.push_str("; retry after ");
                push_int(&mut detail, secs);
                detail.push_str(" s");
            }
            if let Some(challenge) = self.challenge {
                headers.insert(WWW_AUTHENTICATE, challenge);
            }
            let status = self.refusal.status();
            let (problem_type, policy) = (
                self.refusal.problem_type(),
                self.policy.as_ref().map(Limit::name),
            );
            let body = match shape {
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
                None => problem::body(problem_type, status, &detail, policy, self.retry_after),
            };
            (status, body)
        } else {
            if let Some(wait) = self.retry_after {
                // gRPC's own Retry-After (retry pushback, gRFC A6): a client
                // with a retry policy waits this long before trying again.
                grpc::pushback(&mut headers, wait);
                detail.push_str("; retry after ");
                push_int(&mut detail, grpc::pushback_ms(wait));
                detail.push_str(" ms");
            }
            grpc::status(&mut headers, self.refusal.grpc_code(), &detail);
            (StatusCode::OK, Bytes::new())
        };
        let mut response = Response::new(Full::new(body));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }
}

/// A future polled after it completed gets a 500 rather than a panic.
#[cold]
pub(crate) fn polled_after_completion() -> Response<Full<Bytes>> {
    Answer::new(
        Refusal::Misconfigured,
        "tollgate response future polled after completion",
    )
    .into_response(Protocol::Http)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn body_text(r: Response<Full<Bytes>>) -> String {
        use http_body::Body;
        let mut body = r.into_body();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match std::pin::Pin::new(&mut body).poll_frame(&mut cx) {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                String::from_utf8(frame.into_data().unwrap().to_vec()).unwrap()
            }
            _ => String::new(),
        }
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
