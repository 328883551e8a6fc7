//! DropMatch: K Monte-Carlo dropout masks on the target's post-norm hidden state, through
//! the target's own LM head, as K extra "heads" that vote on a draft the base rule refused.
//!
//! Asked only where the base rule rejected (it can only rescue), so its cost — one batched
//! LM-head matmul of K rows plus K + 1 softmaxes — is paid per rejection, not per position.
//! Masks are drawn from a generator keyed by (seed, context, position, head): the context
//! (the tokens before the step) identifies the request and the step, so a run reproduces
//! whatever the batch or the order of requests.
//!
//! With `candidates = N` the heads score only the target's N most likely tokens and the
//! draft: N rows of the LM head read from the target's weights instead of all 151,936, and
//! distributions renormalised over those tokens. Next to an EAGLE step on a CPU the full LM
//! head's K rows and K + 1 full-vocabulary softmaxes are a large share; N rows are not. The votes and JS terms change only by the mass outside the candidates.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use mistralrs_core::speculative_hook::CaptureRequest;
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde::Deserialize;

use super::LoadedFingerprints;
use crate::{
    distribution::argmax,
    divergence::{log_softmax, Divergence},
    judge::Judge,
    proposers::{eagle::TokenEmbeddings, embeddings::target_output_rows},
    step_view::StepView,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
pub enum Criterion {
    /// The draft token is some head's arg-max (Eq. 4).
    #[serde(rename = "naive")]
    Naive,
    /// JS(draft ‖ centroid) ≤ max over heads of JS(head ‖ centroid) (Eq. 6).
    #[serde(rename = "js")]
    Js,
    /// The paper's Algorithm 1: the JS test, or the heads' plurality token is the draft.
    #[default]
    #[serde(rename = "js+majority")]
    JsMajority,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropMatchConfig {
    /// Number of dropout heads.
    #[serde(default = "default_k")]
    pub k: usize,
    /// Dropout probability of each hidden unit.
    #[serde(default = "default_p")]
    pub p: f64,
    #[serde(default)]
    pub criterion: Criterion,
    /// Seed of the mask generator.
    #[serde(default)]
    pub seed: u64,
    /// Score only the target's this many most likely tokens (and the draft); 0: the whole
    /// vocabulary through the target's LM head.
    #[serde(default)]
    pub candidates: usize,
}

fn default_k() -> usize {
    5
}

fn default_p() -> f64 {
    0.3
}

impl DropMatchConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.k >= 1, "k must be at least 1, got {}", self.k);
        ensure!(
            self.k <= 64,
            "k = {} heads is out of range; use 1..=64",
            self.k
        );
        ensure!(
            (0.0..1.0).contains(&self.p),
            "p must be in [0, 1), got {}",
            self.p
        );
        Ok(())
    }
}

pub struct DropMatch {
    config: DropMatchConfig,
    /// The target's LM-head rows, read when `candidates` > 0.
    output_rows: Option<Arc<dyn TokenEmbeddings>>,
}

impl DropMatch {
    /// A judge over the whole vocabulary (`candidates` is ignored).
    pub fn new(config: DropMatchConfig) -> Self {
        Self { config, output_rows: None }
    }

    /// The judge `config` asks for: with `candidates` > 0 it reads the target's LM-head rows
    /// from the target's weights.
    pub fn load(config: DropMatchConfig, models: &LoadedFingerprints) -> Result<Self> {
        if config.candidates == 0 {
            return Ok(Self::new(config));
        }
        let source = models
            .target_source
            .context("candidates > 0 needs the target's weights, and no target file is known")?;
        let rows = target_output_rows(source)
            .with_context(|| format!("candidates = {}: reading the target's LM head", config.candidates))?;
        Ok(Self { config, output_rows: Some(rows) })
    }

    /// `[k, hidden]` inverted-dropout masks: 0 with probability p, else 1 / (1 − p).
    pub fn masks(&self, context: u64, position: usize, hidden: usize) -> Vec<f32> {
        let keep_scale = (1.0 / (1.0 - self.config.p)) as f32;
        let mut out = Vec::with_capacity(self.config.k * hidden);
        for head in 0..self.config.k {
            let key =
                mix(mix(mix(self.config.seed) ^ context) ^ ((position as u64) << 32 | head as u64));
            let mut rng = StdRng::seed_from_u64(key);
            out.extend((0..hidden).map(|_| {
                if rng.random::<f64>() < self.config.p {
                    0.0
                } else {
                    keep_scale
                }
            }));
        }
        out
    }

    /// `[k, hidden]` masked copies of the hidden state that produced the target's logits at
    /// `position`.
    fn masked_hidden(&self, view: &StepView, position: usize) -> Result<Tensor> {
        let hidden = view
            .ctx
            .target_hidden
            .last
            .as_ref()
            .context("DropMatch needs the target's last hidden state; it was not captured")?;
        let h = hidden.get(position)?;
        let d = h.dim(0)?;
        let masks = self.masks(context_key(view.ctx.prefix), position, d);
        let masks = Tensor::from_vec(masks, (self.config.k, d), &Device::Cpu)?
            .to_device(h.device())?
            .to_dtype(h.dtype())?;
        Ok(masks.broadcast_mul(&h.unsqueeze(0)?)?)
    }

    /// The K heads' logits over the whole vocabulary: the target's LM head on the masked
    /// hidden states.
    fn head_logits(&self, view: &StepView, position: usize) -> Result<Vec<Vec<f32>>> {
        let lm_head = view
            .ctx
            .target_lm_head
            .context("DropMatch needs the target's LM head; it was not captured")?;
        let masked = self.masked_hidden(view, position)?.unsqueeze(0)?;
        let logits = lm_head.forward(&masked)?.squeeze(0)?.to_dtype(DType::F32)?;
        Ok(logits.to_vec2::<f32>()?)
    }

    /// Algorithm 1 over `tokens` only: the heads' logits of those tokens and the draft's
    /// distribution renormalised over them.
    fn rescues_among_candidates(&self, view: &StepView, position: usize, rows: &dyn TokenEmbeddings) -> Result<bool> {
        let draft = view.draft_token(position);
        let tokens = candidates(view.target_logits(position), self.config.candidates, draft);
        let weights = rows.embed(&tokens)?;
        let masked = self.masked_hidden(view, position)?.to_dtype(DType::F32)?;
        let heads = masked
            .to_device(weights.device())?
            .matmul(&weights.t()?)?
            .to_vec2::<f32>()?;
        let draft_log_probs = view.draft_log_probs(position);
        let restricted: Vec<f32> = tokens.iter().map(|&t| draft_log_probs[t as usize]).collect();
        // The draft is the last candidate when the target ranks it outside the N best.
        let draft_index = tokens.iter().position(|&t| t == draft).expect("the draft is a candidate") as u32;
        Ok(heads_accept(self.config.criterion, draft_index, &log_softmax(&restricted), &heads))
    }
}

/// The `n` tokens of highest target logit (ties to the lower id), then `draft` unless among
/// them; the whole vocabulary, in id order, when `n` covers it.
pub fn candidates(target_logits: &[f32], n: usize, draft: u32) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..target_logits.len() as u32).collect();
    if n < ids.len() {
        let by_logit = |a: &u32, b: &u32| {
            target_logits[*b as usize]
                .total_cmp(&target_logits[*a as usize])
                .then(a.cmp(b))
        };
        ids.select_nth_unstable_by(n, by_logit);
        ids.truncate(n);
        ids.sort_unstable_by(by_logit);
        if !ids.contains(&draft) {
            ids.push(draft);
        }
    }
    ids
}

impl Judge for DropMatch {
    fn name(&self) -> &str {
        "dropmatch"
    }

    fn target_capture(&self) -> CaptureRequest {
        CaptureRequest {
            last_hidden: true,
            lm_head: self.output_rows.is_none(),
            ..Default::default()
        }
    }

    fn rescues(&self, view: &StepView, position: usize) -> Result<bool> {
        if let Some(rows) = &self.output_rows {
            return self.rescues_among_candidates(view, position, &**rows);
        }
        let heads = self.head_logits(view, position)?;
        Ok(heads_accept(
            self.config.criterion,
            view.draft_token(position),
            view.draft_log_probs(position),
            &heads,
        ))
    }
}

/// Algorithm 1 of the DropMatch paper on the heads' logits. Ties of the plurality go to
/// the token a head voted for first.
pub fn heads_accept(
    criterion: Criterion,
    draft_token: u32,
    draft_log_probs: &[f32],
    head_logits: &[Vec<f32>],
) -> bool {
    let votes: Vec<u32> = head_logits.iter().map(|l| argmax(l)).collect();
    match criterion {
        Criterion::Naive => votes.contains(&draft_token),
        Criterion::Js => js_test(draft_log_probs, head_logits),
        Criterion::JsMajority => {
            plurality(&votes) == Some(draft_token) || js_test(draft_log_probs, head_logits)
        }
    }
}

/// JS(draft ‖ centroid) ≤ max_i JS(head_i ‖ centroid), centroid = softmax(mean of logits).
fn js_test(draft_log_probs: &[f32], head_logits: &[Vec<f32>]) -> bool {
    let centroid = centroid(head_logits);
    let spread = head_logits
        .iter()
        .map(|l| Divergence::Js.between(&log_softmax(l), &centroid))
        .fold(f64::NEG_INFINITY, f64::max);
    Divergence::Js.between(draft_log_probs, &centroid) <= spread
}

/// log softmax of the heads' mean logits (Eq. 5: logits are averaged, not probabilities).
fn centroid(head_logits: &[Vec<f32>]) -> Vec<f32> {
    let k = head_logits.len() as f32;
    let mut mean = vec![0.0f32; head_logits[0].len()];
    for logits in head_logits {
        for (m, l) in mean.iter_mut().zip(logits) {
            *m += l / k;
        }
    }
    log_softmax(&mean)
}

/// The most frequent vote; on a tie, the one that appeared first.
fn plurality(votes: &[u32]) -> Option<u32> {
    let mut best: Option<(u32, usize)> = None;
    for &v in votes {
        let count = votes.iter().filter(|&&x| x == v).count();
        if best.is_none_or(|(_, c)| count > c) {
            best = Some((v, count));
        }
    }
    best.map(|(v, _)| v)
}

/// SplitMix64 finaliser: spreads nearby keys over the whole seed space.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A key for the tokens before a step (FNV-1a).
pub fn context_key(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, &t| {
        (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge(p: f64) -> DropMatch {
        DropMatch::new(DropMatchConfig {
            k: 5,
            p,
            criterion: Criterion::JsMajority,
            seed: 7,
            candidates: 0,
        })
    }

    #[test]
    fn masks_keep_one_minus_p_scaled_and_reproduce() {
        let j = judge(0.3);
        let m = j.masks(42, 1, 4000);
        let kept = m.iter().filter(|&&x| x != 0.0).count() as f64 / m.len() as f64;
        // 20000 Bernoulli(0.7) draws: σ ≈ 0.0032.
        assert!((kept - 0.7).abs() < 0.02, "{kept}");
        assert!(m.iter().all(|&x| x == 0.0 || x == (1.0f64 / 0.7) as f32));
        assert_eq!(m, j.masks(42, 1, 4000));
        assert_ne!(m, j.masks(42, 2, 4000));
        assert_ne!(m, j.masks(43, 1, 4000));
        // Heads differ from each other.
        assert_ne!(m[..4000], m[4000..8000]);
        assert!(judge(0.0).masks(1, 0, 100).iter().all(|&x| x == 1.0));
    }

    fn row(peak: usize, height: f32) -> Vec<f32> {
        let mut r = vec![0.0; 6];
        r[peak] = height;
        r
    }

    #[test]
    fn algorithm_1_truth_table() {
        // Concentrated heads all voting 2: JS spread is 0, the majority rescues draft 2.
        let concentrated = vec![row(2, 8.0); 5];
        let draft_far = log_softmax(&row(2, 2.0));
        assert!(!heads_accept(Criterion::Js, 2, &draft_far, &concentrated));
        assert!(heads_accept(
            Criterion::JsMajority,
            2,
            &draft_far,
            &concentrated
        ));
        // Dispersed heads; a draft distribution near their centroid passes the JS test.
        let dispersed = vec![
            row(0, 2.0),
            row(1, 2.0),
            row(0, 2.0),
            row(3, 2.0),
            row(1, 2.0),
        ];
        let mean: Vec<f32> = (0..6)
            .map(|t| dispersed.iter().map(|r| r[t]).sum::<f32>() / 5.0)
            .collect();
        let near = log_softmax(&mean);
        assert!(heads_accept(Criterion::Js, 4, &near, &dispersed));
        // A draft far from every head is refused by every criterion.
        let far = log_softmax(&row(5, 9.0));
        for c in [Criterion::Naive, Criterion::Js, Criterion::JsMajority] {
            assert!(!heads_accept(c, 5, &far, &dispersed), "{c:?}");
        }
        // Naive: any head's arg-max.
        assert!(heads_accept(Criterion::Naive, 3, &far, &dispersed));
    }

    #[test]
    fn plurality_ties_go_to_the_first_vote() {
        assert_eq!(plurality(&[1, 2, 2, 1, 3]), Some(1));
        assert_eq!(plurality(&[3, 2, 2]), Some(2));
        assert_eq!(plurality(&[]), None);
    }

    #[test]
    fn naive_accepts_a_superset_of_majority_matches() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..500 {
            let heads: Vec<Vec<f32>> = (0..5)
                .map(|_| (0..4).map(|_| rng.random::<f32>() * 3.0).collect())
                .collect();
            let draft = rng.random_range(0..4u32);
            let votes: Vec<u32> = heads.iter().map(|l| argmax(l)).collect();
            if plurality(&votes) == Some(draft) {
                assert!(heads_accept(Criterion::Naive, draft, &[0.0; 4], &heads));
            }
        }
    }

    #[test]
    fn centroid_averages_logits_not_probabilities() {
        // Mean logits (2.67, 0, 3) favour token 2; mean probabilities (0.64, 0.01, 0.35)
        // would favour token 0.
        let heads = vec![
            vec![4.0, 0.0, 0.0],
            vec![4.0, 0.0, 0.0],
            vec![0.0, 0.0, 9.0],
        ];
        assert_eq!(argmax(&centroid(&heads)), 2);
        let mean_probs: Vec<f32> = (0..3)
            .map(|t| heads.iter().map(|h| log_softmax(h)[t].exp()).sum::<f32>() / 3.0)
            .collect();
        assert_eq!(argmax(&mean_probs), 0);
    }

    #[test]
    fn candidates_are_the_best_target_tokens_then_the_draft() {
        let logits = [0.5, 3.0, -1.0, 3.0, 2.0, 0.0];
        // Ranked by logit, the tie 1/3 to the lower id; the draft appended when not ranked.
        assert_eq!(candidates(&logits, 3, 4), vec![1, 3, 4]);
        assert_eq!(candidates(&logits, 3, 2), vec![1, 3, 4, 2]);
        assert_eq!(candidates(&logits, 1, 1), vec![1]);
        // n covering the vocabulary: every token, in id order.
        assert_eq!(candidates(&logits, 6, 2), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(candidates(&logits, 100, 2), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn context_keys_differ_for_different_contexts() {
        assert_ne!(context_key(&[1, 2, 3]), context_key(&[1, 2, 4]));
        assert_eq!(context_key(&[5, 6]), context_key(&[5, 6]));
    }
}
