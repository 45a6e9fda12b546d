//! Building tuple keys from a request: the one place where principal,
//! client address and operation become key components, shared by the
//! rate-limit and concurrency layers.

use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use tollgate_budget::{InvalidName, Key, check_name};

use super::operation::write_operation;
use super::{ClientIp, ClientIpError, ClientIpResolver, Principal};

/// One component of a key. The key does not name the rule's policy: a
/// store keeps the budgets of different policy names (and units) apart by
/// itself, so two rules keyed alike never share a budget.
///
/// Every component is tagged with its kind (`ip=`, `t=` tenant, `a=`
/// account, `c=` credential, `op=` operation, `lit=` literal), so a
/// component of one kind never equals one of another: a rule keyed by
/// tenant that falls back to the client address
/// ([`MissingPrincipal::FallbackToClientIp`]) can never share a budget with
/// a tenant that happens to be named like an address. For example the
/// per-account-operation key of alice in tenant north is
/// `t=north:a=alice:op=POST%20/export`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyPart {
    /// The resolved client address ([`ClientIpResolver`](crate::ClientIpResolver)).
    ClientIp,
    /// The principal's tenant.
    Tenant,
    /// The principal's tenant and account (an account id is only meaningful
    /// within its tenant, so both are always included).
    Account,
    /// The principal's tenant, account and credential id (empty if the
    /// authenticator set none).
    Credential,
    /// The operation from routing ([`Operation`](crate::Operation)).
    Operation,
    /// A fixed component, e.g. to group several routes into one budget.
    Literal(Arc<str>),
    /// A component the application computes from the request
    /// ([`KeyPart::from_extension`], [`KeyPart::unverified`]).
    Custom(CustomPart),
}

impl KeyPart {
    pub(crate) fn needs_principal(&self) -> bool {
        matches!(
            self,
            KeyPart::Tenant | KeyPart::Account | KeyPart::Credential
        )
    }

    /// A component read from the request extension `T`, which a layer you
    /// trust put there after verifying it (an API-key id, an organisation
    /// id from a verified token, a path parameter your router extracted):
    /// the safe way to key by something the application knows.
    ///
    /// `name` (`[A-Za-z0-9._-]`, 1 to 64 bytes) tags the component
    /// (`x.NAME=value`), so a custom component never equals a built-in one
    /// or another custom one. A request without the extension is treated
    /// like one without a principal ([`Rule::when_no_principal`](crate::Rule::when_no_principal):
    /// `401` by default, or the client address, or skip the rule).
    ///
    /// ```
    /// use tollgate::{KeyPart, Policy, Rate, Rule};
    /// /// Set by the application's own API-key middleware.
    /// #[derive(Clone)]
    /// struct ApiKeyId(String);
    /// let per_key = Rule::new(Policy::token_bucket("per-api-key", 100, Rate::per_minute(100)).unwrap())
    ///     .keyed_by([KeyPart::from_extension("api-key", |k: &ApiKeyId| k.0.clone()).unwrap()]);
    /// ```
    pub fn from_extension<T: Send + Sync + 'static>(
        name: &str,
        read: impl Fn(&T) -> String + Send + Sync + 'static,
    ) -> Result<Self, InvalidName> {
        CustomPart::key_part(name, true, move |parts: &Parts| {
            parts.extensions.get::<T>().map(&read)
        })
    }

    /// A component computed by `read` from anything in the request head,
    /// **including what the client writes** (headers, query, path).
    ///
    /// A client chooses such a value: keyed only by it, a client that sends
    /// a new value each time gets a new budget each time. Use it only with
    /// another component the client cannot choose (the client address,
    /// the account), or to split an already-bounded budget further (e.g.
    /// per repository path within an account). For anything an
    /// authentication layer verified, use [`KeyPart::from_extension`].
    /// `None` is treated like a missing principal, and `name` tags the
    /// component, as there.
    pub fn unverified(
        name: &str,
        read: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Self, InvalidName> {
        CustomPart::key_part(name, false, read)
    }
}

type ReadFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// A key component computed by the application; see
/// [`KeyPart::from_extension`] and [`KeyPart::unverified`]. Two custom parts
/// are equal when they are clones of one another.
#[derive(Clone)]
pub struct CustomPart {
    name: Arc<str>,
    /// `x.NAME=`: the component's tag.
    tag: Arc<str>,
    verified: bool,
    read: Arc<ReadFn>,
}

impl CustomPart {
    fn key_part(
        name: &str,
        verified: bool,
        read: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Result<KeyPart, InvalidName> {
        check_name(name)?;
        Ok(KeyPart::Custom(Self {
            name: name.into(),
            tag: format!("x.{name}=").into(),
            verified,
            read: Arc::new(read),
        }))
    }

    /// The name given when the part was made.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the part reads a request extension (set by a trusted layer)
    /// rather than anything a client writes.
    pub fn is_verified(&self) -> bool {
        self.verified
    }
}

impl PartialEq for CustomPart {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.read, &other.read) && self.name == other.name
    }
}

impl Eq for CustomPart {}

impl std::hash::Hash for CustomPart {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state);
    }
}

impl std::fmt::Debug for CustomPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CustomPart")
            .field("name", &self.name)
            .field("verified", &self.verified)
            .finish_non_exhaustive()
    }
}

/// What a rule does when its key needs a [`Principal`](crate::Principal) and the
/// request has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum MissingPrincipal {
    /// Answer `401 Unauthorized` (gRPC: UNAUTHENTICATED) (default), after
    /// charging the request to every other applicable rule whose key is
    /// known (e.g. per address), so that guessing is rate limited too. Use
    /// it on routes that require authentication.
    #[default]
    Reject,
    /// Key the rule by the client address instead of the principal parts.
    FallbackToClientIp,
    /// Do not apply this rule to the request.
    Skip,
}

/// Why a key could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// The key needs a principal, the request has none, and the rule says
    /// [`MissingPrincipal::Reject`].
    NoPrincipal,
    /// The key needs the client address and it could not be resolved.
    ClientIp(ClientIpError),
    /// A custom component has no value for this request, and the rule
    /// says [`MissingPrincipal::Reject`].
    MissingPart(Arc<str>),
}

/// Lazily resolved identity of one request.
pub(crate) struct RequestIdentity<'a> {
    parts: &'a Parts,
    resolver: &'a ClientIpResolver,
    /// The principal an authentication layer set, looked up once, when
    /// first needed.
    principal: Option<Option<&'a Principal>>,
    /// The client address before aggregation, resolved once.
    addr: Option<Result<IpAddr, ClientIpError>>,
}

impl<'a> RequestIdentity<'a> {
    pub(crate) fn new(parts: &'a Parts, resolver: &'a ClientIpResolver) -> Self {
        Self {
            parts,
            resolver,
            principal: None,
            addr: None,
        }
    }

    fn ip(&mut self) -> Result<ClientIp, ClientIpError> {
        self.client_addr().map(|addr| self.resolver.mask(addr))
    }

    /// The resolved client address, before aggregation by prefix.
    pub(crate) fn client_addr(&mut self) -> Result<IpAddr, ClientIpError> {
        self.addr
            .get_or_insert_with(|| self.resolver.resolve_unmasked(self.parts))
            .clone()
    }

    /// The principal an authentication layer set, if any.
    pub(crate) fn principal(&mut self) -> Option<&'a Principal> {
        let parts = self.parts;
        *self
            .principal
            .get_or_insert_with(|| parts.extensions.get::<Principal>())
    }

    /// The key of `key_parts` (the budget's policy name is not part of
    /// it: a store keeps each policy's budgets apart by itself), `Ok(None)`
    /// when the request should skip it, or why it cannot be built. `route`
    /// names the operation when routing left no `MatchedPath` (see
    /// [`Operation`]). A key of the client address alone is
    /// [`Key::client_ip`] (no text is written); a rule without parts has
    /// the one key `*`.
    pub(crate) fn key(
        &mut self,
        key_parts: &[KeyPart],
        missing: MissingPrincipal,
        route: Option<&str>,
    ) -> Result<Option<Key>, KeyError> {
        if let [KeyPart::ClientIp] = key_parts {
            // The common rule, per client address: the address is the key
            // (masked into a key once).
            return match self.client_addr() {
                Ok(addr) => Ok(Some(self.resolver.masked_key(addr))),
                Err(e) => Err(KeyError::ClientIp(e)),
            };
        }
        let mut fallback = false;
        let principal = self.principal();
        if principal.is_none() && key_parts.iter().any(KeyPart::needs_principal) {
            match missing {
                MissingPrincipal::Reject => return Err(KeyError::NoPrincipal),
                MissingPrincipal::Skip => return Ok(None),
                MissingPrincipal::FallbackToClientIp => fallback = true,
            }
        }
        let mut key = Building::Empty;
        let mut ip_done = false;
        for part in key_parts {
            let part = if fallback && part.needs_principal() {
                if ip_done {
                    continue;
                }
                &KeyPart::ClientIp
            } else {
                part
            };
            match part {
                KeyPart::ClientIp => match self.ip() {
                    Ok(ip) => {
                        ip_done = true;
                        key.push_ip(ip);
                    }
                    Err(e) => return Err(KeyError::ClientIp(e)),
                },
                KeyPart::Tenant => key.push("t=", principal.map_or("", |p| p.tenant())),
                KeyPart::Account => {
                    key.push("t=", principal.map_or("", |p| p.tenant()));
                    key.push("a=", principal.map_or("", |p| p.account()));
                }
                KeyPart::Credential => {
                    key.push("t=", principal.map_or("", |p| p.tenant()));
                    key.push("a=", principal.map_or("", |p| p.account()));
                    key.push("c=", principal.and_then(|p| p.credential()).unwrap_or(""));
                }
                KeyPart::Operation => {
                    write_operation(self.parts, route, |pieces| key.push_parts("op=", pieces));
                }
                KeyPart::Literal(s) => key.push("lit=", s),
                KeyPart::Custom(c) => match (c.read)(self.parts) {
                    Some(value) => key.push(&c.tag, &value),
                    None => match missing {
                        MissingPrincipal::Reject => {
                            return Err(KeyError::MissingPart(c.name.clone()));
                        }
                        MissingPrincipal::Skip => return Ok(None),
                        MissingPrincipal::FallbackToClientIp if ip_done => {}
                        MissingPrincipal::FallbackToClientIp => match self.ip() {
                            Ok(ip) => {
                                ip_done = true;
                                key.push_ip(ip);
                            }
                            Err(e) => return Err(KeyError::ClientIp(e)),
                        },
                    },
                },
            }
        }
        Ok(Some(key.finish()))
    }
}

/// A key being built: nothing yet, one client address (kept as the
/// address, [`Key::client_ip`]), or text.
enum Building {
    Empty,
    Ip(ClientIp),
    Text(Key),
}

impl Building {
    fn text(&mut self) -> Option<&mut Key> {
        if let Building::Ip(ip) = *self {
            *self = Building::Text(Key::client_ip(ip.addr(), ip.prefix()));
        }
        match self {
            Building::Text(key) => Some(key),
            _ => None,
        }
    }

    /// Appends the component `tag` followed by `pieces`.
    fn push_parts(&mut self, tag: &str, pieces: &[&str]) {
        match self.text() {
            Some(key) => key.push_tagged_parts(tag, pieces),
            None => *self = Building::Text(Key::tagged(tag, pieces.concat())),
        }
    }

    /// Appends the component `tag` followed by `value`.
    fn push(&mut self, tag: &str, value: &str) {
        match self.text() {
            Some(key) => key.push_tagged(tag, value),
            None => *self = Building::Text(Key::tagged(tag, value)),
        }
    }

    fn push_ip(&mut self, ip: ClientIp) {
        match self.text() {
            Some(key) => key.push_tagged("ip=", ip.text()),
            None => *self = Building::Ip(ip),
        }
    }

    fn finish(self) -> Key {
        match self {
            Building::Empty => Key::new("*"),
            Building::Ip(ip) => Key::client_ip(ip.addr(), ip.prefix()),
            Building::Text(key) => key,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The account key depends on nothing but the verified principal:
        /// any headers, query string, peer or path leave it unchanged.
        #[test]
        fn account_key_depends_only_on_the_principal(
            headers in proptest::collection::vec(("[a-z-]{1,12}", "[ -~]{0,40}"), 0..8),
            query in "[a-z=&0-9]{0,30}",
            peer in any::<[u8; 4]>(),
        ) {
            let mut req = http::Request::builder()
                .uri(format!("/export?{query}"))
                .body(())
                .unwrap();
            for (name, value) in &headers {
                if let (Ok(n), Ok(v)) = (
                    http::HeaderName::from_bytes(name.as_bytes()),
                    http::HeaderValue::from_str(value),
                ) {
                    req.headers_mut().append(n, v);
                }
            }
            req.extensions_mut().insert(Principal::new("north", "alice"));
            req.extensions_mut().insert(crate::identity::PeerAddr((peer, 1).into()));
            let (parts, ()) = req.into_parts();
            let resolver = ClientIpResolver::trusting(["0.0.0.0/0".parse().unwrap()], crate::identity::ForwardedHeader::XForwardedFor).unwrap();
            let key = RequestIdentity::new(&parts, &resolver)
                .key(&[KeyPart::Account], MissingPrincipal::Reject, None)
                .unwrap();
            prop_assert_eq!(key, Some(Key::new("t=north").with("a=alice")));
        }
    }

    /// Audit finding 10: with `FallbackToClientIp`, a `[Tenant]` rule's
    /// fallback key (name, address) equalled (name, tenant) for a tenant
    /// literally named like that address.
    #[test]
    fn an_address_never_equals_a_tenant_account_or_literal() {
        let request = |principal: Option<Principal>| {
            let mut req = http::Request::builder().uri("/").body(()).unwrap();
            req.extensions_mut()
                .insert(crate::identity::PeerAddr(([203, 0, 113, 5], 1).into()));
            if let Some(p) = principal {
                req.extensions_mut().insert(p);
            }
            req.into_parts().0
        };
        let resolver = ClientIpResolver::peer_only();
        let anonymous = request(None);
        let named = request(Some(Principal::new("203.0.113.5", "203.0.113.5")));
        let by_address = RequestIdentity::new(&anonymous, &resolver)
            .key(&[KeyPart::ClientIp], MissingPrincipal::Reject, None)
            .unwrap();
        for parts in [vec![KeyPart::Tenant], vec![KeyPart::Account]] {
            let fallback = RequestIdentity::new(&anonymous, &resolver)
                .key(&parts, MissingPrincipal::FallbackToClientIp, None)
                .unwrap();
            let principal = RequestIdentity::new(&named, &resolver)
                .key(&parts, MissingPrincipal::FallbackToClientIp, None)
                .unwrap();
            assert_eq!(fallback, by_address, "{parts:?}");
            assert_ne!(fallback, principal, "{parts:?}");
        }
        let literal = RequestIdentity::new(&anonymous, &resolver)
            .key(
                &[KeyPart::Literal("203.0.113.5".into())],
                MissingPrincipal::Reject,
                None,
            )
            .unwrap();
        assert_ne!(literal, by_address);
    }

    /// Custom components are tagged by name: never equal to a built-in
    /// component, to another name's, or to a value with separators in it.
    #[test]
    fn custom_components_keep_keys_injective() {
        let mut req = http::Request::builder()
            .uri("/")
            .header("x-org", "north")
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(crate::identity::PeerAddr(([203, 0, 113, 5], 1).into()));
        req.extensions_mut()
            .insert(Principal::new("north", "alice"));
        let (parts, ()) = req.into_parts();
        let resolver = ClientIpResolver::peer_only();
        let header = |name: &str| {
            KeyPart::unverified(name, |p: &Parts| {
                p.headers
                    .get("x-org")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            })
            .unwrap()
        };
        let key = |part: KeyPart| {
            RequestIdentity::new(&parts, &resolver)
                .key(&[part], MissingPrincipal::Reject, None)
                .unwrap()
                .unwrap()
        };
        let org = key(header("org"));
        assert_eq!(org, Key::new("x.org=north"));
        assert_ne!(org, key(KeyPart::Tenant));
        assert_ne!(org, key(header("tenant")));
        assert_ne!(org, key(KeyPart::Literal("north".into())));
        assert_ne!(org, key(KeyPart::Literal("x.org=north".into())));
        // A value with separators stays one component.
        let odd = KeyPart::unverified("org", |_: &Parts| Some("a:b=c".into())).unwrap();
        assert_eq!(key(odd).components().len(), 1);
        // Names are checked once, when the part is made.
        assert!(KeyPart::unverified("has space", |_: &Parts| None).is_err());
        assert!(KeyPart::from_extension("", |p: &Principal| p.tenant().to_owned()).is_err());
        // Clones are equal; two parts with one name and different readers are not.
        let a = header("org");
        assert_eq!(a, a.clone());
        assert_ne!(a, header("org"));
    }
}
