//! [`ResponseFuture`] of the rate-limit layer: the store's pending decision,
//! then the inner response (with the `RateLimit` fields, and the
//! reservations of rules charged by outcome settled by its status) or a
//! refusal.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::pipeline::{Admit, AfterResponse, Fields};
use super::shaping::Wait;
use crate::body::{BodyMode, Wrapped};
use crate::response::{
    Answer, Protocol, RATELIMIT, RATELIMIT_POLICY, Shape, polled_after_completion,
};

/// The pipeline's answer, once the store has decided.
type PendingAnswer = Pin<Box<dyn Future<Output = Result<Admit, Answer>> + Send>>;

/// A request shaping rules hold until its release, with what it needs then.
struct HeldForShaping<S, ReqB> {
    until: Pin<Box<tokio::time::Sleep>>,
    /// Gives the reservation back if this is dropped before the release.
    wait: Option<Wait>,
    /// A clone of the inner service, not yet ready: it is driven to
    /// readiness once the request is released.
    pending: Option<(S, Request<ReqB>)>,
    fields: Fields,
    after: Option<AfterResponse>,
}

impl<S, ReqB> HeldForShaping<S, ReqB> {
    /// Holds `req` for `wait` with `idle`, a clone of the inner service
    /// that is not ready: a service whose readiness is a resource (a permit
    /// of tower's `ConcurrencyLimit`, a `Buffer` slot) must not be held by
    /// a request that only waits; the clone is made ready after the wait.
    fn new(
        wait: Wait,
        idle: S,
        req: Request<ReqB>,
        fields: Fields,
        after: Option<AfterResponse>,
    ) -> Box<Self> {
        Box::new(Self {
            until: Box::pin(tokio::time::sleep(wait.delay)),
            wait: Some(wait),
            pending: Some((idle, req)),
            fields,
            after,
        })
    }
}

impl<S, ReqB> Drop for HeldForShaping<S, ReqB> {
    fn drop(&mut self) {
        // Dropped before the inner service was called (its client gone
        // while it waited, or while the service was not ready): the
        // reservations of rules charged by outcome are given back, as the
        // shaped ones are by `wait`.
        if self.pending.is_some()
            && let Some(after) = self.after.take()
        {
            after.not_called();
        }
    }
}

/// The store's pending decision, with what to do once it is known.
struct Deciding<S, ReqB> {
    decision: PendingAnswer,
    // The inner service and request, taken when the store admits.
    pending: Option<(S, Request<ReqB>)>,
    protocol: Protocol,
    shape: Option<Shape>,
}

pin_project! {
    /// Response future of [`RateLimit`](super::RateLimit): first the store's
    /// decision, then either the inner service's response or a refusal,
    /// with the body `M` makes of them ([`BodyMode`]).
    pub struct ResponseFuture<S, ReqB, M = Wrapped>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
        mode: PhantomData<fn() -> M>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        // Boxed: only stores that wait on I/O get here (an in-process store
        // decides inside `call`), and the request it holds would otherwise
        // make every response future, on every path, that much larger.
        Deciding {
            deciding: Box<Deciding<S, ReqB>>,
        },
        // Boxed too: only shaped requests wait, on the runtime's timer.
        Waiting {
            held: Box<HeldForShaping<S, ReqB>>,
        },
        Calling {
            #[pin]
            future: S::Future,
            fields: Fields,
            after: Option<AfterResponse>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqB, M> ResponseFuture<S, ReqB, M>
where
    S: Service<Request<ReqB>> + Clone,
{
    pub(crate) fn deciding(
        decision: PendingAnswer,
        inner: S,
        req: Request<ReqB>,
        protocol: Protocol,
        shape: Option<Shape>,
    ) -> Self {
        Self {
            mode: PhantomData,
            state: State::Deciding {
                deciding: Box::new(Deciding {
                    decision,
                    pending: Some((inner, req)),
                    protocol,
                    shape,
                }),
            },
        }
    }

    /// Admitted: the inner service's future, with the fields to add.
    pub(crate) fn calling(future: S::Future, fields: Fields, after: Option<AfterResponse>) -> Self {
        Self {
            mode: PhantomData,
            state: State::Calling {
                future,
                fields,
                after,
            },
        }
    }

    /// Admitted for later: held until shaping rules release it, then made
    /// ready and called on `idle`, a clone of the inner service.
    pub(crate) fn waiting(
        wait: Wait,
        idle: S,
        req: Request<ReqB>,
        fields: Fields,
        after: Option<AfterResponse>,
    ) -> Self {
        Self {
            mode: PhantomData,
            state: State::Waiting {
                held: HeldForShaping::new(wait, idle, req, fields, after),
            },
        }
    }

    pub(crate) fn refused(response: Response<Bytes>) -> Self {
        Self {
            mode: PhantomData,
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqB, M> std::fmt::Debug for ResponseFuture<S, ReqB, M>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Deciding { .. } => "deciding",
            State::Waiting { .. } => "waiting",
            State::Calling { .. } => "calling",
            State::Refused { .. } => "refused",
        };
        crate::body::debug_future(f, state)
    }
}

impl<S, ReqB, ResB, M> Future for ResponseFuture<S, ReqB, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    M: BodyMode<ResB>,
{
    type Output = Result<Response<M::Body>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Deciding { deciding } => {
                    let result = ready!(deciding.decision.as_mut().poll(cx));
                    let next = match (result, deciding.pending.take()) {
                        (
                            Ok(Admit {
                                fields,
                                wait: None,
                                settle,
                            }),
                            Some((mut inner, req)),
                        ) => State::Calling {
                            future: inner.call(req),
                            fields,
                            after: settle,
                        },
                        (
                            Ok(Admit {
                                fields,
                                wait: Some(wait),
                                settle,
                            }),
                            Some((inner, req)),
                        ) => {
                            // The ready instance is let go at once; a
                            // clone waits (see `HeldForShaping::new`).
                            let idle = inner.clone();
                            drop(inner);
                            State::Waiting {
                                held: HeldForShaping::new(wait, idle, req, fields, settle),
                            }
                        }
                        (Err(answer), pending) => State::Refused {
                            response: Some(
                                answer.answer(
                                    deciding.protocol,
                                    deciding.shape.as_ref(),
                                    pending
                                        .as_ref()
                                        .map_or(&http::Method::GET, |(_, req)| req.method()),
                                ),
                            ),
                        },
                        (Ok(_), None) => State::Refused {
                            response: Some(polled_after_completion()),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Waiting { held } => {
                    ready!(held.until.as_mut().poll(cx));
                    // Released: the reservation is the request's now.
                    if let Some(wait) = held.wait.take() {
                        wait.released();
                    }
                    if let Some((inner, _)) = held.pending.as_mut() {
                        ready!(inner.poll_ready(cx))?;
                    }
                    let next = match held.pending.take() {
                        Some((mut inner, req)) => State::Calling {
                            future: inner.call(req),
                            fields: held.fields.take(),
                            after: held.after.take(),
                        },
                        None => State::Refused {
                            response: Some(polled_after_completion()),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Calling {
                    future,
                    fields,
                    after,
                } => {
                    let mut response = ready!(future.poll(cx))?;
                    if let Some(after) = after.take() {
                        after.status(response.status());
                    }
                    // Appended, not replaced: an inner limit (e.g. a
                    // concurrency limit) may have described itself already,
                    // and a structured-field list may span field lines.
                    if let Some(both) = fields.take() {
                        let (policy, current) = *both;
                        let headers = response.headers_mut();
                        headers.append(RATELIMIT_POLICY.clone(), policy);
                        headers.append(RATELIMIT.clone(), current);
                    }
                    return Poll::Ready(Ok(response.map(M::pass)));
                }
                StateProj::Refused { response } => {
                    let response = response.take().unwrap_or_else(polled_after_completion);
                    return Poll::Ready(Ok(response.map(M::refusal)));
                }
            }
        }
    }
}

#[cfg(all(test, feature = "axum"))]
mod tests {
    use std::convert::Infallible;
    use std::future::Ready;
    use std::mem::size_of;

    use axum::body::Body;
    use http::{Request, Response};
    use tower_service::Service;

    use super::ResponseFuture;

    type RouterFuture = <axum::Router as Service<Request<Body>>>::Future;
    type ReadyFuture = Ready<Result<Response<Body>, Infallible>>;
    type ReadyService = tower::util::ServiceFn<fn(Request<Body>) -> ReadyFuture>;

    /// The layer's future is moved on every poll of every future around
    /// it: it stays the inner service's future and 32 bytes (the fields
    /// and the outcome's settling); what waits for the store or a shaping
    /// release is boxed. axum's `Router` future is 320 bytes, the layer's
    /// around it 352.
    #[test]
    fn the_response_future_is_the_inner_one_and_32_bytes() {
        assert!(
            size_of::<ResponseFuture<axum::Router, Body>>() <= size_of::<RouterFuture>() + 32,
            "{} around {}",
            size_of::<ResponseFuture<axum::Router, Body>>(),
            size_of::<RouterFuture>()
        );
        assert!(
            size_of::<ResponseFuture<ReadyService, Body>>() <= size_of::<ReadyFuture>() + 32,
            "{} around {}",
            size_of::<ResponseFuture<ReadyService, Body>>(),
            size_of::<ReadyFuture>()
        );
    }
}
