//! Tuple keys whose text form keeps component boundaries.
//!
//! A [`Key`] is an ordered tuple of one or more components, e.g.
//! `("t=north", "a=alice", "op=POST /export")`. Its text form joins the
//! components with `:` after percent-encoding `%`, `:` and every byte
//! outside printable ASCII, so the encoding is injective: `("a:b", "c")` is
//! `a%3Ab:c` and `("a", "b:c")` is `a:b%3Ac`. The same text is used by every
//! store that needs one and in logs, and [`Key::parse`] reverses it.
//!
//! A key that is one client address, `ip=ADDR` (`ip=ADDR/PREFIX` when
//! aggregated), is kept as the address itself ([`Key::client_ip`]): the
//! in-memory store keys its budgets by the address's bits, and the text is
//! written only when a store or a log asks for it ([`Key::text`]). Every way
//! of building a key gives one value for one tuple: `Key::new("ip=10.0.0.1")`
//! is `Key::client_ip("10.0.0.1".parse()?, 32)`.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

/// An ordered tuple of text components identifying one budget.
#[derive(Clone)]
pub struct Key {
    /// Canonical: a key whose only component is `ip=` and an address's
    /// text (as [`Addr`] writes it) is always [`Repr::Addr`], so that two
    /// keys are equal exactly when their representations are.
    repr: Repr,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// The encoded text form (printable ASCII only); always the encoding of
    /// at least one component.
    Text(Vec<u8>),
    /// The one component `ip=` followed by the address's text.
    Addr(Addr),
}

/// A client address and the prefix length it was aggregated to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Addr {
    ip: IpAddr,
    /// At most the address's width; the width itself means "not aggregated".
    prefix: u8,
}

impl Addr {
    fn width(ip: IpAddr) -> u8 {
        if ip.is_ipv4() { 32 } else { 128 }
    }

    /// The component's bytes, unescaped: `ip=ADDR`, or `ip=ADDR/PREFIX`.
    fn write_component(self, out: &mut impl fmt::Write) -> fmt::Result {
        out.write_str("ip=")?;
        match self.ip {
            IpAddr::V4(v4) => {
                // The common case, without the formatting machinery.
                let mut digits = [0u8; 15];
                let mut len = 0;
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        digits[len] = b'.';
                        len += 1;
                    }
                    if octet >= 100 {
                        digits[len] = b'0' + octet / 100;
                        len += 1;
                    }
                    if octet >= 10 {
                        digits[len] = b'0' + octet / 10 % 10;
                        len += 1;
                    }
                    digits[len] = b'0' + octet % 10;
                    len += 1;
                }
                // Only ASCII digits and dots were written.
                out.write_str(std::str::from_utf8(&digits[..len]).unwrap_or_default())?;
            }
            IpAddr::V6(v6) => write!(out, "{v6}")?,
        }
        if self.prefix < Self::width(self.ip) {
            write!(out, "/{}", self.prefix)?;
        }
        Ok(())
    }

    /// The address a component's bytes name, if they are exactly what
    /// [`Addr::write_component`] writes for it.
    fn parse_component(component: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(component.strip_prefix(b"ip=")?).ok()?;
        let (ip, prefix) = match text.split_once('/') {
            Some((ip, prefix)) => (ip.parse::<IpAddr>().ok()?, prefix.parse::<u8>().ok()?),
            None => {
                let ip = text.parse::<IpAddr>().ok()?;
                (ip, Self::width(ip))
            }
        };
        if prefix > Self::width(ip) {
            return None;
        }
        let addr = Self { ip, prefix };
        let mut again = Buf::new();
        addr.write_component(&mut again).ok()?;
        (again.as_bytes() == component).then_some(addr)
    }
}

/// A stack buffer for one address component (at most `ip=`, 45 bytes of
/// IPv6 text and `/128`).
struct Buf {
    bytes: [u8; 64],
    len: usize,
}

impl Buf {
    fn new() -> Self {
        Self {
            bytes: [0; 64],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl fmt::Write for Buf {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        self.bytes
            .get_mut(self.len..end)
            .ok_or(fmt::Error)?
            .copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
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
    // Most components (names, ids, IPv4 addresses) need no escaping: copy
    // them whole. No early exit, so the check compiles to a vectorised loop.
    if !component
        .iter()
        .fold(false, |any, &b| any | needs_escape(b))
    {
        out.extend_from_slice(component);
        return;
    }
    // At most three bytes for each: one reservation, then no capacity
    // checks that can fail.
    out.reserve(component.len() * 3);
    let mut rest = component;
    while let Some(i) = rest.iter().position(|&b| needs_escape(b)) {
        out.extend_from_slice(&rest[..i]);
        out.extend_from_slice(&escape_byte(rest[i]));
        rest = &rest[i + 1..];
    }
    out.extend_from_slice(rest);
}

impl Key {
    /// A key with a single component.
    pub fn new(first: impl AsRef<[u8]>) -> Self {
        let first = first.as_ref();
        if let Some(addr) = Addr::parse_component(first) {
            return Self {
                repr: Repr::Addr(addr),
            };
        }
        // Room for a few more components (an address, an account) without
        // growing.
        let mut encoded = Vec::with_capacity(first.len() + 48);
        push_escaped(&mut encoded, first);
        Self {
            repr: Repr::Text(encoded),
        }
    }

    /// A key with a single component, `tag` followed by `value` (the same
    /// key as [`Key::new`] of the two concatenated), without building the
    /// concatenation first.
    pub fn tagged(tag: &str, value: impl AsRef<[u8]>) -> Self {
        let value = value.as_ref();
        let mut encoded = Vec::with_capacity(tag.len() + value.len() + 48);
        push_escaped(&mut encoded, tag.as_bytes());
        push_escaped(&mut encoded, value);
        if encoded.starts_with(b"ip=") {
            // Perhaps an address: one canonical form for every tuple.
            return Self::new([tag.as_bytes(), value].concat());
        }
        Self {
            repr: Repr::Text(encoded),
        }
    }

    /// The key of one client address aggregated to `prefix` bits (the
    /// address's width, 32 or 128, for none; a larger `prefix` counts as
    /// the width): the tuple `("ip=ADDR")`, or `("ip=NETWORK/PREFIX")` when
    /// aggregated, the address masked to its first `prefix` bits so that
    /// every address of one network is one key. The address is taken as
    /// given: an IPv4-mapped IPv6 address stays IPv6 (the `tollgate`
    /// layer's client-address resolver maps it to IPv4 first). Nothing is
    /// allocated.
    ///
    /// ```
    /// use std::net::IpAddr;
    /// use tollgate_budget::Key;
    ///
    /// let a: IpAddr = "203.0.113.7".parse().unwrap();
    /// let b: IpAddr = "203.0.113.200".parse().unwrap();
    /// assert_eq!(Key::client_ip(a, 24), Key::client_ip(b, 24));
    /// assert_eq!(Key::client_ip(a, 24).text(), "ip=203.0.113.0/24");
    /// assert_ne!(Key::client_ip(a, 32), Key::client_ip(b, 32));
    /// ```
    pub fn client_ip(ip: IpAddr, prefix: u8) -> Self {
        let prefix = prefix.min(Addr::width(ip));
        let ip = match ip {
            IpAddr::V4(v4) => IpAddr::V4(
                (u32::from(v4) & u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)).into(),
            ),
            IpAddr::V6(v6) => IpAddr::V6(
                (u128::from(v6) & u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0))
                    .into(),
            ),
        };
        Self {
            repr: Repr::Addr(Addr { ip, prefix }),
        }
    }

    /// The client address and prefix length of a key made of one client
    /// address ([`Key::client_ip`], or the same tuple built as text).
    pub fn as_client_ip(&self) -> Option<(IpAddr, u8)> {
        match self.repr {
            Repr::Addr(a) => Some((a.ip, a.prefix)),
            Repr::Text(_) => None,
        }
    }

    /// The key with one more component appended.
    #[must_use]
    pub fn with(mut self, component: impl AsRef<[u8]>) -> Self {
        self.push(component);
        self
    }

    /// The encoded text, for appending to (a key of two or more
    /// components is always text).
    fn encoded_mut(&mut self) -> &mut Vec<u8> {
        if let Repr::Addr(addr) = self.repr {
            let mut encoded = Vec::with_capacity(64);
            write_addr(addr, &mut encoded);
            self.repr = Repr::Text(encoded);
        }
        match &mut self.repr {
            Repr::Text(encoded) => encoded,
            // Just replaced.
            Repr::Addr(_) => unreachable!("an address key was made text above"),
        }
    }

    /// Appends a component.
    pub fn push(&mut self, component: impl AsRef<[u8]>) {
        let encoded = self.encoded_mut();
        encoded.push(b':');
        push_escaped(encoded, component.as_ref());
    }

    /// Appends the component `tag` followed by `value`, as one component
    /// (the same key as `push` of the two concatenated), without building
    /// the concatenation first. A tag that names the component's kind
    /// (e.g. `ip=`) keeps components of different kinds from ever being
    /// equal, whatever their values.
    pub fn push_tagged(&mut self, tag: &str, value: impl AsRef<[u8]>) {
        let encoded = self.encoded_mut();
        encoded.push(b':');
        push_escaped(encoded, tag.as_bytes());
        push_escaped(encoded, value.as_ref());
    }

    /// Appends one component made of `tag` and then each of `pieces` (the
    /// same key as [`Key::push_tagged`] of their concatenation), without
    /// building the concatenation.
    pub fn push_tagged_parts(&mut self, tag: &str, pieces: &[&str]) {
        let encoded = self.encoded_mut();
        encoded.push(b':');
        push_escaped(encoded, tag.as_bytes());
        for piece in pieces {
            push_escaped(encoded, piece.as_bytes());
        }
    }

    /// The injective text form. Borrowed for keys built as text; written
    /// out for a client address's key.
    pub fn text(&self) -> Cow<'_, str> {
        match &self.repr {
            // Only printable ASCII is ever written: this cannot fail.
            Repr::Text(encoded) => Cow::Borrowed(std::str::from_utf8(encoded).unwrap_or_default()),
            Repr::Addr(addr) => {
                let mut out = Vec::with_capacity(64);
                write_addr(*addr, &mut out);
                Cow::Owned(String::from_utf8(out).unwrap_or_default())
            }
        }
    }

    /// Appends the injective text form to `out` (what a store that needs
    /// text, such as Redis, builds its own key from).
    pub fn write_text(&self, out: &mut Vec<u8>) {
        match &self.repr {
            Repr::Text(encoded) => out.extend_from_slice(encoded),
            Repr::Addr(addr) => write_addr(*addr, out),
        }
    }

    /// Calls `f` with the injective text form as bytes, written on the
    /// stack for a client address's key: for hashing a key's text without
    /// allocating.
    pub fn with_text_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        match &self.repr {
            Repr::Text(encoded) => f(encoded),
            Repr::Addr(addr) => {
                let mut raw = Buf::new();
                // An address component always fits the buffer.
                let _ = addr.write_component(&mut raw);
                let mut escaped = [0u8; 192];
                let mut len = 0;
                for &b in raw.as_bytes() {
                    let three;
                    let bytes: &[u8] = if needs_escape(b) {
                        three = escape_byte(b);
                        &three
                    } else {
                        std::slice::from_ref(&b)
                    };
                    escaped[len..len + bytes.len()].copy_from_slice(bytes);
                    len += bytes.len();
                }
                f(&escaped[..len])
            }
        }
    }

    /// The components, decoded.
    pub fn components(&self) -> Vec<Vec<u8>> {
        match &self.repr {
            Repr::Addr(addr) => {
                let mut raw = Buf::new();
                let _ = addr.write_component(&mut raw);
                vec![raw.as_bytes().to_vec()]
            }
            // The encoded form is produced by this module, so decoding cannot fail.
            Repr::Text(_) => decode(&self.text()).unwrap_or_default(),
        }
    }

    /// Parses the text form produced by [`Key::text`].
    ///
    /// Only canonical encodings are accepted (upper-case hex, no escape for a
    /// byte that needs none), so every key has exactly one text form.
    pub fn parse(text: &str) -> Result<Self, InvalidKey> {
        let parts = decode(text)?;
        if let [only] = parts.as_slice()
            && let Some(addr) = Addr::parse_component(only)
        {
            return Ok(Self {
                repr: Repr::Addr(addr),
            });
        }
        Ok(Self {
            repr: Repr::Text(text.as_bytes().to_vec()),
        })
    }
}

fn escape_byte(b: u8) -> [u8; 3] {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    [b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0xf)]]
}

/// Appends the encoded text of an address's key.
fn write_addr(addr: Addr, out: &mut Vec<u8>) {
    let mut raw = Buf::new();
    // An address component always fits the buffer.
    let _ = addr.write_component(&mut raw);
    push_escaped(out, raw.as_bytes());
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        // Representations are canonical (see `repr`).
        self.repr == other.repr
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.repr.hash(state);
    }
}

/// Keys are ordered by their text forms.
impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.with_text_bytes(|a| other.with_text_bytes(|b| a.cmp(b)))
    }
}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
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
        self.with_text_bytes(|text| f.write_str(std::str::from_utf8(text).unwrap_or_default()))
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
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
        assert_eq!(a.text(), "a%3Ab:c");
        assert_eq!(b.text(), "a:b%3Ac");
        assert_ne!(Key::new("a").with(""), Key::new("a:"));
        assert_eq!(Key::new("POST /export").text(), "POST%20/export");
        assert_eq!(Key::new("100%").text(), "100%25");
    }

    #[test]
    fn a_tagged_component_is_the_concatenation() {
        assert_eq!(Key::tagged("t=", "a:b"), Key::new("t=a:b"));
        assert_eq!(Key::tagged("ip=", "10.0.0.1"), Key::new("ip=10.0.0.1"));
        assert_eq!(
            Key::tagged("i", "p=10.0.0.1").as_client_ip(),
            Key::new("ip=10.0.0.1").as_client_ip()
        );
        assert!(Key::tagged("i", "p=10.0.0.1").as_client_ip().is_some());
        let mut a = Key::new("p");
        a.push_tagged("ip=", "1.2.3.4");
        assert_eq!(a, Key::new("p").with("ip=1.2.3.4"));
        let mut c = Key::new("p");
        c.push_tagged_parts("op=", &["POST", " ", "/x:y"]);
        assert_eq!(c, Key::new("p").with("op=POST /x:y"));
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

    /// A client address's key is the tuple `("ip=ADDR")` however it is
    /// built, and its text is written out only when asked for.
    #[test]
    fn a_client_address_key_is_one_value_however_built() {
        let v4: IpAddr = "203.0.113.7".parse().unwrap();
        let k = Key::client_ip(v4, 32);
        assert_eq!(k, Key::new("ip=203.0.113.7"));
        assert_eq!(k, Key::parse("ip=203.0.113.7").unwrap());
        assert_eq!(k.text(), "ip=203.0.113.7");
        assert_eq!(k.as_client_ip(), Some((v4, 32)));
        assert_eq!(Key::new("ip=203.0.113.7").as_client_ip(), Some((v4, 32)));
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        let k6 = Key::client_ip(v6, 64);
        // Aggregated: the network, whichever of its addresses built it.
        assert_eq!(k6.text(), "ip=2001%3Adb8%3A%3A/64");
        assert_eq!(Key::parse("ip=2001%3Adb8%3A%3A/64").unwrap(), k6);
        assert_eq!(k6.components(), vec![b"ip=2001:db8::/64".to_vec()]);
        assert_eq!(Key::client_ip("2001:db8::ffff".parse().unwrap(), 64), k6);
        assert_eq!(
            Key::client_ip("203.0.113.200".parse().unwrap(), 24),
            Key::client_ip(v4, 24)
        );
        assert_eq!(Key::client_ip(v4, 0).text(), "ip=0.0.0.0/0");
        // Text naming an address inside the network is another key, as
        // its text is another text.
        assert_ne!(Key::parse("ip=2001%3Adb8%3A%3A1/64").unwrap(), k6);
        // Not the canonical text of an address: stays text, another key.
        for other in [
            "ip=203.0.113.07",
            "ip=203.0.113.7/32",
            "ip=2001:DB8::1",
            "ip=1.2.3.4/33",
            "ip=1.2.3.4/",
            "ip= 1.2.3.4",
        ] {
            let k = Key::new(other);
            assert_eq!(k.as_client_ip(), None, "{other}");
            assert_ne!(k, Key::client_ip(v4, 32));
        }
        // A second component makes it a tuple of two.
        let two = Key::client_ip(v4, 32).with("x");
        assert_eq!(two, Key::new("ip=203.0.113.7").with("x"));
        assert_eq!(two.as_client_ip(), None);
        // An oversized prefix is the width.
        assert_eq!(Key::client_ip(v4, 200), Key::client_ip(v4, 32));
    }

    fn build(parts: &[Vec<u8>]) -> Key {
        let mut k = Key::new(&parts[0]);
        for p in &parts[1..] {
            k.push(p);
        }
        k
    }

    proptest! {
        #[test]
        fn encoding_is_injective_and_round_trips(
            a in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 1..5),
            b in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..6), 1..5),
        ) {
            let (ka, kb) = (build(&a), build(&b));
            prop_assert_eq!(ka == kb, a == b);
            prop_assert_eq!(ka.cmp(&kb) == Ordering::Equal, a == b);
            prop_assert_eq!(ka.components(), a.clone());
            prop_assert_eq!(Key::parse(&ka.text()).unwrap(), ka);
        }

        /// Address keys against text keys of the same and of other tuples:
        /// equal exactly when the tuples are, hashed alike when equal,
        /// ordered by text, and round-tripping through their text.
        #[test]
        fn address_keys_are_the_tuples_they_name(
            bits in any::<u128>(),
            v4 in any::<bool>(),
            prefix in 0u8..=130,
            junk in proptest::collection::vec(any::<u8>(), 0..6),
        ) {
            use std::hash::BuildHasher;
            let ip = if v4 { IpAddr::V4((bits as u32).into()) } else { IpAddr::V6(bits.into()) };
            let key = Key::client_ip(ip, prefix);
            let component = key.components().remove(0);
            let as_text = Key::new(&component);
            prop_assert_eq!(&as_text, &key);
            let hasher = std::hash::RandomState::new();
            prop_assert_eq!(hasher.hash_one(&as_text), hasher.hash_one(&key));
            prop_assert_eq!(Key::parse(&key.text()).unwrap(), key.clone());
            prop_assert_eq!(key.to_string(), key.text().into_owned());
            let mut written = Vec::new();
            key.write_text(&mut written);
            let text = key.text();
            prop_assert_eq!(written.as_slice(), text.as_bytes());
            let other = Key::new(&junk);
            prop_assert_eq!(other == key, junk == component);
            prop_assert_eq!(key.cmp(&other), key.text().as_bytes().cmp(other.text().as_bytes()));
        }

        #[test]
        fn parse_never_panics(s in ".{0,40}") {
            if let Ok(k) = Key::parse(&s) {
                prop_assert_eq!(k.text(), s.as_str());
            }
        }
    }
}
