//! Parsers for forwarding headers: `X-Forwarded-For`, RFC 7239 `Forwarded`
//! and `X-Real-IP`.
//!
//! They never fail and never panic: every entry becomes a [`Node`], and
//! anything that is not an address (garbage, `unknown`, an obfuscated
//! identifier) is a node that stops the right-to-left walk in
//! [`crate::ClientIpResolver`]. Input is bounded: at most
//! [`MAX_FIELD_LINES`] header lines of at most [`MAX_LINE_BYTES`] bytes and
//! at most [`MAX_ENTRIES`] entries are looked at, always the rightmost ones
//! (the ones nearest to us); what lies beyond becomes a [`Node::Invalid`]
//! so that the walk can never run past it.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::HeaderValue;

/// Header lines looked at, counted from the last.
pub const MAX_FIELD_LINES: usize = 16;
/// Longest header line parsed; a longer one is a single [`Node::Invalid`].
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

/// Nodes of a chain, leftmost (farthest from us) first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chain {
    /// The nodes, left to right.
    pub nodes: Vec<Node>,
}

fn bounded_lines<'a>(
    values: impl IntoIterator<Item = &'a HeaderValue>,
) -> (bool, Vec<&'a HeaderValue>) {
    let all: Vec<&HeaderValue> = values.into_iter().collect();
    let skip = all.len().saturating_sub(MAX_FIELD_LINES);
    (skip > 0, all[skip..].to_vec())
}

fn finish(cut: bool, mut nodes: Vec<Node>) -> Chain {
    let mut cut = cut;
    if nodes.len() > MAX_ENTRIES {
        nodes.drain(..nodes.len() - MAX_ENTRIES);
        cut = true;
    }
    if cut {
        nodes.insert(0, Node::Invalid);
    }
    Chain { nodes }
}

/// Parses every `X-Forwarded-For` line (comma-separated entries).
///
/// An entry is an IPv4 or IPv6 address, optionally as `v4:port`,
/// `[v6]` or `[v6]:port`; `unknown` is [`Node::Unknown`].
pub fn x_forwarded_for<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> Chain {
    let (cut, lines) = bounded_lines(values);
    let mut nodes = Vec::new();
    for line in lines {
        match line_str(line) {
            Some(text) => nodes.extend(
                text.split(',')
                    .map(|e| plain_entry(e.trim_matches([' ', '\t']))),
            ),
            None => nodes.push(Node::Invalid),
        }
    }
    finish(cut, nodes)
}

/// Parses every `X-Real-IP` line: each must hold exactly one address.
pub fn x_real_ip<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> Chain {
    let (cut, lines) = bounded_lines(values);
    let nodes = lines
        .into_iter()
        .map(|line| match line_str(line) {
            Some(text) if !text.contains(',') => plain_entry(text.trim_matches([' ', '\t'])),
            _ => Node::Invalid,
        })
        .collect();
    finish(cut, nodes)
}

/// Parses every RFC 7239 `Forwarded` line into the `for=` node of each
/// element.
pub fn forwarded<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> Chain {
    let (cut, lines) = bounded_lines(values);
    let mut nodes = Vec::new();
    for line in lines {
        match line_str(line).and_then(forwarded_elements) {
            Some(mut elements) => nodes.append(&mut elements),
            None => nodes.push(Node::Invalid),
        }
    }
    finish(cut, nodes)
}

fn line_str(value: &HeaderValue) -> Option<&str> {
    if value.len() > MAX_LINE_BYTES {
        return None;
    }
    value.to_str().ok()
}

fn plain_entry(entry: &str) -> Node {
    if entry.eq_ignore_ascii_case("unknown") {
        return Node::Unknown;
    }
    if let Ok(ip) = entry.parse::<IpAddr>() {
        return Node::Addr(ip);
    }
    if let Ok(sa) = entry.parse::<SocketAddr>() {
        return Node::Addr(sa.ip());
    }
    if let Some(inner) = entry.strip_prefix('[').and_then(|e| e.strip_suffix(']')) {
        if let Ok(v6) = inner.parse::<Ipv6Addr>() {
            return Node::Addr(IpAddr::V6(v6));
        }
    }
    Node::Invalid
}

/// Splits a `Forwarded` line into elements and returns each element's
/// `for=` node; `None` if the syntax is broken.
fn forwarded_elements(line: &str) -> Option<Vec<Node>> {
    let mut nodes = Vec::new();
    let mut element_for: Option<Node> = None;
    let mut rest = line;
    loop {
        rest = rest.trim_start_matches([' ', '\t']);
        if rest.is_empty() {
            // An empty element (e.g. a trailing comma) is tolerated.
            break;
        }
        // pair = token "=" value
        let eq = rest.find('=')?;
        let name = rest[..eq].trim_end_matches([' ', '\t']);
        if name.is_empty() || !name.bytes().all(is_tchar) {
            return None;
        }
        rest = &rest[eq + 1..];
        let (value, after) = if let Some(quoted) = rest.strip_prefix('"') {
            let (v, consumed) = quoted_string(quoted)?;
            (v, &quoted[consumed..])
        } else {
            let end = rest.find(|c: char| !is_tchar_char(c)).unwrap_or(rest.len());
            if end == 0 {
                return None;
            }
            (rest[..end].to_owned(), &rest[end..])
        };
        if name.eq_ignore_ascii_case("for") {
            if element_for.is_some() {
                // Two `for` parameters in one element: ambiguous.
                return None;
            }
            element_for = Some(forwarded_node(&value));
        }
        rest = after.trim_start_matches([' ', '\t']);
        match rest.as_bytes().first() {
            Some(b';') => rest = &rest[1..],
            Some(b',') => {
                nodes.push(element_for.take().unwrap_or(Node::Unknown));
                rest = &rest[1..];
                // Skip empty elements.
                while let Some(r) = rest.trim_start_matches([' ', '\t']).strip_prefix(',') {
                    rest = r;
                }
            }
            None => break,
            Some(_) => return None,
        }
    }
    if let Some(node) = element_for.take() {
        nodes.push(node);
    } else if !line.trim().is_empty() && !line.trim_end().ends_with(',') {
        nodes.push(Node::Unknown);
    }
    Some(nodes)
}

/// Parses a quoted-string body (after the opening quote); returns the value
/// and the bytes consumed including the closing quote.
fn quoted_string(s: &str) -> Option<(String, usize)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, i + 1)),
            '\\' => out.push(chars.next()?.1),
            c => out.push(c),
        }
    }
    None
}

fn forwarded_node(value: &str) -> Node {
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
    match (addr.parse::<std::net::Ipv4Addr>(), valid_port(port)) {
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

fn is_tchar_char(c: char) -> bool {
    c.is_ascii() && is_tchar(c as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hv(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    fn ip(s: &str) -> Node {
        Node::Addr(s.parse().unwrap())
    }

    #[test]
    fn rfc7239_examples() {
        // RFC 7239 section 4 and 7.1-7.4 examples.
        let c = forwarded([&hv(r#"for="_gazonk""#)]);
        assert_eq!(c.nodes, [Node::Obfuscated]);
        let c = forwarded([&hv(r#"For="[2001:db8:cafe::17]:4711""#)]);
        assert_eq!(c.nodes, [ip("2001:db8:cafe::17")]);
        let c = forwarded([&hv("for=192.0.2.60;proto=http;by=203.0.113.43")]);
        assert_eq!(c.nodes, [ip("192.0.2.60")]);
        let c = forwarded([&hv("for=192.0.2.43, for=198.51.100.17")]);
        assert_eq!(c.nodes, [ip("192.0.2.43"), ip("198.51.100.17")]);
        let c = forwarded([
            &hv("for=192.0.2.43"),
            &hv("for=198.51.100.17;by=203.0.113.60;proto=http;host=example.com"),
        ]);
        assert_eq!(c.nodes, [ip("192.0.2.43"), ip("198.51.100.17")]);
        let c = forwarded([&hv(
            r#"for=192.0.2.43, for="[2001:db8:cafe::17]", for=unknown"#,
        )]);
        assert_eq!(
            c.nodes,
            [ip("192.0.2.43"), ip("2001:db8:cafe::17"), Node::Unknown]
        );
        let c = forwarded([&hv(r#"for="192.0.2.43:47011""#)]);
        assert_eq!(c.nodes, [ip("192.0.2.43")]);
        let c = forwarded([&hv(r#"for="_hidden:_port""#)]);
        assert_eq!(c.nodes, [Node::Obfuscated]);
    }

    #[test]
    fn hostile_forwarded_values() {
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
        ] {
            let c = forwarded([&hv(bad)]);
            assert!(
                c.nodes.iter().all(|n| !matches!(n, Node::Addr(_)))
                    || c.nodes.contains(&Node::Invalid),
                "{bad:?} gave {c:?}"
            );
        }
        assert_eq!(forwarded([&hv("by=1.2.3.4")]).nodes, [Node::Unknown]);
        assert_eq!(
            forwarded([&hv(r#"for="1.2.3.4:0x10""#)]).nodes,
            [Node::Invalid]
        );
    }

    #[test]
    fn x_forwarded_for_entries_and_lines() {
        let c = x_forwarded_for([&hv("203.0.113.9, 198.51.100.8"), &hv(" 10.0.0.1 ")]);
        assert_eq!(
            c.nodes,
            [ip("203.0.113.9"), ip("198.51.100.8"), ip("10.0.0.1")]
        );
        let c = x_forwarded_for([&hv(
            "[2001:db8::1]:443, 1.2.3.4:80, [::1], unknown, nonsense, ",
        )]);
        assert_eq!(
            c.nodes,
            [
                ip("2001:db8::1"),
                ip("1.2.3.4"),
                ip("::1"),
                Node::Unknown,
                Node::Invalid,
                Node::Invalid
            ]
        );
        // Non-UTF-8 / opaque bytes are one invalid node.
        let opaque = HeaderValue::from_bytes(b"1.2.3.4\xff").unwrap();
        assert_eq!(x_forwarded_for([&opaque]).nodes, [Node::Invalid]);
        // Arabic-Indic digits are not an address.
        let arabic = HeaderValue::from_bytes("١.٢.٣.٤".as_bytes()).unwrap();
        assert_eq!(x_forwarded_for([&arabic]).nodes, [Node::Invalid]);
    }

    #[test]
    fn inputs_are_bounded_from_the_right() {
        let long = hv(&"1.1.1.1,".repeat(1000));
        assert_eq!(x_forwarded_for([&long]).nodes, [Node::Invalid]);
        let many = hv(&vec!["9.9.9.9"; 200].join(","));
        let c = x_forwarded_for([&many]);
        assert_eq!(c.nodes.len(), MAX_ENTRIES + 1);
        assert_eq!(c.nodes[0], Node::Invalid);
        let lines: Vec<HeaderValue> = (0..40).map(|i| hv(&format!("10.0.0.{i}"))).collect();
        let c = x_forwarded_for(&lines);
        assert_eq!(c.nodes.len(), MAX_FIELD_LINES + 1);
        assert_eq!(c.nodes[0], Node::Invalid);
        assert_eq!(*c.nodes.last().unwrap(), ip("10.0.0.39"));
    }

    #[test]
    fn x_real_ip_is_one_address_per_line() {
        assert_eq!(x_real_ip([&hv(" 1.2.3.4 ")]).nodes, [ip("1.2.3.4")]);
        assert_eq!(x_real_ip([&hv("1.2.3.4, 5.6.7.8")]).nodes, [Node::Invalid]);
    }
}
