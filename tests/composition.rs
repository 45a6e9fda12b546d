//! Features composed, against one exact model.
//!
//! Every feature of the rate-limit layer is exact on its own; the defects
//! found after wave 2 were all where two of them meet (a plan switch that
//! freed a held request's units, an empty-start bucket whose `Retry-After`
//! was false, outcome charging that let concurrent guesses through). This
//! property test builds a `RateLimitLayer` from a random combination of
//! rules and features, over both stores, and drives it with random traces
//! on a virtual clock:
//!
//! - rules: per address or per account, on one route or all, a fixed cost
//!   (sometimes one that can never fit), token buckets (starting full or
//!   empty), fixed and sliding windows, plans for the principal and the
//!   rule's policy and its plans' changed at runtime
//!   (`RulesHandle::set_policy`, `RulesHandle::set_plan`, and policy sets
//!   written as data, `RulesHandle::apply`) among up to four policies of
//!   one name, shaping, charging by outcome
//!   (`charge_only_when`), dry-run, exemptions by network;
//! - events: requests (answered at once, or held by the inner service
//!   until the trace says how they end), their completions with a `200` or
//!   a `401`, requests dropped while held or in flight, plan changes,
//!   policy changes, and time passing (exactly: the test sits on tokio's
//!   paused clock, and the stores read it).
//!
//! Checked against the model after every event, and at the end:
//!
//! - **the envelope**: for every budget (rule and key) and every interval
//!   `[a, b]` between the times units were spent, the units admitted (a
//!   shaped request's when it is released, a charge made by outcome only
//!   when its outcome kept it) are at most the largest capacity of the
//!   policies in force then (twice the limit for windows) plus the fastest
//!   of their rates times `b - a`; dry-run rules are not enforced and are
//!   left out;
//! - **`Retry-After` is truthful**: after a `429`, waiting exactly the
//!   announced seconds (nobody else spending meanwhile) and sending the
//!   same request again is not refused for lack of budget;
//! - **a refused request spends nothing**: the same request again at the
//!   same instant is refused alike, with the same `RateLimit` fields;
//! - **no shaped request is held past its delay**: it reaches the inner
//!   service no later than its rule's longest wait after it came;
//! - **a lower bound for charging by outcome**: a budget that nothing but
//!   reservations has spent (no charge kept, no conversion, no settlement
//!   after a possible lapse; a bucket that starts full, or a window) is
//!   described, where a `429` or an admitted answer describes it, with at
//!   least its capacity less what is reserved: a reservation left
//!   unsettled, or given back to the wrong place, shows as a right key
//!   refused.
//!
//! Seeded (`PROPTEST_RNG_SEED` replays another seed) with a fixed budget
//! of cases (`COMPOSITION_CASES` changes it): 3,000 on the in-memory store,
//! 300 on a private `redis-server`.

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use common::driven::note;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use num_rational::Ratio;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use tollgate::rate_limit::PolicySet;
use tollgate::store::Nanos;
use tollgate::{
    Cost, Exemption, Initial, MemoryStore, Policy, Principal, Rate, RateLimitLayer, Rule, Store,
    StoreError,
    identity::PeerAddr,
    store::{Charge, Clock, Outcome},
};
use tollgate_budget::{Receipt, Reservation};
use tollgate_redis::RedisStore;
use tollgate_testkit::RedisServer;
use tower::{Layer, Service};

type Q = Ratio<i128>;

const MS: u64 = 1_000_000;
const PEERS: [&str; 2] = ["198.51.100.1", "198.51.100.2"];
const ACCOUNTS: [&str; 2] = ["alice", "bob"];
const ROUTES: [&str; 2] = ["/a", "/b"];

// ---------------------------------------------------------------- specs

#[derive(Debug, Clone, PartialEq)]
enum PolicySpec {
    Bucket {
        capacity: u64,
        amount: u64,
        period_ms: u64,
        empty: bool,
    },
    Fixed {
        limit: u64,
        window_ms: u64,
    },
    Sliding {
        limit: u64,
        window_ms: u64,
    },
}

impl PolicySpec {
    fn policy(&self, name: &str) -> Policy {
        match *self {
            PolicySpec::Bucket {
                capacity,
                amount,
                period_ms,
                empty,
            } => {
                let rate = Rate::new(amount, Duration::from_millis(period_ms));
                let p = Policy::token_bucket(name, capacity, rate).unwrap();
                if empty {
                    p.with_initial(Initial::Empty)
                } else {
                    p
                }
            }
            PolicySpec::Fixed { limit, window_ms } => {
                Policy::fixed_window(name, limit, Duration::from_millis(window_ms)).unwrap()
            }
            PolicySpec::Sliding { limit, window_ms } => {
                Policy::sliding_window(name, limit, Duration::from_millis(window_ms)).unwrap()
            }
        }
    }

    /// The policy as data ([`PolicySet`]'s JSON form).
    fn data(&self) -> String {
        match *self {
            PolicySpec::Bucket {
                capacity,
                amount,
                period_ms,
                empty,
            } => format!(
                r#"{{"capacity": {capacity}, "refill": {{"every": {{"amount": {amount}, "millis": {period_ms}}}}}, "initial": "{}"}}"#,
                if empty { "empty" } else { "full" }
            ),
            PolicySpec::Fixed { limit, window_ms } => format!(
                r#"{{"algorithm": "fixed_window", "limit": {limit}, "window": {{"millis": {window_ms}}}}}"#
            ),
            PolicySpec::Sliding { limit, window_ms } => format!(
                r#"{{"algorithm": "sliding_window", "limit": {limit}, "window": {{"millis": {window_ms}}}}}"#
            ),
        }
    }

    fn capacity(&self) -> u64 {
        match *self {
            PolicySpec::Bucket { capacity, .. } => capacity,
            PolicySpec::Fixed { limit, .. } | PolicySpec::Sliding { limit, .. } => limit,
        }
    }

    /// The burst and the rate (units per ns) of the envelope: a window's
    /// count can be spent at the end of one window and again at the start
    /// of the next.
    fn envelope(&self) -> (Q, Q) {
        let q = |n: u64| Q::from_integer(i128::from(n));
        match *self {
            PolicySpec::Bucket {
                capacity,
                amount,
                period_ms,
                ..
            } => (q(capacity), q(amount) / q(period_ms * MS)),
            PolicySpec::Fixed { limit, window_ms } | PolicySpec::Sliding { limit, window_ms } => {
                (q(2 * limit), q(limit) / q(window_ms * MS))
            }
        }
    }
}

fn bucket() -> impl Strategy<Value = PolicySpec> {
    (
        1u64..5,
        1u64..4,
        prop::sample::select(vec![100u64, 250, 500, 1000, 3000]),
        prop::bool::weighted(0.3),
    )
        .prop_map(|(capacity, amount, period_ms, empty)| PolicySpec::Bucket {
            capacity,
            amount,
            period_ms,
            empty,
        })
}

fn any_policy() -> impl Strategy<Value = PolicySpec> {
    prop_oneof![
        3 => bucket(),
        1 => (1u64..5, prop::sample::select(vec![500u64, 1000, 2000]))
            .prop_map(|(limit, window_ms)| PolicySpec::Fixed { limit, window_ms }),
        1 => (1u64..5, prop::sample::select(vec![500u64, 1000, 2000]))
            .prop_map(|(limit, window_ms)| PolicySpec::Sliding { limit, window_ms }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keyed {
    Ip,
    Account,
}

#[derive(Debug, Clone)]
struct RuleSpec {
    keyed: Keyed,
    /// The first is the rule's own; the others are plans `p1`, `p2`, ...
    policies: Vec<PolicySpec>,
    route: Option<usize>,
    cost: u64,
    /// Longest wait in ms, and how many of a key may wait.
    shaping: Option<(u64, usize)>,
    by_outcome: bool,
    dry_run: bool,
    exempt_peer: Option<usize>,
}

fn rule() -> impl Strategy<Value = RuleSpec> {
    let shaped = (
        prop::collection::vec(bucket(), 1..5),
        prop::option::weighted(0.8, (100u64..3000, 1usize..4)),
    );
    let unshaped = (
        prop::collection::vec(any_policy(), 1..5),
        Just(None::<(u64, usize)>),
    );
    (
        prop_oneof![shaped, unshaped],
        prop::sample::select(vec![Keyed::Ip, Keyed::Account]),
        prop::option::of(0..ROUTES.len()),
        prop::sample::select(vec![1u64, 1, 1, 2, 3, 5]),
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.15),
        prop::option::weighted(0.15, 0..PEERS.len()),
    )
        .prop_map(
            |((policies, shaping), keyed, route, cost, by_outcome, dry_run, exempt_peer)| {
                RuleSpec {
                    keyed,
                    policies,
                    route,
                    cost,
                    shaping,
                    by_outcome,
                    dry_run,
                    exempt_peer,
                }
            },
        )
}

#[derive(Debug, Clone)]
enum Event {
    /// Time passes (ns).
    Wait(u64),
    /// Time passes until a waiting request is answered (at most 5 s): the
    /// next events happen at that instant, beside the release.
    UntilReleased,
    Request {
        peer: usize,
        account: Option<usize>,
        route: usize,
        /// The inner service's answer; `None`: it holds the request until
        /// a `Complete` event says.
        answer: Option<u16>,
        /// After a `429`: wait its `Retry-After` and send it again.
        probe: bool,
    },
    /// Several requests at once, alike (answered at once by the inner
    /// service, 200 or 401).
    Burst {
        peer: usize,
        account: Option<usize>,
        route: usize,
        answer: u16,
        n: usize,
    },
    /// The oldest request the inner service holds answers this.
    Complete(u16),
    /// A request still waiting (held, or in flight) is dropped.
    Drop(usize),
    /// An account moves to plan `pN` (0: none).
    Plan(usize, usize),
    /// A rule's own policy becomes its `n`th.
    SetPolicy(usize, usize),
    /// A rule's plan `pN` (N >= 1) becomes its `k`th policy
    /// (`RulesHandle::set_plan`).
    SetPlan(usize, usize, usize),
    /// A policy set, written as data (JSON), applied
    /// (`RulesHandle::apply`): rule `r`'s own policy becomes its `k`th and
    /// its plan `pN` its `j`th, on top of the rules as they were when the
    /// first set was applied; the set replaces the one applied before
    /// (another rule it named goes back).
    ApplySet {
        rule: usize,
        k: usize,
        plan: usize,
        j: usize,
    },
}

fn event() -> impl Strategy<Value = Event> {
    let status = prop::sample::select(vec![200u16, 401]);
    prop_oneof![
        4 => prop_oneof![
            3 => Just(0u64),
            4 => 1u64..400 * MS,
            2 => 400 * MS..4_000 * MS,
            1 => 55_000 * MS..65_000 * MS,
        ]
        .prop_map(Event::Wait),
        2 => Just(Event::UntilReleased),
        8 => (
            0..PEERS.len(),
            prop::option::weighted(0.8, 0..ACCOUNTS.len()),
            0..ROUTES.len(),
            prop::option::weighted(0.75, status.clone()),
            prop::bool::weighted(0.3),
        )
            .prop_map(|(peer, account, route, answer, probe)| Event::Request {
                peer,
                account,
                route,
                answer,
                probe,
            }),
        3 => (
            0..PEERS.len(),
            prop::option::weighted(0.8, 0..ACCOUNTS.len()),
            0..ROUTES.len(),
            status.clone(),
            2usize..6,
        )
            .prop_map(|(peer, account, route, answer, n)| Event::Burst {
                peer,
                account,
                route,
                answer,
                n,
            }),
        2 => status.prop_map(Event::Complete),
        1 => (0usize..8).prop_map(Event::Drop),
        2 => (0..ACCOUNTS.len(), 0usize..4).prop_map(|(a, p)| Event::Plan(a, p)),
        3 => (0usize..3, 0usize..4).prop_map(|(r, p)| Event::SetPolicy(r, p)),
        2 => (0usize..3, 1usize..4, 0usize..4).prop_map(|(r, n, k)| Event::SetPlan(r, n, k)),
        2 => (0usize..3, 0usize..4, 1usize..4, 0usize..4)
            .prop_map(|(rule, k, plan, j)| Event::ApplySet { rule, k, plan, j }),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    rules: Vec<RuleSpec>,
    layer_dry_run: bool,
    events: Vec<Event>,
    /// At each release of a held request, this many more like it at that
    /// instant (arrivals beside a release are where a hold's accounting
    /// shows).
    echo: usize,
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![3 => any_case(), 1 => holds_and_switches()]
}

/// One shaping rule whose policy changes while requests are held, and
/// arrivals when they are released: a burst that leaves requests held,
/// changes of policy each followed by a request (the key converts at its
/// first charge under new numbers), time passing to the releases, another
/// burst, then anything. Where a hold's units could be freed by a change
/// of numbers (defect 1 of the round where features meet).
fn holds_and_switches() -> impl Strategy<Value = Case> {
    let request = || Event::Request {
        peer: 0,
        account: None,
        route: 0,
        answer: Some(200),
        probe: false,
    };
    let burst = |n| Event::Burst {
        peer: 0,
        account: None,
        route: 0,
        answer: 200,
        n,
    };
    let switch = (0u64..400 * MS, 0usize..4);
    (
        prop::collection::vec(bucket(), 3..5),
        (500u64..3000, 1usize..4),
        (2usize..7, prop::collection::vec(switch, 1..4)),
        (0usize..3, 2usize..7),
        prop::collection::vec(event(), 0..20),
    )
        .prop_map(
            move |(policies, shaping, (first, switches), (releases, last), tail)| {
                let mut events = vec![burst(first)];
                for (wait, k) in switches {
                    events.extend([Event::Wait(wait), Event::SetPolicy(0, k), request()]);
                }
                events.extend(std::iter::repeat_n(Event::UntilReleased, releases + 1));
                events.push(burst(last));
                events.extend(tail);
                Case {
                    rules: vec![RuleSpec {
                        keyed: Keyed::Ip,
                        policies,
                        route: None,
                        cost: 1,
                        shaping: Some(shaping),
                        by_outcome: false,
                        dry_run: false,
                        exempt_peer: None,
                    }],
                    layer_dry_run: false,
                    events,
                    echo: 0,
                }
            },
        )
}

/// Any combination of rules, features and events.
fn any_case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(rule(), 1..4),
        prop::bool::weighted(0.05),
        prop::collection::vec(event(), 10..90),
        prop_oneof![Just(0usize), 1usize..4],
    )
        .prop_map(|(rules, layer_dry_run, events, echo)| Case {
            rules,
            layer_dry_run,
            events,
            echo,
        })
}

// ------------------------------------------------------- virtual clock

/// The stores' clock: tokio's (paused) clock, so that a held request's
/// release and the stores' time are one time line.
#[derive(Clone)]
struct Virtual {
    origin: tokio::time::Instant,
}

impl Virtual {
    fn now(&self) -> Nanos {
        u64::try_from(
            tokio::time::Instant::now()
                .duration_since(self.origin)
                .as_nanos(),
        )
        .unwrap()
    }
}

impl Clock for Virtual {
    fn now(&self) -> Nanos {
        Virtual::now(self)
    }
}

/// A Redis store decided on a runtime of its own (real time, real I/O),
/// waited for synchronously: on the test's paused clock a call is then
/// instant, and tokio never advances the clock while waiting for Redis.
/// Its injected time is the test's virtual time.
#[derive(Clone)]
struct OnRedis {
    store: RedisStore,
    now: Arc<AtomicU64>,
    clock: Virtual,
    runtime: Arc<tokio::runtime::Runtime>,
}

impl OnRedis {
    fn wait<T: Send + 'static>(
        &self,
        call: impl FnOnce(RedisStore) -> Pin<Box<dyn Future<Output = T> + Send>>,
    ) -> T {
        self.now.store(self.clock.now(), Ordering::SeqCst);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let work = call(self.store.clone());
        self.runtime.spawn(async move {
            let _ = tx.send(work.await);
        });
        rx.recv().expect("the Redis runtime answers")
    }
}

impl Store for OnRedis {
    fn charge<'a>(
        &'a self,
        charges: &'a [Charge],
    ) -> impl Future<Output = Result<Outcome, StoreError>> + Send + 'a {
        std::future::ready(self.try_charge_now(charges).expect("always answers"))
    }

    fn try_charge_now(&self, charges: &[Charge]) -> Option<Result<Outcome, StoreError>> {
        let charges = charges.to_vec();
        Some(self.wait(move |s| Box::pin(async move { s.charge(&charges).await })))
    }

    fn check_policy(&self, policy: &Policy) -> Result<(), StoreError> {
        self.store.check_policy(policy)
    }

    fn can_shape(&self) -> bool {
        true
    }

    fn cancel<'a>(
        &'a self,
        charges: &'a [Charge],
        reservation: &'a Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let (charges, reservation) = (charges.to_vec(), reservation.clone());
        std::future::ready(
            self.wait(move |s| Box::pin(async move { s.cancel(&charges, &reservation).await })),
        )
    }

    fn can_refund(&self) -> bool {
        true
    }

    fn refund<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let (charges, receipt) = (charges.to_vec(), receipt.clone());
        std::future::ready(
            self.wait(move |s| Box::pin(async move { s.refund(&charges, &receipt).await })),
        )
    }

    fn confirm<'a>(
        &'a self,
        charges: &'a [Charge],
        receipt: &'a Receipt,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        let (charges, receipt) = (charges.to_vec(), receipt.clone());
        std::future::ready(
            self.wait(move |s| Box::pin(async move { s.confirm(&charges, &receipt).await })),
        )
    }
}

// ------------------------------------------------------------- the app

/// What the inner service saw of each request: when it was called, and
/// the answers it still owes.
#[derive(Default)]
struct Inner {
    called: HashMap<u64, Nanos>,
    owed: Vec<(u64, tokio::sync::oneshot::Sender<u16>)>,
}

type Shared = Arc<Mutex<Inner>>;

type Svc = tollgate::rate_limit::RateLimit<
    tower::util::BoxCloneSyncService<Request<()>, Response<Empty<Bytes>>, Infallible>,
    Arc<dyn tollgate::store::DynStore>,
>;

type Fut = <Svc as Service<Request<()>>>::Future;

fn inner(
    shared: Shared,
    clock: Virtual,
) -> tower::util::BoxCloneSyncService<Request<()>, Response<Empty<Bytes>>, Infallible> {
    tower::util::BoxCloneSyncService::new(tower::service_fn(move |req: Request<()>| {
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        };
        let id = header("x-id").unwrap();
        let answer = header("x-answer");
        let mut inner = shared.lock().unwrap();
        inner.called.insert(id, clock.now());
        let owed = match answer {
            Some(_) => None,
            None => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                inner.owed.push((id, tx));
                Some(rx)
            }
        };
        drop(inner);
        async move {
            let status = match (answer, owed) {
                (Some(status), _) => status as u16,
                (None, Some(rx)) => rx.await.unwrap_or(200),
                (None, None) => 200,
            };
            Ok::<_, Infallible>(
                Response::builder()
                    .status(status)
                    .header("x-inner", "1")
                    .body(Empty::new())
                    .unwrap(),
            )
        }
    }))
}

fn build_rule(i: usize, spec: &RuleSpec) -> Rule {
    let name = format!("r{i}");
    let own = spec.policies[0].policy(&name);
    let mut rule = match spec.keyed {
        Keyed::Ip => Rule::per_client_ip(own),
        Keyed::Account => Rule::per_account(own),
    };
    for (k, p) in spec.policies.iter().enumerate().skip(1) {
        rule = rule.plan(&format!("p{k}"), p.policy(&name));
    }
    if let Some(route) = spec.route {
        rule = rule.on_route(ROUTES[route]);
    }
    rule = rule.with_cost(Cost::Fixed(std::num::NonZeroU64::new(spec.cost).unwrap()));
    if let Some((ms, per_key)) = spec.shaping {
        rule = rule.shape(
            Duration::from_millis(ms),
            NonZeroUsize::new(per_key).unwrap(),
        );
    }
    if spec.by_outcome {
        rule = rule.charge_only_when(|status| status == StatusCode::UNAUTHORIZED);
    }
    if spec.dry_run {
        rule = rule.dry_run(true);
    }
    if let Some(peer) = spec.exempt_peer {
        let net: ipnet::IpNet = format!("{}/32", PEERS[peer]).parse().unwrap();
        rule = rule.exempt(Exemption::networks([net]).unwrap());
    }
    rule
}

// ------------------------------------------------------------ the model

/// A request as sent: what the model needs to judge it.
#[derive(Debug, Clone)]
struct Sent {
    id: u64,
    at: Nanos,
    peer: usize,
    account: Option<usize>,
    plan: usize,
    route: usize,
    answer: Option<u16>,
    /// Each rule's own policy when it was sent (an index into its
    /// policies): a policy changed later does not change how it was
    /// decided.
    own: Vec<usize>,
    /// Each rule's policy per plan when it was sent (plan `pN` is
    /// `plans[rule][N]`, an index into its policies).
    plans: Vec<Vec<usize>>,
    /// Sent beside a release (the case's echo): its own release echoes
    /// nothing, so echoes do not breed.
    echo: bool,
}

/// Units spent from one budget: when (between `lo` and `hi`: a held
/// request's release is seen up to a millisecond late, the timer's tick),
/// and how many.
#[derive(Debug, Clone, Copy)]
struct Spent {
    lo: Nanos,
    hi: Nanos,
    units: u64,
}

#[derive(Default)]
struct Budget {
    spent: Vec<Spent>,
    /// When a request was decided under which policy (the policy in
    /// force from then on for this key).
    decided: Vec<(Nanos, PolicySpec)>,
    /// Requests held for later: decided at the first time under the
    /// policy, released at the second; that policy stays in force for
    /// them until then, whatever the key changes to meanwhile (a held
    /// request's units are spent, on its own schedule).
    held: Vec<(Nanos, Nanos, PolicySpec)>,
    /// A rule charged by outcome: the requests whose reservations are not
    /// settled yet (by id), with when they were reserved.
    outstanding: Vec<(u64, Nanos)>,
    /// A rule charged by outcome whose budget something else spent: a
    /// charge kept (a `401`, a request dropped in flight), a reservation
    /// settled after it may have lapsed, or a request decided under other
    /// numbers (a conversion counts what is reserved as spent). Until then
    /// the budget is its capacity less what is reserved, exactly.
    tainted: bool,
}

struct Model<'c> {
    case: &'c Case,
    seen: &'c Seen,
    /// Each rule's own policy now (an index into its policies).
    own: Vec<usize>,
    /// Each rule's policy per plan now (see `Sent::plans`).
    plans: Vec<Vec<usize>>,
    /// `own` and `plans` when the first set was applied: what every set
    /// is applied on top of.
    base: Option<(Vec<usize>, Vec<Vec<usize>>)>,
    budgets: HashMap<(usize, String), Budget>,
}

impl Model<'_> {
    /// The policy rule `i` uses for `s`.
    fn policy(&self, i: usize, s: &Sent) -> PolicySpec {
        let spec = &self.case.rules[i];
        let k = if s.account.is_some() && s.plan >= 1 && s.plan < spec.policies.len() {
            s.plans[i][s.plan]
        } else {
            s.own[i]
        };
        spec.policies[k].clone()
    }

    /// The budget key rule `i` charges `s` to, if it applies to it and can
    /// (its key is known, the rule is not skipped for it).
    fn key(&self, i: usize, s: &Sent) -> Option<String> {
        let spec = &self.case.rules[i];
        if spec.route.is_some_and(|r| r != s.route) || spec.exempt_peer == Some(s.peer) {
            return None;
        }
        match spec.keyed {
            Keyed::Ip => Some(format!("ip{}", s.peer)),
            Keyed::Account => s.account.map(|a| format!("acct{a}")),
        }
    }

    fn enforced(&self, i: usize) -> bool {
        !(self.case.layer_dry_run || self.case.rules[i].dry_run)
    }

    /// Notes the decisions `s` caused (a request decided under a policy
    /// puts its key under that policy, admitted or not).
    fn decided(&mut self, s: &Sent) {
        for i in 0..self.case.rules.len() {
            let Some(key) = self.key(i, s) else { continue };
            let policy = self.policy(i, s);
            if self.case.rules[i].cost > policy.capacity() {
                continue;
            }
            let budget = self.budgets.entry((i, key)).or_default();
            budget.decided.push((s.at, policy));
        }
    }

    /// Notes what `s` spent: it was answered `status` (by the inner
    /// service when `inner`), reached the inner service at `called` (when
    /// it did), and its outcome is `outcome` (the status that settles the
    /// rules charged by outcome; `None`: it never came, the request was
    /// dropped, and their reservations are kept).
    fn spent(&mut self, s: &Sent, status: Option<StatusCode>, inner: bool, called: Option<Nanos>) {
        if !inner && status == Some(StatusCode::TOO_MANY_REQUESTS) {
            return;
        }
        // The layer's own refusal (401 for a missing principal, 400 for a
        // cost that can never fit) is known before anything is called.
        let own = if inner { None } else { status };
        for i in 0..self.case.rules.len() {
            let Some(key) = self.key(i, s) else { continue };
            let policy = self.policy(i, s);
            let spec = &self.case.rules[i];
            if spec.cost > policy.capacity() || !self.enforced(i) {
                continue;
            }
            if spec.by_outcome {
                let kept = match (own, status) {
                    (Some(own), _) => own == StatusCode::UNAUTHORIZED,
                    (None, Some(status)) => status == StatusCode::UNAUTHORIZED,
                    (None, None) => true,
                };
                if !kept {
                    continue;
                }
                note(&self.seen.kept_by_outcome);
                self.budgets.entry((i, key.clone())).or_default().tainted = true;
            }
            // A shaping rule spends when the request is released; the
            // others when it came.
            let budget = self.budgets.entry((i, key)).or_default();
            let (lo, hi) = match called {
                Some(t) if spec.shaping.is_some() && !spec.by_outcome && t > s.at => {
                    budget.held.push((s.at, t, policy));
                    (t.saturating_sub(MS), t)
                }
                _ => (s.at, s.at),
            };
            budget.spent.push(Spent {
                lo,
                hi,
                units: spec.cost,
            });
        }
    }

    /// The enforced rules charged by outcome that charge `s`, with its
    /// key and the policy used.
    fn by_outcome(&self, s: &Sent) -> Vec<(usize, String, PolicySpec)> {
        (0..self.case.rules.len())
            .filter(|&i| self.case.rules[i].by_outcome && self.enforced(i))
            .filter_map(|i| {
                let key = self.key(i, s)?;
                let policy = self.policy(i, s);
                (self.case.rules[i].cost <= policy.capacity()).then_some((i, key, policy))
            })
            .collect()
    }

    /// `s` was admitted and waits (held, or in flight): its rules charged
    /// by outcome hold a reservation until it is answered or dropped.
    fn reserved(&mut self, s: &Sent) {
        for (i, key, _) in self.by_outcome(s) {
            let budget = self.budgets.entry((i, key)).or_default();
            budget.outstanding.push((s.id, s.at));
        }
    }

    /// The request `id` was answered or dropped at `now`: its reservations
    /// are settled (one settled after it may have lapsed, a minute after
    /// it was made, taints its budget).
    fn settled(&mut self, id: u64, now: Nanos) {
        for budget in self.budgets.values_mut() {
            if let Some(x) = budget.outstanding.iter().position(|o| o.0 == id) {
                let (_, at) = budget.outstanding.swap_remove(x);
                if now - at >= 60_000 * MS {
                    budget.tainted = true;
                }
            }
        }
    }

    /// The lower bound, for rules charged by outcome: a request answered
    /// `429` (`admitted`: by the inner service) was described with at least
    /// what the model says its budget holds, where its fields describe it. Nothing but reservations
    /// spends an untainted budget of a bucket that starts full (or of a
    /// window), so it holds its capacity less what is reserved (less this
    /// request's own cost when admitted): a reservation never settled, a
    /// refund lost or one given back to the wrong place shows here as a
    /// right key refused.
    fn check_live(
        &self,
        s: &Sent,
        fields: &str,
        admitted: bool,
        checked: &AtomicU64,
    ) -> Result<(), String> {
        for (i, key, policy) in self.by_outcome(s) {
            let Some(budget) = self.budgets.get(&(i, key.clone())) else {
                continue;
            };
            let converted = budget.decided.iter().any(|d| d.1 != policy);
            let empty = matches!(policy, PolicySpec::Bucket { empty: true, .. });
            if budget.tainted || converted || empty {
                continue;
            }
            let cost = self.case.rules[i].cost;
            let reserved = budget.outstanding.len() as u64 + u64::from(admitted);
            let expected = policy.capacity().saturating_sub(reserved * cost);
            let name = format!("\"r{i}\";r=");
            // (A refusal describes the limits that refused.)
            let Some(r) = fields.split(", ").find_map(|f| {
                let rest = f.strip_prefix(&name)?;
                rest.split(';').next()?.parse::<u64>().ok()
            }) else {
                continue;
            };
            note(checked);
            if r < expected {
                return Err(format!(
                    "rule r{i} key {key}: request {} ({}) was described with r={r}, where \
                     nothing but {} outstanding reservations of {cost} spent a budget of {} \
                     ({fields:?}): units were lost",
                    s.id,
                    if admitted { "admitted" } else { "refused" },
                    budget.outstanding.len(),
                    policy.capacity()
                ));
            }
        }
        Ok(())
    }

    /// The envelope, for every budget of an enforced rule.
    fn check_envelope(&self) -> Result<(), String> {
        for ((i, key), budget) in &self.budgets {
            if !self.enforced(*i) || budget.spent.is_empty() {
                continue;
            }
            let mut bounds: Vec<Nanos> = budget.spent.iter().flat_map(|s| [s.lo, s.hi]).collect();
            bounds.sort_unstable();
            bounds.dedup();
            for (x, &a) in bounds.iter().enumerate() {
                for &b in &bounds[x..] {
                    let units: u64 = budget
                        .spent
                        .iter()
                        .filter(|s| s.lo >= a && s.hi <= b)
                        .map(|s| s.units)
                        .sum();
                    if units == 0 {
                        continue;
                    }
                    // The policies in force in [a, b]: the last decided
                    // before a, and every one decided from a to b.
                    let before = budget.decided.iter().rfind(|d| d.0 < a);
                    let during = budget.decided.iter().filter(|d| d.0 >= a && d.0 <= b);
                    let holding = budget
                        .held
                        .iter()
                        .filter(|h| h.0 <= b && h.1 >= a)
                        .map(|h| &h.2);
                    let (mut burst, mut rate) = (Q::from_integer(0), Q::from_integer(0));
                    let policies = before.into_iter().chain(during).map(|d| &d.1);
                    for p in policies.chain(holding) {
                        let (bu, r) = p.envelope();
                        burst = burst.max(bu);
                        rate = rate.max(r);
                    }
                    let allowed = burst + rate * Q::from_integer(i128::from(b - a));
                    if Q::from_integer(i128::from(units)) > allowed {
                        return Err(format!(
                            "rule r{i} key {key}: {units} units spent in [{a}, {b}] ns, \
                             where at most {allowed} may be (spent {:?}, decided {:?})",
                            budget.spent, budget.decided
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

// ------------------------------------------------------------ the drive

/// What a run exercised, so that a run that tests nothing fails: answers
/// by kind, requests held by shaping, reservations given back, probes
/// after `Retry-After`, policies changed.
#[derive(Default)]
struct Seen {
    admitted: AtomicU64,
    refused: AtomicU64,
    held: AtomicU64,
    kept_by_outcome: AtomicU64,
    probes: AtomicU64,
    policy_changes: AtomicU64,
    plan_changes: AtomicU64,
    sets_applied: AtomicU64,
    dropped: AtomicU64,
    outcome_budgets_checked: AtomicU64,
}

impl Seen {
    /// Fails unless every feature was exercised at least `min` times.
    fn assert_exercised(&self, min: u64) {
        let counts = [
            ("admitted", &self.admitted),
            ("refused", &self.refused),
            ("held", &self.held),
            ("kept by outcome", &self.kept_by_outcome),
            ("probes after Retry-After", &self.probes),
            ("policy changes", &self.policy_changes),
            ("plans changed", &self.plan_changes),
            ("sets applied", &self.sets_applied),
            ("dropped while waiting", &self.dropped),
            ("outcome budgets checked", &self.outcome_budgets_checked),
        ]
        .map(|(what, n)| (what, n.load(Ordering::Relaxed)));
        eprintln!("exercised: {counts:?}");
        for (what, n) in counts {
            assert!(n >= min, "only {n} {what} in the whole run: {counts:?}");
        }
    }
}

struct Waiting {
    sent: Sent,
    future: Pin<Box<Fut>>,
    /// The longest any of its shaping rules lets it wait.
    longest: Option<Nanos>,
}

struct Drive<'c> {
    case: &'c Case,
    seen: &'c Seen,
    svc: Svc,
    handle: tollgate::RulesHandle<Arc<dyn tollgate::store::DynStore>>,
    shared: Shared,
    clock: Virtual,
    model: Model<'c>,
    waiting: Vec<Waiting>,
    next_id: u64,
    /// Each account's plan now.
    plans: [usize; 2],
    /// Held requests released since last looked at.
    released: Vec<Sent>,
    /// No echoes (while a probe waits: nobody else may spend).
    quiet: bool,
}

impl Drive<'_> {
    fn request(&mut self, s: &Sent) -> Request<()> {
        let mut req = Request::builder()
            .method("GET")
            .uri(ROUTES[s.route])
            .header("x-id", s.id.to_string());
        if let Some(answer) = s.answer {
            req = req.header("x-answer", answer.to_string());
        }
        let mut req = req.body(()).unwrap();
        let ip: IpAddr = PEERS[s.peer].parse().unwrap();
        req.extensions_mut()
            .insert(PeerAddr(SocketAddr::new(ip, 1)));
        if let Some(a) = s.account {
            let mut p = Principal::new("t", ACCOUNTS[a]);
            if s.plan > 0 {
                p = p.with_plan(format!("p{}", s.plan));
            }
            req.extensions_mut().insert(p);
        }
        req
    }

    /// Sends `s`: its answer now, or `None` while it waits (held by a
    /// shaping rule, or in flight in the inner service).
    fn send(&mut self, s: &Sent) -> Option<Response<tollgate::ResponseBody<Empty<Bytes>>>> {
        let mut svc = self.svc.clone();
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(svc.poll_ready(&mut cx).is_ready());
        let mut future = Box::pin(svc.call(self.request(s)));
        self.model.decided(s);
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(response) => Some(response.unwrap()),
            Poll::Pending => {
                // (The stores decide at once: a request that waits was
                // admitted.)
                self.model.reserved(s);
                // Dry-run rules and rules charged by outcome do not shape.
                let longest = (0..self.case.rules.len())
                    .filter(|&i| self.model.key(i, s).is_some() && self.model.enforced(i))
                    .filter(|&i| !self.case.rules[i].by_outcome)
                    .filter_map(|i| self.case.rules[i].shaping)
                    .map(|(ms, _)| ms * MS)
                    .min();
                self.waiting.push(Waiting {
                    sent: s.clone(),
                    future,
                    longest,
                });
                None
            }
        }
    }

    fn called(&self, id: u64) -> Option<Nanos> {
        self.shared.lock().unwrap().called.get(&id).copied()
    }

    /// Polls every waiting request; notes those answered now.
    fn poll_waiting(&mut self, cx: &mut Context<'_>) -> Result<bool, String> {
        let mut any = false;
        let mut i = 0;
        while i < self.waiting.len() {
            let w = &mut self.waiting[i];
            if let Poll::Ready(response) = w.future.as_mut().poll(cx) {
                let w = self.waiting.swap_remove(i);
                let response = response.unwrap();
                let called = self.called(w.sent.id);
                self.check_held(&w, called)?;
                let inner = response.headers().contains_key("x-inner");
                self.model.settled(w.sent.id, self.clock.now());
                self.model
                    .spent(&w.sent, Some(response.status()), inner, called);
                if called.is_some_and(|t| t > w.sent.at) && !w.sent.echo {
                    self.released.push(w.sent.clone());
                }
                any = true;
            } else {
                i += 1;
            }
        }
        Ok(any)
    }

    /// No shaped request waits past its longest wait (give or take the
    /// timer's millisecond).
    fn check_held(&self, w: &Waiting, called: Option<Nanos>) -> Result<(), String> {
        let Some(longest) = w.longest else {
            return Ok(());
        };
        let by = w.sent.at + longest + MS;
        let late = match called {
            Some(t) => t > by,
            None => self.clock.now() > by,
        };
        if late {
            return Err(format!(
                "request {} held past its longest wait of {longest} ns (came at {}, \
                 called at {called:?}, now {})",
                w.sent.id,
                w.sent.at,
                self.clock.now()
            ));
        }
        Ok(())
    }

    /// Lets `ns` pass, answering waiting requests as their time comes
    /// (tokio's paused clock jumps from timer to timer).
    async fn wait(&mut self, ns: u64) -> Result<(), String> {
        self.wait_or_release(ns, false).await
    }

    /// Lets up to `ns` pass, stopping early (when `at_release`) at the
    /// instant a waiting request is answered: the next event happens then.
    async fn wait_or_release(&mut self, ns: u64, at_release: bool) -> Result<(), String> {
        let until = tokio::time::Instant::now() + Duration::from_nanos(ns);
        let mut sleep = Box::pin(tokio::time::sleep_until(until));
        loop {
            let mut reached = false;
            let polled = std::future::poll_fn(|cx| {
                let any = match self.poll_waiting(cx) {
                    Ok(any) => any,
                    Err(e) => return Poll::Ready(Err(e)),
                };
                if sleep.as_mut().poll(cx).is_ready() {
                    reached = true;
                    return Poll::Ready(Ok(any));
                }
                if any {
                    return Poll::Ready(Ok(true));
                }
                Poll::Pending
            })
            .await;
            let answered = polled?;
            // Arrivals beside each release (the case's echo).
            let echoes = if self.quiet { 0 } else { self.case.echo };
            for sent in std::mem::take(&mut self.released) {
                for _ in 0..echoes {
                    let echo = self.sent(sent.peer, sent.account, sent.route, Some(200), true);
                    Box::pin(self.judge(echo, false)).await?;
                }
            }
            for w in &self.waiting {
                if w.longest.is_some() && self.called(w.sent.id).is_none() {
                    self.check_held(w, None)?;
                }
            }
            if reached || (answered && at_release) {
                return Ok(());
            }
        }
    }

    /// A request as the trace says, sent now.
    fn sent(
        &mut self,
        peer: usize,
        account: Option<usize>,
        route: usize,
        answer: Option<u16>,
        echo: bool,
    ) -> Sent {
        let id = self.next_id;
        self.next_id += 1;
        Sent {
            id,
            at: self.clock.now(),
            peer,
            account,
            plan: account.map_or(0, |a| self.plans[a]),
            route,
            answer,
            own: self.model.own.clone(),
            plans: self.model.plans.clone(),
            echo,
        }
    }

    /// One request as the trace says, judged as it is answered.
    async fn one(
        &mut self,
        peer: usize,
        account: Option<usize>,
        route: usize,
        answer: Option<u16>,
        probe: bool,
    ) -> Result<(), String> {
        let s = self.sent(peer, account, route, answer, false);
        self.judge(s, probe).await
    }

    /// Sends `s` and judges its answer; after a `429`, `probe` waits its
    /// `Retry-After` and sends it again.
    async fn judge(&mut self, s: Sent, probe: bool) -> Result<(), String> {
        let Some(response) = self.send(&s) else {
            if self.called(s.id).is_none() {
                note(&self.seen.held);
            }
            return Ok(());
        };
        let inner = response.headers().contains_key("x-inner");
        match (inner, response.status()) {
            (false, StatusCode::TOO_MANY_REQUESTS) => note(&self.seen.refused),
            (true, _) => note(&self.seen.admitted),
            _ => {}
        }
        if inner || response.status() == StatusCode::TOO_MANY_REQUESTS {
            let fields = response
                .headers()
                .get_all("ratelimit")
                .iter()
                .map(|v| v.to_str().unwrap())
                .collect::<Vec<_>>()
                .join(", ");
            self.model
                .check_live(&s, &fields, inner, &self.seen.outcome_budgets_checked)?;
        }
        self.model
            .spent(&s, Some(response.status()), inner, self.called(s.id));
        if response.status() == StatusCode::TOO_MANY_REQUESTS && !inner {
            self.refused(&s, &response, probe).await?;
        }
        Ok(())
    }

    async fn run(&mut self) -> Result<(), String> {
        let case = self.case;
        for event in &case.events {
            match *event {
                Event::Wait(ns) => self.wait(ns).await?,
                Event::UntilReleased => self.wait_or_release(5_000 * MS, true).await?,
                Event::Burst {
                    peer,
                    account,
                    route,
                    answer,
                    n,
                } => {
                    for _ in 0..n {
                        self.one(peer, account, route, Some(answer), false).await?;
                    }
                }
                Event::Request {
                    peer,
                    account,
                    route,
                    answer,
                    probe,
                } => {
                    self.one(peer, account, route, answer, probe).await?;
                }
                Event::Complete(status) => {
                    let owed = {
                        let mut inner = self.shared.lock().unwrap();
                        (!inner.owed.is_empty()).then(|| inner.owed.remove(0))
                    };
                    if let Some((_, tx)) = owed {
                        let _ = tx.send(status);
                    }
                    self.wait(0).await?;
                }
                Event::Drop(n) => {
                    if !self.waiting.is_empty() {
                        let w = self.waiting.remove(n % self.waiting.len());
                        let called = self.called(w.sent.id);
                        drop(w.future);
                        note(&self.seen.dropped);
                        self.model.settled(w.sent.id, self.clock.now());
                        // Held and dropped: given back or spent, never
                        // admitted. In flight and dropped: its charges by
                        // outcome keep their reservations.
                        if called.is_some() {
                            self.model.spent(&w.sent, None, true, called);
                        }
                        self.shared
                            .lock()
                            .unwrap()
                            .owed
                            .retain(|(id, _)| *id != w.sent.id);
                        self.wait(0).await?;
                    }
                }
                Event::Plan(account, plan) => self.plans[account] = plan,
                Event::SetPolicy(rule, k) => {
                    let Some(spec) = self.case.rules.get(rule) else {
                        continue;
                    };
                    let k = k % spec.policies.len();
                    let policy = spec.policies[k].policy(&format!("r{rule}"));
                    if self.handle.set_policy(policy).is_ok() {
                        self.model.own[rule] = k;
                        note(&self.seen.policy_changes);
                    }
                }
                Event::SetPlan(rule, plan, k) => {
                    let Some(spec) = self.case.rules.get(rule) else {
                        continue;
                    };
                    if plan >= spec.policies.len() {
                        continue;
                    }
                    let k = k % spec.policies.len();
                    let policy = spec.policies[k].policy(&format!("r{rule}"));
                    if self.handle.set_plan(&format!("p{plan}"), policy).is_ok() {
                        self.model.plans[rule][plan] = k;
                        note(&self.seen.plan_changes);
                    }
                }
                Event::ApplySet { rule, k, plan, j } => {
                    let Some(spec) = self.case.rules.get(rule) else {
                        continue;
                    };
                    let n = spec.policies.len();
                    let (k, j) = (k % n, j % n);
                    // One of the rule's plans (`p1` to `pN-1`), if it has
                    // any: a principal on another plan gets the default.
                    let plan = (n > 1).then(|| 1 + (plan - 1) % (n - 1));
                    let plans = match plan {
                        Some(plan) => {
                            format!(r#", "plans": {{"p{plan}": {}}}"#, spec.policies[j].data())
                        }
                        None => String::new(),
                    };
                    let text = format!(
                        r#"{{"rules": {{"r{rule}": {{"policy": {}{plans}}}}}}}"#,
                        spec.policies[k].data()
                    );
                    let set = PolicySet::from_json(&text).map_err(|e| format!("{text}: {e}"))?;
                    self.handle
                        .apply(&set)
                        .map_err(|e| format!("{text}: {e}"))?;
                    let model = &mut self.model;
                    let (own, plans) = model
                        .base
                        .get_or_insert_with(|| (model.own.clone(), model.plans.clone()))
                        .clone();
                    model.own = own;
                    model.plans = plans;
                    model.own[rule] = k;
                    if let Some(plan) = plan {
                        model.plans[rule][plan] = j;
                    }
                    note(&self.seen.sets_applied);
                }
            }
            self.model.check_envelope()?;
        }
        // Everything held is released, and everything owed answered (a
        // held request is owed its answer once released).
        for _ in 0..3 {
            self.wait(10_000 * MS).await?;
            let owed: Vec<_> = std::mem::take(&mut self.shared.lock().unwrap().owed);
            for (_, tx) in owed {
                let _ = tx.send(401);
            }
            self.wait(0).await?;
        }
        if !self.waiting.is_empty() {
            return Err(format!("{} requests never answered", self.waiting.len()));
        }
        self.model.check_envelope()
    }

    /// After a `429` for `s`: the same request again at once is refused
    /// alike (the refusal spent nothing); and, for a probe, the same
    /// request after its `Retry-After` is not refused for lack of budget.
    async fn refused(
        &mut self,
        s: &Sent,
        response: &Response<tollgate::ResponseBody<Empty<Bytes>>>,
        probe: bool,
    ) -> Result<(), String> {
        let fields = |r: &Response<_>| {
            ["retry-after", "ratelimit"].map(|h| {
                r.headers()
                    .get_all(h)
                    .iter()
                    .map(|v| v.to_str().unwrap().to_owned())
                    .collect::<Vec<_>>()
            })
        };
        let again = Sent {
            id: self.next_id,
            ..s.clone()
        };
        self.next_id += 1;
        let Some(second) = self.send(&again) else {
            return Err(format!("request {} refused, then held at once", s.id));
        };
        if second.status() != StatusCode::TOO_MANY_REQUESTS || fields(&second) != fields(response) {
            return Err(format!(
                "request {} refused with {:?}, then at the same instant answered {} with {:?}: \
                 the refusal spent something",
                s.id,
                fields(response),
                second.status(),
                fields(&second)
            ));
        }
        if !probe {
            return Ok(());
        }
        let secs: u64 = response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        // An initially-empty bucket is kept a minute after it was last
        // asked for (`algorithm::EMPTY_KEPT_FULL`): beyond that a longer
        // wait may find it forgotten, as documented.
        if secs >= 60 {
            return Ok(());
        }
        // Nobody else spends meanwhile: only what was reserved before is
        // released.
        note(&self.seen.probes);
        self.quiet = true;
        let waited = self.wait(secs * 1_000_000_000).await;
        self.quiet = false;
        waited?;
        let retry = Sent {
            id: self.next_id,
            at: self.clock.now(),
            answer: Some(200),
            own: self.model.own.clone(),
            plans: self.model.plans.clone(),
            ..s.clone()
        };
        self.next_id += 1;
        match self.send(&retry) {
            Some(r)
                if r.status() == StatusCode::TOO_MANY_REQUESTS
                    && !r.headers().contains_key("x-inner") =>
            {
                Err(format!(
                    "request {} was told Retry-After: {secs}, and was refused again after \
                     exactly that long ({:?})",
                    s.id,
                    fields(&r)
                ))
            }
            Some(r) => {
                let inner = r.headers().contains_key("x-inner");
                self.model
                    .spent(&retry, Some(r.status()), inner, self.called(retry.id));
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// Runs `case` on `store` (made with the clock it is given), on a paused
/// clock.
fn run_case(
    case: &Case,
    seen: &Seen,
    store: impl FnOnce(Virtual) -> Arc<dyn tollgate::store::DynStore>,
) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let clock = Virtual {
            origin: tokio::time::Instant::now(),
        };
        let store = store(clock.clone());
        let mut layer = RateLimitLayer::builder(store).dry_run(case.layer_dry_run);
        for (i, spec) in case.rules.iter().enumerate() {
            layer = layer.rule(build_rule(i, spec));
        }
        let layer = layer.build().map_err(|e| e.to_string())?;
        let handle = layer.rules_handle();
        let shared = Shared::default();
        let svc = layer.layer(inner(shared.clone(), clock.clone()));
        let mut drive = Drive {
            case,
            seen,
            svc,
            handle,
            shared,
            clock: clock.clone(),
            model: Model {
                case,
                seen,
                own: vec![0; case.rules.len()],
                plans: case
                    .rules
                    .iter()
                    .map(|r| (0..r.policies.len()).collect())
                    .collect(),
                base: None,
                budgets: HashMap::new(),
            },
            waiting: Vec::new(),
            next_id: 0,
            plans: [0; 2],
            released: Vec::new(),
            quiet: false,
        };
        // Time starts past zero, as a store's clock does after a while.
        drive.wait(1_000 * MS).await?;
        drive.run().await
    })
}

fn runner(cases: u32) -> TestRunner {
    // (A longer hunt: COMPOSITION_CASES, the same seed.)
    let cases = std::env::var("COMPOSITION_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(cases);
    let seed = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x70_11_6a_7e);
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    })
}

#[test]
fn features_compose_on_the_memory_store() {
    let seen = Seen::default();
    runner(3000)
        .run(&case(), |case| {
            run_case(&case, &seen, |clock| {
                Arc::new(MemoryStore::builder().clock(clock).build())
            })
            .map_err(TestCaseError::fail)
        })
        .unwrap();
    seen.assert_exercised(20);
}

#[test]
fn features_compose_on_redis() {
    let server = tollgate_testkit::or_skip!(RedisServer::start());
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
    );
    let n = AtomicU64::new(0);
    let seen = Seen::default();
    runner(300)
        .run(&case(), |case| {
            let prefix = format!("composition-{}", n.fetch_add(1, Ordering::Relaxed));
            run_case(&case, &seen, |clock| {
                let now = Arc::new(AtomicU64::new(0));
                let injected = now.clone();
                let store = {
                    let _entered = runtime.enter();
                    RedisStore::builder(&server.url())
                        .unwrap()
                        .prefix(prefix)
                        .injected_time(move || injected.load(Ordering::SeqCst))
                        .build()
                        .unwrap()
                };
                Arc::new(OnRedis {
                    store,
                    now,
                    clock,
                    runtime: runtime.clone(),
                })
            })
            .map_err(TestCaseError::fail)
        })
        .unwrap();
    seen.assert_exercised(5);
}

/// The issue's first defect as one trace through the layer: three units
/// spent and one held under a bucket of 3 at 1/s, a detour through a
/// bucket of 1 (a debt past the release) and then one of 3 at 30/s; at the
/// release, three more arrive. The hold survives both changes, so they are
/// refused; when it did not, the fast bucket had refilled and admitted
/// them beside the released one (4 units at one instant, at most 3).
#[test]
fn a_held_requests_units_survive_a_detour_through_other_policies() {
    let b = |capacity, amount, period_ms| PolicySpec::Bucket {
        capacity,
        amount,
        period_ms,
        empty: false,
    };
    let req = || Event::Request {
        peer: 0,
        account: None,
        route: 0,
        answer: Some(200),
        probe: false,
    };
    let case = Case {
        rules: vec![RuleSpec {
            keyed: Keyed::Ip,
            policies: vec![b(3, 1, 1000), b(3, 3, 100), b(1, 1, 1000)],
            route: None,
            cost: 1,
            shaping: Some((3000, 3)),
            by_outcome: false,
            dry_run: false,
            exempt_peer: None,
        }],
        layer_dry_run: false,
        echo: 0,
        events: vec![
            req(),
            req(),
            req(),
            req(),
            Event::Wait(100 * MS),
            Event::SetPolicy(0, 2),
            req(),
            Event::Wait(100 * MS),
            Event::SetPolicy(0, 1),
            req(),
            Event::UntilReleased,
            Event::UntilReleased,
            req(),
            req(),
            req(),
        ],
    };
    let seen = Seen::default();
    let r = run_case(&case, &seen, |clock| {
        Arc::new(MemoryStore::builder().clock(clock).build())
    });
    assert_eq!(r, Ok(()));
    assert_eq!(seen.held.load(Ordering::Relaxed), 1, "the trace holds one");
}

/// Found by the policy sets added to this test: a failed-login charge
/// reserved under one bucket, the key moved to other numbers (here an
/// initially-empty twin) and back (a set applied: the same numbers as the
/// reservation's), then settled with a `200`. The move dropped the
/// reservation (counted as spent), so the settlement found the one made
/// since under the same numbers and gave *its* unit back: two requests
/// admitted at one instant that could both be kept, at capacity 1.
/// Reservations now carry over with the key.
#[test]
fn a_reservation_survives_a_move_to_other_numbers_and_back() {
    let b = |empty| PolicySpec::Bucket {
        capacity: 1,
        amount: 1,
        period_ms: 100,
        empty,
    };
    let held = || Event::Request {
        peer: 0,
        account: Some(1),
        route: 0,
        answer: None,
        probe: false,
    };
    for back in [
        Event::ApplySet {
            rule: 0,
            k: 0,
            plan: 1,
            j: 0,
        },
        Event::SetPolicy(0, 0),
    ] {
        let case = Case {
            rules: vec![RuleSpec {
                keyed: Keyed::Account,
                policies: vec![b(false), b(true)],
                route: None,
                cost: 1,
                shaping: None,
                by_outcome: true,
                dry_run: false,
                exempt_peer: None,
            }],
            layer_dry_run: false,
            echo: 0,
            events: vec![
                held(),
                Event::SetPolicy(0, 1),
                held(),
                Event::UntilReleased,
                back.clone(),
                held(),
                Event::Complete(200),
                held(),
            ],
        };
        let seen = Seen::default();
        let r = run_case(&case, &seen, |clock| {
            Arc::new(MemoryStore::builder().clock(clock).build())
        });
        assert_eq!(r, Ok(()), "back with {back:?}");
    }
}
