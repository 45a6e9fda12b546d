//! Counting upgraded connections: the permit of a request that asks for an
//! upgrade is shared with the handler, so the slot can outlive the (empty)
//! body of a `101 Switching Protocols` answer.

use std::fmt;
use std::sync::Arc;

use http::{Method, Request, header};

use super::leases::Slot;
use super::limiter::Ending;

/// A request's slot in a [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer),
/// for connections that outlive their response.
///
/// A request is counted until its response body has ended. An upgraded
/// connection (WebSocket, `CONNECT` tunnel) answers `101` (or `200` to
/// `CONNECT`) with an empty body and then lives on, so by default it stops
/// being counted when it switches protocols. To count it for its whole
/// life, the layer puts an `InFlight` into the extensions of every request
/// that asks for an upgrade (an `Upgrade` header, or method `CONNECT`):
/// take it in the handler and keep it in the task that serves the upgraded
/// connection. Nested layers add their slots to the same `InFlight`. A
/// slot is freed when both the response body and every clone of the
/// `InFlight` are gone.
///
/// ```
/// use axum::{extract::Request, http::StatusCode, response::Response};
/// use tollgate::concurrency::InFlight;
///
/// async fn upgrade(mut req: Request) -> Response {
///     let slot = req.extensions_mut().remove::<InFlight>();
///     let upgrade = hyper::upgrade::on(&mut req);
///     tokio::spawn(async move {
///         let _slot = slot; // counted until this task ends
///         if let Ok(_connection) = upgrade.await {
///             // serve the upgraded connection
///         }
///     });
///     Response::builder()
///         .status(StatusCode::SWITCHING_PROTOCOLS)
///         .header("upgrade", "echo")
///         .header("connection", "upgrade")
///         .body(axum::body::Body::empty())
///         .unwrap()
/// }
/// # let _ = upgrade;
/// ```
#[derive(Clone)]
pub struct InFlight {
    // Never read: holding them is the point. One per concurrency layer the
    // request passed through (layers nest: a global one on the app and a
    // per-key one on the route each add their slot to the same handle).
    _slots: Vec<Arc<Slot>>,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InFlight")
    }
}

/// How the response body holds its request's permit.
/// Never read: holding it is the point.
pub(crate) enum InFlightHold {
    /// Alone: the slot is freed with the body.
    Own { _slot: Slot },
    /// With the [`InFlight`] handed to the handler.
    Shared { _slot: Arc<Slot> },
}

impl InFlightHold {
    /// Where to mark how the request ended, for an adaptive limit.
    pub(crate) fn ending(&self) -> Option<&Arc<Ending>> {
        match self {
            InFlightHold::Own { _slot } => _slot.ending(),
            InFlightHold::Shared { _slot } => _slot.ending(),
        }
    }

    /// See [`Permit::answered`](super::limiter::Permit::answered).
    pub(crate) fn answered(&self, status: http::StatusCode, declared: Option<u64>) {
        match self {
            InFlightHold::Own { _slot } => _slot.answered(status, declared),
            InFlightHold::Shared { _slot } => _slot.answered(status, declared),
        }
    }
}

/// The permit of `req`, shared with the handler through an [`InFlight`] in
/// its extensions when the request asks for an upgrade.
pub(crate) fn hold<B>(permit: Slot, req: &mut Request<B>) -> InFlightHold {
    let upgrade = req.method() == Method::CONNECT || req.headers().contains_key(header::UPGRADE);
    if let Some(ending) = permit.ending() {
        // (Read with the answer: a `HEAD`'s ends with its head, a `2xx` to
        // `CONNECT` is a tunnel, whose life is the client's.)
        if req.method() == Method::HEAD {
            ending.asked(Ending::HEAD);
        } else if req.method() == Method::CONNECT {
            ending.asked(Ending::CONNECT);
        }
    }
    if !upgrade {
        return InFlightHold::Own { _slot: permit };
    }
    let shared = Arc::new(permit);
    match req.extensions_mut().get_mut::<InFlight>() {
        Some(outer) => outer._slots.push(shared.clone()),
        None => {
            req.extensions_mut().insert(InFlight {
                _slots: vec![shared.clone()],
            });
        }
    }
    InFlightHold::Shared { _slot: shared }
}
