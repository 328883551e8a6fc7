//! Lossless means identical on quantized weights: tiny targets and drafts quantized as they
//! load (`models.isq`: Q4_K, Q6_K, Q8_0) run through the same CPU kernels as the real GGUFs.
//! With the row-invariant kernels and weights held once as panels (what `verdict` selects), a
//! row of the target's logits has the same bits whether it was decoded alone, verified among
//! up to 8 rows, or computed after a prefix-cache hit (a prompt prefilled in two chunks); and
//! greedy `exact` and `rejection` speculation write plain decoding's tokens for every γ in
//! 1..=8.

mod common;

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Mutex},
};

use candle_core::{Result as CandleResult, Tensor};
use common::{
    scripted::{plain_runs, scripted_at_most},
    tiny_pair,
};
use mistralrs_core::{
    speculative_hook::{AcceptDecision, AcceptRule, ArgmaxMatch, Proposer, SamplingSettings, VerifyContext},
    SpeculativeConfig, SpeculativePipeline,
};
use tokio::sync::Mutex as AsyncMutex;
use verdict::{
    config::{Config, Isq},
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, build_mistralrs_with, generate},
    judge::JudgeStack,
    kernels::QuantKernel,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::{words, TinyArch, TinySpec},
};

const MAX_TOKENS: usize = 24;

/// A tiny pair wide enough for 256-value K-quant blocks in every matrix.
fn quantizable_spec(seed: u64) -> TinySpec {
    let mut s = TinySpec::new(TinyArch::Qwen2, seed);
    s.hidden_size = 256;
    s.intermediate_size = 512;
    s
}

fn isq_config(dir: &Path, isq: Isq, gamma: usize) -> Config {
    Config::from_toml(&format!(
        "[models]\ntarget = {:?}\ndraft = {:?}\nisq = \"{isq}\"\n[speculative]\ngamma = {gamma}\n[sampling]\ntemperature = 0.0\nmax_tokens = {MAX_TOKENS}\n",
        dir.join("target").to_str().unwrap(),
        dir.join("draft").to_str().unwrap(),
    ))
    .unwrap()
}

/// Prompts that share a long prefix, so that each after the first is a prefix-cache hit.
fn prompts() -> Vec<String> {
    let prefix: Vec<usize> = (0..20).map(|i| (i * 7 + 2) % 56).collect();
    [[3, 9], [41, 5], [3, 12]]
        .iter()
        .map(|tail| words(&prefix.iter().chain(tail).copied().collect::<Vec<_>>()))
        .collect()
}

/// The bits of a logits row, keyed by the tokens it was computed after.
type Rows = HashMap<Vec<u32>, Vec<u32>>;

/// Greedy arg-max acceptance that keeps every row of the target's logits it is shown.
#[derive(Default)]
struct RecordingRule {
    rows: Mutex<Rows>,
}

impl AcceptRule for RecordingRule {
    fn sample_draft(&self, seq_id: usize, logits: &Tensor, sampling: &SamplingSettings) -> CandleResult<u32> {
        ArgmaxMatch.sample_draft(seq_id, logits, sampling)
    }

    fn accept(&self, ctx: &VerifyContext<'_>) -> CandleResult<AcceptDecision> {
        let mut rows = self.rows.lock().unwrap();
        for (i, row) in ctx.target_logits.to_vec2::<f32>()?.into_iter().enumerate() {
            // Row i scores the position after the prefix and the first i drafts.
            let context: Vec<u32> = ctx.prefix.iter().chain(&ctx.draft_tokens[..i]).copied().collect();
            rows.insert(context, row.iter().map(|v| v.to_bits()).collect());
        }
        ArgmaxMatch.accept(ctx)
    }
}

/// The target's logits rows of greedy decoding of `prompts` with `proposer` drafting.
fn recorded_rows(models: &LoadedModels, config: &Config, proposer: Arc<dyn Proposer>, prefix_cache: bool) -> Rows {
    let rule = Arc::new(RecordingRule::default());
    let pipeline = SpeculativePipeline::with_proposer(
        models.target.clone(),
        proposer,
        SpeculativeConfig { gamma: config.speculative.gamma, accept_rule: Some(rule.clone()) },
    )
    .unwrap();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let engine = build_mistralrs_with(Arc::new(AsyncMutex::new(pipeline)), 1, prefix_cache).await;
        for p in prompts() {
            generate(&engine, &Prompt::Text(p), &config.sampling).await.unwrap();
        }
    });
    let rows = std::mem::take(&mut *rule.rows.lock().unwrap());
    rows
}

/// Rows of `other` that were computed after the same tokens as rows of `alone` must have
/// the same bits; returns how many were compared.
fn assert_same_rows(alone: &Rows, other: &Rows, what: &str) -> usize {
    let mut compared = 0;
    for (context, bits) in other {
        if let Some(expected) = alone.get(context) {
            let differing = bits.iter().zip(expected).filter(|(a, b)| a != b).count();
            assert_eq!(differing, 0, "{what}: the row after {} tokens differs in {differing} logits", context.len());
            compared += 1;
        }
    }
    compared
}

#[test]
fn a_rows_logits_have_the_same_bits_alone_in_a_verify_and_after_a_prefix_hit() {
    QuantKernel::RowInvariant.select();
    QuantKernel::hold_weights_once(true);
    let dir = tempfile::tempdir().unwrap();
    let s = quantizable_spec(11);
    tiny_pair(dir.path(), &s, 0.2);
    let mut prompt_rows = Vec::new();
    for isq in [Isq::Q4K, Isq::Q6K, Isq::Q8_0] {
        let config = isq_config(dir.path(), isq, 7);
        let models = LoadedModels::load_with_draft(&config, false).unwrap();
        let plain = plain_runs(&models, &config, &prompts());
        let tokens: usize = plain.iter().map(|r| r.ids.len()).sum();
        // Every token decoded alone: one-row verify forwards.
        let alone = recorded_rows(&models, &config, scripted_at_most(&plain, &s, None, 0), false);
        assert!(alone.len() >= tokens, "{isq}: {} rows for {tokens} tokens", alone.len());
        // The known continuation verified 8 rows at a time, a draft spoiled every 3rd step.
        let verified = recorded_rows(&models, &config, scripted_at_most(&plain, &s, Some(3), 7), false);
        let compared = assert_same_rows(&alone, &verified, &format!("{isq}, 8-row verify"));
        assert!(compared >= tokens - plain.len(), "{isq}: only {compared} of {tokens} rows met in verify forwards");
        // Prompts after the first hit the prefix cache: their prompt forward computes only
        // the tokens after the shared prefix, then decoding goes on alone.
        let chunked = recorded_rows(&models, &config, scripted_at_most(&plain, &s, None, 0), true);
        let compared = assert_same_rows(&alone, &chunked, &format!("{isq}, after a prefix-cache hit"));
        assert_eq!(compared, chunked.len(), "{isq}: every row after a hit is one decoding alone computed");
        let first_prompt: Vec<u32> = alone.keys().min_by_key(|c| c.len()).unwrap().clone();
        prompt_rows.push(alone[&first_prompt].clone());
    }
    // Each format computes other logits: the weights were quantized as they loaded.
    assert!(
        prompt_rows[0] != prompt_rows[1] && prompt_rows[1] != prompt_rows[2] && prompt_rows[0] != prompt_rows[2],
        "Q4_K, Q6_K and Q8_0 gave identical logits"
    );
}

#[test]
fn greedy_lossless_speculation_on_quantized_models_is_plain_decoding_for_every_gamma() {
    QuantKernel::RowInvariant.select();
    QuantKernel::hold_weights_once(true);
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &quantizable_spec(11), 0.2);
    for isq in [Isq::Q4K, Isq::Q6K, Isq::Q8_0] {
        let config = isq_config(dir.path(), isq, 1);
        let models = LoadedModels::load(&config).unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async {
            let plain = Engine::plain(&models, 1).await;
            let mut plain_texts = Vec::new();
            for p in prompts() {
                plain_texts.push(generate(&plain.mistralrs, &Prompt::Text(p), &config.sampling).await.unwrap().text);
            }
            let (mut kept, mut refused) = (0, 0);
            for gamma in 1..=8 {
                for base in [BaseRule::Exact, BaseRule::Rejection] {
                    let engine =
                        Engine::speculative(&models, SpeculativeSetup { gamma, stack: JudgeStack::lossless(base), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) })
                            .await
                            .unwrap();
                    let rule = engine.rule.clone().unwrap();
                    rule.record_steps();
                    for (p, expected) in prompts().into_iter().zip(&plain_texts) {
                        let text = generate(&engine.mistralrs, &Prompt::Text(p), &config.sampling).await.unwrap().text;
                        assert_eq!(&text, expected, "{isq}, γ {gamma}, {base:?}: speculative output differs from plain decoding");
                        engine.settle().await;
                    }
                    for s in rule.recorded_steps().iter().filter(|s| s.drafted > 0 && !s.finished) {
                        kept += s.accepted;
                        refused += usize::from(s.accepted < s.drafted);
                    }
                }
            }
            // The comparison means something only if drafts were both kept and refused.
            assert!(kept > 0 && refused > 0, "{isq}: {kept} drafts kept, {refused} steps refused one");
        });
    }
}

#[test]
fn isq_on_a_gguf_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("model.gguf");
    std::fs::write(&gguf, b"GGUF").unwrap();
    let config = Config::from_toml(&format!("[models]\ntarget = {:?}\nisq = \"q4k\"\n[speculative]\nenabled = false\n", gguf.to_str().unwrap())).unwrap();
    let err = format!("{:#}", LoadedModels::load(&config).err().unwrap());
    assert!(err.contains("models.isq = \"q4k\"") && err.contains("model.gguf"), "{err}");
    let err = format!("{:#}", Config::from_toml("[models]\ntarget = \"t\"\nisq = \"q5\"\n[speculative]\nenabled = false\n").err().unwrap());
    assert!(err.contains("q5") && err.contains("q4k"), "{err}");
}
