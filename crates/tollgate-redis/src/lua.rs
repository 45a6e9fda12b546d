//! The store's Lua scripts, and the numbers they share with Rust.
//!
//! `decide.lua` and `one_bucket.lua` are templates: each `@NAME@` in them is
//! replaced by the value [`SHARED`] gives `NAME` when a script is first
//! used, and lines starting with `--@` (notes on the template) are left
//! out. So Rust is the one source of every number both sides rely on (the
//! store epoch, the era, the horizon, tollgate-budget's constants), and a
//! script's source and SHA-1 ([`decide_source`], [`decide_script`]) are
//! those of the rendered text, which is what Redis runs.

use std::sync::LazyLock;

use redis::Script;
use tollgate_budget::Charge;
use tollgate_budget::algorithm::{EMPTY_KEPT_FULL, MAX_CARRIED_DEBT, MAX_RESERVATION};

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Unix time of the store epoch, 2026-01-01T00:00:00Z. Server time is
/// counted from here so that seconds stay small. The decision script gets
/// it as an argument, the one-bucket script in its text.
pub(crate) const EPOCH_UNIX_SECS: u64 = 1_767_225_600;

/// Seconds per era of the scripts' (era, offset) time.
pub(crate) const ERA_SECS: u64 = 4_000_000;

/// Nanoseconds per era of the scripts' (era, offset) time.
pub(crate) const ERA_NS: u64 = ERA_SECS * NANOS_PER_SEC;

/// The scripts' difference of two times more than an era apart: longer
/// than any difference of two nearer times, and exact.
const HUGE_NS: u64 = 9_000_000_000_000_000;

/// Integers the script handles must stay below 2^53 to be exact.
pub(crate) const EXACT: u128 = 1 << 53;

/// Longest horizon (time to full, or window span) the script accepts: half
/// an era, so every difference of interest is exact. The longest debt a
/// carried-over bucket keeps is the same bound.
pub(crate) const MAX_HORIZON_NS: u128 = MAX_CARRIED_DEBT as u128;

/// The shortest TTL of a key written under injected time, in ms (an hour
/// of real time: see `RedisStoreBuilder::injected_time`).
const INJECTED_MIN_TTL_MS: u64 = 3_600_000;

// What the scripts' arithmetic relies on.
const _: () = {
    assert!(MAX_HORIZON_NS * 2 == ERA_NS as u128);
    // A shaped charge's longest wait is clamped to the horizon.
    assert!(Charge::MAX_DELAY.as_nanos() == MAX_HORIZON_NS);
    // Two times at most an era apart differ by less than two eras.
    assert!(HUGE_NS >= 2 * ERA_NS && (HUGE_NS as u128) < EXACT);
    assert!(MAX_RESERVATION.is_multiple_of(NANOS_PER_SEC));
};

/// The numbers the scripts share with Rust, by their placeholder names in
/// the templates (`@NAME@`).
const SHARED: [(&str, u64); 9] = [
    ("EPOCH_UNIX_SECS", EPOCH_UNIX_SECS),
    ("ERA_SECS", ERA_SECS),
    ("ERA_NS", ERA_NS),
    ("HUGE_NS", HUGE_NS),
    ("MAX_CARRIED_DEBT", MAX_CARRIED_DEBT),
    // The largest integer the scripts count exactly.
    ("MAX_COUNT", (EXACT - 1) as u64),
    ("EMPTY_KEPT_FULL", EMPTY_KEPT_FULL),
    ("MAX_RESERVATION_SECS", MAX_RESERVATION / NANOS_PER_SEC),
    ("INJECTED_MIN_TTL_MS", INJECTED_MIN_TTL_MS),
];

/// A template with its `--@` lines left out and every `@NAME@` replaced
/// by the shared number of that name.
fn render(template: &str) -> String {
    let mut source: String = template
        .split_inclusive('\n')
        .filter(|line| !line.starts_with("--@"))
        .collect();
    for (name, value) in SHARED {
        source = source.replace(&format!("@{name}@"), &value.to_string());
    }
    source
}

const DECIDE_TEMPLATE: &str = include_str!("decide.lua");
const ONE_BUCKET_TEMPLATE: &str = include_str!("one_bucket.lua");

static DECIDE: LazyLock<String> = LazyLock::new(|| render(DECIDE_TEMPLATE));
static ONE_BUCKET: LazyLock<String> = LazyLock::new(|| render(ONE_BUCKET_TEMPLATE));

/// The decision script's Lua source.
pub(crate) fn decide_source() -> &'static str {
    &DECIDE
}

/// The decision script.
pub(crate) fn decide_script() -> Script {
    Script::new(decide_source())
}

/// The one-bucket script's Lua source: the common call (one token-bucket
/// charge, unshaped, of a bucket that starts full) decided with a fraction
/// of the full script's work, or handed back to it.
pub(crate) fn one_bucket_source() -> &'static str {
    &ONE_BUCKET
}

/// The one-bucket script.
pub(crate) fn one_bucket_script() -> Script {
    Script::new(one_bucket_source())
}

/// The lease script's Lua source (it shares no numbers: used as written).
pub(crate) const LEASE_SOURCE: &str = include_str!("leases.lua");

static LEASES: LazyLock<Script> = LazyLock::new(|| Script::new(LEASE_SOURCE));

/// The lease script.
pub(crate) fn lease_script() -> &'static Script {
    &LEASES
}

pub(crate) const POLICIES_SOURCE: &str = include_str!("policies.lua");

static POLICIES: LazyLock<Script> = LazyLock::new(|| Script::new(POLICIES_SOURCE));

/// The fleet policy script.
pub(crate) fn policies_script() -> &'static Script {
    &POLICIES
}

/// Every script the store calls, to load them all (`SCRIPT LOAD`).
pub(crate) fn sources() -> [&'static str; 4] {
    [
        decide_source(),
        one_bucket_source(),
        LEASE_SOURCE,
        POLICIES_SOURCE,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEMPLATES: [(&str, &str); 4] = [
        ("decide.lua", DECIDE_TEMPLATE),
        ("one_bucket.lua", ONE_BUCKET_TEMPLATE),
        ("leases.lua", LEASE_SOURCE),
        ("policies.lua", POLICIES_SOURCE),
    ];

    /// The integer numerals in `lua`'s code (not its comments), with their
    /// values: decimal, with an optional fraction and exponent (`4e15`).
    fn numerals(lua: &str) -> Vec<(String, Option<u128>)> {
        let b = lua.as_bytes();
        let mut found = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'-' if b.get(i + 1) == Some(&b'-') => {
                    while i < b.len() && b[i] != b'\n' {
                        i += 1;
                    }
                }
                quote @ (b'"' | b'\'') => {
                    i += 1;
                    while i < b.len() && b[i] != quote {
                        i += if b[i] == b'\\' { 2 } else { 1 };
                    }
                    i += 1;
                }
                c if c.is_ascii_alphabetic() || c == b'_' => {
                    while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                        i += 1;
                    }
                }
                c if c.is_ascii_digit() => {
                    let start = i;
                    let digits = |i: &mut usize| {
                        let from = *i;
                        while *i < b.len() && b[*i].is_ascii_digit() {
                            *i += 1;
                        }
                        &lua[from..*i]
                    };
                    let whole = digits(&mut i);
                    let mut fraction = "";
                    if b.get(i) == Some(&b'.') {
                        i += 1;
                        fraction = digits(&mut i);
                    }
                    let mut exponent = 0u32;
                    if matches!(b.get(i), Some(b'e' | b'E')) {
                        i += 1;
                        if b.get(i) == Some(&b'+') {
                            i += 1;
                        }
                        exponent = digits(&mut i).parse().unwrap_or(u32::MAX);
                    }
                    let mantissa: Option<u128> = format!("{whole}{fraction}").parse().ok();
                    let value = exponent
                        .checked_sub(u32::try_from(fraction.len()).unwrap_or(u32::MAX))
                        .and_then(|e| 10u128.checked_pow(e))
                        .zip(mantissa)
                        .and_then(|(scale, m)| m.checked_mul(scale));
                    found.push((lua[start..i].to_owned(), value));
                }
                _ => i += 1,
            }
        }
        found
    }

    /// The numerals in `lua`'s code that equal a shared number.
    fn literal_copies(lua: &str) -> Vec<String> {
        numerals(lua)
            .into_iter()
            .filter(|(_, value)| {
                SHARED
                    .iter()
                    .any(|&(_, shared)| *value == Some(u128::from(shared)))
            })
            .map(|(text, _)| text)
            .collect()
    }

    #[test]
    fn no_script_holds_a_literal_copy_of_a_shared_number() {
        for (name, template) in TEMPLATES {
            let copies = literal_copies(template);
            assert!(
                copies.is_empty(),
                "{name} writes {copies:?}: use the @NAME@ placeholder of the Rust constant"
            );
        }
    }

    #[test]
    fn the_check_finds_copies_in_any_notation_but_not_in_comments() {
        let lua = "local A = 4000000000000000 -- 60\nlocal B = 2e15\nlocal C = 3.6e6\n\
                   local D = x60 + \"60\" + 7";
        assert_eq!(literal_copies(lua), ["4000000000000000", "2e15", "3.6e6"]);
        assert!(literal_copies("local KEEP = @EMPTY_KEPT_FULL@ -- 60000000000").is_empty());
    }

    #[test]
    fn every_placeholder_is_a_shared_number_and_rendered() {
        for (name, source) in [
            ("decide.lua", decide_source()),
            ("one_bucket.lua", one_bucket_source()),
        ] {
            assert!(source.starts_with("#!lua\n"), "{name}");
            assert!(!source.contains('@'), "{name} keeps a placeholder");
            assert!(!source.contains("\n--@"), "{name} keeps a template note");
        }
        for (name, _) in SHARED {
            let placeholder = format!("@{name}@");
            assert!(
                TEMPLATES.iter().any(|(_, t)| t.contains(&placeholder)),
                "{name} is used by no script"
            );
        }
        assert!(one_bucket_source().contains(&format!("t[1] - {EPOCH_UNIX_SECS},")));
        assert!(decide_source().contains(&format!("local MAX_DEBT = {MAX_CARRIED_DEBT}\n")));
        assert_eq!(
            decide_script().get_hash(),
            Script::new(decide_source()).get_hash()
        );
    }
}
