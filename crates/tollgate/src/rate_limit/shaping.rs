//! Shaping in the layer: how many requests wait (per key and in all), and
//! what a held request gives back when it is dropped before its release.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Waker};
use std::time::Duration;

use tollgate_core::{Charge, Outcome, Reservation, Store};

/// The requests a layer holds: how many in all, and per shaped key.
#[derive(Default)]
pub(crate) struct Waiters {
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_key: HashMap<Box<str>, usize>,
}

/// The keys a request would wait on (key text, per-key limit).
pub(crate) type WaitKeys = Vec<(Box<str>, usize)>;

impl Waiters {
    /// Whether one more request could wait on each of `keys` and in the
    /// layer (`max`) now.
    pub(crate) fn has_room(&self, keys: &WaitKeys, max: usize) -> bool {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total < max
            && keys
                .iter()
                .all(|(key, limit)| counts.per_key.get(key).copied().unwrap_or(0) < *limit)
    }

    /// A place for one more request in line on each of `keys` (key text,
    /// per-key limit), if every key and the layer (`max`) have room.
    pub(crate) fn enter(self: &Arc<Self>, keys: WaitKeys, max: usize) -> Option<Place> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let full = |(key, limit): &(Box<str>, usize)| {
            counts.per_key.get(key).copied().unwrap_or(0) >= *limit
        };
        if counts.total >= max || keys.iter().any(full) {
            return None;
        }
        counts.total += 1;
        for (key, _) in &keys {
            *counts.per_key.entry(key.clone()).or_default() += 1;
        }
        Some(Place {
            waiters: self.clone(),
            keys: keys.into_iter().map(|(k, _)| k).collect(),
        })
    }
}

/// A request's place in line; left when dropped.
pub(crate) struct Place {
    waiters: Arc<Waiters>,
    keys: Vec<Box<str>>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut counts = self
            .waiters
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        counts.total -= 1;
        for key in &self.keys {
            if let Some(n) = counts.per_key.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    counts.per_key.remove(key);
                }
            }
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
