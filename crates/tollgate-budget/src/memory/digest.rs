//! The keyed hashes of [`crate::MemoryStore`]: the 128-bit digest that
//! stands in for a key's text, and the placement of an address's slot.
//!
//! SipHash-1-3 with 128-bit output (Aumasson and Bernstein's SipHash, the
//! round counts Rust's standard hasher uses), computed in one pass over the
//! policy identity followed by the key's text. Being one-shot over input that
//! is already contiguous, it skips the buffering a streaming [`std::hash::Hasher`]
//! does per `write`, and one pass yields both the shard index and the map
//! hash. Its keys are drawn from the operating system's randomness per store:
//! without them an adversary can neither aim keys at one slot nor make two
//! keys share a digest.

use std::hash::{BuildHasher, RandomState};
use std::net::IpAddr;

use super::shard::{Id, KeyBits, Rehash};
use crate::Key;

/// A secret SipHash key.
#[derive(Clone, Copy)]
pub(crate) struct DigestKey {
    k0: u64,
    k1: u64,
}

impl DigestKey {
    /// A key from the operating system's randomness (through the seed of
    /// [`RandomState`], which comes from it).
    pub(crate) fn random() -> Self {
        let seeds = RandomState::new();
        Self {
            k0: seeds.hash_one(0x746f_6c6c_u64),
            k1: seeds.hash_one(0x6761_7465_u64),
        }
    }

    /// The 128-bit digest of `prefix` (as eight little-endian bytes)
    /// followed by `text`.
    #[inline]
    pub(crate) fn digest(&self, prefix: u64, text: &[u8]) -> u128 {
        sip::<1, 3, true>(self.k0, self.k1, prefix, text)
    }

    /// The 64-bit SipHash-1-3 of the same input.
    #[inline]
    pub(crate) fn digest64(&self, prefix: u64, text: &[u8]) -> u64 {
        sip::<1, 3, false>(self.k0, self.k1, prefix, text) as u64
    }
}

/// The store's secret hashes: where a key's slot goes (its shard and its
/// place in a table), and the identity of a key that is not an address.
pub(crate) struct Hashes {
    digest: DigestKey,
    /// Seeds of the address placement (a folded multiply).
    fold: [u64; 2],
}

impl Hashes {
    pub(crate) fn random() -> Self {
        let seeds = RandomState::new();
        Self {
            digest: DigestKey::random(),
            // Odd multipliers, so that no address bit is lost.
            fold: [
                seeds.hash_one(0x6164_6472_u64) | 1,
                seeds.hash_one(0x706c_6163_u64) | 1,
            ],
        }
    }

    /// `key`'s slot key in `space`: an IPv4 or IPv6 client address
    /// (not aggregated) is its own bits; any other key is the keyed digest
    /// of its text.
    #[inline(always)]
    pub(crate) fn id(&self, key: &Key, space: u32) -> Id {
        let bits = match key.as_client_ip() {
            Some((IpAddr::V4(v4), 32)) => KeyBits::V4([u32::from(v4)]),
            Some((IpAddr::V6(v6), 128)) => KeyBits::V6(KeyBits::words128(u128::from(v6))),
            _ => KeyBits::Text(KeyBits::words128(
                key.with_text_bytes(|text| self.digest.digest(0, text)),
            )),
        };
        let hash = match &bits {
            KeyBits::V4(k) => self.v4(k),
            KeyBits::V6(k) => self.v6(k),
            KeyBits::Text(k) => <Self as Rehash>::text(k),
        };
        Id {
            space,
            key: bits,
            hash,
        }
    }

    /// The shard of `id`, out of `mask + 1`: bits of its hash that the
    /// table's own placement does not use.
    #[inline]
    pub(crate) fn shard_of(id: &Id, mask: usize) -> usize {
        (id.hash >> 32) as usize & mask
    }
}

/// The high and low halves of the 128-bit product, folded: a keyed mix in
/// which every input bit moves every output bit.
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl Rehash for Hashes {
    /// An IPv4 address cannot be chosen freely by a client (it must
    /// connect from it, or a trusted proxy must see it do so), so a keyed
    /// folded multiply places it: a few instructions.
    #[inline]
    fn v4(&self, key: &[u32; 1]) -> u64 {
        fold(u64::from(key[0]) ^ self.fold[0], self.fold[1])
    }

    /// A client holding an IPv6 prefix chooses among 2^64 addresses and
    /// more: placed by keyed SipHash, which an attacker who cannot see the
    /// key cannot aim at one slot.
    #[inline]
    fn v6(&self, key: &[u32; 4]) -> u64 {
        let bits = KeyBits::from_words(*key);
        self.digest
            .digest64((bits >> 64) as u64, &(bits as u64).to_le_bytes())
    }
}

#[derive(Clone, Copy)]
struct Lanes {
    v0: u64,
    v1: u64,
    v2: u64,
    v3: u64,
}

impl Lanes {
    #[inline(always)]
    fn round(&mut self) {
        self.v0 = self.v0.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(13) ^ self.v0;
        self.v0 = self.v0.rotate_left(32);
        self.v2 = self.v2.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(16) ^ self.v2;
        self.v0 = self.v0.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(21) ^ self.v0;
        self.v2 = self.v2.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(17) ^ self.v2;
        self.v2 = self.v2.rotate_left(32);
    }

    #[inline(always)]
    fn absorb<const C: usize>(&mut self, m: u64) {
        self.v3 ^= m;
        for _ in 0..C {
            self.round();
        }
        self.v0 ^= m;
    }

    #[inline(always)]
    fn squeeze<const D: usize>(&mut self) -> u64 {
        for _ in 0..D {
            self.round();
        }
        self.v0 ^ self.v1 ^ self.v2 ^ self.v3
    }
}

/// SipHash-C-D of `prefix.to_le_bytes() ++ text`; 128-bit output when
/// `WIDE` (the high half is the second output word), else 64-bit.
#[inline(always)]
fn sip<const C: usize, const D: usize, const WIDE: bool>(
    k0: u64,
    k1: u64,
    prefix: u64,
    text: &[u8],
) -> u128 {
    let mut s = Lanes {
        v0: k0 ^ 0x736f_6d65_7073_6575,
        v1: k1 ^ 0x646f_7261_6e64_6f6d ^ if WIDE { 0xee } else { 0 },
        v2: k0 ^ 0x6c79_6765_6e65_7261,
        v3: k1 ^ 0x7465_6462_7974_6573,
    };
    s.absorb::<C>(prefix);
    let mut words = text.chunks_exact(8);
    for w in &mut words {
        let mut b = [0u8; 8];
        b.copy_from_slice(w);
        s.absorb::<C>(u64::from_le_bytes(b));
    }
    // The final word: the tail bytes, and the total length mod 256 on top.
    let mut last = (8u64.wrapping_add(text.len() as u64) & 0xff) << 56;
    for (i, &b) in words.remainder().iter().enumerate() {
        last |= u64::from(b) << (8 * i);
    }
    s.absorb::<C>(last);
    s.v2 ^= if WIDE { 0xee } else { 0xff };
    let low = s.squeeze::<D>();
    if !WIDE {
        return u128::from(low);
    }
    s.v1 ^= 0xdd;
    let high = s.squeeze::<D>();
    (u128::from(high) << 64) | u128::from(low)
}

#[cfg(test)]
mod tests {
    use std::hash::{DefaultHasher, Hasher};

    use super::*;

    fn message(prefix: u64, text: &[u8]) -> Vec<u8> {
        let mut m = prefix.to_le_bytes().to_vec();
        m.extend_from_slice(text);
        m
    }

    /// The standard library's hasher is SipHash-1-3 (64-bit) and, from
    /// `DefaultHasher::new`, keyed with zeros: the rounds, absorption and
    /// length padding must agree with it for every tail length.
    #[test]
    fn matches_std_siphash_1_3() {
        for len in 0..40 {
            let text: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let prefix = 0x0123_4567_89ab_cdef_u64.rotate_left(len);
            let mut std = DefaultHasher::new();
            std.write(&message(prefix, &text));
            assert_eq!(
                sip::<1, 3, false>(0, 0, prefix, &text),
                u128::from(std.finish())
            );
        }
    }

    /// The 128-bit output against an independent implementation (the
    /// `siphasher` crate), for both round counts, random keys and every
    /// tail length.
    #[test]
    fn matches_independent_siphash_128() {
        use siphasher::sip128::{Hasher128, SipHasher13, SipHasher24};
        let key = DigestKey::random();
        for len in 0u32..40 {
            let text: Vec<u8> = (0..len).map(|i| (i * 91 + 3) as u8).collect();
            let prefix = key.k0 ^ u64::from(len);
            let m = message(prefix, &text);
            let mut h13 = SipHasher13::new_with_keys(key.k0, key.k1);
            h13.write(&m);
            assert_eq!(
                key.digest(prefix, &text),
                h13.finish128().as_u128(),
                "len {len}"
            );
            let mut h24 = SipHasher24::new_with_keys(key.k0, key.k1);
            h24.write(&m);
            assert_eq!(
                sip::<2, 4, true>(key.k0, key.k1, prefix, &text),
                h24.finish128().as_u128()
            );
        }
    }

    #[test]
    fn keys_and_inputs_all_matter() {
        let a = DigestKey { k0: 1, k1: 2 };
        let b = DigestKey { k0: 1, k1: 3 };
        let d = a.digest(7, b"key");
        assert_ne!(d, b.digest(7, b"key"));
        assert_ne!(d, a.digest(8, b"key"));
        assert_ne!(d, a.digest(7, b"kez"));
        assert_ne!(a.digest(7, b""), a.digest(7, b"\0"));
        assert_ne!(d >> 64, d & u128::from(u64::MAX));
    }
}
