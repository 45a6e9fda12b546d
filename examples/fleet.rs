//! Two app instances sharing one Redis budget.
//!
//! ```text
//! redis-server --port 6379 --save '' --appendonly no   # or any Redis 7+
//! cargo run --example fleet -- --redis redis://127.0.0.1:6379
//! ```
//!
//! Starts two axum servers on two ports, each with its own `RedisStore`
//! connection to the same Redis, limiting `POST /export` per account to a
//! token bucket of 3 (refill 2 per second). It then sends 30 concurrent
//! requests of one account, alternating between the instances, and prints
//! how many each admitted: together they admit exactly 3, where two
//! in-memory stores would have admitted 6.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tollgate::{Policy, Principal, Rate, RateLimitLayer, RedisStore, Rule};

async fn instance(
    redis: &str,
    account: &'static str,
) -> Result<SocketAddr, Box<dyn std::error::Error>> {
    let store = RedisStore::builder(redis)?
        .timeout(Duration::from_secs(1))
        .build()?;
    let export = Policy::token_bucket("export", 3, Rate::per_second(2))?;
    let app = Router::new()
        .route("/export", post(|| async { "export started\n" }))
        .layer(
            RateLimitLayer::builder(store)
                .rule(Rule::per_account(export))
                .build()?,
        )
        // Stands in for authentication.
        .layer(axum::Extension(Principal::new("fleet-demo", account)));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

async fn post_export(addr: SocketAddr) -> std::io::Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    s.write_all(
        b"POST /export HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response {text:?}")))
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut redis = "redis://127.0.0.1:6379".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--redis", Some(url)) => redis = url,
            _ => {
                eprintln!("usage: fleet [--redis redis://HOST:PORT]");
                return ExitCode::from(2);
            }
        }
    }
    // A fresh account per run, so earlier runs' budgets do not interfere.
    let account: &'static str = Box::leak(format!("demo-{}", std::process::id()).into_boxed_str());
    let (a, b) = match (
        instance(&redis, account).await,
        instance(&redis, account).await,
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("cannot start: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("instance A on {a}, instance B on {b}, one budget in {redis}");
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            let target = if i % 2 == 0 { a } else { b };
            tokio::spawn(async move { (i % 2, post_export(target).await) })
        })
        .collect();
    let mut admitted = [0u32; 2];
    let mut other = 0u32;
    for t in tasks {
        match t.await {
            Ok((which, Ok(200))) => admitted[which] += 1,
            Ok((_, Ok(429))) => {}
            Ok((_, Ok(code))) => {
                eprintln!("unexpected status {code} (is Redis reachable at {redis}?)");
                other += 1;
            }
            Ok((_, Err(e))) => {
                eprintln!("request failed: {e}");
                other += 1;
            }
            Err(e) => {
                eprintln!("task failed: {e}");
                other += 1;
            }
        }
    }
    let total = admitted[0] + admitted[1];
    println!(
        "instance A admitted {}, instance B admitted {}: {total} in all (budget 3)",
        admitted[0], admitted[1]
    );
    if other == 0 && total == 3 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
