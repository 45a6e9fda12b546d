//! Tracing events and (with the `metrics` feature) metrics, labelled by
//! policy or layer name and never by raw key.
//!
//! Every metric tollgate emits, through the `metrics` facade (nothing is
//! emitted without the feature, and nothing until a recorder is
//! installed). Names are given as Prometheus sees them through
//! `metrics-exporter-prometheus`, which keeps a counter's or a gauge's
//! name as given (every counter here already ends in `_total`, and none
//! is described with a unit, so its optional suffixes add nothing). A
//! histogram is rendered as a summary (`name{quantile}`, `name_sum`,
//! `name_count`) unless buckets are set for it, then as a histogram
//! (`name_bucket{le}`, `name_sum`, `name_count`). Cost is counted in the
//! policy's own unit (requests, bytes, tokens: whatever the rule's cost
//! counts); "requests" below means one per request.
//!
//! Rate limits (`RateLimitLayer`), label `policy` (a policy's name):
//!
//! | Metric | Type, unit | Labels | Moves when |
//! |---|---|---|---|
//! | `tollgate_admitted_cost_total` | counter, cost | `policy` | a request is admitted: each limit's cost, once the store decided (a shaped request at that decision, before its hold); dry-run limits that would admit it too; not when the store failed open (nothing was decided) |
//! | `tollgate_denied_cost_total` | counter, cost | `policy` | a request is refused for lack of budget (`429`): the cost of each limit that refused it (the others of the call spent and refused nothing) |
//! | `tollgate_never_fits_total` | counter, requests | `policy` | a request whose cost is more than the policy can ever hold (`413` for a content cost, `400` otherwise); counted for every such policy, even when another rule's refusal is the answer |
//! | `tollgate_requests_total` | counter, requests | `policy`, `outcome` | a rule did not charge a request because one of its exemptions matched; `outcome` is `exempt` (its only value) |
//! | `tollgate_dry_run_denied_cost_total` | counter, cost | `policy` | a dry-run rule would have refused the cost (and the request went on without it) |
//! | `tollgate_refunded_cost_total` | counter, cost | `policy` | a reservation of a rule charged by outcome (`Rule::charge_only_when`) is given back because the response did not match |
//! | `tollgate_shaped_total` | counter, requests | `policy` | an admitted request is held by shaping (`Rule::shape`) before it goes on: one for each shaping rule of the request |
//! | `tollgate_shaped_wait_seconds` | histogram, seconds | `policy` | with `tollgate_shaped_total`: how long the request is held (the whole hold, under each of its shaping rules) |
//!
//! Stores, shared by both layers:
//!
//! | Metric | Type, unit | Labels | Moves when |
//! |---|---|---|---|
//! | `tollgate_store_errors_total` | counter, failures | `kind`, `outcome` | a store call failed: one per failed call (a rate limit's charge or settlement, an in-flight limit's lease), with what was done about it; a request whose fallback store fails too counts `fallback`, then `fail_closed` |
//! | `tollgate_store_seconds` | histogram, seconds | none | a `RateLimitLayer` charged its store: how long the charge took, failures included (not a fallback store's charges, an in-process store's failures, refunds and confirmations, nor the lease stores of in-flight limits) |
//!
//! `kind` is the failure's `StoreErrorKind`, as its variant name:
//! `Unavailable`, `Uncertain`, `CapacityExhausted`, `Protocol`,
//! `Unsupported`, `Config`. `outcome` is what was applied:
//! - `fail_closed`: the request was refused (`503`); also counted when the
//!   fallback store fails in turn;
//! - `fail_open`: the request went on unchecked;
//! - `fallback`: a rate limit asked its fallback store
//!   (`OnStoreError::Fallback`);
//! - `local`: an in-flight limit counted in this process alone
//!   (`OnLeaseError::Local`);
//! - `refund_lost` and `confirm_lost`: a reservation of a rule charged by
//!   outcome could not be given back or confirmed after the response; it
//!   stays spent, and lapses as confirmed a minute after it was made.
//!
//! In-flight limits (`ConcurrencyLimitLayer`), label `layer` (the name
//! the layer was built with, which a shared limit's leases carry too):
//!
//! | Metric | Type, unit | Labels | Moves when |
//! |---|---|---|---|
//! | `tollgate_in_flight` | gauge, requests | `layer` | set whenever this process's counts of the layer change (a slot taken, given back or handed to a waiter; a waiter in or out of line): the requests in flight here, holding a shared limit's lease or not, dry-run ones let through above the limit included |
//! | `tollgate_concurrency_limit` | gauge, requests | `layer` | set with `tollgate_in_flight`, for an [adaptive](crate::concurrency::ConcurrencyLimitBuilder::adaptive) limit only: the global limit this process enforces now (the probe limit while it measures the minimum latency); its moves larger than the configured fraction are also logged at INFO, "adaptive concurrency limit moved" with `from` and `to` (a [per-key adaptive](crate::concurrency::ConcurrencyLimitBuilder::per_key_adaptive) limit has no gauge: one per key would be unbounded; its moves are logged at DEBUG, "adaptive per-key concurrency limit moved" with `key`, `key_fingerprint`, `from` and `to`) |
//! | `tollgate_waiting` | gauge, requests | `layer` | set with `tollgate_in_flight`: this process's requests waiting in the layer's own line (not those waiting their turn for a shared limit's lease, which `ConcurrencyStats::waiting` counts and this gauge does not) |
//! | `tollgate_concurrency_refused_total` | counter, requests | `layer`, `scope` | the layer refused a request |
//! | `tollgate_dry_run_refused_total` | counter, requests | `layer`, `scope` | a dry-run layer would have refused a request and let it through instead |
//! | `tollgate_lease_restored_total` | counter, leases | `layer` | a shared limit's lease was found gone while its request still ran, and taken again |
//! | `tollgate_lease_release_abandoned_total` | counter, leases | `layer` | a lease could not be given back while the lease store failed and the retry queue was full (1024 leases): it expires by itself, its slot taken until then |
//! | `tollgate_stalled_bodies_total` | counter, responses | `layer` | a response body made no progress for the layer's body idle timeout: its slot was released and the body ended |
//!
//! `scope` is what was full:
//! - `per_key`: the key's own limit (`429`), including a wait for it that
//!   timed out, and a key that already has as many waiting as it may have
//!   in flight;
//! - `global`: the layer's overall limit (`503`), including a wait for it
//!   that timed out;
//! - `queue`: the line of waiters was full, or a waiter gave its place in
//!   a full line to an earlier arrival (a shared limit), to a higher
//!   [`Priority`](crate::concurrency::Priority) class or to a tenant below
//!   its fair share (`503`);
//! - `fair_share`: the limit is contended and the request's tenant holds
//!   its fair share of it
//!   ([`fair_share`](crate::concurrency::ConcurrencyLimitBuilder::fair_share);
//!   `503`, `Retry-After: 1`);
//! - `priority`: what is left of the limit is kept for the recent demand of
//!   higher classes
//!   ([`priority`](crate::concurrency::ConcurrencyLimitBuilder::priority);
//!   `503`, `Retry-After: 1`);
//! - `store_unavailable`: a shared limit's lease store failed and the layer
//!   fails closed (`503`; never in `tollgate_dry_run_refused_total`, a
//!   dry-run layer refuses it too).
//!
//! The fleet's policy set (`redis::FleetPolicies`, features `redis` and
//! `serde`):
//!
//! | Metric | Type, unit | Labels | Moves when |
//! |---|---|---|---|
//! | `tollgate_fleet_policies_version` | gauge | — | features `redis` and `serde`: the version of the fleet's policy set this process runs ([`FleetPolicies`](crate::redis::FleetPolicies)); each version put in force is also logged at INFO, "fleet policies: version in force" with `key` and `version` |
//! | `tollgate_fleet_policies_errors_total` | counter | `reason` | features `redis` and `serde`: `invalid`, a published set this process cannot apply (once per version; logged at ERROR with the error and the version it runs), `unreachable`, a read of the published set that failed (logged at ERROR once per spell), or `numbers`, a comparison of numbers with the other instances that failed (logged at WARN once per spell; mismatches go unseen meanwhile); a set written back to a Redis that had lost it is logged at WARN |
//! | `tollgate_fleet_policies_mismatched_total` | counter | `policy` | features `redis` and `serde`: comparisons (every 5 s, `DEFAULT_COMPARE_EVERY`) in which another instance on the same Redis charged this policy's budget under other numbers for longer than a publication takes to arrive; counted and logged at WARN once per policy and period, never per request |

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tollgate_budget::{Charge, Key, Outcome, StoreError, Verdict};
use tracing::Level;

/// Emits a tracing event at a level chosen at run time (the macros take a
/// constant level).
macro_rules! event_at {
    ($level:expr, $($rest:tt)+) => {
        match $level {
            tracing::Level::ERROR => tracing::error!($($rest)+),
            tracing::Level::WARN => tracing::warn!($($rest)+),
            tracing::Level::INFO => tracing::info!($($rest)+),
            tracing::Level::DEBUG => tracing::debug!($($rest)+),
            tracing::Level::TRACE => tracing::trace!($($rest)+),
        }
    };
}
pub(crate) use event_at;

static FINGERPRINT_KEY: OnceLock<(u64, u64)> = OnceLock::new();

/// Sets the secret that key fingerprints in logs are computed with, so
/// that every instance of a fleet logs one client's key with the same
/// fingerprint. Without it a random secret is drawn per process. Returns
/// `false` (and changes nothing) once a fingerprint has been computed or
/// the key set: fingerprints never change while a process runs.
///
/// A fingerprint is 64 bits of SipHash-1-3 of the key's text under this
/// secret: stable, not reversible without the secret (an address space is
/// small enough to search, so keep the secret as secret as the logs need
/// to be), and never the key or a credential itself.
pub fn set_log_fingerprint_key(secret: [u8; 16]) -> bool {
    let (a, b) = secret.split_at(8);
    let k = |half: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(half);
        u64::from_le_bytes(w)
    };
    FINGERPRINT_KEY.set((k(a), k(b))).is_ok()
}

/// The fingerprint of `key` for logs: 16 hex digits. A key names the
/// client (its address, its account), not the policy: one client has one
/// fingerprint in every rule keyed alike, and on every instance that shares
/// the secret ([`set_log_fingerprint_key`]).
pub(crate) fn fingerprint(key: &Key) -> String {
    key.with_text_bytes(fingerprint_text)
}

/// The fingerprint of a key's text ([`fingerprint`]).
pub(crate) fn fingerprint_text(text: &[u8]) -> String {
    use std::hash::{BuildHasher, Hasher};
    let &(k0, k1) = FINGERPRINT_KEY.get_or_init(|| {
        let seeds = std::hash::RandomState::new();
        (
            seeds.hash_one(0x006c_6f67_u64),
            seeds.hash_one(0x006b_6579_u64),
        )
    });
    let mut h = siphasher::sip::SipHasher13::new_with_keys(k0, k1);
    h.write(text);
    format!("{:016x}", h.finish())
}

/// The names of a key's parts, without their values (`ip`, `t,a,op`):
/// which rule keyed it, readable and revealing nothing of the client.
pub(crate) fn key_shape(key: &Key) -> String {
    key_shape_text(&key.text())
}

/// The shape of a key's text ([`key_shape`]).
pub(crate) fn key_shape_text(text: &str) -> String {
    text.split(':')
        .map(|part| part.split_once('=').map_or(part, |(name, _)| name))
        .collect::<Vec<_>>()
        .join(",")
}

/// A message that may repeat per request (a store outage, a server
/// misconfiguration), logged the first time and then at most once per
/// interval with how many were left out.
pub(crate) struct Throttle {
    /// When the next one may be logged, in ns since `EPOCH`.
    next: AtomicU64,
    suppressed: AtomicU64,
}

const THROTTLE_INTERVAL: Duration = Duration::from_secs(10);

fn since_start() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Throttle {
    pub(crate) const fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when this one is to be logged, `n` the ones left out
    /// since the last; `None` when it is left out (and counted).
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = since_start();
        let next = self.next.load(Ordering::Relaxed);
        if now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now + THROTTLE_INTERVAL.as_nanos() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// The refusals of a call: each refusing limit with its key's shape and
/// fingerprint, at `level`. Counts (feature `metrics`, label `policy`)
/// `tollgate_admitted_cost_total` for each limit of an admitted call,
/// `tollgate_denied_cost_total` for each limit that refused it and
/// `tollgate_never_fits_total` for each that it can never fit.
#[inline]
pub(crate) fn outcome(charges: &[Charge], outcome: &Outcome, verdict: Verdict, level: Level) {
    // An admission is only counted, which needs the metrics feature: with
    // it off, nothing to do, and no call made.
    if !cfg!(feature = "metrics") && verdict == Verdict::Admitted {
        return;
    }
    observed(charges, outcome, verdict, level);
}

/// [`outcome`], for an outcome there is something to log or count about.
fn observed(charges: &[Charge], outcome: &Outcome, verdict: Verdict, level: Level) {
    for (charge, decision) in charges.iter().zip(outcome.limits()) {
        let name = charge.policy().name();
        match (verdict, decision) {
            (Verdict::NeverFits, d) if d.never_fits() => {
                event_at!(
                    level,
                    policy = name,
                    key = %key_shape(charge.key()),
                    key_fingerprint = %fingerprint(charge.key()),
                    cost = charge.cost(),
                    "refused: cost can never fit"
                );
                count("tollgate_never_fits_total", name, 1);
            }
            (Verdict::Denied { .. }, d) if d.is_denied() => {
                let retry_after = d.retry_after().unwrap_or_default();
                event_at!(
                    level,
                    policy = name,
                    key = %key_shape(charge.key()),
                    key_fingerprint = %fingerprint(charge.key()),
                    cost = charge.cost(),
                    retry_after_ms = retry_after.as_millis() as u64,
                    "refused: rate limited"
                );
                count("tollgate_denied_cost_total", name, charge.cost());
            }
            (Verdict::Admitted, d) if d.is_admitted() => {
                count("tollgate_admitted_cost_total", name, charge.cost());
            }
            // Limits of a refused call that did not refuse it spent nothing
            // and refused nothing.
            _ => {}
        }
    }
}

/// A request held by shaping rules for `delay` before it goes on: counted
/// in `tollgate_shaped_total{policy}` and recorded in the
/// `tollgate_shaped_wait_seconds{policy}` histogram, for each shaping rule.
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

/// A cost that can never fit `policy`; the layer refuses it without asking
/// the store. Always counted; logged like a `429` (at `level`, with the
/// key's shape and fingerprint) when it is the refusal the request gets
/// (`answered`: the first of the layer's own, in rule order). Counted in
/// `tollgate_never_fits_total{policy}`.
pub(crate) fn never_fits(
    policy: &tollgate_budget::Policy,
    key: &Key,
    cost: u64,
    level: Level,
    answered: bool,
) {
    if answered {
        event_at!(
            level,
            policy = policy.name(),
            key = %key_shape(key),
            key_fingerprint = %fingerprint(key),
            cost,
            "refused: cost can never fit"
        );
    }
    count("tollgate_never_fits_total", policy.name(), 1);
}

/// A request whose cost under `policy` could not be computed: no
/// `Content-Length` for a content cost (`411`), or an invalid one, or a
/// computed cost that failed (`400`), with `reason` (the text the client is
/// answered). Logged at `level` with the key's shape and fingerprint.
pub(crate) fn cost_refused(policy: &str, key: &Key, reason: &str, level: Level) {
    event_at!(
        level,
        policy,
        key = %key_shape(key),
        key_fingerprint = %fingerprint(key),
        reason,
        "refused: the request's cost cannot be computed"
    );
}

/// A request `policy` did not charge because an exemption matched it:
/// counted in `tollgate_requests_total{policy, outcome="exempt"}`.
pub(crate) fn exempt(policy: &tollgate_budget::Policy) {
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
/// never when `None`); the request goes on without it. Counted in
/// `tollgate_dry_run_denied_cost_total{policy}`.
pub(crate) fn dry_run_denied(
    policy: &tollgate_budget::Policy,
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

/// Reservations of rules charged by outcome, given back because the
/// response did not match: counted in `tollgate_refunded_cost_total{policy}`.
pub(crate) fn refunded(charges: &[Charge]) {
    for charge in charges {
        count(
            "tollgate_refunded_cost_total",
            charge.policy().name(),
            charge.cost(),
        );
    }
}

/// What refused a request on its own account: a rule's policy of a
/// `RateLimitLayer`, or a `ConcurrencyLimitLayer`; logged as `policy=` or
/// `layer=` (the field each layer's refusals already carry).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Refuser<'a> {
    Policy(&'a str),
    InFlight(&'a str),
}

/// A request refused because its key could not be made: no principal (a
/// `401`, logged at the layer's level), an unusable client address (`400`,
/// same), or no peer address at all — the server's own misconfiguration,
/// logged as an error once and then at most once per ten seconds, for each
/// kind of layer (one's error does not hide the other's). A key that
/// could not be made has no fingerprint.
pub(crate) fn key_refused(error: &crate::identity::KeyError, by: Refuser<'_>, level: Level) {
    use crate::identity::{ClientIpError, KeyError};
    // One event, with the field the refusing layer's events carry.
    macro_rules! refused {
        ($at:expr, $($rest:tt)+) => {
            match by {
                Refuser::Policy(policy) => event_at!($at, policy, $($rest)+),
                Refuser::InFlight(layer) => event_at!($at, layer, $($rest)+),
            }
        };
    }
    match error {
        KeyError::NoPrincipal => {
            refused!(
                level,
                "refused: the rule needs a principal and there is none"
            );
        }
        KeyError::MissingPart(part) => {
            refused!(
                level,
                part = &**part,
                "refused: the request lacks a key part"
            );
        }
        KeyError::ClientIp(ClientIpError::MissingPeer) => {
            static THROTTLES: [Throttle; 2] = [const { Throttle::new() }; 2];
            let throttle = match by {
                Refuser::Policy(_) => &THROTTLES[0],
                Refuser::InFlight(_) => &THROTTLES[1],
            };
            if let Some(suppressed) = throttle.admit() {
                refused!(
                    Level::ERROR,
                    suppressed,
                    "tollgate cannot key by client address: the request carries no peer \
                     address. Serve the app with \
                     `into_make_service_with_connect_info::<SocketAddr>()` (axum), or insert \
                     `tollgate::identity::PeerAddr` per connection (hyper). Answered 500 \
                     ({suppressed} more not logged since the last)"
                );
            }
        }
        KeyError::ClientIp(e) => {
            refused!(level, error = %e, "refused: unusable client address");
        }
    }
}

/// A shared in-flight lease of `limit` found gone while its request still
/// ran, and taken again: logged once and then at most once per ten seconds
/// (a pause or a flushed store loses every lease at once).
pub(crate) fn lease_restored(limit: &str) {
    static THROTTLE: Throttle = Throttle::new();
    if let Some(suppressed) = THROTTLE.admit() {
        tracing::warn!(
            limit,
            suppressed,
            "an in-flight lease was gone while its request was still running (this process \
             was paused, or the store unreachable, for longer than the lease, or the store \
             lost it: flushed, restarted): taken again, above the limit if others took its \
             place meanwhile ({suppressed} more not logged since the last)"
        );
    }
}

/// An error with its sources, `: `-separated (what failed, then why: a
/// TLS certificate not trusted, `NOAUTH`, ...).
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// A store failure: logged the first time and then at most once per ten
/// seconds with the count left out (an outage fails every request), and
/// always counted in the metric. Each kind of failure and outcome applied
/// has its own throttle: a charge lost after the response, or a fallback
/// taken, is not hidden behind the refusals of an outage.
///
/// The metric: `tollgate_store_errors_total{kind, outcome}`, `kind` the
/// `StoreErrorKind` variant's name (`Unavailable`, `Uncertain`,
/// `CapacityExhausted`, `Protocol`, `Unsupported`, `Config`) and `outcome`
/// the `applied` one: `fail_closed`, `fail_open`, `fallback`, `local`,
/// `refund_lost` or `confirm_lost` (see the module's docs).
pub(crate) fn store_error(error: &StoreError, applied: &'static str) {
    use tollgate_budget::StoreErrorKind as K;
    const OUTCOMES: usize = 6;
    const KINDS: usize = 7;
    static THROTTLES: [[Throttle; KINDS]; OUTCOMES] =
        [const { [const { Throttle::new() }; KINDS] }; OUTCOMES];
    let outcome = match applied {
        "fail_closed" => 0,
        "fail_open" => 1,
        "fallback" => 2,
        "late_charge_lost" => 3,
        "local" => 4,
        _ => 5,
    };
    let kind = match error.kind() {
        K::Unavailable => 0,
        K::Uncertain => 1,
        K::CapacityExhausted => 2,
        K::Protocol => 3,
        K::Unsupported => 4,
        K::Config => 5,
        _ => 6,
    };
    if let Some(suppressed) = THROTTLES[outcome][kind].admit() {
        tracing::warn!(
            error = %chain(error),
            kind = ?error.kind(),
            outcome = applied,
            suppressed,
            "store failed ({suppressed} more of this kind and outcome not logged since the last)"
        );
    }
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

/// Records the time since `started` (from [`start`]) in the
/// `tollgate_store_seconds` histogram (seconds, no labels).
pub(crate) fn store_latency(started: Option<std::time::Instant>) {
    #[cfg(feature = "metrics")]
    if let Some(started) = started {
        metrics::histogram!("tollgate_store_seconds").record(started.elapsed().as_secs_f64());
    }
    let _ = started;
}

/// Adds `by` to the counter `metric`, labelled `policy` (the policy's
/// name): the rate-limit counters of the module's docs.
fn count(metric: &'static str, policy: &str, by: u64) {
    // Only with the feature: the label is the policy's name, never a key.
    #[cfg(feature = "metrics")]
    metrics::counter!(metric, "policy" => policy.to_owned()).increment(by);
    let _ = (metric, policy, by);
}
