//! The `application/problem+json` body of a refusal (RFC 9457).

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;

use super::fields::{ceil_secs, push_int};

/// The problem type of a refusal for lack of budget.
pub(super) const RATE_LIMITED: &str = "urn:tollgate:problem:rate-limited";

/// The body: the refusal's problem type, the status and its reason phrase,
/// a detail, and the policy and wait when there are.
pub(super) fn body(
    problem_type: &str,
    status: StatusCode,
    detail: &str,
    policy: Option<&str>,
    retry_after: Option<Duration>,
) -> Bytes {
    let mut json = String::with_capacity(256);
    // Problem types and reason phrases are fixed ASCII without quotes or
    // backslashes: they need no escaping.
    json.push_str("{\"type\":\"");
    json.push_str(problem_type);
    json.push_str("\",\"title\":\"");
    json.push_str(status.canonical_reason().unwrap_or("Error"));
    json.push('"');
    json.push_str(",\"status\":");
    push_int(&mut json, u64::from(status.as_u16()));
    json.push_str(",\"detail\":");
    json_string(&mut json, detail);
    if let Some(p) = policy {
        // Policy and layer names are [A-Za-z0-9._-]: nothing to escape.
        json.push_str(",\"policy\":\"");
        json.push_str(p);
        json.push('"');
    }
    if let Some(wait) = retry_after {
        json.push_str(",\"retry_after\":");
        push_int(&mut json, ceil_secs(wait).max(1));
    }
    json.push('}');
    Bytes::from(json)
}

/// Appends `s` as a JSON string.
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let body = body("t", StatusCode::BAD_REQUEST, "bad \"value\"\n", None, None);
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(text.contains(r#""detail":"bad \"value\"\u000a""#), "{text}");
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["status"], 400);
    }
}
