//! Fitting AutoJudge's logistic head: standardise, L2 logistic regression (linfa-logistic)
//! over a log grid of C, model selection by ROC-AUC on problems held out of training, and a
//! threshold table on them from which τ is chosen for the wanted recall of important tokens.
//! The AUC reported comes from a third set of problems that chose neither C nor τ: the best
//! of a grid on the problems that picked it is biased upwards.

use std::collections::BTreeSet;

use anyhow::{ensure, Context, Result};
use linfa::prelude::*;
use linfa_logistic::LogisticRegression;
use ndarray::{Array1, Array2, Axis};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde::Serialize;

/// One labelled mismatch's features.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Which label set it came from (problem ids are per set).
    pub source: usize,
    pub problem_id: usize,
    pub features: Vec<f32>,
    pub important: bool,
}

#[derive(Clone, Debug)]
pub struct FitOptions {
    /// Inverse regularisation strengths tried (sklearn's C; linfa's alpha = 1 / C).
    pub c_grid: Vec<f64>,
    /// Share of problems held out of training to choose C and τ.
    pub selection_share: f64,
    /// Share of problems held out of both: the AUC and recall reported.
    pub validation_share: f64,
    pub seed: u64,
    pub max_iterations: u64,
    /// τ is the largest threshold whose validation recall of important tokens reaches this.
    pub min_recall: f64,
}

impl Default for FitOptions {
    fn default() -> Self {
        Self {
            // 10^-5.5 … 10^1 in half decades: with few labels the best C is small.
            c_grid: (-11..=2).map(|k| 10f64.powf(k as f64 / 2.0)).collect(),
            selection_share: 0.1,
            validation_share: 0.1,
            seed: 52,
            max_iterations: 500,
            min_recall: 0.9,
        }
    }
}

/// One row of the threshold table: the effect of accepting a mismatch iff P < τ.
#[derive(Clone, Debug, Serialize)]
pub struct ThresholdRow {
    pub tau: f64,
    /// Important held-out mismatches refused (P ≥ τ) / all important ones.
    pub recall: f64,
    /// Important among those refused.
    pub precision: f64,
    /// Held-out mismatches accepted (P < τ).
    pub accepted_share: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct FitReport {
    pub train_samples: usize,
    pub selection_samples: usize,
    pub validation_samples: usize,
    pub train_problems: usize,
    pub selection_problems: usize,
    pub validation_problems: usize,
    pub important_share: f64,
    /// (C, AUC on the selection problems) for every C tried.
    pub grid: Vec<(f64, f64)>,
    pub best_c: f64,
    /// The chosen C's AUC on the problems that chose it (optimistic).
    pub selection_auc: f64,
    /// The chosen model's AUC on the validation problems, which chose nothing.
    pub validation_auc: f64,
    pub train_auc: f64,
    /// The threshold table on the selection problems, from which τ is chosen.
    pub thresholds: Vec<ThresholdRow>,
    pub chosen_tau: f64,
    pub min_recall: f64,
    /// What the chosen τ does on the validation problems.
    pub validation_at_tau: ThresholdRow,
    /// Per label set, in order.
    pub per_source: Vec<SourceFit>,
    /// The chosen C fitted on shares of the training problems, scored on the validation
    /// problems: whether more labels would still raise the AUC.
    pub learning_curve: Vec<LearningPoint>,
}

/// One point of the learning curve.
#[derive(Clone, Debug, Serialize)]
pub struct LearningPoint {
    pub train_problems: usize,
    pub train_samples: usize,
    pub validation_auc: f64,
}

/// Shares of the training problems the learning curve fits on (the whole is the head itself).
const LEARNING_SHARES: [f64; 2] = [0.25, 0.5];

/// One label set's share of a fit.
#[derive(Clone, Debug, Serialize)]
pub struct SourceFit {
    pub source: usize,
    pub samples: usize,
    pub important: usize,
    pub validation_samples: usize,
    /// The chosen model's validation AUC on this set's held-out problems (null when they
    /// hold only one class).
    pub validation_auc: f64,
}

/// The fitted head: raw-feature weights (standardisation folded in) and bias, plus the
/// standardised model they came from.
pub struct FittedHead {
    pub weight: Vec<f32>,
    pub bias: f32,
    pub mean: Vec<f64>,
    pub scale: Vec<f64>,
    pub standardised_weight: Vec<f64>,
    pub standardised_bias: f64,
    pub report: FitReport,
}

impl FittedHead {
    /// P(important) as the trainer computes it: σ(w·(x − mean)/scale + b).
    pub fn probability(&self, features: &[f32]) -> f64 {
        let z: f64 = self.standardised_bias
            + features
                .iter()
                .zip(&self.mean)
                .zip(&self.scale)
                .zip(&self.standardised_weight)
                .map(|(((x, m), s), w)| w * (*x as f64 - m) / s)
                .sum::<f64>();
        1.0 / (1.0 + (-z).exp())
    }
}

/// Split by problem: every mismatch of a problem falls on the same side, and each label set
/// holds out its own share of its problems (a set's problems shuffled with `seed` plus the
/// set's index, so one set alone splits as it always did).
pub fn split_by_problem(
    samples: &[Sample],
    validation_share: f64,
    seed: u64,
) -> (Vec<usize>, Vec<usize>) {
    let mut validation: BTreeSet<(usize, usize)> = BTreeSet::new();
    for source in samples.iter().map(|s| s.source).collect::<BTreeSet<_>>() {
        let mut problems: Vec<usize> = samples
            .iter()
            .filter(|s| s.source == source)
            .map(|s| s.problem_id)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        problems.shuffle(&mut StdRng::seed_from_u64(seed + source as u64));
        let n_val = ((problems.len() as f64 * validation_share).round() as usize)
            .clamp(1, problems.len().saturating_sub(1).max(1));
        validation.extend(problems[..n_val].iter().map(|&p| (source, p)));
    }
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (i, s) in samples.iter().enumerate() {
        if validation.contains(&(s.source, s.problem_id)) {
            val.push(i);
        } else {
            train.push(i);
        }
    }
    (train, val)
}

/// [`split_by_problem`] into three: training, selection (choosing C and τ) and validation
/// (the figures reported). Validation holds the problems [`split_by_problem`] holds out;
/// selection takes its share of each label set's problems from the rest, at least one while
/// training keeps one.
pub fn split_for_selection(
    samples: &[Sample],
    selection_share: f64,
    validation_share: f64,
    seed: u64,
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let (rest, validation) = split_by_problem(samples, validation_share, seed);
    let mut selection: BTreeSet<(usize, usize)> = BTreeSet::new();
    for source in rest.iter().map(|&i| samples[i].source).collect::<BTreeSet<_>>() {
        let mut problems: Vec<usize> = rest
            .iter()
            .map(|&i| &samples[i])
            .filter(|s| s.source == source)
            .map(|s| s.problem_id)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        // Another stream than the validation draw's.
        problems.shuffle(&mut StdRng::seed_from_u64(seed.wrapping_add(1 << 32).wrapping_add(source as u64)));
        let n_sel = ((problems.len() as f64 * selection_share).round() as usize).clamp(1, problems.len().saturating_sub(1));
        selection.extend(problems[..n_sel].iter().map(|&p| (source, p)));
    }
    let (train, select): (Vec<usize>, Vec<usize>) = rest.into_iter().partition(|&i| !selection.contains(&(samples[i].source, samples[i].problem_id)));
    (train, select, validation)
}

fn matrix(samples: &[Sample], rows: &[usize]) -> Array2<f64> {
    let d = samples[rows[0]].features.len();
    Array2::from_shape_fn((rows.len(), d), |(i, j)| {
        samples[rows[i]].features[j] as f64
    })
}

/// ROC-AUC as the Mann–Whitney statistic: the chance that an important sample scores above
/// an unimportant one, ties counting half.
pub fn roc_auc(scores: &[f64], labels: &[bool]) -> f64 {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut rank_sum, mut i) = (0.0, 0);
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && scores[order[j + 1]] == scores[order[i]] {
            j += 1;
        }
        // Average rank (1-based) of a run of ties.
        let rank = (i + j) as f64 / 2.0 + 1.0;
        rank_sum += (i..=j).filter(|&k| labels[order[k]]).count() as f64 * rank;
        i = j + 1;
    }
    let positives = labels.iter().filter(|&&l| l).count() as f64;
    let negatives = labels.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

/// The threshold table over the quantiles of held-out probabilities.
pub fn threshold_table(probabilities: &[f64], labels: &[bool]) -> Vec<ThresholdRow> {
    let mut sorted = probabilities.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut taus: Vec<f64> = (0..=25)
        .map(|k| sorted[((sorted.len() - 1) as f64 * k as f64 / 25.0).round() as usize])
        .collect();
    taus.push(1.0 + f64::EPSILON);
    taus.dedup();
    taus.into_iter().map(|tau| threshold_row(probabilities, labels, tau)).collect()
}

/// The effect of accepting a mismatch iff P < `tau` on these probabilities and labels.
pub fn threshold_row(probabilities: &[f64], labels: &[bool], tau: f64) -> ThresholdRow {
    let important = labels.iter().filter(|&&l| l).count().max(1) as f64;
    let refused: Vec<bool> = probabilities.iter().map(|&p| p >= tau).collect();
    let caught = refused.iter().zip(labels).filter(|(&r, &l)| r && l).count() as f64;
    let n_refused = refused.iter().filter(|&&r| r).count() as f64;
    ThresholdRow {
        tau,
        recall: caught / important,
        precision: if n_refused > 0.0 { caught / n_refused } else { 1.0 },
        accepted_share: 1.0 - n_refused / probabilities.len().max(1) as f64,
    }
}

/// L2 logistic regression at inverse strength `c` on standardised rows: (w, b) giving
/// P(important).
fn logistic_at(c: f64, z: &Array2<f64>, labels: &[bool], max_iterations: u64) -> Result<(Array1<f64>, f64)> {
    let dataset = Dataset::new(z.clone(), Array1::from(labels.to_vec()));
    let model = LogisticRegression::default()
        .alpha(1.0 / c)
        .max_iterations(max_iterations)
        .fit(&dataset)
        .with_context(|| format!("logistic regression with C = {c}"))?;
    // linfa's positive class is the more frequent one; flip the model so that it gives
    // P(important).
    let sign = if model.labels().pos.class { 1.0 } else { -1.0 };
    Ok((model.params() * sign, model.intercept() * sign))
}

/// The rows of the first `share` of the training problems, drawn per label set in a seeded
/// order; `None` when they hold one class only.
fn training_subset(samples: &[Sample], train: &[usize], share: f64, seed: u64) -> Option<Vec<usize>> {
    let mut problems: Vec<(usize, usize)> =
        train.iter().map(|&i| (samples[i].source, samples[i].problem_id)).collect::<BTreeSet<_>>().into_iter().collect();
    problems.shuffle(&mut StdRng::seed_from_u64(seed.wrapping_add(2 << 32)));
    let keep: BTreeSet<(usize, usize)> =
        problems.iter().take(((problems.len() as f64 * share).round() as usize).max(1)).copied().collect();
    let rows: Vec<usize> = train.iter().copied().filter(|&i| keep.contains(&(samples[i].source, samples[i].problem_id))).collect();
    let important = rows.iter().filter(|&&i| samples[i].important).count();
    (important > 0 && important < rows.len()).then_some(rows)
}

/// Fit the head on `samples` (all with the same feature length).
pub fn fit_logistic(samples: &[Sample], options: &FitOptions) -> Result<FittedHead> {
    ensure!(
        samples.len() >= 10,
        "need at least 10 labelled mismatches, got {}",
        samples.len()
    );
    let d = samples[0].features.len();
    ensure!(
        samples.iter().all(|s| s.features.len() == d),
        "samples have different feature lengths"
    );
    let (train, sel, val) = split_for_selection(samples, options.selection_share, options.validation_share, options.seed);
    ensure!(
        !train.is_empty() && !sel.is_empty() && !val.is_empty(),
        "need at least three problems: one each to train, choose C and τ, and validate ({} train, {} selection, {} validation mismatches)",
        train.len(),
        sel.len(),
        val.len()
    );
    let labels = |rows: &[usize]| {
        rows.iter()
            .map(|&i| samples[i].important)
            .collect::<Vec<_>>()
    };
    let (y_train, y_sel, y_val) = (labels(&train), labels(&sel), labels(&val));
    ensure!(
        y_train.iter().any(|&l| l) && y_train.iter().any(|&l| !l),
        "the training split needs both important and unimportant mismatches"
    );

    let x_train = matrix(samples, &train);
    let mean = x_train.mean_axis(Axis(0)).context("empty training set")?;
    let scale = x_train
        .std_axis(Axis(0), 0.0)
        .mapv(|s| if s > 1e-12 { s } else { 1.0 });
    let standardise = |x: &Array2<f64>| (x - &mean) / &scale;
    let (z_train, z_sel, z_val) = (standardise(&x_train), standardise(&matrix(samples, &sel)), standardise(&matrix(samples, &val)));
    let mut grid = Vec::new();
    let mut best: Option<(f64, f64, Array1<f64>, f64)> = None;
    for &c in &options.c_grid {
        let (w, b) = logistic_at(c, &z_train, &y_train, options.max_iterations)?;
        let p_sel = z_sel.dot(&w).mapv(|v| 1.0 / (1.0 + (-(v + b)).exp()));
        let auc = roc_auc(p_sel.as_slice().unwrap(), &y_sel);
        tracing::info!("C = {c:.0e}: selection AUC {auc:.4}");
        grid.push((c, auc));
        if best.as_ref().is_none_or(|best| auc > best.1) {
            best = Some((c, auc, w, b));
        }
    }
    let (best_c, selection_auc, w, b) = best.context("empty C grid")?;
    let probability = |z: &Array2<f64>| z.dot(&w).mapv(|v| 1.0 / (1.0 + (-(v + b)).exp()));
    let (p_sel, p_val) = (probability(&z_sel), probability(&z_val));
    let p_train = probability(&z_train);
    let thresholds = threshold_table(p_sel.as_slice().unwrap(), &y_sel);
    let chosen_tau = thresholds
        .iter()
        .filter(|r| r.recall >= options.min_recall)
        .map(|r| r.tau)
        .fold(0.0, f64::max);
    let validation_auc = roc_auc(p_val.as_slice().unwrap(), &y_val);
    let validation_at_tau = threshold_row(p_val.as_slice().unwrap(), &y_val, chosen_tau);
    tracing::info!("C = {best_c:.0e} chosen (selection AUC {selection_auc:.4}); validation AUC {validation_auc:.4}");
    let count_problems = |rows: &[usize]| {
        rows.iter()
            .map(|&i| (samples[i].source, samples[i].problem_id))
            .collect::<BTreeSet<_>>()
            .len()
    };
    let mut learning_curve = Vec::new();
    for share in LEARNING_SHARES {
        let Some(rows) = training_subset(samples, &train, share, options.seed) else { continue };
        let z = standardise(&matrix(samples, &rows));
        let (w, b) = logistic_at(best_c, &z, &labels(&rows), options.max_iterations)?;
        let p = z_val.dot(&w).mapv(|v| 1.0 / (1.0 + (-(v + b)).exp()));
        learning_curve.push(LearningPoint {
            train_problems: count_problems(&rows),
            train_samples: rows.len(),
            validation_auc: roc_auc(p.as_slice().unwrap(), &y_val),
        });
    }
    learning_curve.push(LearningPoint { train_problems: count_problems(&train), train_samples: train.len(), validation_auc });
    let (weight, bias) = verdict_heads::LogisticHead::fold_standardisation(
        w.as_slice().unwrap(),
        b,
        mean.as_slice().unwrap(),
        scale.as_slice().unwrap(),
    );
    let per_source = samples
        .iter()
        .map(|s| s.source)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .map(|source| {
            let of = |s: &Sample| s.source == source;
            let (scores, labels): (Vec<f64>, Vec<bool>) = val
                .iter()
                .zip(p_val.iter())
                .filter(|(&i, _)| of(&samples[i]))
                .map(|(&i, &p)| (p, samples[i].important))
                .unzip();
            SourceFit {
                source,
                samples: samples.iter().filter(|s| of(s)).count(),
                important: samples.iter().filter(|s| of(s) && s.important).count(),
                validation_samples: labels.len(),
                validation_auc: roc_auc(&scores, &labels),
            }
        })
        .collect();
    Ok(FittedHead {
        weight,
        bias,
        mean: mean.to_vec(),
        scale: scale.to_vec(),
        standardised_weight: w.to_vec(),
        standardised_bias: b,
        report: FitReport {
            train_samples: train.len(),
            selection_samples: sel.len(),
            validation_samples: val.len(),
            train_problems: count_problems(&train),
            selection_problems: count_problems(&sel),
            validation_problems: count_problems(&val),
            important_share: samples.iter().filter(|s| s.important).count() as f64
                / samples.len() as f64,
            grid,
            best_c,
            selection_auc,
            validation_auc,
            train_auc: roc_auc(p_train.as_slice().unwrap(), &y_train),
            thresholds,
            chosen_tau,
            min_recall: options.min_recall,
            validation_at_tau,
            per_source,
            learning_curve,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auc_by_hand() {
        assert_eq!(
            roc_auc(&[0.1, 0.2, 0.8, 0.9], &[false, false, true, true]),
            1.0
        );
        assert_eq!(
            roc_auc(&[0.9, 0.8, 0.2, 0.1], &[false, false, true, true]),
            0.0
        );
        // One of four positive/negative pairs is out of order; a tie counts half.
        assert_eq!(
            roc_auc(&[0.1, 0.5, 0.4, 0.9], &[false, false, true, true]),
            0.75
        );
        assert_eq!(roc_auc(&[0.5, 0.5], &[false, true]), 0.5);
    }

    #[test]
    fn threshold_table_counts_by_hand() {
        let p = [0.1, 0.2, 0.6, 0.9];
        let y = [false, true, false, true];
        let table = threshold_table(&p, &y);
        let at = |tau: f64| table.iter().find(|r| (r.tau - tau).abs() < 1e-12).unwrap();
        // τ = 0.2 refuses 0.2, 0.6, 0.9: both important caught, 2 of 3 refused important.
        let r = at(0.2);
        assert_eq!((r.recall, r.accepted_share), (1.0, 0.25));
        assert!((r.precision - 2.0 / 3.0).abs() < 1e-12);
        // τ = 0.9 refuses only 0.9.
        let r = at(0.9);
        assert_eq!((r.recall, r.precision, r.accepted_share), (0.5, 1.0, 0.75));
    }

    #[test]
    fn split_keeps_problems_whole() {
        let samples: Vec<Sample> = (0..100)
            .map(|i| Sample {
                source: 0,
                problem_id: i / 5,
                features: vec![0.0],
                important: false,
            })
            .collect();
        let (train, val) = split_by_problem(&samples, 0.1, 1);
        assert_eq!(val.len(), 10);
        let val_problems: BTreeSet<usize> = val.iter().map(|&i| samples[i].problem_id).collect();
        assert!(train
            .iter()
            .all(|&i| !val_problems.contains(&samples[i].problem_id)));
    }

    /// Two label sets whose problem ids overlap: each holds out its own share, and a
    /// problem id of one set is not the same problem as that id of the other.
    #[test]
    fn each_label_set_holds_out_its_own_share_of_problems() {
        let samples: Vec<Sample> = (0..300)
            .map(|i| Sample { source: usize::from(i >= 100), problem_id: (i % 100) / 5, features: vec![0.0], important: false })
            .collect();
        let (train, val) = split_by_problem(&samples, 0.1, 1);
        let held = |source: usize| val.iter().filter(|&&i| samples[i].source == source).count();
        // 20 problems of 5 mismatches in set 0, 40 of 5 in set 1 (ids 0..19, twice).
        assert_eq!((held(0), held(1)), (10, 20));
        let val_keys: BTreeSet<(usize, usize)> = val.iter().map(|&i| (samples[i].source, samples[i].problem_id)).collect();
        assert!(train.iter().all(|&i| !val_keys.contains(&(samples[i].source, samples[i].problem_id))));
        // Set 0 alone splits as it did before there were sets.
        let alone: Vec<Sample> = samples[..100].to_vec();
        let (_, val_alone) = split_by_problem(&alone, 0.1, 1);
        assert_eq!(val_alone, val.iter().copied().filter(|&i| i < 100).collect::<Vec<_>>());
    }
}
