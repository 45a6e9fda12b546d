//! The Redis key layout: how a charge or a lease becomes a Redis key, the
//! hash tag in its braces (escaped key text), and the cluster slot that tag
//! puts it in.
//!
//! - A charge's state: `PREFIX:{KEY}:NAME/UNIT` ([`redis_key`]).
//! - Leases: `PREFIX:{inflight/NAME}:all` holds every lease of the limit
//!   `NAME`, `PREFIX:{inflight/NAME}:k:KEY` those of one key
//!   ([`lease_keys`]): one hash tag per limit.

use tollgate_budget::{Charge, Policy, Unit};

/// Appends `text` to `out` with its braces escaped (`{` as `%7B`, `}` as
/// `%7D`), so that it can never open or close a hash tag.
pub(crate) fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

/// `PREFIX:{KEY}:NAME/UNIT` — the braces make the key's own text its
/// cluster hash tag; the policy's name and unit keep the state of
/// different budgets apart, as `MemoryStore` does. The numbers are not part
/// of the key: the state records the numbers that wrote it, and the script
/// carries it over when they change.
pub(crate) fn redis_key(prefix: &str, charge: &Charge) -> String {
    let text = charge.key().text();
    let mut key = String::with_capacity(prefix.len() + text.len() + 48);
    key.push_str(prefix);
    key.push_str(":{");
    push_escaped(&mut key, &text);
    key.push_str("}:");
    key.push_str(&budget(charge.policy()));
    key
}

/// `NAME/UNIT`: every part of a policy that `MemoryStore` tells states
/// apart by. Names are `[A-Za-z0-9._-]`; a unit of your own is `o.` and its
/// name escaped like a key component, so that it can never read as one of
/// the built-in units.
pub(crate) fn budget(policy: &Policy) -> String {
    let unit = match policy.unit() {
        Unit::Other(name) => format!("o.{}", tollgate_budget::Key::new(&**name)),
        built_in => built_in.as_str().to_owned(),
    };
    format!("{}/{unit}", policy.name())
}

/// The keys of the leases of `limit`: the limit's, and `key`'s if the
/// limit is per key. One hash tag for the limit, so that both bounds are
/// checked and taken in one atomic script, on one node of a cluster.
pub(crate) fn lease_keys(prefix: &str, limit: &str, key: Option<&str>) -> Vec<String> {
    let tag = format!("{prefix}:{{inflight/{limit}}}");
    let mut keys = vec![format!("{tag}:all")];
    if let Some(key) = key {
        let mut k = format!("{tag}:k:");
        push_escaped(&mut k, key);
        keys.push(k);
    }
    keys
}

/// Charge indices grouped by cluster slot, groups in slot order.
pub(crate) fn slot_groups(keys: &[String]) -> Vec<Vec<usize>> {
    let mut by_slot: Vec<(u16, usize)> =
        keys.iter().enumerate().map(|(i, k)| (slot(k), i)).collect();
    by_slot.sort_unstable();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut last = None;
    for (s, i) in by_slot {
        if last == Some(s) {
            if let Some(g) = groups.last_mut() {
                g.push(i);
            }
        } else {
            groups.push(vec![i]);
            last = Some(s);
        }
    }
    groups
}

/// The Redis Cluster slot of a key: CRC16 (XMODEM) of its hash tag, mod 16384.
pub(crate) fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    crc16(tagged.unwrap_or(bytes)) % 16384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_budget::{Key, Rate};

    #[test]
    fn crc16_and_hash_tags_match_redis() {
        // The reference value from the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), crc16(b"foo{}{bar}") % 16384);
        assert_eq!(slot("foo{{bar}}zap"), crc16(b"{bar") % 16384);
    }

    #[test]
    fn keys_escape_braces_and_carry_the_policy() {
        let p = Policy::token_bucket("export", 3, Rate::per_second(2)).unwrap();
        let c = Charge::new(Key::new("export").with("a{b}"), p, 1).unwrap();
        assert_eq!(
            redis_key("app", &c),
            "app:{export:a%7Bb%7D}:export/requests"
        );
    }

    #[test]
    fn lease_keys_share_the_limit_tag_and_escape_the_key() {
        assert_eq!(
            lease_keys("app", "upload", None),
            ["app:{inflight/upload}:all"]
        );
        let keys = lease_keys("app", "upload", Some("a{b}"));
        assert_eq!(
            keys,
            [
                "app:{inflight/upload}:all",
                "app:{inflight/upload}:k:a%7Bb%7D"
            ]
        );
        assert_eq!(slot(&keys[0]), slot(&keys[1]));
    }
}
