//! Redis URLs made safe to print: credentials replaced by `***`.
//!
//! A URL is redacted from its text, not from a parse: the URLs that most
//! need it are the ones that do not parse (a password holding `/`, `?` or
//! `#` ends the URL's authority early, so a parser sees another host, or
//! none). Redacting too much is harmless in a message; too little is not.

/// The query parameters redis-rs reads credentials from (`redis+unix://`
/// URLs take `user` and `pass`), and their common spellings.
const CREDENTIAL_PARAMS: [&str; 4] = ["pass", "password", "user", "username"];

/// `url` with its user name and password, and every credential query
/// parameter's value (`pass=`, `password=`, `user=`, `username=`),
/// replaced by `***`, for messages and logs.
///
/// Everything before the **last** `@` is treated as user information,
/// whatever it contains: a password may hold `/`, `?`, `#` or `@`, so
/// no character before the last `@` can be trusted to end it. A text
/// that is not a URL at all is redacted by the same rules.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let mut out = String::with_capacity(url.len());
    if let Some(scheme) = scheme {
        out.push_str(scheme);
        out.push_str("://");
    }
    let tail = match rest.rfind('@') {
        Some(at) => {
            out.push_str("***");
            &rest[at..]
        }
        None => rest,
    };
    redact_params(tail, &mut out);
    out
}

/// Appends `text` to `out` with the value of every credential parameter
/// replaced. Parameters are split at `?` and `&` anywhere (not only after
/// the first `?`): after an `@` inside a query, the text left is already
/// in the query.
fn redact_params(text: &str, out: &mut String) {
    let mut rest = text;
    loop {
        let end = rest.find(['?', '&']).unwrap_or(rest.len());
        let (part, after) = rest.split_at(end);
        match part.split_once('=') {
            Some((name, _)) if is_credential(name) => {
                out.push_str(name);
                out.push_str("=***");
            }
            _ => out.push_str(part),
        }
        let mut chars = after.chars();
        match chars.next() {
            Some(separator) => {
                out.push(separator);
                rest = chars.as_str();
            }
            None => return,
        }
    }
}

/// Whether the parameter `name` (percent-decoded, any case, as redis-rs
/// decodes query names) carries a credential.
fn is_credential(name: &str) -> bool {
    let decoded = percent_decoded(name).to_ascii_lowercase();
    CREDENTIAL_PARAMS.contains(&decoded.as_str())
}

/// `text` with `%XX` escapes decoded (invalid escapes kept as they are).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    /// Every form of credential found in review, and the common ones: no
    /// secret survives, and what is not secret is kept.
    #[test]
    fn every_credential_is_redacted() {
        for (url, redacted) in [
            ("redis://h:1", "redis://h:1"),
            ("rediss://u:p@h:1/0", "rediss://***@h:1/0"),
            ("redis://:pw@h:1", "redis://***@h:1"),
            ("redis://user@h:1", "redis://***@h:1"),
            // Found in review: the first `/` was taken as the end of the
            // host, and the password printed whole.
            (
                "redis://:s3cr/etPW@127.0.0.1:16391",
                "redis://***@127.0.0.1:16391",
            ),
            ("redis://:a?b#c@h:1/2", "redis://***@h:1/2"),
            ("redis://:a@b@h:1", "redis://***@h:1"),
            // Found in review: credentials in the query were printed.
            (
                "redis+unix:///tmp/r.sock?pass=hunter2",
                "redis+unix:///tmp/r.sock?pass=***",
            ),
            (
                "redis+unix:///tmp/r.sock?db=1&user=ops&password=hunter2",
                "redis+unix:///tmp/r.sock?db=1&user=***&password=***",
            ),
            (
                "redis+unix:///tmp/r.sock?PASS=hunter2&p%61ss=hunter3",
                "redis+unix:///tmp/r.sock?PASS=***&p%61ss=***",
            ),
            ("rediss://h:1/#insecure", "rediss://h:1/#insecure"),
            (
                "redis://h:1/0?protocol=resp3",
                "redis://h:1/0?protocol=resp3",
            ),
            // An `@` in the query hides the host too (too much is fine),
            // and the parameters after it are still redacted.
            (
                "redis+unix:///s?user=me@corp&pass=hunter2",
                "redis+unix://***@corp&pass=***",
            ),
            // Found in review: a wrong scheme, or none, was echoed whole.
            ("http://:secretPW@h:1", "http://***@h:1"),
            (":secretPW@h:1", "***@h:1"),
            ("", ""),
        ] {
            assert_eq!(redact_url(url), redacted, "{url}");
        }
    }

    #[test]
    fn no_secret_survives_in_odd_places() {
        for url in [
            "redis://:hunter2@",
            "redis://hunter2@",
            "redis+unix:///x?pass=hunter2#frag",
            "redis+unix:///x?pass=hunter2&",
            "redis+unix:///x?&&pass=hunter2?pass=hunter2",
            "redis://:hunter2@@@h",
            "://:hunter2@h",
        ] {
            let r = redact_url(url);
            assert!(!r.contains("hunter2"), "{url} -> {r}");
        }
    }
}
