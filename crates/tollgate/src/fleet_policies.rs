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
//!
//! Every instance also says, every [`DEFAULT_COMPARE_EVERY`], which
//! numbers it charges each budget under, and compares them with the other
//! instances' ([`RedisStore::compare_numbers`]): instances that charge one
//! budget under different numbers (a change made on one instance only, a
//! set one instance refused, a rolled-back deploy) each count and log it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tollgate_budget::{Policy, Store, StoreError};
use tollgate_redis::{PublishedPolicies, RedisStore};

use crate::RulesHandle;
use crate::rate_limit::{InvalidPolicySet, PolicySet};

/// How often an instance reads the published version when no announcement
/// comes: half a second, so that a lost announcement delays a change by
/// at most that.
pub const DEFAULT_CHECK_EVERY: Duration = Duration::from_millis(500);

/// How often an instance compares the numbers it charges each budget
/// under with the other instances' ([`FleetPolicies`]): every five
/// seconds, and at once after it applies a version. A mismatch is counted
/// and logged once per budget and period, never per request.
pub const DEFAULT_COMPARE_EVERY: Duration = Duration::from_secs(5);

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
/// # Mismatched numbers
///
/// Each instance charges a budget under the numbers it has for it (the
/// rule's policy, plans and overrides). When two instances on one Redis
/// have different numbers for one budget for longer than a publication
/// takes to arrive (two checks), both count it
/// ([`FleetPolicyStats::mismatched`], and
/// `tollgate_fleet_policies_mismatched_total{policy}` with the `metrics`
/// feature) and log a warning naming the policy, once per budget and
/// [period](FleetPoliciesBuilder::compare_numbers_every) while it lasts,
/// and an info line when they agree again; [`mismatched`](Self::mismatched)
/// names the budgets. What is compared is each budget's set of numbers
/// (its rules' policies, plans and overrides, without routes): two routes
/// of one budget with their numbers swapped read alike, and an override
/// equal to the default on one instance only reads as a difference. An
/// instance that spoke with old numbers after a publication and then
/// stopped before applying it counts until its record ages out (three of
/// its periods). Meanwhile the budget is charged by both: each
/// charge first carries what the key has spent over to the charging
/// instance's numbers ([`carry_over`](crate::store::algorithm::carry_over)),
/// so nothing spent is forgotten in either direction, and what a key is
/// admitted in any interval is at most the larger capacity plus each
/// policy's rate over the time: the more generous numbers bound it.
///
/// The watcher tasks stop when the last clone is dropped.
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
/// // Or with periods of your own:
/// // FleetPolicies::builder(store, handle).check_every(..).start().await?
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

/// Starts a [`FleetPolicies`] with periods of your own
/// ([`FleetPolicies::builder`]).
#[must_use = "a builder does nothing until `start`"]
pub struct FleetPoliciesBuilder<St> {
    store: RedisStore,
    handle: RulesHandle<St>,
    check_every: Duration,
    compare_every: Duration,
}

impl<St> fmt::Debug for FleetPoliciesBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetPoliciesBuilder")
            .field("key", &self.store.policies_key())
            .field("check_every", &self.check_every)
            .field("compare_every", &self.compare_every)
            .finish_non_exhaustive()
    }
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
    /// Comparisons in which another instance charged one of this
    /// instance's budgets under other numbers, counted once per budget
    /// and period.
    pub mismatched: u64,
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
    /// publications came first every time it tried, for
    /// [`CHANGE_PATIENCE`]; nothing was published.
    #[error("the policy set kept changing while the change was made; nothing was published")]
    Conflict,
}

/// How long [`FleetPolicies::publish_change`] keeps making its change
/// again when other publications come first (after a pause that grows to
/// 64 ms and differs between instances, so that changes made at once take
/// turns).
pub const CHANGE_PATIENCE: Duration = Duration::from_secs(10);

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
    mismatched: AtomicU64,
    /// This instance, as it names itself among the others.
    instance: String,
    check_every: Duration,
    compare_every: Duration,
    /// Budgets another instance charges under other numbers, by policy
    /// name, at the last comparison.
    differing: Mutex<Vec<String>>,
    /// Compare at once (after a version is applied).
    compare_now: tokio::sync::Notify,
    /// The last comparison failed (reported once per spell).
    comparing_failed: std::sync::atomic::AtomicBool,
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

/// Stops the watcher tasks when the last [`FleetPolicies`] is dropped.
struct Watcher(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Watcher {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

impl<St: Store + Send + Sync + 'static> FleetPoliciesBuilder<St> {
    /// Reads the published version every `every` when no announcement
    /// comes (default [`DEFAULT_CHECK_EVERY`]), between 1 ms and 300 s.
    /// A mismatch must last two of these before it counts (two of the
    /// longer of the two instances' own).
    pub fn check_every(mut self, every: Duration) -> Self {
        self.check_every = every.clamp(Duration::from_millis(1), Duration::from_secs(300));
        self
    }

    /// Compares the numbers this instance charges each budget under with
    /// the other instances' every `every` (default
    /// [`DEFAULT_COMPARE_EVERY`]): the period a mismatch is counted and
    /// logged once in, between 1 ms and 200 s. An instance silent for
    /// three of its periods is gone.
    pub fn compare_numbers_every(mut self, every: Duration) -> Self {
        self.compare_every = every.clamp(Duration::from_millis(1), Duration::from_secs(200));
        self
    }

    /// Reads the fleet's set and applies it, then watches; see
    /// [`FleetPolicies::start`].
    ///
    /// # Errors
    ///
    /// Redis could not be read: nothing was applied, and nothing watches.
    pub async fn start(self) -> Result<FleetPolicies<St>, StoreError> {
        let shared = Arc::new(Shared {
            store: self.store,
            handle: self.handle,
            state: tokio::sync::Mutex::default(),
            version: AtomicU64::new(0),
            applied: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            read_errors: AtomicU64::new(0),
            restored: AtomicU64::new(0),
            mismatched: AtomicU64::new(0),
            instance: instance_name(),
            check_every: self.check_every,
            compare_every: self.compare_every,
            differing: Mutex::default(),
            compare_now: tokio::sync::Notify::new(),
            comparing_failed: std::sync::atomic::AtomicBool::new(false),
        });
        let published = shared.store.published_policies().await?;
        {
            let mut state = shared.state.lock().await;
            shared.take(&mut state, published).await;
        }
        let watching = shared.clone();
        let comparing = shared.clone();
        let tasks = vec![
            tokio::spawn(async move { watching.watch().await }),
            tokio::spawn(async move { comparing.compare().await }),
        ];
        Ok(FleetPolicies {
            shared,
            _watcher: Arc::new(Watcher(tasks)),
        })
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
        Self::builder(store, handle).start().await
    }

    /// A [`FleetPolicies`] with periods of your own: how often it reads the
    /// published version, and how often it compares numbers with the
    /// other instances.
    pub fn builder(store: RedisStore, handle: RulesHandle<St>) -> FleetPoliciesBuilder<St> {
        FleetPoliciesBuilder {
            store,
            handle,
            check_every: DEFAULT_CHECK_EVERY,
            compare_every: DEFAULT_COMPARE_EVERY,
        }
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
    /// newer set, after a short random pause that grows to 64 ms, for up
    /// to [`CHANGE_PATIENCE`]); returns the version and the set. Changes
    /// made this way on several instances at once take effect one after
    /// another (tested: 50 at once over three instances, none lost). A
    /// published set this instance cannot apply (say it names a
    /// rule this instance does not have) is not changed here:
    /// [`PublishError::Invalid`].
    ///
    /// # Errors
    ///
    /// [`PublishError`]; [`PublishError::Conflict`] when other
    /// publications came first for [`CHANGE_PATIENCE`] (nothing
    /// published: try again).
    pub async fn publish_change(
        &self,
        change: impl Fn(&mut PolicySet),
    ) -> Result<(u64, PolicySet), PublishError> {
        let shared = &self.shared;
        let started = tokio::time::Instant::now();
        let mut try_number = 0;
        while started.elapsed() < CHANGE_PATIENCE {
            try_number += 1;
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
                Err(_newer) => {
                    drop(state);
                    tokio::time::sleep(backoff(try_number)).await;
                }
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

    /// The policies (by name) that another instance charged under other
    /// numbers at the last comparison; empty when the fleet agrees.
    pub fn mismatched(&self) -> Vec<String> {
        self.shared
            .differing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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
            mismatched: s.mismatched.load(Ordering::Relaxed),
        }
    }
}

impl<St: Store + Send + Sync + 'static> Shared<St> {
    /// Wakes on every announcement and every check period, and reads.
    async fn watch(&self) {
        let every = self.check_every;
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
        self.compare_now.notify_one();
        #[cfg(feature = "metrics")]
        metrics::gauge!("tollgate_fleet_policies_version").set(version as f64);
        tracing::info!(
            key = %self.store.policies_key(),
            version,
            "fleet policies: version in force"
        );
    }
}

impl<St: Store + Send + Sync + 'static> Shared<St> {
    /// Compares numbers every period, and at once after an apply.
    async fn compare(&self) {
        loop {
            self.compare_once().await;
            // Woken by an apply, or the period over: either way, compare.
            let _ = tokio::time::timeout(self.compare_every, self.compare_now.notified()).await;
        }
    }

    async fn compare_once(&self) {
        let numbers = budget_numbers(&self.handle.rules());
        let version = self.version.load(Ordering::Relaxed).to_string();
        // Gone after three silent periods; a difference counts once both
        // sides have held their numbers for two checks (a publication
        // reaches every instance within one).
        let quiet = self.compare_every * 3;
        let settle = self.check_every * 2;
        let found = match self
            .store
            .compare_numbers(&self.instance, &version, &numbers, quiet, settle)
            .await
        {
            Ok(found) => found,
            Err(error) => {
                // Not known to differ any more (nor to agree): said once
                // per spell, counted every time.
                self.read_errors.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                metrics::counter!("tollgate_fleet_policies_errors_total", "reason" => "numbers")
                    .increment(1);
                let mut held = self
                    .differing
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if !self.comparing_failed.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        key = %self.store.numbers_key(),
                        %error,
                        "fleet policies: cannot compare numbers with the other instances \
                         (mismatches go unseen until it can)"
                    );
                }
                held.clear();
                return;
            }
        };
        if self.comparing_failed.swap(false, Ordering::Relaxed) {
            tracing::info!(
                key = %self.store.numbers_key(),
                "fleet policies: comparing numbers again"
            );
        }
        let mut differing = Vec::new();
        for ((policy, _), seen) in numbers.iter().zip(found) {
            if seen.others == 0 {
                continue;
            }
            self.mismatched.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!(
                "tollgate_fleet_policies_mismatched_total",
                "policy" => policy.name().to_owned()
            )
            .increment(1);
            tracing::warn!(
                policy = policy.name(),
                unit = policy.unit().as_str(),
                others = seen.others,
                other_version = seen.label.as_deref().unwrap_or(""),
                version = %version,
                "fleet policies: other instances charge this budget under other numbers; \
                 each charge carries what was spent over to the charging instance's numbers"
            );
            differing.push(policy.name().to_owned());
        }
        let mut held = self
            .differing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for name in held.iter().filter(|name| !differing.contains(name)) {
            tracing::info!(
                policy = %name,
                version = %version,
                "fleet policies: the fleet charges this budget under the same numbers again"
            );
        }
        *held = differing;
    }
}

/// Per budget (one policy name and unit), its policy and a fingerprint of
/// every number the rules may charge it under: the distinct numbers of its
/// rules, sorted, so that a budget on one route or on two (a deploy that
/// adds a route) with the same numbers reads alike.
fn budget_numbers(rules: &[crate::Rule]) -> Vec<(Policy, String)> {
    let mut texts: Vec<(Policy, Vec<String>)> = Vec::new();
    for rule in rules {
        let text = rule.numbers_text();
        match texts.iter_mut().find(|(p, _)| p.same_budget(rule.policy())) {
            Some((_, all)) => all.push(text),
            None => texts.push((rule.policy().clone(), vec![text])),
        }
    }
    texts
        .into_iter()
        .map(|(policy, mut all)| {
            all.sort_unstable();
            all.dedup();
            let fingerprint = fnv1a(all.join(" | ").as_bytes());
            (policy, format!("{fingerprint:016x}"))
        })
        .collect()
}

/// The pause after try `n` of a change another publication beat: up to
/// 2^n ms (at most 64), a random share of it.
fn backoff(n: u32) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let most = 1u64 << n.min(6);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(n);
    Duration::from_millis(1 + hasher.finish() % most)
}

/// FNV-1a, 64 bits: the same on every build (unlike the standard hasher),
/// so that instances built apart compare alike.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A name for this instance among the others: its process id and a random
/// part (hosts share process ids).
fn instance_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{}-{:016x}", std::process::id(), hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Rate, Rule};

    fn export(capacity: u64, rate: Rate) -> Policy {
        Policy::token_bucket("export", capacity, rate).unwrap()
    }

    fn fingerprint(rule: Rule) -> String {
        budget_numbers(&[rule]).remove(0).1
    }

    #[test]
    fn a_fingerprint_is_of_the_numbers_not_of_how_they_were_written() {
        let ab = Rule::per_account(export(3, Rate::per_second(2)))
            .plan("a", export(5, Rate::per_second(1)))
            .plan("b", export(7, Rate::per_second(1)));
        let ba = Rule::per_account(export(3, Rate::per_minute(120)))
            .plan("b", export(7, Rate::per_second(1)))
            .plan("a", export(5, Rate::new(1000, Duration::from_secs(1000))));
        assert_eq!(fingerprint(ab.clone()), fingerprint(ba));
        let other_plan = Rule::per_account(export(3, Rate::per_second(2)))
            .plan("a", export(5, Rate::per_second(1)))
            .plan("b", export(8, Rate::per_second(1)));
        assert_ne!(fingerprint(ab.clone()), fingerprint(other_plan));
        // A plan under another name, an override instead of a plan: other.
        let renamed = Rule::per_account(export(3, Rate::per_second(2)))
            .plan("a", export(5, Rate::per_second(1)))
            .plan("c", export(7, Rate::per_second(1)));
        assert_ne!(fingerprint(ab.clone()), fingerprint(renamed));
        let tenant = Rule::per_account(export(3, Rate::per_second(2)))
            .plan("a", export(5, Rate::per_second(1)))
            .for_tenant("b", export(7, Rate::per_second(1)));
        assert_ne!(fingerprint(ab), fingerprint(tenant));
    }

    #[test]
    fn the_rules_of_one_budget_share_a_fingerprint_and_others_have_their_own() {
        let upload = Policy::token_bucket("upload", 3, Rate::per_second(2)).unwrap();
        let rules = [
            Rule::per_account(export(3, Rate::per_second(2))).on_route("/a"),
            Rule::per_client_ip(upload),
            Rule::per_account(export(3, Rate::per_second(2))).on_route("/b"),
        ];
        let numbers = budget_numbers(&rules);
        let names: Vec<&str> = numbers.iter().map(|(p, _)| p.name()).collect();
        assert_eq!(names, ["export", "upload"]);
        // A second route with the same numbers reads alike (a deploy that
        // adds one is no mismatch); other numbers on it do not.
        let one = budget_numbers(&rules[..2]);
        assert_eq!(numbers[0].1, one[0].1);
        assert_eq!(numbers[1].1, one[1].1);
        let other = budget_numbers(&[
            rules[0].clone(),
            Rule::per_account(export(4, Rate::per_second(2))).on_route("/b"),
        ]);
        assert_ne!(numbers[0].1, other[0].1);
    }

    #[test]
    fn fnv1a_matches_its_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
