//! The guide: everything the crate root's example does not show, chapter
//! by chapter. Every Rust example in it is compiled (and most are run) as
//! a doctest.
//!
//! 1. [`quickstart`]: the demo application and its contract (routes, demo
//!    keys, budgets, flags);
//! 2. [`rate_limits`]: rules, keys, exemptions, dry-run, charging by
//!    outcome (failed logins), refusal bodies, shaping, plans and limits
//!    changed at runtime, policies and their arithmetic, stores, gRPC;
//! 3. [`redis`]: one budget for a fleet, TLS, Sentinel, your own
//!    connection, fleet-wide in-flight limits;
//! 4. [`identity`]: who is asking (principals, client addresses behind
//!    proxies), every answer the layers give, logs and metrics;
//! 5. [`in_flight`]: bounding work in flight, waiting, stalled bodies;
//! 6. [`client`]: a client that honours `Retry-After`;
//! 7. [`project`]: versions and what counts as breaking, the repository's
//!    layout, benchmarks, hardening and CI;
//! 8. [`recipes`]: whole tasks end to end: behind nginx, Prometheus and
//!    Grafana, failed logins on every route, one plan changed at runtime,
//!    one error format for both layers, gRPC, Redis with TLS and
//!    Sentinel, a fleet.

#[doc = include_str!("../guide/01-quickstart.md")]
pub mod quickstart {}

#[doc = include_str!("../guide/02-rate-limits.md")]
pub mod rate_limits {}

#[doc = include_str!("../guide/03-redis.md")]
pub mod redis {}

#[doc = include_str!("../guide/04-identity-answers-logs.md")]
pub mod identity {}

#[doc = include_str!("../guide/05-in-flight.md")]
pub mod in_flight {}

#[doc = include_str!("../guide/06-client.md")]
pub mod client {}

#[doc = include_str!("../guide/07-project.md")]
pub mod project {}

#[doc = include_str!("../guide/08-recipes.md")]
pub mod recipes {}
