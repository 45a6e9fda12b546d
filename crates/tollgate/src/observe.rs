//! Tracing events and (with the `metrics` feature) metrics, labelled by
//! policy name and never by raw key.
//!
//! Metrics emitted:
//! - `tollgate_admitted_cost_total{policy}`: cost admitted;
//! - `tollgate_denied_cost_total{policy}`: cost refused (429);
//! - `tollgate_never_fits_total{policy}`: requests whose cost can never fit;
//! - `tollgate_requests_total{policy,outcome="exempt"}`: requests a rule
//!   did not charge because of an exemption;
//! - `tollgate_dry_run_denied_cost_total{policy}`: cost a dry-run rule would
//!   have refused (and let through);
//! - `tollgate_late_refused_cost_total{policy}`: cost of a rule charged
//!   after the response that found its budget spent (see
//!   `Rule::charge_only_when`);
//! - `tollgate_store_errors_total{kind,outcome}`: store failures and the
//!   outcome applied (`fail_closed`, `fail_open`, `fallback`,
//!   `late_charge_lost`);
//! - `tollgate_store_seconds`: store decision latency histogram.

use tollgate_core::{Charge, Decision, Outcome, StoreError, Verdict};

pub(crate) fn outcome(charges: &[Charge], outcome: &Outcome, verdict: Verdict) {
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        let name = charge.policy().name();
        match (verdict, decision) {
            (Verdict::NeverFits, Decision::NeverFits { .. }) => {
                tracing::debug!(policy = name, cost = charge.cost(), "cost can never fit");
                count("tollgate_never_fits_total", name, 1);
            }
            (Verdict::Denied { .. }, Decision::Denied { retry_after, .. }) => {
                tracing::debug!(
                    policy = name,
                    cost = charge.cost(),
                    ?retry_after,
                    "rate limited"
                );
                count("tollgate_denied_cost_total", name, charge.cost());
            }
            (Verdict::Admitted, Decision::Admitted { .. }) => {
                count("tollgate_admitted_cost_total", name, charge.cost());
            }
            // Limits of a refused call that did not refuse it spent nothing
            // and refused nothing.
            _ => {}
        }
    }
}

/// A cost that can never fit `policy`; the layer refuses it without asking
/// the store.
/// A request held by shaping rules for `delay` before it goes on.
pub(crate) fn shaped(charges: &[Charge], delay: std::time::Duration) {
    for charge in charges.iter().filter(|c| c.max_delay().is_some()) {
        let policy = charge.policy().name();
        tracing::debug!(policy, wait_ms = delay.as_millis(), "request shaped");
        #[cfg(feature = "metrics")]
        {
            metrics::counter!("tollgate_shaped_total", "policy" => policy.to_owned()).increment(1);
            metrics::histogram!("tollgate_shaped_wait_seconds", "policy" => policy.to_owned())
                .record(delay.as_secs_f64());
        }
    }
}

pub(crate) fn never_fits(policy: &tollgate_core::Policy, cost: u64) {
    tracing::debug!(policy = policy.name(), cost, "cost can never fit");
    count("tollgate_never_fits_total", policy.name(), 1);
}

/// A request `policy` did not charge because an exemption matched it.
pub(crate) fn exempt(policy: &tollgate_core::Policy) {
    tracing::trace!(policy = policy.name(), "exempt");
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_requests_total",
        "policy" => policy.name().to_owned(),
        "outcome" => "exempt"
    )
    .increment(1);
}

/// A dry-run `policy` would have refused `cost` (after `retry_after`, or
/// never when `None`); the request goes on without it.
pub(crate) fn dry_run_denied(
    policy: &tollgate_core::Policy,
    cost: u64,
    retry_after: Option<std::time::Duration>,
) {
    tracing::info!(
        policy = policy.name(),
        cost,
        ?retry_after,
        "dry run: this request would have been refused"
    );
    count("tollgate_dry_run_denied_cost_total", policy.name(), cost);
}

/// A rule charged after its response: admitted, or refused because
/// requests in flight at the same time spent the budget after the check.
pub(crate) fn late_charge(charge: &Charge, result: Result<Outcome, StoreError>) {
    let name = charge.policy().name();
    match result {
        Ok(outcome) if outcome.is_admitted() => {
            count("tollgate_admitted_cost_total", name, charge.cost());
        }
        Ok(_) => {
            tracing::info!(
                policy = name,
                cost = charge.cost(),
                "charged after the response, but the budget was spent meanwhile: not counted"
            );
            count("tollgate_late_refused_cost_total", name, charge.cost());
        }
        Err(error) => store_error(&error, "late_charge_lost"),
    }
}

pub(crate) fn store_error(error: &StoreError, applied: &'static str) {
    tracing::warn!(error = %error, kind = ?error.kind(), outcome = applied, "rate-limit store failed");
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "tollgate_store_errors_total",
        "kind" => format!("{:?}", error.kind()),
        "outcome" => applied
    )
    .increment(1);
}

/// A start time for the store-latency histogram; no clock read without the
/// `metrics` feature.
pub(crate) fn start() -> Option<std::time::Instant> {
    #[cfg(feature = "metrics")]
    return Some(std::time::Instant::now());
    #[cfg(not(feature = "metrics"))]
    None
}

pub(crate) fn store_latency(started: Option<std::time::Instant>) {
    #[cfg(feature = "metrics")]
    if let Some(started) = started {
        metrics::histogram!("tollgate_store_seconds").record(started.elapsed().as_secs_f64());
    }
    let _ = started;
}

fn count(metric: &'static str, policy: &str, by: u64) {
    // Only with the feature: the label is the policy's name, never a key.
    #[cfg(feature = "metrics")]
    metrics::counter!(metric, "policy" => policy.to_owned()).increment(by);
    let _ = (metric, policy, by);
}
