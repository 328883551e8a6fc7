//! The proposer hook of the patched pipeline on tiny generated targets: drafts from an EAGLE-3
//! head (no draft model loaded) or from a scripted proposer; greedy lossless output is the
//! plain target's token for token, and the target's and proposer's caches hold every
//! committed position but the last after each step.

mod common;

use std::{
    collections::{BTreeSet, HashMap},
    path::Path,
    sync::Arc,
};

use common::{
    prompts,
    scripted::{plain_runs, scripted},
    spec,
};
use mistralrs_core::speculative_hook::{Proposer, StepReport};
use verdict::{
    config::Config,
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    tiny_model::{words, write_tiny_eagle3_head, write_tiny_model, TinyArch, FIRST_WORD_ID},
};

const MAX_TOKENS: usize = 40;

fn eagle_config(dir: &Path, gamma: usize) -> Config {
    eagle_config_with(dir, gamma, "f32")
}

fn eagle_config_with(dir: &Path, gamma: usize, weights: &str) -> Config {
    Config::from_toml(&eagle_toml(dir, gamma, weights)).unwrap()
}

fn eagle_toml(dir: &Path, gamma: usize, weights: &str) -> String {
    format!(
        "[models]\ntarget = {:?}\n[speculative]\nproposer = \"eagle\"\neagle_head = {:?}\neagle_weights = {weights:?}\ngamma = {gamma}\n[sampling]\ntemperature = 0.0\nmax_tokens = {MAX_TOKENS}\n",
        dir.join("target").to_str().unwrap(),
        dir.join("head").to_str().unwrap(),
    )
}

fn many_prompts() -> Vec<String> {
    let mut all = prompts();
    all.extend((0..9).map(|i| words(&[i * 5 % 56, (i * 11 + 3) % 56, 20 + i])));
    all
}

/// Texts and step reports of speculative decoding with `proposer`, for each lossless rule.
fn speculative_texts(
    models: &LoadedModels,
    config: &Config,
    proposer: impl Fn() -> Arc<dyn Proposer>,
    prompts: &[String],
) -> Vec<(BaseRule, Vec<String>, Vec<StepReport>)> {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut all = Vec::new();
        for base in [BaseRule::Exact, BaseRule::Rejection] {
            let engine = Engine::with_proposer(models, proposer(), SpeculativeSetup { gamma: config.speculative.gamma, stack: JudgeStack::lossless(base), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) })
            .await
            .unwrap();
            let rule = engine.rule.clone().unwrap();
            rule.record_steps();
            let mut texts = Vec::new();
            for p in prompts {
                let g = generate(&engine.mistralrs, &Prompt::Text(p.clone()), &config.sampling)
                    .await
                    .unwrap();
                engine.settle().await;
                texts.push(g.text);
            }
            all.push((base, texts, rule.recorded_steps()));
        }
        all
    })
}

/// After every unfinished step both caches hold the committed tokens but the newest, which
/// the next verify forward feeds.
fn assert_cache_lengths(base: BaseRule, steps: &[StepReport]) {
    for (i, s) in steps.iter().enumerate().filter(|(_, s)| !s.finished) {
        assert_eq!(s.target_cache_len, s.seq_len - 1, "{base:?} step {i}: {s:?}");
        assert_eq!(s.draft_cache_len, s.seq_len - 1, "{base:?} step {i}: {s:?}");
        assert_eq!(s.emitted, s.accepted + 1, "{base:?} step {i}: {s:?}");
    }
    // A finished sequence's proposer state is dropped.
    for (i, s) in steps.iter().enumerate().filter(|(_, s)| s.finished) {
        assert_eq!(s.draft_cache_len, 0, "{base:?} step {i}: {s:?}");
    }
}

fn outcomes(steps: &[StepReport]) -> (usize, usize) {
    let drafting = steps.iter().filter(|s| s.drafted > 0 && !s.finished);
    let (partial, full): (Vec<_>, Vec<_>) = drafting.partition(|s| s.accepted < s.drafted);
    (partial.len(), full.len())
}

/// A random EAGLE-3 head whose draft vocabulary is the 4 tokens the target writes most in
/// `plain`, so that its drafts are sometimes right.
fn write_frequent_tokens_head(s: &verdict::tiny_model::TinySpec, dir: &Path, plain: &[common::scripted::PlainRun]) {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for run in plain {
        for &id in &run.ids {
            *counts.entry(id).or_default() += 1;
        }
    }
    let mut by_count: Vec<(u32, usize)> = counts.into_iter().collect();
    by_count.sort_by_key(|&(id, n)| (std::cmp::Reverse(n), id));
    let mut draft_vocab: Vec<u32> = by_count.iter().take(4).map(|&(id, _)| id).collect();
    draft_vocab.sort();
    write_tiny_eagle3_head(s, dir, &draft_vocab, [1, 2, 2], 7).unwrap();
}

#[test]
fn greedy_lossless_with_a_random_eagle_head_is_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Llama, 11);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let config = eagle_config(dir.path(), 1);
    let models = LoadedModels::load(&config).unwrap();
    assert!(models.draft.is_none(), "an EAGLE head needs no draft model");
    let prompts = many_prompts();
    let plain = plain_runs(&models, &config, &prompts);
    write_frequent_tokens_head(&s, &dir.path().join("head"), &plain);
    let plain: Vec<String> = plain.into_iter().map(|r| r.text).collect();

    // γ = 1 keeps or refuses the one draft (a random head rarely gets two right in a row);
    // γ = 3 drafts from the head's own outputs past the committed positions, also with the
    // head's matrices in 8-bit blocks.
    for (gamma, weights) in [(1, "f32"), (3, "f32"), (3, "q8_0")] {
        let config = eagle_config_with(dir.path(), gamma, weights);
        let proposer = models.eagle_proposer(&config).unwrap();
        let runs = speculative_texts(&models, &config, || proposer.clone(), &prompts);
        for (base, texts, steps) in runs {
            assert_eq!(texts, plain, "{base:?}, γ {gamma}, {weights}: the EAGLE head's output differs from plain decoding");
            assert_cache_lengths(base, &steps);
            assert_eq!(proposer.live_sequences(), 0, "finished sequences left drafting state behind");
            if gamma == 1 {
                let (partial, full) = outcomes(&steps);
                assert!(partial > 0 && full > 0, "{base:?}: {partial} refused and {full} kept drafts");
            }
        }
    }
    // A confidence cut: steps draft 1 to γ tokens, and the output is still plain decoding's.
    let mut config = eagle_config(dir.path(), 3);
    config.speculative.eagle_min_confidence = 0.4;
    let proposer = models.eagle_proposer(&config).unwrap();
    for (base, texts, steps) in speculative_texts(&models, &config, || proposer.clone(), &prompts) {
        assert_eq!(texts, plain, "{base:?} with a confidence cut");
        assert_cache_lengths(base, &steps);
        let drafted: Vec<usize> = steps.iter().filter(|s| s.drafted > 0).map(|s| s.drafted).collect();
        assert!(
            drafted.iter().any(|&d| d < 3) && drafted.iter().all(|&d| d <= 3),
            "{base:?}: drafts per step {drafted:?}"
        );
    }
    // Unsure first drafts skipped: those steps decode one token, and the output is still
    // plain decoding's.
    let mut config = eagle_config(dir.path(), 3);
    config.speculative.eagle_min_first_confidence = 0.5;
    let proposer = models.eagle_proposer(&config).unwrap();
    for (base, texts, steps) in speculative_texts(&models, &config, || proposer.clone(), &prompts) {
        assert_eq!(texts, plain, "{base:?} skipping unsure first drafts");
        assert_cache_lengths(base, &steps);
        let skipped = steps.iter().filter(|s| s.drafted == 0).count();
        assert!(
            skipped > prompts.len() && steps.iter().any(|s| s.drafted > 0),
            "{base:?}: {skipped} steps without drafts ({} prompts)",
            prompts.len()
        );
    }
    // The tiny head's rows (32 wide) are not whole 256-value blocks of Q4_K.
    let err = format!("{:#}", models.eagle_proposer(&eagle_config_with(dir.path(), 3, "q4k")).err().unwrap());
    assert!(err.contains("eagle_weights = \"q4k\"") && err.contains("256"), "{err}");
}

/// Greedy answers of `prompts` sent at once to an EAGLE engine that runs up to 4 sequences
/// together, with the rule's step reports.
fn concurrent_texts(
    models: &LoadedModels,
    config: &Config,
    proposer: Arc<dyn Proposer>,
    prompts: &[String],
) -> (Vec<String>, Vec<StepReport>) {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let engine = Engine::with_proposer(models, proposer, SpeculativeSetup { gamma: config.speculative.gamma, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(4) })
        .await
        .unwrap();
        let rule = engine.rule.clone().unwrap();
        rule.record_steps();
        let texts = common::answer_concurrently(&engine.mistralrs, prompts, &config.sampling).await;
        engine.settle().await;
        (texts, rule.recorded_steps())
    })
}

/// Sequences decoded together by an EAGLE engine are verified in one target forward per
/// step (the patched batched speculative step): rows of different KV lengths, each with its own number of
/// drafts (a confidence cut drafts 1 to γ; skipped first drafts give none), each judged
/// and cut back on its own, its rows packed with the other sequences' or padded. Every
/// answer equals the plain target's, and after every step
/// each sequence's target row and head cache hold its committed tokens but the newest.
#[test]
fn batched_eagle_steps_answer_each_sequence_as_plain_decoding() {
    for arch in [TinyArch::Qwen2, TinyArch::Llama] {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(arch, 11);
        write_tiny_model(&s, &dir.path().join("target")).unwrap();
        let config = eagle_config(dir.path(), 3);
        let models = LoadedModels::load(&config).unwrap();
        // 2 to 9 prompt tokens: the rows start at different KV lengths (Llama answers the
        // last in one token).
        let prompts: Vec<String> = [&[9, 30, 7, 5, 3][..], &[22, 6, 14, 40, 8, 11, 2, 19, 33], &[4, 17, 50], &[1, 2]]
            .iter()
            .map(|ids| words(ids))
            .collect();
        let plain = plain_runs(&models, &config, &prompts);
        write_frequent_tokens_head(&s, &dir.path().join("head"), &plain);
        let plain: Vec<String> = plain.into_iter().map(|r| r.text).collect();
        // SV's schedule with a verify row as dear as a whole forward: no draft pays for its
        // row, so batched steps verify none and a sequence alone drafts none.
        let sv = "[sv]\nenabled = true\nverify_ms = [[1, 10.0], [2, 20.0]]\n";
        // SV with T_v learned from these steps' own times: whatever it then verifies, the
        // answers stay plain decoding's.
        let learned = "[sv]\nenabled = true\n";
        // Packed: the target's MLPs and LM head run on each sequence's own rows (mistral.rs
        // 0022); padded: every sequence's rows padded to the widest, as before.
        let runs = [(0.4, 0.0, "", true), (0.0, 0.5, "", true), (0.0, 0.0, sv, true), (0.4, 0.0, "", false), (0.0, 0.0, learned, true)];
        for (min_confidence, min_first_confidence, sv_toml, packed) in runs {
            let (dear_rows, learns) = (sv_toml == sv, sv_toml == learned);
            let mut config = Config::from_toml(&format!("{}{sv_toml}", eagle_toml(dir.path(), 3, "f32"))).unwrap();
            config.speculative.eagle_min_confidence = min_confidence;
            config.speculative.eagle_min_first_confidence = min_first_confidence;
            config.speculative.packed_verify_rows = packed;
            let proposer = models.eagle_proposer(&config).unwrap();
            let mut drafted = BTreeSet::new();
            let packed_before = mistralrs_core::packed_speculative_verifies();
            for batch in 1..=prompts.len() {
                let verified = mistralrs_core::batched_speculative_verifies();
                let head_batched = proposer.proposer().batched_calls();
                let (texts, steps) = concurrent_texts(&models, &config, proposer.clone(), &prompts[..batch]);
                let what = format!("{arch:?}, {batch} at once, cut {min_confidence}/{min_first_confidence} {sv_toml}, packed {packed}");
                if dear_rows && batch > 1 {
                    let undrafted = steps.iter().filter(|s| s.drafted == 0).count();
                    assert!(undrafted > 2 * batch, "{what}: {undrafted} steps verified no draft");
                }
                if dear_rows && batch == 1 {
                    assert!(steps.iter().all(|s| s.drafted == 0), "{what}: a sequence alone drafted what no row pays for");
                }
                assert_eq!(texts, plain[..batch], "{what}: batched EAGLE decoding differs from plain decoding");
                assert_cache_lengths(BaseRule::Exact, &steps);
                assert_eq!(proposer.live_sequences(), 0, "{what}: finished sequences left policy state behind");
                assert_eq!(proposer.proposer().live_sequences(), 0, "{what}: finished sequences left drafting state behind");
                let batched = mistralrs_core::batched_speculative_verifies() - verified;
                if batch > 1 {
                    assert!(batched > 0, "{what}: no step verified several sequences at once");
                    // The pipeline reaches the head's batched calls through the metrics wrapper.
                    assert!(proposer.proposer().batched_calls() > head_batched, "{what}: the head never drafted for several sequences at once");
                }
                drafted.extend(steps.iter().filter(|s| !s.finished).map(|s| s.drafted));
            }
            if sv_toml.is_empty() {
                assert!(drafted.len() > 1, "{arch:?}: every step drafted {drafted:?} tokens");
            }
            if learns {
                let seen = proposer.learned_latency().expect("learning T_v").row_counts_seen();
                assert!(!seen.is_empty(), "{arch:?}: no verified step was timed");
            }
            if packed && min_confidence > 0.0 {
                // Drafts of different lengths in one verify: some forwards ran packed. (The
                // count is the process's: another test's packed verifies could hide a miss
                // here, not fail it.)
                let packed_verifies = mistralrs_core::packed_speculative_verifies() - packed_before;
                assert!(packed_verifies > 0, "{arch:?}: no batched verify fed only each sequence's own rows");
            }
        }
    }
}

/// Prompts that share a long prefix (a system prompt, few-shot examples) and differ after it.
fn prompts_sharing_a_prefix() -> Vec<String> {
    let prefix: Vec<usize> = (0..24).map(|i| (i * 7 + 2) % 56).collect();
    [[3, 9], [41, 5], [3, 12], [17, 17]]
        .iter()
        .map(|tail| words(&prefix.iter().chain(tail).copied().collect::<Vec<_>>()))
        .collect()
}

#[test]
fn prefix_cache_hits_restore_the_heads_rows_and_stay_under_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Llama, 11);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    write_tiny_eagle3_head(&s, &dir.path().join("head"), &[8, 9, 10, 11], [1, 2, 2], 7).unwrap();
    let config = eagle_config(dir.path(), 3);
    let models = LoadedModels::load(&config).unwrap();
    let mut prompts = prompts_sharing_a_prefix();
    // A prompt asked again is cached whole: all but its last token is reused.
    prompts.push(prompts[3].clone());
    let plain: Vec<String> = plain_runs(&models, &config, &prompts).into_iter().map(|r| r.text).collect();
    assert_eq!(mistralrs_core::cpu_prefix_cache_bytes(), 0, "engines without a prefix cache keep nothing");

    let proposer = models.eagle_proposer(&config).unwrap();
    let scheduling = Scheduling { max_seqs: 1, prefix_cache_bytes: Some(64 << 20), ragged_batches: true };
    let (texts, steps, held, restored) = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let engine = Engine::with_proposer(&models, proposer.clone(), SpeculativeSetup { gamma: 3, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: Arc::new(Metrics::default()), scheduling })
        .await
        .unwrap();
        let rule = engine.rule.clone().unwrap();
        rule.record_steps();
        let (mut texts, mut held, mut restored) = (Vec::new(), Vec::new(), Vec::new());
        for (i, p) in prompts.iter().enumerate() {
            texts.push(generate(&engine.mistralrs, &Prompt::Text(p.clone()), &config.sampling).await.unwrap().text);
            engine.settle().await;
            held.push(mistralrs_core::cpu_prefix_cache_bytes());
            restored.push(proposer.proposer().restored_rows());
            if i == 0 {
                // Room for one entry and a half: each later request evicts the one before.
                mistralrs_core::set_cpu_prefix_cache_limit(Some(held[0] * 3 / 2));
            }
        }
        (texts, rule.recorded_steps(), held, restored)
    });
    mistralrs_core::set_cpu_prefix_cache_limit(None);
    assert_eq!(texts, plain, "greedy EAGLE decoding after prefix-cache hits differs from plain decoding");
    assert_cache_lengths(BaseRule::Exact, &steps);
    // Every request after the first restored the head's rows of the shared prefix (most of
    // the 24 shared words: the target's hit ends where the tokens part, and it redoes the
    // last cached position for the head).
    for i in 1..4 {
        assert!(restored[i] - restored[i - 1] >= 20, "request {i}: head rows restored after each {restored:?}");
    }
    // The repeat reuses more than the shared prefix: every token but the last two (the one
    // the target recomputes for logits and the one it redoes for the head).
    assert!(
        restored[4] - restored[3] > restored[3] - restored[2],
        "the repeated prompt: head rows restored after each {restored:?}"
    );
    assert!(held[0] > 0, "the finished request's cache was not kept");
    for (i, &bytes) in held.iter().enumerate().skip(1) {
        assert!(bytes > 0 && bytes <= held[0] * 3 / 2, "request {i}: {bytes} bytes held, bound {}", held[0] * 3 / 2);
    }
}

#[test]
fn a_proposer_step_keeps_both_caches_at_the_committed_length() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 5);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let config = eagle_config(dir.path(), 3);
    let models = LoadedModels::load(&config).unwrap();
    let prompts = prompts();
    let plain = plain_runs(&models, &config, &prompts);
    let runs = speculative_texts(&models, &config, || scripted(&plain, &s, Some(3)), &prompts);
    let plain: Vec<String> = plain.into_iter().map(|r| r.text).collect();
    for (base, texts, steps) in runs {
        assert_eq!(texts, plain, "{base:?}");
        assert_cache_lengths(base, &steps);
        // The prompt step drafts nothing; every sequence has exactly one.
        assert_eq!(steps.iter().filter(|s| s.drafted == 0).count(), prompts.len(), "{base:?}");
        let (partial, full) = outcomes(&steps);
        assert!(partial > 0 && full > 0, "{base:?}: {partial} partial and {full} full acceptances");
    }
}

#[test]
fn an_eos_among_a_proposers_drafts_ends_the_sequence_there() {
    const GAMMA: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let prompt = prompts()[0].clone();
    // A target whose greedy output meets a new word at a position a kept draft fills (the
    // prompt step emits 1 token, then each step γ drafts and a bonus token); that word
    // becomes the EOS.
    let (s, eos_position) = (20..60)
        .find_map(|seed| {
            let probe = dir.path().join(format!("probe{seed}"));
            let s = spec(TinyArch::Llama, seed);
            write_tiny_model(&s, &probe.join("target")).unwrap();
            let config = eagle_config(&probe, GAMMA);
            let models = LoadedModels::load(&config).unwrap();
            let ids = plain_runs(&models, &config, std::slice::from_ref(&prompt)).remove(0).ids;
            (5..ids.len())
                .find(|&p| {
                    ids[p] as usize >= FIRST_WORD_ID && !ids[..p].contains(&ids[p]) && (p - 1) % (GAMMA + 1) != GAMMA
                })
                .map(|p| {
                    let mut s = s;
                    s.eos_word = Some(ids[p] as usize - FIRST_WORD_ID);
                    (s, p)
                })
        })
        .expect("some seed gives a long enough greedy output");
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let config = eagle_config(dir.path(), GAMMA);
    let models = LoadedModels::load(&config).unwrap();
    let plain = plain_runs(&models, &config, std::slice::from_ref(&prompt));
    assert!(plain[0].stopped, "plain decoding stops at the new EOS: {:?}", plain[0].text);
    assert_eq!(plain[0].ids[..eos_position].len(), eos_position);
    assert!(plain[0].ids.len() <= eos_position + 1, "{:?}", plain[0].ids);
    let runs = speculative_texts(&models, &config, || scripted(&plain, &s, None), &[prompt]);
    for (base, texts, steps) in runs {
        assert_eq!(texts[0], plain[0].text, "{base:?}");
        assert_cache_lengths(base, &steps);
        let last = steps.last().unwrap();
        assert!(last.finished, "{base:?}: {last:?}");
        assert!(last.accepted < last.drafted, "{base:?}: the EOS must cut the kept drafts short: {last:?}");
    }
}

#[test]
fn a_head_for_another_target_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Llama, 3);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let mut wider = s.clone();
    wider.hidden_size = 48;
    wider.intermediate_size = 64;
    write_tiny_eagle3_head(&wider, &dir.path().join("head"), &[8, 9, 10], [1, 2, 2], 1).unwrap();
    let config = eagle_config(dir.path(), 2);
    let models = LoadedModels::load(&config).unwrap();
    let err = format!("{:#}", models.eagle_proposer(&config).err().unwrap());
    assert!(err.contains("hidden size 48") && err.contains("hidden size 32"), "{err}");
}

#[test]
fn a_judge_reading_draft_model_states_is_refused_with_eagle_drafts() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Llama, 3);
    common::tiny_pair(dir.path(), &s, 0.2);
    write_tiny_eagle3_head(&s, &dir.path().join("head"), &[8, 9, 10], [1, 2, 2], 1).unwrap();
    let base = format!(
        "[models]\ntarget = {:?}\ndraft = {:?}\n[speculative]\nproposer = \"eagle\"\neagle_head = {:?}\n",
        dir.path().join("target").to_str().unwrap(),
        dir.path().join("draft").to_str().unwrap(),
        dir.path().join("head").to_str().unwrap(),
    );
    let models = LoadedModels::load_with_draft(&Config::from_toml(&base).unwrap(), true).unwrap();
    let head = verdict_heads::LogisticHead::constant(
        verdict_heads::FeatureSpec::DraftAndTarget,
        models.target_fingerprint.clone(),
        models.draft_fingerprint.clone(),
        0.5,
    );
    let head_path = dir.path().join("autojudge.safetensors");
    head.save(&head_path).unwrap();
    let config = Config::from_toml(&format!(
        "{base}[[judge]]\nkind = \"autojudge\"\nhead = {:?}\n",
        head_path.to_str().unwrap()
    ))
    .unwrap();
    let stack = models.configured_stack(&config).unwrap();
    let proposer = models.eagle_proposer(&config).unwrap();
    let err = tokio::runtime::Runtime::new().unwrap().block_on(async {
        Engine::with_proposer(&models, proposer, SpeculativeSetup { gamma: 2, stack, seed: 0, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) })
            .await
            .err()
            .unwrap()
    });
    let err = format!("{err:#}");
    assert!(err.contains("autojudge") && err.contains("draft model's hidden states"), "{err}");
}

/// Prompts that repeat themselves, so that prompt lookup finds matches from the first step.
fn repeating_prompts() -> Vec<String> {
    [&[3, 8, 15, 3, 8, 15, 3, 8][..], &[21, 4, 21, 4, 21, 4, 9], &[40, 41, 42, 43, 40, 41, 42], &[5, 6, 7]]
        .iter()
        .map(|ids| words(ids))
        .collect()
}

/// Prompt lookup drafts point masses from the text so far, alone or sharing steps with an
/// EAGLE head, with SV or without: greedy answers are plain decoding's under both lossless
/// rules, one sequence at a time and several verified together, and no sequence's state
/// outlives it.
#[test]
fn greedy_lossless_with_prompt_lookup_alone_or_with_the_head_is_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 11);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let config = eagle_config(dir.path(), 3);
    let models = LoadedModels::load(&config).unwrap();
    let mut prompts = repeating_prompts();
    prompts.extend(many_prompts());
    let plain = plain_runs(&models, &config, &prompts);
    write_frequent_tokens_head(&s, &dir.path().join("head"), &plain);
    let plain: Vec<String> = plain.into_iter().map(|r| r.text).collect();

    let lookup_toml = eagle_toml(dir.path(), 3, "f32").replace("proposer = \"eagle\"", "proposer = \"ngram\"");
    let mut lookup_config = Config::from_toml(&lookup_toml).unwrap();
    lookup_config.speculative.ngram_min = 1;
    lookup_config.speculative.ngram_max = 3;
    let lookup = models.ngram_proposer(&lookup_config).unwrap();
    for (base, texts, steps) in speculative_texts(&models, &lookup_config, || lookup.clone(), &prompts) {
        assert_eq!(texts, plain, "{base:?}: prompt lookup's output differs from plain decoding");
        let (partial, full) = outcomes(&steps);
        assert!(partial > 0 && full > 0, "{base:?}: {partial} refused and {full} kept lookup proposals");
        assert_eq!(lookup.live_sequences(), 0, "finished sequences left lookup state behind");
        assert_eq!(lookup.proposer().live_sequences(), 0, "finished sequences left lookup state behind");
    }
    assert!(lookup.proposer().keep_rates().rate(3) != 0.5, "no lookup draft's fate was learned");

    // SV over prompt lookup, a verify row as dear as a whole forward: a sequence alone drafts
    // nothing, and a batch verifies nothing, since no draft pays for its row.
    let mut dear_rows = Config::from_toml(&format!("{lookup_toml}[sv]\nenabled = true\nverify_ms = [[1, 10.0], [2, 20.0]]\n")).unwrap();
    dear_rows.speculative = lookup_config.speculative.clone();
    let lookup_sv = models.ngram_proposer(&dear_rows).unwrap();
    assert!(lookup_sv.has_budget());
    for (base, texts, steps) in speculative_texts(&models, &dear_rows, || lookup_sv.clone(), &prompts[..4]) {
        assert_eq!(texts, plain[..4], "{base:?}: prompt lookup under SV differs from plain decoding");
        assert!(steps.iter().all(|s| s.drafted == 0), "{base:?}: a sequence alone drafted what no row pays for");
    }
    let (texts, steps) = concurrent_texts(&models, &dear_rows, lookup_sv.clone(), &prompts[..4]);
    assert_eq!(texts, plain[..4], "prompt lookup under SV, 4 sequences at once, differs from plain decoding");
    assert_eq!(steps.iter().map(|s| s.accepted).sum::<usize>(), 0, "a batch verified drafts no row pays for");
    assert_eq!(lookup_sv.live_sequences(), 0);

    let drafting = lookup_config.eagle_drafting();
    let head = models.eagle_head(&lookup_config, None, &drafting).unwrap();
    let combined = models.combined_proposer(&lookup_config, head.clone(), 3, &drafting).unwrap();
    for (base, texts, _) in speculative_texts(&models, &lookup_config, || combined.clone(), &prompts) {
        assert_eq!(texts, plain, "{base:?}: lookup with the head differs from plain decoding");
    }
    let choices = combined.proposer().choices();
    assert!(choices.lookup > 0 && choices.head > 0, "the combined proposer never took one of its proposals: {choices:?}");
    let (texts, steps) = concurrent_texts(&models, &lookup_config, combined.clone(), &prompts[..4]);
    assert_eq!(texts, plain[..4], "lookup with the head, 4 sequences at once, differs from plain decoding");
    assert_cache_lengths(BaseRule::Exact, &steps);
    assert_eq!(head.live_sequences(), 0, "finished sequences left head state behind");
    assert_eq!(combined.live_sequences(), 0, "finished sequences left policy state behind");
}

/// Tokens 1–3 of `runs` answers to `prompt` sampled by `engine`'s target at the config's
/// temperature, by position (`None`: the answer ended before).
fn sampled_positions(engine: &Engine, config: &Config, prompt: &str, runs: usize) -> Vec<[Option<String>; 3]> {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let mut out = Vec::with_capacity(runs);
        for _ in 0..runs {
            let g = generate(&engine.mistralrs, &Prompt::Text(prompt.to_string()), &config.sampling).await.unwrap();
            engine.settle().await;
            let mut words = g.text.split_whitespace().map(str::to_string);
            out.push([words.next(), words.next(), words.next()]);
        }
        out
    })
}

/// Pearson's χ² of two equally sized samples' counts at one position, categories seen fewer
/// than 10 times together pooled into one; returns (χ², degrees of freedom).
fn chi_square_two_samples(a: &[[Option<String>; 3]], b: &[[Option<String>; 3]], position: usize) -> (f64, usize) {
    let mut counts: std::collections::BTreeMap<Option<String>, (f64, f64)> = Default::default();
    for x in a {
        counts.entry(x[position].clone()).or_default().0 += 1.0;
    }
    for x in b {
        counts.entry(x[position].clone()).or_default().1 += 1.0;
    }
    let (mut rare, mut cells) = ((0.0, 0.0), Vec::new());
    for (_, (x, y)) in counts {
        if x + y < 10.0 {
            rare = (rare.0 + x, rare.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cells.push(rare);
    }
    let chi2 = cells.iter().map(|(x, y)| (x - y) * (x - y) / (x + y)).sum();
    (chi2, cells.len().saturating_sub(1))
}

/// χ² critical value at p = 1e-4 (Wilson–Hilferty): a lossless rule fails once in 10,000
/// runs per position.
fn chi_square_critical(df: usize) -> f64 {
    let (df, z) = (df.max(1) as f64, 3.719);
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

/// Sampling through the whole pipeline: tokens 1–3 drawn with `rejection` and γ EAGLE drafts
/// (a head whose 4-token draft vocabulary leaves q = 0 on every other token) are distributed
/// as plain sampling's, position by position (`runs` samples a side); a lossy stack that keeps
/// every draft is told apart by the same test. `sampling` replaces the config's greedy line.
/// `first_df` is how many categories less one token 1 must show: it comes from the prompt's
/// forward, a plain sample that is sharp at low temperature, so only the caller knows.
fn rejection_samples_the_targets_distribution(gamma: usize, sampling: &str, runs: usize, first_df: usize) {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 11);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let greedy = eagle_config(dir.path(), 3);
    let models = LoadedModels::load(&greedy).unwrap();
    let plain = plain_runs(&models, &greedy, &many_prompts());
    write_frequent_tokens_head(&s, &dir.path().join("head"), &plain);
    let toml = eagle_toml(dir.path(), gamma, "f32")
        .replace(&format!("gamma = {gamma}\n"), &format!("gamma = {gamma}\nbase_rule = \"rejection\"\n"))
        .replace("temperature = 0.0", sampling)
        .replace(&format!("max_tokens = {MAX_TOKENS}"), "max_tokens = 3");
    let config = Config::from_toml(&toml).unwrap();
    let prompt = words(&[9, 30, 7]);
    let plain_engine = tokio::runtime::Runtime::new().unwrap().block_on(Engine::plain(&models, 1));
    let reference = sampled_positions(&plain_engine, &config, &prompt, runs);
    let speculative = |stack: JudgeStack| {
        let engine = tokio::runtime::Runtime::new().unwrap().block_on(async {
            Engine::with_proposer(&models, models.eagle_proposer(&config).unwrap(), SpeculativeSetup { gamma, stack, seed: 5, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) }).await.unwrap()
        });
        sampled_positions(&engine, &config, &prompt, runs)
    };
    let lossless = speculative(JudgeStack::lossless(BaseRule::Rejection));
    for position in 0..3 {
        let (chi2, df) = chi_square_two_samples(&reference, &lossless, position);
        let least_df = if position == 0 { first_df } else { 3 };
        assert!(df >= least_df, "position {}: too few categories ({df}) for the test to mean anything", position + 1);
        assert!(chi2 < chi_square_critical(df), "position {}: χ² {chi2:.1} on {df} degrees of freedom against plain sampling", position + 1);
    }
    // FSD replacing the base rule with a divergence bound no pair exceeds keeps every draft:
    // tokens 2–3 then come from the head's 4 tokens, and the test sees it.
    let keeps_all = Config::from_toml(&format!("{}[[judge]]\nkind = \"fsd\"\ndivergence = \"kl-draft-target\"\nthreshold = 1000.0\nmode = \"replace\"\n", toml)).unwrap();
    let lossy = speculative(models.configured_stack(&keeps_all).unwrap());
    let (chi2, df) = chi_square_two_samples(&reference, &lossy, 1);
    assert!(chi2 > chi_square_critical(df), "a stack keeping every draft passed as lossless: χ² {chi2:.1} on {df}");
}

#[test]
fn rejection_with_eagle_drafts_samples_the_targets_distribution_through_the_pipeline() {
    rejection_samples_the_targets_distribution(2, "temperature = 1.0", 1500, 3);
}

/// As the evaluation samples: temperature 0.7, top-p 0.95, four drafts a step.
#[test]
fn rejection_under_top_p_with_four_drafts_samples_the_targets_distribution() {
    rejection_samples_the_targets_distribution(4, "temperature = 0.7\ntop_p = 0.95", 3000, 0);
}

#[test]
fn log_probabilities_of_verified_tokens_are_plain_decodings() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 11);
    write_tiny_model(&s, &dir.path().join("target")).unwrap();
    let mut config = Config::from_toml(&eagle_toml(dir.path(), 3, "f32").replace("proposer = \"eagle\"", "proposer = \"ngram\"")).unwrap();
    config.speculative.ngram_min = 1;
    config.speculative.ngram_max = 3;
    let models = LoadedModels::load(&config).unwrap();
    let metrics = Arc::new(Metrics::default());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (plain, speculative) = runtime.block_on(async {
        let plain = Engine::plain(&models, 1).await;
        let lookup = models.ngram_proposer(&config).unwrap();
        let speculative = Engine::with_proposer(&models, lookup, SpeculativeSetup { gamma: 3, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: metrics.clone(), scheduling: Scheduling::from(1) }).await.unwrap();
        (plain, speculative)
    });
    for prompt in &repeating_prompts()[..3] {
        let prompt = Prompt::Chat(prompt.clone());
        let [a, b] = [&plain, &speculative].map(|engine| {
            runtime.block_on(verdict::engine::generate_with_top_tokens(&engine.mistralrs, &prompt, &config.sampling, 3)).unwrap()
        });
        assert_eq!(a.text, b.text);
        assert_eq!(a.top_tokens.len(), b.top_tokens.len());
        for (position, ((token_a, top_a), (token_b, top_b))) in a.top_tokens.iter().zip(&b.top_tokens).enumerate() {
            assert_eq!(token_a, token_b, "token {position}");
            assert_eq!(top_a.len(), 3, "token {position}: {top_a:?}");
            for (x, y) in top_a.iter().zip(top_b) {
                assert_eq!((x.0, &x.1), (y.0, &y.1), "token {position}: {top_a:?} against {top_b:?}");
                assert!((x.2 - y.2).abs() < 1e-4, "token {position}: {top_a:?} against {top_b:?}");
            }
            // Log-probabilities: negative, their probabilities summing to at most 1.
            let mass: f32 = top_a.iter().map(|c| c.2.exp()).sum();
            assert!(top_a.iter().all(|c| c.2 <= 0.0) && mass <= 1.0 + 1e-4, "token {position}: {top_a:?}");
        }
    }
    let counters = metrics.snapshot();
    assert!(counters.accepted_tokens > 0, "no draft was kept, so no verified token was reported: {counters:?}");
}
