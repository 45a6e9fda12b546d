//! A differential test against a real nginx: the same generated header
//! sets, from the same trusted or untrusted peers, sent to nginx with
//! `real_ip_recursive on` and to an axum app resolving the client address
//! with tollgate; the chosen addresses must agree. Every kind of
//! disagreement that remains is listed in HARDENING.md with the reason
//! tollgate's answer is the safer one, and each is allowed here only in
//! cases that carry the feature explaining it.

mod common;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use axum::Router;
use axum::extract::Request;
use axum::routing::get;
use common::nginx::Nginx;
use common::{send_bytes, serve};
use tollgate::{ClientIpResolver, identity::ForwardedHeader};

/// The trusted networks, in both configurations.
const TRUSTED: &[&str] = &[
    "127.0.0.1/32",
    "10.0.0.0/8",
    "2001:db8:1::/48",
    "::ffff:192.0.2.0/120",
];

/// Features of a generated case that explain a known disagreement (see
/// HARDENING.md, "nginx realip differential", for why tollgate's answer is
/// the safer one in each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Feature {
    /// An entry with a space inside ("a b"): nginx splits entries at
    /// spaces as well as commas; tollgate reads it as one malformed entry.
    InnerSpace,
    /// A line longer than tollgate's 4096-byte limit: tollgate stops at
    /// the cut, nginx reads on.
    LongLine,
    /// An address the trusted network `::ffff:192.0.2.0/120` names: nginx
    /// trusts nothing by an IPv4-mapped network, tollgate trusts the IPv4
    /// addresses it names.
    MappedNetwork,
    /// `[v6]` without a port: nginx cannot parse it, tollgate can.
    Bracketed,
    /// An IPv4 octet with a leading zero (`010.1.1.1`): nginx reads it as
    /// decimal, tollgate refuses the ambiguous form.
    LeadingZero,
    /// A line that is empty or starts with an empty list element: nginx
    /// stops there, tollgate skips it as HTTP's list syntax asks.
    EmptyElement,
}

struct Case {
    peer: IpAddr,
    lines: Vec<Vec<u8>>,
    features: Vec<Feature>,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn entry(rng: &mut Rng, features: &mut Vec<Feature>) -> Vec<u8> {
    let r = rng.below(256) as u8;
    let text = match rng.below(30) {
        0..=4 => format!("10.{}.{}.{r}", rng.below(256), rng.below(256)),
        5..=8 => format!("198.51.100.{r}"),
        9 => format!("203.0.113.{r}"),
        10..=11 => format!("2001:db8:1::{r:x}"),
        12..=13 => format!("2001:db8:2::{r:x}"),
        14 => {
            features.push(Feature::Bracketed);
            format!("[2001:db8:2::{r:x}]")
        }
        15 => format!("[2001:db8:1::{r:x}]:443"),
        16 => format!("198.51.100.{r}:8080"),
        17 => match rng.below(3) {
            0 => "::ffff:10.1.2.3".to_owned(),
            1 => "::ffff:198.51.100.9".to_owned(),
            _ => {
                features.push(Feature::MappedNetwork);
                "::ffff:192.0.2.7".to_owned()
            }
        },
        18 => {
            features.push(Feature::MappedNetwork);
            format!("192.0.2.{r}")
        }
        19 => "unknown".to_owned(),
        20 => match rng.below(7) {
            6 => {
                features.push(Feature::LeadingZero);
                "010.1.1.1".to_owned()
            }
            i => {
                ["abc", "1.2.3", "::g", "999.1.1.1", "1.2.3.4.5", "_hidden"][i as usize].to_owned()
            }
        },
        21 => return b"\xff".to_vec(),
        22 => return b"\x80abc".to_vec(),
        23 => {
            features.push(Feature::InnerSpace);
            "198.51.100.1 10.0.0.1".to_owned()
        }
        24 if rng.below(4) == 0 => {
            features.push(Feature::LongLine);
            "9".repeat(5000)
        }
        25 => format!("2001:DB8:2::{r:X}"),
        26 => "fe80::1%eth0".to_owned(),
        27 => String::new(),
        _ => format!("10.0.0.{r}"),
    };
    text.into_bytes()
}

fn generate(n: usize) -> Vec<Case> {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    (0..n)
        .map(|_| {
            let mut features = Vec::new();
            let peer: IpAddr = if rng.below(10) < 7 {
                [127, 0, 0, 1].into()
            } else {
                [127, 0, 0, 2].into()
            };
            let count = match rng.below(10) {
                0 => 0,
                1..=6 => 1,
                7..=8 => 2,
                _ => 3,
            };
            let lines: Vec<Vec<u8>> = (0..count)
                .map(|_| {
                    let entries: Vec<Vec<u8>> = (0..1 + rng.below(5))
                        .map(|_| entry(&mut rng, &mut features))
                        .collect();
                    let sep: &[u8] = [&b", "[..], b",", b" , ", b",  "][rng.below(4) as usize];
                    entries.join(sep)
                })
                .collect();
            let leading_empty = |line: &Vec<u8>| {
                let start = line.iter().position(|b| *b != b' ');
                start.is_none_or(|i| line[i] == b',')
            };
            if lines.iter().any(leading_empty) {
                features.push(Feature::EmptyElement);
            }
            features.sort();
            features.dedup();
            Case {
                peer,
                lines,
                features,
            }
        })
        .collect()
}

fn canonical(text: &str) -> Option<IpAddr> {
    let ip: IpAddr = text.trim().parse().ok()?;
    Some(ip.to_canonical())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_chooses_the_client_address_nginx_realip_chooses() {
    let mut server = String::new();
    for net in TRUSTED {
        server.push_str(&format!("set_real_ip_from {net};\n"));
    }
    server.push_str(
        "real_ip_header X-Forwarded-For;\nreal_ip_recursive on;\n\
         location / { return 200 \"$remote_addr\"; }",
    );
    let nginx = tollgate_testkit::or_skip!(Nginx::start(&server));
    let resolver = ClientIpResolver::trusting(
        TRUSTED.iter().map(|n| n.parse().unwrap()),
        ForwardedHeader::XForwardedFor,
    )
    .unwrap();
    let tollgate: SocketAddr = serve(Router::new().route(
        "/",
        get(move |req: Request| {
            let resolver = resolver.clone();
            async move {
                let (parts, _) = req.into_parts();
                match resolver.resolve(&parts) {
                    Ok(ip) => ip.addr().to_string(),
                    Err(e) => format!("error: {e}"),
                }
            }
        }),
    ))
    .await;

    let cases = generate(6000);
    let plain = cases.iter().filter(|c| c.features.is_empty()).count();
    let mut compared = 0;
    let mut refused_by_nginx = 0;
    let mut explained: BTreeMap<String, usize> = BTreeMap::new();
    let mut unexplained = Vec::new();
    for case in &cases {
        let headers: Vec<(&str, &[u8])> = case
            .lines
            .iter()
            .map(|l| ("X-Forwarded-For", l.as_slice()))
            .collect();
        let theirs = send_bytes(nginx.addr, case.peer, "GET", "/", &headers, b"").await;
        if theirs.status != http::StatusCode::OK {
            refused_by_nginx += 1;
            continue;
        }
        let ours = send_bytes(tollgate, case.peer, "GET", "/", &headers, b"").await;
        assert_eq!(ours.status, http::StatusCode::OK, "{}", ours.body);
        compared += 1;
        let (a, b) = (canonical(&theirs.body), canonical(&ours.body));
        assert!(
            a.is_some() && b.is_some(),
            "{:?} / {:?}",
            theirs.body,
            ours.body
        );
        if a == b {
            continue;
        }
        let shown: Vec<String> = case
            .lines
            .iter()
            .map(|l| String::from_utf8_lossy(&l[..l.len().min(120)]).into_owned())
            .collect();
        let line = format!(
            "peer {} lines {:?}: nginx {} tollgate {}",
            case.peer, shown, theirs.body, ours.body
        );
        if case.features.is_empty() {
            unexplained.push(line);
        } else {
            *explained.entry(format!("{:?}", case.features)).or_default() += 1;
        }
    }
    let total: usize = explained.values().sum();
    eprintln!(
        "compared {compared} ({plain} without a known-difference feature), refused by nginx \
         {refused_by_nginx}, {total} explained disagreements, by features: {explained:?}"
    );
    assert!(compared >= 5000, "only {compared} cases compared");
    assert!(plain >= 2000, "only {plain} cases must agree exactly");
    assert!(
        unexplained.is_empty(),
        "{} unexplained disagreements:\n{}",
        unexplained.len(),
        unexplained.join("\n")
    );
}
