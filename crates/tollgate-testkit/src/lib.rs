//! What tollgate's tests share, in one unpublished crate: private
//! `redis-server`, cluster and `redis-sentinel` processes and TLS
//! certificates ([`RedisServer`], [`RedisCluster`], [`RedisSentinel`],
//! [`TestCertificates`]), the one skip-or-fail rule for tests that need
//! them ([`or_skip!`]), a charge in one line ([`charge`]) and an
//! independent Redis Cluster slot ([`slot`]).
//!
//! ```no_run
//! use tollgate_testkit::{RedisServer, or_skip};
//!
//! fn a_test() {
//!     // Skipped loudly without redis-server; under CI=true, a failure.
//!     let redis = or_skip!(RedisServer::start());
//!     assert!(redis.url().starts_with("redis://127.0.0.1:"));
//! }
//! ```

mod servers;

pub use servers::*;
use tollgate_budget::{Charge, Key, Policy};

/// The server (or certificates) `start` gave, or returns from the test
/// when it gave `None`: `start` has printed the loud skip message then, or
/// panicked under `CI=true`, where nothing may be skipped.
#[macro_export]
macro_rules! or_skip {
    ($start:expr) => {
        match $start {
            Some(started) => started,
            None => return,
        }
    };
}

/// A charge of `cost` to `policy` for the key (`policy`'s name, `key`).
///
/// # Panics
///
/// If the charge is invalid (a test's own mistake).
pub fn charge(key: &str, policy: &Policy, cost: u64) -> Charge {
    Charge::new(Key::new(policy.name()).with(key), policy.clone(), cost).expect("a valid charge")
}

/// The Redis Cluster slot of `key`: CRC16 (XModem) of its hash tag (the
/// text between the first `{` and the next `}`, if not empty) or of the
/// whole key, mod 16384, as the Redis Cluster specification defines it.
/// Written here from the specification, table-driven, apart from the
/// store's own (bitwise) one: a test comparing the two checks the store.
pub fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|&b| b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
            Some(0) | None => bytes,
            Some(len) => &bytes[open + 1..open + 1 + len],
        },
        None => bytes,
    };
    hashed.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16[usize::from(((crc >> 8) as u8) ^ b)]
    }) % 16384
}

/// CRC16-XModem (polynomial 0x1021) of each byte value.
const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_specification() {
        // The specification's reference: CRC16("123456789") = 0x31C3.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        // An empty first tag: the whole key is hashed.
        assert_ne!(slot("foo{}{bar}"), slot("bar"));
        assert_eq!(slot("foo{{bar}}zap"), slot("{bar"));
    }
}
