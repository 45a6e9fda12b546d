//! The [`Store`] trait: one atomic, all-or-nothing decision per request.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::{Charge, Outcome, Policy, Receipt, Reservation};

/// A boxed, sendable future, as returned by [`DynStore`].
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where budgets live.
///
/// [`Store::charge`] makes one decision for a set of charges: refill, compare
/// and deduct for every charge happen atomically, and either all are spent or
/// none is. The returned [`Outcome`] has one decision per charge, in order.
///
/// A charge whose cost exceeds its policy's capacity is answered
/// [never-fitting](crate::Decision::never_fitting) decisions without touching any state.
///
/// A budget's state is identified by the charge's key **and** its policy's
/// name and unit (not its numbers: see [`Policy`]). The key alone does not
/// name the policy (the HTTP layer's keys are `ip=…`, `t=…:a=…`), so a
/// store that kept state by key alone would make two rules keyed alike
/// share one budget. The conformance suite's `identity` case checks this.
///
/// Use it as a generic parameter, or as `Arc<dyn DynStore>` to choose a store
/// at runtime; every `Store` is a [`DynStore`] and `Arc<dyn DynStore>` is a
/// `Store`.
pub trait Store: Send + Sync + 'static {
    /// Charges every item of `charges` together, all-or-nothing.
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a;

    /// Decides `charges` at once when that needs no I/O: `Some` with exactly
    /// what [`Store::charge`] would have answered (and with the same effect
    /// on the budgets), `None` when the caller must await [`Store::charge`]
    /// instead. A `None` has no effect on any budget.
    ///
    /// In-process stores answer `Some` so that callers (the HTTP layer)
    /// need not allocate a future per request; the default answers `None`.
    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        let _ = charges;
        None
    }

    /// Whether this store can hold and decide `policy` exactly: an error of
    /// kind [`StoreErrorKind::Unsupported`] says which number is out of
    /// its range. Callers check every policy once, when they are
    /// configured (the HTTP layer does so when a rule is added), so that a
    /// configuration error is never answered at runtime as an outage. The
    /// default accepts every policy.
    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        let _ = policy;
        Ok(())
    }

    /// Decides `charges` as [`Store::charge`] would now, without spending
    /// or writing anything: for limits charged only after the fact (e.g.
    /// on a response's status), which are checked before the request. The
    /// answer can be stale by the time it is acted on.
    ///
    /// The default answers [`StoreErrorKind::Unsupported`]; a store that
    /// implements it says so in [`Store::can_check`].
    fn check<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        let _ = charges;
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot decide without charging",
        )))
    }

    /// Whether [`Store::check`] is implemented (the default: no). The HTTP
    /// layer refuses, when it is built, rules that need it on a store
    /// without it.
    fn can_check(&self) -> bool {
        false
    }

    /// Whether the store shapes [`Charge::shaped`] charges (reserves them
    /// for the instant they fit and answers [`Outcome::delay`]); the
    /// default: no, and shaped charges are decided as unshaped ones. The
    /// HTTP layer refuses shaping rules on a store without it.
    fn can_shape(&self) -> bool {
        false
    }

    /// Gives back what `reservation` (from a delayed [`Outcome`] of
    /// `charges`) reserved, for a request dropped before its release, where
    /// that is safe: for each shaped charge whose stored state is still the
    /// one the reservation wrote (nothing was reserved or written after
    /// it), the state the reservation replaced is put back, exactly as if
    /// the request had never come; otherwise it stays spent, so that the
    /// requests reserved behind it keep their release times and no
    /// interval ever releases more than the budget. Other charges of the
    /// request stay charged. The default gives nothing back.
    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let _ = (charges, reservation);
        std::future::ready(Ok(()))
    }

    /// Whether [`Store::refund`] and [`Store::confirm`] are implemented,
    /// and admitted calls with refundable charges carry a [`Receipt`] (the
    /// default: no). The HTTP layer refuses, when it is built, rules
    /// charged by outcome on a store without it.
    fn can_refund(&self) -> bool {
        false
    }

    /// Gives back `charges`, admitted earlier as [`Charge::refundable`]
    /// ones, with `receipt` their part of that call's
    /// [`Outcome::receipt`] ([`Receipt::only`]): each budget is then as if
    /// that admission had never been made, as far as its rule can tell
    /// ([`crate::algorithm::refund`]: a token bucket's reserved units come
    /// back until they lapse, a window's only while the admission's window
    /// counts, a bucket that holds requests for later gives nothing back).
    /// Never more than was charged; a refund that fails leaves the charge
    /// spent (its reservation lapses as confirmed).
    ///
    /// The default answers [`StoreErrorKind::Unsupported`].
    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let _ = (charges, receipt);
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot give charges back",
        )))
    }

    /// Confirms `charges`, admitted earlier as [`Charge::refundable`] ones
    /// (with `receipt`, as for [`Store::refund`]): they count. A token
    /// bucket's reserved units lose them, so it refills to its whole
    /// capacity again ([`crate::algorithm::confirm`]); unconfirmed, they
    /// lapse as confirmed one to two [`crate::algorithm::MAX_RESERVATION`]s
    /// after the charge.
    ///
    /// The default answers [`StoreErrorKind::Unsupported`].
    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let _ = (charges, receipt);
        std::future::ready(Err(StoreError::new(
            StoreErrorKind::Unsupported,
            "this store cannot confirm charges",
        )))
    }
}

/// The object-safe form of [`Store`], implemented for every `Store`.
pub trait DynStore: Send + Sync + 'static {
    /// [`Store::charge`], boxed.
    fn charge_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> StoreFuture<'a, Result<Outcome, StoreError>>;

    /// [`Store::try_charge_now`].
    fn try_charge_now_dyn(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>>;

    /// [`Store::check_policy`].
    fn check_policy_dyn(&self, policy: &Policy) -> Result<(), StoreError>;

    /// [`Store::check`], boxed.
    fn check_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> StoreFuture<'a, Result<Outcome, StoreError>>;

    /// [`Store::can_check`].
    fn can_check_dyn(&self) -> bool;

    /// [`Store::can_shape`].
    fn can_shape_dyn(&self) -> bool;

    /// [`Store::cancel`], boxed.
    fn cancel_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> StoreFuture<'a, Result<(), StoreError>>;

    /// [`Store::can_refund`].
    fn can_refund_dyn(&self) -> bool;

    /// [`Store::refund`], boxed.
    fn refund_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> StoreFuture<'a, Result<(), StoreError>>;

    /// [`Store::confirm`], boxed.
    fn confirm_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> StoreFuture<'a, Result<(), StoreError>>;
}

impl<S: Store> DynStore for S {
    fn charge_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> StoreFuture<'a, Result<Outcome, StoreError>> {
        Box::pin(self.charge(charges))
    }

    fn try_charge_now_dyn(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        self.try_charge_now(charges)
    }

    fn check_policy_dyn(&self, policy: &Policy) -> Result<(), StoreError> {
        self.check_policy(policy)
    }

    fn check_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> StoreFuture<'a, Result<Outcome, StoreError>> {
        Box::pin(self.check(charges))
    }

    fn can_check_dyn(&self) -> bool {
        self.can_check()
    }

    fn can_shape_dyn(&self) -> bool {
        self.can_shape()
    }

    fn cancel_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(self.cancel(charges, reservation))
    }

    fn can_refund_dyn(&self) -> bool {
        self.can_refund()
    }

    fn refund_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(self.refund(charges, receipt))
    }

    fn confirm_boxed<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(self.confirm(charges, receipt))
    }
}

impl Store for Arc<dyn DynStore> {
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        (**self).charge_boxed(charges)
    }

    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        (**self).try_charge_now_dyn(charges)
    }

    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        (**self).check_policy_dyn(policy)
    }

    fn check<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        (**self).check_boxed(charges)
    }

    fn can_check(&self) -> bool {
        (**self).can_check_dyn()
    }

    fn can_shape(&self) -> bool {
        (**self).can_shape_dyn()
    }

    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).cancel_boxed(charges, reservation)
    }

    fn can_refund(&self) -> bool {
        (**self).can_refund_dyn()
    }

    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).refund_boxed(charges, receipt)
    }

    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).confirm_boxed(charges, receipt)
    }
}

impl<S: Store> Store for Arc<S> {
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        (**self).charge(charges)
    }

    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        (**self).try_charge_now(charges)
    }

    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        (**self).check_policy(policy)
    }

    fn check<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        (**self).check(charges)
    }

    fn can_check(&self) -> bool {
        (**self).can_check()
    }

    fn can_shape(&self) -> bool {
        (**self).can_shape()
    }

    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).cancel(charges, reservation)
    }

    fn can_refund(&self) -> bool {
        (**self).can_refund()
    }

    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).refund(charges, receipt)
    }

    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        (**self).confirm(charges, receipt)
    }
}

/// What kind of failure a [`StoreError`] is; the layer maps each to its
/// configured outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store could not be reached or refused the request before anything
    /// was applied (connection refused, not connected yet, timeout before
    /// sending). Nothing was spent.
    Unavailable,
    /// The request may have been applied (connection lost after sending, or a
    /// timeout while waiting for the answer). Budget may have been spent.
    Uncertain,
    /// The store is at its configured key cap and refuses new keys.
    CapacityExhausted,
    /// The store answered something this client does not understand.
    Protocol,
    /// The store cannot represent this policy exactly (a configuration
    /// error: fix the policy).
    Unsupported,
    /// The store itself is configured wrongly (a URL that does not parse,
    /// certificates that are not certificates, options that contradict
    /// each other): found when it is built, before any request.
    Config,
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreErrorKind::Unavailable => "store unavailable",
            StoreErrorKind::Uncertain => "store outcome uncertain",
            StoreErrorKind::CapacityExhausted => "store key capacity exhausted",
            StoreErrorKind::Protocol => "store protocol error",
            StoreErrorKind::Unsupported => "policy unsupported by store",
            StoreErrorKind::Config => "invalid store configuration",
        })
    }
}

/// A store failure. Keeps its source chain.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl StoreError {
    /// An error of `kind` described by `message`.
    pub fn new(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// The same error, caused by `source`.
    #[must_use]
    pub fn with_source(mut self, source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// Whether budget may have been spent despite the error.
    pub fn is_uncertain(&self) -> bool {
        self.kind == StoreErrorKind::Uncertain
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_chain_is_kept() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let e = StoreError::new(StoreErrorKind::Unavailable, "connecting to redis").with_source(io);
        assert_eq!(e.to_string(), "store unavailable: connecting to redis");
        assert_eq!(e.source().unwrap().to_string(), "refused");
        assert!(!e.is_uncertain());
    }
}
