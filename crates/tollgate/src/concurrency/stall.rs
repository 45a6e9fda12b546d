//! Ending response bodies that make no progress: a client that stops
//! reading (an HTTP/2 flow-control window left at zero, a full TCP window)
//! stops the server from polling the body at all, so the body itself
//! cannot notice. One watchdog task per layer looks at every body in
//! flight and, for one that has yielded nothing for the layer's
//! [`body_idle_timeout`](super::ConcurrencyLimitBuilder::body_idle_timeout),
//! releases its slot (and fleet lease) at once; the body then ends with an
//! error the next time it is polled, which resets the stream (HTTP/2) or
//! closes the connection (HTTP/1.1).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::in_flight::InFlightHold;
use crate::observe::Throttle;

/// The default [`body_idle_timeout`](crate::concurrency::ConcurrencyLimitBuilder::body_idle_timeout):
/// a minute.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The error a response body ends with when it made no progress for the
/// layer's [`body_idle_timeout`](crate::concurrency::ConcurrencyLimitBuilder::body_idle_timeout).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the response body made no progress for {idle:?} (the client stopped reading, or the \
     body stopped producing): ended, and its in-flight slot released"
)]
pub struct BodyStalled {
    idle: Duration,
}

/// One layer's watch over the bodies of its requests in flight.
pub(crate) struct Stalls {
    limit: Arc<str>,
    idle: Duration,
    epoch: Instant,
    watch: Mutex<Watch>,
    stalled: AtomicU64,
}

#[derive(Default)]
struct Watch {
    bodies: HashMap<u64, Weak<Watched>>,
    next: u64,
    /// Whether the watchdog task runs; at most one does, and it ends when
    /// no body is left to watch.
    running: bool,
}

/// A body's slot, shared by the body and the watchdog: whichever comes
/// first (the body's end or drop, or a stall) releases it.
pub(crate) struct Watched {
    id: u64,
    stalls: Arc<Stalls>,
    /// When the body last yielded a frame (or started), in ns since the
    /// layer's epoch.
    last: AtomicU64,
    permit: Mutex<Option<InFlightHold>>,
    stalled: AtomicBool,
    /// The task that last found the body pending: woken when it stalls,
    /// so that a server still polling the body ends it at once.
    waker: Mutex<Option<Waker>>,
}

impl fmt::Debug for Stalls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stalls")
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

/// How a response body holds its request's slot.
pub(crate) enum Guard {
    /// Watched for stalls.
    Watched(Arc<Watched>),
    /// Not watched (no tokio runtime to run the watchdog on). Never read:
    /// holding it is the point.
    Held { _permit: InFlightHold },
}

impl Stalls {
    pub(crate) fn new(limit: Arc<str>, idle: Duration) -> Self {
        Self {
            limit,
            idle,
            epoch: Instant::now(),
            watch: Mutex::new(Watch::default()),
            stalled: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Bodies ended because they made no progress.
    pub(crate) fn stalled(&self) -> u64 {
        self.stalled.load(Ordering::Relaxed)
    }

    /// `permit`, held by a body that starts now and is watched from now on.
    pub(crate) fn guard(self: &Arc<Self>, permit: InFlightHold) -> Guard {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Guard::Held { _permit: permit };
        };
        let mut watch = self.lock();
        let id = watch.next;
        watch.next += 1;
        let watched = Arc::new(Watched {
            id,
            stalls: self.clone(),
            last: AtomicU64::new(self.now()),
            permit: Mutex::new(Some(permit)),
            stalled: AtomicBool::new(false),
            waker: Mutex::new(None),
        });
        watch.bodies.insert(id, Arc::downgrade(&watched));
        if !watch.running {
            watch.running = true;
            runtime.spawn(watchdog(self.clone()));
        }
        Guard::Watched(watched)
    }
}

impl Watched {
    /// The body yielded a frame.
    pub(crate) fn progress(&self) {
        self.last.store(self.stalls.now(), Ordering::Relaxed);
    }

    /// The body is pending: `waker` is woken if it stalls.
    pub(crate) fn pending(&self, waker: &Waker) {
        let mut slot = self.waker.lock().unwrap_or_else(PoisonError::into_inner);
        if !slot.as_ref().is_some_and(|w| w.will_wake(waker)) {
            *slot = Some(waker.clone());
        }
    }

    /// Whether the watchdog ended this body.
    pub(crate) fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    /// Releases the slot (the body ended, or was dropped).
    pub(crate) fn release(&self) {
        let permit = self
            .permit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(permit);
    }

    /// The error the body ends with.
    pub(crate) fn error(&self) -> BodyStalled {
        BodyStalled {
            idle: self.stalls.idle,
        }
    }

    fn stall(&self) {
        self.stalled.store(true, Ordering::Release);
        self.release();
        let waker = self
            .waker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(waker) = waker {
            waker.wake();
        }
        let stalls = &self.stalls;
        stalls.stalled.fetch_add(1, Ordering::Relaxed);
        static THROTTLE: Throttle = Throttle::new();
        if let Some(suppressed) = THROTTLE.admit() {
            tracing::warn!(
                layer = &*stalls.limit,
                idle = ?stalls.idle,
                suppressed,
                "a response body made no progress (the client stopped reading, or the body \
                 stopped producing): its in-flight slot is released and the body ended"
            );
        }
        // Counter `tollgate_stalled_bodies_total{layer}`; documented in
        // observe.rs.
        #[cfg(feature = "metrics")]
        metrics::counter!("tollgate_stalled_bodies_total", "layer" => stalls.limit.to_string())
            .increment(1);
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.stalls.lock().bodies.remove(&self.id);
    }
}

/// Every so often (a quarter of the idle time, between 10 ms and 1 s),
/// ends the bodies idle for longer than the layer allows; stops when none
/// is left to watch.
async fn watchdog(stalls: Arc<Stalls>) {
    let tick = (stalls.idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let idle = u64::try_from(stalls.idle.as_nanos()).unwrap_or(u64::MAX);
    loop {
        tokio::time::sleep(tick).await;
        let now = stalls.now();
        let mut ended = Vec::new();
        // The bodies looked at, held until the lock is let go: the last
        // reference to one dropped under it would lock it again.
        let mut seen = Vec::new();
        let done = {
            let mut watch = stalls.lock();
            watch.bodies.retain(|_, body| match body.upgrade() {
                None => false,
                Some(body) if now.saturating_sub(body.last.load(Ordering::Relaxed)) >= idle => {
                    ended.push(body);
                    false
                }
                Some(body) => {
                    seen.push(body);
                    true
                }
            });
            let done = watch.bodies.is_empty();
            if done {
                watch.running = false;
            }
            done
        };
        drop(seen);
        // Outside the lock: releasing a slot hands it to a waiter, and a
        // fleet lease's release spawns its call.
        for body in ended {
            body.stall();
        }
        if done {
            return;
        }
    }
}
