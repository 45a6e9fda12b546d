//! gRPC callers: recognised by their exact content type, and answered with
//! a trailers-only response (HTTP 200 with `grpc-status`, `grpc-message`
//! and, when a wait is known, `grpc-retry-pushback-ms`), gRPC-Web in its
//! own content type: gRPC-Web allows trailers-only responses, the status
//! fields in the headers and an empty body, which its clients read as the
//! call's status.

use std::fmt::Write as _;

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue};

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

    /// The content type of a refusal to this caller.
    pub(super) fn content_type(self) -> &'static str {
        match self {
            Protocol::Http => "application/problem+json",
            Protocol::Grpc => "application/grpc",
            Protocol::GrpcWeb => "application/grpc-web+proto",
            Protocol::GrpcWebText => "application/grpc-web-text+proto",
        }
    }
}

/// Adds the trailers-only fields of a refusal with `code` and `message`.
pub(super) fn status(headers: &mut HeaderMap, code: u16, message: &str) {
    headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", v);
    }
}

/// Adds `grpc-retry-pushback-ms`: the wait in whole milliseconds, rounded
/// up so that a client never comes back early.
pub(super) fn pushback(headers: &mut HeaderMap, wait: std::time::Duration) {
    let ms = wait.as_nanos().div_ceil(1_000_000);
    headers.insert(
        "grpc-retry-pushback-ms",
        HeaderValue::from(u64::try_from(ms).unwrap_or(u64::MAX)),
    );
}

/// gRPC's `grpc-message` encoding: percent-encode everything outside
/// printable ASCII, and `%` itself.
fn percent_encode(s: &str) -> String {
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
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a 100% é"), "a 100%25 %C3%A9");
    }
}
