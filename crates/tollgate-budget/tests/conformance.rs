//! The shared conformance table against `MemoryStore`.

use tollgate_budget::conformance::{cases, run_case};
use tollgate_budget::{ManualClock, MemoryStore};

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

#[test]
fn memory_store_reproduces_every_case() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    for case in cases() {
        block_on(run_case(&store, "mem", &case, |t| clock.set(t)))
            .unwrap_or_else(|m| panic!("{m}"));
    }
}

#[test]
fn memory_store_behind_a_trait_object_agrees() {
    use std::sync::Arc;
    use tollgate_budget::DynStore;
    let clock = ManualClock::new(0);
    let store: Arc<dyn DynStore> = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    for case in cases() {
        block_on(run_case(&store, "dyn", &case, |t| clock.set(t)))
            .unwrap_or_else(|m| panic!("{m}"));
    }
}
