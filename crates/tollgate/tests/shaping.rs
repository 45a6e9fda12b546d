//! A request held by a shaping rule and dropped before its release (the
//! client went away, a timeout) gives its reservation back when it is the
//! last in line, and leaves its place in line either way.

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::time::Duration;

use http::{Request, Response};
use tollgate::{
    KeyPart, MemoryStore, Policy, Rate, RateLimitLayer, Rule,
    identity::PeerAddr,
    store::{Charge, Key, ManualClock},
};
use tower::{Layer, Service, ServiceExt};

fn held() -> Policy {
    Policy::token_bucket("held", 1, Rate::per_second(2)).unwrap()
}

/// How long until the bucket is full again: where the line of
/// reservations ends, plus one refill.
fn reset(store: &MemoryStore) -> Duration {
    let probe = Charge::new(Key::new("lit=one"), held(), 1).unwrap();
    store.describe(&[probe]).limits()[0].reset()
}

fn request() -> Request<()> {
    let mut req = Request::new(());
    req.extensions_mut()
        .insert(PeerAddr("198.51.100.7:5000".parse().unwrap()));
    req
}

#[tokio::test]
async fn a_dropped_waiter_gives_back_its_reservation_when_last_in_line() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = RateLimitLayer::builder(std::sync::Arc::new(store.clone()))
        .rule(
            Rule::new(held())
                .keyed_by([KeyPart::Literal("one".into())])
                .shape(Duration::from_secs(2), NonZeroUsize::new(2).unwrap()),
        )
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let mut call = || svc.ready().now_or_never().unwrap().unwrap().call(request());
    // The first goes at once; the next two are held, to 0.5 s and 1 s.
    let first = call().await.unwrap();
    assert_eq!(first.status(), 200);
    let second = call();
    let third = call();
    assert_eq!(reset(&store), Duration::from_millis(1500));
    // The line of two is full: a fourth is refused at once.
    assert_eq!(call().await.unwrap().status(), 429);
    // Dropping the second, with the third behind it, gives nothing back.
    drop(second);
    assert_eq!(reset(&store), Duration::from_millis(1500));
    // The third is last in line: dropped, its reservation goes back.
    drop(third);
    assert_eq!(reset(&store), Duration::from_millis(1000));
    // Both left the line, but the store bounds it by time too (two refills
    // of one request: 1 s), and the second's reservation, not given back,
    // is still in it: the fourth takes the place (and release time) of the
    // one given back; a fifth is refused at once, spending nothing.
    let fourth = call();
    assert_eq!(reset(&store), Duration::from_millis(1500));
    assert_eq!(call().await.unwrap().status(), 429);
    assert_eq!(reset(&store), Duration::from_millis(1500));
    drop(fourth);
}

/// Used above: a future that is ready now, or `None`.
trait NowOrNever: std::future::Future + Sized {
    fn now_or_never(self) -> Option<Self::Output> {
        let mut future = std::pin::pin!(self);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => Some(v),
            std::task::Poll::Pending => None,
        }
    }
}

impl<F: std::future::Future> NowOrNever for F {}

/// Found in review: a held request kept the inner service it was made
/// ready with for its whole wait, so a service whose readiness is a
/// resource (here tower's `ConcurrencyLimit` of one) stayed taken and an
/// unrelated request waited as long. Now the wait lets it go, and the held
/// request is made ready again when released.
#[tokio::test]
async fn a_held_request_does_not_keep_the_inner_service_ready() {
    let layer = RateLimitLayer::builder(MemoryStore::new())
        .rule(
            Rule::new(held())
                .on_route("/held")
                .keyed_by([KeyPart::Literal("one".into())])
                .shape(Duration::from_secs(2), NonZeroUsize::new(2).unwrap()),
        )
        .build()
        .unwrap();
    let inner = tower::limit::ConcurrencyLimitLayer::new(1).layer(tower::service_fn(
        |_req: Request<()>| async { Ok::<_, Infallible>(Response::new(())) },
    ));
    let mut svc = layer.layer(inner);
    let to = |path: &str| {
        let mut req = request();
        *req.uri_mut() = path.parse().unwrap();
        req
    };
    let first = svc.ready().await.unwrap().call(to("/held")).await.unwrap();
    assert_eq!(first.status(), 200);
    // The second is held for 0.5 s.
    let held = tokio::spawn(svc.ready().await.unwrap().call(to("/held")));
    tokio::task::yield_now().await;
    // The only permit is free again at once: an unrelated request goes.
    let ready = svc
        .ready()
        .now_or_never()
        .expect("ready while the other waits");
    assert_eq!(
        ready.unwrap().call(to("/free")).await.unwrap().status(),
        200
    );
    assert_eq!(held.await.unwrap().unwrap().status(), 200);
}

/// Holding needs tokio's timer. Outside a runtime nothing is held: a
/// request is decided unshaped (refused here, spending nothing), not a
/// panic.
#[test]
fn without_a_runtime_a_request_that_would_wait_is_refused() {
    let clock = ManualClock::new(0);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let layer = RateLimitLayer::builder(std::sync::Arc::new(store.clone()))
        .rule(
            Rule::new(held())
                .keyed_by([KeyPart::Literal("one".into())])
                .shape(Duration::from_secs(2), NonZeroUsize::new(2).unwrap()),
        )
        .build()
        .unwrap();
    let mut svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    let mut call = || {
        let ready = svc.ready().now_or_never().unwrap().unwrap();
        ready.call(request()).now_or_never().unwrap().unwrap()
    };
    assert_eq!(call().status(), 200);
    assert_eq!(call().status(), 429);
    // Nothing stayed reserved: the bucket is full again in 0.5 s.
    assert_eq!(reset(&store), Duration::from_millis(500));
}

/// A zero wait shapes nothing: the rule is refused with a clear error.
#[test]
fn a_zero_wait_is_refused_as_a_rule() {
    let rule = Rule::new(held()).shape(Duration::ZERO, NonZeroUsize::new(2).unwrap());
    let error = RateLimitLayer::builder(MemoryStore::new())
        .rule(rule)
        .build()
        .unwrap_err();
    assert!(error.to_string().contains("above zero"), "{error}");
    // The rule is wrong whatever the store: not the store's fault.
    assert!(!error.is_unsupported_by_store(), "{error}");
}

/// A MemoryStore that answers one poll later, as a store with a round
/// trip does (and never inside `call`).
#[derive(Clone)]
struct RoundTrip(MemoryStore);

struct OnePollLater(bool);

impl std::future::Future for OnePollLater {
    type Output = ();
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

impl tollgate::Store for RoundTrip {
    async fn charge(
        &self,
        charges: &[Charge],
    ) -> Result<tollgate::store::Outcome, tollgate::StoreError> {
        OnePollLater(false).await;
        self.0.charge_now(charges)
    }

    fn can_shape(&self) -> bool {
        true
    }

    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a tollgate::store::Reservation,
    ) -> impl std::future::Future<Output = Result<(), tollgate::StoreError>> + Send + 'a {
        self.0.cancel_now(charges, reservation);
        std::future::ready(Ok(()))
    }

    fn check_policy(&self, policy: &Policy) -> Result<(), tollgate::StoreError> {
        tollgate::Store::check_policy(&self.0, policy)
    }
}

/// Review finding: with a store that answers after a round trip, every
/// request of a burst checked the line while it was still empty, the store
/// held them all, and those beyond `max_waiting` were then refused with
/// their charges spent (an unshaped rule charged, reservations left that
/// delayed later callers). Now a request takes its place in line before
/// the store decides it: beyond the line it is decided unshaped, and a
/// refusal spends nothing.
#[tokio::test]
async fn a_full_line_refuses_before_the_store_decides_and_spends_nothing() {
    let clock = ManualClock::new(0);
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let other = Policy::token_bucket("other", 100, Rate::per_hour(1)).unwrap();
    let layer = RateLimitLayer::builder(RoundTrip(memory.clone()))
        .max_waiting(2)
        .rule(
            Rule::new(held())
                .keyed_by([KeyPart::Literal("one".into())])
                .shape(Duration::from_secs(5), NonZeroUsize::new(10).unwrap()),
        )
        .rule(Rule::new(other.clone()).keyed_by([KeyPart::Literal("two".into())]))
        .build()
        .unwrap();
    let svc = layer.layer(tower::service_fn(|_req: Request<()>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    // Six calls made before any is decided (all in flight to the store).
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let mut svc = svc.clone();
            async move { svc.ready().await.unwrap().call(request()).await.unwrap() }
        })
        .map(tokio::spawn)
        .collect();
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.unwrap().status().as_u16());
    }
    statuses.sort_unstable();
    // One at once and one held (the line of two, one of whose places was
    // taken by the first while it was decided); the rest refused.
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);
    // The refused spent nothing: `other` was charged for the two admitted,
    // and the held bucket is full 1 s from now (0.5 s line, 0.5 s refill).
    let probe = |p: &Policy, k: &str| {
        memory
            .describe(&[Charge::new(Key::new(k), p.clone(), 1).unwrap()])
            .limits()[0]
    };
    assert_eq!(probe(&other, "lit=two").remaining(), 98);
    assert_eq!(probe(&held(), "lit=one").reset(), Duration::from_secs(1));
}
