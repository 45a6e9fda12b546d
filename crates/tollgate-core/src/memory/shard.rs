//! The storage layout: per shard, a table of 32-byte slots for states that
//! are one count and one time, and a table of 48-byte slots for the rest.
//!
//! A slot's key is the keyed digest of (policy name and unit, key text)
//! with its top [`TAG_BITS`] bits replaced by the *tag* of the numbers the
//! state was written under ([`super::numbers`]): a key has one slot
//! whatever numbers its policy has had, and a reader whose numbers differ
//! converts the state ([`algorithm::carry_over`]). Lookups compare the
//! digest bits only.

use hashbrown::HashTable;

use crate::algorithm::{self, State};
use crate::{Algorithm, Nanos};

/// Bits of a slot key that tag the state's numbers.
pub(super) const TAG_BITS: u32 = 24;
const TAG_SHIFT: u32 = 128 - TAG_BITS;
/// The bits of a slot key that identify the budget: 104 bits of digest.
pub(super) const ID_MASK: u128 = (1 << TAG_SHIFT) - 1;

/// Where a key's slot is placed in its table: the digest's lower half,
/// itself a keyed hash.
fn place(id: u128) -> u64 {
    id as u64
}

fn tagged(id: u128, tag: u32) -> u128 {
    id | u128::from(tag) << TAG_SHIFT
}

fn tag_of(key: u128) -> u32 {
    (key >> TAG_SHIFT) as u32
}

#[derive(Default)]
pub(super) struct Shard {
    /// Token buckets and fixed windows, as (count, idle deadline): their
    /// state's time follows from the two and the numbers
    /// ([`algorithm::time_from_idle`]).
    pub(super) compact: HashTable<Compact>,
    /// Everything else (sliding windows, and the rare state whose deadline
    /// saturated): the whole state and its idle deadline.
    pub(super) wide: HashTable<Wide>,
    pub(super) next_sweep: Nanos,
}

/// A 32-byte slot.
#[derive(Clone, Copy)]
pub(super) struct Compact {
    key: u128,
    level: u64,
    pub(super) idle_at: Nanos,
}

/// A 48-byte slot.
#[derive(Clone, Copy)]
pub(super) struct Wide {
    key: u128,
    state: State,
    pub(super) idle_at: Nanos,
}

/// A state as read from its slot, with the tag of its numbers.
#[derive(Clone, Copy)]
pub(super) struct Stored {
    pub(super) tag: u32,
    /// The state's count (or credit) and, for wide slots, the whole state:
    /// decoded by [`Stored::state`] with the numbers of its tag.
    raw: Raw,
}

#[derive(Clone, Copy)]
enum Raw {
    Compact { level: u64, idle_at: Nanos },
    Wide(State),
}

impl Stored {
    /// The state, decoded with `algorithm`, the numbers of its own tag.
    pub(super) fn state(self, algorithm: &Algorithm) -> State {
        match self.raw {
            Raw::Wide(state) => state,
            Raw::Compact { level, idle_at } => unpack(algorithm, level, idle_at),
        }
    }
}

/// A compact slot's state, with the numbers it was written under.
fn unpack(algorithm: &Algorithm, level: u64, idle_at: Nanos) -> State {
    State {
        level,
        prior: 0,
        // `pack` checked that the time is recoverable. Were it not, the
        // deadline is the conservative reading: nothing refills before it.
        at: algorithm::time_from_idle(algorithm, level, idle_at).unwrap_or(idle_at),
    }
}

impl Compact {
    /// The compact form of `state`, if it gives `state` back exactly.
    fn pack(key: u128, algorithm: &Algorithm, state: State, idle_at: Nanos) -> Option<Self> {
        let at = algorithm::time_from_idle(algorithm, state.level, idle_at);
        (state.prior == 0 && at == Some(state.at)).then_some(Self {
            key,
            level: state.level,
            idle_at,
        })
    }
}

impl Shard {
    pub(super) fn len(&self) -> usize {
        self.compact.len() + self.wide.len()
    }

    pub(super) fn contains(&self, id: u128) -> bool {
        let same = |key: u128| key & ID_MASK == id;
        self.compact.find(place(id), |c| same(c.key)).is_some()
            || self.wide.find(place(id), |w| same(w.key)).is_some()
    }

    /// What is stored for the budget `id`, whatever its numbers.
    pub(super) fn read(&self, id: u128) -> Option<Stored> {
        let same = |key: u128| key & ID_MASK == id;
        if let Some(c) = self.compact.find(place(id), |c| same(c.key)) {
            return Some(Stored {
                tag: tag_of(c.key),
                raw: Raw::Compact {
                    level: c.level,
                    idle_at: c.idle_at,
                },
            });
        }
        if self.wide.is_empty() {
            return None;
        }
        self.wide.find(place(id), |w| same(w.key)).map(|w| Stored {
            tag: tag_of(w.key),
            raw: Raw::Wide(w.state),
        })
    }

    /// The compact slot of `id`, when it holds a state written under the
    /// numbers `tag`: for deciding and writing in place, one probe.
    pub(super) fn compact_mut(&mut self, id: u128, tag: u32) -> Option<CompactMut<'_>> {
        let key = tagged(id, tag);
        self.compact
            .find_mut(place(id), |c| c.key & ID_MASK == id)
            .filter(|c| c.key == key)
            .map(|slot| CompactMut { slot })
    }

    /// Writes `state` for `id` under the numbers `tag` (`algorithm`),
    /// compactly when it packs exactly; a budget is only ever in one of
    /// the two tables, once.
    pub(super) fn put(
        &mut self,
        id: u128,
        tag: u32,
        algorithm: &Algorithm,
        state: State,
        idle_at: Nanos,
    ) {
        let key = tagged(id, tag);
        let same = |k: u128| k & ID_MASK == id;
        match Compact::pack(key, algorithm, state, idle_at) {
            Some(c) => {
                match self.compact.find_mut(place(id), |s| same(s.key)) {
                    Some(slot) => *slot = c,
                    None => {
                        self.compact.insert_unique(place(id), c, |s| place(s.key));
                    }
                }
                if !self.wide.is_empty() {
                    self.remove_wide(id);
                }
            }
            None => {
                let w = Wide {
                    key,
                    state,
                    idle_at,
                };
                match self.wide.find_mut(place(id), |s| same(s.key)) {
                    Some(slot) => *slot = w,
                    None => {
                        self.wide.insert_unique(place(id), w, |s| place(s.key));
                    }
                }
                if !self.compact.is_empty() {
                    self.remove_compact(id);
                }
            }
        }
    }

    /// Drops what is stored for `id`; whether anything was.
    pub(super) fn remove(&mut self, id: u128) -> bool {
        self.remove_compact(id) | self.remove_wide(id)
    }

    fn remove_compact(&mut self, id: u128) -> bool {
        match self
            .compact
            .find_entry(place(id), |s| s.key & ID_MASK == id)
        {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    fn remove_wide(&mut self, id: u128) -> bool {
        match self.wide.find_entry(place(id), |s| s.key & ID_MASK == id) {
            Ok(entry) => {
                entry.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Drops every entry idle at `now`; how many.
    pub(super) fn drop_idle(&mut self, now: Nanos) -> usize {
        let before = self.len();
        self.compact.retain(|c| c.idle_at > now);
        self.wide.retain(|w| w.idle_at > now);
        if self.compact.capacity() > 64 && self.compact.capacity() > 4 * self.compact.len() {
            self.compact.shrink_to_fit(|s| place(s.key));
        }
        if self.wide.capacity() > 64 && self.wide.capacity() > 4 * self.wide.len() {
            self.wide.shrink_to_fit(|s| place(s.key));
        }
        before - self.len()
    }

    /// Every entry's budget and idle deadline.
    pub(super) fn deadlines(&self) -> impl Iterator<Item = (u128, Nanos)> + '_ {
        let compact = self.compact.iter().map(|c| (c.key & ID_MASK, c.idle_at));
        let wide = self.wide.iter().map(|w| (w.key & ID_MASK, w.idle_at));
        compact.chain(wide)
    }
}

/// A compact slot whose numbers are the reader's own.
pub(super) struct CompactMut<'a> {
    slot: &'a mut Compact,
}

impl CompactMut<'_> {
    pub(super) fn state(&self, algorithm: &Algorithm) -> State {
        unpack(algorithm, self.slot.level, self.slot.idle_at)
    }

    /// Writes `state` in place when it packs exactly; `false` when it must
    /// move to the wide table ([`Shard::put`]).
    pub(super) fn set(&mut self, algorithm: &Algorithm, state: State, idle_at: Nanos) -> bool {
        match Compact::pack(self.slot.key, algorithm, state, idle_at) {
            Some(packed) => {
                *self.slot = packed;
                true
            }
            None => false,
        }
    }
}
