//! The line of requests waiting for a shared limit's lease, without Redis:
//! a `ConcurrencyLimitLayer` shared through an in-memory [`LeaseStore`]
//! (the same atomic rules as the Redis script: expired leases dropped, the
//! bounds checked and the lease taken in one step), on tokio's paused
//! clock. Each rule here was fixed in a review round and was until now
//! only tested through Redis and processes (tests/fleet_in_flight.rs).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tollgate::identity::PeerAddr;
use tollgate::store::{Acquired, Lease, LeaseRequest, LeaseStore, Renewed, StoreFuture};
use tollgate::{ConcurrencyLimitLayer, KeyPart, StoreError};
use tower::{Layer, ServiceExt};

/// Leases in memory, on tokio's clock.
#[derive(Default)]
struct MemoryLeases {
    held: Mutex<HashMap<u128, (LeaseRequest, Instant)>>,
}

impl MemoryLeases {
    fn take(&self, request: &LeaseRequest, id: u128) -> Acquired {
        let mut held = self.held.lock().unwrap();
        let now = Instant::now();
        held.retain(|_, (_, until)| *until > now);
        let of_limit = held
            .values()
            .filter(|(r, _)| r.limit == request.limit)
            .collect::<Vec<_>>();
        let of_key = of_limit
            .iter()
            .filter(|(r, _)| request.key.is_some() && r.key == request.key)
            .count();
        let key_full = request.per_key.is_some_and(|max| of_key as u64 >= max);
        let all_full = request
            .global
            .is_some_and(|max| of_limit.len() as u64 >= max);
        match (key_full, all_full) {
            (true, true) => Acquired::BothFull,
            (true, false) => Acquired::PerKeyFull,
            (false, true) => Acquired::GlobalFull,
            (false, false) => {
                held.insert(id, (request.clone(), now + request.ttl));
                Acquired::Granted(Lease {
                    request: request.clone(),
                    id,
                })
            }
        }
    }
}

impl LeaseStore for MemoryLeases {
    fn acquire<'a>(
        &'a self,
        request: &'a LeaseRequest,
        id: u128,
    ) -> StoreFuture<'a, Result<Acquired, StoreError>> {
        Box::pin(std::future::ready(Ok(self.take(request, id))))
    }

    fn renew<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<Renewed, StoreError>> {
        let until = Instant::now() + lease.request.ttl;
        let mut held = self.held.lock().unwrap();
        let renewed = match held.insert(lease.id, (lease.request.clone(), until)) {
            Some(_) => Renewed::Extended,
            None => Renewed::Restored,
        };
        Box::pin(std::future::ready(Ok(renewed)))
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<(), StoreError>> {
        self.held.lock().unwrap().remove(&lease.id);
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Requests numbered by the test: each one, once admitted, records its
/// number and holds its slot until the test opens its gate.
#[derive(Clone)]
struct Held {
    admitted: Arc<Mutex<Vec<usize>>>,
    gates: Arc<Vec<Semaphore>>,
}

impl Held {
    fn new(n: usize) -> Self {
        Self {
            admitted: Arc::default(),
            gates: Arc::new((0..n).map(|_| Semaphore::new(0)).collect()),
        }
    }

    fn open(&self, n: usize) {
        self.gates[n].add_permits(1);
    }

    fn admitted(&self) -> Vec<usize> {
        self.admitted.lock().unwrap().clone()
    }
}

type Svc = tollgate::concurrency::ConcurrencyLimit<
    tower::util::BoxCloneSyncService<Request<()>, Response<()>, Infallible>,
>;

fn service(
    held: &Held,
    per_key: Option<usize>,
    global: Option<usize>,
    waiters: usize,
    store: Arc<dyn LeaseStore>,
) -> Svc {
    let mut limit = ConcurrencyLimitLayer::builder("line")
        .shared(store)
        .poll_every(Duration::from_millis(50))
        .wait(waiters, Duration::from_secs(10));
    if let Some(max) = per_key {
        limit = limit.per_key(NonZeroUsize::new(max).unwrap(), [KeyPart::ClientIp]);
    }
    if let Some(max) = global {
        limit = limit.global(NonZeroUsize::new(max).unwrap());
    }
    let held = held.clone();
    let inner = tower::service_fn(move |req: Request<()>| {
        let held = held.clone();
        async move {
            let n: usize = req.headers()["x-n"].to_str().unwrap().parse().unwrap();
            held.admitted.lock().unwrap().push(n);
            held.gates[n].acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(()))
        }
    });
    limit
        .build()
        .unwrap()
        .layer(tower::util::BoxCloneSyncService::new(inner))
}

/// Request `n` from client address 127.0.0.`client` (its key), sent now;
/// its status once answered. The response (and its slot) is dropped then.
fn send(svc: &Svc, n: usize, client: u8) -> tokio::task::JoinHandle<StatusCode> {
    let mut req = Request::get("/").header("x-n", n).body(()).unwrap();
    req.extensions_mut()
        .insert(PeerAddr(SocketAddr::from(([127, 0, 0, client], 4000))));
    let svc = svc.clone();
    tokio::spawn(async move { svc.oneshot(req).await.unwrap().status() })
}

/// Lets every task run until all wait on something (the clock is paused:
/// no time passes).
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// Within a process, first come first served: a freed slot goes to the
/// earliest waiter, never to a later one that happens to ask first.
#[tokio::test(start_paused = true)]
async fn a_freed_slot_goes_to_the_earliest_waiter() {
    let held = Held::new(5);
    let svc = service(&held, None, Some(1), 8, Arc::new(MemoryLeases::default()));
    let mut answers = Vec::new();
    for n in 0..5 {
        answers.push(send(&svc, n, 1 + n as u8));
        settle().await;
    }
    assert_eq!(held.admitted(), [0]);
    for n in 0..4 {
        held.open(n);
        // Polls every 50 ms: well within a second.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(held.admitted(), (0..=n + 1).collect::<Vec<_>>());
    }
    held.open(4);
    for answer in answers {
        assert_eq!(answer.await.unwrap(), StatusCode::OK);
    }
}

/// A waiter refused by its own key's limit alone holds up nobody of
/// another key: they are admitted past it while the limit in all has room.
#[tokio::test(start_paused = true)]
async fn a_key_full_by_itself_holds_up_no_other_key() {
    let held = Held::new(4);
    let svc = service(
        &held,
        Some(1),
        Some(3),
        8,
        Arc::new(MemoryLeases::default()),
    );
    let first = send(&svc, 0, 1);
    settle().await;
    let same_key = send(&svc, 1, 1);
    settle().await;
    let other_key = send(&svc, 2, 2);
    settle().await;
    assert_eq!(held.admitted(), [0, 2]);
    held.open(2);
    assert_eq!(other_key.await.unwrap(), StatusCode::OK);
    held.open(0);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(held.admitted(), [0, 2, 1]);
    held.open(1);
    assert_eq!(same_key.await.unwrap(), StatusCode::OK);
}

/// Waiters of several keys refused by the limit in all are admitted in
/// the order they came, one per freed slot (the race where a slot frees
/// while an ask is out is the last test's).
#[tokio::test(start_paused = true)]
async fn waiters_of_several_keys_are_admitted_in_arrival_order() {
    let held = Held::new(3);
    let svc = service(
        &held,
        Some(2),
        Some(1),
        8,
        Arc::new(MemoryLeases::default()),
    );
    let mut answers = Vec::new();
    for n in 0..3 {
        answers.push(send(&svc, n, 1 + n as u8));
        settle().await;
    }
    assert_eq!(held.admitted(), [0]);
    held.open(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(held.admitted(), [0, 1]);
    held.open(1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(held.admitted(), [0, 1, 2]);
    held.open(2);
    for answer in answers {
        assert_eq!(answer.await.unwrap(), StatusCode::OK);
    }
}

/// One key waits no more than it may have in flight: a newcomer behind a
/// waiter of its own key is refused at once, as by the key (`429`), while
/// another key may still wait (and is answered `503` by the limit in all
/// only when its wait ends).
#[tokio::test(start_paused = true)]
async fn a_key_waits_no_more_than_it_may_have_in_flight() {
    let held = Held::new(4);
    let svc = service(
        &held,
        Some(1),
        Some(1),
        8,
        Arc::new(MemoryLeases::default()),
    );
    let first = send(&svc, 0, 1);
    settle().await;
    let waiting = send(&svc, 1, 1);
    settle().await;
    let refused = send(&svc, 2, 1);
    settle().await;
    assert!(refused.is_finished(), "refused at once, not after a wait");
    assert_eq!(refused.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
    let other = send(&svc, 3, 2);
    settle().await;
    assert!(!other.is_finished(), "another key waits");
    // Nothing frees a slot: both waits end, each with its own answer.
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(waiting.await.unwrap(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(other.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    held.open(0);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    assert_eq!(held.admitted(), [0]);
}

/// A full line refuses a newcomer at once, as the line (`503`).
#[tokio::test(start_paused = true)]
async fn a_full_line_refuses_at_once() {
    let held = Held::new(3);
    let svc = service(&held, None, Some(1), 1, Arc::new(MemoryLeases::default()));
    let first = send(&svc, 0, 1);
    settle().await;
    let waiting = send(&svc, 1, 2);
    settle().await;
    let refused = send(&svc, 2, 3);
    settle().await;
    assert!(refused.is_finished(), "refused at once, not after a wait");
    assert_eq!(refused.await.unwrap(), StatusCode::SERVICE_UNAVAILABLE);
    held.open(0);
    held.open(1);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    assert_eq!(waiting.await.unwrap(), StatusCode::OK);
    assert_eq!(held.admitted(), [0, 1]);
}

/// A lease the store lost while its request runs is taken again at its
/// next renewal (within a third of the 10 s lease), so the shared count
/// says it is in flight and a newcomer is refused.
#[tokio::test(start_paused = true)]
async fn a_lost_lease_is_taken_again_at_its_renewal() {
    let held = Held::new(2);
    let store = Arc::new(MemoryLeases::default());
    let svc = service(&held, None, Some(1), 0, store.clone());
    let first = send(&svc, 0, 1);
    settle().await;
    assert_eq!(store.held.lock().unwrap().len(), 1);
    // The store loses every lease (a flush, a restart without persistence).
    store.held.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(store.held.lock().unwrap().len(), 1, "taken again");
    assert_eq!(
        send(&svc, 1, 2).await.unwrap(),
        StatusCode::SERVICE_UNAVAILABLE
    );
    held.open(0);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    assert_eq!(held.admitted(), [0]);
}
/// A slot freed by another instance reaches a waiter held behind
/// one refused by its own key's limit (the refused one hands the turn on).
#[tokio::test(start_paused = true)]
async fn slot_freed_elsewhere_reaches_the_waiter_behind() {
    let store = Arc::new(MemoryLeases::default());
    let held_a = Held::new(4);
    let held_b = Held::new(4);
    let a = service(&held_a, Some(1), Some(3), 8, store.clone());
    let b = service(&held_b, Some(1), Some(3), 8, store.clone());
    // Instance B holds key 1 and key 2.
    let b1 = send(&b, 0, 1);
    let b2 = send(&b, 1, 2);
    settle().await;
    assert_eq!(held_b.admitted(), [0, 1]);
    // Instance A: a waiter of key 1, then one of key 2 behind it.
    let a1 = send(&a, 0, 1);
    settle().await;
    let a2 = send(&a, 1, 2);
    settle().await;
    assert!(held_a.admitted().is_empty());
    // B lets key 2 go: A's key-2 waiter can be admitted (key 1 still full).
    held_b.open(1);
    assert_eq!(b2.await.unwrap(), StatusCode::OK);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        held_a.admitted(),
        [1],
        "the key-2 waiter behind a key-1 waiter got the slot"
    );
    held_a.open(1);
    assert_eq!(a2.await.unwrap(), StatusCode::OK);
    held_b.open(0);
    assert_eq!(b1.await.unwrap(), StatusCode::OK);
    tokio::time::sleep(Duration::from_secs(1)).await;
    held_a.open(0);
    assert_eq!(a1.await.unwrap(), StatusCode::OK);
}

/// leases whose answers take `delay` (decided when asked).
struct SlowLeases {
    inner: MemoryLeases,
    delay: Duration,
}

impl LeaseStore for SlowLeases {
    fn acquire<'a>(
        &'a self,
        request: &'a LeaseRequest,
        id: u128,
    ) -> StoreFuture<'a, Result<Acquired, StoreError>> {
        let answer = self.inner.take(request, id);
        let delay = self.delay;
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Ok(answer)
        })
    }
    fn renew<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<Renewed, StoreError>> {
        self.inner.renew(lease)
    }
    fn release<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<(), StoreError>> {
        self.inner.release(lease)
    }
}

/// A waiter refused by the limit in all holds up the waiter
/// behind it even when a slot frees (elsewhere) while its ask is out.
#[tokio::test(start_paused = true)]
async fn global_refusal_holds_up_behind_even_when_a_slot_frees_mid_ask() {
    let mut overtaken = Vec::new();
    for x in (0..100).step_by(5) {
        let store: Arc<dyn LeaseStore> = Arc::new(SlowLeases {
            inner: MemoryLeases::default(),
            delay: Duration::from_millis(40),
        });
        let held_a = Held::new(3);
        let held_b = Held::new(1);
        let a = service(&held_a, None, Some(1), 8, store.clone());
        let b = service(&held_b, None, Some(1), 8, store.clone());
        let b0 = send(&b, 0, 9);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(held_b.admitted(), [0]);
        let a1 = send(&a, 1, 1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let a2 = send(&a, 2, 2);
        tokio::time::sleep(Duration::from_millis(100 + x)).await;
        held_b.open(0);
        b0.await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let order = held_a.admitted();
        if order.first() == Some(&2) {
            overtaken.push(x);
        }
        held_a.open(1);
        held_a.open(2);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = (a1.await, a2.await);
    }
    assert!(
        overtaken.is_empty(),
        "the later waiter overtook at offsets {overtaken:?} ms"
    );
}

/// An adaptive limit is this process's own: shared through leases, a
/// fleet keeps a fixed global bound, and the build says so.
#[test]
fn an_adaptive_limit_cannot_be_shared() {
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeases::default());
    let config = tollgate::concurrency::AdaptiveConfig::default();
    let global = ConcurrencyLimitLayer::builder("line")
        .shared(store.clone())
        .adaptive(config);
    let per_key = ConcurrencyLimitLayer::builder("line")
        .shared(store)
        .global(NonZeroUsize::new(8).unwrap())
        .per_key_adaptive(config, [KeyPart::Account]);
    for builder in [global, per_key] {
        let err = builder.build().unwrap_err();
        assert!(
            err.to_string()
                .contains("a shared (fleet-wide) limit keeps a fixed"),
            "{err}"
        );
    }
}
