//! Per-key adaptive limits: one controller per key, each fed by its own
//! key's requests, bounded in number.
//!
//! The controllers live in two generations: a key seen is looked up in the
//! current one (moved there from the previous one if it was there, or made
//! afresh); when the current generation is full, it becomes the previous
//! one and the older previous one is forgotten, except the controllers of
//! keys with requests in flight, which move to the new current one (found
//! in review: a flood of new keys reset a busy key's low, protective limit
//! to a new controller's while its requests were still in the backend).
//! So at most twice [`KEPT`] controllers are kept besides those of keys in
//! flight, a key seen at least once while [`KEPT`] other keys enter the
//! current generation keeps what its controller learned, and a flood of
//! new keys costs one map operation per request and, once per [`KEPT`]
//! of them, one pass over the generation forgotten.

use std::collections::HashMap;

use tollgate_budget::{AdaptiveConfig, AdaptiveLimit, Change, Nanos, Sample};

/// Controllers per generation.
pub(crate) const KEPT: usize = 4096;

/// Each key's adaptive limit.
pub(crate) struct KeyLimits {
    config: AdaptiveConfig,
    current: HashMap<Box<str>, AdaptiveLimit>,
    previous: HashMap<Box<str>, AdaptiveLimit>,
    /// The limit of a key whose controller is not kept: a new
    /// controller's (its first probe's).
    fresh: u32,
    /// How many to keep in a generation (`KEPT`, fewer in tests).
    kept: usize,
    /// Controllers of keys in flight carried into the current generation
    /// when it was made: it is full at `kept` more than those.
    carried: usize,
}

impl KeyLimits {
    pub(crate) fn new(config: AdaptiveConfig) -> Self {
        Self::keeping(config, KEPT)
    }

    fn keeping(config: AdaptiveConfig, kept: usize) -> Self {
        Self {
            fresh: AdaptiveLimit::new(config, 0).limit(),
            config,
            current: HashMap::new(),
            previous: HashMap::new(),
            kept,
            carried: 0,
        }
    }

    /// `key`'s limit now.
    pub(crate) fn limit(&self, key: &str) -> usize {
        let limit = self
            .current
            .get(key)
            .or_else(|| self.previous.get(key))
            .map_or(self.fresh, AdaptiveLimit::limit);
        limit as usize
    }

    /// A request of `key` arrives at `now`, with `in_flight` of the key's
    /// already in flight: its controller is kept (made if need be) and
    /// sees the time pass. `busy` says which keys have requests in flight
    /// (their controllers are never forgotten).
    pub(crate) fn arrive(
        &mut self,
        key: &str,
        now: Nanos,
        in_flight: u32,
        busy: impl Fn(&str) -> bool,
    ) -> Option<Change> {
        if !self.current.contains_key(key) {
            let limit = self
                .previous
                .remove(key)
                .unwrap_or_else(|| AdaptiveLimit::new(self.config, now));
            if self.current.len() >= self.kept + self.carried {
                let forgotten =
                    std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
                self.current
                    .extend(forgotten.into_iter().filter(|(k, _)| busy(k)));
                self.carried = self.current.len();
            }
            self.current.insert(key.into(), limit);
        }
        self.current
            .get_mut(key)
            .and_then(|limit| limit.tick(now, in_flight))
    }

    /// A request of `key` ended at `now` as `sample` says (`None`: it says
    /// nothing of the backend), with `in_flight` of the key's still in
    /// flight. A key whose controller was forgotten meanwhile is not
    /// measured (its next arrival starts a new one).
    pub(crate) fn ended(
        &mut self,
        key: &str,
        now: Nanos,
        in_flight: u32,
        sample: Option<Sample>,
    ) -> Option<Change> {
        let limit = match self.current.get_mut(key) {
            Some(limit) => limit,
            None => self.previous.get_mut(key)?,
        };
        match sample {
            Some(sample) => limit.update(now, in_flight, sample),
            None => limit.tick(now, in_flight),
        }
    }

    #[cfg(test)]
    fn kept_now(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn config() -> AdaptiveConfig {
        AdaptiveConfig::builder()
            .bounds(2, 100)
            .probe_samples(3)
            .build()
            .unwrap()
    }

    /// Drives `key` for `rounds` windows with `in_flight` requests each
    /// ending after `latency`, starting at `now`; returns the time after.
    fn drive(limits: &mut KeyLimits, key: &str, mut now: Nanos, latency: Nanos) -> Nanos {
        for _ in 0..2_000 {
            let in_flight = u32::try_from(limits.limit(key)).unwrap();
            limits.arrive(key, now, in_flight.saturating_sub(1), |_| true);
            now += latency / u64::from(in_flight.max(1));
            limits.ended(
                key,
                now,
                in_flight.saturating_sub(1),
                Some(Sample::Ok(latency)),
            );
        }
        now
    }

    #[test]
    fn each_key_learns_its_own_limit() {
        let mut limits = KeyLimits::new(config());
        assert_eq!(
            limits.limit("a"),
            3,
            "an unseen key has a new controller's limit"
        );
        // "a": latency at its floor however many are in flight; "b": latency
        // that grows with every request in flight beyond 2.
        let mut now = 0;
        for _ in 0..2_000 {
            for (key, grows) in [("a", false), ("b", true)] {
                let in_flight = u32::try_from(limits.limit(key)).unwrap();
                limits.arrive(key, now, in_flight - 1, |_| true);
                let latency = if grows {
                    10 * MS * u64::from(in_flight.max(2)) / 2
                } else {
                    10 * MS
                };
                limits.ended(key, now + latency, in_flight - 1, Some(Sample::Ok(latency)));
            }
            now += 10 * MS;
        }
        let (a, b) = (limits.limit("a"), limits.limit("b"));
        assert!(a >= 40, "a's latency never grew: limit {a}");
        assert!(b <= 8, "b's latency grows beyond 2 in flight: limit {b}");
    }

    #[test]
    fn a_flood_of_new_keys_keeps_at_most_two_generations() {
        let mut limits = KeyLimits::keeping(config(), 100);
        let end = drive(&mut limits, "kept", 0, 10 * MS);
        let learned = limits.limit("kept");
        assert!(learned > 3, "it learned something: {learned}");
        let idle = |_: &str| false;
        for i in 0..1_000 {
            limits.arrive(&format!("new{i}"), end, 0, idle);
            assert!(limits.kept_now() <= 200);
            // Seen once per 50 new keys: never forgotten.
            if i % 50 == 0 {
                limits.arrive("kept", end, 0, idle);
            }
        }
        assert_eq!(
            limits.limit("kept"),
            learned,
            "a key seen now and then keeps its limit"
        );
        assert_eq!(
            limits.limit("new0"),
            3,
            "a key not seen for long starts again"
        );
        // A request of a forgotten key ends: nothing to measure, nothing made.
        let before = limits.kept_now();
        assert_eq!(limits.ended("new0", end, 0, Some(Sample::Ok(MS))), None);
        assert_eq!(limits.kept_now(), before);
    }

    /// Found in review: a flood of new keys reset a key's learned limit
    /// while its requests were in flight.
    #[test]
    fn a_key_in_flight_keeps_its_controller_through_any_flood() {
        let mut limits = KeyLimits::keeping(config(), 100);
        let end = drive(&mut limits, "busy", 0, 10 * MS);
        let learned = limits.limit("busy");
        assert!(learned > 3, "it learned something: {learned}");
        let busy = |k: &str| k == "busy";
        for i in 0..1_000 {
            limits.arrive(&format!("new{i}"), end, 0, busy);
            // Two generations, and the busy key carried.
            assert!(limits.kept_now() <= 201);
        }
        assert_eq!(limits.limit("busy"), learned);
    }
}
