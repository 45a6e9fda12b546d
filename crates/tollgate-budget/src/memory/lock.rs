//! The shards' lock: one atomic operation to take it, a plain store to give
//! it back.
//!
//! A shard is held for one decision: a hash probe and a few words of
//! arithmetic, tens of nanoseconds. A general mutex pays a second locked
//! instruction to release (parking_lot's compares and swaps, so that it can
//! wake a parked waiter), a fifth of a hot key's decision. This lock
//! releases with a store, so it cannot wake anyone: a waiter spins, then
//! yields its time slice, then sleeps in short naps until the shard is
//! free. A shard is held longer only to grow its table or sweep idle
//! entries (at most about a hundred microseconds at millions of keys),
//! which the naps cover without burning a core.

// The one module of the crate with `unsafe`: a lock hands out `&mut` to
// what it guards, which needs `unsafe impl` of `lock_api::RawMutex`
// (lock_api builds the guard and the data cell on it, safely).
#![allow(unsafe_code)]

use std::hint::spin_loop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

/// A mutex over `T` on [`RawShardLock`].
pub(super) type ShardMutex<T> = lock_api::Mutex<RawShardLock, T>;
/// Its guard.
pub(super) type ShardGuard<'a, T> = lock_api::MutexGuard<'a, RawShardLock, T>;

/// Spins of the waiting loop before it yields (doubling from one pause).
const SPIN_ROUNDS: u32 = 6;
/// Yields before it naps.
const YIELD_ROUNDS: u32 = 10;
/// One nap: long next to a decision, short next to a sweep.
const NAP: Duration = Duration::from_micros(20);

/// Taken by a compare-and-swap, released by a store.
#[derive(Debug)]
pub(super) struct RawShardLock {
    locked: AtomicBool,
}

// SAFETY: `lock` and `try_lock` return only after they changed `locked`
// from `false` to `true` (acquire ordering), and `unlock` (called only by
// the holder, as the trait requires) stores `false` with release ordering:
// one holder at a time, and each holder sees the writes of the one before.
unsafe impl lock_api::RawMutex for RawShardLock {
    const INIT: Self = Self {
        locked: AtomicBool::new(false),
    };

    // A guard may be dropped on another thread: nothing here is per thread.
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if !self.try_lock_weak() {
            self.lock_contended();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }
}

impl RawShardLock {
    #[inline]
    fn try_lock_weak(&self) -> bool {
        self.locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    #[cold]
    fn lock_contended(&self) {
        let mut round = 0;
        loop {
            // Wait by reading: the line stays shared until the holder's
            // store, instead of bouncing between waiters' failed swaps.
            while self.locked.load(Ordering::Relaxed) {
                wait(round);
                round = round.saturating_add(1);
            }
            if self.try_lock_weak() {
                return;
            }
        }
    }
}

/// One round of waiting: a growing spin, then yields, then naps.
fn wait(round: u32) {
    if round < SPIN_ROUNDS {
        for _ in 0..1u32 << round {
            spin_loop();
        }
    } else if round < SPIN_ROUNDS + YIELD_ROUNDS {
        thread::yield_now();
    } else {
        thread::sleep(NAP);
    }
}

#[cfg(test)]
mod tests {
    use super::ShardMutex;
    use std::sync::Arc;
    use std::thread;
    use std::time::Duration;

    /// Holders exclude each other: four threads (more than CI's cores, so
    /// holders are preempted and waiters reach the yields and naps) each
    /// flag the shard as held, check nobody else had, and increment a
    /// plain counter in two steps. A lock that let two in would trip the
    /// flag or lose increments.
    #[test]
    fn holders_exclude_each_other() {
        const THREADS: u64 = 4;
        const ROUNDS: u64 = 50_000;
        let shard = Arc::new(ShardMutex::new((0u64, false)));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let shard = Arc::clone(&shard);
                thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        let mut held = shard.lock();
                        assert!(!held.1, "two holders at once");
                        held.1 = true;
                        let count = held.0;
                        std::hint::spin_loop();
                        held.0 = count + 1;
                        held.1 = false;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a holder panicked");
        }
        assert_eq!(shard.lock().0, THREADS * ROUNDS);
    }

    /// A waiter behind a long hold (a table growing, a sweep) waits for as
    /// long as it lasts, napping, and gets the shard once it is given back.
    #[test]
    fn a_waiter_gets_the_shard_after_a_long_hold() {
        let shard = Arc::new(ShardMutex::new(0u32));
        let held = shard.lock();
        let waiter = {
            let shard = Arc::clone(&shard);
            thread::spawn(move || *shard.lock() += 1)
        };
        // Long enough for the waiter to pass its spins and yields.
        thread::sleep(Duration::from_millis(20));
        assert!(shard.try_lock().is_none());
        assert!(!waiter.is_finished(), "the waiter got in while held");
        drop(held);
        waiter.join().expect("the waiter panicked");
        assert_eq!(*shard.lock(), 1);
    }

    /// A panic while held releases the shard (no poisoning).
    #[test]
    fn a_panic_while_held_releases_the_shard() {
        let shard = Arc::new(ShardMutex::new(0u32));
        let panicked = {
            let shard = Arc::clone(&shard);
            thread::spawn(move || {
                let _held = shard.lock();
                panic!("while held");
            })
            .join()
        };
        assert!(panicked.is_err());
        *shard.try_lock().expect("released by the unwind") += 1;
        assert_eq!(*shard.lock(), 1);
    }
}
