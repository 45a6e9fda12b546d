//! The axum hello-world the HTTP overhead measurements share
//! (`bench_server` over loopback, `profile_layer` in process): bare, behind
//! tollgate (in-memory, per client address) or behind tower_governor (its
//! default peer-address key), with equivalent quotas that admit everything
//! or, with `refuse`, refuse everything after the first request.

use axum::Router;
use axum::routing::get;
use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

/// The app for `mode` (`bare`, `tollgate` or `governor`), or why not.
pub fn app(mode: &str, refuse: bool) -> Result<Router, String> {
    let hello = Router::new().route("/", get(|| async { "hello" }));
    match mode {
        "bare" => Ok(hello),
        "tollgate" => {
            // A billion per second with a billion of burst, or 1 per hour.
            let policy = if refuse {
                Policy::token_bucket("bench", 1, Rate::per_hour(1))
            } else {
                Policy::token_bucket("bench", 1_000_000_000, Rate::per_second(1_000_000_000))
            }
            .map_err(|e| e.to_string())?;
            Ok(hello.layer(
                RateLimitLayer::new(MemoryStore::new())
                    .headers_on_admitted(false)
                    .rule(Rule::per_client_ip(policy)),
            ))
        }
        "governor" => {
            let mut builder = GovernorConfigBuilder::default();
            if refuse {
                builder.per_second(3600).burst_size(1);
            } else {
                builder.per_nanosecond(1).burst_size(1_000_000_000);
            }
            let config = builder.finish().ok_or("invalid tower_governor config")?;
            Ok(hello.layer(GovernorLayer::new(config)))
        }
        other => Err(format!(
            "unknown mode {other:?}: bare, tollgate or governor"
        )),
    }
}
