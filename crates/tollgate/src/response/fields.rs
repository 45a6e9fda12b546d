//! The `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-10), written for both layers.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use tollgate_budget::{Charge, Outcome, Unit};

/// The `RateLimit-Policy` header name.
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// The `RateLimit` header name.
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up; never 0 for a positive duration.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Appends `n` in decimal.
pub(crate) fn push_int(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// Builds the two field values, one list member per limit.
/// Writes the `RateLimit-Policy` and `RateLimit` values side by side in
/// one buffer: one allocation for both, each value a slice of it.
#[derive(Default)]
pub(crate) struct FieldWriter {
    /// The `RateLimit-Policy` value, then (from `split`) the `RateLimit`
    /// value.
    text: Vec<u8>,
    /// On the stack until `finish`: one or two limits fit.
    current: smallvec::SmallVec<[u8; 96]>,
}

impl FieldWriter {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn policy(&mut self, name: &str, quota: u64, window: Option<Duration>, unit: &Unit) {
        let out = &mut self.text;
        if out.is_empty() {
            // Room for both values of one or two limits: one allocation.
            out.reserve(192);
        } else {
            out.extend_from_slice(b", ");
        }
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\";q=");
        out.extend_from_slice(itoa::Buffer::new().format(quota).as_bytes());
        if let Some(window) = window {
            out.extend_from_slice(b";w=");
            out.extend_from_slice(
                itoa::Buffer::new()
                    .format(ceil_secs(window).max(1))
                    .as_bytes(),
            );
        }
        if *unit != Unit::Requests {
            out.extend_from_slice(b";qu=\"");
            out.extend_from_slice(unit.as_str().as_bytes());
            out.push(b'"');
        }
    }

    pub(crate) fn current(&mut self, name: &str, remaining: u64, reset: Option<Duration>) {
        let out = &mut self.current;
        if !out.is_empty() {
            out.extend_from_slice(b", ");
        }
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\";r=");
        out.extend_from_slice(itoa::Buffer::new().format(remaining).as_bytes());
        if let Some(reset) = reset {
            out.extend_from_slice(b";t=");
            out.extend_from_slice(itoa::Buffer::new().format(ceil_secs(reset)).as_bytes());
        }
    }

    pub(crate) fn finish(self) -> Option<(HeaderValue, HeaderValue)> {
        let Self { mut text, current } = self;
        if text.is_empty() || current.is_empty() {
            return None;
        }
        let split = text.len();
        text.extend_from_slice(&current);
        let mut both = Bytes::from(text);
        let current = both.split_off(split);
        Some((
            HeaderValue::from_maybe_shared(both).ok()?,
            HeaderValue::from_maybe_shared(current).ok()?,
        ))
    }
}

/// `Retry-After` values of up to an hour, made once: a refusal's is
/// usually one of them, and then costs no allocation.
pub(crate) fn retry_after_value(secs: u64) -> HeaderValue {
    const TABLE: usize = 3601;
    static VALUES: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    let values = VALUES.get_or_init(|| {
        let mut text = String::new();
        let mut ends = Vec::with_capacity(TABLE);
        for n in 0..TABLE {
            text.push_str(itoa::Buffer::new().format(n));
            ends.push(text.len());
        }
        // Leaked once per process (about 14 KB): static header values are
        // cloned without touching a reference count.
        let text: &'static str = Box::leak(text.into_boxed_str());
        let mut start = 0;
        ends.into_iter()
            .map(|end| {
                let value = HeaderValue::from_static(&text[start..end]);
                start = end;
                value
            })
            .collect()
    });
    match usize::try_from(secs).ok().and_then(|i| values.get(i)) {
        Some(value) => value.clone(),
        None => HeaderValue::from(secs),
    }
}

/// The `RateLimit-Policy` and `RateLimit` values of `charges` as decided
/// in `outcome`, written member by member: the general writer, used
/// where a policy has no rendering and the one the rendered parts are
/// tested against (`rendered::ratelimit_fields` is the one to call).
pub(crate) fn written_fields(
    charges: &[Charge],
    outcome: &Outcome,
) -> Option<(HeaderValue, HeaderValue)> {
    let mut fields = FieldWriter::new();
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        let p = charge.policy();
        fields.policy(p.name(), p.capacity(), Some(p.window()), p.unit());
        // A cost that can never fit, or a limit not evaluated, says nothing
        // about the budget's state.
        if decision.is_evaluated() && !decision.never_fits() {
            fields.current(p.name(), decision.remaining(), Some(decision.reset()));
        }
    }
    fields.finish()
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

    #[test]
    fn an_in_flight_limit_has_no_window_and_names_its_unit() {
        let mut f = FieldWriter::new();
        f.policy("slow", 2, None, &Unit::ConcurrentRequests);
        f.current("slow", 0, None);
        let (policy, current) = f.finish().unwrap();
        assert_eq!(policy, "\"slow\";q=2;qu=\"concurrent-requests\"");
        assert_eq!(current, "\"slow\";r=0");
    }
}
