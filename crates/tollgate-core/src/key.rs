//! Tuple keys whose text form keeps component boundaries.
//!
//! A [`Key`] is an ordered tuple of one or more components, e.g.
//! `("export", "north", "alice", "POST /export")`. Its text form joins the
//! components with `:` after percent-encoding `%`, `:` and every byte outside
//! printable ASCII, so the encoding is injective: `("a:b", "c")` is
//! `a%3Ab:c` and `("a", "b:c")` is `a:b%3Ac`. The same text is used by every
//! store and in logs, and [`Key::parse`] reverses it.

use std::fmt;

/// An ordered tuple of text components identifying one budget.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// The encoded text form (printable ASCII only); always the encoding of
    /// at least one component.
    encoded: Vec<u8>,
}

/// Text that is not the encoding of any key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid key text at byte {position}: {reason}")]
pub struct InvalidKey {
    position: usize,
    reason: &'static str,
}

fn needs_escape(b: u8) -> bool {
    !(0x21..=0x7e).contains(&b) || b == b':' || b == b'%'
}

fn push_escaped(out: &mut Vec<u8>, component: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    // Most components (names, ids, IPv4 addresses) need no escaping: copy
    // them whole. No early exit, so the check compiles to a vectorised loop.
    if !component
        .iter()
        .fold(false, |any, &b| any | needs_escape(b))
    {
        out.extend_from_slice(component);
        return;
    }
    for &b in component {
        if needs_escape(b) {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]);
        } else {
            out.push(b);
        }
    }
}

impl Key {
    /// A key with a single component.
    pub fn new(first: impl AsRef<[u8]>) -> Self {
        // Room for a few more components (an address, an account) without
        // growing.
        let mut encoded = Vec::with_capacity(first.as_ref().len() + 48);
        push_escaped(&mut encoded, first.as_ref());
        Self { encoded }
    }

    /// The key with one more component appended.
    #[must_use]
    pub fn with(mut self, component: impl AsRef<[u8]>) -> Self {
        self.push(component);
        self
    }

    /// Appends a component.
    pub fn push(&mut self, component: impl AsRef<[u8]>) {
        self.encoded.push(b':');
        push_escaped(&mut self.encoded, component.as_ref());
    }

    /// Appends the component `tag` followed by `value`, as one component
    /// (the same key as `push` of the two concatenated), without building
    /// the concatenation first. A tag that names the component's kind
    /// (e.g. `ip=`) keeps components of different kinds from ever being
    /// equal, whatever their values.
    pub fn push_tagged(&mut self, tag: &str, value: impl AsRef<[u8]>) {
        self.encoded.push(b':');
        push_escaped(&mut self.encoded, tag.as_bytes());
        push_escaped(&mut self.encoded, value.as_ref());
    }

    /// The injective text form.
    pub fn as_str(&self) -> &str {
        // Only printable ASCII is ever written: this cannot fail.
        std::str::from_utf8(&self.encoded).unwrap_or_default()
    }

    /// The injective text form, as bytes (what stores hash).
    pub fn as_bytes(&self) -> &[u8] {
        &self.encoded
    }

    /// The components, decoded.
    pub fn components(&self) -> Vec<Vec<u8>> {
        // The encoded form is produced by this module, so decoding cannot fail.
        decode(self.as_str()).unwrap_or_default()
    }

    /// Parses the text form produced by [`Key::as_str`].
    ///
    /// Only canonical encodings are accepted (upper-case hex, no escape for a
    /// byte that needs none), so every key has exactly one text form.
    pub fn parse(text: &str) -> Result<Self, InvalidKey> {
        decode(text)?;
        Ok(Self {
            encoded: text.as_bytes().to_vec(),
        })
    }
}

fn decode(text: &str) -> Result<Vec<Vec<u8>>, InvalidKey> {
    let bytes = text.as_bytes();
    let mut parts = vec![Vec::new()];
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b':' => parts.push(Vec::new()),
            b'%' => {
                let hex = |j: usize| -> Result<u8, InvalidKey> {
                    match bytes.get(j) {
                        Some(c @ b'0'..=b'9') => Ok(c - b'0'),
                        Some(c @ b'A'..=b'F') => Ok(c - b'A' + 10),
                        _ => Err(InvalidKey {
                            position: j,
                            reason: "expected an upper-case hex digit after '%'",
                        }),
                    }
                };
                let v = (hex(i + 1)? << 4) | hex(i + 2)?;
                if !needs_escape(v) {
                    return Err(InvalidKey {
                        position: i,
                        reason: "escaped a byte that must appear literally",
                    });
                }
                if let Some(last) = parts.last_mut() {
                    last.push(v);
                }
                i += 2;
            }
            _ if needs_escape(b) => {
                return Err(InvalidKey {
                    position: i,
                    reason: "byte must be percent-encoded",
                });
            }
            _ => {
                if let Some(last) = parts.last_mut() {
                    last.push(b);
                }
            }
        }
        i += 1;
    }
    Ok(parts)
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn boundaries_are_kept() {
        let a = Key::new("a:b").with("c");
        let b = Key::new("a").with("b:c");
        assert_ne!(a, b);
        assert_eq!(a.as_str(), "a%3Ab:c");
        assert_eq!(b.as_str(), "a:b%3Ac");
        assert_ne!(Key::new("a").with(""), Key::new("a:"));
        assert_eq!(Key::new("POST /export").as_str(), "POST%20/export");
        assert_eq!(Key::new("100%").as_str(), "100%25");
    }

    #[test]
    fn a_tagged_component_is_the_concatenation() {
        let mut a = Key::new("p");
        a.push_tagged("ip=", "1.2.3.4");
        assert_eq!(a, Key::new("p").with("ip=1.2.3.4"));
        let mut b = Key::new("p");
        b.push_tagged("t:", "a:b");
        assert_eq!(b, Key::new("p").with("t:a:b"));
        assert_eq!(b.components()[1], b"t:a:b");
    }

    #[test]
    fn parse_rejects_non_canonical_text() {
        assert!(Key::parse("a%3a").is_err());
        assert!(Key::parse("a%41").is_err());
        assert!(Key::parse("a%4").is_err());
        assert!(Key::parse("a b").is_err());
        assert!(Key::parse("é").is_err());
        assert_eq!(Key::parse("a%3Ab:c").unwrap(), Key::new("a:b").with("c"));
    }

    proptest! {
        #[test]
        fn encoding_is_injective_and_round_trips(
            a in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 1..5),
            b in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 1..5),
        ) {
            let build = |parts: &Vec<Vec<u8>>| {
                let mut k = Key::new(&parts[0]);
                for p in &parts[1..] { k.push(p); }
                k
            };
            let (ka, kb) = (build(&a), build(&b));
            prop_assert_eq!(ka == kb, a == b);
            prop_assert_eq!(ka.components(), a.clone());
            prop_assert_eq!(Key::parse(ka.as_str()).unwrap(), ka);
        }

        #[test]
        fn parse_never_panics(s in ".{0,40}") {
            if let Ok(k) = Key::parse(&s) {
                prop_assert_eq!(k.as_str(), s.as_str());
            }
        }
    }
}
