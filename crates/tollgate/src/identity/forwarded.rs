//! Parsers for forwarding headers: `X-Forwarded-For`, RFC 7239 `Forwarded`
//! and `X-Real-IP`, read **per entry, from the right**.
//!
//! Proxies append: the entries nearest to us (rightmost, in the last header
//! line) were written by the hops we may trust, and everything to their
//! left may have been written by the client. So each line is split into
//! entries and read right to left, and every entry stands on its own: an
//! entry that is malformed, not visible ASCII, `unknown`, obfuscated or cut
//! by a length limit becomes a [`Node`] that is not an address, which stops
//! the trust walk in [`ClientIpResolver`](crate::ClientIpResolver) *at that entry*. Bytes a
//! client wrote to the left can never invalidate what trusted hops wrote to
//! their right.
//!
//! The parsers never fail and never panic. Work is bounded: at most
//! [`MAX_FIELD_LINES`] header lines (the last ones), the last
//! [`MAX_LINE_BYTES`] bytes of each line, and [`MAX_ENTRIES`] entries in
//! all are looked at; what lies beyond a limit is one [`Node::Invalid`], so
//! a walk can never run past it.
//!
//! Public only for the fuzz targets (`cargo fuzz` builds with `--cfg fuzzing`); not a stable API.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use http::HeaderValue;

/// Header lines looked at, counted from the last.
pub const MAX_FIELD_LINES: usize = 16;
/// Bytes of a header line looked at, counted from its end; the entry that
/// straddles the cut is a [`Node::Invalid`].
pub const MAX_LINE_BYTES: usize = 4096;
/// Entries looked at, counted from the right.
pub const MAX_ENTRIES: usize = 64;

/// One hop of a forwarding chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Node {
    /// An IP address (any port is dropped).
    Addr(IpAddr),
    /// The literal `unknown`, or a `Forwarded` element without `for=`.
    Unknown,
    /// An RFC 7239 obfuscated identifier such as `_hidden`.
    Obfuscated,
    /// Anything else, including what was cut off by the input limits.
    Invalid,
}

/// The nodes of every `X-Forwarded-For` line, nearest (rightmost) first.
///
/// An entry is an IPv4 or IPv6 address, optionally as `v4:port`, `[v6]` or
/// `[v6]:port`; `unknown` is [`Node::Unknown`]. Empty list elements (`a,,b`)
/// are skipped, as HTTP's list syntax asks.
pub fn x_forwarded_for<'a, I>(values: I) -> impl Iterator<Item = Node> + 'a
where
    I: IntoIterator<Item = &'a HeaderValue>,
    I::IntoIter: DoubleEndedIterator + 'a,
{
    bounded(values, |line| ListEntries::new(line).map(plain_entry))
}

/// The nodes of every `X-Real-IP` line, nearest first: each line must hold
/// exactly one address.
pub fn x_real_ip<'a, I>(values: I) -> impl Iterator<Item = Node> + 'a
where
    I: IntoIterator<Item = &'a HeaderValue>,
    I::IntoIter: DoubleEndedIterator + 'a,
{
    bounded(values, |line| {
        std::iter::once(if line.len() > MAX_LINE_BYTES {
            Node::Invalid
        } else {
            plain_entry(Entry::Whole(trim(line)))
        })
    })
}

/// The `for=` node of every RFC 7239 `Forwarded` element, nearest first.
///
/// Element boundaries are found from the right, outside quoted strings;
/// each element is then checked against the RFC's grammar on its own. An
/// element without `for=` is [`Node::Unknown`].
pub fn forwarded<'a, I>(values: I) -> impl Iterator<Item = Node> + 'a
where
    I: IntoIterator<Item = &'a HeaderValue>,
    I::IntoIter: DoubleEndedIterator + 'a,
{
    bounded(values, ForwardedElements::new)
}

/// Lines last to first, each split into nodes by `per_line`, within the
/// limits.
fn bounded<'a, I, L>(
    values: I,
    per_line: impl Fn(&'a [u8]) -> L + 'a,
) -> impl Iterator<Item = Node> + 'a
where
    I: IntoIterator<Item = &'a HeaderValue>,
    I::IntoIter: DoubleEndedIterator + 'a,
    L: Iterator<Item = Node> + 'a,
{
    let mut lines = values.into_iter().rev();
    let mut lines_left = MAX_FIELD_LINES;
    let mut entries_left = MAX_ENTRIES;
    let mut current: Option<L> = None;
    let mut finished = false;
    std::iter::from_fn(move || {
        if finished {
            return None;
        }
        loop {
            if let Some(node) = current.as_mut().and_then(Iterator::next) {
                if entries_left == 0 {
                    finished = true;
                    return Some(Node::Invalid);
                }
                entries_left -= 1;
                return Some(node);
            }
            let line = lines.next()?;
            if lines_left == 0 {
                finished = true;
                return Some(Node::Invalid);
            }
            lines_left -= 1;
            current = Some(per_line(line.as_bytes()));
        }
    })
}

fn trim(bytes: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = bytes.iter().position(|b| !is_ows(b)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |i| i + 1);
    &bytes[start..end]
}

/// One list element as found from the right.
#[derive(Debug, Clone, Copy)]
enum Entry<'a> {
    /// A whole element (trimmed of optional whitespace).
    Whole(&'a [u8]),
    /// The leftmost fragment of a line read only from its end.
    Cut,
}

/// The comma-separated elements of one line, right to left, skipping empty
/// ones; a line over [`MAX_LINE_BYTES`] is read from its end and the
/// element straddling the cut is [`Entry::Cut`].
struct ListEntries<'a> {
    rest: Option<&'a [u8]>,
    cut: bool,
}

impl<'a> ListEntries<'a> {
    fn new(line: &'a [u8]) -> Self {
        let cut = line.len() > MAX_LINE_BYTES;
        let window = if cut {
            &line[line.len() - MAX_LINE_BYTES..]
        } else {
            line
        };
        Self {
            rest: Some(window),
            cut,
        }
    }
}

impl<'a> Iterator for ListEntries<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        loop {
            let rest = self.rest?;
            let element = match rest.iter().rposition(|&b| b == b',') {
                Some(i) => {
                    self.rest = Some(&rest[..i]);
                    &rest[i + 1..]
                }
                None => {
                    self.rest = None;
                    if self.cut {
                        return Some(Entry::Cut);
                    }
                    rest
                }
            };
            let element = trim(element);
            if !element.is_empty() {
                return Some(Entry::Whole(element));
            }
        }
    }
}

fn plain_entry(entry: Entry<'_>) -> Node {
    let Entry::Whole(bytes) = entry else {
        return Node::Invalid;
    };
    // Visible ASCII only: anything else is not an address, whatever it is.
    if !bytes.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Node::Invalid;
    }
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Node::Invalid;
    };
    if text.eq_ignore_ascii_case("unknown") {
        return Node::Unknown;
    }
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Node::Addr(ip);
    }
    if let Ok(sa) = text.parse::<SocketAddr>() {
        return Node::Addr(sa.ip());
    }
    if let Some(inner) = text.strip_prefix('[').and_then(|e| e.strip_suffix(']'))
        && let Ok(v6) = inner.parse::<Ipv6Addr>()
    {
        return Node::Addr(IpAddr::V6(v6));
    }
    Node::Invalid
}

/// The elements of one `Forwarded` line, right to left, each parsed to its
/// `for=` node.
struct ForwardedElements<'a> {
    inner: ListScan<'a>,
}

impl<'a> ForwardedElements<'a> {
    fn new(line: &'a [u8]) -> Self {
        Self {
            inner: ListScan::new(line),
        }
    }
}

impl Iterator for ForwardedElements<'_> {
    type Item = Node;

    fn next(&mut self) -> Option<Node> {
        match self.inner.next()? {
            Entry::Whole(element) => Some(forwarded_element(element)),
            Entry::Cut => Some(Node::Invalid),
        }
    }
}

/// Like [`ListEntries`], but commas inside quoted strings do not separate.
/// Quotes are paired from the right: a `"` inside a quoted string ends it
/// unless an odd number of backslashes precede it. When a quote is still
/// open at the left end, the rest of the line is one [`Entry::Cut`]: its
/// boundaries cannot be known. Whether an element found this way is
/// well-formed is checked by [`forwarded_element`], left to right.
struct ListScan<'a> {
    rest: Option<&'a [u8]>,
    cut: bool,
}

impl<'a> ListScan<'a> {
    fn new(line: &'a [u8]) -> Self {
        let entries = ListEntries::new(line);
        Self {
            rest: entries.rest,
            cut: entries.cut,
        }
    }
}

impl<'a> Iterator for ListScan<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        loop {
            let rest = self.rest?;
            let mut quoted = false;
            let mut boundary = None;
            for i in (0..rest.len()).rev() {
                match rest[i] {
                    b'"' if !quoted => quoted = true,
                    b'"' => {
                        let escapes = rest[..i].iter().rev().take_while(|&&b| b == b'\\').count();
                        if escapes % 2 == 0 {
                            quoted = false;
                        }
                    }
                    b',' if !quoted => {
                        boundary = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            let element = match boundary {
                Some(i) => {
                    self.rest = Some(&rest[..i]);
                    &rest[i + 1..]
                }
                None => {
                    self.rest = None;
                    if quoted || self.cut {
                        return Some(Entry::Cut);
                    }
                    rest
                }
            };
            let element = trim(element);
            if !element.is_empty() {
                return Some(Entry::Whole(element));
            }
        }
    }
}

/// The `for=` node of one element: `pair *( ";" pair )` with
/// `pair = token "=" ( token / quoted-string )`, optional whitespace
/// around `;` tolerated. Broken syntax or two `for` parameters is
/// [`Node::Invalid`]; no `for` is [`Node::Unknown`].
fn forwarded_element(element: &[u8]) -> Node {
    let mut node = None;
    let mut rest = element;
    loop {
        rest = trim(rest);
        let Some(eq) = rest.iter().position(|&b| b == b'=') else {
            return Node::Invalid;
        };
        let name = &rest[..eq];
        if name.is_empty() || !name.iter().copied().all(is_tchar) {
            return Node::Invalid;
        }
        rest = &rest[eq + 1..];
        let (value, after) = if let Some(quoted) = rest.strip_prefix(b"\"") {
            match quoted_string(quoted) {
                Some((value, consumed)) => (value, &quoted[consumed..]),
                None => return Node::Invalid,
            }
        } else {
            let end = rest
                .iter()
                .position(|&b| !is_tchar(b))
                .unwrap_or(rest.len());
            if end == 0 {
                return Node::Invalid;
            }
            (rest[..end].to_vec(), &rest[end..])
        };
        if name.eq_ignore_ascii_case(b"for") {
            if node.is_some() {
                // Two `for` parameters in one element: ambiguous.
                return Node::Invalid;
            }
            node = Some(forwarded_node(&value));
        }
        rest = trim(after);
        match rest.first() {
            None => return node.unwrap_or(Node::Unknown),
            Some(b';') => rest = &rest[1..],
            Some(_) => return Node::Invalid,
        }
    }
}

/// A quoted-string body (after the opening quote): its value and the bytes
/// consumed, closing quote included. Only visible ASCII, space and tab may
/// appear (obs-text never names an address).
fn quoted_string(s: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        match s[i] {
            b'"' => return Some((out, i + 1)),
            b'\\' => {
                let escaped = *s.get(i + 1)?;
                if !is_qdtext_or_quote(escaped) {
                    return None;
                }
                out.push(escaped);
                i += 2;
                continue;
            }
            b if is_qdtext_or_quote(b) => out.push(b),
            _ => return None,
        }
        i += 1;
    }
    None
}

fn is_qdtext_or_quote(b: u8) -> bool {
    b == b'\t' || (0x20..=0x7e).contains(&b)
}

fn forwarded_node(value: &[u8]) -> Node {
    let Ok(value) = std::str::from_utf8(value) else {
        return Node::Invalid;
    };
    if value.eq_ignore_ascii_case("unknown") {
        return Node::Unknown;
    }
    if value.starts_with('_') {
        return Node::Obfuscated;
    }
    // "[" IPv6 "]" [ ":" port ]
    if let Some(rest) = value.strip_prefix('[') {
        let Some(close) = rest.find(']') else {
            return Node::Invalid;
        };
        let (addr, port) = (&rest[..close], &rest[close + 1..]);
        return match (addr.parse::<Ipv6Addr>(), valid_port(port)) {
            (Ok(v6), true) => Node::Addr(IpAddr::V6(v6)),
            _ => Node::Invalid,
        };
    }
    // IPv4 [ ":" port ]
    let (addr, port) = match value.find(':') {
        Some(i) => (&value[..i], &value[i..]),
        None => (value, ""),
    };
    match (addr.parse::<Ipv4Addr>(), valid_port(port)) {
        (Ok(v4), true) => Node::Addr(IpAddr::V4(v4)),
        _ => Node::Invalid,
    }
}

fn valid_port(port: &str) -> bool {
    let Some(p) = port.strip_prefix(':') else {
        return port.is_empty();
    };
    // node-port = port / obfport
    (!p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
        || (p.starts_with('_')
            && p.len() > 1
            && p.bytes()
                .skip(1)
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-'))
}

fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    fn raw(bytes: &[u8]) -> HeaderValue {
        HeaderValue::from_bytes(bytes).unwrap()
    }

    fn ip(s: &str) -> Node {
        Node::Addr(s.parse().unwrap())
    }

    /// Nodes left to right, as written, for readable expectations.
    fn xff(lines: &[HeaderValue]) -> Vec<Node> {
        let mut nodes: Vec<Node> = x_forwarded_for(lines).collect();
        nodes.reverse();
        nodes
    }

    fn fwd(lines: &[HeaderValue]) -> Vec<Node> {
        let mut nodes: Vec<Node> = forwarded(lines).collect();
        nodes.reverse();
        nodes
    }

    #[test]
    fn rfc7239_examples() {
        // RFC 7239 section 4 and 7.1-7.4 examples.
        assert_eq!(fwd(&[hv(r#"for="_gazonk""#)]), [Node::Obfuscated]);
        assert_eq!(
            fwd(&[hv(r#"For="[2001:db8:cafe::17]:4711""#)]),
            [ip("2001:db8:cafe::17")]
        );
        assert_eq!(
            fwd(&[hv("for=192.0.2.60;proto=http;by=203.0.113.43")]),
            [ip("192.0.2.60")]
        );
        assert_eq!(
            fwd(&[hv("for=192.0.2.43, for=198.51.100.17")]),
            [ip("192.0.2.43"), ip("198.51.100.17")]
        );
        assert_eq!(
            fwd(&[
                hv("for=192.0.2.43"),
                hv("for=198.51.100.17;by=203.0.113.60;proto=http;host=example.com"),
            ]),
            [ip("192.0.2.43"), ip("198.51.100.17")]
        );
        assert_eq!(
            fwd(&[hv(
                r#"for=192.0.2.43, for="[2001:db8:cafe::17]", for=unknown"#
            )]),
            [ip("192.0.2.43"), ip("2001:db8:cafe::17"), Node::Unknown]
        );
        assert_eq!(fwd(&[hv(r#"for="192.0.2.43:47011""#)]), [ip("192.0.2.43")]);
        assert_eq!(fwd(&[hv(r#"for="_hidden:_port""#)]), [Node::Obfuscated]);
        // Quoted commas and semicolons do not split elements.
        assert_eq!(
            fwd(&[hv(r#"for=192.0.2.1;host="a,b;c", for=192.0.2.2"#)]),
            [ip("192.0.2.1"), ip("192.0.2.2")]
        );
        assert_eq!(
            fwd(&[hv(r#"for=192.0.2.1;host="a\"b,c", for=192.0.2.2"#)]),
            [ip("192.0.2.1"), ip("192.0.2.2")]
        );
    }

    #[test]
    fn a_broken_forwarded_element_is_invalid_on_its_own() {
        for bad in [
            "for=",
            "for",
            r#"for="unterminated"#,
            "for=2001:db8::1",
            r#"for="[2001:db8::1""#,
            r#"for="[::1]:99999999""#,
            "for=1.2.3.4;for=5.6.7.8",
            "for=1.2.3.4 garbage",
            "=1.2.3.4",
            r#"for="1.2.3.4\"#,
            r#"for="1.2.3.4:0x10""#,
        ] {
            // The element is invalid; the trusted hop's element to its right
            // still counts.
            let line = format!("{bad}, for=198.51.100.17");
            assert_eq!(
                fwd(&[hv(&line)]).last(),
                Some(&ip("198.51.100.17")),
                "{line:?}"
            );
            let nodes = fwd(&[hv(bad)]);
            assert!(
                nodes.iter().all(|n| !matches!(n, Node::Addr(_))),
                "{bad:?} gave {nodes:?}"
            );
        }
        assert_eq!(fwd(&[hv("by=1.2.3.4")]), [Node::Unknown]);
        // A client's unterminated quote cannot swallow the proxy's element.
        assert_eq!(
            fwd(&[hv(r#"for="x, for=1.2.3.4"#)]),
            [Node::Invalid, ip("1.2.3.4")]
        );
        // Nor can non-ASCII bytes.
        assert_eq!(
            fwd(&[raw(b"for=\"\xff\", for=1.2.3.4")]),
            [Node::Invalid, ip("1.2.3.4")]
        );
    }

    #[test]
    fn x_forwarded_for_entries_and_lines() {
        assert_eq!(
            xff(&[hv("203.0.113.9, 198.51.100.8"), hv(" 10.0.0.1 ")]),
            [ip("203.0.113.9"), ip("198.51.100.8"), ip("10.0.0.1")]
        );
        assert_eq!(
            xff(&[hv(
                "[2001:db8::1]:443, 1.2.3.4:80, [::1], unknown, nonsense, ,,"
            )]),
            [
                ip("2001:db8::1"),
                ip("1.2.3.4"),
                ip("::1"),
                Node::Unknown,
                Node::Invalid,
            ]
        );
        // Arabic-Indic digits are not an address.
        let arabic = HeaderValue::from_bytes("١.٢.٣.٤".as_bytes()).unwrap();
        assert_eq!(xff(&[arabic]), [Node::Invalid]);
    }

    /// Finding 1 of the identity audit: a client-written byte on the same
    /// line as the proxy's report invalidated the whole line.
    #[test]
    fn client_bytes_left_of_a_proxy_entry_do_not_hide_it() {
        for client in [
            &b"\xff"[..],
            b"1.2.3.4\xff",
            b"\x80\x81, 6.6.6.6",
            b"\"",
            b"[",
            b"a b c",
            b"\t",
        ] {
            let mut line = client.to_vec();
            line.extend_from_slice(b", 198.51.100.8");
            let nodes = xff(&[raw(&line)]);
            assert_eq!(nodes.last(), Some(&ip("198.51.100.8")), "{line:?}");
        }
    }

    #[test]
    fn long_lines_are_read_from_their_end() {
        let mut line = "9".repeat(5000);
        line.push_str(", 198.51.100.8");
        let nodes = xff(&[hv(&line)]);
        assert_eq!(nodes, [Node::Invalid, ip("198.51.100.8")]);
        // The entry straddling the cut is invalid even if its tail parses.
        let long = hv(&"1.1.1.1,".repeat(1000));
        let nodes: Vec<Node> = x_forwarded_for([&long]).collect();
        assert_eq!(nodes.len(), MAX_ENTRIES + 1);
        assert_eq!(nodes[0], ip("1.1.1.1"));
        assert_eq!(nodes[MAX_ENTRIES], Node::Invalid);
        // The window starts at "1.2.3.4": it looks whole, but was cut.
        let pad = MAX_LINE_BYTES + 1 - "X1.2.3.4,".len() - "5.6.7.8".len();
        let cut = format!("X1.2.3.4,{}5.6.7.8", " ".repeat(pad));
        assert_eq!(cut.len(), MAX_LINE_BYTES + 1);
        assert_eq!(xff(&[hv(&cut)]), [Node::Invalid, ip("5.6.7.8")]);
        // The same for Forwarded.
        let mut line = format!("for=\"{}\"", "x".repeat(5000));
        line.push_str(", for=198.51.100.8");
        assert_eq!(fwd(&[hv(&line)]), [Node::Invalid, ip("198.51.100.8")]);
    }

    #[test]
    fn inputs_are_bounded_from_the_right() {
        let many = hv(&vec!["9.9.9.9"; 200].join(","));
        let nodes: Vec<Node> = x_forwarded_for([&many]).collect();
        assert_eq!(nodes.len(), MAX_ENTRIES + 1);
        assert_eq!(nodes[MAX_ENTRIES], Node::Invalid);
        let lines: Vec<HeaderValue> = (0..40).map(|i| hv(&format!("10.0.0.{i}"))).collect();
        let nodes: Vec<Node> = x_forwarded_for(&lines).collect();
        assert_eq!(nodes.len(), MAX_FIELD_LINES + 1);
        assert_eq!(nodes[0], ip("10.0.0.39"));
        assert_eq!(nodes[MAX_FIELD_LINES], Node::Invalid);
    }

    #[test]
    fn x_real_ip_is_one_address_per_line() {
        let nodes: Vec<Node> = x_real_ip([&hv(" 1.2.3.4 ")]).collect();
        assert_eq!(nodes, [ip("1.2.3.4")]);
        let nodes: Vec<Node> = x_real_ip([&hv("1.2.3.4, 5.6.7.8")]).collect();
        assert_eq!(nodes, [Node::Invalid]);
        let nodes: Vec<Node> = x_real_ip([&raw(b"\xff"), &hv("5.6.7.8")]).collect();
        assert_eq!(nodes, [ip("5.6.7.8"), Node::Invalid]);
    }
}
