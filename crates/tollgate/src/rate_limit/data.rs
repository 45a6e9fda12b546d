//! Policies as data (feature `serde`): a [`PolicySet`] says, for rules
//! named by their policy's name, the numbers of their default policy, of
//! their plans, and of their tenants' and accounts' overrides, in a form
//! `serde` reads and writes (JSON, TOML, …). It maps one to one onto the
//! builder: [`RulesHandle::apply`](crate::RulesHandle::apply) puts it
//! in force as [`Rule::plan`](crate::Rule::plan),
//! [`Rule::for_tenant`](crate::Rule::for_tenant) and
//! [`Rule::for_account`](crate::Rule::for_account) would, with the same
//! validation, and every error names the field and the rule it broke
//! (`rules.export.plans.pro.capacity: must be at least 1`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tollgate_budget::{Initial, Policy, Rate};

/// Runtime policy changes as data: for each rule, named by its policy's
/// name, what to put in force. Rules the set does not name keep the
/// policies they were built with.
///
/// In JSON:
///
/// ```json
/// {"rules": {"export": {
///     "policy": {"capacity": 3, "refill": {"per_second": 1}},
///     "plans": {"pro": {"capacity": 30, "refill": {"per_second": 10}}},
///     "tenants": {"internal": {"capacity": 1000, "refill": {"per_second": 500}}},
///     "accounts": {"acme/batch": {"algorithm": "fixed_window", "limit": 100, "window": {"minutes": 1}}}
/// }}}
/// ```
///
/// ```
/// use tollgate::rate_limit::PolicySet;
///
/// let set = PolicySet::from_json(r#"{"rules": {"export": {"plans": {"pro": {"capacity": 6, "refill": {"per_second": 2}}}}}}"#)?;
/// assert_eq!(set.rules["export"].plans["pro"].capacity, Some(6));
/// let bad = PolicySet::from_json(r#"{"rules": {"export": {"plans": {"pro": {"capacity": 0, "refill": {"per_second": 2}}}}}}"#);
/// assert_eq!(bad.unwrap_err().to_string(), "rules.export.plans.pro.capacity: must be at least 1");
/// # Ok::<(), tollgate::rate_limit::InvalidPolicySet>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PolicySet {
    /// Each rule's policies, by the name of the rule's policy.
    #[serde(default, deserialize_with = "unique")]
    pub rules: BTreeMap<String, RulePolicies>,
}

/// What a [`PolicySet`] puts in force for one rule. What it leaves out
/// stays as the rule was built.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct RulePolicies {
    /// The rule's default policy (for no plan, other plans, and requests
    /// without a principal).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "object_or_none"
    )]
    pub policy: Option<PolicyData>,
    /// Policies by plan ([`Rule::plan`](crate::Rule::plan)).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "unique"
    )]
    pub plans: BTreeMap<String, PolicyData>,
    /// Policies by tenant ([`Rule::for_tenant`](crate::Rule::for_tenant)).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "unique"
    )]
    pub tenants: BTreeMap<String, PolicyData>,
    /// Policies by account, as `tenant/account`
    /// ([`Rule::for_account`](crate::Rule::for_account); the tenant is
    /// what comes before the first `/`).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "unique"
    )]
    pub accounts: BTreeMap<String, PolicyData>,
}

/// One policy's numbers as data; its name is its rule's, and its unit the
/// rule's (as [`RulesHandle::set_policy`](crate::RulesHandle::set_policy)
/// takes it).
///
/// A token bucket (the default algorithm) has `capacity`, `refill` and
/// optionally `initial` (`"full"`, the default, or `"empty"`); a fixed or
/// sliding window has `limit` and `window`. A field of the other kind is an
/// error, not ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PolicyData {
    /// The time rule.
    #[serde(default)]
    pub algorithm: AlgorithmName,
    /// A token bucket's capacity, at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity: Option<u64>,
    /// A token bucket's refill rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill: Option<Every>,
    /// A token bucket's credit for a key never seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<InitialData>,
    /// A window's limit, at least 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// A window's length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<Span>,
}

/// [`PolicyData::algorithm`]: `"token_bucket"` (the default),
/// `"fixed_window"` or `"sliding_window"`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AlgorithmName {
    /// [`Policy::token_bucket`].
    #[default]
    TokenBucket,
    /// [`Policy::fixed_window`].
    FixedWindow,
    /// [`Policy::sliding_window`].
    SlidingWindow,
}

/// [`PolicyData::initial`]: `"full"` or `"empty"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum InitialData {
    /// [`Initial::Full`].
    Full,
    /// [`Initial::Empty`].
    Empty,
}

/// A refill rate as data: `{"per_second": 2}`, `{"per_minute": 100}`,
/// `{"per_hour": 1000}`, or `{"every": {"amount": 3, "millis": 1500}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Every {
    /// Units per second.
    PerSecond(u64),
    /// Units per minute.
    PerMinute(u64),
    /// Units per hour.
    PerHour(u64),
    /// `amount` units every `millis` milliseconds.
    Every {
        /// Units per period.
        amount: u64,
        /// The period in milliseconds.
        millis: u64,
    },
}

/// A window's length as data: `{"millis": 500}`, `{"seconds": 10}`,
/// `{"minutes": 1}` or `{"hours": 24}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Span {
    /// Milliseconds.
    Millis(u64),
    /// Seconds.
    Seconds(u64),
    /// Minutes.
    Minutes(u64),
    /// Hours.
    Hours(u64),
}

/// Why a [`PolicySet`] was refused: the field, as a dotted path from the
/// set (`rules.export.plans.pro.capacity`), and the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPolicySet {
    path: String,
    reason: String,
}

impl fmt::Display for InvalidPolicySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.path.as_str() {
            "" => f.write_str(&self.reason),
            path => write!(f, "{path}: {}", self.reason),
        }
    }
}

impl std::error::Error for InvalidPolicySet {}

impl InvalidPolicySet {
    pub(crate) fn new(path: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self {
            path: path.into(),
            reason: reason.to_string(),
        }
    }

    /// The field, as a dotted path from the set (empty for the whole set).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The rule it broke.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl PolicySet {
    /// Reads a set from JSON and checks every policy in it
    /// ([`validate`](Self::validate)); a syntax or type error names its
    /// field too. The set and every policy in it are JSON objects (a list
    /// is refused, not read field by field), and a key given twice is an
    /// error, not the last one winning.
    ///
    /// # Errors
    ///
    /// [`InvalidPolicySet`] for JSON that is not a policy set, or a
    /// policy that is not valid.
    pub fn from_json(json: &str) -> Result<Self, InvalidPolicySet> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| InvalidPolicySet::new("", format!("not JSON: {e}")))?;
        no_lists(&value, "")?;
        let set: Self = from_json_at(json, "")?;
        set.validate()?;
        Ok(set)
    }

    /// The set as JSON.
    pub fn to_json(&self) -> String {
        // A map of strings to plain data: always serializable.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Checks every policy as the builder would
    /// ([`Policy::token_bucket`] and the windows), and every account's
    /// `tenant/account` form. Which rules exist is checked when the set is
    /// [applied](crate::RulesHandle::apply).
    ///
    /// # Errors
    ///
    /// The first invalid field.
    pub fn validate(&self) -> Result<(), InvalidPolicySet> {
        for (name, rule) in &self.rules {
            rule.each(name, |_, path, data| data.policy(name, &path).map(|_| ()))?;
        }
        Ok(())
    }
}

/// Reads `T` from `json`, a type error named by its field's path after
/// `prefix` (each segment as [`segment`] writes it).
pub(crate) fn from_json_at<T: serde::de::DeserializeOwned>(
    json: &str,
    prefix: &str,
) -> Result<T, InvalidPolicySet> {
    let mut de = serde_json::Deserializer::from_str(json);
    let read = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let mut path = prefix.to_owned();
        for part in e.path().iter() {
            let text = match part {
                serde_path_to_error::Segment::Map { key } => segment(key),
                serde_path_to_error::Segment::Seq { index } => index.to_string(),
                serde_path_to_error::Segment::Enum { variant } => segment(variant),
                serde_path_to_error::Segment::Unknown => "?".to_owned(),
            };
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(&text);
        }
        InvalidPolicySet::new(path, e.into_inner())
    })?;
    de.end()
        .map_err(|e| InvalidPolicySet::new(prefix, format!("after the JSON: {e}")))?;
    Ok(read)
}

/// Refuses a list anywhere in `value`: the format has none, and `serde`
/// would read one as the fields of a struct, in order.
fn no_lists(value: &serde_json::Value, path: &str) -> Result<(), InvalidPolicySet> {
    match value {
        serde_json::Value::Array(_) => Err(InvalidPolicySet::new(
            path,
            "a list, where an object or a number goes",
        )),
        serde_json::Value::Object(map) => map.iter().try_for_each(|(key, v)| {
            let at = match path {
                "" => segment(key),
                _ => format!("{path}.{}", segment(key)),
            };
            no_lists(v, &at)
        }),
        _ => Ok(()),
    }
}

/// A `T` written as an object: a list is refused, in every format (`serde`
/// would read one as `T`'s fields in order, e.g. from TOML).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Fields<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(Fields(std::marker::PhantomData))
            .map(Object)
    }
}

/// An optional policy, written as an object when it is given.
fn object_or_none<'de, D>(deserializer: D) -> Result<Option<PolicyData>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Ok(Option::<Object<PolicyData>>::deserialize(deserializer)?.map(|Object(data)| data))
}

/// Reads a map, refusing a key given twice (rather than keeping the last),
/// each value written as an object.
fn unique<'de, D, V>(deserializer: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Unique<V>(std::marker::PhantomData<V>);

    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Unique<V> {
        type Value = BTreeMap<String, V>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object, each key once")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut read = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                if read.contains_key(&key) {
                    return Err(serde::de::Error::custom(format!("{key:?} is given twice")));
                }
                let Object(value) = map.next_value()?;
                read.insert(key, value);
            }
            Ok(read)
        }
    }

    deserializer.deserialize_map(Unique(std::marker::PhantomData))
}

/// Where in a rule's policies a [`PolicyData`] goes.
pub(crate) enum Place<'a> {
    Default,
    Plan(&'a str),
    Tenant(&'a str),
    Account(&'a str, &'a str),
}

impl RulePolicies {
    /// Calls `f` with each policy's place, path and data, in order:
    /// the default, plans, tenants, accounts.
    pub(crate) fn each(
        &self,
        name: &str,
        mut f: impl FnMut(Place<'_>, String, &PolicyData) -> Result<(), InvalidPolicySet>,
    ) -> Result<(), InvalidPolicySet> {
        let at =
            |field: &str, key: &str| format!("rules.{}.{field}.{}", segment(name), segment(key));
        if let Some(data) = &self.policy {
            f(
                Place::Default,
                format!("rules.{}.policy", segment(name)),
                data,
            )?;
        }
        for (plan, data) in &self.plans {
            f(Place::Plan(plan), at("plans", plan), data)?;
        }
        for (tenant, data) in &self.tenants {
            f(Place::Tenant(tenant), at("tenants", tenant), data)?;
        }
        for (account, data) in &self.accounts {
            let path = at("accounts", account);
            let Some((tenant, account)) = account.split_once('/') else {
                return Err(InvalidPolicySet::new(
                    path,
                    "an account is written tenant/account",
                ));
            };
            f(Place::Account(tenant, account), path, data)?;
        }
        Ok(())
    }
}

/// A map key as a path segment: as it is when it is a plain name, quoted
/// otherwise (so that a key with a dot cannot be read as two segments).
pub(crate) fn segment(key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
    if plain {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

impl PolicyData {
    /// Reads one policy from JSON (an object: a list is refused, and so
    /// is a field given twice or a field no policy has); a syntax or type
    /// error names its field. Its numbers are checked when the set it goes
    /// into is ([`PolicySet::validate`]).
    ///
    /// # Errors
    ///
    /// [`InvalidPolicySet`], its path relative to the policy.
    pub fn from_json(json: &str) -> Result<Self, InvalidPolicySet> {
        let value: serde_json::Value = serde_json::from_str(json)
            .map_err(|e| InvalidPolicySet::new("", format!("not JSON: {e}")))?;
        if !value.is_object() {
            return Err(InvalidPolicySet::new("", "a policy is a JSON object"));
        }
        no_lists(&value, "")?;
        from_json_at(json, "")
    }

    /// The policy named `name` these numbers make, as the builder makes
    /// it; errors say `path` and the field.
    pub(crate) fn policy(&self, name: &str, path: &str) -> Result<Policy, InvalidPolicySet> {
        let field = |f: &str| format!("{path}.{f}");
        let positive = |f: &str, n: Option<u64>, what: &str| match n {
            None => Err(InvalidPolicySet::new(
                field(f),
                format!("missing: {what} needs it"),
            )),
            Some(0) => Err(InvalidPolicySet::new(field(f), "must be at least 1")),
            Some(n) => Ok(n),
        };
        let not_here =
            |present: &[(&str, bool)], what: &str| match present.iter().find(|(_, is)| *is) {
                Some((f, _)) => Err(InvalidPolicySet::new(
                    field(f),
                    format!("not a field of {what}"),
                )),
                None => Ok(()),
            };
        let whole = |e: tollgate_budget::InvalidPolicy| InvalidPolicySet::new(path, e.reason());
        match self.algorithm {
            AlgorithmName::TokenBucket => {
                let what = "a token bucket (capacity, refill, initial)";
                not_here(
                    &[
                        ("limit", self.limit.is_some()),
                        ("window", self.window.is_some()),
                    ],
                    what,
                )?;
                let capacity = positive("capacity", self.capacity, "a token bucket")?;
                let Some(refill) = self.refill else {
                    return Err(InvalidPolicySet::new(
                        field("refill"),
                        "missing: a token bucket needs it",
                    ));
                };
                let rate = refill.rate(&field("refill"))?;
                let policy = Policy::token_bucket(name, capacity, rate).map_err(whole)?;
                Ok(match self.initial {
                    Some(InitialData::Empty) => policy.with_initial(Initial::Empty),
                    _ => policy,
                })
            }
            AlgorithmName::FixedWindow | AlgorithmName::SlidingWindow => {
                let what = "a window (limit, window)";
                not_here(
                    &[
                        ("capacity", self.capacity.is_some()),
                        ("refill", self.refill.is_some()),
                        ("initial", self.initial.is_some()),
                    ],
                    what,
                )?;
                let limit = positive("limit", self.limit, "a window")?;
                let Some(window) = self.window else {
                    return Err(InvalidPolicySet::new(
                        field("window"),
                        "missing: a window needs it",
                    ));
                };
                let window = window.duration(&field("window"))?;
                let made = match self.algorithm {
                    AlgorithmName::FixedWindow => Policy::fixed_window(name, limit, window),
                    _ => Policy::sliding_window(name, limit, window),
                };
                made.map_err(whole)
            }
        }
    }
}

impl Every {
    fn rate(self, path: &str) -> Result<Rate, InvalidPolicySet> {
        let (field, amount, rate) = match self {
            Every::PerSecond(n) => ("per_second", n, Rate::per_second(n)),
            Every::PerMinute(n) => ("per_minute", n, Rate::per_minute(n)),
            Every::PerHour(n) => ("per_hour", n, Rate::per_hour(n)),
            Every::Every { amount, millis } => {
                if millis == 0 {
                    return Err(InvalidPolicySet::new(
                        format!("{path}.every.millis"),
                        "must be at least 1",
                    ));
                }
                (
                    "every.amount",
                    amount,
                    Rate::new(amount, Duration::from_millis(millis)),
                )
            }
        };
        if amount == 0 {
            return Err(InvalidPolicySet::new(
                format!("{path}.{field}"),
                "must be at least 1",
            ));
        }
        Ok(rate)
    }
}

impl Span {
    fn duration(self, path: &str) -> Result<Duration, InvalidPolicySet> {
        let (field, n, each) = match self {
            Span::Millis(n) => ("millis", n, 1),
            Span::Seconds(n) => ("seconds", n, 1_000),
            Span::Minutes(n) => ("minutes", n, 60_000),
            Span::Hours(n) => ("hours", n, 3_600_000),
        };
        match n.checked_mul(each) {
            Some(0) => Err(InvalidPolicySet::new(
                format!("{path}.{field}"),
                "must be at least 1",
            )),
            Some(ms) => Ok(Duration::from_millis(ms)),
            None => Err(InvalidPolicySet::new(
                format!("{path}.{field}"),
                "is too long",
            )),
        }
    }
}
