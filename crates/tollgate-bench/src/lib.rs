//! Measurement programs for tollgate, kept apart from the examples a user
//! runs to learn. Each binary in `src/bin` says in its header what it
//! measures and how to run it; `BENCHMARKS.md` and `HARDENING.md` give the
//! commands and the figures. Not published.

pub mod bench_app;
