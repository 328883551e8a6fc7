//! Fitting PAD's pivot MLP with candle-nn: class-weighted cross-entropy (w_c = n / (2 n_c),
//! PyTorch's weighted mean), full-batch AdamW, evaluation every 10 epochs on a held-out
//! split by problem, keeping the weights with the lowest validation loss.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Optimizer, ParamsAdamW, VarBuilder, VarMap};
use serde::Serialize;
use verdict_heads::{ModelFingerprint, PivotMlp};

use crate::fit::{roc_auc, split_for_selection};

/// One candidate token: target hidden state at layer L − 8, [entropy, p], pivot label.
#[derive(Clone, Debug)]
pub struct PivotSample {
    pub problem_id: usize,
    pub hidden: Vec<f32>,
    pub entropy: f32,
    pub probability: f32,
    pub pivot: bool,
}

#[derive(Clone, Debug)]
pub struct PadFitOptions {
    pub epochs: usize,
    pub learning_rate: f64,
    pub weight_decay: f64,
    /// Share of problems held out of training to choose the epoch (early stopping).
    pub selection_share: f64,
    /// Share of problems held out of both: the AUC and σ table reported.
    pub validation_share: f64,
    pub seed: u64,
}

impl Default for PadFitOptions {
    fn default() -> Self {
        Self {
            epochs: 2000,
            learning_rate: 1e-3,
            weight_decay: 0.01,
            selection_share: 0.2,
            validation_share: 0.2,
            seed: 42,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PadFitReport {
    pub train_samples: usize,
    pub selection_samples: usize,
    pub validation_samples: usize,
    pub pivot_share: f64,
    /// The epoch whose loss on the selection problems was least, and that loss.
    pub best_epoch: usize,
    pub best_selection_loss: f64,
    /// On the validation problems, which chose nothing.
    pub validation_auc: f64,
    /// What each σ would do on the validation candidates, to choose σ for a bench.
    pub sigma_table: Vec<SigmaRow>,
}

/// PAD keeps a refused draft when P(pivot) ≤ σ: the share of candidates it would keep and
/// how many true pivots would slip through.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SigmaRow {
    pub sigma: f64,
    pub accepted_share: f64,
    pub pivots_accepted: usize,
    pub pivots: usize,
}

/// [`SigmaRow`]s for σ = 0.1, 0.2, …, 0.9 over scored candidates.
pub fn sigma_table(scores: &[f64], pivots: &[bool]) -> Vec<SigmaRow> {
    let total_pivots = pivots.iter().filter(|&&p| p).count();
    (1..=9)
        .map(|tenths| {
            let sigma = tenths as f64 / 10.0;
            let accepted: Vec<bool> = scores
                .iter()
                .zip(pivots)
                .filter(|(&score, _)| score <= sigma)
                .map(|(_, &pivot)| pivot)
                .collect();
            SigmaRow {
                sigma,
                accepted_share: accepted.len() as f64 / scores.len().max(1) as f64,
                pivots_accepted: accepted.iter().filter(|&&p| p).count(),
                pivots: total_pivots,
            }
        })
        .collect()
}

struct Batch {
    hidden: Tensor,
    small: Tensor,
    labels: Tensor,
    weights: Tensor,
    pivots: Vec<bool>,
}

fn batch(samples: &[PivotSample], rows: &[usize], class_weight: [f32; 2]) -> Result<Batch> {
    let d = samples[rows[0]].hidden.len();
    let hidden: Vec<f32> = rows
        .iter()
        .flat_map(|&i| samples[i].hidden.iter().copied())
        .collect();
    let small: Vec<f32> = rows
        .iter()
        .flat_map(|&i| [samples[i].entropy, samples[i].probability])
        .collect();
    let pivots: Vec<bool> = rows.iter().map(|&i| samples[i].pivot).collect();
    let labels: Vec<u32> = pivots.iter().map(|&p| p as u32).collect();
    let weights: Vec<f32> = pivots.iter().map(|&p| class_weight[p as usize]).collect();
    let n = rows.len();
    Ok(Batch {
        hidden: Tensor::from_vec(hidden, (n, d), &Device::Cpu)?,
        small: Tensor::from_vec(small, (n, 2), &Device::Cpu)?,
        labels: Tensor::from_vec(labels, (n, 1), &Device::Cpu)?,
        weights: Tensor::from_vec(weights, n, &Device::Cpu)?,
        pivots,
    })
}

/// Σ w_y · (−log softmax(z)_y) / Σ w_y.
fn weighted_cross_entropy(logits: &Tensor, batch: &Batch) -> Result<Tensor> {
    let log_probs = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = log_probs.gather(&batch.labels, 1)?.squeeze(1)?;
    let weighted = (picked.neg()? * &batch.weights)?.sum_all()?;
    Ok((weighted / batch.weights.sum_all()?.to_scalar::<f32>()? as f64)?)
}

/// The MLP's parameters by name, as the best epoch left them.
type NamedParameters = Vec<(String, Tensor)>;

/// Fit the pivot MLP; `target` is the model the features came from.
pub fn fit_pivot_mlp(
    samples: &[PivotSample],
    layer: i64,
    target: ModelFingerprint,
    sigma: f32,
    options: &PadFitOptions,
) -> Result<(PivotMlp, PadFitReport)> {
    ensure!(
        samples.len() >= 10,
        "need at least 10 labelled candidates, got {}",
        samples.len()
    );
    let pivots = samples.iter().filter(|s| s.pivot).count();
    ensure!(
        pivots > 0 && pivots < samples.len(),
        "need both pivots and non-pivots"
    );
    let as_fit: Vec<crate::fit::Sample> = samples
        .iter()
        .map(|s| crate::fit::Sample {
            source: 0,
            problem_id: s.problem_id,
            features: Vec::new(),
            important: s.pivot,
        })
        .collect();
    let (train, sel, val) = split_for_selection(&as_fit, options.selection_share, options.validation_share, options.seed);
    ensure!(!sel.is_empty() && !val.is_empty(), "need at least three problems: one each to train, stop early and validate");
    let n = train.len() as f32;
    let train_pivots = train.iter().filter(|&&i| samples[i].pivot).count() as f32;
    ensure!(
        train_pivots > 0.0 && train_pivots < n,
        "the training split needs both classes"
    );
    let class_weight = [n / (2.0 * (n - train_pivots)), n / (2.0 * train_pivots)];
    let (train_batch, sel_batch, val_batch) = (
        batch(samples, &train, class_weight)?,
        batch(samples, &sel, class_weight)?,
        batch(samples, &val, class_weight)?,
    );

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let mlp = PivotMlp::new(vb, layer, target.clone(), sigma, serde_json::Value::Null)?;
    let mut optimizer = candle_nn::AdamW::new(
        varmap.all_vars(),
        ParamsAdamW {
            lr: options.learning_rate,
            weight_decay: options.weight_decay,
            ..Default::default()
        },
    )?;
    let mut best: Option<(usize, f64, NamedParameters)> = None;
    for epoch in 1..=options.epochs {
        let loss = weighted_cross_entropy(
            &mlp.logits(&train_batch.hidden, &train_batch.small)?,
            &train_batch,
        )?;
        optimizer.backward_step(&loss)?;
        if epoch % 10 == 0 || epoch == options.epochs {
            let sel_loss = weighted_cross_entropy(
                &mlp.logits(&sel_batch.hidden, &sel_batch.small)?,
                &sel_batch,
            )?
            .to_scalar::<f32>()? as f64;
            if best.as_ref().is_none_or(|b| sel_loss < b.1) {
                let snapshot = varmap
                    .data()
                    .lock()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| Ok((k.clone(), v.as_tensor().copy()?)))
                    .collect::<Result<Vec<_>>>()?;
                best = Some((epoch, sel_loss, snapshot));
            }
        }
    }
    let (best_epoch, best_selection_loss, snapshot) = best.expect("at least one evaluation");
    let tensors: std::collections::HashMap<String, Tensor> = snapshot.into_iter().collect();
    let load = |report: serde_json::Value| {
        let vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, &Device::Cpu);
        PivotMlp::new(vb, layer, target.clone(), sigma, report)
    };
    let fitted = load(serde_json::Value::Null)?;
    let probs =
        candle_nn::ops::softmax_last_dim(&fitted.logits(&val_batch.hidden, &val_batch.small)?)?
            .narrow(1, 1, 1)?
            .squeeze(1)?
            .to_vec1::<f32>()?;
    let scores: Vec<f64> = probs.iter().map(|&p| p as f64).collect();
    let report = PadFitReport {
        train_samples: train.len(),
        selection_samples: sel.len(),
        validation_samples: val.len(),
        pivot_share: pivots as f64 / samples.len() as f64,
        best_epoch,
        best_selection_loss,
        validation_auc: roc_auc(&scores, &val_batch.pivots),
        sigma_table: sigma_table(&scores, &val_batch.pivots),
    };
    let head = load(serde_json::to_value(&report)?)?;
    Ok((head, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigma_table_counts_by_hand() {
        let scores = [0.05, 0.25, 0.45, 0.85];
        let pivots = [false, true, false, true];
        let table = sigma_table(&scores, &pivots);
        let row = |sigma: f64| {
            table
                .iter()
                .find(|r| (r.sigma - sigma).abs() < 1e-9)
                .unwrap()
        };
        // σ = 0.3 keeps 0.05 and 0.25: half the candidates, one of the two pivots.
        assert_eq!(
            *row(0.3),
            SigmaRow {
                sigma: 0.3,
                accepted_share: 0.5,
                pivots_accepted: 1,
                pivots: 2
            }
        );
        assert_eq!(row(0.1).accepted_share, 0.25);
        assert_eq!(row(0.9).accepted_share, 1.0);
        assert_eq!(row(0.9).pivots_accepted, 2);
    }

    #[test]
    fn weighted_cross_entropy_matches_a_hand_computation() {
        // Two samples, logits (0, 0) and (2, 0); labels 1 and 0; weights 3 and 1.
        let samples = vec![
            PivotSample {
                problem_id: 0,
                hidden: vec![0.0],
                entropy: 0.0,
                probability: 0.0,
                pivot: true,
            },
            PivotSample {
                problem_id: 1,
                hidden: vec![0.0],
                entropy: 0.0,
                probability: 0.0,
                pivot: false,
            },
        ];
        let b = batch(&samples, &[0, 1], [1.0, 3.0]).unwrap();
        let logits = Tensor::new(&[[0.0f32, 0.0], [2.0, 0.0]], &Device::Cpu).unwrap();
        let loss = weighted_cross_entropy(&logits, &b)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let expected = (3.0 * 2f64.ln() + 1.0 * (1.0 + (-2f64).exp()).ln()) / 4.0;
        assert!((loss - expected).abs() < 1e-6, "{loss} vs {expected}");
    }
}
