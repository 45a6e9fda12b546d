//! [`ClientIpResolver`]: the client address from the connected peer and,
//! through trusted proxies only, the forwarding headers.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use tollgate_budget::Key;

use super::forwarded::{self, Node};

/// The connected peer's address, for servers that are not axum: insert it
/// into each request's extensions when accepting the connection.
///
/// With the `axum` feature, axum's `ConnectInfo<SocketAddr>` is read too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddr(pub SocketAddr);

/// Which forwarding header a trusted proxy writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for=proxy1`.
    Forwarded,
    /// `X-Real-IP: client`, one address per line.
    XRealIp,
}

impl ForwardedHeader {
    /// The client address by the trust walk over this header's entries,
    /// nearest first.
    fn walk(self, peer: IpAddr, headers: &HeaderMap, trusted: &[IpNet]) -> IpAddr {
        match self {
            ForwardedHeader::XForwardedFor => walk(
                peer,
                forwarded::x_forwarded_for(headers.get_all("x-forwarded-for")),
                trusted,
            ),
            ForwardedHeader::Forwarded => walk(
                peer,
                forwarded::forwarded(headers.get_all("forwarded")),
                trusted,
            ),
            ForwardedHeader::XRealIp => walk(
                peer,
                forwarded::x_real_ip(headers.get_all("x-real-ip")),
                trusted,
            ),
        }
    }
}

/// A client address as used in keys: normalised (IPv4-mapped IPv6 is IPv4;
/// IPv6 is in canonical form) and, if configured, masked to a prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientIp {
    addr: IpAddr,
    prefix: u8,
}

impl ClientIp {
    /// The (masked) address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length the address was masked to (32 or 128 if none).
    pub fn prefix(&self) -> u8 {
        self.prefix
    }
}

impl fmt::Display for ClientIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let full = if self.addr.is_ipv4() { 32 } else { 128 };
        if self.prefix == full {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.prefix)
        }
    }
}

impl ClientIp {
    /// The [`Display`](fmt::Display) text, written into a buffer on the
    /// stack: keys are built per request, and this keeps the address from
    /// costing an allocation (and, for IPv4, the formatting machinery).
    pub(crate) fn text(&self) -> IpText {
        let mut out = IpText {
            buf: [0; IpText::CAPACITY],
            len: 0,
        };
        match self.addr {
            IpAddr::V4(v4) if self.prefix == 32 => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        out.push(b'.');
                    }
                    if octet >= 100 {
                        out.push(b'0' + octet / 100);
                    }
                    if octet >= 10 {
                        out.push(b'0' + octet / 10 % 10);
                    }
                    out.push(b'0' + octet % 10);
                }
            }
            _ => {
                // The longest form, an IPv4-mapped IPv6 address with a
                // prefix, is 49 bytes: it always fits.
                let _ = fmt::Write::write_fmt(&mut out, format_args!("{self}"));
            }
        }
        out
    }
}

/// A [`ClientIp`]'s text on the stack; see [`ClientIp::text`].
pub(crate) struct IpText {
    buf: [u8; IpText::CAPACITY],
    len: usize,
}

impl IpText {
    const CAPACITY: usize = 64;

    fn push(&mut self, b: u8) {
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = b;
            self.len += 1;
        }
    }
}

impl fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let slot = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        slot.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

impl AsRef<[u8]> for IpText {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Why no client address could be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClientIpError {
    /// The request carries no peer address: a server configuration error.
    #[error(
        "no peer address in the request extensions: serve axum with \
         `into_make_service_with_connect_info::<SocketAddr>()`, or insert \
         `tollgate::identity::PeerAddr` for each connection"
    )]
    MissingPeer,
    /// The single trusted proxy sent something other than exactly one address.
    #[error("trusted proxy {proxy} must send exactly one address in {header}, got {value:?}")]
    NotSingleAddress {
        /// The proxy's address.
        proxy: IpAddr,
        /// The header it should have set.
        header: String,
        /// What it sent, cut to 64 bytes.
        value: String,
    },
}

/// A network written in IPv4-mapped form with a prefix shorter than /96 (it
/// names no IPv4 network), refused by [`ClientIpResolver::trusting`] and
/// [`Exemption::networks`](crate::Exemption::networks).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "network {network} is written as an IPv4-mapped address but its prefix is shorter \
     than /96, so it names no IPv4 network: client addresses are compared as IPv4 when \
     they are IPv4-mapped (write ::ffff:10.0.0.0/104 or 10.0.0.0/8)"
)]
pub struct InvalidNetwork {
    network: IpNet,
}

impl InvalidNetwork {
    /// The network that was refused.
    pub fn network(&self) -> IpNet {
        self.network
    }
}

/// An invalid prefix length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("prefix length {prefix} is out of range for IPv{family} (1..={max})")]
pub struct InvalidPrefix {
    prefix: u8,
    family: u8,
    max: u8,
}

#[derive(Debug, Clone)]
enum Mode {
    PeerOnly,
    Recursive {
        trusted: Arc<[IpNet]>,
        header: ForwardedHeader,
    },
    SingleProxy {
        proxy: IpAddr,
        header: HeaderName,
    },
}

/// Resolves the client address of a request.
///
/// - [`ClientIpResolver::peer_only`] (default): the connected peer; forwarding
///   headers are ignored.
/// - [`ClientIpResolver::trusting`]: when the peer is inside a trusted
///   network, walk the forwarding entries from the right past trusted hops
///   and take the first address that is not trusted, like nginx's
///   `real_ip_recursive on`. If every hop is trusted the leftmost address is
///   taken. Every header line is split into entries and each entry is read
///   on its own, right to left (at most the last 16 lines, the last 4096
///   bytes of each and 64 entries are read): an entry that is not an address (`unknown`, obfuscated,
///   malformed, non-ASCII, or cut by a limit) stops the walk *at that
///   entry*, keyed by the trusted hop that reported it. What a client
///   writes to the left of a trusted hop's entry can therefore never
///   change the address that hop reported, and a caller can never choose
///   its key by sending junk.
/// - [`ClientIpResolver::single_proxy`]: the strictest contract —
///   one trusted proxy that overwrites one header with exactly one address;
///   anything else from it is an error ([`ClientIpError::NotSingleAddress`]).
///
/// ```
/// use tollgate::{ClientIpResolver, identity::ForwardedHeader};
/// let resolver = ClientIpResolver::trusting(["10.0.0.0/8".parse()?], ForwardedHeader::XForwardedFor)?;
/// let mut headers = http::HeaderMap::new();
/// headers.insert("x-forwarded-for", "203.0.113.7, 10.1.1.1".parse().unwrap());
/// let ip = resolver.resolve_from("10.0.0.2".parse()?, &headers)?;
/// assert_eq!(ip.to_string(), "203.0.113.7");
/// // An untrusted peer cannot choose its address.
/// let ip = resolver.resolve_from("198.51.100.8".parse()?, &headers)?;
/// assert_eq!(ip.to_string(), "198.51.100.8");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ClientIpResolver {
    mode: Mode,
    v4_prefix: u8,
    v6_prefix: u8,
}

impl Default for ClientIpResolver {
    fn default() -> Self {
        Self::peer_only()
    }
}

/// IPv4-mapped IPv6 collapses to IPv4; other addresses are unchanged.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// A network in the form peers are compared in: an IPv4-mapped network of
/// at least /96 is the IPv4 network it names. A mapped network shorter than
/// /96 could only ever match mapped addresses, which peers never are after
/// [`canonical`], so it is refused.
fn canonical_net(net: IpNet) -> Result<IpNet, InvalidNetwork> {
    let IpNet::V6(v6) = net else {
        return Ok(net.trunc());
    };
    // Written as an IPv4-mapped address: the user means IPv4.
    let Some(v4) = v6.addr().to_ipv4_mapped() else {
        return Ok(net.trunc());
    };
    v6.prefix_len()
        .checked_sub(96)
        .and_then(|prefix| ipnet::Ipv4Net::new(v4, prefix).ok())
        .map(|v4net| IpNet::V4(v4net.trunc()))
        .ok_or(InvalidNetwork { network: net })
}

/// `nets` in the form client addresses are compared in (see
/// [`ClientIpResolver::trusting`]): mapped networks become IPv4 ones, and an
/// IPv6 network that holds the whole IPv4-mapped range (e.g. `::/0`) also
/// holds every IPv4 address.
pub(crate) fn canonical_nets(
    nets: impl IntoIterator<Item = IpNet>,
) -> Result<Vec<IpNet>, InvalidNetwork> {
    let mut out = Vec::new();
    for net in nets {
        out.push(canonical_net(net)?);
        if let IpNet::V6(v6) = net {
            let mapped = Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0, 0);
            if v6.prefix_len() <= 96 && v6.trunc().contains(&mapped) {
                out.push(IpNet::V4(ipnet::Ipv4Net::default()));
            }
        }
    }
    Ok(out)
}

impl ClientIpResolver {
    /// The connected peer only.
    pub fn peer_only() -> Self {
        Self {
            mode: Mode::PeerOnly,
            v4_prefix: 32,
            v6_prefix: 128,
        }
    }

    /// Believe `header` from peers inside `trusted`, walking right to left.
    /// With no networks this is [`ClientIpResolver::peer_only`].
    ///
    /// Networks and peers are compared in one canonical form: an
    /// IPv4-mapped network (`::ffff:a.b.c.d/n`, n ≥ 96) is the IPv4 network
    /// `a.b.c.d/(n − 96)`, as peers and forwarded addresses are IPv4 when
    /// mapped, and an IPv6 network that holds the whole mapped range (such
    /// as `::/0`) also holds every IPv4 address. A network written in
    /// mapped form with a prefix shorter than /96 is refused with
    /// [`InvalidNetwork`]: it names no IPv4 network.
    pub fn trusting(
        trusted: impl IntoIterator<Item = IpNet>,
        header: ForwardedHeader,
    ) -> Result<Self, InvalidNetwork> {
        let nets = canonical_nets(trusted)?;
        let trusted: Arc<[IpNet]> = nets.into();
        if trusted.is_empty() {
            return Ok(Self::peer_only());
        }
        Ok(Self {
            mode: Mode::Recursive { trusted, header },
            ..Self::peer_only()
        })
    }

    /// The strict single-proxy contract: `proxy` overwrites `header` with
    /// exactly one IP address; a list or anything else from it is refused.
    pub fn single_proxy(proxy: IpAddr, header: HeaderName) -> Self {
        Self {
            mode: Mode::SingleProxy {
                proxy: canonical(proxy),
                header,
            },
            ..Self::peer_only()
        }
    }

    /// Aggregates IPv6 clients by prefix, e.g. 64 for one key per /64.
    pub fn aggregate_ipv6(mut self, prefix: u8) -> Result<Self, InvalidPrefix> {
        if !(1..=128).contains(&prefix) {
            return Err(InvalidPrefix {
                prefix,
                family: 6,
                max: 128,
            });
        }
        self.v6_prefix = prefix;
        Ok(self)
    }

    /// Aggregates IPv4 clients by prefix, e.g. 24.
    pub fn aggregate_ipv4(mut self, prefix: u8) -> Result<Self, InvalidPrefix> {
        if !(1..=32).contains(&prefix) {
            return Err(InvalidPrefix {
                prefix,
                family: 4,
                max: 32,
            });
        }
        self.v4_prefix = prefix;
        Ok(self)
    }

    /// The peer address of a request: [`PeerAddr`], or axum's
    /// `ConnectInfo<SocketAddr>` with the `axum` feature.
    pub fn peer_of(parts: &Parts) -> Option<IpAddr> {
        if let Some(PeerAddr(sa)) = parts.extensions.get::<PeerAddr>() {
            return Some(sa.ip());
        }
        #[cfg(feature = "axum")]
        if let Some(ci) = parts
            .extensions
            .get::<axum::extract::ConnectInfo<SocketAddr>>()
        {
            return Some(ci.0.ip());
        }
        None
    }

    /// Resolves the client address of a request.
    pub fn resolve(&self, parts: &Parts) -> Result<ClientIp, ClientIpError> {
        self.resolve_unmasked(parts).map(|addr| self.mask(addr))
    }

    /// The client address before aggregation by prefix (in canonical form:
    /// IPv4-mapped addresses are IPv4).
    pub(crate) fn resolve_unmasked(&self, parts: &Parts) -> Result<IpAddr, ClientIpError> {
        let peer = Self::peer_of(parts).ok_or(ClientIpError::MissingPeer)?;
        self.unmasked_from(peer, &parts.headers)
    }

    /// Resolves the client address given the peer and the request headers.
    pub fn resolve_from(
        &self,
        peer: IpAddr,
        headers: &HeaderMap,
    ) -> Result<ClientIp, ClientIpError> {
        self.unmasked_from(peer, headers)
            .map(|addr| self.mask(addr))
    }

    fn unmasked_from(&self, peer: IpAddr, headers: &HeaderMap) -> Result<IpAddr, ClientIpError> {
        let peer = canonical(peer);
        let addr = match &self.mode {
            Mode::PeerOnly => peer,
            Mode::Recursive { trusted, header } => {
                if is_trusted(trusted, peer) {
                    header.walk(peer, headers, trusted)
                } else {
                    peer
                }
            }
            Mode::SingleProxy { proxy, header } => {
                if peer == *proxy {
                    single(*proxy, header, headers)?
                } else {
                    peer
                }
            }
        };
        Ok(addr)
    }

    /// `addr`'s network under the resolver's prefix for its family,
    /// masked as a [`Key::client_ip`] masks it (one mask for both).
    pub(crate) fn mask(&self, addr: IpAddr) -> ClientIp {
        let (addr, prefix) = self
            .masked_key(addr)
            .as_client_ip()
            .expect("a key made of one client address");
        ClientIp { addr, prefix }
    }

    /// The key of `addr` aggregated by this resolver's prefix: what
    /// [`mask`](Self::mask) gives, as a key (made once, for the rules keyed
    /// by the address alone).
    pub(crate) fn masked_key(&self, addr: IpAddr) -> Key {
        let prefix = match addr {
            IpAddr::V4(_) => self.v4_prefix,
            IpAddr::V6(_) => self.v6_prefix,
        };
        Key::client_ip(addr, prefix)
    }
}

fn is_trusted(trusted: &[IpNet], ip: IpAddr) -> bool {
    trusted.iter().any(|n| n.contains(&ip))
}

/// From the trusted `peer`, past every trusted hop: the first address that
/// is not trusted, else the last one reached. `nodes` come nearest first.
fn walk(peer: IpAddr, nodes: impl Iterator<Item = Node>, trusted: &[IpNet]) -> IpAddr {
    let mut current = peer;
    for node in nodes {
        match node {
            Node::Addr(ip) => {
                current = canonical(ip);
                if !is_trusted(trusted, current) {
                    return current;
                }
            }
            // The trusted hop that reported a non-address is as far as we
            // can believe.
            Node::Unknown | Node::Obfuscated | Node::Invalid => return current,
        }
    }
    current
}

fn single(
    proxy: IpAddr,
    header: &HeaderName,
    headers: &HeaderMap,
) -> Result<IpAddr, ClientIpError> {
    let mut lines = headers.get_all(header).iter();
    let refuse = |value: &[u8]| ClientIpError::NotSingleAddress {
        proxy,
        header: header.to_string(),
        value: String::from_utf8_lossy(&value[..value.len().min(64)]).into_owned(),
    };
    let (Some(only), None) = (lines.next(), lines.next()) else {
        let joined: Vec<u8> = headers
            .get_all(header)
            .iter()
            .flat_map(|v| v.as_bytes().iter().copied().chain(*b"\n"))
            .take(64)
            .collect();
        return Err(refuse(&joined));
    };
    only.to_str()
        .ok()
        .map(|s| s.trim_matches([' ', '\t']))
        .and_then(|s| s.parse::<IpAddr>().ok())
        .map(canonical)
        .ok_or_else(|| refuse(only.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    proptest! {
        /// The stack text is the Display text, for every address and prefix.
        #[test]
        fn stack_text_matches_display(
            v4 in any::<[u8; 4]>(),
            v6 in any::<[u16; 8]>(),
            p4 in 0u8..=32,
            p6 in 0u8..=128,
            zeros in 0usize..8,
        ) {
            let mut v6 = v6;
            // Runs of zero groups exercise the compressed form.
            for g in v6.iter_mut().skip(zeros / 2).take(zeros) {
                *g = 0;
            }
            let cases = [
                ClientIp { addr: IpAddr::from(v4), prefix: 32 },
                ClientIp { addr: IpAddr::from(v4), prefix: p4 },
                ClientIp { addr: IpAddr::from(v6), prefix: 128 },
                ClientIp { addr: IpAddr::from(v6), prefix: p6 },
                ClientIp { addr: IpAddr::from(Ipv4Addr::from(v4).to_ipv6_mapped()), prefix: 128 },
            ];
            for ip in cases {
                let (text, display) = (ip.text(), ip.to_string());
                prop_assert_eq!(text.as_ref(), display.as_bytes());
            }
        }
    }

    #[test]
    fn longest_address_text_fits() {
        let ip = ClientIp {
            addr: "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255"
                .parse()
                .unwrap(),
            prefix: 127,
        };
        let text = ip.text();
        assert_eq!(text.as_ref(), ip.to_string().as_bytes());
        let ip = ClientIp {
            addr: "255.255.255.255".parse().unwrap(),
            prefix: 32,
        };
        let text = ip.text();
        assert_eq!(text.as_ref(), b"255.255.255.255");
    }

    fn headers(name: &str, values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn trusting(nets: &[&str], header: ForwardedHeader) -> ClientIpResolver {
        ClientIpResolver::trusting(nets.iter().map(|n| n.parse().unwrap()), header).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_keeps_its_own_address() {
        let r = trusting(&["192.0.2.10/32"], ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["203.0.113.77"]);
        assert_eq!(
            r.resolve_from(ip("198.51.100.8"), &h).unwrap().addr(),
            ip("198.51.100.8")
        );
        assert_eq!(
            r.resolve_from(ip("192.0.2.10"), &h).unwrap().addr(),
            ip("203.0.113.77")
        );
    }

    #[test]
    fn recursive_walk_skips_trusted_hops_across_lines() {
        let r = trusting(
            &["10.0.0.0/8", "192.0.2.0/24"],
            ForwardedHeader::XForwardedFor,
        );
        let h = headers(
            "x-forwarded-for",
            &["1.1.1.1, 6.6.6.6", "10.0.0.5", "192.0.2.1"],
        );
        // 1.1.1.1 was sent by the client itself; 6.6.6.6 is where the first
        // trusted proxy saw the connection come from.
        assert_eq!(
            r.resolve_from(ip("10.9.9.9"), &h).unwrap().addr(),
            ip("6.6.6.6")
        );
        // Garbage right of the untrusted hop stops the walk at the reporter.
        let h = headers("x-forwarded-for", &["6.6.6.6, garbage, 10.0.0.5"]);
        assert_eq!(
            r.resolve_from(ip("10.9.9.9"), &h).unwrap().addr(),
            ip("10.0.0.5")
        );
        let h = headers("x-forwarded-for", &["unknown"]);
        assert_eq!(
            r.resolve_from(ip("10.9.9.9"), &h).unwrap().addr(),
            ip("10.9.9.9")
        );
        // All trusted: the leftmost address.
        let h = headers("x-forwarded-for", &["10.1.1.1, 10.2.2.2"]);
        assert_eq!(
            r.resolve_from(ip("10.9.9.9"), &h).unwrap().addr(),
            ip("10.1.1.1")
        );
        // No header: the trusted peer itself.
        assert_eq!(
            r.resolve_from(ip("10.9.9.9"), &HeaderMap::new())
                .unwrap()
                .addr(),
            ip("10.9.9.9")
        );
    }

    /// Finding 3 of the identity audit: a trusted network written in
    /// IPv4-mapped form trusted nothing, because peers are IPv4 by then.
    #[test]
    fn mapped_trusted_networks_trust_the_ipv4_peers_they_name() {
        let h = headers("x-forwarded-for", &["198.51.100.8"]);
        for net in [
            "::ffff:127.0.0.50/128",
            "::ffff:127.0.0.0/104",
            "::ffff:0:0/96",
        ] {
            let r = trusting(&[net], ForwardedHeader::XForwardedFor);
            for peer in ["127.0.0.50", "::ffff:127.0.0.50"] {
                assert_eq!(
                    r.resolve_from(ip(peer), &h).unwrap().addr(),
                    ip("198.51.100.8"),
                    "{net} from {peer}"
                );
            }
        }
        // A mapped hop inside the chain is the IPv4 hop, trusted as such.
        let r = trusting(&["10.0.0.0/8"], ForwardedHeader::XForwardedFor);
        let h = headers("x-forwarded-for", &["198.51.100.8, ::ffff:10.1.1.1"]);
        assert_eq!(
            r.resolve_from(ip("10.0.0.1"), &h).unwrap().addr(),
            ip("198.51.100.8")
        );
        // Mapped prefixes shorter than /96 could never match: refused.
        for net in ["::ffff:0:0/95", "::ffff:127.0.0.0/80"] {
            let e =
                ClientIpResolver::trusting([net.parse().unwrap()], ForwardedHeader::XForwardedFor)
                    .unwrap_err();
            assert!(e.to_string().contains("names no IPv4 network"), "{e}");
        }
        // An IPv6 network holding the whole mapped range holds IPv4 peers.
        let all = trusting(&["::/0"], ForwardedHeader::XForwardedFor);
        assert_eq!(
            all.resolve_from(ip("127.0.0.9"), &h).unwrap().addr(),
            ip("198.51.100.8")
        );
        // Ordinary IPv6 networks are kept as they are.
        let r = trusting(&["2001:db8::/32"], ForwardedHeader::XForwardedFor);
        assert_eq!(
            r.resolve_from(ip("2001:db8::5"), &h).unwrap().addr(),
            ip("10.1.1.1")
        );
        let single = ClientIpResolver::single_proxy(
            ip("::ffff:127.0.0.50"),
            HeaderName::from_static("x-real-ip"),
        );
        assert_eq!(
            single
                .resolve_from(ip("127.0.0.50"), &headers("x-real-ip", &["198.51.100.9"]))
                .unwrap()
                .addr(),
            ip("198.51.100.9")
        );
    }

    #[test]
    fn forwarded_header_with_ports_and_brackets() {
        let r = trusting(&["10.0.0.0/8"], ForwardedHeader::Forwarded);
        let h = headers(
            "forwarded",
            &[r#"for="[2001:db8:cafe::17]:4711", for=10.0.0.1"#],
        );
        assert_eq!(
            r.resolve_from(ip("10.0.0.2"), &h).unwrap().addr(),
            ip("2001:db8:cafe::17")
        );
        let h = headers("forwarded", &["for=_hidden, for=10.0.0.1"]);
        assert_eq!(
            r.resolve_from(ip("10.0.0.2"), &h).unwrap().addr(),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn normalisation_and_aggregation() {
        let r = ClientIpResolver::peer_only();
        assert_eq!(
            r.resolve_from(ip("::ffff:198.51.100.8"), &HeaderMap::new())
                .unwrap()
                .to_string(),
            "198.51.100.8"
        );
        let t = trusting(&["127.0.0.1/32"], ForwardedHeader::XForwardedFor);
        let a = t
            .resolve_from(
                ip("127.0.0.1"),
                &headers("x-forwarded-for", &["2001:0db8:0:0::1"]),
            )
            .unwrap();
        let b = t
            .resolve_from(
                ip("127.0.0.1"),
                &headers("x-forwarded-for", &["2001:db8::1"]),
            )
            .unwrap();
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "2001:db8::1");
        let agg = ClientIpResolver::peer_only()
            .aggregate_ipv6(64)
            .unwrap()
            .aggregate_ipv4(24)
            .unwrap();
        assert_eq!(
            agg.resolve_from(ip("2001:db8:1:2:3:4:5:6"), &HeaderMap::new())
                .unwrap()
                .to_string(),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            agg.resolve_from(ip("198.51.100.8"), &HeaderMap::new())
                .unwrap()
                .to_string(),
            "198.51.100.0/24"
        );
        assert!(ClientIpResolver::peer_only().aggregate_ipv6(0).is_err());
        assert!(ClientIpResolver::peer_only().aggregate_ipv4(33).is_err());
    }

    #[test]
    fn single_proxy_contract() {
        let r =
            ClientIpResolver::single_proxy(ip("192.0.2.10"), HeaderName::from_static("x-real-ip"));
        let one = headers("x-real-ip", &["198.51.100.8"]);
        assert_eq!(
            r.resolve_from(ip("192.0.2.10"), &one).unwrap().addr(),
            ip("198.51.100.8")
        );
        assert_eq!(
            r.resolve_from(ip("198.51.100.8"), &headers("x-real-ip", &["203.0.113.77"]))
                .unwrap()
                .addr(),
            ip("198.51.100.8")
        );
        assert_eq!(
            r.resolve_from(
                ip("198.51.100.8"),
                &headers("x-real-ip", &["not-an-address"])
            )
            .unwrap()
            .addr(),
            ip("198.51.100.8")
        );
        for bad in [
            &["198.51.100.8, 203.0.113.9"][..],
            &["1.2.3.4", "5.6.7.8"],
            &["nonsense"],
            &[],
        ] {
            let e = r
                .resolve_from(ip("192.0.2.10"), &headers("x-real-ip", bad))
                .unwrap_err();
            assert!(
                matches!(e, ClientIpError::NotSingleAddress { .. }),
                "{bad:?}"
            );
        }
    }

    /// Bytes a client may put in a header value: anything but controls.
    fn client_bytes() -> impl Strategy<Value = Vec<u8>> {
        let byte = any::<u8>().prop_map(|b| {
            if (b < 0x20 && b != b'\t') || b == 0x7f {
                b'x'
            } else {
                b
            }
        });
        prop_oneof![
            proptest::collection::vec(byte.clone(), 0..40),
            // Long enough to cross the per-line byte limit.
            proptest::collection::vec(byte, 0..40).prop_map(|v| v.repeat(200)),
            Just(b"\"".to_vec()),
            Just(b"for=\"x".to_vec()),
            Just(b"x\\".to_vec()),
        ]
    }

    fn client_address() -> impl Strategy<Value = IpAddr> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(|o| IpAddr::from([198, 51, o[2], o[3]])),
            any::<[u16; 4]>()
                .prop_map(|g| { IpAddr::from([0x2001, 0xdb8, 0xcafe, 1, g[0], g[1], g[2], g[3]]) }),
        ]
    }

    proptest! {
        /// Whatever bytes a client writes to the left of what trusted hops
        /// append (nginx-style on the same line, or on lines of its own),
        /// the chosen address is the rightmost entry the client did not
        /// write: the address the first trusted proxy saw.
        #[test]
        fn client_bytes_never_change_what_trusted_hops_report(
            client_lines in proptest::collection::vec(client_bytes(), 0..3),
            client in client_address(),
            hops in proptest::collection::vec(any::<[u8; 3]>(), 1..4),
            same_line in any::<bool>(),
        ) {
            let proxies: Vec<IpAddr> = hops.iter().map(|o| IpAddr::from([10, o[0], o[1], o[2]])).collect();
            // What each proxy appends: the address of its own peer.
            let reported: Vec<IpAddr> = std::iter::once(client).chain(proxies[..proxies.len() - 1].iter().copied()).collect();
            let peer = proxies[proxies.len() - 1];
            for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
                let (name, entry): (&str, fn(IpAddr) -> String) = match header {
                    ForwardedHeader::Forwarded => ("forwarded", |ip| match ip {
                        IpAddr::V4(v4) => format!("for={v4}"),
                        IpAddr::V6(v6) => format!("for=\"[{v6}]\""),
                    }),
                    _ => ("x-forwarded-for", |ip| ip.to_string()),
                };
                let mut lines: Vec<Vec<u8>> = Vec::new();
                if same_line {
                    let mut line = client_lines.join(&b", "[..]);
                    for ip in &reported {
                        if !line.is_empty() {
                            line.extend_from_slice(b", ");
                        }
                        line.extend_from_slice(entry(*ip).as_bytes());
                    }
                    lines.push(line);
                } else {
                    lines.extend(client_lines.iter().cloned());
                    lines.extend(reported.iter().map(|ip| entry(*ip).into_bytes()));
                }
                let mut h = HeaderMap::new();
                for line in &lines {
                    h.append(name, http::HeaderValue::from_bytes(line).unwrap());
                }
                let r = trusting(&["10.0.0.0/8"], header);
                prop_assert_eq!(r.resolve_from(peer, &h).unwrap().addr(), client, "{:?}", header);
            }
        }

        /// For any header content, an untrusted peer is keyed by itself.
        #[test]
        fn untrusted_peer_is_never_replaced(values in proptest::collection::vec("[ -~]{0,80}", 0..5), last in 0u8..=255) {
            let peer = IpAddr::V4(Ipv4Addr::new(198, 51, 100, last));
            let mut h = HeaderMap::new();
            for v in &values {
                if let Ok(v) = v.parse::<http::HeaderValue>() {
                    h.append("x-forwarded-for", v.clone());
                    h.append("forwarded", v.clone());
                    h.append("x-real-ip", v);
                }
            }
            for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp] {
                let r = trusting(&["10.0.0.0/8"], header);
                prop_assert_eq!(r.resolve_from(peer, &h).unwrap().addr(), peer);
            }
        }

        /// With trusted proxies, the chosen address is either untrusted with
        /// only trusted hops to its right, or a trusted hop itself: never an
        /// address that a hop beyond the trust boundary wrote.
        #[test]
        fn chosen_address_was_written_by_a_trusted_hop(entries in proptest::collection::vec(prop_oneof![
            Just("10.0.0.1".to_owned()), Just("10.0.0.2".to_owned()), Just("6.6.6.6".to_owned()),
            Just("7.7.7.7".to_owned()), Just("unknown".to_owned()), Just("junk".to_owned()),
        ], 0..8)) {
            let r = trusting(&["10.0.0.0/8"], ForwardedHeader::XForwardedFor);
            let h = if entries.is_empty() { HeaderMap::new() } else { headers("x-forwarded-for", &[&entries.join(", ")]) };
            let got = r.resolve_from(ip("10.9.9.9"), &h).unwrap().addr();
            // Expected: walk from the right.
            let mut expected = ip("10.9.9.9");
            for e in entries.iter().rev() {
                match e.parse::<IpAddr>() {
                    Ok(a) => { expected = a; if !a.to_string().starts_with("10.") { break; } }
                    Err(_) => break,
                }
            }
            prop_assert_eq!(got, expected);
        }
    }
}
