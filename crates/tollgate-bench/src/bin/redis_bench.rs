//! Load driver for the Redis benchmark (benches/redis.sh): N concurrent
//! tasks share one RedisStore (one multiplexed connection) for S seconds.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin redis_bench -- --redis redis://127.0.0.1:6379 \
//!     --concurrency 32 --seconds 5 --mode allow|deny [--cache]
//! ```
//!
//! Prints one line: `decisions_per_s p50_us p99_us admitted cache_hits`.
//! `allow` spreads decisions over 10 000 keys with a budget that admits
//! everything; `deny` hammers one key whose budget is exhausted.
#![allow(clippy::float_arithmetic)] // Reports measurements; decides nothing.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tollgate::{
    Policy, Rate, RedisStore, Store,
    store::{Charge, Key},
};

#[tokio::main]
async fn main() -> ExitCode {
    let (mut url, mut conc, mut secs, mut mode, mut cache) = (
        "redis://127.0.0.1:6379".to_owned(),
        32usize,
        5u64,
        "allow".to_owned(),
        false,
    );
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match a.as_str() {
            "--redis" => url = value(),
            "--concurrency" => conc = value().parse().unwrap_or(0),
            "--seconds" => secs = value().parse().unwrap_or(0),
            "--mode" => mode = value(),
            "--cache" => cache = true,
            // The scripts as the store sends them (rendered with the
            // constants they share with Rust), for SCRIPT LOAD by hand.
            "--print-script" => {
                match value().as_str() {
                    "one-bucket" => print!("{}", tollgate::RedisStore::one_bucket_script_source()),
                    "decide" => print!("{}", tollgate::RedisStore::script_source()),
                    _ => {
                        eprintln!("--print-script one-bucket|decide");
                        return ExitCode::from(2);
                    }
                }
                return ExitCode::SUCCESS;
            }
            _ => {
                eprintln!(
                    "usage: redis_bench --redis URL --concurrency N --seconds S --mode allow|deny [--cache]\n       redis_bench --print-script one-bucket|decide"
                );
                return ExitCode::from(2);
            }
        }
    }
    if conc == 0 || secs == 0 || !(mode == "allow" || mode == "deny") {
        eprintln!("concurrency and seconds must be positive, mode allow or deny");
        return ExitCode::from(2);
    }
    let mut builder = match RedisStore::builder(&url) {
        Ok(b) => b.timeout(Duration::from_secs(2)),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    // The over-limit cache is on by default: without `--cache` it is off,
    // so the deny-heavy comparison is with and without it.
    builder = builder.over_limit_cache(if cache { 100_000 } else { 0 });
    let store = match builder.build() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let policy = if mode == "allow" {
        Policy::token_bucket("bench", 1_000_000, Rate::per_second(1_000_000))
    } else {
        Policy::token_bucket("deny", 1, Rate::per_second(1))
    };
    let Ok(policy) = policy else {
        return ExitCode::FAILURE;
    };
    let charges: Arc<Vec<[Charge; 1]>> = Arc::new(
        (0..if mode == "allow" { 10_000 } else { 1 })
            .filter_map(|i| {
                Charge::new(Key::new("bench").with(i.to_string()), policy.clone(), 1).ok()
            })
            .map(|c| [c])
            .collect(),
    );
    let deadline = Instant::now() + Duration::from_secs(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..conc)
        .map(|t| {
            let (store, charges) = (store.clone(), charges.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut admitted = 0u64;
                let mut i = t;
                while Instant::now() < deadline {
                    let c = &charges[i % charges.len()];
                    i += conc;
                    let t0 = Instant::now();
                    match store.charge(c).await {
                        Ok(o) => admitted += u64::from(o.is_admitted()),
                        Err(e) => {
                            eprintln!("store error: {e}");
                            return None;
                        }
                    }
                    lat.push(t0.elapsed());
                    // Answers from the over-limit cache are ready at once: a
                    // task that never yields would starve the connection's
                    // own task on a one-core runtime. Yield as tokio's budget
                    // says (every so many answers), as a server's request
                    // tasks do.
                    tokio::task::consume_budget().await;
                }
                Some((lat, admitted))
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut admitted = 0;
    for t in tasks {
        match t.await {
            Ok(Some((lat, a))) => {
                all.extend(lat);
                admitted += a;
            }
            _ => return ExitCode::FAILURE,
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| {
        all.get(((all.len() as f64 - 1.0) * p) as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    println!(
        "{:.0} {:.1} {:.1} {admitted} {}",
        all.len() as f64 / elapsed,
        pct(0.50),
        pct(0.99),
        store.cache_stats().hits
    );
    ExitCode::SUCCESS
}
