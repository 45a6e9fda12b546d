//! The fleet's policy set in Redis (`policies.lua`): one hash,
//! `PREFIX:policies`, holding a version that only rises and the set's
//! text, written together and announced on the channel `PREFIX:policies`
//! (pub/sub). The store knows the set only as text: what it means is the
//! layer's (`tollgate`'s `FleetPolicies` reads and applies it).
//!
//! Beside it, `PREFIX:policies:numbers` holds which numbers each instance
//! charges each budget under, so that instances charging one budget under
//! different numbers see it ([`RedisStore::compare_numbers`]).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tollgate_budget::{Policy, StoreError, StoreErrorKind};

use crate::lua::{self, POLICIES_SOURCE};
use crate::store::RedisStore;

/// A published policy set: its version and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedPolicies {
    /// Raised by one at every publication.
    pub version: u64,
    /// The set as it was published.
    pub text: String,
}

/// What [`RedisStore::compare_numbers`] found for one budget.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NumbersCompared {
    /// How many other instances charge the budget under other numbers.
    pub others: u64,
    /// The label of one of them, if any.
    pub label: Option<String>,
}

/// Versions announced on the policy channel, as they come (pub/sub): see
/// [`RedisStore::policy_announcements`].
pub struct PolicyAnnouncements {
    stream: redis::aio::PubSubStream,
}

impl std::fmt::Debug for PolicyAnnouncements {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyAnnouncements")
            .finish_non_exhaustive()
    }
}

impl PolicyAnnouncements {
    /// The next announced version; `None` when the subscription ended
    /// (the connection was lost: subscribe again). An announcement that is
    /// not a version is skipped.
    pub async fn next(&mut self) -> Option<u64> {
        loop {
            let message =
                std::future::poll_fn(|cx: &mut Context<'_>| poll_next(&mut self.stream, cx))
                    .await?;
            if let Ok(version) = message.get_payload::<u64>() {
                return Some(version);
            }
        }
    }
}

fn poll_next(
    stream: &mut redis::aio::PubSubStream,
    cx: &mut Context<'_>,
) -> Poll<Option<redis::Msg>> {
    futures_core::Stream::poll_next(Pin::new(stream), cx)
}

impl RedisStore {
    /// The key of the fleet's policy set, and the channel its versions are
    /// announced on (the same name).
    pub fn policies_key(&self) -> String {
        format!("{}:policies", self.inner.prefix)
    }

    /// The Lua source of the policy script (read, publish, restore), for
    /// operators who audit it.
    pub fn policies_script_source() -> &'static str {
        POLICIES_SOURCE
    }

    async fn policies_call<T: redis::FromRedisValue>(
        &self,
        op: &str,
        text: &str,
        version: u64,
    ) -> Result<T, StoreError> {
        let key = self.policies_key();
        let version = version.to_string();
        let args = [op, text, &version, &key];
        // Not `policies_script_call(..).await`: one more nested future
        // took callers' futures past the compiler's query depth.
        let (invocation, eval) = policies_invocation(&key, &args);
        self.run::<T>(&invocation, eval, self.deadline()).await
    }

    /// The policy script on `key` with `args` (EVALSHA, then EVAL when the
    /// script is not loaded).
    async fn policies_script_call<T: redis::FromRedisValue>(
        &self,
        key: &str,
        args: &[&str],
    ) -> Result<T, StoreError> {
        let (invocation, eval) = policies_invocation(key, args);
        self.run::<T>(&invocation, eval, self.deadline()).await
    }

    /// The key of the numbers each instance charges its budgets under
    /// ([`compare_numbers`](Self::compare_numbers)).
    pub fn numbers_key(&self) -> String {
        format!("{}:policies:numbers", self.inner.prefix)
    }

    /// Says which numbers `instance` charges each budget of `numbers`
    /// under (a policy, and a fingerprint of every number this instance
    /// may charge that policy's budget under: its plans and overrides
    /// too), and compares them with what the other instances on this
    /// Redis said; answers per budget, in order, how many other instances
    /// charge it under other numbers. An instance that has said nothing
    /// for `quiet` is gone; a difference counts only once both sides have
    /// had their numbers for `settle` (a publication still on its way is
    /// no mismatch). `label` (say, the fleet version the instance runs;
    /// no spaces) comes back with a mismatch, to tell the operator which
    /// instance differs.
    ///
    /// # Errors
    ///
    /// The store's error.
    pub async fn compare_numbers(
        &self,
        instance: &str,
        label: &str,
        numbers: &[(Policy, String)],
        quiet: Duration,
        settle: Duration,
    ) -> Result<Vec<NumbersCompared>, StoreError> {
        let key = self.numbers_key();
        let quiet = quiet.as_millis().max(1).to_string();
        let settle = settle.as_millis().to_string();
        let budgets: Vec<String> = numbers
            .iter()
            .map(|(policy, _)| crate::keys::budget(policy))
            .collect();
        let mut args: Vec<&str> = vec!["numbers", instance, &quiet, &settle];
        for (budget, (_, fingerprint)) in budgets.iter().zip(numbers) {
            args.extend([budget.as_str(), fingerprint.as_str(), label]);
        }
        let reply: Vec<(u64, Option<String>)> = self.policies_script_call(&key, &args).await?;
        Ok(reply
            .into_iter()
            .map(|(others, label)| NumbersCompared { others, label })
            .collect())
    }

    /// The policy set published last, if any. A version that is not up
    /// to 15 decimal digits (written by hand: `1e3`, `inf`, ` 12`) reads
    /// as version 0, here and in the script alike: a set that any
    /// instance running a version writes back over
    /// ([`restore_policies`](Self::restore_policies)), and any publication
    /// replaces.
    ///
    /// # Errors
    ///
    /// The store's error.
    pub async fn published_policies(&self) -> Result<Option<PublishedPolicies>, StoreError> {
        let (version, text): (Option<String>, Option<String>) =
            self.policies_call("read", "", 0).await?;
        let Some(version) = version else {
            return Ok(None);
        };
        Ok(Some(PublishedPolicies {
            version: version_of(&version),
            text: text.unwrap_or_default(),
        }))
    }

    /// Publishes `text` as the next version of the fleet's policy set,
    /// written with its version in one step and announced; returns the
    /// version: one above both the version held and `running` (the version
    /// the caller runs), so that no version goes down, even on a Redis
    /// that lost the set.
    ///
    /// # Errors
    ///
    /// The store's error: then nothing was published, unless the error is
    /// [uncertain](StoreErrorKind::Uncertain) (no answer in time: it may
    /// have been).
    pub async fn publish_policies(&self, text: &str, running: u64) -> Result<u64, StoreError> {
        let (_, version): (u8, u64) = self.policies_call("publish", text, running).await?;
        Ok(version)
    }

    /// Publishes `text` as version `after + 1` only if the version held is
    /// still `after` (the one the change was made on): `Ok(Ok(version))`,
    /// or `Ok(Err(held))` when another publication came first (nothing
    /// written: read again, and make the change again).
    ///
    /// # Errors
    ///
    /// As [`publish_policies`](Self::publish_policies).
    pub async fn publish_policies_after(
        &self,
        text: &str,
        after: u64,
    ) -> Result<Result<u64, u64>, StoreError> {
        let (written, version): (u8, u64) =
            self.policies_call("publish_after", text, after).await?;
        Ok(if written == 1 {
            Ok(version)
        } else {
            Err(version)
        })
    }

    /// Writes `text` back as `version` when Redis has no set or an older
    /// version (it lost the set, say in a restart without persistence),
    /// and announces it; `true` if it wrote. Every instance may call it:
    /// the newest version wins, and no version goes down.
    ///
    /// # Errors
    ///
    /// The store's error.
    pub async fn restore_policies(&self, version: u64, text: &str) -> Result<bool, StoreError> {
        let written: u64 = self.policies_call("restore", text, version).await?;
        Ok(written != 0)
    }

    /// Subscribes to the announcements of new versions, on a connection of
    /// its own. `None` for a store that was not made from a URL (a cluster,
    /// Sentinel, a connection given to it): watch with
    /// [`published_policies`](Self::published_policies) alone.
    ///
    /// # Errors
    ///
    /// Connecting or subscribing failed.
    pub async fn policy_announcements(&self) -> Option<Result<PolicyAnnouncements, StoreError>> {
        let client = self.inner.pubsub.as_ref()?;
        let subscribe = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(self.policies_key()).await?;
            Ok::<_, redis::RedisError>(PolicyAnnouncements {
                stream: pubsub.into_on_message(),
            })
        };
        Some(
            match tokio::time::timeout(self.inner.connect_timeout, subscribe).await {
                Ok(Ok(announcements)) => Ok(announcements),
                Ok(Err(e)) => Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "subscribing to the policy announcements failed",
                )
                .with_source(e)),
                Err(_) => Err(StoreError::new(
                    StoreErrorKind::Unavailable,
                    "subscribing to the policy announcements timed out",
                )),
            },
        )
    }
}

/// The policy script on `key` with `args`: its EVALSHA invocation, and
/// the EVAL to send when the script is not loaded.
fn policies_invocation<'a>(
    key: &'a str,
    args: &'a [&'a str],
) -> (
    redis::ScriptInvocation<'static>,
    impl Fn() -> redis::Cmd + 'a,
) {
    let mut invocation = lua::policies_script().prepare_invoke();
    invocation.key(key);
    for arg in args {
        invocation.arg(*arg);
    }
    let eval = move || {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(POLICIES_SOURCE).arg(1).arg(key);
        for arg in args {
            cmd.arg(*arg);
        }
        cmd
    };
    (invocation, eval)
}

/// A version as the script reads it: up to 15 decimal digits (exact in
/// Lua's numbers), anything else none (0).
fn version_of(text: &str) -> u64 {
    if text.is_empty() || text.len() > 15 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return 0;
    }
    text.parse().unwrap_or(0)
}
