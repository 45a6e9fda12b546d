//! The rate-limit middleware: resolve who is asking, charge every rule that
//! applies in one all-or-nothing store call, and answer refusals.
//!
//! # Answers
//!
//! | situation | HTTP | gRPC (`grpc-status`) |
//! |---|---|---|
//! | admitted | the inner response, plus `RateLimit-Policy` / `RateLimit` (configurable) | same |
//! | denied | `429`, `Retry-After` (whole seconds, rounded up, never 0), `RateLimit-Policy`, `RateLimit`, `Cache-Control: no-store`, problem+json | 8 RESOURCE_EXHAUSTED |
//! | cost can never fit | `413` for content-length costs, `400` for other costs; no `Retry-After` | 3 INVALID_ARGUMENT |
//! | store failed, fail-closed | `503`, no-store | 14 UNAVAILABLE |
//! | rule needs a principal, none present | `401` with `WWW-Authenticate` ([`RateLimitBuilder::www_authenticate`](crate::rate_limit::RateLimitBuilder::www_authenticate), `Bearer` by default) (configurable per rule) | 16 UNAUTHENTICATED |
//! | content-length cost without `Content-Length` | `411` | 3 |
//! | no peer address (server misconfigured) | `500`, logged | 13 INTERNAL |
//!
//! gRPC is recognised by the exact content type: `application/grpc` alone
//! or followed by `+` or `;`, and the gRPC-Web types (`application/grpc-web`,
//! `application/grpc-web+proto`, `application/grpc-web-text`), which are
//! answered in their own content type. `application/grpcx` is plain HTTP.
//!
//! A refusal to `HEAD` is the head a `GET` would get (its body's length in
//! `Content-Length`) with no body, whichever layer answers and wherever it
//! sits (the in-flight layer's refusals too).
//!
//! # The order of answers: every request counts against its address
//!
//! A rule whose key or cost cannot be determined (no principal, no
//! `Content-Length`, an unusable computed cost, no peer address), or whose
//! cost can never fit, is not charged: it gives the layer a refusal of its
//! own (the first one, in rule order). Every other applicable rule is
//! charged, and then:
//!
//! 1. the charges are one all-or-nothing store decision;
//! 2. a store failure follows [`OnStoreError`](crate::OnStoreError) (`503` when failing closed;
//!    failing open goes on as if admitted);
//! 3. if any limit lacks budget, the answer is `429` and nothing was spent
//!    anywhere;
//! 4. otherwise the layer's own refusal, if there is one, with the
//!    `RateLimit` fields of the limits it was charged to;
//! 5. otherwise the inner service is called.
//!
//! So a request the layer refuses for its own reasons (a credential guess
//! answered `401`, an oversized upload answered `413`) still spends from
//! every limit it can be charged to, typically its address, and is `429`
//! once that is spent: guessing and junk are rate limited too. Only a
//! refusal for lack of budget spends nothing.
//!
//! When an authentication layer answers `401` itself before the request
//! reaches this layer, put an address-keyed `RateLimitLayer` outside the
//! authentication layer and the account-keyed rules inside it (see [the
//! guide](crate::guide::rate_limits#when-authentication-answers-first)).
//!
//! The inner service's error type passes through unchanged: refusals are
//! responses, not errors. `poll_ready` only forwards the inner service's
//! readiness: the limiter never exerts backpressure.
//!
//! # Response bodies
//!
//! The layer's responses carry a [`ResponseBody`](crate::ResponseBody)
//! around the inner service's body ([`Wrapped`], for any body type), or,
//! after [`RateLimitLayer::with_inner_body`](crate::RateLimitLayer::with_inner_body),
//! the inner body type itself ([`InnerBody`], for bodies with
//! `From<Bytes>`, such as axum's). The answers are the same, byte for
//! byte; with axum the inner body saves boxing each response again.
//!
//! # Exemptions
//!
//! An [`Exemption`] on a rule (or on the layer, for every rule) skips the
//! requests it matches: by resolved client network, by principal, or by a
//! predicate over the request head. A skipped rule charges nothing and
//! refuses nothing; a request exempt from every rule reaches the inner
//! service without a store call, so a health check answers even while the
//! store is down.
//!
//! # Dry-run rules
//!
//! A dry-run rule ([`Rule::dry_run`], or [`RateLimitBuilder::dry_run`](crate::rate_limit::RateLimitBuilder::dry_run) for
//! all) is decided and charged like any other while its budget lasts, but
//! it never refuses for lack of budget: the would-be refusal is logged and
//! counted instead. Mixed with enforced rules in one request:
//!
//! - the store is asked for all of them at once, all-or-nothing;
//! - if the call is refused and a dry-run limit is among those refusing,
//!   those dry-run limits are left out (a refused call spent nothing) and
//!   the rest decided again, until the call is admitted or only enforced
//!   limits refuse;
//! - so a request is decided as if the dry-run rules that would refuse it
//!   did not apply, the dry-run rules that would admit it are charged
//!   together with the enforced ones, and a `429` comes only from enforced
//!   limits (its `Retry-After` is theirs).
//!
//! The `RateLimit` fields describe every limit, dry-run ones included
//! (`r=0` once a dry-run budget is spent). Refusals about the request
//! itself (no principal, no `Content-Length`, an invalid cost, a cost
//! above the policy's capacity, which no budget could ever take) are given
//! by dry-run rules too: they do not depend on how much budget is left.
//!
//! # Shaping: delay instead of refusing
//!
//! A rule with [`Rule::shape`] holds a request its budget cannot take now
//! but can within the rule's `max_delay`: the store reserves the credit
//! now, for the exact instant it fits, and the response future waits on
//! the runtime's timer until then (no thread blocks, `poll_ready` never
//! waits) before calling the inner service. Beyond `max_delay` the request
//! is refused with `429` and the exact wait, as without shaping; a cost
//! that can never fit is never held.
//!
//! - **Exact on release times.** For every trace, what a shaping rule's
//!   budget releases in any interval of length `t` is at most `B + r·t`,
//!   also when shaped and immediate requests mix on one key.
//! - **All or nothing.** A request is reserved in every shaping rule and
//!   charged now in the others, in one store decision, or charged nowhere;
//!   a rule that does not shape must fit now. An unshaped rule counts a
//!   held request when it arrives (its budget bounds arrivals), a shaping
//!   rule when it is released.
//! - **Bounded waiting.** At most `per_key` requests of one key, and
//!   [`RateLimitBuilder::max_waiting`](crate::rate_limit::RateLimitBuilder::max_waiting) in the layer (1024 by default), wait
//!   at once; a request beyond that is decided as if its rules did not
//!   shape. The store bounds the line too, atomically: a request waits no
//!   longer than `per_key` of its own cost take to refill, so requests
//!   decided together (on Redis, in flight at once) beyond the line are
//!   refused at once and spend nothing.
//! - **Across a change of numbers.** A bucket holding requests for later
//!   stays empty until the last is released, under new numbers too
//!   ([`algorithm::carry_over`](crate::store::algorithm::carry_over)).
//! - **Dropped while waiting.** A request whose future is dropped before
//!   its release (the client went away, a timeout) gives its reservation
//!   back when it is the last in line for that key; one with requests
//!   reserved behind it does not (they keep their release times, and
//!   giving it back could let a later request be released in the same
//!   instant as them, over the budget). The rules it was charged to now
//!   stay charged. Dropped while the store is still deciding (Redis, before
//!   the reply), it cannot give back what the reply reserves: that credit
//!   stays spent, as if the request had been served.
//! - A request the layer refuses on its own account (`401`, `411`, ...) is
//!   never held, and dry-run rules and rules charged after the response do
//!   not shape.
//!
//! Shaping needs a tokio runtime with its timer (the wait is a
//! `tokio::time::Sleep`; outside a runtime a request that would wait is
//! refused instead), a store that can shape ([`Store::can_shape`](crate::Store::can_shape): `MemoryStore`
//! and the Redis store, whose calls whose keys span cluster slots are
//! decided unshaped) and token buckets refilling at most one token per
//! nanosecond. A call whose charges repeat a key is not shaped. Waits are
//! at most [`Charge::MAX_DELAY`](crate::store::Charge::MAX_DELAY). A held request lets go of
//! the inner service it was made ready with (a clone is made ready on
//! release), so readiness that is a resource is not held by a wait. The
//! `RateLimit` fields of a held response are as of its reservation.
//! Metrics (feature `metrics`): `tollgate_shaped_total` (every request the
//! store held, also those later dropped) and the
//! `tollgate_shaped_wait_seconds` histogram, by policy.
//!
//! # When the budget is charged
//!
//! With a store that needs no I/O ([`Store::try_charge_now`](crate::Store::try_charge_now)
//! answers, as `MemoryStore` always does), the charge happens inside `call`
//! and the inner service is called there too, as tower services usually
//! do; the response future only waits for the inner response. With a store
//! that does I/O (Redis), `call` returns a future that charges when first
//! polled. Either way a charge is made once per `call`, and a response
//! future dropped after the charge does not refund it.
//!
//! # Example
//!
//! ```
//! use std::net::SocketAddr;
//! use axum::{Router, routing::{get, post}};
//! use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
//!
//! let per_ip = Policy::token_bucket("per-ip", 5, Rate::per_second(1)).unwrap();
//! let export = Policy::token_bucket("export", 3, Rate::per_second(2)).unwrap();
//!
//! let limits = RateLimitLayer::builder(MemoryStore::new())
//!     .rule(Rule::per_client_ip(per_ip))
//!     .rule(Rule::per_account_operation(export).on_route("/export"))
//!     .build()
//!     .expect("valid rules");
//!
//! let app: Router = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .route("/export", post(|| async { "exported" }))
//!     .layer(limits);
//! // Serve with `app.into_make_service_with_connect_info::<SocketAddr>()`
//! // so the layer can see the peer address.
//! # let _ = app.into_make_service_with_connect_info::<SocketAddr>();
//! ```

pub(crate) mod config;
#[cfg(feature = "serde")]
mod data;
pub(crate) mod exempt;
mod future;
pub(crate) mod handle;
pub(crate) mod invalid;
pub(crate) mod layer;
mod pipeline;
mod plans;
mod route;
pub(crate) mod rule;
pub(crate) mod service;
mod shaping;

pub use crate::body::{BodyMode, InnerBody, Wrapped};
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use data::{
    AlgorithmName, Every, InitialData, InvalidPolicySet, PolicyData, PolicySet, RulePolicies, Span,
};
pub(crate) use exempt::Exemption;
pub(crate) use exempt::any_matches;
pub use future::ResponseFuture;
pub use layer::RateLimitBuilder;
pub(crate) use rule::Rule;
pub use rule::{CostError, CostFn};
pub use service::RateLimit;
