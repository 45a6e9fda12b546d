//! The core's conformance table against a real Redis, with injected time,
//! both as one script per request and slot by slot with refunds.

use tollgate_core::ManualClock;
use tollgate_core::conformance::{cases, run_case};
use tollgate_redis::RedisStore;
use tollgate_redis::testing::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_reproduces_every_case() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    for split in [false, true] {
        let clock = ManualClock::new(0);
        let reading = clock.clone();
        let store = RedisStore::builder(&server.url())
            .unwrap()
            .injected_time(move || tollgate_core::Clock::now(&reading))
            .split_by_slot(split)
            .build()
            .unwrap();
        let namespace = if split { "split" } else { "atomic" };
        for case in cases() {
            run_case(&store, namespace, &case, |t| clock.set(t))
                .await
                .unwrap_or_else(|m| panic!("split={split}: {m}"));
        }
    }
}
