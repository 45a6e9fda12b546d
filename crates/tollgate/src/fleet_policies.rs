//! [`FleetPolicies`]: one policy set for every instance on one Redis
//! (features `redis` and `serde`).
//!
//! The set lives in Redis under the store's prefix
//! ([`RedisStore::policies_key`]), with a version raised at every
//! publication and written with it in one step. A publication is
//! announced (pub/sub); every instance also reads the version every
//! [`DEFAULT_CHECK_EVERY`], in case an announcement is lost. Each instance
//! applies a newer version with [`RulesHandle::apply`], so a set means the
//! same on every instance built from the same code.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate_budget::{Store, StoreError};
use tollgate_redis::{PublishedPolicies, RedisStore};

use crate::RulesHandle;
use crate::rate_limit::{InvalidPolicySet, PolicySet};

/// How often an instance reads the published version when no announcement
/// comes: half a second, so that a lost announcement delays a change by
/// at most that.
pub const DEFAULT_CHECK_EVERY: Duration = Duration::from_millis(500);

/// One [`PolicySet`] for a fleet: published by any instance
/// ([`publish`](Self::publish)), applied by every instance on the same
/// Redis (same prefix) within a second, loaded by an instance when it
/// starts ([`start`](Self::start)) before it serves.
///
/// An instance that cannot read a published set (Redis unreachable) or
/// cannot apply it (invalid, or naming a rule this instance does not
/// have: a fleet in the middle of a deploy) keeps the set it has, logs an
/// error (once per version) and counts it ([`FleetPolicyStats`], and
/// `tollgate_fleet_policies_errors_total` with the `metrics` feature);
/// [`version`](Self::version) says which version it runs. When Redis has
/// lost the set (a restart without persistence) or holds an older
/// version than an instance runs, the instance writes its own back
/// ([`RedisStore::restore_policies`]: the newest version wins, and no
/// version goes down), logs a warning and counts it.
///
/// The watcher task stops when the last clone is dropped.
///
/// ```no_run
/// use tollgate::rate_limit::PolicySet;
/// use tollgate::redis::FleetPolicies;
/// use tollgate::{Policy, Rate, RateLimitLayer, RedisStore, Rule};
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")?.build()?;
/// let export = Policy::token_bucket("export", 3, Rate::per_second(1))?;
/// let layer = RateLimitLayer::builder(store.clone())
///     .rule(Rule::per_account(export))
///     .build()?;
/// // Before serving: the fleet's current set is in force.
/// let fleet = FleetPolicies::start(store, layer.rules_handle()).await?;
/// // Later, on any instance: every instance applies it within a second.
/// let set = PolicySet::from_json(
///     r#"{"rules": {"export": {"policy": {"capacity": 6, "refill": {"per_second": 2}}}}}"#,
/// )?;
/// let version = fleet.publish(&set).await?;
/// assert_eq!(fleet.version(), version);
/// # Ok(()) }
/// ```
pub struct FleetPolicies<St> {
    shared: Arc<Shared<St>>,
    _watcher: Arc<Watcher>,
}

impl<St> Clone for FleetPolicies<St> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            _watcher: self._watcher.clone(),
        }
    }
}

impl<St> fmt::Debug for FleetPolicies<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetPolicies")
            .field("key", &self.shared.store.policies_key())
            .field("version", &self.shared.version.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What a [`FleetPolicies`] has done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct FleetPolicyStats {
    /// The version in force (0: none published yet).
    pub version: u64,
    /// Versions applied (published here or elsewhere).
    pub applied: u64,
    /// Published versions this instance could not apply (each counted
    /// once).
    pub refused: u64,
    /// Reads of the published set that failed (Redis unreachable).
    pub read_errors: u64,
    /// Times this instance wrote its set back to a Redis that had lost it
    /// (or held an older version).
    pub restored: u64,
}

/// Why [`FleetPolicies::publish`] published nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// The set is not valid here ([`RulesHandle::check_set`]): nothing was
    /// published, nothing changed.
    #[error(transparent)]
    Invalid(#[from] InvalidPolicySet),
    /// Redis failed: nothing was published, unless the error is
    /// [uncertain](tollgate_budget::StoreErrorKind::Uncertain) (then every
    /// instance, this one too, applies it when it reads it).
    #[error("publishing the policy set failed: {0}")]
    Store(#[from] StoreError),
    /// [`publish_change`](FleetPolicies::publish_change): other
    /// publications came first every time it tried; nothing was published.
    #[error("the policy set kept changing while the change was made; nothing was published")]
    Conflict,
}

/// How many times [`FleetPolicies::publish_change`] makes its change again
/// when another publication came first.
const CHANGE_TRIES: usize = 5;

struct Shared<St> {
    store: RedisStore,
    handle: RulesHandle<St>,
    /// What is in force; held across a read or a write and the apply that
    /// follows, so that versions are applied in order.
    state: tokio::sync::Mutex<State>,
    version: AtomicU64,
    applied: AtomicU64,
    refused: AtomicU64,
    read_errors: AtomicU64,
    restored: AtomicU64,
}

#[derive(Default)]
struct State {
    version: u64,
    /// The text of the version in force, to write back if Redis loses it.
    text: String,
    /// The last version refused (reported once).
    refused: u64,
    /// Redis was unreachable at the last read (reported once per spell).
    unreachable: bool,
}

/// Stops the watcher task when the last [`FleetPolicies`] is dropped.
struct Watcher(tokio::task::JoinHandle<()>);

impl Drop for Watcher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<St: Store + Send + Sync + 'static> FleetPolicies<St> {
    /// Reads the fleet's set and applies it to `handle`'s layer, then
    /// watches for new versions (announcements, and a read every
    /// [`DEFAULT_CHECK_EVERY`]). Call it before serving: an instance
    /// started after a publication starts with it. A published set this
    /// instance cannot apply is reported and counted, and the layer keeps
    /// the rules it was built with. Needs a tokio runtime.
    ///
    /// # Errors
    ///
    /// Redis could not be read: nothing was applied, and nothing watches.
    pub async fn start(store: RedisStore, handle: RulesHandle<St>) -> Result<Self, StoreError> {
        Self::start_checking_every(store, handle, DEFAULT_CHECK_EVERY).await
    }

    /// [`start`](Self::start), reading the version every `every` when no
    /// announcement comes.
    ///
    /// # Errors
    ///
    /// As [`start`](Self::start).
    pub async fn start_checking_every(
        store: RedisStore,
        handle: RulesHandle<St>,
        every: Duration,
    ) -> Result<Self, StoreError> {
        let shared = Arc::new(Shared {
            store,
            handle,
            state: tokio::sync::Mutex::default(),
            version: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            read_errors: AtomicU64::new(0),
            restored: AtomicU64::new(0),
        });
        let published = shared.store.published_policies().await?;
        {
            let mut state = shared.state.lock().await;
            shared.take(&mut state, published).await;
        }
        let watching = shared.clone();
        let watcher = tokio::spawn(async move { watching.watch(every).await });
        Ok(Self {
            shared,
            _watcher: Arc::new(Watcher(watcher)),
        })
    }

    /// Publishes `set` to the fleet, once this instance has checked it
    /// ([`RulesHandle::check_set`]), and applies it here; returns its
    /// version. Every instance on the same Redis applies it within a
    /// second.
    ///
    /// # Errors
    ///
    /// [`PublishError`]: an invalid set, or Redis failing; either way
    /// nothing changed (but see [`PublishError::Store`]).
    pub async fn publish(&self, set: &PolicySet) -> Result<u64, PublishError> {
        self.shared.handle.check_set(set)?;
        let text = set.to_json();
        let mut state = self.shared.state.lock().await;
        // Above the version held and the one in force here: a Redis that
        // lost the set cannot make a publication go back in versions.
        let version = self
            .shared
            .store
            .publish_policies(&text, state.version)
            .await?;
        if version > state.version {
            self.shared.apply(&mut state, version, text, set);
        }
        Ok(version)
    }

    /// Changes the set *published last* with `change` and publishes the
    /// result, if no other publication came in between (compare and
    /// publish: a change made on a set older than the published one, or
    /// made at the same time on another instance, is made again on the
    /// newer set, up to five times); returns the version and the set.
    /// Changes made this way on several instances at once all take
    /// effect. A published set this instance cannot apply (say it names a
    /// rule this instance does not have) is not changed here:
    /// [`PublishError::Invalid`].
    ///
    /// # Errors
    ///
    /// [`PublishError`]; [`PublishError::Conflict`] after five tries.
    pub async fn publish_change(
        &self,
        change: impl Fn(&mut PolicySet),
    ) -> Result<(u64, PolicySet), PublishError> {
        let shared = &self.shared;
        for _ in 0..CHANGE_TRIES {
            let published = shared.store.published_policies().await?;
            let after = published.as_ref().map_or(0, |p| p.version);
            if after < self.version() {
                // Redis lost the set (or holds a broken one): put the one
                // in force here back first, then change that.
                let state = shared.state.lock().await;
                shared
                    .store
                    .restore_policies(state.version, &state.text)
                    .await?;
                continue;
            }
            // A published text that is not a set at all (written by hand)
            // is replaced by the change made on the set in force here.
            let mut set = published
                .and_then(|p| PolicySet::from_json(&p.text).ok())
                .unwrap_or_else(|| shared.handle.applied_set());
            change(&mut set);
            shared.handle.check_set(&set)?;
            let text = set.to_json();
            let mut state = shared.state.lock().await;
            match shared.store.publish_policies_after(&text, after).await? {
                Ok(version) => {
                    if version > state.version {
                        shared.apply(&mut state, version, text, &set);
                    }
                    return Ok((version, set));
                }
                Err(_newer) => continue,
            }
        }
        Err(PublishError::Conflict)
    }

    /// The version in force here (0: none published yet).
    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::Relaxed)
    }

    /// The set in force here.
    pub fn set(&self) -> PolicySet {
        self.shared.handle.applied_set()
    }

    /// What it has done.
    pub fn stats(&self) -> FleetPolicyStats {
        let s = &self.shared;
        FleetPolicyStats {
            version: s.version.load(Ordering::Relaxed),
            applied: s.applied.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            read_errors: s.read_errors.load(Ordering::Relaxed),
            restored: s.restored.load(Ordering::Relaxed),
        }
    }
}

impl<St: Store + Send + Sync + 'static> Shared<St> {
    /// Wakes on every announcement and every `every`, and reads.
    async fn watch(&self, every: Duration) {
        let mut announcements = None;
        loop {
            if announcements.is_none() {
                announcements = match self.store.policy_announcements().await {
                    Some(Ok(subscribed)) => Some(subscribed),
                    // Subscribed again at the next turn; read meanwhile.
                    Some(Err(_)) | None => None,
                };
            }
            match &mut announcements {
                Some(subscribed) => {
                    if let Ok(None) = tokio::time::timeout(every, subscribed.next()).await {
                        announcements = None;
                    }
                }
                None => tokio::time::sleep(every).await,
            }
            self.check().await;
        }
    }

    async fn check(&self) {
        let mut state = self.state.lock().await;
        match self.store.published_policies().await {
            Ok(published) => {
                if state.unreachable {
                    tracing::info!(
                        key = %self.store.policies_key(),
                        version = state.version,
                        "fleet policies: Redis answers again"
                    );
                }
                state.unreachable = false;
                self.take(&mut state, published).await;
            }
            Err(error) => {
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                metrics::counter!("tollgate_fleet_policies_errors_total", "reason" => "unreachable")
                    .increment(1);
                if !state.unreachable {
                    tracing::error!(
                        key = %self.store.policies_key(),
                        version = state.version,
                        %error,
                        "fleet policies: cannot read the published set; keeping the one in force"
                    );
                }
                state.unreachable = true;
            }
        }
    }

    /// Applies `published` if it is newer than what is in force; writes
    /// what is in force back if Redis has nothing or an older version.
    async fn take(&self, state: &mut State, published: Option<PublishedPolicies>) {
        let held = published.as_ref().map_or(0, |p| p.version);
        if held < state.version {
            match self
                .store
                .restore_policies(state.version, &state.text)
                .await
            {
                Ok(true) => {
                    self.restored.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        key = %self.store.policies_key(),
                        version = state.version,
                        found = held,
                        "fleet policies: Redis had lost the set in force; wrote it back"
                    );
                }
                Ok(false) => {}
                Err(error) => tracing::error!(
                    key = %self.store.policies_key(),
                    version = state.version,
                    %error,
                    "fleet policies: cannot write the set in force back to Redis"
                ),
            }
            return;
        }
        let Some(published) = published.filter(|p| p.version > state.version) else {
            return;
        };
        let parsed = PolicySet::from_json(&published.text)
            .and_then(|set| self.handle.check_set(&set).map(|()| set));
        match parsed {
            Ok(set) => self.apply(state, published.version, published.text, &set),
            Err(error) => {
                if state.refused != published.version {
                    state.refused = published.version;
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    #[cfg(feature = "metrics")]
                    metrics::counter!("tollgate_fleet_policies_errors_total", "reason" => "invalid")
                        .increment(1);
                    tracing::error!(
                        key = %self.store.policies_key(),
                        published = published.version,
                        running = state.version,
                        %error,
                        "fleet policies: cannot apply the published set; keeping the one in force"
                    );
                }
            }
        }
    }

    /// Puts `set` (checked) in force as `version`.
    fn apply(&self, state: &mut State, version: u64, text: String, set: &PolicySet) {
        if let Err(error) = self.handle.apply(set) {
            // Checked just before, under the same lock: only a concurrent
            // `replace` on the handle can make it fail.
            tracing::error!(version, %error, "fleet policies: applying the set failed");
            return;
        }
        state.version = version;
        state.text = text;
        self.version.store(version, Ordering::Relaxed);
        self.applied.fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::gauge!("tollgate_fleet_policies_version").set(version as f64);
        tracing::info!(
            key = %self.store.policies_key(),
            version,
            "fleet policies: version in force"
        );
    }
}
