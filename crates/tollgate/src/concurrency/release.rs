//! Giving fleet leases back, with a bounded number of retries.
//!
//! A release is tried once at once. One that fails is queued, and a single
//! task per layer tries the queue again, one lease at a time, with a pause
//! that doubles while the store keeps failing: during an outage or a
//! stalled server, a layer sends one release at a time, not one per lease
//! (each call sent to a stalled Redis runs when it resumes, so retries
//! per lease would all land at once). When one succeeds the rest follow
//! back to back. The queue holds at most [`MAX_PENDING_RELEASES`] leases:
//! beyond it a lease is left to expire by its time to live, which is
//! counted and logged at a bounded rate.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tollgate_budget::{Lease, LeaseStore};

use crate::observe::Throttle;

/// Whose leases are given back: a shared limit (its fleet), with the store
/// the leases are in, its releases still to retry, and the line of its
/// waiters, told when a slot comes free.
pub(crate) trait Owner: Send + Sync + 'static {
    /// The store the leases are in.
    fn store(&self) -> &dyn LeaseStore;
    /// The releases still to be retried.
    fn releases(&self) -> &Releases;
    /// A slot came free: the first waiter may ask.
    fn slot_freed(&self);
}

/// The most releases one layer keeps for retrying. Each is a lease that
/// would hold a slot until its time to live if given up; past this many
/// the store has been failing for long enough that the slots are lost for
/// a lease either way, and the memory and the calls sent when it comes
/// back stay bounded.
pub(crate) const MAX_PENDING_RELEASES: usize = 1024;

/// The pause before the first retry, doubled after each failure up to
/// [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// A layer's releases still to be retried.
#[derive(Default)]
pub(crate) struct Releases {
    pending: Mutex<Pending>,
    /// Leases left to expire by themselves: the queue was full.
    abandoned: AtomicU64,
}

#[derive(Default)]
struct Pending {
    /// Leases to give back, each with the time after which it has expired
    /// anyway (from when it was queued: an upper bound of its expiry).
    queue: VecDeque<(Lease, tokio::time::Instant)>,
    /// Whether the retrying task runs; at most one does.
    retrying: bool,
}

impl Releases {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Leases left to expire by themselves because the queue was full.
    pub(crate) fn abandoned(&self) -> u64 {
        self.abandoned.load(Ordering::Relaxed)
    }
}

/// Gives `lease` back on a spawned task (a drop cannot wait), then hands
/// the turn to the first request of this process waiting for a slot.
/// `failing`: the store has just failed (the acquire's answer was lost), so
/// the release goes straight to the queue rather than adding a call to a
/// store that is not answering. Without a runtime the lease expires by
/// itself, one time to live after its last renewal.
pub(crate) fn give_back<F: Owner>(leases: &Arc<F>, lease: Lease, failing: bool) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::warn!(
            limit = &*lease.request.limit,
            "no tokio runtime to release an in-flight lease; it expires by itself"
        );
        return;
    };
    // Behind releases already queued: the store was failing a moment ago,
    // and the retrying task sends them in order.
    if failing || leases.releases().lock().retrying {
        queue(leases, &runtime, lease);
        return;
    }
    let leases = leases.clone();
    runtime.clone().spawn(async move {
        match leases.store().release(&lease).await {
            Ok(()) => leases.slot_freed(),
            Err(_) => queue(&leases, &runtime, lease),
        }
    });
}

/// Queues `lease` for the retrying task (started if none runs), or leaves
/// it to expire when the queue is full.
fn queue<F: Owner>(leases: &Arc<F>, runtime: &tokio::runtime::Handle, lease: Lease) {
    let mut pending = leases.releases().lock();
    if pending.queue.len() >= MAX_PENDING_RELEASES {
        drop(pending);
        leases.releases().abandoned.fetch_add(1, Ordering::Relaxed);
        static THROTTLE: Throttle = Throttle::new();
        if let Some(suppressed) = THROTTLE.admit() {
            tracing::warn!(
                limit = &*lease.request.limit,
                pending = MAX_PENDING_RELEASES,
                suppressed,
                "too many in-flight leases waiting to be released while the lease store \
                 fails; this one expires by itself (its slot stays taken until then)"
            );
        }
        // Counter `tollgate_lease_release_abandoned_total{layer}`; documented
        // in observe.rs.
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "tollgate_lease_release_abandoned_total",
            "layer" => lease.request.limit.to_string()
        )
        .increment(1);
        return;
    }
    let until = tokio::time::Instant::now() + lease.request.ttl;
    pending.queue.push_back((lease, until));
    if !pending.retrying {
        pending.retrying = true;
        runtime.spawn(retry(leases.clone()));
    }
}

/// Releases the queued leases one at a time: after a pause that doubles
/// while the store fails, and back to back once it answers. Ends when the
/// queue is empty; leases that have expired meanwhile are dropped.
async fn retry<F: Owner>(leases: Arc<F>) {
    let mut pause = FIRST_PAUSE;
    loop {
        tokio::time::sleep(pause).await;
        loop {
            let next = {
                let mut pending = leases.releases().lock();
                let now = tokio::time::Instant::now();
                while pending
                    .queue
                    .front()
                    .is_some_and(|(_, until)| *until <= now)
                {
                    pending.queue.pop_front();
                }
                match pending.queue.pop_front() {
                    Some(next) => next,
                    None => {
                        // Under the lock: a release queued from now on
                        // starts a new task.
                        pending.retrying = false;
                        return;
                    }
                }
            };
            match leases.store().release(&next.0).await {
                Ok(()) => {
                    leases.slot_freed();
                    pause = FIRST_PAUSE;
                }
                Err(error) => {
                    static THROTTLE: Throttle = Throttle::new();
                    if let Some(suppressed) = THROTTLE.admit() {
                        tracing::warn!(
                            error = %crate::observe::chain(&error),
                            limit = &*next.0.request.limit,
                            suppressed,
                            "could not release an in-flight lease; trying again"
                        );
                    }
                    leases.releases().lock().queue.push_front(next);
                    pause = (pause * 2).min(MAX_PAUSE);
                    break;
                }
            }
        }
    }
}
