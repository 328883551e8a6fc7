//! The EAGLE-3 head as the pipeline's [`Proposer`]: one [`SequenceDrafter`] per sequence,
//! fed the target's captured layers after every target forward.

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Mutex, MutexGuard},
};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use mistralrs_core::speculative_hook::{Proposer, TargetFeatures};
use verdict_heads::{Eagle3Head, ModelFingerprint, WeightFormat};

pub use super::embeddings::target_embeddings;
use super::eagle::{SequenceDrafter, TokenEmbeddings};
use crate::models::ModelSource;

pub struct EagleProposer {
    head: Arc<Eagle3Head>,
    embeddings: Arc<dyn TokenEmbeddings>,
    /// Target decoder layers whose outputs the head fuses (low → high): the outputs of layers
    /// `l − 1` for the inputs of the head's layers `l`.
    layers: Vec<usize>,
    vocab_size: usize,
    /// Drafting stops before a draft the head gives less than this probability (0: never).
    min_confidence: f32,
    sequences: Mutex<HashMap<usize, SequenceDrafter>>,
}

impl EagleProposer {
    /// `layers`: the target layers whose *outputs* to capture, one per third of the head's
    /// `fc` input.
    pub fn new(
        head: Arc<Eagle3Head>,
        embeddings: Arc<dyn TokenEmbeddings>,
        layers: Vec<usize>,
        vocab_size: usize,
    ) -> Result<Self> {
        ensure!(
            layers.len() == 3,
            "an EAGLE-3 head fuses 3 target layers, {} were given ({layers:?})",
            layers.len()
        );
        Ok(Self {
            head,
            embeddings,
            layers,
            vocab_size,
            min_confidence: 0.0,
            sequences: Mutex::new(HashMap::new()),
        })
    }

    /// Stop drafting before a draft whose best token the head gives less than `p` (the first
    /// draft is always made), so a step verifies fewer unlikely drafts.
    pub fn with_min_confidence(mut self, p: f32) -> Result<Self> {
        ensure!((0.0..1.0).contains(&p), "EAGLE min confidence {p} outside [0, 1)");
        self.min_confidence = p;
        Ok(self)
    }

    /// Load the head in `head_dir` for the loaded target: refused when it was made for
    /// another model; the target's own embeddings are shared with it.
    pub fn load(head_dir: &Path, weights: WeightFormat, target: &ModelSource, fingerprint: &ModelFingerprint) -> Result<Self> {
        let mut head = Eagle3Head::load(head_dir, &Device::Cpu)?;
        head.check_target(&head_dir.display().to_string(), fingerprint)?;
        head.quantize(weights)
            .with_context(|| format!("EAGLE-3 head {}: speculative.eagle_weights = \"{weights}\"", head_dir.display()))?;
        let layers = capture_layers(&head.config.aux_layers(fingerprint.num_layers), fingerprint.num_layers)
            .with_context(|| format!("EAGLE-3 head {}", head_dir.display()))?;
        let embeddings = target_embeddings(target)?;
        tracing::info!(
            "EAGLE-3 head {}: draft vocabulary {}, weights {weights}, fuses the outputs of target layers {layers:?}",
            head_dir.display(),
            head.config.draft_vocab()
        );
        Self::new(Arc::new(head), embeddings, layers, fingerprint.vocab_size)
    }

    fn sequences(&self) -> MutexGuard<'_, HashMap<usize, SequenceDrafter>> {
        self.sequences.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sequences with drafting state (finished ones are released).
    pub fn live_sequences(&self) -> usize {
        self.sequences().len()
    }
}

/// The target layers to capture for fused layer *inputs* `aux` (EAGLE-3's convention): the
/// input of layer `l` is the output of layer `l − 1` (`l = L` names the last layer's output).
pub fn capture_layers(aux: &[usize], num_layers: usize) -> Result<Vec<usize>> {
    aux.iter()
        .map(|&l| match l {
            0 => bail!("fusing the input of layer 0 (the embeddings) is not supported"),
            l if l > num_layers => bail!("layer input {l} does not exist in a target of {num_layers} layers"),
            l => Ok(l - 1),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_layer_inputs_are_the_previous_layers_outputs() {
        // Qwen2.5-1.5B: inputs of 2, 14, 25 are outputs of 1, 13, 24 (SGLang's ids).
        assert_eq!(capture_layers(&[2, 14, 25], 28).unwrap(), vec![1, 13, 24]);
        assert_eq!(capture_layers(&[1, 2, 2], 2).unwrap(), vec![0, 1, 1]);
        let err = format!("{:#}", capture_layers(&[0, 1, 2], 28).unwrap_err());
        assert!(err.contains("layer 0"), "{err}");
        let err = format!("{:#}", capture_layers(&[2, 14, 29], 28).unwrap_err());
        assert!(err.contains("29") && err.contains("28 layers"), "{err}");
    }
}

fn to_candle(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

impl Proposer for EagleProposer {
    fn target_layers(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> candle_core::Result<()> {
        let rows = features.layers.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>();
        let aux = Tensor::cat(&rows, 1)?;
        let mut sequences = self.sequences();
        let drafter = sequences.entry(features.seq_id).or_default();
        drafter
            .commit(
                &self.head,
                &*self.embeddings,
                features.start,
                &aux,
                features.next_tokens,
            )
            .with_context(|| format!("EAGLE head, sequence {}", features.seq_id))
            .map_err(to_candle)
    }

    fn propose(
        &self,
        seq_id: usize,
        gamma: usize,
        sample: &mut dyn FnMut(&Tensor) -> candle_core::Result<u32>,
    ) -> candle_core::Result<(Vec<u32>, Tensor)> {
        let mut sequences = self.sequences();
        let drafter = sequences
            .get_mut(&seq_id)
            .ok_or_else(|| candle_core::Error::Msg(format!("EAGLE head: sequence {seq_id} has no target features yet")))?;
        let drafts = drafter
            .draft_confident(&self.head, &*self.embeddings, gamma, self.min_confidence, self.vocab_size, &mut |row| {
                Ok(sample(row)?)
            })
            .map_err(to_candle)?;
        Ok((drafts.tokens, drafts.logits))
    }

    fn release(&self, seq_id: usize) {
        self.sequences().remove(&seq_id);
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.sequences().get(&seq_id).map_or(0, SequenceDrafter::committed_len)
    }
}
