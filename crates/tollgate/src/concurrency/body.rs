//! [`PermitBody`]: a response body that holds its in-flight permit until
//! the body ends, is dropped, or makes no progress for too long.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::limiter::Ending;
use super::stall::Guard;

/// The error type of a [`PermitBody`]: the inner body's error, or
/// [`BodyStalled`](super::BodyStalled).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// A response body that keeps its request counted as in flight until the
    /// body has ended, failed, or been dropped (e.g. the client went away),
    /// or has made no progress for the layer's
    /// [`body_idle_timeout`](crate::concurrency::ConcurrencyLimitBuilder::body_idle_timeout):
    /// then the slot is released at once, and the body ends with
    /// [`BodyStalled`](super::BodyStalled) when it is next polled.
    ///
    /// Progress is a frame taken by the server, which takes the next one
    /// once the last has (nearly) left its buffers: data frames larger
    /// than [`PermitBody::CHUNK`] are passed on in pieces of that size, so
    /// that a client reading a large frame steadily is seen to progress.
    /// (A client that reads less than that in the idle timeout is taken
    /// for one that stopped.)
    pub struct PermitBody<B> {
        #[pin]
        inner: B,
        // Released when the last frame or an error is yielded, on drop
        // (with the guard), or by the layer's watchdog when the body
        // stalls.
        guard: Option<Guard>,
        // Ended by the watchdog: the error has been yielded.
        ended: bool,
        // What is left of a large data frame, passed on first.
        rest: Bytes,
        // For an adaptive limit: marked when the body ends or fails.
        ending: Option<Arc<Ending>>,
        // For an adaptive limit: the bytes still to come of a declared
        // `Content-Length` (a server stops polling once it has them).
        declared: Option<u64>,
    }
}

impl<B> PermitBody<B> {
    /// The largest data frame passed on at once: 16 KiB.
    pub const CHUNK: usize = 16 * 1024;

    /// `inner`, holding `guard`; `ending` (an adaptive limit's) is marked
    /// when the body ends, fails, or has sent the `declared` length.
    pub(crate) fn new(
        inner: B,
        guard: Option<Guard>,
        ending: Option<Arc<Ending>>,
        declared: Option<u64>,
    ) -> Self {
        Self {
            inner,
            guard,
            ended: false,
            rest: Bytes::new(),
            declared: declared.filter(|_| ending.is_some()),
            ending,
        }
    }
}

/// At most [`PermitBody::CHUNK`] bytes of `data`, the rest left in it.
fn piece(data: &mut Bytes) -> Bytes {
    if data.len() <= PermitBody::<()>::CHUNK {
        std::mem::take(data)
    } else {
        data.split_to(PermitBody::<()>::CHUNK)
    }
}

impl<B> std::fmt::Debug for PermitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermitBody")
            .field("holds_permit", &self.guard.is_some())
            .finish_non_exhaustive()
    }
}

/// Lets go of `guard`'s slot now.
fn release(guard: &mut Option<Guard>) {
    if let Some(Guard::Watched(watched)) = guard.take() {
        watched.release();
    }
}

impl<B> Body for PermitBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        if *this.ended {
            return Poll::Ready(None);
        }
        if let Some(Guard::Watched(watched)) = this.guard.as_ref()
            && watched.is_stalled()
        {
            let error = watched.error();
            this.guard.take();
            *this.ended = true;
            this.rest.clear();
            return Poll::Ready(Some(Err(error.into())));
        }
        let frame = if this.rest.is_empty() {
            match this.inner.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => frame.map_data(|mut data| {
                    let first = piece(&mut data);
                    *this.rest = data;
                    first
                }),
                Poll::Ready(Some(Err(error))) => {
                    if let Some(ending) = this.ending {
                        ending.failed(tollgate_budget::Failure::Error);
                    }
                    release(this.guard);
                    return Poll::Ready(Some(Err(error.into())));
                }
                Poll::Ready(None) => {
                    if let Some(ending) = this.ending {
                        ending.ok();
                    }
                    release(this.guard);
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    if let Some(Guard::Watched(watched)) = this.guard.as_ref() {
                        watched.pending(cx.waker());
                    }
                    return Poll::Pending;
                }
            }
        } else {
            Frame::data(piece(this.rest))
        };
        if let Some(Guard::Watched(watched)) = this.guard.as_ref() {
            watched.progress();
        }
        if let (Some(left), Some(data)) = (this.declared.as_mut(), frame.data_ref()) {
            *left = left.saturating_sub(data.len() as u64);
            if *left == 0
                && let Some(ending) = this.ending
            {
                ending.ok();
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        let end = self.ended || (self.rest.is_empty() && self.inner.is_end_stream());
        // A server stops polling a body that says it is over (its last
        // frame sent, e.g. the length it announced, or empty from the
        // start: a `204`): it ended well, unless marked otherwise first.
        if end && let Some(ending) = &self.ending {
            ending.ok();
        }
        end
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        // (The upper bound first: a lower one above it would panic.)
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint.set_lower(hint.lower().saturating_add(rest));
        hint
    }
}
