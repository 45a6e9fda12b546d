use std::fmt;
use std::sync::Arc;

use http::request::Parts;

/// The operation a request performs, for per-operation keys: the route
/// identity from routing plus the method, e.g. `POST /export`.
///
/// Resolved, in order, from an `Operation` in the request extensions (set it
/// in code for plain hyper services), axum's `MatchedPath` (with the `axum`
/// feature), or else `METHOD *`: requests that no router matched share one
/// operation rather than splitting by raw URL. The raw URL and its query
/// string are never used.
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
        if let Some(op) = parts.extensions.get::<Operation>() {
            return op.clone();
        }
        match route_of(parts) {
            Some(route) => Self(format!("{} {route}", parts.method).into()),
            None => Self(format!("{} *", parts.method).into()),
        }
    }
}

/// The route pattern the router matched, if known.
pub(crate) fn route_of(parts: &Parts) -> Option<&str> {
    #[cfg(feature = "axum")]
    if let Some(path) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return Some(path.as_str());
    }
    let _ = parts;
    None
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
