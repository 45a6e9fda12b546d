//! Who is asking: the verified [`Principal`], the client address
//! ([`ClientIpResolver`]) and the [`Operation`] from routing.
//!
//! Nothing here reads an account from a header or query string, and nothing
//! reads a bearer secret: a per-account key comes only from the
//! [`Principal`] that an authentication layer put into the request
//! extensions. A client address comes from the connected peer, and a
//! forwarded address is believed only from a configured trusted proxy.

mod client_ip;
// Public to the fuzz targets only: `cargo fuzz` builds with `--cfg fuzzing`.
#[cfg(fuzzing)]
pub mod forwarded;
#[cfg(not(fuzzing))]
#[allow(unreachable_pub)]
mod forwarded;
mod keys;
mod operation;
mod principal;

pub(crate) use client_ip::canonical_nets;
pub use client_ip::{
    ClientIp, ClientIpError, ClientIpResolver, ForwardedHeader, InvalidNetwork, InvalidPrefix,
    PeerAddr,
};
pub use keys::{CustomPart, KeyPart, MissingPrincipal};
pub(crate) use keys::{KeyError, RequestIdentity};
pub use operation::Operation;
pub(crate) use operation::{nested_of as operation_nest, route_of as operation_route};
pub use principal::Principal;
