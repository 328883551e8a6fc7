//! PAD's pivot classifier: an MLP on the target's hidden state at layer L − 8 plus
//! [entropy, p(token)] of the target distribution; output P(pivot).
//!
//! Shape follows the reference code (`AnchorClassifierExtendedTargetV2`): two linear
//! branches without activation, concatenated, then Linear → ReLU → Linear to two classes.

use std::{collections::HashMap, path::Path};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Linear, VarBuilder};

use crate::{file::HeadFile, fingerprint::ModelFingerprint};

/// Branch and hidden widths of the reference classifier.
pub const HIDDEN_BRANCH: usize = 64;
pub const SMALL_BRANCH: usize = 16;
pub const FUSED: usize = 128;

pub struct PivotMlp {
    target_proj: Linear,
    small_features_proj: Linear,
    fuse: Linear,
    out: Linear,
    /// Decoder layer whose residual output is the feature; negative counts from the end.
    pub layer: i64,
    pub target: ModelFingerprint,
    /// Recommended σ: accept a mismatch iff P(pivot) ≤ σ.
    pub sigma: f32,
    pub report: serde_json::Value,
}

impl PivotMlp {
    pub const KIND: &'static str = "pad-pivot-mlp";

    /// Build from a var builder (fresh variables when training, stored ones when loading).
    pub fn new(
        vb: VarBuilder,
        layer: i64,
        target: ModelFingerprint,
        sigma: f32,
        report: serde_json::Value,
    ) -> Result<Self> {
        let hidden = target.hidden_size;
        Ok(Self {
            target_proj: candle_nn::linear(hidden, HIDDEN_BRANCH, vb.pp("target_proj"))?,
            small_features_proj: candle_nn::linear(2, SMALL_BRANCH, vb.pp("small_features_proj"))?,
            fuse: candle_nn::linear(HIDDEN_BRANCH + SMALL_BRANCH, FUSED, vb.pp("classifier.0"))?,
            out: candle_nn::linear(FUSED, 2, vb.pp("classifier.2"))?,
            layer,
            target,
            sigma,
            report,
        })
    }

    /// A head that says P(pivot) = `p` whatever the features (test fixtures).
    pub fn constant(layer: i64, target: ModelFingerprint, p: f32, sigma: f32) -> Result<Self> {
        let zeros = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &Device::Cpu);
        let hidden = target.hidden_size;
        let mut tensors = HashMap::new();
        for (name, (out, inp)) in [
            ("target_proj", (HIDDEN_BRANCH, hidden)),
            ("small_features_proj", (SMALL_BRANCH, 2)),
            ("classifier.0", (FUSED, HIDDEN_BRANCH + SMALL_BRANCH)),
            ("classifier.2", (2, FUSED)),
        ] {
            tensors.insert(format!("{name}.weight"), zeros(&[out, inp])?);
            tensors.insert(format!("{name}.bias"), zeros(&[out])?);
        }
        let logit = (p / (1.0 - p)).ln();
        tensors.insert(
            "classifier.2.bias".into(),
            Tensor::from_slice(&[0.0f32, logit], 2, &Device::Cpu)?,
        );
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        Self::new(vb, layer, target, sigma, serde_json::json!({"constant": p}))
    }

    /// Class logits `[n, 2]` (class 1 = pivot) for hidden states `[n, hidden]` and small
    /// features `[n, 2]` = [entropy, p].
    pub fn logits(&self, hidden: &Tensor, small: &Tensor) -> Result<Tensor> {
        let t = self.target_proj.forward(hidden)?;
        let s = self.small_features_proj.forward(small)?;
        let fused = self
            .fuse
            .forward(&Tensor::cat(&[t, s], D::Minus1)?)?
            .relu()?;
        Ok(self.out.forward(&fused)?)
    }

    /// P(pivot) for one position.
    pub fn probability(&self, hidden: &[f32], entropy: f32, p: f32) -> Result<f32> {
        ensure!(
            hidden.len() == self.target.hidden_size,
            "pivot head expects hidden size {}, got {}",
            self.target.hidden_size,
            hidden.len()
        );
        let h = Tensor::from_slice(hidden, (1, hidden.len()), &Device::Cpu)?;
        let s = Tensor::from_slice(&[entropy, p], (1, 2), &Device::Cpu)?;
        let probs = candle_nn::ops::softmax_last_dim(&self.logits(&h, &s)?)?;
        Ok(probs.get(0)?.get(1)?.to_scalar::<f32>()?)
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (name, layer) in [
            ("target_proj", &self.target_proj),
            ("small_features_proj", &self.small_features_proj),
            ("classifier.0", &self.fuse),
            ("classifier.2", &self.out),
        ] {
            out.push((format!("{name}.weight"), layer.weight().clone()));
            if let Some(b) = layer.bias() {
                out.push((format!("{name}.bias"), b.clone()));
            }
        }
        out
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let tensors = self.named_tensors();
        let refs: Vec<(&str, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t.clone()))
            .collect();
        let mut metadata = HashMap::new();
        metadata.insert("layer".into(), self.layer.to_string());
        metadata.insert("target_model".into(), serde_json::to_string(&self.target)?);
        metadata.insert("sigma".into(), self.sigma.to_string());
        metadata.insert(
            "features".into(),
            "target layer hidden ; [entropy, p]".into(),
        );
        metadata.insert("report".into(), self.report.to_string());
        HeadFile::write(path, Self::KIND, &refs, metadata)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let file = HeadFile::read(path, Self::KIND)?;
        let target: ModelFingerprint = file.meta_json("target_model")?;
        let layer: i64 = file
            .meta_parsed("layer")
            .with_context(|| path.display().to_string())?;
        let sigma: f32 = file
            .meta_parsed("sigma")
            .with_context(|| path.display().to_string())?;
        let report = file.report();
        let vb = VarBuilder::from_tensors(file.tensors, DType::F32, &Device::Cpu);
        Self::new(vb, layer, target, sigma, report)
            .with_context(|| format!("{}: tensors do not fit the pivot MLP", path.display()))
    }

    /// The absolute layer index in a model with `num_layers` layers.
    pub fn resolved_layer(&self, num_layers: usize) -> usize {
        if self.layer < 0 {
            (num_layers as i64 + self.layer).max(0) as usize
        } else {
            self.layer as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fingerprint() -> ModelFingerprint {
        ModelFingerprint {
            architecture: "llama".into(),
            hidden_size: 4,
            num_layers: 3,
            vocab_size: 10,
            tokenizer_sha256: "cd".repeat(32),
            source: "tiny".into(),
        }
    }

    #[test]
    fn round_trip_keeps_the_probabilities() {
        let varmap = candle_nn::VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let mlp = PivotMlp::new(vb, -2, fingerprint(), 0.5, serde_json::Value::Null).unwrap();
        let dir = std::env::temp_dir().join(format!("verdict-pivot-{}", std::process::id()));
        let path = dir.join("pad.safetensors");
        mlp.save(&path).unwrap();
        let loaded = PivotMlp::load(&path).unwrap();
        let h = [0.3, -1.0, 2.0, 0.5];
        let (a, b) = (
            mlp.probability(&h, 1.2, 0.3).unwrap(),
            loaded.probability(&h, 1.2, 0.3).unwrap(),
        );
        assert_eq!(a, b);
        assert!(a > 0.0 && a < 1.0);
        assert_eq!(loaded.layer, -2);
        assert_eq!(loaded.resolved_layer(3), 1);
        assert!(loaded.probability(&[0.0; 3], 0.0, 0.0).is_err());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn constant_head_says_its_probability() {
        let mlp = PivotMlp::constant(-1, fingerprint(), 0.2, 0.5).unwrap();
        let p = mlp.probability(&[5.0, -3.0, 1.0, 0.0], 2.0, 0.9).unwrap();
        assert!((p - 0.2).abs() < 1e-6, "{p}");
    }
}
