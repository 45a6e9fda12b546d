//! The Retry-After parser on arbitrary bytes and receipt times: no panic,
//! and delay-seconds always parse to exactly their value (or saturate).
#![no_main]

use std::time::{Duration, UNIX_EPOCH};

use libfuzzer_sys::fuzz_target;
use tollgate::client::retry_after;

fuzz_target!(|input: (u32, &[u8])| {
    let (secs, value) = input;
    let received = UNIX_EPOCH + Duration::from_secs(u64::from(secs) * 4);
    let parsed = retry_after(value, received);
    let trimmed: Vec<u8> = value
        .iter()
        .copied()
        .filter(|b| *b != b' ' && *b != b'\t')
        .collect();
    if !trimmed.is_empty() && trimmed.len() == value.len() && trimmed.iter().all(u8::is_ascii_digit)
    {
        let expected = std::str::from_utf8(&trimmed)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map_or(Duration::MAX, Duration::from_secs);
        assert_eq!(parsed, Ok(expected));
    }
});
