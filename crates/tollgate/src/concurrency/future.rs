//! [`ResponseFuture`] of the concurrency layer: wait for a permit (when
//! queueing is allowed), then call the inner service, or refuse.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tollgate_budget::Failure;
use tower_service::Service;

use super::PermitBody;
use super::config::Config;
use super::in_flight::{InFlightHold, hold};
use super::leases::Slot;
use super::limiter::Saturated;
use super::refusal::{refusal, respond};
use super::stall::Stalls;
use crate::ResponseBody;
use crate::response::Protocol;

type Acquire = Pin<Box<dyn Future<Output = Result<Slot, Saturated>> + Send>>;

pin_project! {
    /// Response future of [`ConcurrencyLimit`](super::ConcurrencyLimit).
    pub struct ResponseFuture<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        #[pin]
        state: State<S, ReqB>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<S, ReqB>
    where
        S: Service<Request<ReqB>>,
    {
        Waiting {
            acquire: Acquire,
            // The slot, once acquired, while the inner service gets ready.
            acquired: Option<Slot>,
            // A clone of the inner service, not yet ready: a request that
            // waits does not hold the readiness of the one it was called on.
            pending: Option<(S, Request<ReqB>)>,
            config: Arc<Config>,
            protocol: Protocol,
        },
        Calling {
            #[pin]
            future: S::Future,
            // Moves into the response body when the head arrives, watched
            // for stalls from then on; dropped with this future if the
            // request is abandoned or fails.
            permit: Option<InFlightHold>,
            stalls: Arc<Stalls>,
        },
        Refused {
            response: Option<Response<Bytes>>,
        },
    }
}

impl<S, ReqB> ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    pub(crate) fn calling(
        mut inner: S,
        mut req: Request<ReqB>,
        permit: Slot,
        stalls: Arc<Stalls>,
    ) -> Self {
        let permit = hold(permit, &mut req);
        Self {
            state: State::Calling {
                future: inner.call(req),
                permit: Some(permit),
                stalls,
            },
        }
    }

    /// Exempt: called at once, holding no slot.
    pub(crate) fn exempt(mut inner: S, req: Request<ReqB>, stalls: Arc<Stalls>) -> Self {
        Self {
            state: State::Calling {
                future: inner.call(req),
                permit: None,
                stalls,
            },
        }
    }

    pub(crate) fn waiting(
        acquire: Acquire,
        inner: S,
        req: Request<ReqB>,
        config: Arc<Config>,
        protocol: Protocol,
    ) -> Self
    where
        S: Clone,
    {
        let idle = inner.clone();
        drop(inner);
        Self {
            state: State::Waiting {
                acquire,
                acquired: None,
                pending: Some((idle, req)),
                config,
                protocol,
            },
        }
    }

    pub(crate) fn refused(response: Response<Bytes>) -> Self {
        Self {
            state: State::Refused {
                response: Some(response),
            },
        }
    }
}

impl<S, ReqB> std::fmt::Debug for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Waiting { .. } => "waiting",
            State::Calling { .. } => "calling",
            State::Refused { .. } => "refused",
        };
        crate::body::debug_future(f, state)
    }
}

impl<S, ReqB, ResB> Future for ResponseFuture<S, ReqB>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    type Output = Result<Response<ResponseBody<PermitBody<ResB>>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Waiting {
                    acquire,
                    acquired,
                    pending,
                    config,
                    protocol,
                } => {
                    if acquired.is_none() {
                        match ready!(acquire.as_mut().poll(cx)) {
                            Ok(slot) => *acquired = Some(slot),
                            Err(full) => {
                                let method = pending
                                    .as_ref()
                                    .map_or(&http::Method::GET, |(_, req)| req.method());
                                let response =
                                    respond(config, refusal(config, full), *protocol, method);
                                this.state.set(State::Refused {
                                    response: Some(response),
                                });
                                continue;
                            }
                        }
                    }
                    // Holding its slot, the request waits for the inner
                    // service to be ready, as if it had just arrived.
                    if let Some((inner, _)) = pending.as_mut() {
                        ready!(inner.poll_ready(cx))?;
                    }
                    let next = match (acquired.take(), pending.take()) {
                        (Some(slot), Some((mut inner, mut req))) => {
                            let permit = hold(slot, &mut req);
                            State::Calling {
                                future: inner.call(req),
                                permit: Some(permit),
                                stalls: config.stalls.clone(),
                            }
                        }
                        _ => State::Refused {
                            response: Some(crate::response::polled_after_completion()),
                        },
                    };
                    this.state.set(next);
                }
                StateProj::Calling {
                    future,
                    permit,
                    stalls,
                } => {
                    let ending = permit.as_ref().and_then(|p| p.ending()).cloned();
                    let response = match ready!(future.poll(cx)) {
                        Ok(response) => response,
                        Err(error) => {
                            if let Some(ending) = &ending {
                                ending.failed(Failure::Error);
                            }
                            return Poll::Ready(Err(error));
                        }
                    };
                    let declared = ending.as_ref().and_then(|_| {
                        let length = response.headers().get(http::header::CONTENT_LENGTH)?;
                        length.to_str().ok()?.parse::<u64>().ok()
                    });
                    if let Some(permit) = permit.as_ref() {
                        permit.answered(response.status(), declared);
                    }
                    let guard = permit.take().map(|permit| stalls.guard(permit));
                    return Poll::Ready(Ok(response.map(|b| {
                        ResponseBody::inner(PermitBody::new(b, guard, ending, declared))
                    })));
                }
                StateProj::Refused { response } => {
                    let response = response
                        .take()
                        .unwrap_or_else(crate::response::polled_after_completion);
                    return Poll::Ready(Ok(response.map(ResponseBody::refused)));
                }
            }
        }
    }
}
