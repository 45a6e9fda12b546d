//! [`ConcurrencyLimit`]: the `Service` impl that takes a permit per request.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::ResponseFuture;
use super::config::Config;
use super::leases::{self, Slot};
use super::refusal::{refusal, respond};
use super::share::Ask;
use crate::identity::{KeyPart, RequestIdentity};
use crate::observe::{self, Refuser};
use crate::rate_limit::any_matches;
use crate::response::{Answer, Protocol};

/// Bounds requests in flight; made by
/// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer).
pub struct ConcurrencyLimit<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S: Clone> Clone for ConcurrencyLimit<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for ConcurrencyLimit<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyLimit")
            .field("inner", &self.inner)
            .field("limit", &self.config.limiter.limits.name)
            .finish_non_exhaustive()
    }
}

impl<S> ConcurrencyLimit<S> {
    pub(crate) fn from_config(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
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

impl<S, ReqB, ResB> Service<Request<ReqB>> for ConcurrencyLimit<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    ReqB: Send + 'static,
{
    type Response = Response<crate::ResponseBody<super::PermitBody<ResB>>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Never backpressure: a full limit is answered, not awaited here.
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = &self.config;
        let (parts, body) = req.into_parts();
        let protocol = Protocol::of(&parts.headers);
        let mut who = RequestIdentity::new(&parts, &config.resolver);
        if any_matches(&config.exemptions, &mut who, &parts) {
            let req = Request::from_parts(parts, body);
            return ResponseFuture::exempt(inner, req, config.stalls.clone());
        }
        let mut key_of = |key: &[KeyPart]| match who.key(key, config.missing, None) {
            Ok(key) => Ok(key.map(|k| Box::<str>::from(k.text()))),
            Err(error) => {
                let limits = &config.limiter.limits;
                observe::key_refused(&error, Refuser::InFlight(&limits.name), limits.log_level);
                let mut answer = Answer::for_key(error, &limits.name);
                if answer.challenge.is_some() {
                    answer.challenge = Some(Box::new(config.www_authenticate.clone()));
                }
                Err(Box::new(respond(config, answer, protocol, &parts.method)))
            }
        };
        let key: Option<Box<str>> = if config.limiter.limits.per_key() {
            match key_of(&config.key) {
                Ok(key) => key,
                Err(refused) => return ResponseFuture::refused(*refused),
            }
        } else {
            None
        };
        let mut ask = Ask::keyed(key);
        if let Some(fair) = &config.fair {
            match key_of(&fair.parts) {
                Ok(tenant) => ask.tenant = tenant.map(Into::into),
                Err(refused) => return ResponseFuture::refused(*refused),
            }
            if let Some(weight) = &fair.weight {
                ask.weight = weight(&parts);
            }
        }
        if let Some(class) = &config.priority {
            ask.class = class(&parts);
        }
        let req = Request::from_parts(parts, body);
        if let Some(leases) = &config.leases {
            let (limiter, leases) = (config.limiter.clone(), leases.clone());
            let acquire = Box::pin(async move {
                match leases::acquire(limiter.clone(), leases, ask.key.clone()).await {
                    // Refused, and logged as such, in dry-run: let through.
                    Err(full) if limiter.dry_run_admits(full) => {
                        Ok(Slot::local(limiter.take_unchecked(ask)))
                    }
                    acquired => acquired,
                }
            });
            return ResponseFuture::waiting(acquire, inner, req, config.clone(), protocol);
        }
        match config.limiter.try_acquire(&mut ask) {
            Ok(permit) => {
                ResponseFuture::calling(inner, req, Slot::local(permit), config.stalls.clone())
            }
            Err(full) if config.limiter.dry_run_admits(full) => {
                config.limiter.refused(full, ask.key.as_deref());
                let permit = config.limiter.take_unchecked(ask);
                ResponseFuture::calling(inner, req, Slot::local(permit), config.stalls.clone())
            }
            Err(_) if config.limiter.limits.waits().is_some() => {
                let limiter = config.limiter.clone();
                let waiting = Box::pin(async move { limiter.acquire(ask).await.map(Slot::local) });
                ResponseFuture::waiting(waiting, inner, req, config.clone(), protocol)
            }
            Err(full) => {
                let answer = refusal(config, config.limiter.refused(full, ask.key.as_deref()));
                ResponseFuture::refused(respond(config, answer, protocol, req.method()))
            }
        }
    }
}
