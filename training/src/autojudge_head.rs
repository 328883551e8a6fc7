//! `train-head fit --kind autojudge`: labels + features → a `LogisticHead` file and reports.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use serde::Serialize;
use verdict_heads::{FeatureSpec, LogisticHead};

use crate::{
    feature_models::FeatureModels,
    features::{feature_path, ProblemFeatures},
    fit::{fit_logistic, FitOptions, FitReport, Sample},
    labels::LabelStore,
};

/// A label file and the folder of its problems' features.
#[derive(Clone, Debug)]
pub struct LabelSet {
    pub labels: PathBuf,
    pub features: PathBuf,
}

/// Every labelled mismatch of `set` with its feature vector under `spec`, as samples of
/// label set number `source`.
pub fn load_samples(set: &LabelSet, source: usize, spec: FeatureSpec) -> Result<Vec<Sample>> {
    let (labels, features) = (&set.labels, &set.features);
    let mut samples = Vec::new();
    for problem in LabelStore::read_all(labels)? {
        if problem.mismatches.is_empty() {
            continue;
        }
        let path = feature_path(features, problem.problem_id);
        if !path.exists() {
            tracing::warn!(
                "problem {} has no features yet ({}); left out",
                problem.problem_id,
                path.display()
            );
            continue;
        }
        let f = ProblemFeatures::load(&path, problem.mismatches.len())?;
        let target: Vec<Vec<f32>> = f.target_last.to_vec2()?;
        ensure!(
            !spec.uses_draft() || f.draft_last.dim(1)? > 0,
            "{}: the features were computed without a draft model (`features --target-only`, for labels mined with --eagle-head); fit them with --spec target",
            path.display()
        );
        let draft: Vec<Vec<f32>> = f.draft_last.to_vec2()?;
        for (i, m) in problem.mismatches.iter().enumerate() {
            let mut x = Vec::new();
            if spec.uses_draft() {
                x.extend_from_slice(&draft[i]);
            }
            x.extend_from_slice(&target[i]);
            samples.push(Sample {
                source,
                problem_id: problem.problem_id,
                features: x,
                important: m.important,
            });
        }
    }
    Ok(samples)
}

/// The report written beside the head.
#[derive(Serialize)]
pub struct HeadReport<'a> {
    pub features: &'a str,
    /// The label files, in order (`per_source` numbers them from 0).
    pub labels: Vec<String>,
    pub mismatches: usize,
    pub important: usize,
    #[serde(flatten)]
    pub fit: &'a FitReport,
}

/// Fit one head on every set of `sets` together (each holds out its own share of problems;
/// their features must come from the same models), save it at `out`, and write
/// `<out>.report.json` and `<out>.report.md`.
pub fn fit_autojudge_head(sets: &[LabelSet], spec: FeatureSpec, options: &FitOptions, out: &Path) -> Result<LogisticHead> {
    let first = sets.first().context("no label set to fit on")?;
    let models = FeatureModels::load(&first.features)?;
    let mut samples = Vec::new();
    for (source, set) in sets.iter().enumerate() {
        let theirs = FeatureModels::load(&set.features)?;
        ensure!(
            theirs.target.same_model(&models.target) && (!spec.uses_draft() || theirs.draft.same_model(&models.draft)),
            "{} holds features of target {}, {} of target {}: one head reads one model's states",
            set.features.display(),
            theirs.target.describe(),
            first.features.display(),
            models.target.describe()
        );
        samples.extend(load_samples(set, source, spec)?);
    }
    let important = samples.iter().filter(|s| s.important).count();
    tracing::info!(
        "fitting a {} head on {} mismatches ({important} important)",
        spec.name(),
        samples.len()
    );
    let fitted = fit_logistic(&samples, options)?;
    let report = HeadReport {
        features: spec.name(),
        labels: sets.iter().map(|s| s.labels.display().to_string()).collect(),
        mismatches: samples.len(),
        important,
        fit: &fitted.report,
    };
    let head = LogisticHead {
        features: spec,
        weight: fitted.weight.clone(),
        bias: fitted.bias,
        target: models.target.clone(),
        draft: spec.uses_draft().then(|| models.draft.clone()),
        threshold: fitted.report.chosen_tau as f32,
        report: serde_json::to_value(&report)?,
    };
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    head.save(out)?;
    std::fs::write(
        out.with_extension("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(out.with_extension("report.md"), markdown(&report))?;
    tracing::info!(
        "wrote {} (validation AUC {:.3}, τ {:.3})",
        out.display(),
        fitted.report.validation_auc,
        fitted.report.chosen_tau
    );
    Ok(head)
}

fn markdown(report: &HeadReport) -> String {
    let fit = report.fit;
    let mut md = format!(
        "# AutoJudge head ({} features)\n\n\
         - labels: `{}`: {} mismatches, {} important ({:.1}%)\n\
         - split by problem: {} train mismatches ({} problems), {} selection ({} problems), {} validation ({} problems)\n\
         - C chosen by ROC-AUC on the selection problems: C = {:.0e} (selection AUC {:.3}, train {:.3})\n\
         - τ = {}: the largest threshold with selection recall of important tokens ≥ {:.0}%\n\
         - on the validation problems, which chose neither: AUC **{:.3}**; at τ, recall of important {:.1}% with {:.1}% of mismatches accepted\n\n\
         | C | selection AUC |\n|---|---|\n",
        report.features,
        report.labels.join("`, `"),
        report.mismatches,
        report.important,
        100.0 * fit.important_share,
        fit.train_samples,
        fit.train_problems,
        fit.selection_samples,
        fit.selection_problems,
        fit.validation_samples,
        fit.validation_problems,
        fit.best_c,
        fit.selection_auc,
        fit.train_auc,
        format_tau(fit.chosen_tau),
        100.0 * fit.min_recall,
        fit.validation_auc,
        100.0 * fit.validation_at_tau.recall,
        100.0 * fit.validation_at_tau.accepted_share,
    );
    for (c, auc) in &fit.grid {
        md += &format!("| {c:.0e} | {auc:.3} |\n");
    }
    if fit.per_source.len() > 1 {
        md += "\nPer label set, with the chosen C:\n\n| labels | mismatches | important | validation mismatches | validation AUC |\n|---|---|---|---|---|\n";
        for s in &fit.per_source {
            md += &format!(
                "| `{}` | {} | {} ({:.1}%) | {} | {:.3} |\n",
                report.labels[s.source],
                s.samples,
                s.important,
                100.0 * s.important as f64 / s.samples.max(1) as f64,
                s.validation_samples,
                s.validation_auc
            );
        }
    }
    md += "\nLearning curve: the chosen C fitted on part of the training problems, scored on the validation problems (an AUC still rising says more labels would help):\n\n| training problems | training mismatches | validation AUC |\n|---|---|---|\n";
    for point in &fit.learning_curve {
        md += &format!("| {} | {} | {:.3} |\n", point.train_problems, point.train_samples, point.validation_auc);
    }
    md += "\nAccept a mismatch iff P(important) < τ. On the selection problems:\n\n\
           | τ | recall of important | precision | mismatches accepted |\n|---|---|---|---|\n";
    for row in &fit.thresholds {
        md += &format!(
            "| {} | {:.1}% | {:.1}% | {:.1}% |\n",
            format_tau(row.tau),
            100.0 * row.recall,
            100.0 * row.precision,
            100.0 * row.accepted_share
        );
    }
    md
}

/// Thresholds span decades (a head can be confident), so small ones keep their digits.
fn format_tau(tau: f64) -> String {
    if tau > 0.0 && tau < 0.01 {
        format!("{tau:.2e}")
    } else {
        format!("{tau:.3}")
    }
}
