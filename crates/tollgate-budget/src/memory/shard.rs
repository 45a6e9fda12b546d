//! The storage layout: per shard, per space (a policy's name, unit and
//! numbers, [`super::spaces`]), one table per kind of key, each with
//! compact slots for states that are one count and one time (token
//! buckets, fixed windows, a sliding window with nothing in its previous
//! window) and wide slots for the rest.
//!
//! Slot keys are exact where they can be: an IPv4 client address is its 32
//! bits and an IPv6 one its 128 bits, so two addresses never share a
//! budget; any other key is the keyed 128-bit digest of its text. A key's
//! bits are kept as 32-bit words so that a slot is aligned to 4 bytes: an
//! IPv4 token bucket's slot is 20 bytes (4 of address, 8 of count, 8 of
//! time), a 128-bit key's 32. A slot holds no deadline: when a state goes
//! idle follows from it and its space's numbers, and is computed only when
//! a shard is swept or a key must be evicted.
//!
//! The space is the table, not part of the slot: a key has one slot per
//! space it was charged under, and a reader whose numbers differ finds the
//! state in a sibling space (the same name and unit) and converts it
//! ([`algorithm::carry_over`]), moving it to its own.

use std::sync::Arc;

use hashbrown::HashTable;

use crate::algorithm::{self, State};
use crate::{Algorithm, Decision, Nanos, Policy};

/// A slot's key: 32-bit words (one for IPv4, four otherwise).
pub(super) trait Words: Copy + Eq {}
impl Words for [u32; 1] {}
impl Words for [u32; 4] {}

/// The key of a budget in one shard: its space, and its key's bits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Id {
    pub(super) space: u32,
    pub(super) key: KeyBits,
    /// Where the key's slot is placed in its table (and, high bits, its
    /// shard): a keyed hash of the key's bits, whatever the space.
    pub(super) hash: u64,
}

/// A key's bits, by kind.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum KeyBits {
    V4([u32; 1]),
    V6([u32; 4]),
    /// The keyed digest of the key's text.
    Text([u32; 4]),
}

impl KeyBits {
    pub(super) fn words128(v: u128) -> [u32; 4] {
        [
            v as u32,
            (v >> 32) as u32,
            (v >> 64) as u32,
            (v >> 96) as u32,
        ]
    }

    pub(super) fn from_words(w: [u32; 4]) -> u128 {
        u128::from(w[0]) | u128::from(w[1]) << 32 | u128::from(w[2]) << 64 | u128::from(w[3]) << 96
    }
}

/// A compact slot: a state whose `prior` and `reserved` are 0 (a count or
/// credit, and its time). Packed to the key's 4-byte alignment (a 20-byte slot for an
/// IPv4 key); the counts are read and written whole, as 8-byte values, so
/// that a read right after a write is forwarded from the write (two 4-byte
/// halves read back as one 8-byte value stall the load).
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
pub(super) struct Compact<W> {
    key: W,
    level: u64,
    at: u64,
}

/// A wide slot: a state with a `prior` (a sliding window's previous
/// count, a token bucket's hold) and nothing reserved.
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
pub(super) struct Wide<W> {
    key: W,
    level: u64,
    prior: u64,
    at: u64,
}

/// A reserving slot: the whole state, for a token bucket with units
/// reserved (few keys, for a short time).
#[derive(Clone, Copy)]
#[repr(C, packed(4))]
pub(super) struct Reserving<W> {
    key: W,
    state: [u64; 6],
}

impl<W: Copy> Compact<W> {
    #[inline]
    fn key(&self) -> W {
        self.key
    }

    #[inline]
    fn state(&self) -> State {
        State {
            level: self.level,
            at: self.at,
            ..State::default()
        }
    }

    /// The compact form of `state`, if it has one (`prior` and
    /// `reserved` are 0).
    #[inline]
    fn pack(key: W, state: State) -> Option<Self> {
        (state.prior == 0 && state.reserved == 0 && state.reserved_earlier == 0).then_some(Self {
            key,
            level: state.level,
            at: state.at,
        })
    }
}

impl<W: Copy> Wide<W> {
    #[inline]
    fn key(&self) -> W {
        self.key
    }

    fn new(key: W, state: State) -> Self {
        Self {
            key,
            level: state.level,
            prior: state.prior,
            at: state.at,
        }
    }

    fn state(&self) -> State {
        State {
            level: self.level,
            prior: self.prior,
            at: self.at,
            ..State::default()
        }
    }
}

impl<W: Copy> Reserving<W> {
    fn key(&self) -> W {
        self.key
    }

    fn new(key: W, s: State) -> Self {
        Self {
            key,
            state: [
                s.level,
                s.prior,
                s.at,
                s.reserved,
                s.reserved_earlier,
                s.epoch,
            ],
        }
    }

    fn state(&self) -> State {
        let [level, prior, at, reserved, reserved_earlier, epoch] = self.state;
        State {
            level,
            prior,
            at,
            reserved,
            reserved_earlier,
            epoch,
        }
    }
}

/// One kind of key's slots in one space of one shard. A key is in one of
/// its three tables, once: the narrowest its state fits.
pub(super) struct Table<W> {
    compact: HashTable<Compact<W>>,
    wide: HashTable<Wide<W>>,
    reserving: HashTable<Reserving<W>>,
}

impl<W> Default for Table<W> {
    fn default() -> Self {
        Self {
            compact: HashTable::new(),
            wide: HashTable::new(),
            reserving: HashTable::new(),
        }
    }
}

/// Which table a state goes to.
enum Width {
    Compact,
    Wide,
    Reserving,
}

fn width(state: &State) -> Width {
    if state.reserved != 0 || state.reserved_earlier != 0 {
        Width::Reserving
    } else if state.prior != 0 {
        Width::Wide
    } else {
        Width::Compact
    }
}

/// Puts `slot` for `key` in `table`, replacing its slot there if any.
fn put_in<S>(
    table: &mut HashTable<S>,
    hash: u64,
    slot: S,
    same: impl Fn(&S) -> bool,
    rehash: impl Fn(&S) -> u64,
) {
    match table.find_mut(hash, same) {
        Some(old) => *old = slot,
        None => {
            table.insert_unique(hash, slot, rehash);
        }
    }
}

/// Removes `key`'s slot from `table`; whether there was one.
fn remove_from<S>(table: &mut HashTable<S>, hash: u64, same: impl Fn(&S) -> bool) -> bool {
    if table.is_empty() {
        return false;
    }
    match table.find_entry(hash, same) {
        Ok(entry) => {
            entry.remove();
            true
        }
        Err(_) => false,
    }
}

/// Drops the slots of `table` idle at `now`, and gives back room.
fn retain_busy<S>(table: &mut HashTable<S>, busy: impl Fn(&S) -> bool, rehash: impl Fn(&S) -> u64) {
    table.retain(|s| busy(s));
    if table.capacity() > 64 && table.capacity() > 4 * table.len() {
        table.shrink_to_fit(rehash);
    }
}

impl<W: Words> Table<W> {
    fn len(&self) -> usize {
        self.compact.len() + self.wide.len() + self.reserving.len()
    }

    fn read(&self, key: W, hash: u64) -> Option<State> {
        if let Some(c) = self.compact.find(hash, |c| c.key() == key) {
            return Some(c.state());
        }
        if !self.wide.is_empty()
            && let Some(w) = self.wide.find(hash, |w| w.key() == key)
        {
            return Some(w.state());
        }
        if self.reserving.is_empty() {
            return None;
        }
        self.reserving
            .find(hash, |r| r.key() == key)
            .map(Reserving::state)
    }

    fn put(&mut self, key: W, hash: u64, state: State, rehash: impl Fn(&W) -> u64) {
        let width = width(&state);
        match Compact::pack(key, state) {
            Some(c) => put_in(
                &mut self.compact,
                hash,
                c,
                |s| s.key() == key,
                |s| rehash(&s.key()),
            ),
            None if matches!(width, Width::Wide) => put_in(
                &mut self.wide,
                hash,
                Wide::new(key, state),
                |s| s.key() == key,
                |s| rehash(&s.key()),
            ),
            None => put_in(
                &mut self.reserving,
                hash,
                Reserving::new(key, state),
                |s| s.key() == key,
                |s| rehash(&s.key()),
            ),
        }
        if !matches!(width, Width::Compact) && !self.compact.is_empty() {
            remove_from(&mut self.compact, hash, |s| s.key() == key);
        }
        if !matches!(width, Width::Wide) {
            remove_from(&mut self.wide, hash, |s| s.key() == key);
        }
        if !matches!(width, Width::Reserving) {
            remove_from(&mut self.reserving, hash, |s| s.key() == key);
        }
    }

    fn remove(&mut self, key: W, hash: u64) -> bool {
        remove_from(&mut self.compact, hash, |s| s.key() == key)
            | remove_from(&mut self.wide, hash, |s| s.key() == key)
            | remove_from(&mut self.reserving, hash, |s| s.key() == key)
    }

    /// Drops every entry whose state is idle at `now` (by `idle_at`).
    fn drop_idle(
        &mut self,
        now: Nanos,
        idle_at: &impl Fn(State) -> Nanos,
        rehash: impl Fn(&W) -> u64,
    ) {
        retain_busy(
            &mut self.compact,
            |c| idle_at(c.state()) > now,
            |s| rehash(&s.key()),
        );
        retain_busy(
            &mut self.wide,
            |w| idle_at(w.state()) > now,
            |s| rehash(&s.key()),
        );
        retain_busy(
            &mut self.reserving,
            |r| idle_at(r.state()) > now,
            |s| rehash(&s.key()),
        );
    }

    fn states(&self) -> impl Iterator<Item = (W, State)> + '_ {
        let compact = self.compact.iter().map(|c| (c.key(), c.state()));
        let wide = self.wide.iter().map(|w| (w.key(), w.state()));
        let reserving = self.reserving.iter().map(|r| (r.key(), r.state()));
        compact.chain(wide).chain(reserving)
    }
}

/// The tables of one space in one shard, with the space's siblings as
/// this shard last saw them.
#[derive(Default)]
pub(super) struct SpaceTables {
    v4: Table<[u32; 1]>,
    v6: Table<[u32; 4]>,
    text: Table<[u32; 4]>,
    /// The spaces of this space's name and unit (itself included), where
    /// a key's state may have been written under other numbers; `None`
    /// until loaded (and again when the spaces changed). One list per
    /// name and unit, shared by its spaces in every shard: a copy per
    /// space and shard would grow with the square of the spaces (a rule
    /// with many account overrides has as many).
    pub(super) siblings: Option<Arc<[u32]>>,
}

impl SpaceTables {
    fn len(&self) -> usize {
        self.v4.len() + self.v6.len() + self.text.len()
    }

    /// Drops every entry idle at `now` under the space's `numbers` (every
    /// space with entries was given by the store); how many are left.
    fn drop_idle<H: Rehash>(
        &mut self,
        now: Nanos,
        hashes: &H,
        numbers: Option<Algorithm>,
    ) -> usize {
        if let Some(numbers) = numbers.filter(|_| self.len() > 0) {
            let idle_at = |s: State| algorithm::idle_since(&numbers, s);
            self.v4.drop_idle(now, &idle_at, |k| hashes.v4(k));
            self.v6.drop_idle(now, &idle_at, |k| hashes.v6(k));
            self.text.drop_idle(now, &idle_at, <H as Rehash>::text);
        }
        self.len()
    }
}

/// How the slot placement of a key's bits is recomputed when a table
/// grows: the store's keyed hashes.
pub(super) trait Rehash {
    fn v4(&self, key: &[u32; 1]) -> u64;
    fn v6(&self, key: &[u32; 4]) -> u64;
    /// A digest's placement is its own lower half.
    fn text(key: &[u32; 4]) -> u64 {
        u64::from(key[0]) | u64::from(key[1]) << 32
    }
}

pub(super) struct Shard {
    /// The space whose tables are [`first`](Self::first), or [`NO_SPACE`].
    first_space: u32,
    /// The tables of the first space to touch this shard (to write, or to
    /// load its siblings for a read), inline: a key of a store with one
    /// policy is then two loads from its locked shard (the table, its
    /// slot) instead of four (the list of spaces, the space's box); so is
    /// a store's busiest policy when it came first. Emptied by a sweep,
    /// they go to the next space that touches the shard.
    first: SpaceTables,
    /// Every other space's tables, indexed by space id; grown when a space
    /// first writes here. Boxed: a store may meet thousands of spaces (one
    /// per distinct override's numbers), each shard only some of them, and
    /// an unused index costs a pointer rather than a space's six empty
    /// tables (304 bytes). A space left empty by a sweep is freed.
    spaces: Vec<Option<Box<SpaceTables>>>,
    /// Entries in all tables.
    len: usize,
    /// The spaces' generation the siblings above were copied at.
    pub(super) generation: u64,
    pub(super) next_sweep: Nanos,
}

/// Dispatches `$body` on the table of `$id`'s kind in `$tables`, with
/// `$key` bound to the key's words and `$rehash` to its placement.
macro_rules! on_table {
    ($tables:expr, $id:expr, $hashes:expr, |$t:ident, $key:ident, $rehash:ident| $body:expr) => {
        match $id.key {
            KeyBits::V4($key) => {
                let $t = &mut $tables.v4;
                let $rehash = |k: &[u32; 1]| $hashes.v4(k);
                $body
            }
            KeyBits::V6($key) => {
                let $t = &mut $tables.v6;
                let $rehash = |k: &[u32; 4]| $hashes.v6(k);
                $body
            }
            KeyBits::Text($key) => {
                let $t = &mut $tables.text;
                let $rehash = |k: &[u32; 4]| <H as Rehash>::text(k);
                $body
            }
        }
    };
}

/// What `t` holds for `id`'s key, whatever `id`'s space.
fn read_in(t: &SpaceTables, id: &Id) -> Option<State> {
    match id.key {
        KeyBits::V4(k) => t.v4.read(k, id.hash),
        KeyBits::V6(k) => t.v6.read(k, id.hash),
        KeyBits::Text(k) => t.text.read(k, id.hash),
    }
}

/// [`Shard::first_space`] when no space holds the inline tables. Space ids
/// are below 2^24 ([`super::spaces`]).
const NO_SPACE: u32 = u32::MAX;

impl Default for Shard {
    fn default() -> Self {
        Self {
            first_space: NO_SPACE,
            first: SpaceTables::default(),
            spaces: Vec::new(),
            len: 0,
            generation: 0,
            next_sweep: 0,
        }
    }
}

impl Shard {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    fn tables(&self, space: u32) -> Option<&SpaceTables> {
        if space == self.first_space {
            return Some(&self.first);
        }
        self.spaces.get(space as usize)?.as_deref()
    }

    #[inline(always)]
    fn tables_if_any(&mut self, space: u32) -> Option<&mut SpaceTables> {
        if space == self.first_space {
            return Some(&mut self.first);
        }
        self.spaces.get_mut(space as usize)?.as_deref_mut()
    }

    /// The tables of `space`, made if this shard has none yet (inline if
    /// no space has the inline ones).
    pub(super) fn tables_mut(&mut self, space: u32) -> &mut SpaceTables {
        if space == self.first_space {
            return &mut self.first;
        }
        let i = space as usize;
        let boxed = self.spaces.get(i).is_some_and(Option::is_some);
        if self.first_space == NO_SPACE && !boxed {
            self.first_space = space;
            return &mut self.first;
        }
        if i >= self.spaces.len() {
            self.spaces.resize_with(i + 1, || None);
        }
        self.spaces[i].get_or_insert_with(Box::default)
    }

    /// Every space's tables, with the space: the inline ones first.
    fn all_tables(&self) -> impl Iterator<Item = (u32, &SpaceTables)> + '_ {
        let first = (self.first_space != NO_SPACE).then_some((self.first_space, &self.first));
        let boxed = self.spaces.iter().enumerate();
        first
            .into_iter()
            .chain(boxed.filter_map(|(space, t)| Some((u32::try_from(space).ok()?, t.as_deref()?))))
    }

    /// The `i`th space of `space`'s name and unit, as loaded: `space`
    /// itself among them.
    pub(super) fn sibling(&self, space: u32, i: usize) -> Option<u32> {
        self.tables(space)?.siblings.as_deref()?.get(i).copied()
    }

    /// Forgets every space's siblings (the spaces changed): they are
    /// loaded again when next needed.
    pub(super) fn forget_siblings(&mut self) {
        self.first.siblings = None;
        for t in self.spaces.iter_mut().flatten() {
            t.siblings = None;
        }
    }

    pub(super) fn contains(&self, id: &Id) -> bool {
        self.read(id).is_some()
    }

    /// What is stored for `id` in its own space.
    pub(super) fn read(&self, id: &Id) -> Option<State> {
        read_in(self.tables(id.space)?, id)
    }

    /// How many spaces hold an entry for `id`'s key: its own and its
    /// siblings' (a key written under other numbers before a plan switch).
    pub(super) fn holders_of(&self, id: &Id) -> usize {
        self.all_tables()
            .filter(|(_, t)| read_in(t, id).is_some())
            .count()
    }

    /// Decides `cost` against `id`'s compact slot in place, when the slot
    /// is there and the new state is compact too: one probe. `None` when
    /// the caller must take the general path (no compact slot, or the new
    /// state must move to the wide table): nothing was changed then. The
    /// cost fits the policy (the caller checked).
    #[inline(always)]
    pub(super) fn decide_in_place(
        &mut self,
        id: &Id,
        policy: &Policy,
        now: Nanos,
        cost: u64,
    ) -> Option<Decision> {
        let t = self.tables_if_any(id.space)?;
        match id.key {
            KeyBits::V4(k) => in_place(&mut t.v4, k, id.hash, policy, now, cost),
            KeyBits::V6(k) => in_place(&mut t.v6, k, id.hash, policy, now, cost),
            KeyBits::Text(k) => in_place(&mut t.text, k, id.hash, policy, now, cost),
        }
    }

    /// Writes `state` for `id` in its own space, compactly when it can; a
    /// key is only ever in one of its space's two tables, once.
    pub(super) fn put<H: Rehash>(&mut self, id: &Id, state: State, hashes: &H) {
        let tables = self.tables_mut(id.space);
        let before = tables.len();
        on_table!(tables, id, hashes, |t, k, rehash| t
            .put(k, id.hash, state, rehash));
        let after = tables.len();
        self.len = self.len + after - before;
    }

    /// Drops what `id`'s space holds for its key; whether anything was.
    pub(super) fn remove(&mut self, id: &Id) -> bool {
        let Some(t) = self.tables_if_any(id.space) else {
            return false;
        };
        let removed = match id.key {
            KeyBits::V4(k) => t.v4.remove(k, id.hash),
            KeyBits::V6(k) => t.v6.remove(k, id.hash),
            KeyBits::Text(k) => t.text.remove(k, id.hash),
        };
        self.len -= usize::from(removed);
        removed
    }

    /// Drops every entry idle at `now` under its space's numbers
    /// (`numbers`); how many.
    pub(super) fn drop_idle<H: Rehash>(
        &mut self,
        now: Nanos,
        hashes: &H,
        numbers: impl Fn(u32) -> Option<Algorithm>,
    ) -> usize {
        let before = self.len;
        let mut len = 0;
        if self.first_space != NO_SPACE {
            let left = self.first.drop_idle(now, hashes, numbers(self.first_space));
            if left == 0 {
                // Freed for the next space that touches this shard.
                self.first = SpaceTables::default();
                self.first_space = NO_SPACE;
            }
            len += left;
        }
        for (space, slot) in self.spaces.iter_mut().enumerate() {
            let Some(t) = slot else { continue };
            let left = t.drop_idle(now, hashes, numbers(space as u32));
            if left == 0 {
                // Its siblings are loaded again when next needed.
                *slot = None;
            }
            len += left;
        }
        self.len = len;
        before - len
    }

    /// Every entry's key (in its own space) and state.
    pub(super) fn states<'a, H: Rehash>(
        &'a self,
        hashes: &'a H,
    ) -> impl Iterator<Item = (Id, State)> + 'a {
        self.all_tables().flat_map(move |(space, t)| {
            let id = move |key, hash| Id { space, key, hash };
            let v4 = t.v4.states().map(move |(k, at)| {
                let hash = hashes.v4(&k);
                (id(KeyBits::V4(k), hash), at)
            });
            let v6 = t.v6.states().map(move |(k, at)| {
                let hash = hashes.v6(&k);
                (id(KeyBits::V6(k), hash), at)
            });
            let text = t.text.states().map(move |(k, at)| {
                let hash = <H as Rehash>::text(&k);
                (id(KeyBits::Text(k), hash), at)
            });
            v4.chain(v6).chain(text)
        })
    }

    /// The sibling lists this shard holds, for tests.
    #[cfg(test)]
    pub(super) fn sibling_lists(&self) -> impl Iterator<Item = &[u32]> + '_ {
        self.all_tables().filter_map(|(_, t)| t.siblings.as_deref())
    }

    /// Spaces this shard holds tables for, and how many indexes it has
    /// room for; for tests.
    #[cfg(test)]
    pub(super) fn spaces_held(&self) -> (usize, usize) {
        let inline = usize::from(self.first_space != NO_SPACE);
        (self.all_tables().count(), self.spaces.len() + inline)
    }

    /// The space holding the inline tables, if any; for tests.
    #[cfg(test)]
    pub(super) fn inline_space(&self) -> Option<u32> {
        (self.first_space != NO_SPACE).then_some(self.first_space)
    }

    /// Table sizes, for tests: (compact, wide) entries in all spaces.
    #[cfg(test)]
    pub(super) fn counts(&self) -> (usize, usize) {
        let mut compact = 0;
        let mut wide = 0;
        for (_, t) in self.all_tables() {
            compact += t.v4.compact.len() + t.v6.compact.len() + t.text.compact.len();
            wide += t.v4.wide.len() + t.v6.wide.len() + t.text.wide.len();
        }
        (compact, wide)
    }
}

#[inline(always)]
fn in_place<W: Words>(
    table: &mut Table<W>,
    key: W,
    hash: u64,
    policy: &Policy,
    now: Nanos,
    cost: u64,
) -> Option<Decision> {
    let slot = table.compact.find_mut(hash, |c| c.key() == key)?;
    if let Algorithm::TokenBucket(bucket) = policy.algorithm()
        && let Some((decision, next)) =
            algorithm::token_bucket_compact(bucket, slot.level, slot.at, now, cost)
    {
        if let Some((level, at)) = next {
            slot.level = level;
            slot.at = at;
        }
        return Some(decision);
    }
    let step = algorithm::decide_fitting(policy, slot.state(), now, cost);
    if let Some(next) = step.next {
        *slot = Compact::pack(key, next)?;
    }
    Some(step.decision)
}

#[cfg(test)]
mod tests {
    use super::{Compact, Wide};
    use std::mem::size_of;

    /// A space's tables, inline in every shard once and boxed for every
    /// other space a shard holds: the figures in the docs (304 bytes).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_spaces_tables_take_304_bytes() {
        assert_eq!(size_of::<super::SpaceTables>(), 304);
    }

    /// The slot sizes the memory figures in BENCHMARKS.md rest on: an
    /// IPv4 token bucket in 20 bytes, an IPv6 (or text digest) one in 32.
    #[test]
    fn slots_are_packed_to_the_key() {
        assert_eq!(size_of::<Compact<[u32; 1]>>(), 20);
        assert_eq!(size_of::<Compact<[u32; 4]>>(), 32);
        assert_eq!(size_of::<Wide<[u32; 1]>>(), 28);
        assert_eq!(size_of::<Wide<[u32; 4]>>(), 40);
    }
}
