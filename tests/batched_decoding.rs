//! Several sequences decoded together in one engine each get their own answer: a greedy
//! request answered in a batch equals the same request answered alone.
//!
//! mistral.rs 0.8.1's single-query CPU attention kept one scratch slot per (tile, head) for
//! every batch item, so each decode step gave every sequence the last sequence's attention:
//! concurrent requests of equal prompt length came back as copies of one answer after their
//! first token (patch 0009).
//!
//! Sequences of different lengths decode in one batch too (patch 0016): each row appends at
//! its own KV length and attends to its own keys only.

mod common;

use std::collections::BTreeSet;

use common::{config, spec, tiny_pair};
use verdict::{
    engine::{generate, Engine, LoadedModels, Prompt},
    tiny_model::{words, TinyArch},
};

const MAX_TOKENS: usize = 24;

fn batched_equals_alone(arch: TinyArch, prompt_ids: &[&[usize]]) {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(arch, 23), 0.2);
    let mut config = config(dir.path(), 3, "exact", MAX_TOKENS);
    config.speculative.enabled = false;
    let models = LoadedModels::load(&config).unwrap();
    let prompts: Vec<String> = prompt_ids.iter().map(|ids| words(ids)).collect();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let engine = Engine::plain(&models, prompts.len()).await;
        let mut alone = Vec::new();
        for p in &prompts {
            let g = generate(&engine.mistralrs, &Prompt::Text(p.clone()), &config.sampling)
                .await
                .unwrap();
            alone.push(g.text);
        }
        let distinct: BTreeSet<&String> = alone.iter().collect();
        assert_eq!(distinct.len(), prompts.len(), "the prompts must answer differently: {alone:?}");

        let together = common::answer_concurrently(&engine.mistralrs, &prompts, &config.sampling).await;
        assert_eq!(together, alone);
    });
}

/// Equal token counts: upstream's scheduler batched only these.
const EQUAL_LENGTHS: &[&[usize]] = &[&[1, 2, 3, 4], &[9, 30, 7, 5], &[22, 6, 14, 40]];

/// 2, 5 and 9 prompt tokens: the rows of one decode batch hold different KV lengths.
const DIFFERENT_LENGTHS: &[&[usize]] = &[&[1, 2], &[9, 30, 7, 5, 3], &[22, 6, 14, 40, 8, 11, 2, 19, 33]];

#[test]
fn qwen2_batched_greedy_equals_alone() {
    batched_equals_alone(TinyArch::Qwen2, EQUAL_LENGTHS);
}

#[test]
fn llama_batched_greedy_equals_alone() {
    batched_equals_alone(TinyArch::Llama, EQUAL_LENGTHS);
}

fn different_lengths_batched_equal_alone(arch: TinyArch) {
    let formed = mistralrs_core::ragged_batches_formed();
    batched_equals_alone(arch, DIFFERENT_LENGTHS);
    assert!(
        mistralrs_core::ragged_batches_formed() > formed,
        "the requests of different lengths never decoded in one batch"
    );
}

#[test]
fn qwen2_different_lengths_batched_greedy_equals_alone() {
    different_lengths_batched_equal_alone(TinyArch::Qwen2);
}

#[test]
fn llama_different_lengths_batched_greedy_equals_alone() {
    different_lengths_batched_equal_alone(TinyArch::Llama);
}
