//! A policy's refusal for lack of budget, rendered once per policy and kept
//! with it ([`Policy::memo`]): the `RateLimit-Policy` value, the fixed part
//! of the `RateLimit` value, the detail, and the problem+json body around
//! its two waits. A refusal then only writes its numbers (the wait, the
//! remaining budget, the reset) into one buffer per value, without
//! formatting machinery; the answer is byte for byte the one the general
//! path (`problem::body`, `ratelimit_fields`) writes.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;

use bytes::Bytes;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, StatusCode};
use tollgate_budget::{Charge, Decision, Outcome, Policy};

use super::fields::{
    FieldWriter, RATELIMIT, RATELIMIT_POLICY, ceil_secs, retry_after_value, written_fields,
};
use super::problem::RATE_LIMITED;

/// The numbers of a lone policy's refusal for lack of budget, the only
/// part of it not rendered in advance (besides the wait). Two words, so
/// that an answer that carries them is no larger than one with a text.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Numbers {
    /// What the key has left of the policy's budget.
    remaining: u64,
    /// When the budget is whole again, in whole seconds rounded up (what
    /// the field says).
    reset_secs: u64,
}

impl Numbers {
    pub(crate) fn new(remaining: u64, reset: Duration) -> Self {
        Self {
            remaining,
            reset_secs: ceil_secs(reset),
        }
    }
}

/// The parts of a policy's refusal that do not change between refusals.
pub(crate) struct Rendered {
    /// `RateLimit-Policy` of this policy alone.
    policy_field: HeaderValue,
    /// `"NAME";r=`: the `RateLimit` value up to the remaining budget.
    current_head: Box<[u8]>,
    /// `rate limit of policy NAME exceeded`.
    detail: Box<str>,
    /// The problem body up to the wait in its detail.
    body_head: Box<[u8]>,
    /// The problem body from after that wait up to the `retry_after`
    /// member's value.
    body_mid: Box<[u8]>,
    /// The HTTP refusal's head, in the general path's order:
    /// `Cache-Control`, `RateLimit-Policy`, `RateLimit` (a placeholder),
    /// `Content-Type`, `Retry-After` (a placeholder). Cloned per refusal,
    /// which costs less than hashing five names into a new map.
    http_head: HeaderMap,
    /// The last `RateLimit` value of an empty budget written, with its
    /// reset in whole seconds: in a flood the refusals of one second say
    /// the same (nothing left, the same reset), and share one value.
    last: Kept<Option<HeaderValue>>,
    /// The last problem body written, with its wait in whole seconds: the
    /// refusals of one second in a flood say the same wait, and share one
    /// body.
    last_body: Kept<Bytes>,
}

/// The last value written for a number (a reset, a wait in whole
/// seconds), shared by every thread while the number stays the same.
struct Kept<T>(ArcSwapOption<(u64, T)>);

impl<T: Clone> Kept<T> {
    fn new() -> Self {
        Self(ArcSwapOption::empty())
    }

    /// The value kept for `n`, or `write`'s, kept from now on.
    fn get(&self, n: u64, write: impl FnOnce() -> T) -> T {
        if let Some(last) = &*self.0.load()
            && last.0 == n
        {
            return last.1.clone();
        }
        let value = write();
        self.0.store(Some(Arc::new((n, value.clone()))));
        value
    }
}

/// The room a decimal `u64` takes at most.
const DIGITS: usize = 20;

impl Rendered {
    /// `policy`'s rendering, made on its first refusal. `None` only if the
    /// policy's memo holds something else (nothing in this crate puts
    /// anything else there) or its name could not be a header value (policy
    /// names are checked to be `[A-Za-z0-9._-]`): the caller then writes
    /// the answer the general way.
    pub(crate) fn of(policy: &Policy) -> Option<&Rendered> {
        policy.memo(Rendered::new).and_then(Option::as_ref)
    }

    fn new(policy: &Policy) -> Option<Rendered> {
        let name = policy.name();
        let mut fields = FieldWriter::new();
        fields.policy(
            name,
            policy.capacity(),
            Some(policy.window()),
            policy.unit(),
        );
        fields.current(name, 0, None);
        let (policy_field, _) = fields.finish()?;
        let detail = format!("rate limit of policy {name} exceeded");
        let status = StatusCode::TOO_MANY_REQUESTS;
        // As `problem::body` writes it; the detail needs no escaping (a
        // policy name has no quote, backslash or control character).
        let body_head = format!(
            "{{\"type\":\"{}\",\"title\":\"{}\",\"status\":{},\"detail\":\"{detail}; retry after ",
            RATE_LIMITED,
            status.canonical_reason().unwrap_or("Error"),
            status.as_u16(),
        );
        let body_mid = format!(" s\",\"policy\":\"{name}\",\"retry_after\":");
        let mut http_head = HeaderMap::with_capacity(5);
        http_head.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        http_head.insert(RATELIMIT_POLICY.clone(), policy_field.clone());
        http_head.insert(RATELIMIT.clone(), HeaderValue::from_static(""));
        http_head.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        http_head.insert(RETRY_AFTER, HeaderValue::from_static(""));
        Some(Rendered {
            last: Kept::new(),
            last_body: Kept::new(),
            http_head,
            policy_field,
            current_head: format!("\"{name}\";r=").into_bytes().into(),
            detail: detail.into(),
            body_head: body_head.into_bytes().into(),
            body_mid: body_mid.into_bytes().into(),
        })
    }

    /// The refusal's detail without its wait.
    pub(crate) fn detail(&self) -> &str {
        &self.detail
    }

    /// `RateLimit-Policy` and `RateLimit` for `numbers`.
    pub(crate) fn fields(&self, numbers: Numbers) -> Option<(HeaderValue, HeaderValue)> {
        Some((self.policy_field.clone(), self.current(numbers)?))
    }

    /// The head of the HTTP refusal (without a body of the application's
    /// or a challenge) for a wait of `secs`: the `RateLimit` value for
    /// `numbers`, or `fields` when the refusal describes several limits.
    pub(crate) fn http_head(
        &self,
        numbers: Numbers,
        fields: Option<(HeaderValue, HeaderValue)>,
        secs: u64,
    ) -> Option<HeaderMap> {
        let (policy, current) = match fields {
            Some((policy, current)) => (Some(policy), current),
            None => (None, self.current(numbers)?),
        };
        let mut head = self.http_head.clone();
        // The template holds each of its five names once, in the order
        // `new` inserted them, and a map with no name repeated visits its
        // values in that order: each value is written in place by its
        // position, without hashing its name again.
        let mut values = head.values_mut();
        let _cache_control = values.next()?;
        let policy_slot = values.next()?;
        if let Some(policy) = policy {
            *policy_slot = policy;
        }
        *values.next()? = current;
        let _content_type = values.next()?;
        *values.next()? = retry_after_value(secs);
        Some(head)
    }

    /// The `RateLimit` value for `numbers`: an empty budget's (a refusal's)
    /// is shared while its reset stays the same second; others (an
    /// admitted response's, which change with every request) are written.
    fn current(&self, numbers: Numbers) -> Option<HeaderValue> {
        let Numbers {
            remaining,
            reset_secs: reset,
        } = numbers;
        if remaining != 0 {
            return self.write_current(remaining, reset);
        }
        self.last.get(reset, || self.write_current(0, reset))
    }

    /// The `RateLimit` value for `remaining` and a reset of `reset` whole
    /// seconds, written.
    fn write_current(&self, remaining: u64, reset: u64) -> Option<HeaderValue> {
        let mut current = Vec::with_capacity(self.current_head.len() + 2 * DIGITS + 3);
        self.push_current(&mut current, remaining, reset);
        HeaderValue::from_maybe_shared(Bytes::from(current)).ok()
    }

    /// Appends this policy's `RateLimit` member.
    fn push_current(&self, out: &mut Vec<u8>, remaining: u64, reset: u64) {
        out.extend_from_slice(&self.current_head);
        out.extend_from_slice(itoa::Buffer::new().format(remaining).as_bytes());
        out.extend_from_slice(b";t=");
        out.extend_from_slice(itoa::Buffer::new().format(reset).as_bytes());
    }

    /// The problem+json body for a wait of `secs` whole seconds: the last
    /// one written while the wait stays the same.
    pub(crate) fn body(&self, secs: u64) -> Bytes {
        self.last_body.get(secs, || self.write_body(secs))
    }

    /// The problem+json body for a wait of `secs` whole seconds, written.
    fn write_body(&self, secs: u64) -> Bytes {
        let mut itoa = itoa::Buffer::new();
        let secs = itoa.format(secs).as_bytes();
        let mut body =
            Vec::with_capacity(self.body_head.len() + self.body_mid.len() + 2 * secs.len() + 1);
        body.extend_from_slice(&self.body_head);
        body.extend_from_slice(secs);
        body.extend_from_slice(&self.body_mid);
        body.extend_from_slice(secs);
        body.push(b'}');
        Bytes::from(body)
    }

    /// The `grpc-message` for a pushback of `ms` milliseconds: printable
    /// ASCII without `%`, so gRPC's percent-encoding leaves it as it is.
    pub(crate) fn grpc_message(&self, ms: u64) -> Option<HeaderValue> {
        const WAIT: &[u8] = b"; retry after ";
        let mut message = Vec::with_capacity(self.detail.len() + WAIT.len() + DIGITS + 3);
        message.extend_from_slice(self.detail.as_bytes());
        message.extend_from_slice(WAIT);
        message.extend_from_slice(itoa::Buffer::new().format(ms).as_bytes());
        message.extend_from_slice(b" ms");
        HeaderValue::from_maybe_shared(Bytes::from(message)).ok()
    }
}

/// The `RateLimit-Policy` and `RateLimit` values of `charges` as decided
/// in `outcome`: from the policies' rendered parts ([`rendered_fields`]),
/// else written ([`written_fields`]).
pub(crate) fn ratelimit_fields(
    charges: &[Charge],
    outcome: &Outcome,
) -> Option<(HeaderValue, HeaderValue)> {
    rendered_fields(charges, outcome).unwrap_or_else(|| written_fields(charges, outcome))
}

/// The `RateLimit-Policy` and `RateLimit` values of `charges` as decided in
/// `outcome`, from their policies' rendered parts: one limit's are shared
/// values, several are joined into one buffer. `None` when a policy has no
/// rendering (the caller then writes them the general way); the inner
/// `None` is what the general writer gives for nothing to say.
pub(crate) fn rendered_fields(
    charges: &[Charge],
    outcome: &Outcome,
) -> Option<Option<(HeaderValue, HeaderValue)>> {
    let said = |d: &Decision| d.is_evaluated() && !d.never_fits();
    if let ([charge], [decision]) = (charges, outcome.limits()) {
        let rendered = Rendered::of(charge.policy())?;
        return Some(
            said(decision)
                .then(|| rendered.fields(Numbers::new(decision.remaining(), decision.reset())))
                .flatten(),
        );
    }
    let mut joined = Vec::with_capacity(192);
    for charge in charges {
        if !joined.is_empty() {
            joined.extend_from_slice(b", ");
        }
        joined.extend_from_slice(Rendered::of(charge.policy())?.policy_field.as_bytes());
    }
    let split = joined.len();
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        if !said(decision) {
            continue;
        }
        if joined.len() > split {
            joined.extend_from_slice(b", ");
        }
        let reset = ceil_secs(decision.reset());
        Rendered::of(charge.policy())?.push_current(&mut joined, decision.remaining(), reset);
    }
    if split == 0 || joined.len() == split {
        return Some(None);
    }
    let mut policy = Bytes::from(joined);
    let current = policy.split_off(split);
    Some(
        HeaderValue::from_maybe_shared(policy)
            .ok()
            .zip(HeaderValue::from_maybe_shared(current).ok()),
    )
}

#[cfg(test)]
mod tests {
    use super::Rendered;
    use tollgate_budget::{Policy, Rate};

    /// The body kept for a wait is the one written for it, whatever wait
    /// came before: shared while the wait stays, written again when it
    /// changes, and right again when an earlier wait comes back.
    #[test]
    fn a_kept_body_is_the_body_of_its_wait() {
        let policy = Policy::token_bucket("per-ip", 5, Rate::per_second(1)).unwrap();
        let rendered = Rendered::of(&policy).unwrap();
        for secs in [3, 3, 4, 3, 0, u64::MAX, u64::MAX, 3] {
            assert_eq!(rendered.body(secs), rendered.write_body(secs), "{secs}");
            let text = String::from_utf8(rendered.body(secs).to_vec()).unwrap();
            assert!(
                text.ends_with(&format!("\"retry_after\":{secs}}}")),
                "{text}"
            );
        }
        // A second body of the same wait is the kept one, not a copy.
        let (a, b) = (rendered.body(7), rendered.body(7));
        assert_eq!(a.as_ptr(), b.as_ptr());
    }
}
