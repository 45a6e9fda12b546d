//! A fixed in-process workload for instruction-level profiles of the HTTP
//! layer (BENCHMARKS.md): 100 000 requests through an axum hello-world,
//! bare, behind tollgate (in-memory, admits everything) or behind
//! tower_governor (the equivalent quota), with no sockets involved, so the
//! instructions each layer adds per request can be counted exactly. With
//! `refuse` as second argument, both limiters refuse everything after the
//! first request.
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin profile_layer
//! valgrind --tool=callgrind target/release/profile_layer bare
//! valgrind --tool=callgrind target/release/profile_layer tollgate
//! valgrind --tool=callgrind target/release/profile_layer governor
//! valgrind --tool=callgrind target/release/profile_layer tollgate refuse
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::Request;
use tower::ServiceExt;

use tollgate_bench::bench_app;

const REQUESTS: u32 = 100_000;

fn main() -> ExitCode {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "tollgate".into());
    let refuse = std::env::args().nth(2).as_deref() == Some("refuse");
    let app = match bench_app::app(&mode, refuse) {
        Ok(app) => app,
        Err(why) => {
            eprintln!("profile_layer: {why}");
            return ExitCode::from(2);
        }
    };
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return ExitCode::FAILURE;
    };
    let peer = SocketAddr::from(([127, 0, 0, 1], 40_000));
    let mut ok = 0u32;
    rt.block_on(async {
        for _ in 0..REQUESTS {
            let Ok(req) = Request::builder()
                .uri("/")
                .extension(ConnectInfo(peer))
                .body(Body::empty())
            else {
                continue;
            };
            let Ok(res) = app.clone().oneshot(req).await;
            ok += u32::from(res.status().is_success());
        }
    });
    println!("{mode}: {ok} of {REQUESTS} admitted");
    let expected = if refuse && mode != "bare" {
        1
    } else {
        REQUESTS
    };
    if ok == expected {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
