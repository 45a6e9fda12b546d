//! Pieces of the tests that drive a layer event by event against a model
//! (`composition.rs`, `composition_in_flight.rs`, `composition_shared.rs`)
//! and of those that feed a response body by hand (`concurrency.rs`).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Request;
use http_body::Frame;
use tokio::sync::mpsc;

/// A response body fed by the test through a channel; it ends when the
/// sender is dropped.
pub struct ChannelBody(pub mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }
}

/// The model, locked; a panic elsewhere (a failed check) does not hide it.
pub fn lock<T>(model: &Mutex<T>) -> MutexGuard<'_, T> {
    model
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Lets every task run as far as it can at this instant.
pub async fn settle() {
    for _ in 0..64 {
        tokio::task::yield_now().await;
    }
}

/// The test's id of a request, from its `x-id` header.
pub fn id_of<B>(req: &Request<B>) -> usize {
    req.headers()
        .get("x-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("every request has an id")
}

/// Counts one more of what a run exercised.
pub fn note(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Fails unless each of `counts` was exercised at least `min` times: a
/// run that never reached a feature fails instead of passing for want of
/// trying.
pub fn assert_exercised(counts: &[(&str, &AtomicU64)], min: u64) {
    for (what, count) in counts {
        let count = count.load(Ordering::Relaxed);
        assert!(
            count >= min,
            "{what}: exercised {count} times, fewer than {min}"
        );
    }
}
