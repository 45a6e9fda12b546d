//! [`Operation`]: the route-level name of what a request does
//! (`METHOD /route/{param}`), for per-operation keys.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;

/// The operation a request performs, for per-operation keys: the route
/// identity from routing plus the method, e.g. `POST /export`. `HEAD` is the
/// operation `GET`, as axum routes it, and every non-standard method is
/// `OTHER` (a client cannot mint budgets by inventing method names).
///
/// Resolved, in order, from an `Operation` in the request extensions (set it
/// in code for plain hyper services), axum's `MatchedPath` (with the `axum`
/// feature), the route pattern of the rule being keyed when that rule
/// matched the request path itself (see
/// [`Rule`](crate::Rule#which-requests-a-rule-applies-to)), or else
/// `METHOD *`. That last value is **shared by every route** without a
/// `MatchedPath`: a layer that wraps the `Router` from outside, or serves
/// plain hyper without an `Operation` extension, keys every operation of
/// an account into one budget (too strict, never too lenient) and
/// tollgate logs an error once. The raw URL and its query string are
/// never used: a client could otherwise mint a fresh budget per URL.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Operation(Arc<str>);

impl Operation {
    /// An operation with the given name.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The operation's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The operation of a request, as described on the type.
    pub fn of(parts: &Parts) -> Self {
        Self::with_fallback(parts, None)
    }

    /// The operation of a request, with `route` standing in for a missing
    /// `MatchedPath`.
    pub(crate) fn with_fallback(parts: &Parts, route: Option<&str>) -> Self {
        if let Some(op) = parts.extensions.get::<Operation>() {
            return op.clone();
        }
        let method = method_of(&parts.method);
        match route_of(parts).or(route) {
            Some(route) => Self(format!("{method} {route}").into()),
            None => Self(format!("{method} *").into()),
        }
    }
}

/// Calls `write` with the pieces of the operation's name (as
/// [`Operation::with_fallback`] names it) without building the name.
pub(crate) fn write_operation<R>(
    parts: &Parts,
    route: Option<&str>,
    write: impl FnOnce(&[&str]) -> R,
) -> R {
    if let Some(op) = parts.extensions.get::<Operation>() {
        return write(&[op.as_str()]);
    }
    let method = method_of(&parts.method);
    match route_of(parts).or(route) {
        Some(route) => write(&[method, " ", route]),
        None => write(&[method, " *"]),
    }
}

/// Where routing put a request: axum's `MatchedPath` and `NestedPath`, each
/// looked up in the request's extensions once per request however many
/// rules name routes (each lookup is a probe of the extension map).
#[derive(Clone, Copy)]
pub(crate) struct Routed<'a> {
    /// The route pattern the router matched ([`route_of`]).
    pub(crate) matched: Option<&'a str>,
    /// The path a nested router is mounted at ([`nested_of`]).
    pub(crate) nested: Option<&'a str>,
}

impl<'a> Routed<'a> {
    pub(crate) fn of(parts: &'a Parts) -> Self {
        Self {
            matched: route_of(parts),
            nested: nested_of(parts),
        }
    }
}

/// The path a nested router is mounted at (axum's `NestedPath`), if any.
fn nested_of(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::NestedPath>() {
        return Some(path.as_str());
    }
    let _ = parts;
    None
}

/// The route pattern the router matched, if known.
fn route_of(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(path.as_str());
    }
    let _ = parts;
    None
}

/// The method as an operation names it. axum answers HEAD with the GET
/// handler: one operation, one budget. Every method outside RFC 9110's and
/// PATCH (any casing of them included: methods are case-sensitive) is one
/// operation, `OTHER`: a client that varies the method name on a route
/// that takes any method must not mint a budget per name.
fn method_of(method: &http::Method) -> &'static str {
    use http::Method as M;
    match *method {
        M::GET | M::HEAD => "GET",
        M::POST => "POST",
        M::PUT => "PUT",
        M::DELETE => "DELETE",
        M::PATCH => "PATCH",
        M::OPTIONS => "OPTIONS",
        M::CONNECT => "CONNECT",
        M::TRACE => "TRACE",
        _ => "OTHER",
    }
}

impl fmt::Debug for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Operation({})", self.0)
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
