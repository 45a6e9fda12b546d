//! gRPC callers: recognised by their exact content type, and answered with
//! a trailers-only response (HTTP 200 with `grpc-status`, `grpc-message`
//! and, when a wait is known, `grpc-retry-pushback-ms`), gRPC-Web in its
//! own content type: gRPC-Web allows trailers-only responses, the status
//! fields in the headers and an empty body, which its clients read as the
//! call's status.

use std::fmt::Write as _;

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue};

/// How a refusal is encoded: as HTTP, or for gRPC and gRPC-Web callers as a
/// trailers-only response with `grpc-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    /// `application/grpc`, alone or followed by `+` or `;`. Answered
    /// `application/grpc` whatever the format: a trailers-only answer
    /// carries no message to encode, and every gRPC client accepts it.
    Grpc,
    /// `application/grpc-web` and `application/grpc-web+...`.
    GrpcWeb(Subtype),
    /// `application/grpc-web-text` and `application/grpc-web-text+...`.
    GrpcWebText(Subtype),
}

/// The message format a gRPC-Web caller named after `+` (`proto`, `json`,
/// `thrift`), lowercased, so that its refusal is answered in its own
/// content type (a gRPC-Web client may check it). Kept inline, so that a [`Protocol`] stays `Copy` and
/// recognising a caller allocates nothing.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Subtype {
    len: u8,
    bytes: [u8; Subtype::MAX],
}

impl Subtype {
    /// Longer names are not kept (see [`Subtype::of`]); the formats in use
    /// are short (`flatbuffers` is 11).
    const MAX: usize = 15;

    /// No `+format` (answered `+proto`, gRPC-Web's default format).
    pub(crate) const NONE: Subtype = Subtype {
        len: 0,
        bytes: [0; Subtype::MAX],
    };

    /// A format name of letters, digits and `.`, `-`, `_` (a media type's
    /// restricted name, without the characters that would need care in a
    /// header), at most 15 bytes. Anything else is `None`: the caller's
    /// content type cannot be repeated safely, and it gets the default.
    fn of(name: &[u8]) -> Option<Subtype> {
        let ok = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_');
        if name.is_empty() || name.len() > Subtype::MAX || !name.iter().all(ok) {
            return None;
        }
        let mut bytes = [0; Subtype::MAX];
        for (to, from) in bytes.iter_mut().zip(name) {
            *to = from.to_ascii_lowercase();
        }
        Some(Subtype {
            len: name.len() as u8,
            bytes,
        })
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl std::fmt::Debug for Subtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.as_bytes()))
    }
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
        // `Some(format)` when `media` is the family `name`, alone or with a
        // `+format`; a format that cannot be repeated is answered as none.
        let family = |name: &[u8]| {
            if media.len() < name.len() || !media[..name.len()].eq_ignore_ascii_case(name) {
                return None;
            }
            match media.get(name.len()) {
                None => Some(Subtype::NONE),
                Some(b'+') => Some(Subtype::of(&media[name.len() + 1..]).unwrap_or(Subtype::NONE)),
                Some(_) => None,
            }
        };
        if let Some(format) = family(b"application/grpc-web-text") {
            Protocol::GrpcWebText(format)
        } else if let Some(format) = family(b"application/grpc-web") {
            Protocol::GrpcWeb(format)
        } else if family(b"application/grpc").is_some() {
            Protocol::Grpc
        } else {
            Protocol::Http
        }
    }

    /// The content type of a refusal to this caller: for gRPC-Web the
    /// caller's own format (lowercased, without parameters), `+proto` when
    /// it named none or one that cannot be repeated.
    pub(super) fn content_type(self) -> HeaderValue {
        let (family, format) = match self {
            Protocol::Http => return HeaderValue::from_static("application/problem+json"),
            Protocol::Grpc => return HeaderValue::from_static("application/grpc"),
            Protocol::GrpcWeb(f) => ("application/grpc-web+", f),
            Protocol::GrpcWebText(f) => ("application/grpc-web-text+", f),
        };
        let format = if format == Subtype::NONE {
            b"proto".as_slice()
        } else {
            format.as_bytes()
        };
        let mut ct = Vec::with_capacity(family.len() + format.len());
        ct.extend_from_slice(family.as_bytes());
        ct.extend_from_slice(format);
        // Only visible ASCII went in (`Subtype::of`), so this cannot fail;
        // the fallback keeps a refusal from ever panicking.
        HeaderValue::from_bytes(&ct).unwrap_or(HeaderValue::from_static("application/grpc-web"))
    }
}

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
static GRPC_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// Adds the trailers-only fields of a refusal with `code` and `message`.
pub(super) fn status(headers: &mut HeaderMap, code: u16, message: &str) {
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        status_with(headers, code, v);
    } else {
        headers.insert(GRPC_STATUS.clone(), code_value(code));
    }
}

/// Adds the trailers-only fields of a refusal with `code` and a message
/// already encoded.
pub(super) fn status_with(headers: &mut HeaderMap, code: u16, message: HeaderValue) {
    headers.insert(GRPC_STATUS.clone(), code_value(code));
    headers.insert(GRPC_MESSAGE.clone(), message);
}

/// The codes refusals use, without formatting.
fn code_value(code: u16) -> HeaderValue {
    match code {
        3 => HeaderValue::from_static("3"),
        8 => HeaderValue::from_static("8"),
        13 => HeaderValue::from_static("13"),
        14 => HeaderValue::from_static("14"),
        16 => HeaderValue::from_static("16"),
        _ => HeaderValue::from(code),
    }
}

/// A wait in whole milliseconds, rounded up so that a client never comes
/// back early (and never 0 for a positive wait).
pub(super) fn pushback_ms(wait: std::time::Duration) -> u64 {
    u64::try_from(wait.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Adds `grpc-retry-pushback-ms`: a wait of `ms` ([`pushback_ms`]).
pub(super) fn pushback(headers: &mut HeaderMap, ms: u64) {
    headers.insert(GRPC_PUSHBACK.clone(), HeaderValue::from(ms));
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
    use std::time::Duration;

    use super::*;

    fn of(ct: &str) -> Protocol {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_str(ct).unwrap());
        Protocol::of(&h)
    }

    #[test]
    fn grpc_is_detected_by_its_exact_media_type() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
            "Application/GRPC+json",
        ] {
            assert_eq!(of(ct), Protocol::Grpc, "{ct}");
        }
        for ct in ["application/grpc-web", "application/grpc-web+proto"] {
            assert!(matches!(of(ct), Protocol::GrpcWeb(_)), "{ct}");
        }
        for ct in [
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            assert!(matches!(of(ct), Protocol::GrpcWebText(_)), "{ct}");
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

    /// A gRPC-Web caller is answered in its own content type (lowercased,
    /// without parameters); one that named no format, or one that cannot be
    /// repeated safely, gets gRPC-Web's default, `+proto`. A gRPC caller
    /// gets `application/grpc`.
    #[test]
    fn a_grpc_web_caller_is_answered_in_its_own_content_type() {
        for (asked, answered) in [
            (
                "application/grpc-web-text+thrift",
                "application/grpc-web-text+thrift",
            ),
            ("application/grpc-web+json", "application/grpc-web+json"),
            ("application/grpc-web", "application/grpc-web+proto"),
            (
                "application/grpc-web-text",
                "application/grpc-web-text+proto",
            ),
            (
                "Application/GRPC-Web+Thrift; charset=x",
                "application/grpc-web+thrift",
            ),
            // Empty, too long or with characters outside a format name.
            ("application/grpc-web+", "application/grpc-web+proto"),
            (
                "application/grpc-web-text+a-format-name-too-long",
                "application/grpc-web-text+proto",
            ),
            ("application/grpc-web+a\"b", "application/grpc-web+proto"),
            ("application/grpc+thrift", "application/grpc"),
            ("application/grpc;charset=utf-8", "application/grpc"),
            ("text/plain", "application/problem+json"),
        ] {
            assert_eq!(of(asked).content_type(), answered, "{asked}");
        }
    }

    /// `grpc-retry-pushback-ms` rounds the wait up to whole milliseconds: a
    /// client told 0 would retry at once, one told a millisecond less than
    /// the wait would be refused again.
    #[test]
    fn pushback_rounds_up_to_whole_milliseconds() {
        let ms = |wait: Duration| {
            let mut h = HeaderMap::new();
            pushback(&mut h, pushback_ms(wait));
            h["grpc-retry-pushback-ms"].to_str().unwrap().to_owned()
        };
        assert_eq!(ms(Duration::from_nanos(1)), "1");
        assert_eq!(ms(Duration::from_millis(1)), "1");
        assert_eq!(ms(Duration::from_millis(1) + Duration::from_nanos(1)), "2");
        assert_eq!(ms(Duration::from_micros(38_001)), "39");
        assert_eq!(ms(Duration::from_secs(2)), "2000");
        assert_eq!(ms(Duration::ZERO), "0");
        assert_eq!(ms(Duration::MAX), u64::MAX.to_string());
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a 100% é"), "a 100%25 %C3%A9");
    }
}
