//! Refusal bodies shaped by the application ([`RefusalInfo`], [`RefusalBody`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};

/// What a refusal is about, given to the application's body writer
/// ([`RateLimitBuilder::refusal_body`](crate::rate_limit::RateLimitBuilder::refusal_body)).
#[derive(Debug, Clone, Copy)]
pub struct RefusalInfo<'a> {
    pub(super) status: StatusCode,
    pub(super) problem_type: &'a str,
    pub(super) detail: &'a str,
    pub(super) policy: Option<&'a str>,
    pub(super) retry_after: Option<Duration>,
}

impl RefusalInfo<'_> {
    /// The status tollgate answers with (`429`, `413`, `503`, `401`, ...);
    /// the application cannot change it.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The problem type URI tollgate's own body would carry, e.g.
    /// `urn:tollgate:problem:rate-limited`: a stable name for the kind of
    /// refusal.
    pub fn problem_type(&self) -> &str {
        self.problem_type
    }

    /// A human-readable explanation.
    pub fn detail(&self) -> &str {
        self.detail
    }

    /// The policy (or in-flight limit) the refusal is about, if one.
    pub fn policy(&self) -> Option<&str> {
        self.policy
    }

    /// The exact wait, for refusals that promise one (also sent, rounded
    /// up to whole seconds, as `Retry-After`).
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

/// A refusal body written by the application, with its content type.
#[derive(Debug, Clone)]
pub struct RefusalBody {
    pub(super) content_type: HeaderValue,
    pub(super) body: Bytes,
}

impl RefusalBody {
    /// `body`, sent with `Content-Type: content_type`.
    pub fn new(content_type: HeaderValue, body: impl Into<Bytes>) -> Self {
        Self {
            content_type,
            body: body.into(),
        }
    }

    /// A JSON body (`application/json`).
    pub fn json(body: impl Into<Bytes>) -> Self {
        Self::new(HeaderValue::from_static("application/json"), body)
    }
}

/// The application's body writer.
#[derive(Clone)]
pub(crate) struct Shape(pub(crate) Arc<dyn Fn(&RefusalInfo<'_>) -> RefusalBody + Send + Sync>);

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Shape(..)")
    }
}
