//! [`LeaseStore`] for [`RedisStore`]: in-flight limits shared by every
//! instance on one Redis, as leases in sorted sets scored by their expiry
//! on Redis's clock (`leases.lua`).
//!
//! Keys: `PREFIX:{inflight/NAME}:all` holds every lease of the limit
//! `NAME`, `PREFIX:{inflight/NAME}:k:KEY` those of one key
//! ([`keys::lease_keys`]). One hash tag for the limit, so that both bounds
//! are checked and taken in one atomic script, on one node of a cluster.

use std::time::Duration;

use tollgate_budget::{
    Acquired, Lease, LeaseRequest, LeaseStore, Renewed, StoreError, StoreErrorKind, StoreFuture,
};

use crate::keys;
use crate::lua::{self, LEASE_SOURCE};
use crate::store::RedisStore;

/// The longest lease the script is asked for, in ms.
const MAX_TTL_MS: u64 = 1_000_000_000_000;

impl RedisStore {
    /// The Lua source of the lease script (fleet-wide in-flight limits:
    /// acquire, renew, release), for operators who pre-load it (`SCRIPT
    /// LOAD`) or audit it, as [`RedisStore::script_source`] is for the
    /// decision script. The store loads it itself when Redis answers
    /// `NOSCRIPT`.
    pub fn lease_script_source() -> &'static str {
        LEASE_SOURCE
    }

    /// The SHA-1 the store calls the lease script by (`EVALSHA`).
    pub fn lease_script_sha() -> String {
        lua::lease_script().get_hash().to_owned()
    }

    /// The Redis keys of `request`'s leases: the limit's, and its key's.
    pub fn lease_keys(&self, request: &LeaseRequest) -> Vec<String> {
        keys::lease_keys(&self.inner.prefix, &request.limit, request.key.as_deref())
    }

    async fn lease_call(
        &self,
        request: &LeaseRequest,
        op: &str,
        id: u128,
        bounds: (u64, u64),
    ) -> Result<i64, StoreError> {
        let keys = self.lease_keys(request);
        // At most about 31 years: Redis's expiry times stay in range (a
        // larger one would fail after the lease was written).
        let ttl_ms = u64::try_from(request.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .clamp(1, MAX_TTL_MS);
        let mut invocation = lua::lease_script().prepare_invoke();
        for k in &keys {
            invocation.key(k);
        }
        invocation
            .arg(op)
            .arg(format!("{id:032x}"))
            .arg(ttl_ms)
            .arg(bounds.0)
            .arg(bounds.1);
        let eval = || {
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(LEASE_SOURCE).arg(keys.len());
            for k in &keys {
                cmd.arg(k);
            }
            cmd.arg(op)
                .arg(format!("{id:032x}"))
                .arg(ttl_ms)
                .arg(bounds.0)
                .arg(bounds.1);
            cmd
        };
        self.run::<i64>(&invocation, eval, self.deadline()).await
    }
}

fn unexpected(op: &str, reply: i64) -> StoreError {
    StoreError::new(
        StoreErrorKind::Protocol,
        format!("lease script answered {reply} to {op}"),
    )
}

impl LeaseStore for RedisStore {
    fn acquire<'a>(
        &'a self,
        request: &'a LeaseRequest,
        id: u128,
    ) -> StoreFuture<'a, Result<Acquired, StoreError>> {
        Box::pin(async move {
            let bounds = (
                request.global.unwrap_or(0),
                request
                    .per_key
                    .filter(|_| request.key.is_some())
                    .unwrap_or(0),
            );
            match self.lease_call(request, "acquire", id, bounds).await? {
                0 => Ok(Acquired::Granted(Lease {
                    request: request.clone(),
                    id,
                })),
                1 => Ok(Acquired::PerKeyFull),
                2 => Ok(Acquired::GlobalFull),
                3 => Ok(Acquired::BothFull),
                other => Err(unexpected("acquire", other)),
            }
        })
    }

    fn renew<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<Renewed, StoreError>> {
        Box::pin(async move {
            match self
                .lease_call(&lease.request, "renew", lease.id, (0, 0))
                .await?
            {
                1 => Ok(Renewed::Extended),
                2 => Ok(Renewed::Restored),
                other => Err(unexpected("renew", other)),
            }
        })
    }

    /// The store's time limit per call ([`RedisStoreBuilder::timeout`]).
    ///
    /// [`RedisStoreBuilder::timeout`]: crate::RedisStoreBuilder::timeout
    fn timeout(&self) -> Option<Duration> {
        Some(self.inner.timeout)
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> StoreFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            match self
                .lease_call(&lease.request, "release", lease.id, (0, 0))
                .await?
            {
                1 => Ok(()),
                other => Err(unexpected("release", other)),
            }
        })
    }
}
