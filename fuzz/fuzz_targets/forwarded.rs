//! Forwarding-header parsers and client-address resolution on arbitrary
//! header sets: no panic, and an untrusted peer is always keyed by itself.
#![no_main]

use std::net::IpAddr;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tollgate::identity::forwarded;
use tollgate::{ClientIpResolver, ForwardedHeader};

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    // Split the input into header lines on 0xFF; each line goes to all three.
    for line in data.split(|b| *b == 0xff) {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append("x-forwarded-for", v.clone());
            headers.append("forwarded", v.clone());
            headers.append("x-real-ip", v);
        }
    }
    let _ = forwarded::x_forwarded_for(headers.get_all("x-forwarded-for"));
    let _ = forwarded::forwarded(headers.get_all("forwarded"));
    let _ = forwarded::x_real_ip(headers.get_all("x-real-ip"));
    let trusted: IpAddr = "10.0.0.1".parse().unwrap();
    let outsider: IpAddr = "198.51.100.7".parse().unwrap();
    for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp] {
        let r = ClientIpResolver::trusting(["10.0.0.0/8".parse().unwrap()], header);
        let _ = r.resolve_from(trusted, &headers);
        assert_eq!(r.resolve_from(outsider, &headers).unwrap().addr(), outsider);
    }
    let single = ClientIpResolver::single_proxy(trusted, http::HeaderName::from_static("x-real-ip"));
    let _ = single.resolve_from(trusted, &headers);
    assert_eq!(single.resolve_from(outsider, &headers).unwrap().addr(), outsider);
});
