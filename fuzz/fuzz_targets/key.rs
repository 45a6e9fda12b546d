//! Tuple-key encoding: any components round-trip, distinct tuples never
//! share a text form, and parsing arbitrary text never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tollgate::store::Key;

fuzz_target!(|input: (Vec<Vec<u8>>, Vec<Vec<u8>>, &str)| {
    let (a, b, text) = input;
    let build = |parts: &[Vec<u8>]| {
        let mut k = Key::new(parts.first().map_or(&[][..], |p| p.as_slice()));
        for p in parts.iter().skip(1) {
            k.push(p);
        }
        k
    };
    if !a.is_empty() && !b.is_empty() {
        let (ka, kb) = (build(&a), build(&b));
        assert_eq!(ka.components(), a);
        assert_eq!(ka == kb, a == b);
        assert_eq!(Key::parse(&ka.text()).unwrap(), ka);
        // An address key is the same tuple as its text.
        if let Some((ip, prefix)) = ka.as_client_ip() {
            assert_eq!(Key::client_ip(ip, prefix), ka);
        }
    }
    if let Ok(k) = Key::parse(text) {
        assert_eq!(k.text(), text);
    }
});
