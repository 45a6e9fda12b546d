//! Time sources: a monotonic [`SystemClock`] and a [`ManualClock`] for tests.
//!
//! Every algorithm in this crate works on [`Nanos`], integer nanoseconds since
//! an arbitrary origin chosen by the clock. Only differences are meaningful, so
//! a timestamp from one clock must never be compared with another clock's.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Integer nanoseconds: a reading of a clock since that clock's own origin,
/// or a span between two readings. An alias, not a newtype: the algorithms
/// do their exact arithmetic on it as a `u64` (spans of `Duration` are
/// converted at the edges), and every time-valued number in this crate's
/// API is written `Nanos` so that it reads as one.
pub type Nanos = u64;

/// A source of elapsed time.
///
/// Implementations should be monotonic. The algorithms do not rely on it: a
/// reading earlier than one already used never mints credit and never moves
/// accounting backwards.
pub trait Clock: Send + Sync + 'static {
    /// The current time in nanoseconds since this clock's origin.
    fn now(&self) -> Nanos;
}

/// The process's monotonic clock, with its origin at construction.
///
/// It reads the CPU's time-stamp counter through `quanta` where that is
/// reliable (a few nanoseconds), and falls back to the operating system's
/// monotonic clock otherwise. Should a reading ever step back, the
/// algorithms clamp it: no credit is minted.
#[derive(Debug, Clone)]
pub struct SystemClock {
    clock: quanta::Clock,
    /// The origin, as the clock source's raw reading.
    origin: u64,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> Nanos {
        // One raw reading scaled straight to nanoseconds since the origin
        // (u64 nanoseconds last 584 years of process uptime); a reading at
        // or before the origin is 0.
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

/// A clock that moves only when told to; clones share one reading.
///
/// It can be moved backwards ([`ManualClock::set`]) to test that budgets
/// survive a clock stepping back.
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `start` nanoseconds.
    pub fn new(start: Nanos) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start)),
        }
    }

    /// Sets the reading, forwards or backwards.
    pub fn set(&self, now: Nanos) {
        self.now.store(now, Ordering::SeqCst);
    }

    /// Moves the reading forwards by `by` (saturating).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .now
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(by))
            });
    }

    /// Moves the reading backwards by `by` (saturating at zero).
    pub fn rewind(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .now
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_sub(by))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_both_ways_and_is_shared_by_clones() {
        let clock = ManualClock::new(10);
        let other = clock.clone();
        clock.advance(Duration::from_nanos(5));
        assert_eq!(other.now(), 15);
        other.rewind(Duration::from_nanos(20));
        assert_eq!(clock.now(), 0);
        clock.set(7);
        assert_eq!(other.now(), 7);
    }

    #[test]
    fn system_clock_does_not_go_backwards() {
        let clock = SystemClock::new();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
    }
}
