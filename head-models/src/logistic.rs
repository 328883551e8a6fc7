//! AutoJudge's head: logistic regression on hidden states at the position that encodes the
//! draft token, P(important) = σ(w·x + b). Standardisation is folded into `w` and `b`, so
//! inference is one dot product.

use std::{collections::HashMap, path::Path};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::{file::HeadFile, fingerprint::ModelFingerprint};

/// Which hidden states make up the feature vector, in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FeatureSpec {
    /// `[draft last hidden ; target last hidden]` (the paper's main setup).
    #[serde(rename = "draft+target")]
    DraftAndTarget,
    /// `target last hidden` alone (what vLLM's integration uses; no draft states needed).
    #[serde(rename = "target")]
    TargetOnly,
}

impl FeatureSpec {
    pub fn name(self) -> &'static str {
        match self {
            FeatureSpec::DraftAndTarget => "draft+target",
            FeatureSpec::TargetOnly => "target",
        }
    }

    pub fn uses_draft(self) -> bool {
        self == FeatureSpec::DraftAndTarget
    }
}

pub struct LogisticHead {
    pub features: FeatureSpec,
    /// Raw-feature weights (standardisation folded in), draft block first.
    pub weight: Vec<f32>,
    pub bias: f32,
    pub target: ModelFingerprint,
    /// Present iff the features use the draft.
    pub draft: Option<ModelFingerprint>,
    /// τ the trainer recommends: accept a mismatch iff P(important) < τ.
    pub threshold: f32,
    /// The trainer's report (validation AUC, threshold table), kept verbatim.
    pub report: serde_json::Value,
}

impl LogisticHead {
    pub const KIND: &'static str = "autojudge-logistic";

    /// Fold a standardiser (x − mean) / scale into weights fitted on standardised features.
    pub fn fold_standardisation(
        weight: &[f64],
        bias: f64,
        mean: &[f64],
        scale: &[f64],
    ) -> (Vec<f32>, f32) {
        let mut folded_bias = bias;
        let folded = weight
            .iter()
            .zip(mean.iter().zip(scale))
            .map(|(w, (m, s))| {
                let w = w / s;
                folded_bias -= w * m;
                w as f32
            })
            .collect();
        (folded, folded_bias as f32)
    }

    /// A head that says P(important) = `p` whatever the features (test fixtures, and a
    /// baseline that makes a judge's effect measurable).
    pub fn constant(
        features: FeatureSpec,
        target: ModelFingerprint,
        draft: Option<ModelFingerprint>,
        p: f32,
    ) -> Self {
        let mut head = Self {
            features,
            weight: Vec::new(),
            bias: (p / (1.0 - p)).ln(),
            target,
            draft,
            threshold: 0.5,
            report: serde_json::json!({"constant": p}),
        };
        head.weight = vec![0.0; head.input_size()];
        head
    }

    pub fn input_size(&self) -> usize {
        self.target.hidden_size
            + match self.features {
                FeatureSpec::DraftAndTarget => self.draft.as_ref().map_or(0, |d| d.hidden_size),
                FeatureSpec::TargetOnly => 0,
            }
    }

    /// P(important) for one mismatch. `draft_hidden` is required iff the features use it.
    pub fn probability(&self, draft_hidden: Option<&[f32]>, target_hidden: &[f32]) -> Result<f32> {
        let mut z = self.bias as f64;
        let mut blocks: Vec<&[f32]> = Vec::with_capacity(2);
        if self.features.uses_draft() {
            blocks.push(draft_hidden.context("this head needs the draft's hidden state")?);
        }
        blocks.push(target_hidden);
        let len: usize = blocks.iter().map(|b| b.len()).sum();
        ensure!(
            len == self.weight.len(),
            "head expects {} features, got {len}",
            self.weight.len()
        );
        let mut w = self.weight.iter();
        for block in blocks {
            for (x, w) in block.iter().zip(&mut w) {
                z += (*x as f64) * (*w as f64);
            }
        }
        Ok((1.0 / (1.0 + (-z).exp())) as f32)
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        ensure!(
            self.weight.len() == self.input_size(),
            "head has {} weights for {} features",
            self.weight.len(),
            self.input_size()
        );
        let weight = Tensor::from_slice(&self.weight, self.weight.len(), &Device::Cpu)?;
        let bias = Tensor::from_slice(&[self.bias], 1, &Device::Cpu)?;
        let mut metadata = HashMap::new();
        metadata.insert("features".into(), self.features.name().into());
        metadata.insert("target_model".into(), serde_json::to_string(&self.target)?);
        if let Some(draft) = &self.draft {
            metadata.insert("draft_model".into(), serde_json::to_string(draft)?);
        }
        metadata.insert("threshold".into(), self.threshold.to_string());
        metadata.insert("report".into(), self.report.to_string());
        HeadFile::write(
            path,
            Self::KIND,
            &[("weight", weight), ("bias", bias)],
            metadata,
        )
    }

    pub fn load(path: &Path) -> Result<Self> {
        let file = HeadFile::read(path, Self::KIND)?;
        let features: FeatureSpec =
            serde_json::from_value(serde_json::Value::String(file.meta("features")?.into()))
                .with_context(|| format!("{}: unknown feature spec", path.display()))?;
        let target: ModelFingerprint = file.meta_json("target_model")?;
        let draft: Option<ModelFingerprint> = match features {
            FeatureSpec::DraftAndTarget => Some(file.meta_json("draft_model")?),
            FeatureSpec::TargetOnly => None,
        };
        let threshold: f32 = file
            .meta_parsed("threshold")
            .with_context(|| path.display().to_string())?;
        let report = file.report();
        let weight = file.tensor("weight")?.flatten_all()?.to_vec1::<f32>()?;
        let bias = file.tensor("bias")?.flatten_all()?.to_vec1::<f32>()?;
        let [bias] = bias[..] else {
            bail!("{}: bias must hold one value", path.display());
        };
        let head = Self {
            features,
            weight,
            bias,
            target,
            draft,
            threshold,
            report,
        };
        ensure!(
            head.weight.len() == head.input_size(),
            "{}: {} weights, but its models' hidden sizes make {} features",
            path.display(),
            head.weight.len(),
            head.input_size()
        );
        Ok(head)
    }

    /// Refuse to run on other models than the ones the head was trained on.
    pub fn check_models(
        &self,
        path: &Path,
        target: &ModelFingerprint,
        draft: Option<&ModelFingerprint>,
    ) -> Result<()> {
        let name = path.display().to_string();
        self.target.check_loaded(&name, "target", target)?;
        if let Some(expected) = &self.draft {
            let loaded = draft.with_context(|| {
                format!("head {name} uses draft hidden states, but no draft model is loaded")
            })?;
            expected.check_loaded(&name, "draft", loaded)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn fingerprint(hidden: usize) -> ModelFingerprint {
        ModelFingerprint {
            architecture: "llama".into(),
            hidden_size: hidden,
            num_layers: 2,
            vocab_size: 10,
            tokenizer_sha256: "ab".repeat(32),
            source: "tiny".into(),
        }
    }

    #[test]
    fn folding_standardisation_gives_the_same_probabilities() {
        let (w, b, mean, scale) = (
            vec![0.5, -2.0, 1.0],
            0.25,
            vec![1.0, -3.0, 0.5],
            vec![2.0, 0.5, 4.0],
        );
        let (fw, fb) = LogisticHead::fold_standardisation(&w, b, &mean, &scale);
        let head = LogisticHead {
            features: FeatureSpec::TargetOnly,
            weight: fw,
            bias: fb,
            target: fingerprint(3),
            draft: None,
            threshold: 0.5,
            report: serde_json::Value::Null,
        };
        let x = [2.0f32, -1.0, 3.0];
        let z: f64 = b
            + (0..3)
                .map(|j| w[j] * (x[j] as f64 - mean[j]) / scale[j])
                .sum::<f64>();
        let expected = 1.0 / (1.0 + (-z).exp());
        let got = head.probability(None, &x).unwrap() as f64;
        assert!((got - expected).abs() < 1e-6, "{got} vs {expected}");
    }

    #[test]
    fn save_load_round_trip_and_feature_order() {
        let dir = std::env::temp_dir().join(format!("verdict-heads-{}", std::process::id()));
        let path = dir.join("h.safetensors");
        let head = LogisticHead {
            features: FeatureSpec::DraftAndTarget,
            weight: vec![1.0, 0.0, 0.0, -1.0, 0.0],
            bias: 0.0,
            target: fingerprint(3),
            draft: Some(fingerprint(2)),
            threshold: 0.1,
            report: serde_json::json!({"auc": 0.9}),
        };
        head.save(&path).unwrap();
        let loaded = LogisticHead::load(&path).unwrap();
        assert_eq!(loaded.weight, head.weight);
        assert_eq!(loaded.threshold, 0.1);
        assert_eq!(loaded.report["auc"], 0.9);
        // z = draft[0] − target[1] = 2 − 2 = 0 → 0.5; draft block first.
        let p = loaded
            .probability(Some(&[2.0, 5.0]), &[7.0, 2.0, 9.0])
            .unwrap();
        assert!((p - 0.5).abs() < 1e-6);
        assert!(loaded.probability(None, &[7.0, 2.0, 9.0]).is_err());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_head_for_another_model_is_refused_naming_both() {
        let head = LogisticHead {
            features: FeatureSpec::TargetOnly,
            weight: vec![0.0; 3],
            bias: 0.0,
            target: fingerprint(3),
            draft: None,
            threshold: 0.1,
            report: serde_json::Value::Null,
        };
        let mut other = fingerprint(4);
        other.source = "big.gguf".into();
        let err = head
            .check_models(Path::new("h.safetensors"), &other, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("hidden size 3") && err.contains("hidden size 4"),
            "{err}"
        );
        assert!(err.contains("big.gguf") && err.contains("tiny"), "{err}");
    }
}
