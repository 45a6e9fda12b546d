//! Forwarding-header parsers and client-address resolution on arbitrary
//! header sets: no panic; an untrusted peer is always keyed by itself; and
//! whatever bytes a client writes, the address a trusted proxy appends
//! after them (on the same line, nginx-style, or on a line of its own) is
//! the one chosen.
#![no_main]

use std::net::IpAddr;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tollgate::identity::forwarded;
use tollgate::{ClientIpResolver, identity::ForwardedHeader};

const NAMES: [(&str, ForwardedHeader, &str); 3] = [
    (
        "x-forwarded-for",
        ForwardedHeader::XForwardedFor,
        "198.51.100.7",
    ),
    ("forwarded", ForwardedHeader::Forwarded, "for=198.51.100.7"),
    ("x-real-ip", ForwardedHeader::XRealIp, "198.51.100.7"),
];

fuzz_target!(|data: &[u8]| {
    // Split the input into header lines on 0xFF 0x00 (0xFF alone is a
    // byte a client may send).
    let lines: Vec<&[u8]> = data.split(|b| *b == 0).collect();
    let mut headers = HeaderMap::new();
    for line in &lines {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            for (name, _, _) in NAMES {
                headers.append(name, v.clone());
            }
        }
    }
    let _ = forwarded::x_forwarded_for(headers.get_all("x-forwarded-for")).count();
    let _ = forwarded::forwarded(headers.get_all("forwarded")).count();
    let _ = forwarded::x_real_ip(headers.get_all("x-real-ip")).count();
    let proxy: IpAddr = "10.0.0.1".parse().unwrap();
    let outsider: IpAddr = "198.51.100.9".parse().unwrap();
    let client: IpAddr = "198.51.100.7".parse().unwrap();
    for (name, header, appended) in NAMES {
        let r = ClientIpResolver::trusting(["10.0.0.0/8".parse().unwrap()], header).unwrap();
        let _ = r.resolve_from(proxy, &headers);
        assert_eq!(r.resolve_from(outsider, &headers).unwrap().addr(), outsider);
        // A proxy that adds a line of its own.
        let mut own_line = headers.clone();
        own_line.append(name, HeaderValue::from_static(appended));
        assert_eq!(
            r.resolve_from(proxy, &own_line).unwrap().addr(),
            client,
            "{name}"
        );
        // An nginx-style proxy: the client's lines joined, then its entry.
        if header != ForwardedHeader::XRealIp {
            let mut joined = lines.join(&b", "[..]);
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(appended.as_bytes());
            if let Ok(v) = HeaderValue::from_bytes(&joined) {
                let mut one = HeaderMap::new();
                one.insert(name, v);
                assert_eq!(
                    r.resolve_from(proxy, &one).unwrap().addr(),
                    client,
                    "{name}"
                );
            }
        }
    }
    let single = ClientIpResolver::single_proxy(proxy, http::HeaderName::from_static("x-real-ip"));
    let _ = single.resolve_from(proxy, &headers);
    assert_eq!(
        single.resolve_from(outsider, &headers).unwrap().addr(),
        outsider
    );
});
