//! EAGLE-1 draft head (arXiv 2401.15077), the layout of the reference's `cnets1.py` and of
//! the official `EAGLE-*` checkpoints (`fc`, `layers.0.*`, a Llama `config.json`):
//!
//! ```text
//! x    = fc(embed(t_{i+1}) ⊕ f_i)                 2H → H, bias when the checkpoint has one
//! h    = x + o_proj(attn(q(x), k(x), v(x)))       layer 0 has no input_layernorm
//! f̂    = h + mlp(post_attention_layernorm(h))     the predicted next feature
//! ```
//! `f_i` is the target's last hidden state after its final norm (the LM head's input), and
//! `f̂` is decoded by the target's own, frozen LM head, so the head holds neither the
//! embeddings nor an LM head (an `embed_tokens.weight` in the file is ignored).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Module, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::{
    decoder_layer::{head_norm, open_weights, read_config, Attention, AttentionShape, HeadCache, HeadNorm, Mlp},
    fingerprint::{check_head_target, ModelFingerprint},
    projection::{projection, Projection},
};

/// The keys of an EAGLE-1 checkpoint's (Llama) `config.json` that the head reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Eagle1Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// The target's vocabulary (the head decodes through the target's LM head).
    pub vocab_size: usize,
    #[serde(default = "one")]
    pub num_hidden_layers: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Verdict's record of the target the head was trained on; see `Eagle3Config`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict_target: Option<ModelFingerprint>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn one() -> usize {
    1
}
fn default_act() -> String {
    "silu".into()
}

impl Eagle1Config {
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn validate(&self) -> Result<()> {
        ensure!(self.num_hidden_layers == 1, "EAGLE-1 heads have one layer, config says {}", self.num_hidden_layers);
        ensure!(self.hidden_act == "silu", "hidden_act {:?}: only silu is supported", self.hidden_act);
        ensure!(
            self.num_attention_heads.is_multiple_of(self.kv_heads()),
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            self.num_attention_heads,
            self.kv_heads()
        );
        Ok(())
    }
}

/// Which optional biases a checkpoint carries; the files say it more reliably than the
/// configs (the reference's `bias` key defaults to true, Qwen2 heads add q/k/v biases).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Eagle1Biases {
    pub fc: bool,
    pub qkv: bool,
}

pub struct Eagle1Head {
    pub config: Eagle1Config,
    fc: Projection,
    attention: Attention,
    post_attention_layernorm: HeadNorm,
    mlp: Mlp,
}

impl Eagle1Head {
    pub fn new(config: Eagle1Config, biases: Eagle1Biases, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        let h = config.hidden_size;
        let layer = vb.pp("layers.0");
        Ok(Self {
            fc: projection(2 * h, h, biases.fc, vb.pp("fc"))?,
            attention: Attention::new(
                &AttentionShape {
                    input: h,
                    output: h,
                    heads: config.num_attention_heads,
                    kv_heads: config.kv_heads(),
                    head_dim: config.head_dim(),
                    rope_theta: config.rope_theta,
                    qkv_bias: biases.qkv,
                },
                layer.pp("self_attn"),
            )?,
            post_attention_layernorm: head_norm(h, config.rms_norm_eps, layer.pp("post_attention_layernorm"))?,
            mlp: Mlp::new(h, config.intermediate_size, layer.pp("mlp"))?,
            config,
        })
    }

    /// Load `dir/config.json` and `dir/model.safetensors` (or `pytorch_model.bin`).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let config: Eagle1Config = read_config(dir, "EAGLE-1")?;
        let vb = open_weights(dir, device)?;
        if !vb.contains_tensor("layers.0.self_attn.q_proj.weight") || !vb.contains_tensor("fc.weight") {
            let hint = match vb.contains_tensor("midlayer.self_attn.q_proj.weight") {
                true => " (it has midlayer.* tensors: an EAGLE-3 head)",
                false => "",
            };
            bail!("{}: no fc and layers.0.* tensors: not an EAGLE-1 head{hint}", dir.display());
        }
        let biases = Eagle1Biases {
            fc: vb.contains_tensor("fc.bias"),
            qkv: vb.contains_tensor("layers.0.self_attn.q_proj.bias"),
        };
        Self::new(config, biases, vb)
            .with_context(|| format!("cannot load the EAGLE-1 head in {}", dir.display()))
    }

    /// Predicted features of `t` rows at positions `start..start + t`: `embeds` (t, H) the
    /// target's embeddings of the tokens after each position, `features` (t, H) the target's
    /// post-norm last hidden states there, or the head's own earlier predictions.
    pub fn forward(&self, embeds: &Tensor, features: &Tensor, start: usize, cache: &mut HeadCache) -> Result<Tensor> {
        let x = self.fc.forward(&Tensor::cat(&[embeds, features], D::Minus1)?)?;
        let h = (&x + self.attention.forward(&x, start, cache)?)?;
        Ok((&h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)
    }

    /// Refuse a head made for another target, naming both.
    pub fn check_target(&self, head: &str, target: &ModelFingerprint) -> Result<()> {
        let c = &self.config;
        check_head_target("EAGLE-1", head, c.verdict_target.as_ref(), c.hidden_size, c.vocab_size, target)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::DType;
    use candle_nn::VarMap;

    use super::*;
    use crate::pth_fixture::save_pth;

    fn tiny_config() -> Eagle1Config {
        serde_json::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 16,
            "intermediate_size": 24,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "vocab_size": 40,
            "bias": true,
        }))
        .unwrap()
    }

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        let values: Vec<f32> = (0..(shape.0 * shape.1) as u64)
            .map(|i| ((seed * 7919 + i * 104_729) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    /// A head with random weights and both kinds of bias, plus the target embedding the
    /// official checkpoints carry; the tensors as a file would hold them.
    fn random_head() -> (Eagle1Head, Vec<(String, Tensor)>) {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let head = Eagle1Head::new(tiny_config(), Eagle1Biases { fc: true, qkv: true }, vb).unwrap();
        let mut tensors: Vec<(String, Tensor)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(name, var)| {
                let t = var.as_tensor();
                // Biases and norms start at 0 and 1: make them differ so a dropped one shows.
                if name.ends_with("bias") || name.ends_with("norm.weight") {
                    var.set(&t.rand_like(0.5, 1.5).unwrap()).unwrap();
                }
                (name.clone(), var.as_tensor().copy().unwrap())
            })
            .collect();
        tensors.push(("embed_tokens.weight".into(), random((40, 16), 9)));
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        (head, tensors)
    }

    fn write_config(dir: &Path) {
        std::fs::write(dir.join("config.json"), serde_json::to_string(&tiny_config()).unwrap()).unwrap();
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn loads_the_reference_layout_from_safetensors_and_from_pytorch_files() {
        let (reference, tensors) = random_head();
        let (e, f) = (random((3, 16), 1), random((3, 16), 2));
        let expected = reference.forward(&e, &f, 0, &mut HeadCache::default()).unwrap();

        let safetensors = tempfile::tempdir().unwrap();
        write_config(safetensors.path());
        let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
        candle_core::safetensors::save(&map, safetensors.path().join("model.safetensors")).unwrap();
        let pytorch = tempfile::tempdir().unwrap();
        write_config(pytorch.path());
        save_pth(&tensors, &pytorch.path().join("pytorch_model.bin"));

        for dir in [safetensors.path(), pytorch.path()] {
            let head = Eagle1Head::load(dir, &Device::Cpu).unwrap();
            let out = head.forward(&e, &f, 0, &mut HeadCache::default()).unwrap();
            assert_eq!(out.dims(), &[3, 16]);
            assert_eq!(max_abs_diff(&out, &expected), 0.0, "{}", dir.display());
        }
    }

    #[test]
    fn the_layer_is_fc_then_attention_then_mlp_with_residuals() {
        // With o_proj and down_proj zero, attention and MLP add nothing: the output is
        // fc([e ⊕ f]) + bias, computed here by hand.
        let (_, mut tensors) = random_head();
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                *t = t.zeros_like().unwrap();
            }
        }
        let map: HashMap<String, Tensor> = tensors.iter().cloned().collect();
        let vb = VarBuilder::from_tensors(map.clone(), DType::F32, &Device::Cpu);
        let head = Eagle1Head::new(tiny_config(), Eagle1Biases { fc: true, qkv: true }, vb).unwrap();
        let (e, f) = (random((2, 16), 3), random((2, 16), 4));
        let out = head.forward(&e, &f, 0, &mut HeadCache::default()).unwrap().to_vec2::<f32>().unwrap();
        let (w, b) = (map["fc.weight"].to_vec2::<f32>().unwrap(), map["fc.bias"].to_vec1::<f32>().unwrap());
        let (e, f) = (e.to_vec2::<f32>().unwrap(), f.to_vec2::<f32>().unwrap());
        for row in 0..2 {
            let input: Vec<f32> = e[row].iter().chain(&f[row]).copied().collect();
            for o in 0..16 {
                let want = b[o] + w[o].iter().zip(&input).map(|(a, x)| a * x).sum::<f32>();
                assert!((out[row][o] - want).abs() < 1e-5, "row {row} unit {o}: {} vs {want}", out[row][o]);
            }
        }
    }

    #[test]
    fn positions_fed_one_at_a_time_equal_one_call_and_truncation_forgets() {
        let (head, _) = random_head();
        let (e, f) = (random((4, 16), 5), random((4, 16), 6));
        let all = head.forward(&e, &f, 0, &mut HeadCache::default()).unwrap();
        let mut cache = HeadCache::default();
        for p in 0..4 {
            let one = head.forward(&e.narrow(0, p, 1).unwrap(), &f.narrow(0, p, 1).unwrap(), p, &mut cache).unwrap();
            assert!(max_abs_diff(&one, &all.narrow(0, p, 1).unwrap()) < 1e-5, "position {p}");
        }
        // A rejected draft at position 3 is forgotten; feeding another row there matches a
        // fresh run over the corrected sequence.
        cache.truncate(3).unwrap();
        let other = random((1, 16), 7);
        let redo = head.forward(&e.narrow(0, 3, 1).unwrap(), &other, 3, &mut cache).unwrap();
        let fresh = head
            .forward(&e, &Tensor::cat(&[f.narrow(0, 0, 3).unwrap(), other], 0).unwrap(), 0, &mut HeadCache::default())
            .unwrap();
        assert!(max_abs_diff(&redo, &fresh.narrow(0, 3, 1).unwrap()) < 1e-5);
    }

    #[test]
    fn an_eagle3_folder_and_a_head_for_another_target_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_config(dir.path());
        let map: HashMap<String, Tensor> = [("midlayer.self_attn.q_proj.weight".to_string(), random((16, 32), 1))].into();
        candle_core::safetensors::save(&map, dir.path().join("model.safetensors")).unwrap();
        let err = Eagle1Head::load(dir.path(), &Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("not an EAGLE-1 head") && err.contains("EAGLE-3"), "{err}");

        let (head, _) = random_head();
        let target = ModelFingerprint {
            architecture: "qwen2".into(),
            hidden_size: 1536,
            num_layers: 28,
            vocab_size: 151_936,
            tokenizer_sha256: "0".repeat(64),
            source: "target.gguf".into(),
        };
        let err = head.check_target("heads/e1", &target).err().unwrap().to_string();
        assert!(err.contains("hidden size 16") && err.contains("vocabulary 40") && err.contains("target.gguf"), "{err}");
        let same = ModelFingerprint { hidden_size: 16, vocab_size: 40, ..target };
        head.check_target("heads/e1", &same).unwrap();
    }
}
