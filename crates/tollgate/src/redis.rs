//! The Redis store's configuration and counters (feature `redis`); the
//! store itself is [`RedisStore`](crate::RedisStore) at the crate root.
//! See the `tollgate-redis` crate for the key layout and scripts.

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
pub use crate::fleet_policies::{
    CHANGE_PATIENCE, DEFAULT_CHECK_EVERY, DEFAULT_COMPARE_EVERY, FleetPolicies,
    FleetPoliciesBuilder, FleetPolicyStats, PublishError,
};
pub use tollgate_redis::{
    CacheStats, DEFAULT_CONNECT_TIMEOUT, DEFAULT_OVER_LIMIT_CACHE, DEFAULT_SENTINEL_CHECK,
    RedisStoreBuilder, ScriptStats, redact_url, redis,
};
pub use tollgate_redis::{NumbersCompared, PolicyAnnouncements, PublishedPolicies};
