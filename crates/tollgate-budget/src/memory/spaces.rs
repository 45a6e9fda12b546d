//! Spaces: one per distinct policy name, unit and numbers a store has met.
//!
//! A budget's state belongs to its policy's name and unit and its key;
//! the numbers it was written under matter only to read it. So each store
//! gives every (name, unit, numbers) it meets a *space* of its own, once:
//! the space selects the tables a key's state lives in (so no slot spends
//! bytes on naming its policy), and the spaces of one name and unit are
//! *siblings*: a key not found in its own space is looked for in its
//! siblings, and a state found there is converted to the reader's numbers
//! ([`carry_over`](crate::algorithm::carry_over)). A policy remembers the
//! space of the last store that asked, so the lookup per decision is one
//! atomic load.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use crate::{Algorithm, Policy, StoreError, StoreErrorKind, Unit};

/// Store ids, for the space each policy remembers. 40 bits: a process would
/// have to build a thousand billion stores to run out.
static NEXT_STORE: AtomicU64 = AtomicU64::new(1);

/// Distinct sets of numbers one store can tell apart in its lifetime.
pub(super) const MAX_SPACES: usize = (1 << 24) - 1;

/// The spaces of one store.
pub(super) struct Spaces {
    store: u64,
    registry: RwLock<Registry>,
    /// Bumped whenever a name and unit gains a second (or later) space, so
    /// that shards refresh the siblings they keep ([`Spaces::siblings`]).
    generation: AtomicU64,
}

#[derive(Default)]
struct Registry {
    by_policy: HashMap<(Arc<str>, Unit, Algorithm), u32>,
    /// The spaces of each name and unit: one list, handed to every shard
    /// that asks ([`Spaces::siblings`]), replaced when the group grows.
    groups: HashMap<(Arc<str>, Unit), Arc<[u32]>>,
    /// Space `s` holds states written under `numbers[s]`, for the name and
    /// unit `group_of[s]`.
    numbers: Vec<Algorithm>,
    group_of: Vec<(Arc<str>, Unit)>,
}

impl Spaces {
    pub(super) fn new() -> Self {
        Self {
            store: NEXT_STORE.fetch_add(1, Ordering::Relaxed) & ((1 << 40) - 1),
            registry: RwLock::new(Registry::default()),
            generation: AtomicU64::new(0),
        }
    }

    /// The space of `policy`, given now if it has none yet.
    #[inline]
    pub(super) fn space(&self, policy: &Policy) -> Result<u32, StoreError> {
        match policy.cached_space(self.store) {
            Some(space) => Ok(space),
            None => self.space_slow(policy),
        }
    }

    fn space_slow(&self, policy: &Policy) -> Result<u32, StoreError> {
        let wanted = (
            Arc::<str>::from(policy.name()),
            policy.unit().clone(),
            *policy.algorithm(),
        );
        let known = self
            .registry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .by_policy
            .get(&wanted)
            .copied();
        let space = match known {
            Some(space) => space,
            None => {
                let mut r = self
                    .registry
                    .write()
                    .unwrap_or_else(PoisonError::into_inner);
                match r.by_policy.get(&wanted) {
                    Some(&space) => space,
                    None if r.numbers.len() >= MAX_SPACES => {
                        return Err(StoreError::new(
                            StoreErrorKind::Unsupported,
                            format!(
                                "this memory store has met {MAX_SPACES} distinct sets of policy \
                                 numbers, all it can tell apart; policy {:?} brings one more",
                                policy.name()
                            ),
                        ));
                    }
                    None => {
                        let space = r.numbers.len() as u32;
                        let (name, unit, numbers) = wanted;
                        r.numbers.push(numbers);
                        r.group_of.push((name.clone(), unit.clone()));
                        r.by_policy
                            .insert((name.clone(), unit.clone(), numbers), space);
                        let group = r
                            .groups
                            .entry((name, unit))
                            .or_insert_with(|| Arc::from([]));
                        *group = group.iter().copied().chain([space]).collect();
                        if group.len() > 1 {
                            self.generation.fetch_add(1, Ordering::Release);
                        }
                        space
                    }
                }
            }
        };
        policy.cache_space(self.store, space);
        Ok(space)
    }

    /// The numbers of `space`.
    pub(super) fn numbers(&self, space: u32) -> Option<Algorithm> {
        let r = self.registry.read().unwrap_or_else(PoisonError::into_inner);
        r.numbers.get(space as usize).copied()
    }

    /// The current generation of the groups (see `generation`).
    #[inline]
    pub(super) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The spaces of `space`'s name and unit, `space` among them: one
    /// list shared by every caller.
    pub(super) fn siblings(&self, space: u32) -> Arc<[u32]> {
        let r = self.registry.read().unwrap_or_else(PoisonError::into_inner);
        r.group_of
            .get(space as usize)
            .and_then(|group| r.groups.get(group))
            .cloned()
            .unwrap_or_else(|| Arc::from([]))
    }
}
