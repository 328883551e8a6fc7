//! Training data for an EAGLE-3 head: one teacher-forced target forward over each problem's
//! prompt and the target's own greedy response, recording the layers the head fuses and the
//! target's best logits at every position (the soft labels).
//!
//! One safetensors file a problem, written beside and renamed, so a killed run loses at most
//! the problem it was on and a rerun skips every file already there.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use mistralrs_core::hidden_capture::CaptureRequest;

use crate::engine::{MistralEngines, Model, RawForward};

/// Best target logits kept per position: the soft label over the draft vocabulary is the
/// softmax of those among them that the draft vocabulary holds.
pub const LABEL_TOP_K: usize = 16;

/// What the head trains on for one problem.
pub struct SequenceFeatures {
    /// Prompt (chat template applied) then response, the target's end-of-turn token last.
    pub tokens: Vec<u32>,
    /// Index of the first response token.
    pub response_start: usize,
    /// (T, 3H) f16: the captured layers at every position, low → high.
    pub aux: Tensor,
    /// (T, K) u32 / f16: the target's K best next-token ids and their logits.
    pub top_ids: Tensor,
    pub top_logits: Tensor,
}

impl SequenceFeatures {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let device = Device::Cpu;
        let tensors: HashMap<String, Tensor> = [
            ("tokens".to_string(), Tensor::new(self.tokens.as_slice(), &device)?),
            ("response_start".to_string(), Tensor::new(&[self.response_start as u32], &device)?),
            ("aux".to_string(), self.aux.clone()),
            ("top_ids".to_string(), self.top_ids.clone()),
            ("top_logits".to_string(), self.top_logits.clone()),
        ]
        .into_iter()
        .collect();
        let partial = path.with_extension("partial");
        candle_core::safetensors::save(&tensors, &partial)?;
        std::fs::rename(&partial, path)?;
        Ok(())
    }

    pub fn load(path: &Path) -> Result<Self> {
        let mut t = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("cannot read EAGLE features {}", path.display()))?;
        let mut take = |name: &str| {
            t.remove(name)
                .with_context(|| format!("{} has no {name}", path.display()))
        };
        Ok(Self {
            tokens: take("tokens")?.to_vec1()?,
            response_start: take("response_start")?.to_vec1::<u32>()?[0] as usize,
            aux: take("aux")?,
            top_ids: take("top_ids")?,
            top_logits: take("top_logits")?,
        })
    }
}

/// Where problem `index`'s features live under `dir`.
pub fn features_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("{index:05}.safetensors"))
}

/// One teacher-forced target forward over `tokens`, recording the outputs of `layers`: the
/// features of a [`SequenceFeatures`].
pub fn capture_sequence(
    engines: &mut MistralEngines,
    tokens: &[u32],
    response_start: usize,
    layers: &[usize],
) -> Result<SequenceFeatures> {
    ensure!(response_start < tokens.len(), "a response needs at least one token");
    let (forward, aux) = capture_layers(engines, Model::Target, tokens, layers)?;
    let (top_ids, top_logits) = top_k(&forward.logits, LABEL_TOP_K)?;
    Ok(SequenceFeatures {
        tokens: tokens.to_vec(),
        response_start,
        aux,
        top_ids,
        top_logits: top_logits.to_dtype(DType::F16)?,
    })
}

/// One teacher-forced forward of `model` over every position of `tokens` (the prefix cache
/// cleared first), recording the outputs of `layers`: the forward, and the layers side by
/// side at each position, `(T, layers × H)` f16, in the order `layers` lists them.
pub fn capture_layers(engines: &mut MistralEngines, model: Model, tokens: &[u32], layers: &[usize]) -> Result<(RawForward, Tensor)> {
    // Every position must be computed: a prefix-cache hit would leave positions unrecorded.
    engines.clear_prefix_caches();
    let (forward, aux) = capture_layers_after_cache(engines, model, tokens, layers)?;
    ensure!(
        forward.first == 0,
        "the target computed positions {}.. only; the prefix cache supplied the rest",
        forward.first
    );
    Ok((forward, aux))
}

/// [`capture_layers`] of the positions `model`'s prefix cache does not hold: the forward
/// (computed from `forward.first` on) and the layers at those positions only.
pub fn capture_layers_after_cache(engines: &MistralEngines, model: Model, tokens: &[u32], layers: &[usize]) -> Result<(RawForward, Tensor)> {
    // A layer fused twice (tiny targets) is recorded once.
    let mut distinct: Vec<i64> = layers.iter().map(|&l| l as i64).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let request = CaptureRequest {
        layers: distinct,
        ..CaptureRequest::default()
    };
    let (forward, states) = engines.capture(model, tokens, request)?;
    let by_layer: HashMap<usize, Tensor> = states.layers.into_iter().collect();
    let aux = layers
        .iter()
        .map(|l| {
            by_layer
                .get(l)
                .with_context(|| format!("layer {l} was not recorded"))?
                .squeeze(0)?
                .to_dtype(DType::F16)
                .map_err(anyhow::Error::from)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((forward, Tensor::cat(&aux, D::Minus1)?))
}

/// The `k` largest entries of each row of `logits` (T, V), best first: ids (T, k) u32 and
/// values (T, k) f32.
pub fn top_k(logits: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let order = logits.arg_sort_last_dim(false)?.narrow(D::Minus1, 0, k)?.contiguous()?;
    let values = logits.gather(&order, D::Minus1)?;
    Ok((order, values))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_best_ids_in_order() {
        let logits = Tensor::new(&[[0.1f32, 3.0, -1.0, 2.0], [5.0, 4.0, 6.0, 0.0]], &Device::Cpu).unwrap();
        let (ids, values) = top_k(&logits, 2).unwrap();
        assert_eq!(ids.to_vec2::<u32>().unwrap(), vec![vec![1, 3], vec![2, 0]]);
        assert_eq!(values.to_vec2::<f32>().unwrap(), vec![vec![3.0, 2.0], vec![6.0, 5.0]]);
    }

    #[test]
    fn features_round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = SequenceFeatures {
            tokens: vec![5, 6, 7],
            response_start: 2,
            aux: Tensor::ones((3, 6), DType::F16, &Device::Cpu).unwrap(),
            top_ids: Tensor::zeros((3, 2), DType::U32, &Device::Cpu).unwrap(),
            top_logits: Tensor::zeros((3, 2), DType::F16, &Device::Cpu).unwrap(),
        };
        let path = features_path(dir.path(), 12);
        f.save(&path).unwrap();
        let back = SequenceFeatures::load(&path).unwrap();
        assert_eq!((back.tokens, back.response_start), (vec![5, 6, 7], 2));
        assert_eq!(back.aux.dims(), &[3, 6]);
        assert!(!path.with_extension("partial").exists());
    }
}
