//! `train-head`: mines labelled draft/target mismatches (AutoJudge's Algorithm 1), fits the
//! heads the plugin loads, and reports how good they are.
//!
//! Data flow: [`miner`] (Algorithm 1 over a [`miner::MiningEngine`]: a draft model, or an
//! EAGLE head in [`eagle_mine`]) → [`labels`] (append-only
//! JSONL, one line per problem; batched runs keep their unfinished searches in
//! [`searches_in_flight`]) → features → [`fit`] (standardise, logistic regression over a
//! grid, threshold table) → a `verdict_heads::LogisticHead` file.

pub mod autojudge_head;
pub mod decode_layers;
pub mod eagle_adamw;
pub mod eagle_capture;
pub mod eagle_fit;
pub mod eagle_loss;
pub mod eagle_mine;
pub mod eagle_pipeline;
pub mod eagle_replay;
pub mod engine;
pub mod feature_models;
pub mod features;
pub mod fit;
pub mod labels;
pub mod mine;
pub mod miner;
pub mod pad_fit;
pub mod pad_head;
pub mod pad_mine;
pub mod responses;
pub mod searches_in_flight;
pub mod sv_profile;
