//! Several sequences decoded together in one engine each get their own answer: a greedy
//! request answered in a batch equals the same request answered alone.
//!
//! mistral.rs 0.8.1's single-query CPU attention kept one scratch slot per (tile, head) for
//! every batch item, so each decode step gave every sequence the last sequence's attention:
//! concurrent requests of equal prompt length came back as copies of one answer after their
//! first token (fixed in the patch series).
//!
//! Sequences of different lengths decode in one batch too (ragged batches): each row appends at
//! its own KV length and attends to its own keys only.

mod common;

use std::{collections::BTreeSet, sync::Arc};

use candle_core::Tensor;
use common::{config, spec, tiny_pair};
use mistralrs_core::{MistralRs, NormalRequest, Request, RequestMessage, Response};
use verdict::{
    config::SamplingConfig,
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate, sampling_params},
    judge::{Judge, JudgeStack},
    metrics::Metrics,
    rules::BaseRule,
    step_view::StepView,
    tiny_model::{words, TinyArch, FIRST_WORD_ID},
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

/// Word 50 marks the request that fails; the other prompts never contain it.
const POISON_WORD: usize = 50;
/// Tokens a poisoned sequence holds before it fails: its prompt and a few decoded tokens,
/// so it fails in a decode step shared with the others.
const FAILS_AT_LEN: usize = 8;

fn poisoned(context: &[u32]) -> bool {
    context.contains(&((FIRST_WORD_ID + POISON_WORD) as u32)) && context.len() >= FAILS_AT_LEN
}

/// A judge that fails on the poisoned sequence: an error inside one sequence's speculative
/// step, after the target scored the whole batch.
struct FailsOnPoison;

impl Judge for FailsOnPoison {
    fn name(&self) -> &str {
        "fails-on-poison"
    }
    fn rescues(&self, view: &StepView, _: usize) -> anyhow::Result<bool> {
        self.vetoes(view, 0)
    }
    fn vetoes(&self, view: &StepView, _: usize) -> anyhow::Result<bool> {
        anyhow::ensure!(!poisoned(view.ctx.prefix), "the poisoned sequence fails here");
        Ok(false)
    }
}

/// The poisoned prompt sent through mistral.rs with a logits processor that fails on it:
/// an error inside one sequence's sampling in a plain decode batch.
async fn poisoned_plain_request(mistralrs: &MistralRs, prompt: &str, sampling: &SamplingConfig) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let message = RequestMessage::Completion { text: prompt.to_string(), echo_prompt: false, best_of: None };
    let mut request = NormalRequest::new_simple(message, sampling_params(sampling), tx, mistralrs.next_request_id(), None, None);
    let fails = |logits: &Tensor, context: &[u32]| -> candle_core::Result<Tensor> {
        if poisoned(context) {
            candle_core::bail!("the poisoned sequence fails here");
        }
        Ok(logits.clone())
    };
    request.logits_processors = Some(vec![Arc::new(fails)]);
    mistralrs.get_sender(None).unwrap().send(Request::Normal(Box::new(request))).await.unwrap();
    rx.recv().await.expect("the engine dropped the poisoned request unanswered")
}

/// An error in one sequence finishes that sequence alone, with its error: the others of
/// its batch answer as they do alone, and the engine serves on. Upstream returned from the
/// plain batch's sampling loop at the first failed sequence (the rest of the batch lost
/// that step's token), and failed a whole speculative batch with one sequence's error.
#[test]
fn an_error_in_one_sequence_fails_that_sequence_alone() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 23), 0.2);
    let config = config(dir.path(), 3, "exact", MAX_TOKENS);
    let models = LoadedModels::load(&config).unwrap();
    let good: Vec<String> = EQUAL_LENGTHS.iter().map(|ids| words(ids)).collect();
    let bad = words(&[2, POISON_WORD, 9, 4]);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        for speculative in [false, true] {
            let engine = match speculative {
                false => Engine::plain(&models, good.len() + 1).await,
                true => {
                    let stack = JudgeStack { judges: vec![Box::new(FailsOnPoison)], ..JudgeStack::lossless(BaseRule::Exact) };
                    Engine::speculative(&models, SpeculativeSetup { gamma: 3, stack, seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(good.len() + 1) }).await.unwrap()
                }
            };
            let mistralrs = engine.mistralrs.clone();
            let mut alone = Vec::new();
            for p in &good {
                alone.push(generate(&mistralrs, &Prompt::Text(p.clone()), &config.sampling).await.unwrap().text);
            }
            let batched_before = mistralrs_core::batched_speculative_verifies();
            let bad_answer = {
                let (mistralrs, bad, sampling) = (mistralrs.clone(), bad.clone(), config.sampling.clone());
                tokio::spawn(async move {
                    match speculative {
                        false => match poisoned_plain_request(&mistralrs, &bad, &sampling).await {
                            Response::InternalError(e) => Err(e.to_string()),
                            Response::CompletionModelError(e, _) => Err(e),
                            Response::CompletionDone(r) => Ok(r.choices[0].text.clone()),
                            _ => Ok("a response of another kind".to_string()),
                        },
                        true => match generate(&mistralrs, &Prompt::Text(bad), &sampling).await {
                            Err(e) => Err(format!("{e:#}")),
                            Ok(g) => Ok(g.text),
                        },
                    }
                })
            };
            let together = common::answer_concurrently(&mistralrs, &good, &config.sampling).await;
            let bad_answer = bad_answer.await.unwrap();
            assert!(
                bad_answer.as_ref().is_err_and(|e| e.contains("the poisoned sequence fails here")),
                "speculative {speculative}: the poisoned request was answered {bad_answer:?}"
            );
            assert_eq!(together, alone, "speculative {speculative}: a neighbour of the failed sequence answered differently");
            if speculative {
                assert!(mistralrs_core::batched_speculative_verifies() > batched_before, "no batched verify: the sequences never shared a step");
            }
            let again = generate(&mistralrs, &Prompt::Text(good[0].clone()), &config.sampling).await.unwrap();
            assert_eq!(again.text, alone[0], "speculative {speculative}: the engine after the failure");
        }
    });
}
