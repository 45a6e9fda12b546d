//! Captures tollgate's tracing events in a test binary, so tests can check
//! what an operator would see in the log (and how often).

use std::fmt::{self, Write as _};
use std::sync::{Mutex, OnceLock};

use tracing::field::Field;
use tracing::{Event, Level, Metadata, Subscriber, span};

static EVENTS: Mutex<Vec<(Level, String)>> = Mutex::new(Vec::new());

struct Capture;

impl Subscriber for Capture {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.target().starts_with("tollgate")
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut text = String::new();
        event.record(&mut |field: &Field, value: &dyn fmt::Debug| {
            let _ = write!(text, "{}={value:?} ", field.name());
        });
        let level = *event.metadata().level();
        EVENTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((level, text));
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

/// Starts capturing (once per test binary).
pub fn capture() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        tracing::subscriber::set_global_default(Capture).expect("no other subscriber");
    });
}

/// Captured events at `level` whose text contains `needle`.
pub fn count(level: Level, needle: &str) -> usize {
    EVENTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|(l, text)| *l == level && text.contains(needle))
        .count()
}

/// Every captured event's text, at any level.
pub fn texts() -> Vec<String> {
    EVENTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .map(|(_, text)| text.clone())
        .collect()
}

/// Captured events at `level` whose text contains every one of `needles`
/// (one event carrying them all, not several between them).
pub fn count_all(level: Level, needles: &[&str]) -> usize {
    EVENTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|(l, text)| *l == level && needles.iter().all(|n| text.contains(n)))
        .count()
}

/// The text of every captured event at `level`.
pub fn texts_at(level: Level) -> Vec<String> {
    EVENTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|(l, _)| *l == level)
        .map(|(_, text)| text.clone())
        .collect()
}
