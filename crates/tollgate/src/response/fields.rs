//! The `RateLimit-Policy` and `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-10), written for both layers.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use tollgate_core::{Charge, Decision, Outcome, Unit};

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
#[derive(Default)]
pub(crate) struct FieldWriter {
    policy: String,
    current: String,
}

impl FieldWriter {
    pub(crate) fn new() -> Self {
        Self {
            policy: String::with_capacity(64),
            current: String::with_capacity(64),
        }
    }

    /// Describes a limit in `RateLimit-Policy`: its quota, the window it is
    /// expressed over (whole seconds, at least 1; none for in-flight
    /// limits) and its unit when it is not requests.
    pub(crate) fn policy(&mut self, name: &str, quota: u64, window: Option<Duration>, unit: &Unit) {
        let out = &mut self.policy;
        if !out.is_empty() {
            out.push_str(", ");
        }
        // Names are restricted to [A-Za-z0-9._-], so they need no escaping.
        out.push('"');
        out.push_str(name);
        out.push_str("\";q=");
        push_int(out, quota);
        if let Some(window) = window {
            out.push_str(";w=");
            push_int(out, ceil_secs(window).max(1));
        }
        if *unit != Unit::Requests {
            out.push_str(";qu=\"");
            out.push_str(unit.as_str());
            out.push('"');
        }
    }

    /// Describes a limit's state in `RateLimit`: what is left and, if
    /// known, when it resets.
    pub(crate) fn current(&mut self, name: &str, remaining: u64, reset: Option<Duration>) {
        let out = &mut self.current;
        if !out.is_empty() {
            out.push_str(", ");
        }
        out.push('"');
        out.push_str(name);
        out.push_str("\";r=");
        push_int(out, remaining);
        if let Some(reset) = reset {
            out.push_str(";t=");
            push_int(out, ceil_secs(reset));
        }
    }

    /// The two values, or `None` when either is empty.
    pub(crate) fn finish(self) -> Option<(HeaderValue, HeaderValue)> {
        if self.policy.is_empty() || self.current.is_empty() {
            return None;
        }
        // The strings become the header values without a copy.
        Some((
            HeaderValue::from_maybe_shared(Bytes::from(self.policy)).ok()?,
            HeaderValue::from_maybe_shared(Bytes::from(self.current)).ok()?,
        ))
    }
}

/// The fields describing each charged policy of `outcome`.
pub(crate) fn ratelimit_fields(
    charges: &[Charge],
    outcome: &Outcome,
) -> Option<(HeaderValue, HeaderValue)> {
    let mut fields = FieldWriter::new();
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        let p = charge.policy();
        fields.policy(p.name(), p.capacity(), Some(p.window()), p.unit());
        // A cost that can never fit, or a limit not evaluated, says nothing
        // about the budget's state.
        if !matches!(decision, Decision::NeverFits { .. } | Decision::Unevaluated) {
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
