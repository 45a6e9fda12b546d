//! Route patterns of rules, in axum 0.8 syntax: checked when the rule is
//! built, compared with axum's `MatchedPath`, and matched against the
//! request path where there is no `MatchedPath`.

use std::fmt;
use std::sync::Arc;

/// A route pattern that axum 0.8 would not accept, reported as an
/// [`InvalidRule`](super::InvalidRule).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid route {route:?} for a rate-limit rule: {reason}")]
pub(crate) struct InvalidRoute {
    route: String,
    reason: String,
}

impl InvalidRoute {
    fn new(route: &str, reason: impl Into<String>) -> Self {
        Self {
            route: route.to_owned(),
            reason: reason.into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    /// Text that must appear as is (escaped braces already undone).
    Literal(String),
    /// `prefix{name}`: one or more bytes other than `/` after the prefix
    /// (`suffix` is always empty: axum 0.8 routes no text after a parameter
    /// in its segment, and `parse` refuses it).
    Param { prefix: String, suffix: String },
    /// `{*name}`: the rest of the path, at least one byte.
    Wildcard,
}

/// A validated route pattern.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct RoutePattern {
    text: Arc<str>,
    segments: Box<[Segment]>,
}

impl fmt::Debug for RoutePattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// How a request's route relates to a pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RouteMatch {
    /// Not this route.
    No,
    /// axum's `MatchedPath` is the pattern.
    Exact,
    /// The layer sits inside a router nested at `N` (axum's `NestedPath`),
    /// and axum's `MatchedPath` is `N` followed by the pattern: the
    /// pattern lacks the nest prefix.
    Suffix,
    /// axum's `MatchedPath` only ends with the pattern, and not under the
    /// layer's own nest: it may be another route that ends the same way
    /// (`/admin/export` for `/export`), or the pattern lacks a prefix the
    /// layer cannot see. Not applied; reported.
    EndsWith,
    /// No `MatchedPath`; the request path, or its end (a router nested
    /// under a prefix the pattern lacks), matches the pattern.
    Path,
}

impl RoutePattern {
    pub(crate) fn parse(route: &str) -> Result<Self, InvalidRoute> {
        let Some(rest) = route.strip_prefix('/') else {
            return Err(InvalidRoute::new(
                route,
                "a route starts with '/', as in axum's Router::route",
            ));
        };
        let mut segments = Vec::new();
        let count = rest.split('/').count();
        for (i, raw) in rest.split('/').enumerate() {
            if raw.starts_with(':') || raw.starts_with('*') {
                return Err(InvalidRoute::new(
                    route,
                    match axum_08(route) {
                        Some(fixed) => format!(
                            "axum 0.8 writes path parameters as {{id}} and wildcards as \
                             {{*rest}}, not :id and *rest; write {fixed:?}"
                        ),
                        None => "axum 0.8 writes path parameters as {id} and wildcards as \
                                 {*rest}, not :id and *rest; every parameter needs a name"
                            .to_owned(),
                    },
                ));
            }
            let segment = parse_segment(route, raw)?;
            if segment == Segment::Wildcard && i + 1 != count {
                return Err(InvalidRoute::new(
                    route,
                    "a wildcard {*rest} can only be the last segment",
                ));
            }
            segments.push(segment);
        }
        Ok(Self {
            text: route.into(),
            segments: segments.into(),
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.text
    }

    /// How `matched` (axum's `MatchedPath`, if any, under the nest prefix
    /// `nested`, if any) or else `path` relates to this pattern.
    pub(crate) fn matches(
        &self,
        matched: Option<&str>,
        nested: Option<&str>,
        path: &str,
    ) -> RouteMatch {
        match matched {
            Some(m) if m == &*self.text => RouteMatch::Exact,
            Some(m) => {
                let under_nest = nested
                    .and_then(|n| m.strip_prefix(n.trim_end_matches('/')))
                    .is_some_and(|rest| rest == &*self.text);
                // Patterns start with '/': an end of the path is whole
                // segments.
                if under_nest {
                    RouteMatch::Suffix
                } else if m.len() > self.text.len() && m.ends_with(&*self.text) {
                    RouteMatch::EndsWith
                } else {
                    RouteMatch::No
                }
            }
            // Without routing, a nest prefix is unknown: the pattern may
            // match the end of the path (`/items/{id}` in `/api/items/7`).
            None if self.matches_path(path) || self.matches_path_end(path) => RouteMatch::Path,
            None => RouteMatch::No,
        }
    }

    /// Whether the pattern matches the path after some of its first
    /// segments.
    fn matches_path_end(&self, path: &str) -> bool {
        path.char_indices()
            .skip(1)
            .filter(|&(_, c)| c == '/')
            .any(|(i, _)| self.matches_path(&path[i..]))
    }

    fn matches_path(&self, path: &str) -> bool {
        let Some(mut rest) = path.strip_prefix('/') else {
            return false;
        };
        for (i, segment) in self.segments.iter().enumerate() {
            let last = i + 1 == self.segments.len();
            if *segment == Segment::Wildcard {
                return !rest.is_empty();
            }
            let (piece, tail) = match rest.split_once('/') {
                Some((piece, tail)) if !last => (piece, Some(tail)),
                Some(_) => return false,
                None if last => (rest, None),
                None => return false,
            };
            let fits = match segment {
                Segment::Literal(text) => piece == text,
                Segment::Param { prefix, suffix } => {
                    piece.len() > prefix.len() + suffix.len()
                        && piece.starts_with(prefix.as_str())
                        && piece.ends_with(suffix.as_str())
                }
                Segment::Wildcard => true,
            };
            if !fits {
                return false;
            }
            rest = tail.unwrap_or("");
        }
        true
    }
}

/// `route` with every axum 0.7 `:name` and `*name` segment rewritten in
/// axum 0.8 syntax; `None` if a parameter has no name.
fn axum_08(route: &str) -> Option<String> {
    let segments: Option<Vec<String>> = route
        .split('/')
        .map(
            |segment| match (segment.strip_prefix(':'), segment.strip_prefix('*')) {
                (Some(""), _) | (_, Some("")) => None,
                (Some(name), _) => Some(format!("{{{name}}}")),
                (_, Some(name)) => Some(format!("{{*{name}}}")),
                _ => Some(segment.to_owned()),
            },
        )
        .collect();
    segments.map(|s| s.join("/"))
}

/// One segment: literal text with `{{`/`}}` escapes and at most one
/// `{name}`, or a whole-segment `{*name}`.
fn parse_segment(route: &str, raw: &str) -> Result<Segment, InvalidRoute> {
    let mut text = String::new();
    let mut param: Option<String> = None;
    let mut chars = raw.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                text.push('{');
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                text.push('}');
            }
            '{' => {
                let mut name = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some('{') | None => {
                            return Err(InvalidRoute::new(
                                route,
                                "unbalanced '{' in a path parameter; escape a literal brace as {{",
                            ));
                        }
                        Some(c) => name.push(c),
                    }
                }
                if let Some(wild) = name.strip_prefix('*') {
                    if wild.is_empty() || !text.is_empty() || chars.peek().is_some() {
                        return Err(InvalidRoute::new(
                            route,
                            "a wildcard is a whole segment with a name, as in /files/{*path}",
                        ));
                    }
                    return Ok(Segment::Wildcard);
                }
                if name.is_empty() {
                    return Err(InvalidRoute::new(
                        route,
                        "a path parameter needs a name, as in {id}",
                    ));
                }
                if param.is_some() {
                    return Err(InvalidRoute::new(
                        route,
                        "only one path parameter per segment",
                    ));
                }
                param = Some(std::mem::take(&mut text));
            }
            '}' => {
                return Err(InvalidRoute::new(
                    route,
                    "unbalanced '}'; escape a literal brace as }}",
                ));
            }
            c => text.push(c),
        }
    }
    Ok(match param {
        // axum 0.8's router (matchit 0.8) refuses text after a parameter
        // in its segment, so such a rule could never match a route.
        Some(_) if !text.is_empty() => {
            return Err(InvalidRoute::new(
                route,
                format!(
                    "axum 0.8 does not route text after a path parameter in one segment \
                     ({raw:?}); end the segment with the parameter or start a new segment"
                ),
            ));
        }
        Some(prefix) => Segment::Param {
            prefix,
            suffix: text,
        },
        None => Segment::Literal(text),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(s: &str) -> RoutePattern {
        RoutePattern::parse(s).unwrap()
    }

    #[test]
    fn axum_07_syntax_is_refused_with_the_fix() {
        let e = RoutePattern::parse("/items/:id").unwrap_err();
        assert!(e.reason.contains("\"/items/{id}\""), "{e}");
        let e = RoutePattern::parse("/files/*path").unwrap_err();
        assert!(e.reason.contains("\"/files/{*path}\""), "{e}");
        for bad in [
            "items",
            "",
            "/a/{",
            "/a/}",
            "/a/{}",
            "/a/{*}",
            "/{*a}/b",
            "/x{a}{b}",
            // axum 0.8.9 (matchit 0.8.4) panics on these (found in review).
            "/a/{id}x",
            "/a/x{id}y",
            "/a/{id}.json",
        ] {
            assert!(RoutePattern::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn axum_07_fixes_are_per_segment() {
        let e = RoutePattern::parse("/x:b/:b").unwrap_err();
        assert!(e.reason.contains("\"/x:b/{b}\""), "{e}");
        let e = RoutePattern::parse("/*").unwrap_err();
        assert!(e.reason.contains("needs a name"), "{e}");
    }

    #[test]
    fn matched_path_is_compared_whole_or_under_its_nest() {
        let p = pattern("/items/{id}");
        let m = |matched, nested, path| p.matches(Some(matched), nested, path);
        assert_eq!(m("/items/{id}", None, "/items/7"), RouteMatch::Exact);
        assert_eq!(
            m("/api/items/{id}", Some("/api"), "/api/items/7"),
            RouteMatch::Suffix
        );
        // Without the layer's own nest, a route that merely ends like the
        // pattern may be another route: not applied, reported.
        assert_eq!(
            m("/admin/items/{id}", None, "/admin/items/7"),
            RouteMatch::EndsWith
        );
        assert_eq!(
            m("/api/v2/items/{id}", Some("/api"), "/api/v2/items/7"),
            RouteMatch::EndsWith
        );
        assert_eq!(m("/xitems/{id}", None, "/xitems/7"), RouteMatch::No);
        assert_eq!(m("/users/{id}", None, "/users/7"), RouteMatch::No);
    }

    #[test]
    fn without_matched_path_the_request_path_is_matched() {
        let p = pattern("/items/{id}");
        assert_eq!(p.matches(None, None, "/items/7"), RouteMatch::Path);
        // A nest prefix cannot be told from the path: its end matches too.
        assert_eq!(p.matches(None, None, "/api/items/7"), RouteMatch::Path);
        for other in ["/items", "/items/", "/items/7/x", "/itemsx/7", "items/7"] {
            assert_eq!(p.matches(None, None, other), RouteMatch::No, "{other}");
        }
        let files = pattern("/files/{*path}");
        assert_eq!(files.matches(None, None, "/files/a/b"), RouteMatch::Path);
        assert_eq!(files.matches(None, None, "/files/"), RouteMatch::No);
        let prefixed = pattern("/img/x{name}");
        assert_eq!(prefixed.matches(None, None, "/img/xcat"), RouteMatch::Path);
        assert_eq!(prefixed.matches(None, None, "/img/x"), RouteMatch::No);
        let braces = pattern("/a{{b}}");
        assert_eq!(braces.matches(None, None, "/a{b}"), RouteMatch::Path);
        assert_eq!(pattern("/").matches(None, None, "/"), RouteMatch::Path);
        assert_eq!(
            pattern("/export").matches(None, None, "/export"),
            RouteMatch::Path
        );
    }
}
