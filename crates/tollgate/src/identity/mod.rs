//! Who is asking: the verified [`Principal`], the client address
//! ([`ClientIpResolver`]) and the [`Operation`](crate::Operation) from routing.
//!
//! Nothing here reads an account from a header or query string, and nothing
//! reads a bearer secret: a per-account key comes only from the
//! [`Principal`] that an authentication layer put into the request
//! extensions. A client address comes from the connected peer, and a
//! forwarded address is believed only from a configured trusted proxy.

pub(crate) mod client_ip;
// Public to the fuzz targets only: `cargo fuzz` builds with `--cfg fuzzing`.
#[cfg(fuzzing)]
pub mod forwarded;
#[cfg(not(fuzzing))]
#[allow(unreachable_pub)]
mod forwarded;
pub(crate) mod keys;
pub(crate) mod operation;
pub(crate) mod principal;

pub(crate) use client_ip::ClientIpResolver;
pub(crate) use client_ip::canonical_nets;
pub use client_ip::{
    ClientIp, ClientIpError, ForwardedHeader, InvalidNetwork, InvalidPrefix, PeerAddr,
};
pub use keys::CustomPart;
pub(crate) use keys::{KeyError, RequestIdentity};
pub(crate) use keys::{KeyPart, MissingPrincipal};
pub(crate) use operation::Routed;
pub(crate) use principal::Principal;
