//! Speculative Verification (SV): a companion model predicts which drafts the target will
//! keep, and each step sends the target only as many drafts as maximise kept tokens per
//! unit of verification time. Drafting is unchanged; only verification is cut.
//!
//! The pieces, each pure and tested on hand values: the indicators S and A a companion gives
//! for each draft ([`indicators`]), the table that turns them into the target's acceptance
//! probability β, fitted on profiling runs ([`table`]), the verify forward's cost T_v(n)
//! measured on this machine ([`crate::verify_latency`]) or learned while decoding ([`learned_latency`],
//! kept across restarts by [`latency_store`]),
//! and the goodput-greedy choice of how many drafts each sequence verifies, alone or in a
//! batch ([`schedule`]); [`verify_budget`] prices that choice with the proposer's own
//! score of each draft as β, or with the keep rates the running judge stack shows for each
//! score ([`keep_rates`]), and [`policy`] runs it in the engine over any proposer.

pub mod indicators;
pub mod keep_rates;
pub mod latency_store;
pub mod learned_latency;
pub mod policy;
pub mod schedule;
pub mod table;
pub mod verify_budget;
