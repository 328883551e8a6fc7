//! Verdict: a configurable judge stack of lossy verifiers for speculative decoding in
//! mistral.rs — the accept rule, judges, lossless base rules, proposers (EAGLE heads),
//! configuration, metrics and model loading. This is the crate a deployment embeds; the
//! `verdict` command (server, benchmark, plots, cost probes, fetching) is `verdict-cli`.
//!
//! Where a token is accepted: [`accept::VerdictRule`] (its `AcceptRule::accept`) →
//! [`judge::JudgeStack::decide`].

pub mod accept;
pub mod assembly;
pub mod config;
pub mod distribution;
pub mod divergence;
pub mod engine;
pub mod fingerprint;
pub mod judge;
pub mod judges;
pub mod kernels;
pub mod memory;
pub mod metrics;
pub mod models;
pub mod proposers;
pub mod rules;
pub mod step_view;
pub mod sv;
#[cfg(any(test, feature = "test-support"))]
pub mod tiny_model;
pub mod verify_latency;

pub use accept::VerdictRule;
pub use config::Config;
