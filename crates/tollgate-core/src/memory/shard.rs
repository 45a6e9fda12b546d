//! The storage layout: per shard, a compact map of 32-byte slots for
//! states that are one count and one time, and a wide map of 48-byte slots
//! for the rest, both keyed by the keyed digest.

use std::hash::{BuildHasher, Hasher};

use hashbrown::HashMap;

use crate::algorithm::{self, State};
use crate::{Nanos, Policy};

#[derive(Default)]
pub(super) struct Shard {
    /// Token buckets and fixed windows, as (count, idle deadline): their
    /// state's time follows from the two and the policy
    /// ([`algorithm::time_from_idle`]). A 32-byte slot.
    pub(super) compact: HashMap<u128, Compact, DigestHasher>,
    /// Everything else (sliding windows, and the rare state whose deadline
    /// saturated): the whole state and its idle deadline. A 48-byte slot.
    pub(super) wide: HashMap<u128, Entry, DigestHasher>,
    pub(super) next_sweep: Nanos,
}

#[derive(Clone, Copy)]
pub(super) struct Entry {
    pub(super) state: State,
    pub(super) idle_at: Nanos,
}

#[derive(Clone, Copy)]
pub(super) struct Compact {
    level: u64,
    pub(super) idle_at: Nanos,
}

impl Compact {
    /// The compact form of `state`, if it gives `state` back exactly.
    pub(super) fn pack(policy: &Policy, state: State, idle_at: Nanos) -> Option<Self> {
        let at = algorithm::time_from_idle(policy, state.level, idle_at);
        (state.prior == 0 && at == Some(state.at)).then_some(Self {
            level: state.level,
            idle_at,
        })
    }

    /// The state packed (with the same policy: it is part of the digest).
    pub(super) fn unpack(self, policy: &Policy) -> State {
        State {
            level: self.level,
            prior: 0,
            // `pack` checked that the time is recoverable. Were it not, the
            // deadline is the conservative reading: nothing refills before it.
            at: algorithm::time_from_idle(policy, self.level, self.idle_at).unwrap_or(self.idle_at),
        }
    }
}

impl Shard {
    pub(super) fn len(&self) -> usize {
        self.compact.len() + self.wide.len()
    }

    pub(super) fn contains(&self, digest: &u128) -> bool {
        self.compact.contains_key(digest) || self.wide.contains_key(digest)
    }

    pub(super) fn state(&self, digest: &u128, policy: &Policy) -> Option<State> {
        match self.compact.get(digest) {
            Some(c) => Some(c.unpack(policy)),
            None => self.wide.get(digest).map(|e| e.state),
        }
    }

    /// Writes `state`, compactly when it packs exactly; a key is only ever
    /// in one of the two maps.
    pub(super) fn put(&mut self, digest: u128, policy: &Policy, state: State, idle_at: Nanos) {
        match Compact::pack(policy, state, idle_at) {
            Some(c) => {
                self.compact.insert(digest, c);
                if !self.wide.is_empty() {
                    self.wide.remove(&digest);
                }
            }
            None => {
                self.wide.insert(digest, Entry { state, idle_at });
                if !self.compact.is_empty() {
                    self.compact.remove(&digest);
                }
            }
        }
    }
}

/// The map key is already a keyed digest: hashing it again would be waste.
#[derive(Clone, Copy, Default)]
pub(super) struct DigestHasher;

impl BuildHasher for DigestHasher {
    type Hasher = DigestBits;
    fn build_hasher(&self) -> DigestBits {
        DigestBits(0)
    }
}

#[derive(Default)]
pub(super) struct DigestBits(u64);

impl Hasher for DigestBits {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached if something other than a u128 is hashed.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}
