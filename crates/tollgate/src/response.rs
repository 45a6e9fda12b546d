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
use tollgate_core::{Charge, Decision, Outcome, Policy, Unit};

use crate::ClientIpError;
use crate::identity::KeyError;

/// The `RateLimit-Policy` header name.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit` header name.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up; never 0 for a positive duration.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// How a refusal is encoded: as HTTP, or for gRPC and gRPC-Web callers as a
/// trailers-only response with `grpc-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    /// `application/grpc`, alone or followed by `+` or `;`.
    Grpc,
    /// `application/grpc-web` and `application/grpc-web+...`.
    GrpcWeb,
    /// `application/grpc-web-text` and `application/grpc-web-text+...`.
    GrpcWebText,
}

impl Protocol {
    /// The protocol of a request, from its exact content type (case
    /// insensitive): `application/grpcx` and the like are plain HTTP.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let Some(ct) = headers.get(CONTENT_TYPE) else {
            return Protocol::Http;
        };
        let ct = ct.as_bytes();
        // The media type ends at a parameter or whitespace.
        let end = ct
            .iter()
            .position(|&b| b == b';' || b == b' ' || b == b'\t')
            .unwrap_or(ct.len());
        let media = &ct[..end];
        let family = |name: &[u8]| {
            media.len() >= name.len()
                && media[..name.len()].eq_ignore_ascii_case(name)
                && matches!(media.get(name.len()), None | Some(b'+'))
        };
        if family(b"application/grpc-web-text") {
            Protocol::GrpcWebText
        } else if family(b"application/grpc-web") {
            Protocol::GrpcWeb
        } else if family(b"application/grpc") {
            Protocol::Grpc
        } else {
            Protocol::Http
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Protocol::Http => "application/problem+json",
            Protocol::Grpc => "application/grpc",
            Protocol::GrpcWeb => "application/grpc-web+proto",
            Protocol::GrpcWebText => "application/grpc-web-text+proto",
        }
    }
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
            policy: Some(policy.name_arc().clone()),
            retry_after: None,
            fields: None,
        }
    }

    /// The refusal for a key that could not be built.
    pub(crate) fn for_key(error: KeyError, first: &str) -> Self {
        match error {
            KeyError::NoPrincipal => Answer::new(
                Refusal::Unauthenticated,
                format!("{first:?} needs an authenticated principal"),
            ),
            KeyError::ClientIp(e @ ClientIpError::MissingPeer) => {
                tracing::error!(error = %e, "tollgate cannot key by client address");
                Answer::new(Refusal::Misconfigured, e.to_string())
            }
            KeyError::ClientIp(e) => Answer::new(Refusal::BadRequest, e.to_string()),
        }
    }

    /// The answer to a denied outcome (or, defensively, a never-fitting
    /// one: the layer does not send those to the store).
    pub(crate) fn from_outcome(charges: &[Charge], outcome: &Outcome) -> Self {
        let idx = outcome.most_restrictive().unwrap_or(0);
        let policy = charges.get(idx).map(|c| c.policy().name_arc().clone());
        let fields = ratelimit_fields(charges, outcome).map(Box::new);
        match (outcome.limits().get(idx), charges.get(idx)) {
            (Some(Decision::NeverFits { cost, .. }), Some(charge)) => Self {
                fields,
                ..Self::never_fits(charge.policy(), *cost, StatusCode::BAD_REQUEST)
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

    pub(crate) fn into_response(self, protocol: Protocol) -> Response<Full<Bytes>> {
        let mut headers = HeaderMap::with_capacity(8);
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(fields) = self.fields {
            let (policy, current) = *fields;
            headers.insert(RATELIMIT_POLICY.clone(), policy);
            headers.insert(RATELIMIT.clone(), current);
        }
        let (status, body) = if protocol != Protocol::Http {
            headers.insert(
                CONTENT_TYPE,
                HeaderValue::from_static(protocol.content_type()),
            );
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
                HeaderValue::from_static(protocol.content_type()),
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
    .into_response(Protocol::Http)
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
    fn grpc_is_detected_by_its_exact_media_type() {
        let of = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
            Protocol::of(&h)
        };
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
            "Application/GRPC+json",
        ] {
            assert_eq!(of(ct), Protocol::Grpc, "{ct}");
        }
        for ct in ["application/grpc-web", "application/grpc-web+proto"] {
            assert_eq!(of(ct), Protocol::GrpcWeb, "{ct}");
        }
        for ct in [
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            assert_eq!(of(ct), Protocol::GrpcWebText, "{ct}");
        }
        for ct in [
            "application/grpcx",
            "application/grpc-webx",
            "application/grpc-",
            "text/plain",
            "application/grp",
        ] {
            assert_eq!(of(ct), Protocol::Http, "{ct}");
        }
        assert_eq!(Protocol::of(&HeaderMap::new()), Protocol::Http);
    }

    #[test]
    fn problem_json_escapes() {
        let r = Answer::new(Refusal::BadRequest, "bad \"value\"\n").into_response(Protocol::Http);
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
