//! A client that is throttled by the quickstart and backs off as told.
//!
//! ```text
//! cargo run --example quickstart                      # in one terminal
//! cargo run --example client_retry                    # in another
//! cargo run --example client_retry -- --server http://127.0.0.1:3000 --requests 8
//! ```
//!
//! It sends `GET /` requests through `tower::retry::Retry` with
//! `tollgate::client::RetryPolicy`: the quickstart allows 5 at once per
//! address and 1 per second after that, so later requests get `429` with
//! `Retry-After`, and the policy waits at least that long before retrying.
//! Every attempt on the wire is printed with its time and answer.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::client::{RetryConfig, RetryPolicy, Sleep};
use tower::{Service, ServiceExt};

/// Prints each planned wait, then sleeps it.
struct ShowWait(Instant);

impl Sleep for ShowWait {
    fn sleep(
        &self,
        d: Duration,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        println!(
            "  {:>6.2}s  policy waits {:.2}s before retrying",
            self.0.elapsed().as_secs_f64(),
            d.as_secs_f64()
        );
        Box::pin(tokio::time::sleep(d))
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut server = "http://127.0.0.1:3000".to_owned();
    let mut requests = 8u32;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--server", Some(v)) => server = v,
            ("--requests", Some(v)) => match v.parse() {
                Ok(n) => requests = n,
                Err(e) => {
                    eprintln!("--requests {v:?}: {e}");
                    return ExitCode::from(2);
                }
            },
            _ => {
                eprintln!("usage: client_retry [--server URL] [--requests N]");
                return ExitCode::from(2);
            }
        }
    }
    let uri: http::Uri = match format!("{}/", server.trim_end_matches('/')).parse() {
        Ok(u) => u,
        Err(e) => {
            eprintln!("--server {server:?}: {e}");
            return ExitCode::from(2);
        }
    };
    let start = Instant::now();
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let wire = tower::service_fn(move |req: http::Request<Empty<Bytes>>| {
        let client = client.clone();
        async move {
            let res = client.request(req).await?;
            let retry_after = res
                .headers()
                .get(http::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(|v| format!(", Retry-After: {v}"))
                .unwrap_or_default();
            println!(
                "  {:>6.2}s  attempt -> {}{retry_after}",
                start.elapsed().as_secs_f64(),
                res.status()
            );
            Ok::<_, hyper_util::client::legacy::Error>(res)
        }
    });
    let policy = RetryPolicy::new(
        RetryConfig::new()
            .max_attempts(4)
            .deadline(Duration::from_secs(8))
            .jitter(Duration::from_millis(200)),
    )
    .with_sleep(ShowWait(start));
    let mut svc = tower::retry::Retry::new(policy, wire);
    let shared = Arc::new(uri);
    for i in 1..=requests {
        println!("request {i}: GET {shared}");
        let req = match http::Request::get((*shared).clone()).body(Empty::new()) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("bad request: {e}");
                return ExitCode::FAILURE;
            }
        };
        let ready = match svc.ready().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("client not ready: {e}");
                return ExitCode::FAILURE;
            }
        };
        match ready.call(req).await {
            Ok(res) => println!("  final: {}", res.status()),
            Err(e) => {
                eprintln!(
                    "cannot reach {server}: {e} (is `cargo run --example quickstart` running?)"
                );
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
