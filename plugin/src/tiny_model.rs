//! Tiny random-weight Llama and Qwen2 models written as safetensors folders, so tests
//! exercise the real mistral.rs loaders and forwards without any download. Compiled only
//! for tests (the `test-support` feature), never into a deployment.

use std::{collections::HashMap, path::Path};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::json;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TinyArch {
    Llama,
    Qwen2,
}

#[derive(Clone, Debug)]
pub struct TinySpec {
    pub arch: TinyArch,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    /// Words (see [`word`]) besides the special tokens and role names.
    pub words: usize,
    pub seed: u64,
    /// Make the model emit the EOS token `<|im_end|>` wherever it would emit this word, so
    /// a test can place an EOS mid-sequence. `None`: EOS is `<|endoftext|>`.
    pub eos_word: Option<usize>,
    /// Make this word's token the byte 0xC3 alone (`Ã` under the byte-level decoder): the
    /// first half of a two-byte character, so a test can end an answer inside a character.
    /// The weights do not change: the model emits the token where it emitted the word.
    pub half_character_word: Option<usize>,
}

impl TinySpec {
    pub fn new(arch: TinyArch, seed: u64) -> Self {
        Self {
            arch,
            hidden_size: 32,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            intermediate_size: 64,
            words: 56,
            seed,
            eos_word: None,
            half_character_word: None,
        }
    }
}

/// Special tokens first, then role names, then `w0..`. Words carry the byte-level space
/// marker `Ġ`: mistral.rs's grammar support needs a byte-level (or byte-fallback) tokenizer.
const SPECIAL: [&str; 4] = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const ROLES: [&str; 3] = ["Ġsystem", "Ġuser", "Ġassistant"];
const IM_END: usize = 3;
/// Id of word 0.
pub const FIRST_WORD_ID: usize = SPECIAL.len() + ROLES.len();

/// The text of word `i`: letters only (`waa`, `wab`, …), so the byte-level pre-tokenizer's
/// regex keeps each word whole.
pub fn word(i: usize) -> String {
    format!(
        "w{}{}",
        (b'a' + (i / 26) as u8) as char,
        (b'a' + (i % 26) as u8) as char
    )
}

/// Inverse of [`word`].
pub fn word_index(text: &str) -> Option<usize> {
    let b = text.strip_prefix('w')?.as_bytes();
    match b {
        [hi @ b'a'..=b'z', lo @ b'a'..=b'z'] => {
            Some(((hi - b'a') as usize) * 26 + (lo - b'a') as usize)
        }
        _ => None,
    }
}

/// A prompt of the given words.
pub fn words(ids: &[usize]) -> String {
    ids.iter().map(|&i| word(i)).collect::<Vec<_>>().join(" ")
}

pub fn vocab(spec: &TinySpec) -> Vec<String> {
    SPECIAL
        .iter()
        .chain(ROLES.iter())
        .map(|s| s.to_string())
        .chain((0..spec.words).map(|i| match spec.half_character_word {
            Some(w) if w == i => "Ã".to_string(),
            _ => format!("Ġ{}", word(i)),
        }))
        .collect()
}

/// Deterministic pseudo-random weights: a small LCG keeps the generator free of RNG-crate
/// version drift, so a seed means the same model forever.
struct Lcg(u64);

impl Lcg {
    fn normal(&mut self) -> f32 {
        // Sum of 4 uniforms, centred and scaled: close enough to N(0, 1) for random weights.
        let mut sum = 0.0;
        for _ in 0..4 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            sum += (self.0 >> 40) as f32 / (1u64 << 24) as f32;
        }
        (sum - 2.0) * (3.0f32).sqrt()
    }

    fn tensor(&mut self, shape: &[usize], std: f32) -> Result<Tensor> {
        let n = shape.iter().product();
        let data: Vec<f32> = (0..n).map(|_| self.normal() * std).collect();
        Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
    }
}

/// Write `config.json`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`
/// and `model.safetensors` for `spec` into `dir`.
pub fn write_tiny_model(spec: &TinySpec, dir: &Path) -> Result<()> {
    write_tiny_model_perturbed(spec, dir, None)
}

/// Like [`write_tiny_model`], with every weight of `base` plus noise of std `noise`: a draft
/// that agrees with its target often but not always.
pub fn write_tiny_model_perturbed(
    spec: &TinySpec,
    dir: &Path,
    perturb: Option<(u64, f32)>,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let vocab = vocab(spec);
    let v = vocab.len();
    let h = spec.hidden_size;
    let head_dim = h / spec.heads;
    let kv = spec.kv_heads * head_dim;
    let mut rng = Lcg(spec.seed);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    // Large embedding and head scales give well-separated logits, so greedy decoding is not
    // decided by float rounding between batched and single-token forwards.
    tensors.insert(
        "model.embed_tokens.weight".into(),
        rng.tensor(&[v, h], 1.0)?,
    );
    let mut lm_head = rng.tensor(&[v, h], 1.0)?;
    if let Some(w) = spec.eos_word {
        // <|im_end|>'s row: the word's row scaled by 1.001, so its logit wins exactly where
        // the word's would (a positive maximum) and barely moves anything else.
        let word_row = lm_head
            .narrow(0, FIRST_WORD_ID + w, 1)?
            .affine(1.001, 0.0)?;
        lm_head = lm_head.slice_assign(&[IM_END..IM_END + 1, 0..h], &word_row)?;
    }
    tensors.insert("lm_head.weight".into(), lm_head);
    tensors.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, &Device::Cpu)?,
    );
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        let std = 0.2;
        for (name, shape) in [
            ("self_attn.q_proj", [h, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, h]),
            ("mlp.gate_proj", [spec.intermediate_size, h]),
            ("mlp.up_proj", [spec.intermediate_size, h]),
            ("mlp.down_proj", [h, spec.intermediate_size]),
        ] {
            tensors.insert(format!("{p}.{name}.weight"), rng.tensor(&shape, std)?);
        }
        if spec.arch == TinyArch::Qwen2 {
            for (name, n) in [("q_proj", h), ("k_proj", kv), ("v_proj", kv)] {
                tensors.insert(format!("{p}.self_attn.{name}.bias"), rng.tensor(&[n], 0.1)?);
            }
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            tensors.insert(
                format!("{p}.{norm}.weight"),
                Tensor::ones(h, DType::F32, &Device::Cpu)?,
            );
        }
    }
    if let Some((seed, noise)) = perturb {
        let mut noise_rng = Lcg(seed);
        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        for name in names {
            let t = &tensors[&name];
            let shape = t.dims().to_vec();
            let scale = t.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?.max(1e-3);
            let perturbed = (t + noise_rng.tensor(&shape, noise * scale)?)?;
            tensors.insert(name, perturbed);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;

    let eos_id = if spec.eos_word.is_some() { IM_END } else { 1 };
    let mut config = json!({
        "architectures": [match spec.arch { TinyArch::Llama => "LlamaForCausalLM", TinyArch::Qwen2 => "Qwen2ForCausalLM" }],
        "model_type": match spec.arch { TinyArch::Llama => "llama", TinyArch::Qwen2 => "qwen2" },
        "vocab_size": v,
        "hidden_size": h,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "bos_token_id": 2,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    });
    if spec.arch == TinyArch::Qwen2 {
        config["sliding_window"] = serde_json::Value::Null;
        config["use_sliding_window"] = json!(false);
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&json!({"bos_token_id": 2, "eos_token_id": eos_id}))?,
    )?;

    let vocab_map: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = SPECIAL
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "<unk>"},
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_string_pretty(&tokenizer)?,
    )?;
    let tokenizer_config = json!({
        "bos_token": "<|im_start|>",
        "eos_token": SPECIAL[eos_id],
        "unk_token": "<unk>",
        "model_max_length": 512,
        "chat_template": "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}",
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config)?,
    )?;
    Ok(())
}

/// Write a random EAGLE-3 head for the tiny target of `spec` into `dir` (seeded, so a test
/// sees the same head every run): drafting over `draft_vocab` (target ids, ascending),
/// fusing the inputs of target layers `aux_layers` (1..=layers).
pub fn write_tiny_eagle3_head(
    spec: &TinySpec,
    dir: &Path,
    draft_vocab: &[u32],
    aux_layers: [usize; 3],
    seed: u64,
) -> Result<()> {
    use candle_nn::{VarBuilder, VarMap};
    use verdict_heads::{eagle3::save_checkpoint, Eagle3Config, Eagle3Head};

    let config: Eagle3Config = serde_json::from_value(json!({
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "vocab_size": vocab(spec).len(),
        "draft_vocab_size": draft_vocab.len(),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers},
    }))?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    Eagle3Head::new(config.clone(), vb, Some(draft_vocab.to_vec()))?;
    let mut rng = Lcg(seed);
    let vars = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    for name in names {
        let var = &vars[name];
        // Matrices N(0, 1/fan_in); norm weights stay 1.
        if let [rows, cols] = var.dims() {
            var.set(&rng.tensor(&[*rows, *cols], (*cols as f32).powf(-0.5))?)?;
        }
    }
    drop(vars);
    save_checkpoint(dir, &config, &varmap, Some(draft_vocab), DType::F32)
}

/// A randomly initialised EAGLE-3 head (width `hidden`, 4 heads, 2 KV heads, MLP 24) whose
/// draft ids map to `draft_ids`, with random (vocab, hidden) embeddings: for unit tests of
/// drafting, which need no saved head.
pub fn random_eagle3_head(
    hidden: usize,
    vocab: usize,
    draft_ids: Vec<u32>,
) -> Result<(verdict_heads::Eagle3Head, crate::proposers::eagle::DenseEmbeddings)> {
    let config: verdict_heads::Eagle3Config = serde_json::from_value(json!({
        "hidden_size": hidden, "intermediate_size": 24, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": vocab, "draft_vocab_size": draft_ids.len(),
    }))?;
    let varmap = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let head = verdict_heads::Eagle3Head::new(config, vb, Some(draft_ids))?;
    let embeddings = Tensor::randn(0f32, 1.0, (vocab, hidden), &Device::Cpu)?;
    Ok((head, crate::proposers::eagle::DenseEmbeddings(embeddings)))
}
