//! The patched speculative pipeline on tiny generated models: greedy speculative output is
//! the plain target's, token for token, and both KV caches are cut back correctly.

mod common;

use std::sync::Arc;

use common::{config, prompts, spec, tiny_pair};
use mistralrs_core::speculative_hook::StepReport;
use verdict::{
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::{word_index, words, write_tiny_model, TinyArch},
};

const GAMMA: usize = 3;
const MAX_TOKENS: usize = 40;

/// Per base rule: the speculative texts and the steps' reports.
type SpeculativeRuns = Vec<(BaseRule, Vec<String>, Vec<StepReport>)>;

/// Texts from plain decoding, then from speculative decoding with each base rule, with
/// the step reports of the speculative runs.
fn decode_all(
    dir: &std::path::Path,
    prompts: &[String],
    max_tokens: usize,
) -> (Vec<String>, SpeculativeRuns) {
    decode_all_with(dir, prompts, max_tokens, 1.into())
}

/// [`decode_all`] with the speculative engines scheduling as `scheduling` says (plain
/// decoding, the reference, keeps no prefix cache).
fn decode_all_with(
    dir: &std::path::Path,
    prompts: &[String],
    max_tokens: usize,
    scheduling: Scheduling,
) -> (Vec<String>, SpeculativeRuns) {
    let config = config(dir, GAMMA, "exact", max_tokens);
    let models = LoadedModels::load(&config).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let plain = Engine::plain(&models, 1).await;
        let mut plain_texts = Vec::new();
        for p in prompts {
            plain_texts.push(
                generate(&plain.mistralrs, &Prompt::Text(p.clone()), &config.sampling)
                    .await
                    .unwrap()
                    .text,
            );
        }
        let mut speculative = Vec::new();
        for base in [BaseRule::Exact, BaseRule::Rejection] {
            let engine = Engine::speculative(&models, SpeculativeSetup { gamma: GAMMA, stack: JudgeStack::lossless(base), seed: 0, metrics: Arc::new(Metrics::default()), scheduling })
            .await
            .unwrap();
            let rule = engine.rule.clone().unwrap();
            rule.record_steps();
            let mut texts = Vec::new();
            for p in prompts {
                texts.push(
                    generate(
                        &engine.mistralrs,
                        &Prompt::Text(p.clone()),
                        &config.sampling,
                    )
                    .await
                    .unwrap()
                    .text,
                );
                engine.settle().await;
            }
            speculative.push((base, texts, rule.recorded_steps()));
        }
        (plain_texts, speculative)
    })
}

fn assert_identical_and_both_outcomes(arch: TinyArch) {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(arch, 11), 0.2);
    let (plain, speculative) = decode_all(dir.path(), &prompts(), MAX_TOKENS);
    for (base, texts, steps) in speculative {
        assert_eq!(
            texts, plain,
            "{base:?} speculative output differs from plain decoding"
        );
        // The comparison means something only if drafts were both kept and refused.
        let partial = steps
            .iter()
            .filter(|s| s.accepted < s.drafted && !s.finished)
            .count();
        let full = steps
            .iter()
            .filter(|s| s.accepted == s.drafted && !s.finished)
            .count();
        assert!(
            partial > 0 && full > 0,
            "{base:?}: {partial} partial and {full} full acceptances"
        );
    }
}

#[test]
fn greedy_speculative_output_is_plain_output_llama() {
    assert_identical_and_both_outcomes(TinyArch::Llama);
}

#[test]
fn greedy_speculative_output_is_plain_output_qwen2() {
    assert_identical_and_both_outcomes(TinyArch::Qwen2);
}

#[test]
fn kv_caches_hold_every_committed_token_but_the_last() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 5), 0.2);
    let (_, speculative) = decode_all(dir.path(), &prompts()[..2], MAX_TOKENS);
    let (_, _, steps) = &speculative[0];
    let mut after_full = 0;
    for (i, s) in steps.iter().enumerate().filter(|(_, s)| !s.finished) {
        // The target fed γ + 1 tokens and keeps all but the refused drafts' entries.
        assert_eq!(s.target_cache_len, s.seq_len - 1, "step {i}: {s:?}");
        if s.accepted == s.drafted {
            // The draft never saw its own last draft: the next step feeds two tokens.
            assert_eq!(s.draft_cache_len, s.seq_len - 2, "step {i}: {s:?}");
            after_full += 1;
        } else {
            assert_eq!(s.draft_cache_len, s.seq_len - 1, "step {i}: {s:?}");
        }
        assert_eq!(s.emitted, s.accepted + 1, "step {i}: {s:?}");
    }
    assert!(
        after_full > 0,
        "no step kept every draft; the full-acceptance path went untested"
    );
}

/// Four prompts of different lengths, decoded together in the batched tests.
fn four_prompts_of_different_lengths() -> Vec<String> {
    [&[9, 30, 7, 5, 3][..], &[22, 6, 14, 40, 8, 11, 2, 19, 33], &[4, 17, 50], &[1, 2]].iter().map(|ids| words(ids)).collect()
}

/// Sequences decoded together by a draft-model engine draft in one draft forward per draft
/// position and are verified in one target forward per step: rows of different KV lengths
/// (the first draft forward feeds one token to some rows and two to those that kept every
/// draft), each judged and cut back on its own. Every answer equals the plain target's, and
/// after every step both models' rows hold the sequence's committed tokens but the newest
/// (the draft one fewer after a step that kept every draft).
#[test]
fn batched_draft_model_steps_answer_each_sequence_as_plain_decoding() {
    for arch in [TinyArch::Qwen2, TinyArch::Llama] {
        let dir = tempfile::tempdir().unwrap();
        // A draft close to the target: steps that keep every draft come up for both.
        tiny_pair(dir.path(), &spec(arch, 11), 0.05);
        let config = config(dir.path(), GAMMA, "exact", MAX_TOKENS);
        let models = LoadedModels::load(&config).unwrap();
        let prompts = four_prompts_of_different_lengths();
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            // The reference decodes one sequence at a time.
            let plain = Engine::plain(&models, 1).await;
            let plain = common::answer_concurrently(&plain.mistralrs, &prompts, &config.sampling).await;
            let (mut partial, mut full) = (0, 0);
            for batch in 1..=prompts.len() {
                let engine = Engine::speculative(&models, SpeculativeSetup { gamma: GAMMA, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(4) })
                    .await
                    .unwrap();
                let rule = engine.rule.clone().unwrap();
                rule.record_steps();
                let verified = mistralrs_core::batched_speculative_verifies();
                let texts = common::answer_concurrently(&engine.mistralrs, &prompts[..batch], &config.sampling).await;
                engine.settle().await;
                let what = format!("{arch:?}, {batch} at once");
                assert_eq!(texts, plain[..batch], "{what}: batched draft-model decoding differs from plain decoding");
                if batch > 1 {
                    let batched = mistralrs_core::batched_speculative_verifies() - verified;
                    assert!(batched > 0, "{what}: no step drafted and verified several sequences at once");
                }
                for (i, s) in rule.recorded_steps().iter().enumerate().filter(|(_, s)| !s.finished) {
                    assert_eq!(s.target_cache_len, s.seq_len - 1, "{what}, step {i}: {s:?}");
                    let draft_len = if s.accepted == s.drafted { s.seq_len - 2 } else { s.seq_len - 1 };
                    assert_eq!(s.draft_cache_len, draft_len, "{what}, step {i}: {s:?}");
                    match s.accepted == s.drafted {
                        true => full += 1,
                        false => partial += 1,
                    }
                }
            }
            assert!(partial > 0 && full > 0, "{arch:?}: {partial} partial and {full} full acceptances");
        });
    }
}

#[test]
fn greedy_speculative_output_after_prefix_cache_hits_is_plain_output() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 11), 0.2);
    let prefix: Vec<usize> = (0..20).map(|i| (i * 5 + 1) % 56).collect();
    let prompts: Vec<String> = [[2, 7], [30, 1], [2, 9]]
        .iter()
        .map(|tail| words(&prefix.iter().chain(tail).copied().collect::<Vec<_>>()))
        .collect();
    let scheduling = Scheduling { max_seqs: 1, prefix_cache_bytes: Some(64 << 20), ragged_batches: true };
    let (plain, speculative) = decode_all_with(dir.path(), &prompts, MAX_TOKENS, scheduling);
    for (base, texts, steps) in speculative {
        // After a hit the draft model reads the whole prompt; the target only what follows
        // the cached prefix.
        assert_eq!(texts, plain, "{base:?} after prefix-cache hits");
        for (i, s) in steps.iter().enumerate().filter(|(_, s)| !s.finished) {
            assert_eq!(s.target_cache_len, s.seq_len - 1, "{base:?} step {i}: {s:?}");
        }
    }
}

/// Plain greedy words of a tiny target for `prompt` (EOS never met: it is `<|endoftext|>`).
fn plain_words(
    dir: &std::path::Path,
    s: &verdict::tiny_model::TinySpec,
    prompt: &str,
) -> Vec<usize> {
    write_tiny_model(s, dir).unwrap();
    let probe_config = verdict::Config::from_toml(&format!(
        "[models]\ntarget = {:?}\n[speculative]\nenabled = false\n[sampling]\nmax_tokens = 20\n",
        dir.to_str().unwrap()
    ))
    .unwrap();
    let probe = LoadedModels::load(&probe_config).unwrap();
    let text = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let plain = Engine::plain(&probe, 1).await;
        generate(
            &plain.mistralrs,
            &Prompt::Text(prompt.into()),
            &probe_config.sampling,
        )
        .await
        .unwrap()
        .text
    });
    text.split_whitespace().map_while(word_index).collect()
}

#[test]
fn eos_inside_the_drafts_ends_the_sequence_there() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = prompts()[0].clone();
    // Find a model whose greedy output meets a new word after a few others, and make that
    // word the EOS token.
    let (s, eos_position) = (20..60)
        .find_map(|seed| {
            let s = spec(TinyArch::Llama, seed);
            let words = plain_words(&dir.path().join(format!("probe{seed}")), &s, &prompt);
            // Steps emit γ + 1 tokens each when every draft is kept; position p % (γ + 1) = γ
            // would be a bonus token, not a draft.
            (5..words.len())
                .find(|&p| !words[..p].contains(&words[p]) && p % (GAMMA + 1) != GAMMA)
                .map(|p| {
                    let mut s = s;
                    s.eos_word = Some(words[p]);
                    (s, p)
                })
        })
        .expect("some seed gives a long enough greedy output");
    // Draft = target: every draft is kept, so the EOS arrives inside a run of drafts.
    tiny_pair(dir.path(), &s, 0.0);
    let (plain, speculative) = decode_all(dir.path(), &[prompt], MAX_TOKENS);
    assert_eq!(
        plain[0].split_whitespace().count(),
        eos_position,
        "plain decoding stops at the new EOS: {plain:?}"
    );
    for (base, texts, steps) in speculative {
        assert_eq!(texts, plain, "{base:?}");
        let last = steps.last().unwrap();
        assert!(last.finished, "{base:?}: {last:?}");
        assert!(
            last.accepted < last.drafted,
            "{base:?}: the EOS must cut the kept drafts short: {last:?}"
        );
    }
}

#[test]
fn draft_with_another_vocabulary_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 3);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let mut other = s.clone();
    other.words += 8;
    write_tiny_model(&other, &dir.path().join("draft")).unwrap();
    let err = LoadedModels::load(&config(dir.path(), GAMMA, "exact", 8))
        .err()
        .expect("must fail");
    let message = format!("{err:#}");
    assert!(
        message.contains("different vocabularies")
            && message.contains("draft")
            && message.contains("target"),
        "{message}"
    );
}

#[test]
fn missing_model_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = LoadedModels::load(&config(dir.path(), GAMMA, "exact", 8))
        .err()
        .expect("must fail");
    let message = format!("{err:#}");
    assert!(
        message.contains("models.target")
            && message.contains(dir.path().join("target").to_str().unwrap()),
        "{message}"
    );
}

#[test]
fn gamma_zero_is_refused_by_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Llama, 2), 0.1);
    let models = LoadedModels::load(&config(dir.path(), 1, "exact", 8)).unwrap();
    let err = tokio::runtime::Runtime::new().unwrap().block_on(async {
        Engine::speculative(&models, SpeculativeSetup { gamma: 0, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) })
        .await
        .err()
        .expect("must fail")
    });
    assert!(format!("{err:#}").contains("gamma >= 1"), "{err:#}");
}

/// A request that ends inside its prompt step (max_tokens ≤ γ + 1) takes no further step.
/// The engine used to mark every sequence running after its prompt step, finished or not; the
/// finished one then ran one more step whose KV writes landed in the target cache a plain
/// engine on the same models was decoding with (GSM8K test problem 22: nonsense from plain
/// decoding right after a PAD request of γ + 1 tokens).
#[test]
fn a_request_finished_in_its_prompt_step_takes_no_further_step() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 7), 0.0);
    let gamma = 4;
    let config = config(dir.path(), gamma, "exact", 3);
    let models = LoadedModels::load(&config).unwrap();
    let steps = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let engine = Engine::speculative(&models, SpeculativeSetup { gamma, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) })
        .await
        .unwrap();
        let rule = engine.rule.clone().unwrap();
        rule.record_steps();
        for p in prompts() {
            let out = generate(&engine.mistralrs, &Prompt::Text(p), &config.sampling)
                .await
                .unwrap();
            assert_eq!(out.completion_tokens, 3, "{out:?}");
            engine.settle().await;
        }
        // Room for a step that should not happen.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        engine.settle().await;
        rule.recorded_steps()
    });
    let mut seqs: Vec<usize> = steps.iter().map(|s| s.seq_id).collect();
    seqs.dedup();
    assert_eq!(seqs.len(), prompts().len(), "{steps:?}");
    for seq in seqs {
        let its: Vec<_> = steps.iter().filter(|s| s.seq_id == seq).collect();
        assert!(
            its.len() == 1 && its[0].finished,
            "sequence {seq} took {} steps after its prompt: {its:?}",
            its.len() - 1
        );
    }
}

/// The draft model under SV (`[sv]` with the draft model drafting): every greedy answer is
/// plain decoding's, alone and four at a time (each sequence then steps on its own). With
/// a verify so dear that a draft forward is nothing beside it, and rows free, every step
/// drafts γ; with each row as dear as a forward no draft pays,
/// so no step verifies a draft (the draft model is read only to score a first draft, on a
/// sequence's first step and on a probe every few steps) and each decodes one token.
#[test]
fn the_draft_model_under_sv_answers_as_plain_decoding_and_drafts_what_pays() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 11), 0.05);
    let base = config(dir.path(), GAMMA, "exact", MAX_TOKENS);
    let with_rows = |verify_ms: &str| {
        let mut config = verdict::Config::from_toml(&format!(
            "[models]\ntarget = {:?}\ndraft = {:?}\n[speculative]\ngamma = {GAMMA}\n[sampling]\ntemperature = 0.0\nmax_tokens = {MAX_TOKENS}\n[sv]\nenabled = true\nlearn_verify_ms = false\nverify_ms = {verify_ms}\n",
            dir.path().join("target").to_str().unwrap(),
            dir.path().join("draft").to_str().unwrap(),
        ))
        .unwrap();
        config.sampling = base.sampling.clone();
        config
    };
    let models = LoadedModels::load(&base).unwrap();
    let prompts = four_prompts_of_different_lengths();
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let plain = Engine::plain(&models, 1).await;
        let plain = common::answer_concurrently(&plain.mistralrs, &prompts, &base.sampling).await;
        for (rows, free) in [("[[1, 1000000.0], [9, 1000000.0]]", true), ("[[1, 10.0], [9, 90.0]]", false)] {
            let config = with_rows(rows);
            let policy = models.draft_model_policy(&config, &config.eagle_drafting()).unwrap().expect("[sv] is on");
            let engine = Engine::speculative_under(&models, policy.clone(), SpeculativeSetup { gamma: GAMMA, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(4) })
                .await
                .unwrap();
            let rule = engine.rule.clone().unwrap();
            rule.record_steps();
            let mut alone = Vec::new();
            for p in &prompts {
                alone.push(generate(&engine.mistralrs, &Prompt::Text(p.clone()), &config.sampling).await.unwrap().text);
                engine.settle().await;
            }
            let together = common::answer_concurrently(&engine.mistralrs, &prompts, &config.sampling).await;
            engine.settle().await;
            assert_eq!(alone, plain, "rows free: {free}: one at a time");
            assert_eq!(together, plain, "rows free: {free}: four at a time");
            let steps: Vec<_> = rule.recorded_steps().into_iter().filter(|s| !s.finished).collect();
            let drafted: usize = steps.iter().map(|s| s.drafted).sum();
            match free {
                true => assert!(steps.iter().all(|s| s.drafted == GAMMA), "free rows: every step drafts γ: {steps:?}"),
                false => assert_eq!(drafted, 0, "dear rows: no draft pays"),
            }
            assert!(steps.iter().all(|s| s.target_cache_len == s.seq_len - 1), "{steps:?}");
            assert_eq!(policy.live_sequences(), 0, "finished sequences are released");
        }
    });
}
