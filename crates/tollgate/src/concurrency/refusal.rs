//! The concurrency layer's refusals, as answers and as responses.

use bytes::Bytes;
use http::{Method, Response};
use tollgate_budget::Unit;

use super::config::Config;
use super::limiter::Saturated;
use crate::response::{Answer, FieldWriter, Limit, Protocol, Refusal};

/// `answer` as this layer's response: its body written by the
/// application's [`refusal_body`](super::ConcurrencyLimitLayer::refusal_body)
/// when there is one.
pub(crate) fn respond(
    config: &Config,
    answer: Answer,
    protocol: Protocol,
    method: &Method,
) -> Response<Bytes> {
    answer.answer(protocol, config.shape.as_ref(), method)
}

/// When to come back after a refusal for fair share or priority: by then
/// the demand the shares were computed from is a period older.
const SHARES_MOVE: std::time::Duration = std::time::Duration::from_secs(1);

/// The refusal for a full limit.
pub(crate) fn refusal(config: &Config, full: Saturated) -> Answer {
    let l = &config.limiter.limits;
    match full {
        Saturated::PerKey => {
            let Some(max) = l.per_key_max else {
                // Adaptive: the number is the key's own and moves, so no
                // quota is told.
                let mut answer = Answer::new(
                    Refusal::TooManyInFlight,
                    format!(
                        "too many of your requests are in flight at once for what their backend \
                         takes now ({:?})",
                        &*l.name
                    ),
                );
                answer.policy = Some(Limit::InFlight(l.name.clone()));
                return answer;
            };
            let mut answer = Answer::new(
                Refusal::TooManyInFlight,
                format!(
                    "at most {max} {} of yours may be in flight at once ({:?})",
                    if max == 1 { "request" } else { "requests" },
                    &*l.name
                ),
            );
            answer.policy = Some(Limit::InFlight(l.name.clone()));
            // No window and no reset: no time can be promised.
            let mut fields = FieldWriter::new();
            fields.policy(
                &l.name,
                u64::try_from(max).unwrap_or(u64::MAX),
                None,
                &Unit::ConcurrentRequests,
            );
            fields.current(&l.name, 0, None);
            answer.fields = fields.finish().map(Box::new);
            answer
        }
        Saturated::Unavailable => {
            let mut answer = Answer::new(
                Refusal::StoreUnavailable,
                "the in-flight limit's store is unavailable; try again later",
            );
            answer.policy = Some(Limit::InFlight(l.name.clone()));
            answer
        }
        Saturated::FairShare | Saturated::Priority | Saturated::Global | Saturated::Queue => {
            let (detail, retry_after) = match full {
                Saturated::FairShare => (
                    "the service is at capacity and your share of it is in use; try again later",
                    Some(SHARES_MOVE),
                ),
                Saturated::Priority => (
                    "the service is at capacity for requests of this priority; try again later",
                    Some(SHARES_MOVE),
                ),
                _ => ("the service is at capacity; try again later", None),
            };
            let mut answer = Answer::new(Refusal::Overloaded, detail);
            answer.policy = Some(Limit::InFlight(l.name.clone()));
            answer.retry_after = retry_after;
            answer
        }
    }
}
