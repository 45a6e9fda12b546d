//! [`ResponseBody`]: the inner service's body, or one of our refusals.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response from a tollgate middleware: the inner
    /// service's body passed through untouched, or the small body of a
    /// refusal this crate produced. The inner body's error type is kept, so
    /// an `Infallible` stays `Infallible`.
    pub struct ResponseBody<B> {
        #[pin]
        inner: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Refused { #[pin] body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            inner: Kind::Inner { body },
        }
    }

    pub(crate) fn refused(body: Bytes) -> Self {
        Self {
            inner: Kind::Refused {
                body: Full::new(body),
            },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Kind::Inner { .. } => f.write_str("ResponseBody::Inner"),
            Kind::Refused { .. } => f.write_str("ResponseBody::Refused"),
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().inner.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Refused { body } => match body.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
                Poll::Ready(Some(Err(never))) => match never {},
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Refused { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Kind::Inner { body } => body.size_hint(),
            Kind::Refused { body } => body.size_hint(),
        }
    }
}

/// What the body of a [`RateLimit`](crate::rate_limit::RateLimit)
/// response is: [`Wrapped`] (the default, for any inner body) or
/// [`InnerBody`] (the inner service's own body type, for bodies a refusal
/// can be written as). Chosen with
/// [`RateLimitLayer::with_inner_body`](crate::RateLimitLayer::with_inner_body);
/// sealed: these two are the only modes.
pub trait BodyMode<B>: sealed::Sealed {
    /// The body of the layer's responses around an inner body `B`.
    type Body;

    /// The inner service's body, as the layer's.
    #[doc(hidden)]
    fn pass(body: B) -> Self::Body;

    /// A refusal's body, as the layer's.
    #[doc(hidden)]
    fn refusal(body: Bytes) -> Self::Body;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Wrapped {}
    impl Sealed for super::InnerBody {}
}

/// The layer's responses carry a [`ResponseBody`]: the inner body passed
/// through, or a refusal's. Works with every inner body type; axum boxes
/// it once more when the layer is inside a `Router`, and a layer around a
/// `Router` is served after `map_response(IntoResponse::into_response)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wrapped;

/// The layer's responses carry the inner service's own body type, and a
/// refusal is written as one (`From<Bytes>`: axum's `Body`, http-body-util's
/// `Full<Bytes>`). Inside a `Router` axum passes the responses through
/// without boxing them again; around a `Router` the layer's service is
/// served by `axum::serve` as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct InnerBody;

impl<B> BodyMode<B> for Wrapped {
    type Body = ResponseBody<B>;

    #[inline]
    fn pass(body: B) -> ResponseBody<B> {
        ResponseBody::inner(body)
    }

    #[inline]
    fn refusal(body: Bytes) -> ResponseBody<B> {
        ResponseBody::refused(body)
    }
}

impl<B: From<Bytes>> BodyMode<B> for InnerBody {
    type Body = B;

    #[inline]
    fn pass(body: B) -> B {
        body
    }

    #[inline]
    fn refusal(body: Bytes) -> B {
        B::from(body)
    }
}

/// The `Debug` form of both layers' response futures: the state they are
/// in, nothing of the services they hold.
pub(crate) fn debug_future(f: &mut std::fmt::Formatter<'_>, state: &str) -> std::fmt::Result {
    f.debug_struct("ResponseFuture")
        .field("state", &state)
        .finish_non_exhaustive()
}
