//! The apps of the HTTP overhead benchmark (benches/http.sh), served over
//! loopback: an axum hello-world on `GET /`, bare, behind tollgate
//! (in-memory; `tollgate-front`: around the router, the front door), or
//! behind tower_governor; or the quickstart-shaped
//! `POST /export` (modes `bare-export`, `tollgate-export`; see `bench_app`
//! for the header it needs), with a quota that admits everything or
//! refuses everything; or one of the floors (`floor-empty`,
//! `floor-refusal`: see `bench_app::Floor`).
//!
//! ```text
//! cargo run --release -p tollgate-bench --bin bench_server -- --mode tollgate --addr 127.0.0.1:8080 [--refuse]
//! ```

use std::net::SocketAddr;
use std::process::ExitCode;

use tollgate_bench::bench_app;

fn main() -> ExitCode {
    let mut mode = String::from("bare");
    let mut addr: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 8080));
    let mut refuse = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--mode" => mode = args.next().unwrap_or_default(),
            "--addr" => match args.next().map(|v| v.parse()) {
                Some(Ok(v)) => addr = v,
                _ => {
                    eprintln!("--addr needs HOST:PORT");
                    return ExitCode::from(2);
                }
            },
            "--refuse" => refuse = true,
            _ => {
                eprintln!(
                    "usage: bench_server --mode MODE [--addr A] [--refuse]\nMODE: {}",
                    bench_app::MODES
                );
                return ExitCode::from(2);
            }
        }
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A floor is a plain service (see `bench_app::Floor`), in axum's body
    // type, which `axum::serve` takes.
    let floor = match rt.block_on(bench_app::Floor::of(&mode)) {
        Some(Ok(floor)) => Some(floor.service::<axum::body::Body>()),
        Some(Err(why)) => {
            eprintln!("bench_server: {why}");
            return ExitCode::from(2);
        }
        None => None,
    };
    // The front door is not a router: its answers are axum's already (the
    // layer answers in the inner body type), and it is served as a plain
    // service.
    let front = (mode == "tollgate-front").then(|| bench_app::front_door(refuse));
    let app = match (&front, &floor) {
        (Some(_), _) | (_, Some(_)) => Ok(axum::Router::new()),
        (None, None) => bench_app::app(&mode, refuse),
    };
    let (app, front) = match (app, front.transpose()) {
        (Ok(app), Ok(front)) => (app, front),
        (Err(why), _) | (_, Err(why)) => {
            eprintln!("bench_server: {why}");
            return ExitCode::from(2);
        }
    };
    rt.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("bind {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        println!("bench_server {mode} listening on http://{addr}");
        let served = match (front, floor) {
            (_, Some(floor)) => axum::serve(
                listener,
                axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
                    SocketAddr,
                >(floor),
            )
            .await,
            (Some(front), None) => axum::serve(
                listener,
                axum::ServiceExt::<axum::extract::Request>::into_make_service_with_connect_info::<
                    SocketAddr,
                >(front),
            )
            .await,
            (None, None) => {
                axum::serve(
                    listener,
                    app.into_make_service_with_connect_info::<SocketAddr>(),
                )
                .await
            }
        };
        match served {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("serve: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
