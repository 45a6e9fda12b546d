//! [`LeaseStore`]: in-flight counts shared by a fleet, as leases that
//! expire by themselves.
//!
//! A request in flight holds a lease on its limit's slots (per key and in
//! all) until it is released; the holder renews it while the request runs,
//! and a lease that is not renewed in time expires, so an instance that
//! dies never holds capacity for longer than one lease.

use std::sync::Arc;
use std::time::Duration;

use crate::{StoreError, StoreFuture};

/// What a lease is asked for: one slot of the limit `limit` in all (at most
/// `global`) and, with a key, one of the key's (at most `per_key`), for
/// `ttl` unless renewed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRequest {
    /// The limit's name (a concurrency layer's).
    pub limit: Arc<str>,
    /// The key whose slots are counted, if the limit has a per-key bound.
    pub key: Option<Box<str>>,
    /// At most this many in flight per key.
    pub per_key: Option<u64>,
    /// At most this many in flight in all.
    pub global: Option<u64>,
    /// How long the lease lasts unless renewed (the Redis store holds at
    /// most 10^12 ms, about 31 years; longer is that long).
    pub ttl: Duration,
}

/// A lease held: what to renew and release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The request it was granted for.
    pub request: LeaseRequest,
    /// Tells this lease from every other; chosen by the holder.
    pub id: u128,
}

/// The answer to a [`LeaseRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acquired {
    /// Granted: the slots are held until released or expired.
    Granted(Lease),
    /// The key has `per_key` leases already (and the limit in all has
    /// room, or the store cannot tell); nothing was taken.
    PerKeyFull,
    /// The limit has `global` leases already (and the key has room);
    /// nothing was taken.
    GlobalFull,
    /// Both are full; nothing was taken. Refused as by the key, but a
    /// waiter told so holds up the requests of every key behind it: a
    /// slot its key frees is also the one the limit in all needs, and
    /// should not go to a later arrival of another key. A store that
    /// cannot tell answers [`Acquired::PerKeyFull`].
    BothFull,
}

/// The answer to a renewal ([`LeaseStore::renew`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// The lease was held, and now lasts its `ttl` from now.
    Extended,
    /// The lease was gone (it expired while its holder was paused or cut
    /// off for longer than the lease, or the store lost it: flushed,
    /// restarted, failed over without it) and was taken again, even above
    /// the bounds: its request is still in flight, and the count must say
    /// so. Until this renewal, others may have been admitted in its place.
    Restored,
}

/// Where in-flight leases live when a limit must hold across processes
/// (the Redis store implements it). Object-safe: use it as
/// `Arc<dyn LeaseStore>`.
///
/// Every operation is atomic on the store's own clock: expired leases are
/// dropped, the bounds checked and the lease taken in one step, so the
/// number of unexpired leases never exceeds a bound.
pub trait LeaseStore: Send + Sync + 'static {
    /// Takes a lease if every bound has room; `id` names it.
    fn acquire<'a>(
        &'a self,
        request: &'a LeaseRequest,
        id: u128,
    ) -> StoreFuture<'a, Result<Acquired, StoreError>>;

    /// Extends `lease` by its `ttl` from now. A lease that is gone (expired,
    /// or lost by the store) is taken again, even above the bounds
    /// ([`Renewed::Restored`]): the holder's request still runs, so the
    /// shared count is again at least what is in flight, and newcomers are
    /// refused until it drops below the bounds.
    fn renew<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<Renewed, StoreError>>;

    /// Gives `lease` back (nothing if it had expired).
    fn release<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<(), StoreError>>;

    /// The longest a call may take before it fails, if the store bounds
    /// it: a renewal can reach the store that much after it was sent, so
    /// a lease must last several times longer (the concurrency layer
    /// refuses shorter ones). `None` (the default): not known, not
    /// checked.
    fn timeout(&self) -> Option<Duration> {
        None
    }
}
