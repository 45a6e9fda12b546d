//! [`RateLimitLayer`] and its [`RateLimitBuilder`]: rules, store,
//! exemptions and answers, checked once when the layer is built.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use arc_swap::ArcSwap;
use http::HeaderValue;
use tollgate_budget::Store;
use tower_layer::Layer;

use super::config::{Config, OnStoreError, RuleSet, check, check_together};
use super::handle::RulesHandle;
use super::invalid::InvalidRule;
use super::{Exemption, RateLimit, Rule};
use crate::ClientIpResolver;
use crate::body::{InnerBody, Wrapped};
use crate::response::{RefusalBody, RefusalInfo, Shape};

/// Applies [`RateLimit`] to a service: the rules, the store, how client
/// addresses are resolved and what a store failure means. Made by
/// [`RateLimitLayer::builder`]; cheap to clone (the configuration is shared
/// behind an `Arc` by every service the layer makes).
///
/// ```
/// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     .rule(Rule::per_client_ip(Policy::token_bucket("per-ip", 10, Rate::per_second(5))?))
///     .build()?;
/// # let _ = layer;
/// # Ok(()) }
/// ```
///
/// Its services answer with a [`ResponseBody`](crate::ResponseBody) around
/// the inner body (`M` = [`Wrapped`], for any body), or with the inner body
/// type itself after [`with_inner_body`](Self::with_inner_body).
#[must_use]
pub struct RateLimitLayer<St, M = Wrapped> {
    config: Arc<Config<St>>,
    mode: PhantomData<fn() -> M>,
}

impl<St, M> Clone for RateLimitLayer<St, M> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
            mode: PhantomData,
        }
    }
}

impl<St, M> fmt::Debug for RateLimitLayer<St, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rules", &self.config.rules.load())
            .field("resolver", &self.config.resolver)
            .field("on_store_error", &self.config.on_store_error)
            .field("headers_on_admitted", &self.config.headers_on_admitted)
            .field("exemptions", &self.config.exemptions)
            .field("dry_run", &self.config.dry_run)
            .field("body", &short_name::<M>())
            .finish_non_exhaustive()
    }
}

/// `M`'s name without its path (`Wrapped`, `InnerBody`): the path of its
/// definition is not the one it is used by.
fn short_name<M>() -> &'static str {
    let name = std::any::type_name::<M>();
    name.rsplit("::").next().unwrap_or(name)
}

impl<St> RateLimitLayer<St> {
    /// The same layer, answering with the inner service's own body type
    /// instead of a [`ResponseBody`](crate::ResponseBody) around it: an
    /// admitted response is the inner response as it is (with the
    /// `RateLimit` fields added to its head), and a refusal's body is made
    /// with `From<Bytes>`. For inner bodies that have it: axum's `Body`
    /// (every axum `Router` and handler), http-body-util's `Full<Bytes>`.
    ///
    /// The answers are the same, byte for byte; only the type differs.
    /// With axum that saves work on every request: inside a `Router`, axum
    /// boxes a layer's response body unless it already is axum's `Body`;
    /// around a `Router` (the front door) the layer's service returns
    /// axum's own response type, so `axum::serve` takes it as it is,
    /// without a `map_response` that boxes every body.
    ///
    /// ```
    /// use std::net::SocketAddr;
    /// use axum::{Router, ServiceExt, extract::Request, routing::get};
    /// use tollgate::{MemoryStore, Policy, Rate, RateLimitLayer, Rule};
    /// use tower::Layer;
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let per_ip = RateLimitLayer::builder(MemoryStore::new())
    ///     .rule(Rule::per_client_ip(Policy::token_bucket("per-ip", 5, Rate::per_second(1))?))
    ///     .build()?
    ///     .with_inner_body();
    /// let router = Router::new().route("/", get(|| async { "hi" })).with_state(());
    /// // Around the router: its responses are axum's, ready to serve.
    /// let app = per_ip.layer(router);
    /// let _make = ServiceExt::<Request>::into_make_service_with_connect_info::<SocketAddr>(app);
    /// # Ok(()) }
    /// ```
    ///
    /// Around an inner body without `From<Bytes>` (hyper's `Incoming`, a
    /// boxed body, `Empty`), the layer's service is not a `Service` at
    /// all: the compiler says that `RateLimit<…, InnerBody>` does not
    /// implement `Service` (or, where a `Service` is required, that the
    /// body has no `From<Bytes>`). Leave `with_inner_body` out there.
    pub fn with_inner_body(self) -> RateLimitLayer<St, InnerBody> {
        RateLimitLayer {
            config: self.config,
            mode: PhantomData,
        }
    }
}

impl<St: Store> RateLimitLayer<St> {
    /// Starts a layer charging `store` (an `Arc` of a store is a store
    /// too, for one store shared by several layers), with no rules yet,
    /// peer-only client addresses, fail-closed on store errors and
    /// `RateLimit` fields on admitted responses.
    pub fn builder(store: St) -> RateLimitBuilder<St> {
        RateLimitBuilder {
            config: Config {
                store: Arc::new(store),
                rules: RuleSet::default(),
                applied: Arc::default(),
                resolver: ClientIpResolver::peer_only(),
                on_store_error: OnStoreError::FailClosed,
                headers_on_admitted: true,
                exemptions: Vec::new(),
                dry_run: false,
                www_authenticate: HeaderValue::from_static("Bearer"),
                log_level: tracing::Level::DEBUG,
                shape: None,
                max_waiting: 1024,
                waiters: Arc::default(),
                reported_no_matched_path: AtomicBool::new(false),
            },
            rules: Vec::new(),
        }
    }
}

impl<St: Store, M> RateLimitLayer<St, M> {
    /// A handle that replaces this layer's rules, or one policy or plan,
    /// while it serves, without a fresh budget ([`RulesHandle`]). Every
    /// clone of the layer, and every service made from it, follows the
    /// handle's changes.
    pub fn rules_handle(&self) -> RulesHandle<St> {
        let fallback = match &self.config.on_store_error {
            OnStoreError::Fallback(store) => Some(store.clone()),
            _ => None,
        };
        RulesHandle::new(
            self.config.rules.clone(),
            self.config.applied.clone(),
            self.config.store.clone(),
            fallback,
        )
    }
}

/// Configures a [`RateLimitLayer`], from [`RateLimitLayer::builder`]:
/// every method consumes and returns the builder, and
/// [`build`](Self::build) checks the rules once, in one place.
#[must_use]
pub struct RateLimitBuilder<St> {
    config: Config<St>,
    rules: Vec<Rule>,
}

impl<St> fmt::Debug for RateLimitBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitBuilder")
            .field("rules", &self.rules)
            .field("on_store_error", &self.config.on_store_error)
            .finish_non_exhaustive()
    }
}

impl<St: Store> RateLimitBuilder<St> {
    fn edit(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }

    /// Adds a rule. Every rule that applies to a request and whose key and
    /// cost are known is charged in one all-or-nothing store call, also
    /// when the layer then refuses the request for its own reasons (see
    /// [the order of answers](super#the-order-of-answers-every-request-counts-against-its-address)).
    pub fn rule(self, rule: Rule) -> Self {
        self.edit(|b| b.rules.push(rule))
    }

    /// The layer, once every rule is checked: its own routes and plans,
    /// and that the store (and a fallback store,
    /// [`on_store_error`](Self::on_store_error)) can hold each of its
    /// policies ([`Store::check_policy`]: e.g. a Redis store and a window
    /// longer than it can decide exactly), its
    /// [`charge_only_when`](Rule::charge_only_when) and its
    /// [`shape`](Rule::shape). A configuration error shows here, never as
    /// a `503` at runtime.
    ///
    /// # Errors
    ///
    /// The first rule that cannot be used, as an [`InvalidRule`] naming
    /// it and the fix.
    pub fn build(mut self) -> Result<RateLimitLayer<St>, InvalidRule> {
        check_together(&self.rules)?;
        for rule in &self.rules {
            check(&*self.config.store, rule)?;
            if let OnStoreError::Fallback(fallback) = &self.config.on_store_error {
                check(fallback, rule)?;
            }
        }
        self.config.rules = Arc::new(ArcSwap::from_pointee(self.rules));
        self.config.applied = Arc::default();
        Ok(RateLimitLayer {
            config: Arc::new(self.config),
            mode: PhantomData,
        })
    }

    /// Sets how client addresses are resolved (default: the peer only).
    pub fn client_ip(self, resolver: ClientIpResolver) -> Self {
        self.edit(|b| b.config.resolver = resolver)
    }

    /// Sets what a store failure means (default: fail closed, 503). A
    /// fallback store must hold every rule too: [`build`](Self::build)
    /// checks.
    pub fn on_store_error(self, what: OnStoreError) -> Self {
        self.edit(|b| b.config.on_store_error = what)
    }

    /// Whether admitted responses carry `RateLimit-Policy` and `RateLimit`
    /// (default: yes). Refusals always carry them.
    pub fn headers_on_admitted(self, yes: bool) -> Self {
        self.edit(|b| b.config.headers_on_admitted = yes)
    }

    /// Lets requests that `exemption` matches skip every rule of this layer
    /// (repeat to add more; any one exempts). An exempt request reaches the
    /// inner service without a store call, so a health check stays up
    /// while the store is down:
    /// `.exempt(Exemption::when(|req| req.uri.path() == "/healthz"))`.
    pub fn exempt(self, exemption: Exemption) -> Self {
        self.edit(|b| b.config.exemptions.push(exemption))
    }

    /// Makes every rule dry-run ([`Rule::dry_run`]): nothing is refused for
    /// lack of budget, would-be refusals are logged and counted, and the
    /// `RateLimit` fields still show each budget (`r=0` once spent).
    pub fn dry_run(self, yes: bool) -> Self {
        self.edit(|b| b.config.dry_run = yes)
    }

    /// Writes the body of this layer's HTTP refusals (`429`, `413`, `503`,
    /// `401`, ...) with `body`, e.g. in the application's own JSON error
    /// envelope, instead of tollgate's `application/problem+json`. The
    /// status, `Retry-After`, `Cache-Control: no-store`, the `RateLimit`
    /// fields and `WWW-Authenticate` stay tollgate's; gRPC refusals are
    /// unchanged (they carry no body).
    ///
    /// ```
    /// use tollgate::{MemoryStore, RateLimitLayer, RefusalBody};
    /// let layer = RateLimitLayer::builder(MemoryStore::new()).refusal_body(|refusal| {
    ///     // Whole seconds, rounded up as in Retry-After.
    ///     let wait = refusal.retry_after().map_or(0, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0));
    ///     RefusalBody::json(format!(
    ///         r#"{{"error":{{"code":{},"retry_in":{wait}}}}}"#,
    ///         refusal.status().as_u16()
    ///     ))
    /// }).build()?;
    /// # Ok::<(), tollgate::InvalidRule>(())
    /// ```
    pub fn refusal_body(
        self,
        body: impl Fn(&RefusalInfo<'_>) -> RefusalBody + Send + Sync + 'static,
    ) -> Self {
        self.edit(|b| b.config.shape = Some(Shape(Arc::new(body))))
    }

    /// At most `max` requests held by shaping rules ([`Rule::shape`]) at
    /// once in this layer (default 1024); beyond that a request is decided
    /// as if its rules did not shape. No queue is unbounded.
    pub fn max_waiting(self, max: usize) -> Self {
        self.edit(|b| b.config.max_waiting = max)
    }

    /// The `WWW-Authenticate` challenge sent with `401` when a rule needs
    /// a principal and the request has none (default: `Bearer`). RFC 9110
    /// requires a `401` to carry one; name your scheme and realm, e.g.
    /// `HeaderValue::from_static("Bearer realm=\"api\"")`.
    pub fn www_authenticate(self, challenge: HeaderValue) -> Self {
        self.edit(|b| b.config.www_authenticate = challenge)
    }

    /// The level refusals are logged at (default `DEBUG`; `INFO` or `WARN`
    /// to see them in production). Each refusal for lack of budget, each
    /// cost that can never fit or cannot be computed (`411`, `400`) is one
    /// event with the policy, the shape of the rule's key (its parts'
    /// names: `ip`, `t,a,op`) and a fingerprint of the key, never the key
    /// itself nor a credential; a request refused for want of a principal
    /// (`401`) is one event with the policy (there is no key to show)
    /// ([`set_log_fingerprint_key`](crate::set_log_fingerprint_key) makes
    /// fingerprints agree across a fleet).
    pub fn log_refusals(self, level: tracing::Level) -> Self {
        self.edit(|b| b.config.log_level = level)
    }
}

impl<S, St, M> Layer<S> for RateLimitLayer<St, M> {
    type Service = RateLimit<S, St, M>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::from_config(inner, self.config.clone())
    }
}
