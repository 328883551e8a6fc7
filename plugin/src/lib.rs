//! Verdict: a configurable judge stack of lossy verifiers for speculative decoding in
//! mistral.rs, with lossless base rules, metrics, a server and a benchmark.
//!
//! Where a token is accepted: [`accept::VerdictRule`] (its `AcceptRule::accept`) →
//! [`judge::JudgeStack::decide`].

pub mod accept;
pub mod bench;
pub mod config;
pub mod datasets;
pub mod distribution;
pub mod divergence;
pub mod engine;
pub mod fingerprint;
pub mod forward_cost;
pub mod head_cost;
pub mod jsonl;
pub mod judge;
pub mod judges;
pub mod kernels;
pub mod matmul_cost;
pub mod metrics;
pub mod models;
pub mod openai_conventions;
pub mod paired;
pub mod plot;
pub mod proposers;
pub mod rules;
pub mod server;
pub mod step_view;
pub mod subset;
pub mod tasks;
pub mod tiny_model;
pub mod wheels;

pub use accept::VerdictRule;
pub use config::Config;
