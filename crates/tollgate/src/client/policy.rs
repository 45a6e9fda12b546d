//! [`RetryPolicy`]: a `tower::retry::Policy` that honours `Retry-After`.

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use tollgate_budget::{Clock, Nanos, SystemClock};
use tower::retry::budget::Budget;

use super::retry_after;

/// Which responses are retried, for which requests, and for how long.
///
/// Defaults: statuses 429 and 503; methods GET and HEAD; 3 attempts in all;
/// a total deadline of 10 s with nothing reserved; local backoff 1 s, 2 s,
/// 4 s… capped at 60 s; jitter up to 500 ms.
#[derive(Debug, Clone)]
#[must_use]
pub struct RetryConfig {
    statuses: Vec<StatusCode>,
    methods: Vec<Method>,
    idempotency_header: Option<HeaderName>,
    max_attempts: u32,
    deadline: Duration,
    reserve: Duration,
    backoff_base: Duration,
    backoff_max: Duration,
    jitter_max: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            statuses: vec![
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
            ],
            methods: vec![Method::GET, Method::HEAD],
            idempotency_header: None,
            max_attempts: 3,
            deadline: Duration::from_secs(10),
            reserve: Duration::ZERO,
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            jitter_max: Duration::from_millis(500),
        }
    }
}

/// What the policy knows when a response arrives.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// The response status.
    pub status: StatusCode,
    /// The request method.
    pub method: &'a Method,
    /// The request headers (for an idempotency key).
    pub request_headers: &'a HeaderMap,
    /// The response's `Retry-After`, if any.
    pub retry_after: Option<&'a HeaderValue>,
    /// Wall-clock time the response was received.
    pub received: SystemTime,
    /// Attempts made so far, counting this one (1 after the first response).
    pub attempt: u32,
    /// Time left before the total deadline, measured on a monotonic clock.
    pub remaining: Duration,
    /// Nonnegative jitter to add after the server's boundary.
    pub jitter: Duration,
}

impl RetryConfig {
    /// The defaults described on the type.
    pub fn new() -> Self {
        Self::default()
    }

    /// Retries these statuses (default 429 and 503). Redirects are never
    /// followed, whatever is listed here.
    pub fn statuses(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.statuses = statuses
            .into_iter()
            .filter(|s| !s.is_redirection())
            .collect();
        self
    }

    /// Also replays `method` (default only GET and HEAD). Only do this for
    /// methods your API makes safe to repeat.
    pub fn retry_method(mut self, method: Method) -> Self {
        if !self.methods.contains(&method) {
            self.methods.push(method);
        }
        self
    }

    /// Replays any method when the request carries `header` (e.g.
    /// `Idempotency-Key`) — the caller vouches that the server deduplicates.
    pub fn retry_with_idempotency_key(mut self, header: HeaderName) -> Self {
        self.idempotency_header = Some(header);
        self
    }

    /// Total attempts, the first included (default 3; at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// Total time for all attempts and waits, on a monotonic clock.
    pub fn deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// Time kept back for the next attempt itself: a wait is only taken if
    /// at least this much of the deadline would be left after it.
    pub fn reserve(mut self, d: Duration) -> Self {
        self.reserve = d;
        self
    }

    /// Local exponential backoff: `base · 2^(attempt−1)`, at most `max`.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// The largest jitter added after the wait (default 500 ms).
    pub fn jitter(mut self, max: Duration) -> Self {
        self.jitter_max = max;
        self
    }

    fn may_replay(&self, method: &Method, headers: &HeaderMap) -> bool {
        self.methods.contains(method)
            || self
                .idempotency_header
                .as_ref()
                .is_some_and(|h| headers.contains_key(h))
    }

    /// The wait before the next attempt, or `None` to stop with this
    /// response.
    ///
    /// Wait = max(server delay, local backoff) + jitter: never earlier than
    /// the server asked. A missing or invalid `Retry-After` uses the local
    /// backoff alone. Stops when the status or method is not retried, the
    /// attempt cap is reached, or the wait would not leave `reserve` before
    /// the deadline — the server's wait is never shortened to fit.
    pub fn retry_wait(&self, a: &Attempt<'_>) -> Option<Duration> {
        if !self.statuses.contains(&a.status) || a.status.is_redirection() {
            return None;
        }
        if !self.may_replay(a.method, a.request_headers) || a.attempt >= self.max_attempts {
            return None;
        }
        let server = a
            .retry_after
            .and_then(|v| retry_after(v.as_bytes(), a.received).ok())
            .unwrap_or(Duration::ZERO);
        let doublings = a.attempt.saturating_sub(1).min(62);
        let backoff = self
            .backoff_base
            .checked_mul(1u32.checked_shl(doublings).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX)
            .min(self.backoff_max);
        let wait = server.max(backoff).saturating_add(a.jitter);
        if wait >= a.remaining.saturating_sub(self.reserve) {
            return None;
        }
        Some(wait)
    }
}

/// A source of jitter in `[0, max]`.
pub trait Jitter: Send + Sync + 'static {
    /// A jitter no larger than `max`.
    fn jitter(&self, max: Duration) -> Duration;
}

/// Uniform jitter from a small xorshift generator seeded per process.
#[derive(Debug)]
pub struct RandomJitter {
    state: AtomicU64,
}

impl Default for RandomJitter {
    fn default() -> Self {
        Self {
            state: AtomicU64::new(RandomState::new().hash_one(0u8) | 1),
        }
    }
}

impl Jitter for RandomJitter {
    fn jitter(&self, max: Duration) -> Duration {
        let mut x = self.state.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.state.store(x, Ordering::Relaxed);
        let max_ns = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(if max_ns == u64::MAX {
            x
        } else {
            x % (max_ns + 1)
        })
    }
}

/// Waits for a duration; injectable so decisions can be tested without
/// sleeping.
pub trait Sleep: Send + Sync + 'static {
    /// A future that completes after `d`.
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Sleeps with `tokio::time::sleep`.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokioSleep;

impl Sleep for TokioSleep {
    fn sleep(&self, d: Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(tokio::time::sleep(d))
    }
}

/// A `tower::retry::Policy` for `http` requests that honours `Retry-After`.
///
/// Use it with `tower::retry::RetryLayer`. Each request gets its own copy
/// (tower clones the policy per call), which counts its attempts and
/// measures its deadline on a monotonic clock from the first attempt; a
/// service made once and called many times treats every request afresh.
/// Transport errors are not retried: they are not throttling.
#[derive(Clone)]
pub struct RetryPolicy {
    config: Arc<RetryConfig>,
    clock: Arc<dyn Clock>,
    wall: Arc<dyn Fn() -> SystemTime + Send + Sync>,
    jitter: Arc<dyn Jitter>,
    sleep: Arc<dyn Sleep>,
    budget: Option<Arc<dyn Budget + Send + Sync>>,
    /// Which policy this is (copies share it), for [`FirstSent`].
    id: u64,
    /// Attempts made by the request this copy belongs to. Only the copy in
    /// a request's response future counts (tower calls `retry` on that
    /// copy); the service's own policy is never changed by a request.
    attempts: u32,
    /// The wait planned before the latest retry, for observers.
    last_wait: Option<Duration>,
}

/// When a request was first sent, on the policy's monotonic clock, and by
/// which policy. Carried in the extensions of the copy tower keeps for
/// retries: tower 0.5 calls `clone_request` for a new request on the
/// *service's* policy, before copying that policy into the response future,
/// so a start time kept in the policy would be shared by every later
/// request of the service. The policy's id keeps nested retry layers apart:
/// a retried request reaching an inner layer is new to that layer.
#[derive(Debug, Clone, Copy)]
struct FirstSent {
    policy: u64,
    at: Nanos,
}

/// Ids of policies made by [`RetryPolicy::new`]; copies share theirs.
static POLICY_IDS: AtomicU64 = AtomicU64::new(1);

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("config", &self.config)
            .field("attempts", &self.attempts)
            .field("last_wait", &self.last_wait)
            .finish_non_exhaustive()
    }
}

impl RetryPolicy {
    /// A policy with `config`, the system clocks, random jitter and tokio
    /// sleeping.
    pub fn new(config: RetryConfig) -> Self {
        Self {
            config: Arc::new(config),
            clock: Arc::new(SystemClock::new()),
            wall: Arc::new(SystemTime::now),
            jitter: Arc::new(RandomJitter::default()),
            sleep: Arc::new(TokioSleep),
            budget: None,
            id: POLICY_IDS.fetch_add(1, Ordering::Relaxed),
            attempts: 0,
            last_wait: None,
        }
    }

    /// Uses `clock` for the deadline and `wall` for HTTP dates.
    #[must_use]
    pub fn with_clocks(
        mut self,
        clock: impl Clock,
        wall: impl Fn() -> SystemTime + Send + Sync + 'static,
    ) -> Self {
        self.clock = Arc::new(clock);
        self.wall = Arc::new(wall);
        self
    }

    /// Uses `jitter` as the jitter source.
    #[must_use]
    pub fn with_jitter(mut self, jitter: impl Jitter) -> Self {
        self.jitter = Arc::new(jitter);
        self
    }

    /// Uses `sleep` to wait between attempts.
    #[must_use]
    pub fn with_sleep(mut self, sleep: impl Sleep) -> Self {
        self.sleep = Arc::new(sleep);
        self
    }

    /// Limits retries to a share of requests (e.g. tower's `TpsBudget`), so
    /// that retries cannot multiply load; shared by every copy.
    #[must_use]
    pub fn with_budget(mut self, budget: Arc<dyn Budget + Send + Sync>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &RetryConfig {
        &self.config
    }
}

impl<B: Clone, Rb, E> tower::retry::Policy<Request<B>, Response<Rb>, E> for RetryPolicy {
    type Future = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn retry(
        &mut self,
        req: &mut Request<B>,
        result: &mut Result<Response<Rb>, E>,
    ) -> Option<Self::Future> {
        let response = result.as_ref().ok()?;
        self.attempts += 1;
        let now = self.clock.now();
        let started = req
            .extensions()
            .get::<FirstSent>()
            .filter(|f| f.policy == self.id)
            .map_or(now, |f| f.at);
        let elapsed = Duration::from_nanos(now.saturating_sub(started));
        let attempt = Attempt {
            status: response.status(),
            method: req.method(),
            request_headers: req.headers(),
            retry_after: response.headers().get(RETRY_AFTER),
            received: (self.wall)(),
            attempt: self.attempts,
            remaining: self.config.deadline.saturating_sub(elapsed),
            jitter: self.jitter.jitter(self.config.jitter_max),
        };
        let wait = self.config.retry_wait(&attempt)?;
        if let Some(budget) = &self.budget
            && !budget.withdraw()
        {
            return None;
        }
        self.last_wait = Some(wait);
        Some(self.sleep.sleep(wait))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        // A request without this policy's mark is new to it: this is its
        // first attempt here.
        let first = match req.extensions().get::<FirstSent>() {
            Some(first) if first.policy == self.id => *first,
            _ => {
                if let Some(budget) = &self.budget {
                    budget.deposit();
                }
                FirstSent {
                    policy: self.id,
                    at: self.clock.now(),
                }
            }
        };
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        clone.extensions_mut().insert(first);
        Some(clone)
    }
}
