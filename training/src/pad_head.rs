//! PAD's features and head: for each labelled candidate, the target's layer L − 8 output at
//! the candidate token's position, and [entropy, p(candidate)] of the raw (T = 1) target
//! distribution that predicted it, as the runtime judge computes them.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use mistralrs_core::hidden_capture::CaptureRequest;
use verdict::divergence::{entropy, log_softmax};

use crate::{
    feature_models::FeatureModels,
    engine::{MistralEngines, Model},
    features::{feature_path, last_row, save_atomically},
    pad_fit::{fit_pivot_mlp, PadFitOptions, PivotSample},
    pad_mine::{read_pivot_labels, PivotLabel},
};

/// PAD reads this decoder layer (counted from the end), as the paper's code does.
pub const PAD_LAYER: i64 = -8;

const HIDDEN: &str = "layer_hidden";
const SMALL: &str = "entropy_and_p";

/// [entropy, p(token)] of the raw (T = 1) target distribution after `context`.
fn entropy_and_probability(
    engines: &MistralEngines,
    context: &[u32],
    token: u32,
) -> Result<[f32; 2]> {
    let forward = engines.raw_forward(Model::Target, context)?;
    let rows = forward.logits.dim(0)?;
    let logits: Vec<f32> = forward.logits.get(rows - 1)?.to_vec1()?;
    let log_p = log_softmax(&logits);
    Ok([entropy(&log_p) as f32, log_p[token as usize].exp()])
}

/// Features of every PAD label without a feature file, one file per problem.
pub fn compute_pad_features(
    engines: &mut MistralEngines,
    prompt_of: impl Fn(usize) -> Result<String>,
    labels: &Path,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut by_problem: BTreeMap<usize, Vec<PivotLabel>> = BTreeMap::new();
    for label in read_pivot_labels(labels)? {
        by_problem.entry(label.problem_id).or_default().push(label);
    }
    by_problem.retain(|id, _| !feature_path(dir, *id).exists());
    let total: usize = by_problem.values().map(Vec::len).sum();
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} PAD candidates, ETA {eta}",
    )?);
    let layer = engines.models().target.num_layers as i64 + PAD_LAYER;
    for (problem_id, candidates) in by_problem {
        engines.clear_prefix_caches();
        let prompt = engines.prompt_tokens(&prompt_of(problem_id)?)?;
        let (mut hidden, mut small) = (Vec::new(), Vec::new());
        for c in &candidates {
            let mut context = prompt.clone();
            context.extend_from_slice(&c.prefix);
            small.extend(entropy_and_probability(engines, &context, c.draft_token)?);
            context.push(c.draft_token);
            let (_, states) = engines.capture(
                Model::Target,
                &context,
                CaptureRequest {
                    layers: vec![layer],
                    ..Default::default()
                },
            )?;
            let (_, out) = states.layers.last().context("layer output not captured")?;
            hidden.extend(last_row(out)?);
            bar.inc(1);
        }
        let n = candidates.len();
        let width = hidden.len() / n;
        let tensors = HashMap::from([
            (
                HIDDEN.to_string(),
                Tensor::from_vec(hidden, (n, width), &Device::Cpu)?,
            ),
            (
                SMALL.to_string(),
                Tensor::from_vec(small, (n, 2), &Device::Cpu)?,
            ),
        ]);
        save_atomically(&tensors, &feature_path(dir, problem_id))?;
    }
    bar.finish();
    Ok(())
}

/// Fit the pivot MLP and save it at `out` with a JSON report beside it.
pub fn fit_pad_head(
    labels: &Path,
    features: &Path,
    models: &FeatureModels,
    sigma: f32,
    options: &PadFitOptions,
    out: &Path,
) -> Result<()> {
    let mut by_problem: BTreeMap<usize, Vec<PivotLabel>> = BTreeMap::new();
    for label in read_pivot_labels(labels)? {
        by_problem.entry(label.problem_id).or_default().push(label);
    }
    let mut samples = Vec::new();
    for (problem_id, candidates) in by_problem {
        let path = feature_path(features, problem_id);
        if !path.exists() {
            tracing::warn!("PAD candidates of problem {problem_id} have no features; left out");
            continue;
        }
        let mut t = candle_core::safetensors::load(&path, &Device::Cpu)?;
        let hidden: Vec<Vec<f32>> = t.remove(HIDDEN).context("no layer_hidden")?.to_vec2()?;
        let small: Vec<Vec<f32>> = t.remove(SMALL).context("no entropy_and_p")?.to_vec2()?;
        anyhow::ensure!(
            hidden.len() == candidates.len(),
            "{}: {} rows for {} candidates (labels changed since?)",
            path.display(),
            hidden.len(),
            candidates.len()
        );
        for ((c, h), s) in candidates.iter().zip(hidden).zip(small) {
            samples.push(PivotSample {
                problem_id,
                hidden: h,
                entropy: s[0],
                probability: s[1],
                pivot: c.pivot,
            });
        }
    }
    let (head, report) = fit_pivot_mlp(&samples, PAD_LAYER, models.target.clone(), sigma, options)?;
    head.save(out)?;
    std::fs::write(
        out.with_extension("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    tracing::info!(
        "wrote {} ({} candidates, {:.1}% pivots, validation AUC {:.3})",
        out.display(),
        samples.len(),
        100.0 * report.pivot_share,
        report.validation_auc
    );
    for row in &report.sigma_table {
        tracing::info!(
            "σ = {:.1}: keeps {:.0}% of validation candidates, {} of {} pivots",
            row.sigma,
            100.0 * row.accepted_share,
            row.pivots_accepted,
            row.pivots
        );
    }
    Ok(())
}
