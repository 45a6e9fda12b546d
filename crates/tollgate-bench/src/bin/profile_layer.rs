//! A fixed in-process workload for instruction-level profiles of the HTTP
//! layer (BENCHMARKS.md, `benches/instructions.sh`): REQUESTS requests
//! (100 000 by default) through one of `bench_app`'s axum apps, with no
//! sockets involved, so the instructions each layer adds per request can be
//! counted exactly:
//! - `GET /`: `bare`, `tollgate` (in-memory, admits everything; inside
//!   the router), `tollgate-front` (the same rule around the router: the
//!   front door) or `governor` (tower_governor, the equivalent quota);
//! - `POST /export` with a principal: `bare-export` (the stand-in
//!   authentication layer alone) or `tollgate-export` (a per-address and a
//!   per-account-operation rule behind it);
//! - the floors (`bench_app::Floor`): `floor-empty`, an empty `200` for
//!   every request, and `floor-refusal` (always with `refuse`), a copy of
//!   the front door's refusal for every request, decided and rendered by
//!   nothing.
//!
//! With `refuse`, the limiters refuse everything after the first request.
//! Exits non-zero unless every request was admitted (2xx) or refused (429)
//! as the mode says it should be. The requests are sent from one function,
//! `profile_layer::send_requests`, so that a profile can count it alone
//! (`--toggle-collect=profile_layer::send_requests`) and leave out the
//! start-up, whose cost varies from run to run (quanta's calibration
//! loops for as long as the clocks take to agree).
//!
//! ```text
//! cargo build --release -p tollgate-bench --bin profile_layer
//! valgrind --tool=callgrind target/release/profile_layer bare
//! valgrind --tool=callgrind target/release/profile_layer tollgate
//! valgrind --tool=callgrind target/release/profile_layer governor refuse
//! valgrind --tool=callgrind target/release/profile_layer tollgate-export refuse 20000
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;

use axum::body::Body;
use axum::extract::ConnectInfo;
use http::{Method, Request, StatusCode};
use tower::ServiceExt;

use tollgate_bench::bench_app;

const DEFAULT_REQUESTS: u32 = 100_000;
const USAGE: &str = "usage: profile_layer MODE [refuse] [REQUESTS]";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "tollgate".into());
    let mut refuse = false;
    let mut requests = DEFAULT_REQUESTS;
    for arg in args {
        match (arg.as_str(), arg.parse::<u32>()) {
            ("refuse", _) => refuse = true,
            (_, Ok(n)) if n > 0 => requests = n,
            _ => {
                eprintln!("profile_layer: unexpected argument {arg:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    // `refuse` is for the modes that refuse; the refusal floor does nothing
    // else.
    let refusing = refuse && (bench_app::is_limited(&mode) || mode == "floor-refusal");
    if refuse != refusing || (mode == "floor-refusal" && !refuse) {
        eprintln!(
            "profile_layer: `refuse` goes with a limited mode or floor-refusal, and floor-refusal needs it\n{USAGE}"
        );
        return ExitCode::from(2);
    }
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().build() else {
        return ExitCode::FAILURE;
    };
    let export = bench_app::is_export(&mode);
    let sent = if mode == "tollgate-front" {
        bench_app::front_door(refuse).map(|app| send_requests(&rt, &app, requests, export))
    } else if let Some(floor) = rt.block_on(bench_app::Floor::of(&mode)) {
        // The cheapest body there is: no box.
        floor.map(|floor| {
            let app = floor.service::<http_body_util::Full<bytes::Bytes>>();
            send_requests(&rt, &app, requests, export)
        })
    } else {
        bench_app::app(&mode, refuse).map(|app| send_requests(&rt, &app, requests, export))
    };
    let (admitted, refused) = match sent {
        Ok(counts) => counts,
        Err(why) => {
            eprintln!("profile_layer: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let other = requests - admitted - refused;
    println!(
        "{mode}{}: {admitted} of {requests} admitted, {refused} refused, {other} other",
        if refusing { " refuse" } else { "" }
    );
    // (A limiter admits the first request; the refusal floor none.)
    let expected = match (refusing, mode.as_str()) {
        (true, "floor-refusal") => 0,
        (true, _) => 1,
        (false, _) => requests,
    };
    if admitted == expected && other == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!("profile_layer: expected {expected} admitted and the rest refused");
        ExitCode::FAILURE
    }
}

/// Sends `requests` requests through `app`, one after another; how many
/// were admitted (2xx) and refused (429). Never inlined: profiles count
/// the instructions run inside it (see the module docs; its name is
/// `profile_layer::send_requests` followed by the app's type).
#[inline(never)]
fn send_requests<A, B>(
    rt: &tokio::runtime::Runtime,
    app: &A,
    requests: u32,
    export: bool,
) -> (u32, u32)
where
    A: tower::Service<
            Request<Body>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        > + Clone,
{
    let peer = SocketAddr::from(([127, 0, 0, 1], 40_000));
    let (mut admitted, mut refused) = (0u32, 0u32);
    rt.block_on(async {
        for _ in 0..requests {
            let builder = if export {
                Request::builder()
                    .method(Method::POST)
                    .uri(bench_app::EXPORT_PATH)
                    .header(http::header::AUTHORIZATION, bench_app::EXPORT_AUTHORIZATION)
            } else {
                Request::builder().uri("/")
            };
            let Ok(req) = builder.extension(ConnectInfo(peer)).body(Body::empty()) else {
                continue;
            };
            let Ok(res) = app.clone().oneshot(req).await;
            admitted += u32::from(res.status().is_success());
            refused += u32::from(res.status() == StatusCode::TOO_MANY_REQUESTS);
        }
    });
    (admitted, refused)
}
