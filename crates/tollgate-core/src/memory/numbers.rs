//! Tags for the numbers a state was written under.
//!
//! A slot records which numbers (a policy's [`Algorithm`] and its
//! parameters) wrote its state as a 24-bit tag, so that a reader with other
//! numbers under the same policy name converts the state instead of
//! misreading it. Each store gives every distinct set of numbers it meets a
//! tag of its own, once; a policy remembers the tag of the last store that
//! asked, so the lookup per decision is one atomic load.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};

use super::shard::TAG_BITS;
use crate::{Algorithm, Policy, StoreError, StoreErrorKind};

/// Store ids, for the tag each policy remembers. 40 bits: a process would
/// have to build a thousand billion stores to run out.
static NEXT_STORE: AtomicU64 = AtomicU64::new(1);

/// The tags of one store.
pub(super) struct Numbers {
    store: u64,
    tags: RwLock<Tags>,
}

#[derive(Default)]
struct Tags {
    by_numbers: HashMap<Algorithm, u32>,
    /// Tag `t` names `numbers[t - 1]` (0 is never a tag).
    numbers: Vec<Algorithm>,
}

/// Distinct sets of numbers one store can tell apart in its lifetime.
const MAX_TAGS: usize = (1 << TAG_BITS) - 1;

impl Numbers {
    pub(super) fn new() -> Self {
        Self {
            store: NEXT_STORE.fetch_add(1, Ordering::Relaxed) & ((1 << 40) - 1),
            tags: RwLock::new(Tags::default()),
        }
    }

    /// The tag of `policy`'s numbers, given now if they have none yet.
    #[inline]
    pub(super) fn tag(&self, policy: &Policy) -> Result<u32, StoreError> {
        match policy.cached_tag(self.store) {
            Some(tag) => Ok(tag),
            None => self.tag_slow(policy),
        }
    }

    fn tag_slow(&self, policy: &Policy) -> Result<u32, StoreError> {
        let numbers = *policy.algorithm();
        let known = self
            .tags
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .by_numbers
            .get(&numbers)
            .copied();
        let tag = match known {
            Some(tag) => tag,
            None => {
                let mut tags = self.tags.write().unwrap_or_else(PoisonError::into_inner);
                match tags.by_numbers.get(&numbers) {
                    Some(&tag) => tag,
                    None if tags.numbers.len() >= MAX_TAGS => {
                        return Err(StoreError::new(
                            StoreErrorKind::Unsupported,
                            format!(
                                "this memory store has met {MAX_TAGS} distinct sets of policy \
                                 numbers, all it can tell apart; policy {:?} brings one more",
                                policy.name()
                            ),
                        ));
                    }
                    None => {
                        tags.numbers.push(numbers);
                        let tag = tags.numbers.len() as u32;
                        tags.by_numbers.insert(numbers, tag);
                        tag
                    }
                }
            }
        };
        policy.cache_tag(self.store, tag);
        Ok(tag)
    }

    /// Whether `tag` is the tag of `policy`'s numbers, as far as the tag
    /// `policy` remembers says (`false` when it remembers another store's).
    #[inline]
    pub(super) fn is_tag_of(&self, policy: &Policy, tag: u32) -> bool {
        policy.cached_tag(self.store) == Some(tag)
    }

    /// The numbers tagged `tag`.
    pub(super) fn numbers(&self, tag: u32) -> Option<Algorithm> {
        let tags = self.tags.read().unwrap_or_else(PoisonError::into_inner);
        tags.numbers.get((tag as usize).checked_sub(1)?).copied()
    }
}
