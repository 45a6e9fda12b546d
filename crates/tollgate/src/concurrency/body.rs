//! [`PermitBody`]: a response body that holds its in-flight permit until
//! the body ends (or is dropped).

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::in_flight::Held;

pin_project! {
    /// A response body that keeps its request counted as in flight until the
    /// body has ended, failed, or been dropped (e.g. the client went away).
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        // Released when the last frame or an error is yielded, or on drop.
        permit: Option<Held>,
    }
}

impl<B> PermitBody<B> {
    pub(crate) fn new(inner: B, permit: Option<Held>) -> Self {
        Self { inner, permit }
    }
}

impl<B> std::fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitBody")
            .field("holds_permit", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}

impl<B: Body> Body for PermitBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &polled {
            this.permit.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
