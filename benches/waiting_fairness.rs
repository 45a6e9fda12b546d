//! Bounded waiting in `ConcurrencyLimitLayer` under sustained load: 40
//! clients call a handler that holds one of 8 slots for 5 ms, with up to 64
//! waiting at most 50 ms, for three seconds. Counts requests admitted at
//! once, admitted after waiting, and waiters that timed out although slots
//! kept freeing; prints the longest wait that succeeded.
//!
//! `cargo bench --bench waiting_fairness`

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use tollgate::ConcurrencyLimitLayer;
use tower::{Layer, Service, ServiceExt};

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run());
}

async fn run() {
    let layer = ConcurrencyLimitLayer::builder("fair")
        .global(NonZeroUsize::new(8).expect("8"))
        .wait(64, Duration::from_millis(50))
        .build()
        .unwrap();
    let inner = tower::service_fn(|_req: Request<()>| async {
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok::<_, Infallible>(Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
    });
    let svc = layer.layer(inner);
    let ok = Arc::new(AtomicU64::new(0));
    let waited_ok = Arc::new(AtomicU64::new(0));
    let timed_out = Arc::new(AtomicU64::new(0));
    let longest_ns = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    for _ in 0..40 {
        let mut svc = svc.clone();
        let (ok, waited_ok, timed_out, longest_ns) = (
            ok.clone(),
            waited_ok.clone(),
            timed_out.clone(),
            longest_ns.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while Instant::now() < end {
                let started = Instant::now();
                let res = svc
                    .ready()
                    .await
                    .expect("ready")
                    .call(Request::new(()))
                    .await
                    .expect("infallible");
                let took = started.elapsed();
                if res.status() == StatusCode::OK {
                    if took > Duration::from_millis(6) {
                        waited_ok.fetch_add(1, Ordering::Relaxed);
                        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
                        longest_ns.fetch_max(ns, Ordering::Relaxed);
                    } else {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    timed_out.fetch_add(1, Ordering::Relaxed);
                }
                drop(res);
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    println!(
        "admitted at once {}, admitted after waiting {}, refused after waiting or with a full queue {}, longest successful wait {:?}",
        ok.load(Ordering::Relaxed),
        waited_ok.load(Ordering::Relaxed),
        timed_out.load(Ordering::Relaxed),
        Duration::from_nanos(longest_ns.load(Ordering::Relaxed))
    );
}
