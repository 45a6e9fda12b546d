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
//! - `GET /admin/policies`: `{"version": N, "set": {...}, "mismatched":
//!   [...]}`, the set in force, and the policies another quickstart on the
//!   same Redis charges under other numbers (with `--store`).
//!
//! `Authorization: Bearer TOKEN` or `401` (checked before the body is
//! read); a rule no rule has, `404`; a body that is not a valid policy,
//! `400` with the error naming the field; Redis failing, `503`. A `PUT`
//! answers with the new version and set. A `PUT` changes the set published
//! last (compare and publish): `PUT`s at once on several instances all
//! take effect, and a published set this instance cannot apply (a rule it
//! does not have, in the middle of a deploy) is `400`, not overwritten.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use http::{HeaderMap, StatusCode};
use tokio::sync::{Mutex, OnceCell};
use tollgate::RedisStore;
use tollgate::RulesHandle;
use tollgate::rate_limit::{PolicyData, PolicySet};
use tollgate::redis::{FleetPolicies, PublishError};
use tollgate::store::DynStore;

type Store = Arc<dyn DynStore>;

/// The set in force, and how it changes.
#[derive(Clone)]
pub(crate) struct Policies {
    handle: RulesHandle<Store>,
    /// With `--store`: the fleet's set, once Redis has answered.
    fleet: Option<Arc<OnceCell<FleetPolicies<Store>>>>,
    /// Without `--store`: the version of the set in force here (held
    /// while a change is made, so that changes go one at a time).
    local: Arc<Mutex<u64>>,
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

    /// The policies another quickstart on the same Redis charges under
    /// other numbers (none without `--store`).
    fn mismatched(&self) -> Vec<String> {
        match self.fleet.as_ref().and_then(|cell| cell.get()) {
            Some(fleet) => fleet.mismatched(),
            None => Vec::new(),
        }
    }

    /// Makes `change` to the set and puts the result in force: the
    /// fleet's set published last, changed and published if nothing was
    /// published in between; or this process's, applied here. Returns the
    /// version and the set.
    async fn change(&self, change: impl Fn(&mut PolicySet)) -> Result<(u64, PolicySet), Response> {
        match &self.fleet {
            Some(cell) => {
                let fleet = cell.get().ok_or_else(unavailable)?;
                fleet.publish_change(change).await.map_err(|e| match e {
                    PublishError::Invalid(e) => problem(StatusCode::BAD_REQUEST, &e.to_string()),
                    e => problem(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
                })
            }
            None => {
                let mut version = self.local.lock().await;
                let mut set = self.handle.applied_set();
                change(&mut set);
                self.handle
                    .apply(&set)
                    .map_err(|e| problem(StatusCode::BAD_REQUEST, &e.to_string()))?;
                *version += 1;
                Ok((*version, set))
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

/// `401` unless the request carries the token (`Bearer`, in any case);
/// `None` when it does. Compared in time that depends on the token's
/// length only, not on where a guess goes wrong or how long it is.
fn unauthorized(admin: &Admin, headers: &HeaderMap) -> Option<Response> {
    let given = headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(|v| {
            let (scheme, rest) = v.split_at_checked(7)?;
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
        })
        .unwrap_or_default();
    let expected = admin.token.as_bytes();
    let mut diff = u8::from(given.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(0);
    }
    if diff == 0 {
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
    json(serde_json::json!({ "version": version, "set": set }))
}

fn json(body: serde_json::Value) -> Response {
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
        Ok((version, set)) => json(serde_json::json!({
            "version": version,
            "set": set,
            "mismatched": admin.policies.mismatched(),
        })),
        Err(refused) => refused,
    }
}

async fn put_default(
    State(admin): State<Admin>,
    Path(rule): Path<String>,
    req: Request,
) -> Response {
    edit(admin, rule, None, req).await
}

async fn put_plan(
    State(admin): State<Admin>,
    Path((rule, plan)): Path<(String, String)>,
    req: Request,
) -> Response {
    edit(admin, rule, Some(plan), req).await
}

/// The largest body a `PUT` reads: one policy is a few dozen bytes.
const MAX_BODY: usize = 16 * 1024;

/// The set with the request's body as `rule`'s default policy (or its
/// `plan`'s), put in force.
async fn edit(admin: Admin, rule: String, plan: Option<String>, req: Request) -> Response {
    // The token before anything else: no body is read for a stranger.
    if let Some(refused) = unauthorized(&admin, req.headers()) {
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
    let body = match axum::body::to_bytes(req.into_body(), MAX_BODY).await {
        Ok(body) => body,
        Err(_) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("a policy is at most {MAX_BODY} bytes"),
            );
        }
    };
    let place = match &plan {
        None => format!("rules.{rule}.policy"),
        Some(plan) => format!("rules.{rule}.plans.{plan:?}"),
    };
    // One policy and nothing else: the body is read as a policy, so it
    // cannot add anything else to the set.
    let text = String::from_utf8_lossy(&body);
    let policy = match PolicyData::from_json(&text) {
        Ok(policy) => policy,
        Err(e) if e.path().is_empty() => {
            return problem(StatusCode::BAD_REQUEST, &format!("{place}: {}", e.reason()));
        }
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &format!("{place}.{}: {}", e.path(), e.reason()),
            );
        }
    };
    let result = admin
        .policies
        .change(|set| {
            let into = set.rules.entry(rule.clone()).or_default();
            match &plan {
                None => into.policy = Some(policy),
                Some(plan) => {
                    into.plans.insert(plan.clone(), policy);
                }
            }
        })
        .await;
    match result {
        Ok((version, set)) => answer(version, &set),
        Err(refused) => refused,
    }
}
