//! Load driver for the in-flight lease benchmark (benches/leases.sh): N
//! concurrent tasks acquire and release in-flight slots for S seconds,
//! through `RedisStore`'s leases or, as the peer, a plain `INCR`/`DECR`
//! semaphore script over the same kind of connection.
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin lease_bench -- --redis redis://127.0.0.1:6379 \
//!     --concurrency 32 --seconds 5 --mode lease|semaphore
//! ```
//!
//! Prints one line: `cycles_per_s p50_us p99_us` (one cycle: acquire, then
//! release, two round trips). Each task has a key of its own among 1 000,
//! with room for every task, so nothing is refused.
#![allow(clippy::float_arithmetic)] // Reports measurements; decides nothing.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use tollgate::{
    RedisStore,
    store::{Acquired, LeaseRequest, LeaseStore},
};

const SEMAPHORE: &str = include_str!("../../../../benches/semaphore.lua");

#[tokio::main]
async fn main() -> ExitCode {
    let (mut url, mut conc, mut secs, mut mode) = (
        "redis://127.0.0.1:6379".to_owned(),
        32usize,
        5u64,
        "lease".to_owned(),
    );
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_default();
        match a.as_str() {
            "--redis" => url = value(),
            "--concurrency" => conc = value().parse().unwrap_or(0),
            "--seconds" => secs = value().parse().unwrap_or(0),
            "--mode" => mode = value(),
            _ => {
                eprintln!(
                    "usage: lease_bench --redis URL --concurrency N --seconds S --mode lease|semaphore"
                );
                return ExitCode::from(2);
            }
        }
    }
    if conc == 0 || secs == 0 || !matches!(mode.as_str(), "lease" | "semaphore") {
        eprintln!("--concurrency and --seconds must be positive, --mode lease or semaphore");
        return ExitCode::from(2);
    }
    let store = match RedisStore::builder(&url).and_then(|b| b.build()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let client = match redis::Client::open(url.as_str()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let conn = match client.get_multiplexed_async_connection().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let until = Instant::now() + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..conc)
        .map(|t| {
            let (store, mut conn, mode) = (store.clone(), conn.clone(), mode.clone());
            tokio::spawn(async move {
                let script = redis::Script::new(SEMAPHORE);
                let request = LeaseRequest {
                    limit: "bench".into(),
                    key: Some(format!("k{}", t % 1000).into()),
                    per_key: Some(64),
                    global: Some(1_000_000),
                    ttl: Duration::from_secs(10),
                };
                let semaphore = format!("sem:{{k{}}}", t % 1000);
                let mut times = Vec::new();
                let mut id = (t as u128) << 64;
                while Instant::now() < until {
                    let started = Instant::now();
                    if mode == "lease" {
                        id += 1;
                        match store.acquire(&request, id).await {
                            Ok(Acquired::Granted(lease)) => {
                                if store.release(&lease).await.is_err() {
                                    return Err("release failed".to_owned());
                                }
                            }
                            other => return Err(format!("acquire: {other:?}")),
                        }
                    } else {
                        let got: i64 = script
                            .key(&semaphore)
                            .arg("acquire")
                            .arg(1_000_000)
                            .invoke_async(&mut conn)
                            .await
                            .map_err(|e| e.to_string())?;
                        if got != 1 {
                            return Err("semaphore full".to_owned());
                        }
                        let _: i64 = script
                            .key(&semaphore)
                            .arg("release")
                            .invoke_async(&mut conn)
                            .await
                            .map_err(|e| e.to_string())?;
                    }
                    times.push(started.elapsed());
                }
                Ok(times)
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        match t.await {
            Ok(Ok(times)) => all.extend(times),
            Ok(Err(e)) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    }
    all.sort();
    let at = |q: f64| all[((all.len() as f64 - 1.0) * q) as usize].as_micros();
    println!("{} {} {}", all.len() as u64 / secs, at(0.5), at(0.99));
    ExitCode::SUCCESS
}
