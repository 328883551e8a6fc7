//! `train-head features`: the hidden states AutoJudge's head reads, for every mined mismatch.
//!
//! For a mismatch at position t with draft token d, both models read prompt ⊕ `y[:t]` ⊕ d and
//! the post-norm last hidden state at d's position is kept (the state that encodes the
//! draft token, as the verify forward produces it at run time). Requests of one problem go
//! in position order, so the prefix cache makes each cost about the tokens since the last.
//! One safetensors file per problem, written atomically: a killed run resumes.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context, Result};
use candle_core::{Device, IndexOp, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use mistralrs_core::hidden_capture::CaptureRequest;

use crate::{
    engine::{MistralEngines, Model},
    labels::{LabelStore, ProblemLabels},
};

pub const TARGET_LAST: &str = "target_last";
pub const DRAFT_LAST: &str = "draft_last";

/// The features of one problem's mismatches, in label order.
pub struct ProblemFeatures {
    /// `[mismatches, target hidden]`
    pub target_last: Tensor,
    /// `[mismatches, draft hidden]`
    pub draft_last: Tensor,
}

pub fn feature_path(dir: &Path, problem_id: usize) -> PathBuf {
    dir.join(format!("{problem_id:05}.safetensors"))
}

/// The row of the last position of a captured `[batch, positions, hidden]` state.
pub fn last_row(states: &Tensor) -> Result<Vec<f32>> {
    let positions = states.dim(1)?;
    Ok(states
        .i((0, positions - 1))?
        .to_dtype(candle_core::DType::F32)?
        .to_vec1()?)
}

fn last_hidden(engines: &MistralEngines, model: Model, tokens: &[u32]) -> Result<Vec<f32>> {
    let (_, states) = engines.capture(
        model,
        tokens,
        CaptureRequest {
            last_hidden: true,
            ..Default::default()
        },
    )?;
    last_row(
        &states
            .last_hidden
            .context("no last hidden state captured")?,
    )
}

/// The last hidden states of both models at every mismatch of one problem; with engines
/// that read the target alone, the draft side is empty (`[mismatches, 0]`).
pub fn problem_features(
    engines: &mut MistralEngines,
    prompt: &str,
    labels: &ProblemLabels,
) -> Result<ProblemFeatures> {
    engines.clear_prefix_caches();
    let prompt_tokens = engines.prompt_tokens(prompt)?;
    let contexts: Vec<Vec<u32>> = labels
        .mismatches
        .iter()
        .map(|m| {
            let mut tokens = prompt_tokens.clone();
            tokens.extend_from_slice(&m.prefix);
            tokens.push(m.draft_token);
            tokens
        })
        .collect();
    context_features(engines, &contexts)
}

/// The last hidden states of both models after each of `contexts` (prompt tokens, the
/// response before a mismatch, the draft token): the state at the position that reads the
/// draft token, as the runtime AutoJudge reads it from the verify forward
/// (`AutoJudge::features`). With engines that read the target alone the draft side is empty.
pub fn context_features(engines: &MistralEngines, contexts: &[Vec<u32>]) -> Result<ProblemFeatures> {
    let rows = |model: Model| -> Result<Tensor> {
        let mut flat = Vec::new();
        let mut width = 0;
        for context in contexts {
            let row = last_hidden(engines, model, context)?;
            width = row.len();
            flat.extend(row);
        }
        Ok(Tensor::from_vec(
            flat,
            (contexts.len(), width),
            &Device::Cpu,
        )?)
    };
    let target_last = rows(Model::Target)?;
    let draft_last = match engines.is_target_only() {
        true => Tensor::zeros((contexts.len(), 0), candle_core::DType::F32, &Device::Cpu)?,
        false => rows(Model::Draft)?,
    };
    Ok(ProblemFeatures { target_last, draft_last })
}

/// Write `tensors` to `path` through a temporary file, so a killed run leaves either the
/// whole file or none (resuming skips problems whose file exists).
pub fn save_atomically(tensors: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let tmp = path.with_extension("safetensors.tmp");
    candle_core::safetensors::save(tensors, &tmp)?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot move features into {}", path.display()))
}

impl ProblemFeatures {
    pub fn save(&self, path: &Path) -> Result<()> {
        save_atomically(
            &HashMap::from([
                (TARGET_LAST.to_string(), self.target_last.clone()),
                (DRAFT_LAST.to_string(), self.draft_last.clone()),
            ]),
            path,
        )
    }

    pub fn load(path: &Path, mismatches: usize) -> Result<Self> {
        let mut tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("cannot read features {}", path.display()))?;
        let mut take = |name: &str| -> Result<Tensor> {
            let t = tensors
                .remove(name)
                .with_context(|| format!("{} has no tensor {name}", path.display()))?;
            ensure!(
                t.dim(0)? == mismatches,
                "{}: {name} has {} rows for {mismatches} mismatches (labels changed since?)",
                path.display(),
                t.dim(0)?
            );
            Ok(t)
        };
        Ok(Self {
            target_last: take(TARGET_LAST)?,
            draft_last: take(DRAFT_LAST)?,
        })
    }
}

/// Compute the features of every labelled problem that has mismatches and no feature file.
pub fn compute_features(
    engines: &mut MistralEngines,
    prompt_of: impl Fn(usize) -> Result<String>,
    labels: &Path,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create feature folder {}", dir.display()))?;
    let todo: Vec<ProblemLabels> = LabelStore::read_all(labels)?
        .into_iter()
        .filter(|p| !p.mismatches.is_empty() && !feature_path(dir, p.problem_id).exists())
        .collect();
    let mismatches: usize = todo.iter().map(|p| p.mismatches.len()).sum();
    tracing::info!(
        "features for {} problems ({mismatches} mismatches) into {}",
        todo.len(),
        dir.display()
    );
    let bar = ProgressBar::new(mismatches as u64);
    bar.set_style(ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} mismatches, ETA {eta}",
    )?);
    for problem in todo {
        let prompt = prompt_of(problem.problem_id)?;
        let features = problem_features(engines, &prompt, &problem)?;
        features.save(&feature_path(dir, problem.problem_id))?;
        bar.inc(problem.mismatches.len() as u64);
    }
    bar.finish();
    Ok(())
}
