//! Shaping in the layer: how many requests wait (per key and in all), and
//! what a held request gives back when it is dropped before its release.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};
use std::time::Duration;

use tollgate_budget::{Charge, Outcome, Reservation, Store};

/// The requests a layer holds: how many in all, and per shaped key.
///
/// A request that may wait takes its place before the store decides it
/// (and gives it up when the store admits or refuses it at once): so the
/// store never holds a request the line has no room for, which would then
/// have to be refused after its charges were spent. An in-process store
/// decides under the locked line; a store that needs I/O decides while the
/// place is held, which counts the request as waiting during its round
/// trip (conservative: at most the bound wait, and a burst through such a
/// store may be shaped a little less).
#[derive(Default)]
pub(crate) struct Waiters {
    counts: Mutex<WaitCounts>,
}

#[derive(Default)]
struct WaitCounts {
    total: usize,
    per_key: HashMap<Box<str>, usize>,
}

/// The keys a request would wait on (key text, per-key limit).
pub(crate) type WaitKeys = Vec<(Box<str>, usize)>;

impl Waiters {
    /// The line, locked: a request that may wait takes its place and is
    /// decided under it, so that no other request takes the room between
    /// the two (see [`ShapingLine`]).
    pub(crate) fn lock(self: &Arc<Self>) -> ShapingLine<'_> {
        ShapingLine {
            waiters: self,
            counts: self.counts.lock().unwrap_or_else(PoisonError::into_inner),
        }
    }
}

/// The locked line.
pub(crate) struct ShapingLine<'a> {
    waiters: &'a Arc<Waiters>,
    counts: std::sync::MutexGuard<'a, WaitCounts>,
}

impl ShapingLine<'_> {
    /// A place for one more request in line on each of `keys` (key text,
    /// per-key limit), if every key and the layer (`max`) have room.
    pub(crate) fn enter(&mut self, keys: &WaitKeys, max: usize) -> Option<Place> {
        let counts = &mut *self.counts;
        let full = |(key, limit): &(Box<str>, usize)| {
            counts.per_key.get(key).copied().unwrap_or(0) >= *limit
        };
        if counts.total >= max || keys.iter().any(full) {
            return None;
        }
        counts.total += 1;
        for (key, _) in keys {
            *counts.per_key.entry(key.clone()).or_default() += 1;
        }
        Some(Place {
            waiters: Some(self.waiters.clone()),
            keys: keys.iter().map(|(k, _)| k.clone()).collect(),
        })
    }

    /// Gives `place` up while the line is locked (dropping it would lock
    /// the line again).
    pub(crate) fn leave(&mut self, mut place: Place) {
        place.waiters = None;
        self.counts.leave(&place.keys);
    }
}

impl WaitCounts {
    fn leave(&mut self, keys: &[Box<str>]) {
        self.total -= 1;
        for key in keys {
            if let Some(n) = self.per_key.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.per_key.remove(key);
                }
            }
        }
    }
}

/// A request's place in line; left when dropped.
pub(crate) struct Place {
    /// `None` once left.
    waiters: Option<Arc<Waiters>>,
    keys: Vec<Box<str>>,
}

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(waiters) = self.waiters.take() {
            waiters
                .counts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .leave(&self.keys);
        }
    }
}

/// Gives a reservation back; run when a held request is dropped first.
type GiveBack = Box<dyn FnOnce() + Send>;

/// A request admitted for later: how long to hold it, and what its drop
/// before then gives back.
pub(crate) struct Wait {
    pub(crate) delay: Duration,
    give_back: Option<GiveBack>,
    _place: Option<Place>,
}

impl fmt::Debug for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Wait")
            .field("delay", &self.delay)
            .finish_non_exhaustive()
    }
}

impl Wait {
    /// The wait of a delayed `outcome` of `charges` in `store`, holding
    /// `place` until it ends.
    pub(crate) fn of<St: Store + Clone>(
        store: &St,
        charges: &[Charge],
        outcome: &Outcome,
        place: Option<Place>,
    ) -> Option<Self> {
        let reservation = outcome.reservation()?.clone();
        let (store, charges) = (store.clone(), charges.to_vec());
        Some(Self {
            delay: outcome.delay(),
            give_back: Some(Box::new(move || cancel(store, charges, reservation))),
            _place: place,
        })
    }

    /// The request goes on: nothing is given back.
    pub(crate) fn released(mut self) {
        self.give_back = None;
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        if let Some(give_back) = self.give_back.take() {
            give_back();
        }
    }
}

/// Gives `reservation` back: at once when the store needs no I/O, else on
/// a spawned task (a drop cannot wait).
fn cancel<St: Store>(store: St, charges: Vec<Charge>, reservation: Reservation) {
    let work = async move {
        if let Err(error) = store.cancel(&charges, &reservation).await {
            tracing::warn!(%error, "could not give back a dropped request's reservation");
        }
    };
    let mut boxed = Box::pin(work);
    let mut cx = Context::from_waker(Waker::noop());
    if boxed.as_mut().poll(&mut cx).is_ready() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(boxed);
        }
        Err(_) => tracing::warn!(
            "no tokio runtime to give back a dropped request's reservation: it stays spent"
        ),
    }
}
