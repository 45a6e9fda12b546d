//! A simulated backend that slows down under load: processor sharing with
//! a capacity. Each request brings some work (the time it takes alone);
//! while `n` requests are in it, each progresses at
//! `capacity / max(n, capacity)` of full speed. So up to `capacity` at
//! once cost nothing extra, and beyond that every request in it slows
//! down alike, as a database or a CPU pool does.
//!
//! Exact in integer nanoseconds on tokio's clock (so paused time drives
//! it): one task finishes jobs when their work is done and sleeps until
//! the next one would be.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

/// A processor-sharing backend; clones share it.
#[derive(Clone, Debug)]
pub(crate) struct ProcessorSharing {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the task that finishes jobs: one arrived.
    arrived: Notify,
}

#[derive(Debug)]
struct State {
    capacity: u64,
    jobs: Vec<Job>,
    /// Until when the jobs' progress is accounted.
    at: Instant,
}

#[derive(Debug)]
struct Job {
    /// Nanoseconds of work left at full speed.
    left: u64,
    done: oneshot::Sender<()>,
}

impl State {
    /// Accounts the jobs' progress up to `now`.
    fn advance(&mut self, now: Instant) {
        let elapsed =
            u64::try_from(now.saturating_duration_since(self.at).as_nanos()).unwrap_or(u64::MAX);
        self.at = now;
        let n = u64::try_from(self.jobs.len()).unwrap_or(u64::MAX);
        if n == 0 {
            return;
        }
        let share = n.max(self.capacity);
        let progress =
            u64::try_from(u128::from(elapsed) * u128::from(self.capacity) / u128::from(share))
                .unwrap_or(u64::MAX);
        for job in &mut self.jobs {
            job.left = job.left.saturating_sub(progress);
        }
    }

    /// Finishes the jobs with no work left; how long until the next one
    /// will be done, if any is left.
    fn finish(&mut self) -> Option<Duration> {
        let mut i = 0;
        while i < self.jobs.len() {
            if self.jobs[i].left == 0 {
                let _ = self.jobs.swap_remove(i).done.send(());
            } else {
                i += 1;
            }
        }
        let least = self.jobs.iter().map(|j| j.left).min()?;
        let n = u64::try_from(self.jobs.len()).unwrap_or(u64::MAX);
        let share = n.max(self.capacity);
        // Wall time for `least` of work at this speed, rounded up.
        let wall = (u128::from(least) * u128::from(share)).div_ceil(u128::from(self.capacity));
        Some(Duration::from_nanos(
            u64::try_from(wall).unwrap_or(u64::MAX),
        ))
    }
}

impl ProcessorSharing {
    /// A backend serving up to `capacity` requests (at least 1) at full
    /// speed. Starts its task on the current tokio runtime.
    pub(crate) fn new(capacity: u64) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                capacity: capacity.max(1),
                jobs: Vec::new(),
                at: Instant::now(),
            }),
            arrived: Notify::new(),
        });
        tokio::spawn(run(shared.clone()));
        Self { shared }
    }

    /// Changes the capacity from now on (the capacity-step benchmark; the
    /// quickstart does not).
    #[allow(dead_code)]
    pub(crate) fn set_capacity(&self, capacity: u64) {
        let mut state = self.lock();
        state.advance(Instant::now());
        state.capacity = capacity.max(1);
        drop(state);
        self.shared.arrived.notify_one();
    }

    /// Does `work` (the time it takes alone) here: returns when it is
    /// done. A request dropped before then leaves the backend then too.
    pub(crate) async fn serve(&self, work: Duration) {
        let (done, finished) = oneshot::channel();
        {
            let mut state = self.lock();
            state.advance(Instant::now());
            state.jobs.push(Job {
                left: u64::try_from(work.as_nanos()).unwrap_or(u64::MAX).max(1),
                done,
            });
        }
        self.shared.arrived.notify_one();
        let _ = finished.await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Finishes jobs as their work is done, until every handle on the backend
/// is dropped (noticed within a second of idling).
async fn run(shared: Arc<Shared>) {
    loop {
        let next = {
            let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
            state.advance(Instant::now());
            // Jobs whose requests were dropped leave too.
            state.jobs.retain(|j| !j.done.is_closed());
            state.finish()
        };
        if next.is_none() && Arc::strong_count(&shared) == 1 {
            return;
        }
        let wait = next.unwrap_or(Duration::from_secs(1));
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shared.arrived.notified() => {}
        }
    }
}
