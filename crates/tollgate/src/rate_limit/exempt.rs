//! [`Exemption`]: requests that a rule, or a whole layer, does not charge.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use ipnet::IpNet;

use crate::Principal;
use crate::identity::InvalidNetwork;
use crate::identity::{RequestIdentity, canonical_nets};

type PrincipalFn = dyn Fn(&Principal) -> bool + Send + Sync;
type RequestFn = dyn Fn(&Parts) -> bool + Send + Sync;

/// Requests that a [`Rule`](crate::Rule) (with [`Rule::exempt`](crate::Rule::exempt))
/// or a whole [`RateLimitLayer`](crate::RateLimitLayer) (with
/// [`RateLimitBuilder::exempt`](crate::rate_limit::RateLimitBuilder::exempt)) does not
/// charge.
///
/// An exempt request charges nothing for the rules it is exempt from and
/// gets no refusal from them (no `401` for a missing principal, no `411`,
/// no `413`); the other rules apply as usual. Exemptions are counted, by
/// policy, in `tollgate_requests_total{outcome="exempt"}` (feature
/// `metrics`). Several exemptions on one rule or layer exempt a request
/// when any of them matches.
///
/// What each kind trusts:
/// - [`Exemption::networks`] checks the *resolved* client address, so it is
///   exactly as trustworthy as the layer's [`ClientIpResolver`](crate::ClientIpResolver):
///   a forwarded address counts only from a trusted proxy. A request whose
///   address cannot be resolved is not exempt.
/// - [`Exemption::principals`] checks the [`Principal`] an authentication
///   layer set; a request without one is not exempt.
/// - [`Exemption::when`] sees the whole request head, including headers the
///   client writes: exempting on a header value lets any client that sends
///   it skip the rule. Test only what a client cannot choose (the route,
///   the method, extensions set by your own trusted layers).
///
/// ```
/// use tollgate::{Exemption, MemoryStore, Policy, Rate, RateLimitLayer, Rule};
/// let per_ip = Policy::token_bucket("per-ip", 5, Rate::per_second(1)).unwrap();
/// let layer = RateLimitLayer::builder(MemoryStore::new())
///     // Health checks skip every rule, even when the store is down.
///     .exempt(Exemption::when(|req| req.uri.path() == "/healthz"))
///     .rule(
///         Rule::per_client_ip(per_ip)
///             // The office network is not limited per address.
///             .exempt(Exemption::networks(["192.0.2.0/24".parse().unwrap()]).unwrap())
///             // Nor is the internal tenant.
///             .exempt(Exemption::principals(|p| p.tenant() == "internal")),
///     );
/// ```
#[derive(Clone)]
pub struct Exemption(Kind);

#[derive(Clone)]
enum Kind {
    Networks(Arc<[IpNet]>),
    Principals(Arc<PrincipalFn>),
    When(Arc<RequestFn>),
}

impl Exemption {
    /// Requests whose resolved client address is inside one of `networks`.
    ///
    /// Networks are compared in the resolver's canonical form (an
    /// IPv4-mapped network of at least /96 is the IPv4 network it names);
    /// a network written in mapped form with a shorter prefix names no
    /// IPv4 network and is refused.
    pub fn networks(networks: impl IntoIterator<Item = IpNet>) -> Result<Self, InvalidNetwork> {
        Ok(Self(Kind::Networks(canonical_nets(networks)?.into())))
    }

    /// Requests whose [`Principal`] satisfies `f` (e.g. an internal tenant).
    pub fn principals(f: impl Fn(&Principal) -> bool + Send + Sync + 'static) -> Self {
        Self(Kind::Principals(Arc::new(f)))
    }

    /// Requests whose head satisfies `f`. See the type's documentation on
    /// what a client can choose.
    pub fn when(f: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        Self(Kind::When(Arc::new(f)))
    }

    pub(crate) fn matches(&self, who: &mut RequestIdentity<'_>, parts: &Parts) -> bool {
        match &self.0 {
            Kind::Networks(nets) => who
                .client_addr()
                .is_ok_and(|addr| nets.iter().any(|n| n.contains(&addr))),
            Kind::Principals(f) => who.principal().is_some_and(|p| f(p)),
            Kind::When(f) => f(parts),
        }
    }
}

/// Whether any of `exemptions` matches the request.
pub(crate) fn any_matches(
    exemptions: &[Exemption],
    who: &mut RequestIdentity<'_>,
    parts: &Parts,
) -> bool {
    exemptions.iter().any(|e| e.matches(who, parts))
}

impl fmt::Debug for Exemption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Networks(nets) => f.debug_tuple("Networks").field(nets).finish(),
            Kind::Principals(_) => f.write_str("Principals(..)"),
            Kind::When(_) => f.write_str("When(..)"),
        }
    }
}
