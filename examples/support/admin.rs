//! The quickstart's policy set and its admin routes.
//!
//! With `--store`, the set is the fleet's ([`FleetPolicies`]): loaded
//! before serving, followed while serving, published by a `PUT`. Without
//! it, the set is this process's ([`RulesHandle::apply`]), with a version
//! of its own. With `--admin-token TOKEN`:
//!
//! - `PUT /admin/policies/{rule}`: the body (a policy in its data form,
//!   e.g. `{"capacity": 6, "refill": {"per_second": 2}}`) becomes the
//!   default policy of the rules whose policy is named `{rule}`;
//! - `PUT /admin/policies/{rule}/plans/{plan}`: the policy of plan
//!   `{plan}` in those rules;
//! - `GET /admin/policies`: `{"version": N, "set": {...}}`, the set in
//!   force.
//!
//! `Authorization: Bearer TOKEN` or `401`; a rule no rule has, `404`; a
//! body that is not a valid policy, `400` with the error naming the field;
//! Redis failing, `503`. A `PUT` answers with the new version and set.
//! Two `PUT`s at once on two instances: the later one's set wins (each is
//! the set its instance had, with its own change).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tokio::sync::{Mutex, OnceCell};
use tollgate::RedisStore;
use tollgate::RulesHandle;
use tollgate::rate_limit::PolicySet;
use tollgate::redis::{FleetPolicies, PublishError};
use tollgate::store::DynStore;

type Store = Arc<dyn DynStore>;

/// The set in force, and how it changes.
#[derive(Clone)]
pub(crate) struct Policies {
    handle: RulesHandle<Store>,
    /// With `--store`: the fleet's set, once Redis has answered.
    fleet: Option<Arc<OnceCell<FleetPolicies<Store>>>>,
    /// Without `--store`: the version of the set in force here.
    local: Arc<Mutex<u64>>,
    /// One change at a time in this process, each made on the set in
    /// force.
    edits: Arc<Mutex<()>>,
}

impl Policies {
    /// With `redis`, loads the fleet's set (before serving) and follows
    /// it; if Redis does not answer yet, keeps trying every second in the
    /// background, serving the rules as built meanwhile.
    pub(crate) async fn start(handle: RulesHandle<Store>, redis: Option<RedisStore>) -> Self {
        let fleet = match redis {
            None => None,
            Some(redis) => {
                let cell = Arc::new(OnceCell::new());
                match FleetPolicies::start(redis.clone(), handle.clone()).await {
                    Ok(fleet) => {
                        let _ = cell.set(fleet);
                    }
                    Err(e) => {
                        eprintln!(
                            "fleet policies: {e} (serving the rules as built; trying again every second)"
                        );
                        let (cell, handle) = (cell.clone(), handle.clone());
                        tokio::spawn(async move {
                            loop {
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                if let Ok(fleet) =
                                    FleetPolicies::start(redis.clone(), handle.clone()).await
                                {
                                    let _ = cell.set(fleet);
                                    eprintln!("fleet policies: following the fleet's set");
                                    return;
                                }
                            }
                        });
                    }
                }
                Some(cell)
            }
        };
        Self {
            handle,
            fleet,
            local: Arc::default(),
            edits: Arc::default(),
        }
    }

    /// The version and set in force.
    async fn current(&self) -> Result<(u64, PolicySet), Response> {
        match &self.fleet {
            Some(cell) => match cell.get() {
                Some(fleet) => Ok((fleet.version(), fleet.set())),
                None => Err(unavailable()),
            },
            None => Ok((*self.local.lock().await, self.handle.applied_set())),
        }
    }

    /// Puts `set` in force: published to the fleet, or applied here.
    async fn change(&self, set: &PolicySet) -> Result<u64, Response> {
        match &self.fleet {
            Some(cell) => {
                let fleet = cell.get().ok_or_else(unavailable)?;
                match fleet.publish(set).await {
                    Ok(version) => Ok(version),
                    Err(PublishError::Invalid(e)) => {
                        Err(problem(StatusCode::BAD_REQUEST, &e.to_string()))
                    }
                    Err(e) => Err(problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string())),
                }
            }
            None => {
                let mut version = self.local.lock().await;
                self.handle
                    .apply(set)
                    .map_err(|e| problem(StatusCode::BAD_REQUEST, &e.to_string()))?;
                *version += 1;
                Ok(*version)
            }
        }
    }
}

fn unavailable() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "the fleet's policy store has not answered yet",
    )
}

fn problem(status: StatusCode, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or(""),
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(http::header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

#[derive(Clone)]
struct Admin {
    token: Arc<str>,
    policies: Policies,
}

/// The admin routes, for `token`.
pub(crate) fn routes(token: String, policies: Policies) -> Router {
    let admin = Admin {
        token: token.into(),
        policies,
    };
    Router::new()
        .route("/admin/policies", get(show))
        .route("/admin/policies/{rule}", put(put_default))
        .route("/admin/policies/{rule}/plans/{plan}", put(put_plan))
        .with_state(admin)
}

/// `401` unless the request carries the token (compared in time that does
/// not depend on where a guess goes wrong); `None` when it does.
fn unauthorized(admin: &Admin, headers: &HeaderMap) -> Option<Response> {
    let given = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
        .unwrap_or_default();
    let expected = admin.token.as_bytes();
    let same = given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0;
    if same {
        return None;
    }
    let mut response = problem(
        StatusCode::UNAUTHORIZED,
        "the admin routes need the admin token",
    );
    response.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    Some(response)
}

fn answer(version: u64, set: &PolicySet) -> Response {
    let body = serde_json::json!({ "version": version, "set": set });
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn show(State(admin): State<Admin>, headers: HeaderMap) -> Response {
    if let Some(refused) = unauthorized(&admin, &headers) {
        return refused;
    }
    match admin.policies.current().await {
        Ok((version, set)) => answer(version, &set),
        Err(refused) => refused,
    }
}

async fn put_default(
    State(admin): State<Admin>,
    Path(rule): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    edit(admin, rule, None, headers, body).await
}

async fn put_plan(
    State(admin): State<Admin>,
    Path((rule, plan)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    edit(admin, rule, Some(plan), headers, body).await
}

/// The set in force with `body` as `rule`'s default policy (or its
/// `plan`'s), put in force.
async fn edit(
    admin: Admin,
    rule: String,
    plan: Option<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refused) = unauthorized(&admin, &headers) {
        return refused;
    }
    if !admin
        .policies
        .handle
        .rules()
        .iter()
        .any(|r| r.policy().name() == rule)
    {
        return problem(
            StatusCode::NOT_FOUND,
            &format!("no rule has a policy named {rule:?}"),
        );
    }
    // The body is one policy: parsed as a value first, so that it cannot
    // add anything else to the set.
    let policy: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(value @ serde_json::Value::Object(_)) => value,
        Ok(_) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "the body is a JSON object: one policy",
            );
        }
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &format!("the body is not JSON: {e}"),
            );
        }
    };
    let entry = match &plan {
        None => serde_json::json!({ "policy": policy }),
        Some(plan) => serde_json::json!({ "plans": { plan: policy } }),
    };
    let change =
        match PolicySet::from_json(&serde_json::json!({ "rules": { &rule: entry } }).to_string()) {
            Ok(change) => change,
            Err(e) => return problem(StatusCode::BAD_REQUEST, &e.to_string()),
        };
    let Some(changed) = change.rules.get(&rule) else {
        return problem(StatusCode::BAD_REQUEST, "no policy in the body");
    };
    let _one_at_a_time = admin.policies.edits.lock().await;
    let (_, mut set) = match admin.policies.current().await {
        Ok(current) => current,
        Err(refused) => return refused,
    };
    let into = set.rules.entry(rule).or_default();
    match &plan {
        None => into.policy = changed.policy,
        Some(plan) => {
            if let Some(policy) = changed.plans.get(plan) {
                into.plans.insert(plan.clone(), *policy);
            }
        }
    }
    match admin.policies.change(&set).await {
        Ok(version) => answer(version, &set),
        Err(refused) => refused,
    }
}
