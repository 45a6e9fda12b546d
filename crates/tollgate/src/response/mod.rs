//! The answers tollgate gives instead of calling the inner service, and the
//! `RateLimit-Policy` / `RateLimit` fields on the answers it lets through.
//!
//! - [`fields`]: the field writer, shared by the rate-limit and the
//!   concurrency layer;
//! - [`refusal`]: the catalogue of refusals (status, problem type, gRPC code)
//!   and the answer under construction;
//! - [`problem`]: the `application/problem+json` body (RFC 9457);
//! - [`rendered`]: a policy's refusal for lack of budget, rendered once;
//! - [`grpc`]: recognising gRPC callers, and their trailers-only answers;
//! - [`custom`]: refusal bodies shaped by the application.
//!
//! Every refusal carries `Cache-Control: no-store`.

mod custom;
mod fields;
mod grpc;
mod problem;
mod refusal;
mod rendered;

pub(crate) use custom::Shape;
pub use custom::{RefusalBody, RefusalInfo};
pub(crate) use fields::{FieldWriter, RATELIMIT, RATELIMIT_POLICY};
pub(crate) use grpc::Protocol;
pub(crate) use refusal::{Answer, Limit, Refusal, polled_after_completion};
pub(crate) use rendered::ratelimit_fields;
