//! `train-head eagle` end to end, each stage resumable: the target's greedy responses to
//! GSM8K train prompts (self-distillation, batched plain decoding through `verdict bench`),
//! their features, the draft vocabulary, training, and the head with its report.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use serde::Serialize;
use verdict::{
    config::Config,
    engine::LoadedModels,
    models::ModelSource,
    proposers::eagle_proposer::{capture_layers, target_embeddings},
};
use verdict_cli::{
    bench::{self, BenchOptions, Mode},
    subset::Subset,
    tasks::{gsm8k, TaskAdapter},
};
use verdict_heads::{eagle3::default_aux_layers, Eagle3Config, Eagle3Head, WeightFormat};

use crate::{
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
    options: &'a EagleFitOptions,
    target: String,
    train_problems: usize,
    validation_problems: usize,
    /// Positions the head trained on (every unrolled step reads each), summed over epochs.
    trained_positions: usize,
    training_seconds: f64,
    draft_vocab_coverage_validation: f64,
    validation_accuracy_per_step: Vec<Vec<f64>>,
    /// 1 + Σ_k Π_{j ≤ k} acc_j from the last validation: an estimate, the accuracies are
    /// measured with earlier tokens teacher-forced.
    estimated_tau: f64,
    /// The saved head's greedy chain drafting (γ = the unrolled steps) replayed on the
    /// held-out responses: the τ a greedy `exact` bench of them would measure.
    held_out_replay: DraftReplay,
    held_out_replay_tau: f64,
}

/// Run every stage not yet done; returns the head's folder.
pub fn train_eagle(config: &Config, plan: &EaglePlan, options: &EagleFitOptions) -> Result<PathBuf> {
    std::fs::create_dir_all(&plan.work)?;
    let responses = plan.work.join("responses.json");
    tracing::info!("stage 1/3: the target's greedy responses → {}", bench::checkpoint_path(&responses).display());
    bench::run(
        config,
        &BenchOptions {
            data_dir: plan.data_dir.clone(),
            split: plan.split.clone(),
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
        },
    )?;
    let mut runs = bench::load_checkpoint(&bench::checkpoint_path(&responses))?;
    runs.sort_by_key(|r| r.problem);
    runs.dedup_by_key(|r| r.problem);

    let models = LoadedModels::load_with_draft(config, false)?;
    let layers = capture_layers(
        &default_aux_layers(models.target_fingerprint.num_layers),
        models.target_fingerprint.num_layers,
    )?;
    let features = plan.work.join("features");
    std::fs::create_dir_all(&features)?;
    let problems = gsm8k::load(&plan.data_dir, &plan.split)?;
    let todo: Vec<&bench::Run> = runs
        .iter()
        .filter(|r| !features_path(&features, r.problem).is_file())
        .collect();
    tracing::info!("stage 2/3: features of {} problems ({} done) → {}", todo.len(), runs.len() - todo.len(), features.display());
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
        for run in todo {
            let prompt = engines.prompt_tokens(&gsm8k::Gsm8k.prompt(&problems[run.problem]))?;
            let mut response = tokenizer
                .encode(run.text.as_str(), false)
                .map_err(anyhow::Error::msg)?
                .get_ids()
                .to_vec();
            // A response shorter than the budget ended at the end of the turn.
            if run.completion_tokens < config.sampling.max_tokens {
                response.push(end_of_turn);
            }
            let tokens: Vec<u32> = prompt.iter().chain(&response).copied().collect();
            capture_sequence(&mut engines, &tokens, prompt.len(), &layers)
                .with_context(|| format!("features of problem {}", run.problem))?
                .save(&features_path(&features, run.problem))?;
            bar.inc(1);
        }
        bar.finish_and_clear();
    }

    let (train, validation) = split_held_out(&runs, &features, plan.hold_out_every);
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
    let used = draft_vocabulary(&response_tokens(&train)?, plan.draft_vocab, &forced, vocab_size)?;
    let held_out_coverage = coverage(&response_tokens(&validation)?, &used);
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
    let last = trainer.progress.validation.last().cloned().unwrap_or_default();
    let report = EagleReport {
        plan,
        options,
        target: models.target_fingerprint.describe(),
        train_problems: train.len(),
        validation_problems: validation.len(),
        trained_positions: trainer.progress.tokens,
        training_seconds: trainer.progress.seconds,
        draft_vocab_coverage_validation: held_out_coverage,
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

/// The features files of `runs`' problems (each once, by index), split as training holds
/// out: every `every`-th problem validates.
fn split_held_out(runs: &[bench::Run], features: &Path, every: usize) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut problems: Vec<usize> = runs.iter().map(|r| r.problem).collect();
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
    let runs = bench::load_checkpoint(&bench::checkpoint_path(&work.join("responses.json")))?;
    let (_, mut held_out) = split_held_out(&runs, &features, hold_out_every);
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
