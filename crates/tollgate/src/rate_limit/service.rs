//! [`RateLimit`]: the `Service` impl; it runs the pipeline and picks the
//! response future's path.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tollgate_budget::Store;
use tower_service::Service;

use super::ResponseFuture;
use super::config::Config;
use super::pipeline::{self, Admit, ChargePlan, Now};
use crate::body::{BodyMode, Wrapped};
use crate::response::Protocol;

/// Rate-limits requests to an inner service; made by
/// [`RateLimitLayer`](crate::RateLimitLayer). Its responses' body is the
/// one `M` makes ([`BodyMode`]): a [`ResponseBody`](crate::ResponseBody)
/// by default, the inner body type with
/// [`RateLimitLayer::with_inner_body`](crate::RateLimitLayer::with_inner_body).
pub struct RateLimit<S, St, M = Wrapped> {
    inner: S,
    config: Arc<Config<St>>,
    mode: PhantomData<fn() -> M>,
}

impl<S: Clone, St, M> Clone for RateLimit<S, St, M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
            mode: PhantomData,
        }
    }
}

impl<S: fmt::Debug, St, M> fmt::Debug for RateLimit<S, St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rules", &self.config.rules.load())
            .finish_non_exhaustive()
    }
}

impl<S, St, M> RateLimit<S, St, M> {
    pub(crate) fn from_config(inner: S, config: Arc<Config<St>>) -> Self {
        Self {
            inner,
            config,
            mode: PhantomData,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, ReqB, ResB, M> Service<Request<ReqB>> for RateLimit<S, St, M>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    St: Store,
    ReqB: Send + 'static,
    M: BodyMode<ResB>,
{
    type Response = Response<M::Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, M>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The limiter itself never waits: only the inner service's readiness
        // is passed on.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let (parts, body) = req.into_parts();
        // Used where it is (not taken apart into locals): the plan is a few
        // hundred bytes, and each field moved out is a copy.
        let mut plan: ChargePlan = pipeline::charge_plan(&self.config, &parts);
        let config = &self.config;
        if plan.charges.is_empty() {
            return match plan.refusal {
                Some(answer) => ResponseFuture::refused(answer.answer(
                    Protocol::of(&parts.headers),
                    config.shape.as_ref(),
                    &parts.method,
                )),
                None => ResponseFuture::calling(
                    self.inner.call(Request::from_parts(parts, body)),
                    None,
                    None,
                ),
            };
        }
        // A request that may wait is decided under the locked line, with
        // its place taken: a decision in process takes microseconds, and no
        // other request can take the room it was decided with.
        let mut line = (!plan.shaping.is_empty()).then(|| config.waiters.lock());
        let mut place = match &mut line {
            Some(line) => plan
                .shaping
                .take_place(line, config.max_waiting, &mut plan.charges),
            None => None,
        };
        match pipeline::decide_now(
            config,
            &plan.charges,
            plan.enforced,
            &mut plan.refusal,
            &mut place,
            &mut plan.settled,
        ) {
            Now::Decided(result) => {
                // Not held: the place is given up, under the same lock.
                if let (Some(line), Some(place)) = (&mut line, place.take()) {
                    line.leave(place);
                }
                drop(line);
                match result {
                    // Decided in `call`: the ready inner service takes the
                    // request now (no clone needed).
                    Ok(Admit {
                        fields,
                        wait: None,
                        settle,
                    }) => ResponseFuture::calling(
                        self.inner.call(Request::from_parts(parts, body)),
                        fields,
                        settle,
                    ),
                    // Held: the ready service stays here for the next
                    // request, the held one gets a clone made ready when
                    // it is released.
                    Ok(Admit {
                        fields,
                        wait: Some(wait),
                        settle,
                    }) => ResponseFuture::waiting(
                        wait,
                        self.inner.clone(),
                        Request::from_parts(parts, body),
                        fields,
                        settle,
                    ),
                    Err(answer) => ResponseFuture::refused(answer.answer(
                        Protocol::of(&parts.headers),
                        config.shape.as_ref(),
                        &parts.method,
                    )),
                }
            }
            Now::Later(failed) => {
                // The store needs I/O: the place is held during the round
                // trip and given up if the request is not held.
                drop(line);
                let decision = Box::pin(pipeline::decide(
                    config.clone(),
                    plan.charges,
                    plan.enforced,
                    failed,
                    plan.refusal,
                    plan.settled,
                    place,
                ));
                let protocol = Protocol::of(&parts.headers);
                ResponseFuture::deciding(
                    decision,
                    take_ready(&mut self.inner),
                    Request::from_parts(parts, body),
                    protocol,
                    config.shape.clone(),
                )
            }
        }
    }
}

/// The inner service made ready in `poll_ready`, for a request that calls it
/// later (after the store's round trip), leaving a fresh clone behind.
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
