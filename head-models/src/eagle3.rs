//! EAGLE-3 draft head (arXiv 2503.01840): one decoder layer that drafts from the target's
//! own hidden states, in the checkpoint layout SGLang, SpecForge and the EAGLE reference
//! load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; `config.json` keys below).
//!
//! ```text
//! g      = fc(a_low ⊕ a_mid ⊕ a_high)                       3H → H, once per target position
//! x      = input_layernorm(embed(t)) ⊕ hidden_norm(h)       h = g, or the head's own output
//! h'     = h + o_proj(attn(q(x), k(x), v(x)))               q/k/v take 2H, no biases
//! out    = h' + mlp(post_attention_layernorm(h'))            SwiGLU
//! logits = lm_head(norm(out))                                over the draft vocabulary
//! ```
//! The residual carries the un-normalised `h` ("norm after residual", the reference's).
//! Token embeddings are the target's (frozen), so they come in from outside.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

pub use crate::decoder_layer::{CacheSegment, HeadCache};
use crate::{
    decoder_layer::{head_norm, open_weights, read_config, Attention, AttentionShape, HeadNorm, Mlp, Outputs},
    projection::{projection, Projection, WeightFormat},
    fingerprint::{check_head_target, ModelFingerprint},
};

/// `config.json` of an EAGLE-3 head, with the field names other engines read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eagle3Config {
    #[serde(default = "eagle3_architectures")]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// The target's vocabulary.
    pub vocab_size: usize,
    /// Rows of the head's own LM head; absent means the full vocabulary (no d2t map).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_vocab_size: Option<usize>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "one")]
    pub num_hidden_layers: usize,
    /// Width of the target's hidden states when it differs from the head's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_hidden_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eagle_config: Option<EagleConfig>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Verdict's record of the target the head was trained on (other engines ignore the
    /// key); a head that has it is refused for any other target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict_target: Option<ModelFingerprint>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EagleConfig {
    /// Target layers whose *input* residual stream is fused, low to high, as vLLM reads them
    /// (SGLang adds one). Absent: {2, L/2, L − 3}.
    #[serde(default)]
    pub eagle_aux_hidden_state_layer_ids: Option<Vec<usize>>,
}

fn eagle3_architectures() -> Vec<String> {
    vec!["LlamaForCausalLMEagle3".into()]
}
fn default_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_max_positions() -> usize {
    32_768
}
fn default_act() -> String {
    "silu".into()
}
fn one() -> usize {
    1
}
fn default_model_type() -> String {
    "llama".into()
}

impl Eagle3Config {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn draft_vocab(&self) -> usize {
        self.draft_vocab_size.unwrap_or(self.vocab_size)
    }

    pub fn target_hidden(&self) -> usize {
        self.target_hidden_size.unwrap_or(self.hidden_size)
    }

    /// The fused target layers (inputs of these decoder layers) for a target of `layers`.
    pub fn aux_layers(&self, layers: usize) -> Vec<usize> {
        self.eagle_config
            .as_ref()
            .and_then(|c| c.eagle_aux_hidden_state_layer_ids.clone())
            .unwrap_or_else(|| default_aux_layers(layers))
    }

    fn validate(&self) -> Result<()> {
        ensure!(self.num_hidden_layers == 1, "EAGLE-3 heads have one layer, config says {}", self.num_hidden_layers);
        ensure!(self.hidden_act == "silu", "hidden_act {:?}: only silu is supported", self.hidden_act);
        ensure!(!self.tie_word_embeddings, "tie_word_embeddings must be false for an EAGLE-3 head (its lm_head is its own)");
        ensure!(
            self.num_attention_heads.is_multiple_of(self.num_key_value_heads),
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            self.num_attention_heads,
            self.num_key_value_heads
        );
        ensure!(self.draft_vocab() <= self.vocab_size, "draft_vocab_size {} exceeds vocab_size {}", self.draft_vocab(), self.vocab_size);
        Ok(())
    }
}

/// EAGLE-3's default fused layers: inputs of layers 2, L/2 and L − 3.
pub fn default_aux_layers(layers: usize) -> Vec<usize> {
    vec![2, layers / 2, layers.saturating_sub(3)]
}

/// What one head call returns for each input row.
pub struct HeadOutput {
    /// The layer's output before `norm`: the hidden input of the next draft step.
    pub hidden: Tensor,
    /// Logits over the draft vocabulary (map ids with [`Eagle3Head::target_id`]).
    pub logits: Tensor,
}

pub struct Eagle3Head {
    pub config: Eagle3Config,
    fc: Projection,
    input_layernorm: HeadNorm,
    hidden_norm: HeadNorm,
    attention: Attention,
    post_attention_layernorm: HeadNorm,
    mlp: Mlp,
    norm: HeadNorm,
    lm_head: Projection,
    /// Draft id → target id, when the draft vocabulary is reduced.
    draft_to_target: Option<Vec<u32>>,
}

impl Eagle3Head {
    /// Build from a var builder: stored weights when loading, fresh variables when training.
    /// `draft_to_target` (target id of each draft id) is required when the draft vocabulary
    /// is reduced.
    pub fn new(config: Eagle3Config, vb: VarBuilder, draft_to_target: Option<Vec<u32>>) -> Result<Self> {
        config.validate()?;
        let h = config.hidden_size;
        let eps = config.rms_norm_eps;
        let mid = vb.pp("midlayer");
        let reduced = config.draft_vocab() != config.vocab_size;
        match &draft_to_target {
            Some(map) => ensure!(
                map.len() == config.draft_vocab(),
                "the draft-to-target map has {} entries for a draft vocabulary of {}",
                map.len(),
                config.draft_vocab()
            ),
            None => ensure!(!reduced, "a reduced draft vocabulary needs the d2t map"),
        }
        Ok(Self {
            fc: projection(3 * config.target_hidden(), h, false, vb.pp("fc"))?,
            input_layernorm: head_norm(h, eps, mid.pp("input_layernorm"))?,
            hidden_norm: head_norm(h, eps, mid.pp("hidden_norm"))?,
            attention: Attention::new(
                &AttentionShape {
                    input: 2 * h,
                    output: h,
                    heads: config.num_attention_heads,
                    kv_heads: config.num_key_value_heads,
                    head_dim: config.head_dim(),
                    rope_theta: config.rope_theta,
                    qkv_bias: false,
                },
                mid.pp("self_attn"),
            )?,
            post_attention_layernorm: head_norm(h, eps, mid.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(h, config.intermediate_size, mid.pp("mlp"))?,
            norm: head_norm(h, eps, vb.pp("norm"))?,
            lm_head: projection(h, config.draft_vocab(), false, vb.pp("lm_head"))?,
            draft_to_target,
            config,
        })
    }

    /// Load `dir/config.json` and `dir/model.safetensors` (or `pytorch_model.bin`). Tensor
    /// names as the reference writes them (`midlayer.`) or as vLLM does (`layers.0.`).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let config: Eagle3Config = read_config(dir, "EAGLE-3")?;
        let vb = open_weights(dir, device)?;
        let vb = if vb.contains_tensor("midlayer.self_attn.q_proj.weight") {
            vb
        } else if vb.contains_tensor("layers.0.self_attn.q_proj.weight") {
            vb.rename_f(|name: &str| name.replacen("midlayer.", "layers.0.", 1))
        } else {
            bail!("{}: no midlayer.* (or layers.0.*) tensors: not an EAGLE-3 head", dir.display());
        };
        let draft_to_target = match config.draft_vocab() != config.vocab_size {
            true => {
                let d2t = vb
                    .get_with_hints_dtype(config.draft_vocab(), "d2t", candle_nn::Init::Const(0.0), DType::I64)
                    .with_context(|| format!("{}: a reduced draft vocabulary needs the d2t map", dir.display()))?;
                Some(d2t_to_target_ids(&d2t.to_vec1::<i64>()?, config.vocab_size)?)
            }
            false => None,
        };
        Self::new(config, vb, draft_to_target)
            .with_context(|| format!("cannot load the EAGLE-3 head in {}", dir.display()))
    }

    /// Store every matrix as `format` for drafting (a trained head's variables are f32;
    /// a quantized head cannot be trained further).
    pub fn quantize(&mut self, format: WeightFormat) -> Result<()> {
        self.fc.quantize(format)?;
        self.attention.quantize(format)?;
        self.mlp.quantize(format)?;
        self.lm_head.quantize(format)
    }

    /// The fused hidden input of a target position: `fc` over the three captured layers.
    pub fn fuse(&self, aux: &Tensor) -> Result<Tensor> {
        crate::on_compute_pool(aux.device(), || Ok(self.fc.forward(aux)?))
    }

    /// Run the layer on `t` rows at positions `start..start + t`: `embeds` (t, H) are the
    /// target's embeddings of the input tokens, `hidden` (t, H) fused target features or
    /// the head's own previous outputs.
    pub fn forward(
        &self,
        embeds: &Tensor,
        hidden: &Tensor,
        start: usize,
        cache: &mut HeadCache,
    ) -> Result<HeadOutput> {
        let rows = embeds.dim(0)?;
        self.forward_segments(embeds, hidden, &mut [CacheSegment { start, rows, cache }])
    }

    /// [`Self::forward`] for several sequences in one call: `embeds` and `hidden` hold each
    /// segment's rows in turn, and each segment attends to its own cache. Every matrix
    /// multiplies all rows at once, so drafting for a batch of sequences costs about one
    /// forward per draft position instead of one per sequence and position.
    pub fn forward_segments(&self, embeds: &Tensor, hidden: &Tensor, segments: &mut [CacheSegment<'_>]) -> Result<HeadOutput> {
        crate::on_compute_pool(embeds.device(), || self.forward_here(embeds, hidden, segments, Outputs::EveryRow))
    }

    /// [`Self::forward_segments`] with one output row per segment, its last: the rows before
    /// it enter the cache as keys and values only. What taking in committed positions needs
    /// (drafting starts from the last one), for a fraction of the layer's work per row.
    pub fn forward_last_rows(&self, embeds: &Tensor, hidden: &Tensor, segments: &mut [CacheSegment<'_>]) -> Result<HeadOutput> {
        crate::on_compute_pool(embeds.device(), || self.forward_here(embeds, hidden, segments, Outputs::LastRow))
    }

    /// [`Self::forward_segments`] on the calling thread, outputs for `outputs`' rows.
    fn forward_here(
        &self,
        embeds: &Tensor,
        hidden: &Tensor,
        segments: &mut [CacheSegment<'_>],
        outputs: Outputs,
    ) -> Result<HeadOutput> {
        let x = Tensor::cat(
            &[
                self.input_layernorm.forward(embeds)?,
                self.hidden_norm.forward(hidden)?,
            ],
            D::Minus1,
        )?;
        let residual = outputs.select(hidden, segments)?;
        let h = (residual + self.attention.forward_segments_for(&x, segments, outputs)?)?;
        let out = (&h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?;
        let logits = self.lm_head.forward(&self.norm.forward(&out)?)?;
        Ok(HeadOutput { hidden: out, logits })
    }

    /// The unrolled training forward (EAGLE-3's training-time test) over one sequence of
    /// `t` target positions: `aux` (t, 3H) their captured layers, `embeds[j]` (t, H) the
    /// embeddings of the tokens step `j` reads (row `i`: the token at `i + 1 + j`). Step 0
    /// reads fused target features; step `j > 0` reads step `j − 1`'s outputs, with the
    /// attention a chain of drafts would see (gradients flow through every step).
    pub fn forward_ttt(&self, aux: &Tensor, embeds: &[Tensor]) -> Result<Vec<HeadOutput>> {
        self.forward_ttt_from(aux, embeds, 0)
    }

    /// [`Self::forward_ttt`] computing only rows `first..` (every output has `t − first`
    /// rows): the rows before serve as step 0's keys and values alone. Training skips the
    /// prompt rows this way, whose predictions are never scored: they cost `fc` and the key
    /// and value projections instead of the whole layer at every step.
    pub fn forward_ttt_from(&self, aux: &Tensor, embeds: &[Tensor], first: usize) -> Result<Vec<HeadOutput>> {
        let t = aux.dim(0)?;
        ensure!(first < t, "first row {first} of a {t}-row sequence");
        let rows = t - first;
        let mut hidden = self.fuse(aux)?;
        let mut steps = Vec::with_capacity(embeds.len());
        let mut outputs = Vec::with_capacity(embeds.len());
        for (step, embed) in embeds.iter().enumerate() {
            let embed = match step {
                0 => embed.clone(),
                _ => embed.narrow(0, first, rows)?,
            };
            let x = Tensor::cat(
                &[self.input_layernorm.forward(&embed)?, self.hidden_norm.forward(&hidden)?],
                D::Minus1,
            )?;
            let residual = match step {
                0 => hidden.narrow(0, first, rows)?,
                _ => hidden.clone(),
            };
            let h = (&residual + self.attention.forward_ttt(&x, step, &mut steps, first)?)?;
            let out = (&h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?;
            let logits = self.lm_head.forward(&self.norm.forward(&out)?)?;
            hidden = out.clone();
            outputs.push(HeadOutput { hidden: out, logits });
        }
        Ok(outputs)
    }

    /// The target token id of draft id `draft`.
    pub fn target_id(&self, draft: u32) -> u32 {
        match &self.draft_to_target {
            Some(map) => map[draft as usize],
            None => draft,
        }
    }

    /// The best draft of one row of logits, as a target token id.
    pub fn greedy_target_id(&self, logits_row: &Tensor) -> Result<u32> {
        let best = logits_row.argmax(D::Minus1)?.to_scalar::<u32>()?;
        Ok(self.target_id(best))
    }

    /// Refuse a head made for another target: by its recorded fingerprint when it has one,
    /// else by hidden size and vocabulary. The message names both models.
    pub fn check_target(&self, head: &str, target: &ModelFingerprint) -> Result<()> {
        let c = &self.config;
        check_head_target("EAGLE-3", head, c.verdict_target.as_ref(), c.target_hidden(), c.vocab_size, target)
    }
}

/// Write a head as other engines load it: `dir/config.json` and `dir/model.safetensors`
/// with the trained tensors of `varmap` plus `d2t` and `t2d` when the vocabulary is reduced.
pub fn save_checkpoint(
    dir: &Path,
    config: &Eagle3Config,
    varmap: &candle_nn::VarMap,
    draft_to_target: Option<&[u32]>,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut tensors = std::collections::HashMap::new();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        tensors.insert(name.clone(), var.as_tensor().to_dtype(dtype)?);
    }
    if let Some(used) = draft_to_target {
        let (d2t, t2d) = vocab_maps(used, config.vocab_size);
        tensors.insert("d2t".into(), Tensor::new(d2t.as_slice(), &Device::Cpu)?);
        tensors.insert("t2d".into(), Tensor::new(t2d.as_slice(), &Device::Cpu)?);
    }
    // Written beside and renamed, so a crash never leaves half a checkpoint under the name.
    let weights = dir.join("model.safetensors");
    let partial = dir.join("model.safetensors.partial");
    candle_core::safetensors::save(&tensors, &partial)?;
    std::fs::rename(&partial, &weights)?;
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config)?)?;
    Ok(())
}

/// `d2t` offsets to target ids, checked: each target id in range and strictly increasing
/// (the reference keeps the draft vocabulary sorted by target id).
pub fn d2t_to_target_ids(d2t: &[i64], vocab_size: usize) -> Result<Vec<u32>> {
    let mut previous = -1i64;
    d2t.iter()
        .enumerate()
        .map(|(draft, &offset)| {
            let target = draft as i64 + offset;
            ensure!(
                target > previous && (target as usize) < vocab_size,
                "d2t[{draft}] = {offset} maps to target id {target}, out of order or outside the vocabulary of {vocab_size}"
            );
            previous = target;
            Ok(target as u32)
        })
        .collect()
}

/// The `d2t` offsets and `t2d` mask of a draft vocabulary given as sorted target ids.
pub fn vocab_maps(used_target_ids: &[u32], vocab_size: usize) -> (Vec<i64>, Vec<u8>) {
    let d2t = used_target_ids
        .iter()
        .enumerate()
        .map(|(i, &t)| t as i64 - i as i64)
        .collect();
    let mut t2d = vec![0u8; vocab_size];
    for &t in used_target_ids {
        t2d[t as usize] = 1;
    }
    (d2t, t2d)
}

#[cfg(test)]
mod tests {
    use candle_core::IndexOp;
    use candle_nn::VarMap;

    use super::*;

    fn tiny_config(draft_vocab: Option<usize>) -> Eagle3Config {
        serde_json::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 16,
            "intermediate_size": 24,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "vocab_size": 40,
            "draft_vocab_size": draft_vocab,
            "tie_word_embeddings": false,
        }))
        .unwrap()
    }

    /// A head with random weights (and, when the vocabulary is reduced, the draft
    /// vocabulary `used`), saved in the reference layout; returns the folder.
    fn saved_head(config: &Eagle3Config, used: Option<&[u32]>) -> (tempfile::TempDir, VarMap) {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        Eagle3Head::new(config.clone(), vb, used.map(<[u32]>::to_vec)).unwrap();
        // Norm weights start at 1: make them differ so a mixed-up norm shows.
        for (name, var) in varmap.data().lock().unwrap().iter() {
            if name.ends_with("norm.weight") {
                let noisy = (var.as_tensor().rand_like(0.5, 1.5)).unwrap();
                var.set(&noisy).unwrap();
            }
        }
        let dir = tempfile::tempdir().unwrap();
        save_checkpoint(dir.path(), config, &varmap, used, DType::F32).unwrap();
        (dir, varmap)
    }

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        // Deterministic values without a global RNG: splitmix64 of (seed, index).
        let values: Vec<f32> = (0..(shape.0 * shape.1) as u64)
            .map(|i| {
                let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i);
                x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                x ^= x >> 31;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    fn fingerprint(source: &str, hidden_size: usize, vocab_size: usize) -> ModelFingerprint {
        ModelFingerprint {
            architecture: "qwen2".into(),
            hidden_size,
            num_layers: 28,
            vocab_size,
            tokenizer_sha256: "0".repeat(64),
            source: source.into(),
        }
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn loads_the_reference_layout_and_maps_draft_ids() {
        let used = [0u32, 3, 7, 8, 20, 39];
        let config = tiny_config(Some(used.len()));
        let (dir, _) = saved_head(&config, Some(&used));
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        assert_eq!(head.config, config);
        let targets: Vec<u32> = (0..used.len() as u32).map(|d| head.target_id(d)).collect();
        assert_eq!(targets, used);
        let out = head
            .forward(&random((2, 16), 1), &random((2, 16), 2), 0, &mut HeadCache::default())
            .unwrap();
        assert_eq!(out.logits.dims(), &[2, used.len()]);
        assert_eq!(out.hidden.dims(), &[2, 16]);
    }

    #[test]
    fn loads_the_vllm_layer_names_too() {
        let config = tiny_config(None);
        let (dir, varmap) = saved_head(&config, None);
        let renamed: std::collections::HashMap<String, Tensor> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.replacen("midlayer.", "layers.0.", 1), v.as_tensor().clone()))
            .collect();
        candle_core::safetensors::save(&renamed, dir.path().join("model.safetensors")).unwrap();
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let reference =
            Eagle3Head::new(config, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), None).unwrap();
        let (e, h) = (random((3, 16), 3), random((3, 16), 4));
        let a = head.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        let b = reference.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        assert_eq!(max_abs_diff(&a.logits, &b.logits), 0.0);
    }

    #[test]
    fn loads_the_reference_pytorch_file_with_its_d2t() {
        let used = [1u32, 2, 9, 30];
        let config = tiny_config(Some(used.len()));
        let (dir, varmap) = saved_head(&config, Some(&used));
        // The same head as `torch.save` writes it: the reference's official checkpoints.
        let mut tensors: Vec<(String, Tensor)> =
            varmap.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
        let (d2t, _) = vocab_maps(&used, config.vocab_size);
        tensors.push(("d2t".into(), Tensor::new(d2t.as_slice(), &Device::Cpu).unwrap()));
        std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
        crate::pth_fixture::save_pth(&tensors, &dir.path().join("pytorch_model.bin"));
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..used.len() as u32).map(|d| head.target_id(d)).collect();
        assert_eq!(targets, used);
        let reference =
            Eagle3Head::new(config, VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), Some(used.to_vec())).unwrap();
        let (e, h) = (random((3, 16), 5), random((3, 16), 6));
        let a = head.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        let b = reference.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        assert_eq!(max_abs_diff(&a.logits, &b.logits), 0.0);
    }

    #[test]
    fn sequences_fed_in_one_call_equal_each_fed_alone() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (e, h) = (random((7, 16), 5), random((7, 16), 6));
        // Sequence a: 3 positions cached, 1 new row; b: 2 new rows from 0; c: 2 cached, 4 new.
        let (mut a, mut b, mut c) = (HeadCache::default(), HeadCache::default(), HeadCache::default());
        head.forward(&random((3, 16), 1), &random((3, 16), 2), 0, &mut a).unwrap();
        head.forward(&random((2, 16), 3), &random((2, 16), 4), 0, &mut c).unwrap();
        let (mut a1, mut b1, mut c1) = (a.clone(), b.clone(), c.clone());
        let together = head
            .forward_segments(
                &e,
                &h,
                &mut [
                    CacheSegment { start: 3, rows: 1, cache: &mut a },
                    CacheSegment { start: 0, rows: 2, cache: &mut b },
                    CacheSegment { start: 2, rows: 4, cache: &mut c },
                ],
            )
            .unwrap();
        let rows = |t: &Tensor, from: usize, n: usize| t.narrow(0, from, n).unwrap();
        let alone = [
            head.forward(&rows(&e, 0, 1), &rows(&h, 0, 1), 3, &mut a1).unwrap(),
            head.forward(&rows(&e, 1, 2), &rows(&h, 1, 2), 0, &mut b1).unwrap(),
            head.forward(&rows(&e, 3, 4), &rows(&h, 3, 4), 2, &mut c1).unwrap(),
        ];
        let stitched = |f: fn(&HeadOutput) -> &Tensor| Tensor::cat(&alone.iter().map(f).collect::<Vec<_>>(), 0).unwrap();
        assert!(max_abs_diff(&together.logits, &stitched(|o| &o.logits)) < 1e-5);
        assert!(max_abs_diff(&together.hidden, &stitched(|o| &o.hidden)) < 1e-5);
        assert_eq!((a.len(), b.len(), c.len()), (4, 2, 6));
        for (x, y) in [(&a, &a1), (&b, &b1), (&c, &c1)] {
            assert!(max_abs_diff(x.keys().unwrap(), y.keys().unwrap()) < 1e-5);
        }
        // Rows that do not add up to the input are refused.
        let mut d = HeadCache::default();
        let err = head
            .forward_segments(&e, &h, &mut [CacheSegment { start: 0, rows: 6, cache: &mut d }])
            .err()
            .unwrap();
        assert!(err.to_string().contains("7 input rows"), "{err}");
    }

    #[test]
    fn last_rows_only_are_the_full_forwards_last_rows_over_the_same_cache() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (e, h) = (random((7, 16), 5), random((7, 16), 6));
        // Sequence a: 3 positions cached, 4 new rows; b: 3 new rows from 0.
        let mut a = HeadCache::default();
        head.forward(&random((3, 16), 1), &random((3, 16), 2), 0, &mut a).unwrap();
        let (mut b, mut a_last, mut b_last) = (HeadCache::default(), a.clone(), HeadCache::default());
        let run = |last_rows: bool, a: &mut HeadCache, b: &mut HeadCache| {
            let segments = &mut [CacheSegment { start: 3, rows: 4, cache: a }, CacheSegment { start: 0, rows: 3, cache: b }];
            match last_rows {
                true => head.forward_last_rows(&e, &h, segments).unwrap(),
                false => head.forward_segments(&e, &h, segments).unwrap(),
            }
        };
        let full = run(false, &mut a, &mut b);
        let last = run(true, &mut a_last, &mut b_last);
        let picked = |t: &Tensor| Tensor::cat(&[t.narrow(0, 3, 1).unwrap(), t.narrow(0, 6, 1).unwrap()], 0).unwrap();
        assert_eq!(last.logits.dims(), &[2, config.vocab_size]);
        assert_eq!(last.hidden.dims(), &[2, 16]);
        assert!(max_abs_diff(&last.logits, &picked(&full.logits)) < 1e-5);
        assert!(max_abs_diff(&last.hidden, &picked(&full.hidden)) < 1e-5);
        // Every row's keys and values entered the cache: the next position reads the same.
        assert_eq!((a_last.len(), b_last.len()), (7, 3));
        assert_eq!(max_abs_diff(a.keys().unwrap(), a_last.keys().unwrap()), 0.0);
        let (e1, h1) = (random((1, 16), 9), random((1, 16), 10));
        let next = head.forward(&e1, &h1, 7, &mut a).unwrap();
        let next_last = head.forward(&e1, &h1, 7, &mut a_last).unwrap();
        assert!(max_abs_diff(&next.logits, &next_last.logits) < 1e-6);
    }

    #[test]
    fn positions_fed_one_call_at_a_time_equal_one_call_for_all() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (e, h) = (random((5, 16), 5), random((5, 16), 6));
        let all = head.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        let mut cache = HeadCache::default();
        let first = head.forward(&e.narrow(0, 0, 3).unwrap(), &h.narrow(0, 0, 3).unwrap(), 0, &mut cache).unwrap();
        let rest = head.forward(&e.narrow(0, 3, 2).unwrap(), &h.narrow(0, 3, 2).unwrap(), 3, &mut cache).unwrap();
        assert_eq!(cache.len(), 5);
        let stitched = Tensor::cat(&[&first.logits, &rest.logits], 0).unwrap();
        assert!(max_abs_diff(&all.logits, &stitched) < 1e-5);
        // A later row sees the earlier ones: changing row 0's token changes row 4.
        let changed = Tensor::cat(&[&random((1, 16), 7), &e.narrow(0, 1, 4).unwrap()], 0).unwrap();
        let other = head
            .forward(&changed, &h, 0, &mut HeadCache::default())
            .unwrap();
        // ... and no row sees a later one: changing row 4's token leaves rows 0..4 alone.
        let last_changed = Tensor::cat(&[&e.narrow(0, 0, 4).unwrap(), &random((1, 16), 8)], 0).unwrap();
        let causal = head.forward(&last_changed, &h, 0, &mut HeadCache::default()).unwrap();
        assert!(max_abs_diff(&all.logits.narrow(0, 0, 4).unwrap(), &causal.logits.narrow(0, 0, 4).unwrap()) < 1e-6);
        assert!(max_abs_diff(&all.logits.i(4).unwrap(), &other.logits.i(4).unwrap()) > 1e-4);
    }

    #[test]
    fn truncating_the_cache_forgets_rejected_drafts() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (e, h) = (random((4, 16), 8), random((4, 16), 9));
        let mut cache = HeadCache::default();
        head.forward(&e.narrow(0, 0, 2).unwrap(), &h.narrow(0, 0, 2).unwrap(), 0, &mut cache).unwrap();
        // Two drafted positions, then rejected.
        head.forward(&random((2, 16), 10), &random((2, 16), 11), 2, &mut cache).unwrap();
        cache.truncate(2).unwrap();
        assert_eq!(cache.len(), 2);
        let after = head.forward(&e.narrow(0, 2, 2).unwrap(), &h.narrow(0, 2, 2).unwrap(), 2, &mut cache).unwrap();
        let fresh = head.forward(&e, &h, 0, &mut HeadCache::default()).unwrap();
        assert!(max_abs_diff(&after.logits, &fresh.logits.narrow(0, 2, 2).unwrap()) < 1e-5);
    }

    #[test]
    fn training_from_a_later_row_computes_the_same_rows() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (t, steps, first) = (7, 3, 4);
        let aux = random((t, 48), 30);
        let embeds: Vec<Tensor> = (0..steps).map(|j| random((t, 16), 31 + j as u64)).collect();
        let all = head.forward_ttt(&aux, &embeds).unwrap();
        let some = head.forward_ttt_from(&aux, &embeds, first).unwrap();
        for j in 0..steps {
            assert_eq!(some[j].logits.dims(), &[t - first, config.draft_vocab()]);
            let diff = max_abs_diff(&some[j].logits, &all[j].logits.narrow(0, first, t - first).unwrap());
            assert!(diff < 1e-5, "step {j}: {diff}");
        }
    }

    #[test]
    fn training_time_test_equals_chain_drafting_with_teacher_forced_tokens() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let (t, steps) = (5, 3);
        let aux = random((t, 48), 20);
        // Embeddings of the tokens at positions 1..=t + steps - 1.
        let token_embeds = random((t + steps - 1, 16), 21);
        let embeds: Vec<Tensor> = (0..steps).map(|j| token_embeds.narrow(0, j, t).unwrap()).collect();
        let unrolled = head.forward_ttt(&aux, &embeds).unwrap();
        let fused = head.fuse(&aux).unwrap();
        for i in 0..t {
            // Commit rows 0..=i from target features, then draft with the true tokens.
            let mut cache = HeadCache::default();
            let committed = head
                .forward(&token_embeds.narrow(0, 0, i + 1).unwrap(), &fused.narrow(0, 0, i + 1).unwrap(), 0, &mut cache)
                .unwrap();
            let mut hidden = committed.hidden.narrow(0, i, 1).unwrap();
            assert!(max_abs_diff(&committed.logits.i(i).unwrap(), &unrolled[0].logits.i(i).unwrap()) < 1e-5);
            for (j, step) in unrolled.iter().enumerate().take(steps).skip(1) {
                let out = head
                    .forward(&token_embeds.narrow(0, i + j, 1).unwrap(), &hidden, i + j, &mut cache)
                    .unwrap();
                let diff = max_abs_diff(&out.logits.squeeze(0).unwrap(), &step.logits.i(i).unwrap());
                assert!(diff < 1e-5, "row {i}, step {j}: {diff}");
                hidden = out.hidden;
            }
        }
    }

    #[test]
    fn a_head_for_another_target_is_refused_naming_both() {
        let config = tiny_config(None);
        let (dir, _) = saved_head(&config, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let qwen = fingerprint("qwen.gguf", 1536, 151936);
        let err = head.check_target("eagle-dir", &qwen).unwrap_err().to_string();
        assert!(err.contains("hidden size 16") && err.contains("1536") && err.contains("qwen.gguf"), "{err}");
        head.check_target("eagle-dir", &fingerprint("tiny", 16, 40)).unwrap();
        // A head that records its target refuses another model of the same shape.
        let mut recorded = config.clone();
        recorded.verdict_target = Some(fingerprint("tiny-a", 16, 40));
        let (dir, _) = saved_head(&recorded, None);
        let head = Eagle3Head::load(dir.path(), &Device::Cpu).unwrap();
        let mut other = fingerprint("tiny-b", 16, 40);
        other.tokenizer_sha256 = "f".repeat(64);
        let err = head.check_target("eagle-dir", &other).unwrap_err().to_string();
        assert!(err.contains("tiny-a") && err.contains("tiny-b"), "{err}");
        head.check_target("eagle-dir", &fingerprint("tiny-a", 16, 40)).unwrap();
    }

    #[test]
    fn vocab_maps_round_trip() {
        let used = [1u32, 2, 5, 9];
        let (d2t, t2d) = vocab_maps(&used, 12);
        assert_eq!(d2t, vec![1, 1, 3, 6]);
        assert_eq!(t2d.iter().map(|&b| b as usize).sum::<usize>(), 4);
        let targets = d2t_to_target_ids(&d2t, 12).unwrap();
        assert_eq!(targets, used);
        for (draft, &target) in targets.iter().enumerate() {
            assert_eq!(t2d[target as usize], 1);
            assert_eq!(t2d[..target as usize].iter().filter(|&&b| b == 1).count(), draft);
        }
        assert!(d2t_to_target_ids(&[0, -1], 12).is_err());
        assert!(d2t_to_target_ids(&[11, 11], 12).is_err());
    }

    #[test]
    fn default_fused_layers_for_a_28_layer_target() {
        assert_eq!(default_aux_layers(28), vec![2, 14, 25]);
        assert_eq!(tiny_config(None).aux_layers(28), vec![2, 14, 25]);
    }
}
