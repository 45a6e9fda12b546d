//! The answers tollgate gives instead of calling the inner service: 429,
//! never-fits, store failure, missing principal, bad input, and their gRPC
//! forms; plus the `RateLimit-Policy` / `RateLimit` fields.
//!
//! Every refusal carries `Cache-Control: no-store` and an
//! `application/problem+json` body (RFC 9457), or for gRPC requests an HTTP
//! 200 trailers-only response with `grpc-status`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use tollgate_core::{Charge, Decision, Outcome, Unit};

/// The `RateLimit-Policy` header name.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit` header name.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up; never 0 for a positive duration.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Whether a request is gRPC (`content-type: application/grpc...`).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/grpc"))
}

/// `RateLimit-Policy` and `RateLimit` values (draft-ietf-httpapi-ratelimit-headers-10)
/// describing each charged policy.
pub(crate) fn ratelimit_fields(
    charges: &[Charge],
    outcome: &Outcome,
) -> Option<(HeaderValue, HeaderValue)> {
    let mut policy = String::with_capacity(64);
    let mut current = String::with_capacity(64);
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        let p = charge.policy();
        if !policy.is_empty() {
            policy.push_str(", ");
        }
        // Names are restricted to [A-Za-z0-9._-], so they need no escaping.
        policy.push('"');
        policy.push_str(p.name());
        policy.push_str("\";q=");
        push_int(&mut policy, p.capacity());
        policy.push_str(";w=");
        push_int(&mut policy, ceil_secs(p.window()).max(1));
        if *p.unit() != Unit::Requests {
            policy.push_str(";qu=\"");
            policy.push_str(p.unit().as_str());
            policy.push('"');
        }
        // A cost that can never fit, or a limit not evaluated, says nothing
        // about the budget's state.
        if !matches!(decision, Decision::NeverFits { .. } | Decision::Unevaluated) {
            if !current.is_empty() {
                current.push_str(", ");
            }
            current.push('"');
            current.push_str(p.name());
            current.push_str("\";r=");
            push_int(&mut current, decision.remaining());
            current.push_str(";t=");
            push_int(&mut current, ceil_secs(decision.reset()));
        }
    }
    if policy.is_empty() || current.is_empty() {
        return None;
    }
    // The strings become the header values without a copy.
    Some((
        HeaderValue::from_maybe_shared(Bytes::from(policy)).ok()?,
        HeaderValue::from_maybe_shared(Bytes::from(current)).ok()?,
    ))
}

/// Appends `n` in decimal.
fn push_int(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    // No early exit, so the check compiles to a vectorised loop.
    let special = s.bytes().fold(false, |any, b| {
        any | (b == b'"') | (b == b'\\') | (b < 0x20)
    });
    if !special {
        out.push_str(s);
        out.push('"');
        return;
    }
    let mut rest = s;
    // Copy runs that need no escaping whole. Every byte that does is ASCII,
    // so splitting there always falls on a character boundary.
    while let Some(i) = rest
        .bytes()
        .position(|b| b == b'"' || b == b'\\' || b < 0x20)
    {
        let (run, tail) = rest.split_at(i);
        out.push_str(run);
        let b = tail.as_bytes()[0];
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            _ => {
                let _ = write!(out, "\\u{b:04x}");
            }
        }
        rest = &tail[1..];
    }
    out.push_str(rest);
    out.push('"');
}

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
    fn status(self) -> StatusCode {
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

/// A refusal response under construction.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) refusal: Refusal,
    pub(crate) detail: String,
    pub(crate) policy: Option<Arc<str>>,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) fields: Option<Box<(HeaderValue, HeaderValue)>>,
}

impl Answer {
    pub(crate) fn new(refusal: Refusal, detail: impl Into<String>) -> Self {
        Self {
            refusal,
            detail: detail.into(),
            policy: None,
            retry_after: None,
            fields: None,
        }
    }

    /// The answer to a denied or never-fitting outcome.
    pub(crate) fn from_outcome(
        charges: &[Charge],
        outcome: &Outcome,
        never_fits_status: StatusCode,
    ) -> Self {
        let idx = outcome.most_restrictive().unwrap_or(0);
        let policy = charges.get(idx).map(|c| c.policy().name_arc().clone());
        let fields = ratelimit_fields(charges, outcome).map(Box::new);
        match outcome.limits().get(idx) {
            Some(Decision::NeverFits { cost, capacity }) => Self {
                refusal: Refusal::NeverFits(never_fits_status),
                detail: format!(
                    "this request costs {cost} {} but policy {:?} holds at most {capacity}; it can never be admitted",
                    charges[idx].policy().unit().as_str(),
                    charges[idx].policy().name()
                ),
                policy,
                retry_after: None,
                fields,
            },
            _ => {
                let wait = match outcome.verdict() {
                    tollgate_core::Verdict::Denied { retry_after } => retry_after,
                    _ => Duration::ZERO,
                };
                // Policy names are [A-Za-z0-9._-]: no quoting needed.
                let mut detail = String::with_capacity(64);
                detail.push_str("rate limit of policy ");
                detail.push_str(policy.as_deref().unwrap_or(""));
                detail.push_str(" exceeded; retry after ");
                push_int(&mut detail, ceil_secs(wait).max(1));
                detail.push_str(" s");
                Self {
                    refusal: Refusal::RateLimited,
                    detail,
                    policy,
                    retry_after: Some(wait),
                    fields,
                }
            }
        }
    }

    pub(crate) fn into_response(self, grpc: bool) -> Response<Full<Bytes>> {
        let mut headers = HeaderMap::with_capacity(8);
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(fields) = self.fields {
            let (policy, current) = *fields;
            headers.insert(RATELIMIT_POLICY.clone(), policy);
            headers.insert(RATELIMIT.clone(), current);
        }
        let (status, body) = if grpc {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
            headers.insert("grpc-status", HeaderValue::from(self.refusal.grpc_code()));
            if let Ok(v) = HeaderValue::from_str(&grpc_percent_encode(&self.detail)) {
                headers.insert("grpc-message", v);
            }
            (StatusCode::OK, Bytes::new())
        } else {
            if let Some(wait) = self.retry_after {
                headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(wait).max(1)));
            }
            headers.insert(
                CONTENT_TYPE,
                HeaderValue::from_static("application/problem+json"),
            );
            let status = self.refusal.status();
            let mut json = String::with_capacity(256);
            // Problem types and reason phrases are fixed ASCII without
            // quotes or backslashes: they need no escaping.
            json.push_str("{\"type\":\"");
            json.push_str(self.refusal.problem_type());
            json.push_str("\",\"title\":\"");
            json.push_str(status.canonical_reason().unwrap_or("Error"));
            json.push('"');
            json.push_str(",\"status\":");
            push_int(&mut json, u64::from(status.as_u16()));
            json.push_str(",\"detail\":");
            json_string(&mut json, &self.detail);
            if let Some(p) = &self.policy {
                json.push_str(",\"policy\":");
                json_string(&mut json, p);
            }
            if let Some(wait) = self.retry_after {
                json.push_str(",\"retry_after\":");
                push_int(&mut json, ceil_secs(wait).max(1));
            }
            json.push('}');
            (status, Bytes::from(json))
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
    .into_response(false)
}

/// gRPC's `grpc-message` encoding: percent-encode everything outside
/// printable ASCII, and `%` itself.
fn grpc_percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }

    proptest::proptest! {
        /// Any text, quoted by `json_string`, is a JSON string that decodes
        /// back to the same text.
        #[test]
        fn json_string_round_trips(text in "\\PC*|[\"\\\\\u{0}-\u{1f}a-z]{0,20}") {
            let mut out = String::from("x");
            json_string(&mut out, &text);
            let decoded: String = serde_json::from_str(&out[1..]).unwrap();
            proptest::prop_assert_eq!(decoded, text);
        }
    }

    #[test]
    fn problem_json_escapes() {
        let r = Answer::new(Refusal::BadRequest, "bad \"value\"\n").into_response(false);
        let body = r.into_body();
        let bytes = futures_lite_collect(body);
        assert!(
            bytes.contains(r#""detail":"bad \"value\"\u000a""#),
            "{bytes}"
        );
    }

    fn futures_lite_collect(body: Full<Bytes>) -> String {
        use http_body::Body;
        let mut body = std::pin::pin!(body);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut out = Vec::new();
        while let std::task::Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
            if let Ok(data) = frame.into_data() {
                out.extend_from_slice(&data);
            }
        }
        String::from_utf8(out).unwrap()
    }
}
