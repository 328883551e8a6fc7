//! Training an EAGLE-3 head on captured target features (training spec §2, §4.3): the
//! unrolled training-time test over every position of a problem, AdamW with warm-up and
//! cosine decay, gradient-norm clipping, checkpoints that resume exactly, validation on
//! held-out problems.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde::{Deserialize, Serialize};
use verdict::proposers::eagle::TokenEmbeddings;
use verdict_heads::{eagle3::save_checkpoint, Eagle3Config, Eagle3Head};

use crate::{
    eagle_adamw::AdamW,
    eagle_capture::SequenceFeatures,
    eagle_loss::{ttt_loss, StepTargets},
};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EagleFitOptions {
    /// Unrolled steps of the training-time test (the chain length it prepares for).
    pub ttt_steps: usize,
    pub epochs: usize,
    /// Peak learning rate, reached after `warmup` of the updates, then cosine to a tenth.
    pub lr: f64,
    pub warmup: f64,
    pub weight_decay: f64,
    /// Problems per optimizer update.
    pub batch: usize,
    pub max_grad_norm: f64,
    pub seed: u64,
    /// Seconds between checkpoints (0: after every update).
    pub checkpoint_secs: u64,
    /// Stop (as a kill would) after this many updates in this call; tests use it.
    #[serde(skip)]
    pub stop_after_updates: Option<usize>,
}

impl Default for EagleFitOptions {
    fn default() -> Self {
        Self {
            ttt_steps: 4,
            epochs: 2,
            lr: 3e-4,
            warmup: 0.05,
            weight_decay: 0.0,
            batch: 4,
            max_grad_norm: 0.5,
            seed: 0,
            checkpoint_secs: 300,
            stop_after_updates: None,
        }
    }
}

/// Where training stands; saved with every checkpoint.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FitProgress {
    pub epoch: usize,
    /// Problems of this epoch's shuffled order already trained on.
    pub position: usize,
    pub updates: usize,
    pub tokens: usize,
    pub seconds: f64,
    /// Held-out accuracy per unrolled step after each finished epoch.
    pub validation: Vec<Vec<f64>>,
}

/// The draft vocabulary: the `size` target ids most frequent among response tokens, with
/// `forced` ids (end of turn, end of text) always in and the lowest unused ids padding when
/// fewer are seen; ascending, as `d2t` needs.
pub fn draft_vocabulary(responses: &[Vec<u32>], size: usize, forced: &[u32], vocab_size: usize) -> Result<Vec<u32>> {
    ensure!(size <= vocab_size && size >= forced.len(), "draft vocabulary of {size} for a vocabulary of {vocab_size} with {} forced ids", forced.len());
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for tokens in responses {
        for &t in tokens {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut by_count: Vec<(u32, usize)> = counts.into_iter().filter(|(t, _)| !forced.contains(t)).collect();
    by_count.sort_by_key(|&(t, n)| (std::cmp::Reverse(n), t));
    let mut used: Vec<u32> = forced.to_vec();
    used.extend(by_count.iter().take(size - forced.len()).map(|&(t, _)| t));
    let missing = size - used.len();
    let filler: Vec<u32> = (0..vocab_size as u32).filter(|t| !used.contains(t)).take(missing).collect();
    used.extend(filler);
    used.sort_unstable();
    Ok(used)
}

/// Share of `responses`' tokens the draft vocabulary `used` (ascending) holds.
pub fn coverage(responses: &[Vec<u32>], used: &[u32]) -> f64 {
    let total: usize = responses.iter().map(Vec::len).sum();
    let hit: usize = responses
        .iter()
        .flatten()
        .filter(|t| used.binary_search(t).is_ok())
        .count();
    hit as f64 / total.max(1) as f64
}

/// One problem prepared for the unrolled forward.
struct Example {
    aux: Tensor,
    /// Step j's input embeddings: row i reads the token at i + 1 + j.
    embeds: Vec<Tensor>,
    /// Labels of rows `first..` (earlier rows predict prompt tokens at every step).
    targets: Vec<StepTargets>,
    first: usize,
    positions: usize,
}

fn prepare(
    f: &SequenceFeatures,
    embeddings: &dyn TokenEmbeddings,
    draft_index: &HashMap<u32, usize>,
    draft_vocab: usize,
    steps: usize,
) -> Result<Example> {
    let t = f.len();
    let device = Device::Cpu;
    let aux = f.aux.to_dtype(DType::F32)?;
    let all = embeddings.embed(&f.tokens)?;
    let hidden = all.dim(1)?;
    // Soft labels per position over the draft vocabulary: the target's best logits that the
    // draft vocabulary holds, renormalised; the mask says the position's next token is a
    // response token and the target's top choice there can be drafted.
    let ids = f.top_ids.to_vec2::<u32>()?;
    let logits = f.top_logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut probs = vec![0f32; t * draft_vocab];
    let mut mask = vec![0f32; t];
    for p in 0..t {
        let row = &mut probs[p * draft_vocab..(p + 1) * draft_vocab];
        let kept: Vec<(usize, f32)> = ids[p]
            .iter()
            .zip(&logits[p])
            .filter_map(|(id, &l)| draft_index.get(id).map(|&d| (d, l)))
            .collect();
        let best = kept.iter().map(|&(_, l)| l).fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = kept.iter().map(|&(_, l)| (l - best).exp()).sum();
        for &(d, l) in &kept {
            row[d] = (l - best).exp() / z;
        }
        let next_is_response = p + 1 >= f.response_start && p + 1 < t;
        if next_is_response && draft_index.contains_key(&ids[p][0]) {
            mask[p] = 1.0;
        }
    }
    let probs = Tensor::from_vec(probs, (t, draft_vocab), &device)?;
    let mask = Tensor::from_vec(mask, t, &device)?;
    let shifted = |x: &Tensor, by: usize| -> Result<Tensor> {
        let width = x.dims()[1..].to_vec();
        let mut pad_shape = vec![by.min(t)];
        pad_shape.extend(&width);
        let pad = Tensor::zeros(pad_shape, x.dtype(), &device)?;
        if by >= t {
            return Ok(pad);
        }
        Ok(Tensor::cat(&[x.narrow(0, by, t - by)?, pad], 0)?)
    };
    // Row i at step j predicts the token at i + 2 + j: no row before this one ever
    // predicts a response token.
    let first = f.response_start.saturating_sub(steps + 1).min(t - 1);
    let mut embeds = Vec::with_capacity(steps);
    let mut targets = Vec::with_capacity(steps);
    for j in 0..steps {
        embeds.push(shifted(&all, j + 1)?);
        targets.push(StepTargets {
            probs: shifted(&probs, j + 1)?.narrow(0, first, t - first)?,
            mask: shifted(&mask.unsqueeze(1)?, j + 1)?.squeeze(1)?.narrow(0, first, t - first)?,
        });
    }
    debug_assert_eq!(embeds[0].dims(), &[t, hidden]);
    Ok(Example { aux, embeds, targets, first, positions: t })
}

/// A head being trained: its variables, optimizer and progress, saved together.
pub struct EagleTrainer {
    pub config: Eagle3Config,
    pub varmap: VarMap,
    pub head: Eagle3Head,
    pub draft_vocab: Vec<u32>,
    draft_index: HashMap<u32, usize>,
    optimizer: AdamW,
    pub progress: FitProgress,
    options: EagleFitOptions,
    embeddings: Arc<dyn TokenEmbeddings>,
    /// What this run trains on, written with every checkpoint (set by `fit`).
    identity: Option<RunIdentity>,
}

/// What a checkpoint was trained on: the head's shape, its draft vocabulary, the training
/// problems and the options that shape the run. Resuming with anything else would mix two
/// runs (the LM head's rows would even name other tokens), so it is refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct RunIdentity {
    head: Eagle3Config,
    draft_vocab: Vec<u32>,
    /// File names of the training problems' features, in order.
    train: Vec<String>,
    /// The options, less how often checkpoints are written.
    options: serde_json::Value,
}

impl RunIdentity {
    /// The parts of `self` that differ from `other`, named for a message.
    fn differences(&self, other: &RunIdentity) -> Vec<String> {
        let mut out = Vec::new();
        if self.head != other.head {
            out.push("the head's config".to_string());
        }
        if self.draft_vocab != other.draft_vocab {
            out.push("the draft vocabulary".to_string());
        }
        if self.train != other.train {
            out.push(format!("the training problems ({} then, {} now)", self.train.len(), other.train.len()));
        }
        if let (Some(then), Some(now)) = (self.options.as_object(), other.options.as_object()) {
            for (key, value) in then {
                if now.get(key) != Some(value) {
                    out.push(format!("{key} ({value} then, {} now)", now.get(key).unwrap_or(&serde_json::Value::Null)));
                }
            }
        }
        out
    }
}

impl EagleTrainer {
    /// A fresh head (PyTorch-style initialisation; `lm_head` from the target's embedding
    /// rows of the draft vocabulary, which the tied target uses as its LM head), or the one
    /// in `checkpoint` when it exists.
    pub fn new(
        config: Eagle3Config,
        draft_vocab: Vec<u32>,
        embeddings: Arc<dyn TokenEmbeddings>,
        options: EagleFitOptions,
        checkpoint: &Path,
    ) -> Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let head = Eagle3Head::new(config.clone(), vb, Some(draft_vocab.clone()))?;
        {
            let mut rng = StdRng::seed_from_u64(options.seed);
            let vars = varmap.data().lock().unwrap();
            let mut names: Vec<&String> = vars.keys().collect();
            names.sort();
            for name in names {
                let var = &vars[name];
                if name == "lm_head.weight" {
                    var.set(&embeddings.embed(&draft_vocab)?)?;
                } else if let [rows, cols] = var.dims() {
                    let bound = 1.0 / (*cols as f64).sqrt();
                    let data: Vec<f32> = (0..rows * cols)
                        .map(|_| rand::Rng::random_range(&mut rng, -bound..bound) as f32)
                        .collect();
                    var.set(&Tensor::from_vec(data, (*rows, *cols), &Device::Cpu)?)?;
                }
            }
        }
        let named: Vec<(String, candle_core::Var)> = varmap
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let optimizer = AdamW::new(named, 0.9, 0.95, options.weight_decay)?;
        let draft_index = draft_vocab.iter().enumerate().map(|(d, &t)| (t, d)).collect();
        let mut trainer = Self {
            config,
            varmap,
            head,
            draft_vocab,
            draft_index,
            optimizer,
            progress: FitProgress::default(),
            options,
            embeddings,
            identity: None,
        };
        if checkpoint.join("state.json").is_file() {
            trainer.restore(checkpoint)?;
        }
        Ok(trainer)
    }

    fn restore(&mut self, dir: &Path) -> Result<()> {
        self.varmap.load(dir.join("head.safetensors"))?;
        self.optimizer.load_state(&dir.join("adam.safetensors"))?;
        let text = std::fs::read_to_string(dir.join("state.json"))?;
        self.progress = serde_json::from_str(&text).context("checkpoint state.json")?;
        tracing::info!(
            "resuming EAGLE training at epoch {}, problem {} of it, update {}",
            self.progress.epoch,
            self.progress.position,
            self.progress.updates
        );
        Ok(())
    }

    /// Record what this run trains on, and refuse to go on from a checkpoint that trained
    /// on something else, naming what differs.
    fn check_identity(&mut self, train: &[PathBuf], checkpoint_dir: &Path) -> Result<()> {
        let mut options = serde_json::to_value(&self.options)?;
        if let Some(o) = options.as_object_mut() {
            o.remove("checkpoint_secs");
        }
        let now = RunIdentity {
            head: self.config.clone(),
            draft_vocab: self.draft_vocab.clone(),
            train: train
                .iter()
                .map(|p| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned()))
                .collect(),
            options,
        };
        let recorded = checkpoint_dir.join("identity.json");
        if recorded.is_file() {
            let then: RunIdentity = serde_json::from_str(&std::fs::read_to_string(&recorded)?)
                .with_context(|| format!("cannot read {}", recorded.display()))?;
            let differences = then.differences(&now);
            ensure!(
                differences.is_empty(),
                "the EAGLE checkpoint in {} was trained with another {}; resume with the same data and flags, or move {} away to start over",
                checkpoint_dir.display(),
                differences.join(", "),
                checkpoint_dir.display()
            );
        } else if self.progress.updates > 0 {
            tracing::warn!(
                "the EAGLE checkpoint in {} does not record what it trained on (written before this check existed); resuming",
                checkpoint_dir.display()
            );
        }
        self.identity = Some(now);
        Ok(())
    }

    /// Write the checkpoint to `dir` whole or not at all (a folder beside, then swapped).
    pub fn checkpoint(&self, dir: &Path) -> Result<()> {
        let partial = dir.with_extension("partial");
        let old = dir.with_extension("old");
        let _ = std::fs::remove_dir_all(&partial);
        std::fs::create_dir_all(&partial)?;
        self.varmap.save(partial.join("head.safetensors"))?;
        self.optimizer.save_state(&partial.join("adam.safetensors"))?;
        std::fs::write(partial.join("state.json"), serde_json::to_string_pretty(&self.progress)?)?;
        if let Some(identity) = &self.identity {
            std::fs::write(partial.join("identity.json"), serde_json::to_string(identity)?)?;
        }
        let _ = std::fs::remove_dir_all(&old);
        if dir.exists() {
            std::fs::rename(dir, &old)?;
        }
        std::fs::rename(&partial, dir)?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    fn example(&self, path: &Path) -> Result<Example> {
        let f = SequenceFeatures::load(path)?;
        prepare(&f, &*self.embeddings, &self.draft_index, self.draft_vocab.len(), self.options.ttt_steps)
    }

    fn learning_rate(&self, total_updates: usize) -> f64 {
        let o = &self.options;
        let warmup = ((total_updates as f64 * o.warmup).ceil() as usize).max(1);
        let u = self.optimizer.step;
        if u < warmup {
            return o.lr * (u + 1) as f64 / warmup as f64;
        }
        let progress = (u - warmup) as f64 / (total_updates.saturating_sub(warmup)).max(1) as f64;
        let floor = o.lr * 0.1;
        floor + (o.lr - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
    }

    /// Train on `train` (feature files) for the configured epochs, resuming where the
    /// checkpoint in `checkpoint_dir` stopped; validate on `validation` after each epoch.
    /// Returns false when stopped early by `stop_after_updates`.
    pub fn fit(&mut self, train: &[PathBuf], validation: &[PathBuf], checkpoint_dir: &Path) -> Result<bool> {
        ensure!(!train.is_empty(), "no training problems");
        self.check_identity(train, checkpoint_dir)?;
        let o = self.options.clone();
        let per_epoch = train.len().div_ceil(o.batch);
        let total_updates = per_epoch * o.epochs;
        let bar = ProgressBar::new((train.len() * o.epochs) as u64).with_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} problems  {elapsed} < {eta}  {msg}")?,
        );
        bar.set_position((self.progress.epoch * train.len() + self.progress.position) as u64);
        let mut last_checkpoint = Instant::now();
        let mut updates_now = 0;
        while self.progress.epoch < o.epochs {
            let mut order: Vec<usize> = (0..train.len()).collect();
            order.shuffle(&mut StdRng::seed_from_u64(o.seed.wrapping_add(self.progress.epoch as u64)));
            while self.progress.position < order.len() {
                let started = Instant::now();
                let chunk = &order[self.progress.position..(self.progress.position + o.batch).min(order.len())];
                let mut loss_sum: Option<Tensor> = None;
                let mut accuracy = vec![0.0; o.ttt_steps];
                for &i in chunk {
                    let ex = self.example(&train[i])?;
                    let outputs = self.head.forward_ttt_from(&ex.aux, &ex.embeds, ex.first)?;
                    let (loss, acc) = ttt_loss(&outputs, &ex.targets)?;
                    for (a, b) in accuracy.iter_mut().zip(&acc) {
                        *a += b / chunk.len() as f64;
                    }
                    self.progress.tokens += ex.positions;
                    let loss = (loss / chunk.len() as f64)?;
                    loss_sum = Some(match loss_sum {
                        None => loss,
                        Some(s) => (s + loss)?,
                    });
                }
                let loss = loss_sum.expect("a non-empty chunk");
                let mut grads = loss.backward()?;
                self.optimizer.clip_grad_norm(&mut grads, o.max_grad_norm)?;
                let lr = self.learning_rate(total_updates);
                self.optimizer.apply(&grads, lr)?;
                self.progress.position += chunk.len();
                self.progress.updates += 1;
                self.progress.seconds += started.elapsed().as_secs_f64();
                updates_now += 1;
                bar.inc(chunk.len() as u64);
                let status = format!(
                    "loss {:.3}  acc/step {}  lr {lr:.1e}",
                    loss.to_scalar::<f32>()?,
                    accuracy.iter().map(|a| format!("{a:.2}")).collect::<Vec<_>>().join(" ")
                );
                bar.set_message(status.clone());
                if last_checkpoint.elapsed() >= Duration::from_secs(o.checkpoint_secs) {
                    self.checkpoint(checkpoint_dir)?;
                    last_checkpoint = Instant::now();
                    // The bar draws only on a terminal; a log gets this line per checkpoint.
                    tracing::info!(
                        "checkpoint: epoch {}, {}/{} problems, {:.0} s trained; last update: {status}",
                        self.progress.epoch + 1,
                        self.progress.position,
                        train.len(),
                        self.progress.seconds
                    );
                }
                if o.stop_after_updates == Some(updates_now) {
                    self.checkpoint(checkpoint_dir)?;
                    bar.abandon();
                    return Ok(false);
                }
            }
            let accuracy = self.validate(validation)?;
            tracing::info!("epoch {} held-out accuracy per step: {accuracy:.3?}", self.progress.epoch);
            self.progress.validation.push(accuracy);
            self.progress.epoch += 1;
            self.progress.position = 0;
            self.checkpoint(checkpoint_dir)?;
            last_checkpoint = Instant::now();
        }
        bar.finish_and_clear();
        Ok(true)
    }

    /// Per unrolled step, the share of held-out masked positions whose arg-max matches the
    /// target's.
    pub fn validate(&self, problems: &[PathBuf]) -> Result<Vec<f64>> {
        let steps = self.options.ttt_steps;
        let (mut hits, mut counted) = (vec![0.0; steps], vec![0.0; steps]);
        for path in problems {
            let ex = self.example(path)?;
            let outputs = self.head.forward_ttt_from(&ex.aux, &ex.embeds, ex.first)?;
            for (j, (out, target)) in outputs.iter().zip(&ex.targets).enumerate() {
                let agree = out.logits.argmax(D::Minus1)?.eq(&target.probs.argmax(D::Minus1)?)?.to_dtype(DType::F32)?;
                hits[j] += (agree * &target.mask)?.sum_all()?.to_scalar::<f32>()? as f64;
                counted[j] += target.mask.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        Ok(hits.iter().zip(&counted).map(|(h, c)| h / c.max(1.0)).collect())
    }

    /// The head in the layout other engines load (`config.json`, `model.safetensors`), its
    /// matrices stored as `dtype` (f16 halves the file; the runtime computes in f32).
    pub fn save_head(&self, dir: &Path, dtype: DType) -> Result<()> {
        save_checkpoint(dir, &self.config, &self.varmap, Some(&self.draft_vocab), dtype)
    }
}

/// Expected tokens per verify forward of a chain whose step k is right with probability
/// `accuracy[k]` given the earlier ones: 1 + Σ_k Π_{j ≤ k} acc_j (an estimate: the steps'
/// accuracies are measured with earlier tokens teacher-forced).
pub fn estimated_tau(accuracy: &[f64]) -> f64 {
    let mut run = 1.0;
    let mut tau = 1.0;
    for a in accuracy {
        run *= a;
        tau += run;
    }
    tau
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_keeps_forced_and_frequent_ids_sorted() {
        let responses = vec![vec![9, 9, 9, 4, 4, 7], vec![4, 2]];
        let used = draft_vocabulary(&responses, 4, &[11], 20).unwrap();
        // 4 and 9 three times each, then 2 before 7 (one each: the lower id wins), and 11.
        assert_eq!(used, vec![2, 4, 9, 11]);
        // Fewer distinct ids than asked: the lowest unused ids pad.
        assert_eq!(draft_vocabulary(&[vec![5]], 3, &[], 10).unwrap(), vec![0, 1, 5]);
        // 9 three times, 4 three times (once in the second response): 6 of 8 tokens.
        assert!((coverage(&responses, &[4, 9]) - 6.0 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn tau_estimate_multiplies_step_accuracies() {
        assert!((estimated_tau(&[0.5, 0.5]) - 1.75).abs() < 1e-12);
        assert_eq!(estimated_tau(&[]), 1.0);
    }
}
