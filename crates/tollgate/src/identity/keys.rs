//! Building tuple keys from a request: the one place where principal,
//! client address and operation become key components, shared by the
//! rate-limit and concurrency layers.

use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use tollgate_core::Key;

use super::{ClientIp, ClientIpError, ClientIpResolver, Operation, Principal};

/// One component of a key (after the policy or layer name, which always
/// comes first).
///
/// Every component is tagged with its kind (`ip=`, `t=` tenant, `a=`
/// account, `c=` credential, `op=` operation, `lit=` literal), so a
/// component of one kind never equals one of another: a rule keyed by
/// tenant that falls back to the client address
/// ([`MissingPrincipal::FallbackToClientIp`]) can never share a budget with
/// a tenant that happens to be named like an address. For example the
/// per-account-operation key of alice in tenant north is
/// `export:t=north:a=alice:op=POST%20/export`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// The resolved client address ([`crate::ClientIpResolver`]).
    ClientIp,
    /// The principal's tenant.
    Tenant,
    /// The principal's tenant and account (an account id is only meaningful
    /// within its tenant, so both are always included).
    Account,
    /// The principal's tenant, account and credential id (empty if the
    /// authenticator set none).
    Credential,
    /// The operation from routing ([`crate::Operation`]).
    Operation,
    /// A fixed component, e.g. to group several routes into one budget.
    Literal(Arc<str>),
}

impl KeyPart {
    pub(crate) fn needs_principal(&self) -> bool {
        matches!(
            self,
            KeyPart::Tenant | KeyPart::Account | KeyPart::Credential
        )
    }
}

/// What a rule does when its key needs a [`crate::Principal`] and the
/// request has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
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
}

/// Lazily resolved identity of one request.
pub(crate) struct RequestIdentity<'a> {
    parts: &'a Parts,
    resolver: &'a ClientIpResolver,
    principal: Option<&'a Principal>,
    /// The client address before aggregation, resolved once.
    addr: Option<Result<IpAddr, ClientIpError>>,
    operation: Option<Operation>,
}

impl<'a> RequestIdentity<'a> {
    pub(crate) fn new(parts: &'a Parts, resolver: &'a ClientIpResolver) -> Self {
        Self {
            parts,
            resolver,
            principal: parts.extensions.get::<Principal>(),
            addr: None,
            operation: None,
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
    pub(crate) fn principal(&self) -> Option<&'a Principal> {
        self.principal
    }

    /// The key `(first, parts...)`, `Ok(None)` when the request should skip
    /// it, or why it cannot be built. `route` names the operation when
    /// routing left no `MatchedPath` (see [`Operation`]).
    pub(crate) fn key(
        &mut self,
        first: &str,
        key_parts: &[KeyPart],
        missing: MissingPrincipal,
        route: Option<&str>,
    ) -> Result<Option<Key>, KeyError> {
        let mut fallback = false;
        if self.principal.is_none() && key_parts.iter().any(KeyPart::needs_principal) {
            match missing {
                MissingPrincipal::Reject => return Err(KeyError::NoPrincipal),
                MissingPrincipal::Skip => return Ok(None),
                MissingPrincipal::FallbackToClientIp => fallback = true,
            }
        }
        let principal = self.principal;
        let mut key = Key::new(first);
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
                        key.push_tagged("ip=", ip.text());
                    }
                    Err(e) => return Err(KeyError::ClientIp(e)),
                },
                KeyPart::Tenant => key.push_tagged("t=", principal.map_or("", |p| p.tenant())),
                KeyPart::Account => {
                    key.push_tagged("t=", principal.map_or("", |p| p.tenant()));
                    key.push_tagged("a=", principal.map_or("", |p| p.account()));
                }
                KeyPart::Credential => {
                    key.push_tagged("t=", principal.map_or("", |p| p.tenant()));
                    key.push_tagged("a=", principal.map_or("", |p| p.account()));
                    key.push_tagged("c=", principal.and_then(|p| p.credential()).unwrap_or(""));
                }
                KeyPart::Operation => match route {
                    // A rule-specific stand-in: not cached across rules.
                    Some(_) => {
                        key.push_tagged("op=", Operation::with_fallback(self.parts, route).as_str())
                    }
                    None => {
                        let op = self
                            .operation
                            .get_or_insert_with(|| Operation::of(self.parts));
                        key.push_tagged("op=", op.as_str());
                    }
                },
                KeyPart::Literal(s) => key.push_tagged("lit=", s.as_bytes()),
            }
        }
        Ok(Some(key))
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
            req.extensions_mut().insert(crate::PeerAddr((peer, 1).into()));
            let (parts, ()) = req.into_parts();
            let resolver = ClientIpResolver::trusting(["0.0.0.0/0".parse().unwrap()], crate::ForwardedHeader::XForwardedFor).unwrap();
            let key = RequestIdentity::new(&parts, &resolver)
                .key("acct", &[KeyPart::Account], MissingPrincipal::Reject, None)
                .unwrap();
            prop_assert_eq!(key, Some(Key::new("acct").with("t=north").with("a=alice")));
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
                .insert(crate::PeerAddr(([203, 0, 113, 5], 1).into()));
            if let Some(p) = principal {
                req.extensions_mut().insert(p);
            }
            req.into_parts().0
        };
        let resolver = ClientIpResolver::peer_only();
        let anonymous = request(None);
        let named = request(Some(Principal::new("203.0.113.5", "203.0.113.5")));
        let by_address = RequestIdentity::new(&anonymous, &resolver)
            .key("rule", &[KeyPart::ClientIp], MissingPrincipal::Reject, None)
            .unwrap();
        for parts in [vec![KeyPart::Tenant], vec![KeyPart::Account]] {
            let fallback = RequestIdentity::new(&anonymous, &resolver)
                .key("rule", &parts, MissingPrincipal::FallbackToClientIp, None)
                .unwrap();
            let principal = RequestIdentity::new(&named, &resolver)
                .key("rule", &parts, MissingPrincipal::FallbackToClientIp, None)
                .unwrap();
            assert_eq!(fallback, by_address, "{parts:?}");
            assert_ne!(fallback, principal, "{parts:?}");
        }
        let literal = RequestIdentity::new(&anonymous, &resolver)
            .key(
                "rule",
                &[KeyPart::Literal("203.0.113.5".into())],
                MissingPrincipal::Reject,
                None,
            )
            .unwrap();
        assert_ne!(literal, by_address);
    }
}
