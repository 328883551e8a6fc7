//! `train-head eagle` end to end, each stage resumable: the target's responses to the
//! training prompts (self-distillation: GSM8K train problems decoded greedily through
//! `verdict bench`, or any prompts file at a chosen temperature), their features, the draft
//! vocabulary, training, and the head with its report.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context, Result};
use serde::Serialize;
use verdict::{
    config::{Config, SamplingConfig},
    engine::LoadedModels,
    models::ModelSource,
    proposers::eagle_proposer::{capture_layers, target_embeddings},
};
use verdict_eval::{
    bench::{self, BenchOptions},
    modes::Mode,
    prompts::PromptRecord,
    subset::Subset,
    tasks::{gsm8k, TaskAdapter},
};
use verdict_heads::{eagle3::default_aux_layers, Eagle3Config, Eagle3Head, WeightFormat};

use crate::{
    responses::{self, generate_responses, ResponsePlan},
    eagle_capture::{capture_sequence, features_path, SequenceFeatures},
    eagle_fit::{coverage, draft_vocabulary, estimated_tau, EagleFitOptions, EagleTrainer},
    eagle_replay::{replay_problems, DraftReplay, DraftTree},
    engine::MistralEngines,
};

/// The head's shape and the run's data; the training options are in [`EagleFitOptions`].
#[derive(Clone, Debug, Serialize)]
pub struct EaglePlan {
    pub data_dir: PathBuf,
    pub split: String,
    pub first: usize,
    pub problems: usize,
    /// A prompts file to answer instead of GSM8K problems (`--prompts`), with the sampling
    /// its responses are generated at; `problems` then limits how many of its prompts.
    pub prompts: Option<PathBuf>,
    pub response_sampling: Option<SamplingConfig>,
    /// The last stage to run (a long generation can finish before training is planned).
    pub until: EagleStage,
    /// Problems decoded together while generating responses (equal prompt lengths only).
    pub generate_batch: usize,
    /// Every n-th problem is held out for validation.
    pub hold_out_every: usize,
    pub draft_vocab: usize,
    pub intermediate_size: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub work: PathBuf,
    pub out: PathBuf,
}

#[derive(Serialize)]
struct EagleReport<'a> {
    plan: &'a EaglePlan,
    /// Prompts answered, and their completion tokens, by source.
    responses_per_source: BTreeMap<String, (usize, usize)>,
    /// The held-out replay by source (prompts files with sources).
    held_out_replay_per_source: BTreeMap<String, DraftReplay>,
    options: &'a EagleFitOptions,
    target: String,
    train_problems: usize,
    validation_problems: usize,
    /// Positions the head trained on (every unrolled step reads each), summed over epochs.
    trained_positions: usize,
    training_seconds: f64,
    draft_vocab_coverage_validation: f64,
    /// Held-out coverage had the draft vocabulary other sizes (the size is a trade: a
    /// drafted token costs its LM head's rows, a token outside it can never be drafted).
    draft_vocab_coverage_by_size: BTreeMap<usize, f64>,
    validation_accuracy_per_step: Vec<Vec<f64>>,
    /// 1 + Σ_k Π_{j ≤ k} acc_j from the last validation: an estimate, the accuracies are
    /// measured with earlier tokens teacher-forced.
    estimated_tau: f64,
    /// The saved head's greedy chain drafting (γ = the unrolled steps) replayed on the
    /// held-out responses: the τ a greedy `exact` bench of them would measure.
    held_out_replay: DraftReplay,
    held_out_replay_tau: f64,
}

/// The stages of `train-head eagle`, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
pub enum EagleStage {
    /// The target's responses.
    Responses,
    /// Their features (the target's hidden states at every position).
    Features,
    /// The draft vocabulary, training, the head and its report.
    Head,
}

/// One training example: a conversation and the target's response to it.
struct Example {
    /// The problem's index in the split, or the prompt's line in the prompts file.
    index: usize,
    source: String,
    turns: Vec<(String, String)>,
    text: String,
    completion_tokens: usize,
    /// The response ended at the end of the turn (the token belongs to it).
    ended_turn: bool,
}

/// The target's greedy responses to GSM8K problems, through the bench's plain mode.
fn gsm8k_examples(config: &Config, plan: &EaglePlan) -> Result<Vec<Example>> {
    let responses = plan.work.join("responses.json");
    tracing::info!("stage 1/3: the target's greedy responses → {}", bench::checkpoint_path(&responses).display());
    bench::run(
        config,
        &BenchOptions {
            task: verdict_eval::benchmark::TaskName::Gsm8k,
            data_dir: plan.data_dir.clone(),
            split: plan.split.clone(),
            sandbox_python: verdict_eval::sandbox::Sandbox::default_python(),
            subset: Subset {
                ids: None,
                offset: plan.first,
                limit: Some(plan.problems),
            },
            modes: vec![Mode::plain()],
            out: responses.clone(),
            explain_divergences: false,
            batch: plan.generate_batch,
            // The responses were generated without one; a hit would change nothing.
            prefix_cache: false,
            seeds: 1,
            hold_while: None,
        },
    )?;
    let mut runs = bench::load_checkpoint(&bench::checkpoint_path(&responses))?;
    runs.sort_by_key(|r| r.problem);
    runs.dedup_by_key(|r| r.problem);
    let problems = gsm8k::load(&plan.data_dir, &plan.split)?;
    Ok(runs
        .into_iter()
        .map(|run| Example {
            index: run.problem,
            source: "gsm8k".into(),
            turns: vec![("user".into(), gsm8k::Gsm8k.prompt(&problems[run.problem]))],
            // A response shorter than the budget ended at the end of the turn.
            ended_turn: run.completion_tokens < config.sampling.max_tokens,
            completion_tokens: run.completion_tokens,
            text: run.text,
        })
        .collect())
}

/// The target's responses to a prompts file, at the plan's sampling.
fn prompt_examples(config: &Config, models: &LoadedModels, plan: &EaglePlan, file: &Path, records: &[PromptRecord]) -> Result<Vec<Example>> {
    let checkpoint = plan.work.join("responses.jsonl");
    tracing::info!("stage 1/3: the target's responses to {} → {}", file.display(), checkpoint.display());
    let response_plan = ResponsePlan {
        prompts: file.to_path_buf(),
        limit: Some(plan.problems),
        sampling: plan.response_sampling.clone().unwrap_or_else(|| config.sampling.clone()),
        batch: plan.generate_batch,
    };
    let answered = generate_responses(models, records, &response_plan, config.server.ragged_batches, &checkpoint)?;
    Ok(answered
        .into_iter()
        .map(|r| Example {
            index: r.index,
            source: r.source.clone(),
            turns: records[r.index].turns().into_iter().map(|t| (t.role, t.content)).collect(),
            ended_turn: r.ended_its_turn(),
            completion_tokens: r.completion_tokens,
            text: r.text,
        })
        .collect())
}

/// Run every stage not yet done; returns the head's folder.
pub fn train_eagle(config: &Config, plan: &EaglePlan, options: &EagleFitOptions) -> Result<PathBuf> {
    std::fs::create_dir_all(&plan.work)?;
    let (examples, models) = match &plan.prompts {
        None => {
            let examples = gsm8k_examples(config, plan)?;
            (examples, LoadedModels::load_with_draft(config, false)?)
        }
        Some(file) => {
            // A bad prompts file is refused before the models load.
            let records = verdict_eval::prompts::load(file)?;
            let models = LoadedModels::load_with_draft(config, false)?;
            (prompt_examples(config, &models, plan, file, &records)?, models)
        }
    };
    if plan.until == EagleStage::Responses {
        tracing::info!("{} responses ready; stopping after them (--until responses)", examples.len());
        return Ok(plan.out.clone());
    }
    let layers = capture_layers(
        &default_aux_layers(models.target_fingerprint.num_layers),
        models.target_fingerprint.num_layers,
    )?;
    let features = plan.work.join("features");
    std::fs::create_dir_all(&features)?;
    let todo: Vec<&Example> = examples
        .iter()
        .filter(|e| !features_path(&features, e.index).is_file())
        .collect();
    tracing::info!("stage 2/3: features of {} responses ({} done) → {}", todo.len(), examples.len() - todo.len(), features.display());
    if !todo.is_empty() {
        let mut engines = MistralEngines::target_only(&models)?;
        let tokenizer = models
            .target
            .blocking_lock()
            .tokenizer()
            .context("the target has no tokenizer")?;
        let end_of_turn = tokenizer
            .token_to_id("<|im_end|>")
            .context("the target's tokenizer has no <|im_end|>: the chat responses' end is unknown")?;
        let bar = indicatif::ProgressBar::new(todo.len() as u64);
        for example in todo {
            let prompt = engines.chat_tokens(&example.turns)?;
            let mut response = tokenizer
                .encode(example.text.as_str(), false)
                .map_err(anyhow::Error::msg)?
                .get_ids()
                .to_vec();
            if example.ended_turn {
                response.push(end_of_turn);
            }
            let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
            capture_sequence(&mut engines, &tokens, prompt.len(), &layers)
                .with_context(|| format!("features of example {}", example.index))?
                .save(&features_path(&features, example.index))?;
            bar.inc(1);
        }
        bar.finish_and_clear();
    }

    if plan.until == EagleStage::Features {
        tracing::info!("features of {} responses ready; stopping after them (--until features)", examples.len());
        return Ok(plan.out.clone());
    }
    let indices: Vec<usize> = examples.iter().map(|e| e.index).collect();
    let responses_per_source = responses::per_source(examples.iter().map(|e| (e.source.as_str(), e.completion_tokens)));
    let (train, validation) = split_held_out(&indices, &features, plan.hold_out_every);
    ensure!(!train.is_empty() && !validation.is_empty(), "{} training and {} validation problems: generate more", train.len(), validation.len());
    let response_tokens = |paths: &[PathBuf]| -> Result<Vec<Vec<u32>>> {
        paths
            .iter()
            .map(|p| {
                let f = SequenceFeatures::load(p)?;
                Ok(f.tokens[f.response_start..].to_vec())
            })
            .collect()
    };
    let vocab_size = models.target_fingerprint.vocab_size;
    let tokenizer = models.target.blocking_lock().tokenizer().context("the target has no tokenizer")?;
    let forced: Vec<u32> = ["<|im_end|>", "<|endoftext|>"].iter().filter_map(|t| tokenizer.token_to_id(t)).collect();
    let train_tokens = response_tokens(&train)?;
    let used = draft_vocabulary(&train_tokens, plan.draft_vocab, &forced, vocab_size)?;
    let held_out_tokens = response_tokens(&validation)?;
    let held_out_coverage = coverage(&held_out_tokens, &used);
    let mut coverage_by_size = BTreeMap::new();
    for size in [1024, 2048, 4096, 8192, 16384, 32768] {
        let vocabulary = draft_vocabulary(&train_tokens, size, &forced, vocab_size)?;
        coverage_by_size.insert(size, coverage(&held_out_tokens, &vocabulary));
    }
    tracing::info!("held-out coverage by draft vocabulary size: {coverage_by_size:?}");
    tracing::info!("draft vocabulary of {} covers {:.2}% of held-out response tokens", used.len(), 100.0 * held_out_coverage);

    let head_config = head_config(plan, &models)?;
    let embeddings = target_embeddings(&models.target_source)?;
    let checkpoint = plan.work.join("checkpoint");
    tracing::info!("stage 3/3: training on {} problems, validating on {}", train.len(), validation.len());
    let mut trainer = EagleTrainer::new(head_config, used, embeddings.clone(), options.clone(), &checkpoint)?;
    trainer.fit(&train, &validation, &checkpoint)?;
    trainer.save_head(&plan.out, candle_core::DType::F16)?;
    tracing::info!("replaying greedy chain drafting (γ {}) on the {} held-out responses", options.ttt_steps, validation.len());
    let saved = Eagle3Head::load(&plan.out, &candle_core::Device::Cpu)?;
    let replay = replay_problems(&saved, &*embeddings, &validation, &DraftTree::chain(options.ttt_steps), 0.0, vocab_size)?;
    let mut held_out_replay_per_source = BTreeMap::new();
    let sources: std::collections::BTreeSet<&str> = examples.iter().map(|e| e.source.as_str()).collect();
    if sources.len() > 1 {
        for source in sources {
            let paths: Vec<PathBuf> = examples
                .iter()
                .filter(|e| e.source == source && e.index % plan.hold_out_every == 0)
                .map(|e| features_path(&features, e.index))
                .collect();
            if !paths.is_empty() {
                let replay = replay_problems(&saved, &*embeddings, &paths, &DraftTree::chain(options.ttt_steps), 0.0, vocab_size)?;
                tracing::info!("held-out {source}: {} responses, replayed τ {:.2}", paths.len(), replay.tau());
                held_out_replay_per_source.insert(source.to_string(), replay);
            }
        }
    }
    let last = trainer.progress.validation.last().cloned().unwrap_or_default();
    let report = EagleReport {
        plan,
        responses_per_source,
        held_out_replay_per_source,
        options,
        target: models.target_fingerprint.describe(),
        train_problems: train.len(),
        validation_problems: validation.len(),
        trained_positions: trainer.progress.tokens,
        training_seconds: trainer.progress.seconds,
        draft_vocab_coverage_validation: held_out_coverage,
        draft_vocab_coverage_by_size: coverage_by_size,
        estimated_tau: estimated_tau(&last),
        validation_accuracy_per_step: trainer.progress.validation.clone(),
        held_out_replay_tau: replay.tau(),
        held_out_replay: replay,
    };
    std::fs::write(plan.out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    tracing::info!(
        "EAGLE-3 head in {}: held-out accuracy per step {last:.3?}, estimated τ {:.2}, replayed τ {:.2}",
        plan.out.display(),
        report.estimated_tau,
        report.held_out_replay_tau
    );
    Ok(plan.out.clone())
}

/// The features files of the examples with these indices (each once), split as training
/// holds out: every `every`-th index validates.
fn split_held_out(indices: &[usize], features: &Path, every: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut problems: Vec<usize> = indices.to_vec();
    problems.sort_unstable();
    problems.dedup();
    let (validation, train): (Vec<usize>, Vec<usize>) = problems.into_iter().partition(|p| p % every == 0);
    let paths = |ids: Vec<usize>| ids.into_iter().map(|p| features_path(features, p)).collect();
    (paths(train), paths(validation))
}

/// `train-head eagle-replay`: a head's greedy chain drafting replayed on the held-out
/// problems' features under `work` (every `hold_out_every`-th problem, as training held out).
pub fn replay_held_out(config: &Config, head_dir: &Path, weights: WeightFormat, work: &Path, hold_out_every: usize, tree: &DraftTree, min_confidence: f32) -> Result<DraftReplay> {
    ensure!(hold_out_every >= 1 && tree.depth() >= 1, "--hold-out-every and --gamma must be at least 1");
    let cache = verdict::models::cache_dir(config.models.cache_dir.as_deref());
    let target = verdict::models::resolve(&config.models.target, &cache).context("models.target")?;
    let mut head = Eagle3Head::load(head_dir, &candle_core::Device::Cpu)?;
    head.quantize(weights)?;
    let features = work.join("features");
    let mut indices: Vec<usize> = bench::load_checkpoint(&bench::checkpoint_path(&work.join("responses.json")))?.iter().map(|r| r.problem).collect();
    indices.extend(responses::load(&work.join("responses.jsonl"))?.iter().map(|r| r.index));
    let (_, mut held_out) = split_held_out(&indices, &features, hold_out_every);
    // Responses generated since the last training have no features yet.
    held_out.retain(|p| p.is_file());
    ensure!(!held_out.is_empty(), "{} holds no held-out problem's features (every {hold_out_every}-th)", features.display());
    tracing::info!("replaying {} held-out problems, draft tree {tree} ({} nodes), weights {weights}", held_out.len(), tree.nodes());
    replay_problems(&head, &*target_embeddings(&target)?, &held_out, tree, min_confidence, head.config.vocab_size)
}

/// The head's `config.json`: the target's width, RoPE base and vocabulary, and its
/// fingerprint (other engines ignore it; Verdict refuses the head for any other target).
fn head_config(plan: &EaglePlan, models: &LoadedModels) -> Result<Eagle3Config> {
    let target = &models.target_fingerprint;
    ensure!(target.hidden_size.is_multiple_of(plan.heads), "--heads {} does not divide the target's width {}", plan.heads, target.hidden_size);
    Ok(serde_json::from_value(serde_json::json!({
        "hidden_size": target.hidden_size,
        "intermediate_size": plan.intermediate_size,
        "num_attention_heads": plan.heads,
        "num_key_value_heads": plan.kv_heads,
        "head_dim": target.hidden_size / plan.heads,
        "rope_theta": rope_theta(&models.target_source)?,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": plan.draft_vocab,
        "tie_word_embeddings": false,
        "verdict_target": target,
    }))?)
}

/// The target's RoPE base: GGUF `<arch>.rope.freq_base`, or `rope_theta` of config.json.
pub fn rope_theta(source: &ModelSource) -> Result<f64> {
    match source {
        ModelSource::Gguf(path) => {
            let mut file = std::fs::File::open(path)?;
            let content = candle_core::quantized::gguf_file::Content::read(&mut file)?;
            let arch = content
                .metadata
                .get("general.architecture")
                .and_then(|v| v.to_string().ok())
                .cloned()
                .unwrap_or_default();
            Ok(content
                .metadata
                .get(&format!("{arch}.rope.freq_base"))
                .and_then(|v| v.to_f32().ok())
                .map_or(10_000.0, f64::from))
        }
        ModelSource::Safetensors(dir) => {
            let text = std::fs::read_to_string(dir.join("config.json"))?;
            let config: serde_json::Value = serde_json::from_str(&text)?;
            Ok(config["rope_theta"].as_f64().unwrap_or(10_000.0))
        }
    }
}
