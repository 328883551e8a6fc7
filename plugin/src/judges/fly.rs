//! FLy (Li et al., "Training-Free Loosely Speculative Decoding", ICLR 2026): a refused draft
//! is kept where the target was unsure and then "self-corrected" around it.
//!
//! At a position the base rule refuses: if the entropy of the target's top-k probabilities
//! there is at most `entropy_threshold`, the target was nearly certain and the refusal
//! stands. Otherwise the draft is kept when each of the next `window` drafts is one the base
//! rule would surely keep, read from the same verify forward (which scored every draft given
//! the ones before it, the variant included). A step with fewer than `window` drafts after
//! the position cannot defer: the drafts SV chose not to verify are not there to agree.
//!
//! "Surely kept": the target's arg-max when decoding greedily; under sampling, a draft whose
//! target probability is at least its draft probability (rejection sampling keeps it with
//! probability 1). The judge draws nothing, so sampled drafts that a draw might still have
//! kept do not count as agreement.

use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{ensure, Result};
use serde::Deserialize;

use crate::{judge::Judge, step_view::StepView};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlyConfig {
    /// Drafts after the refused one that must agree; unset: min(6, γ − 1) for each step.
    #[serde(default)]
    pub window: Option<usize>,
    /// Entropy (nats) of the target's top-k probabilities above which it counts as unsure.
    #[serde(default = "default_entropy_threshold")]
    pub entropy_threshold: f64,
    #[serde(default = "default_entropy_top_k")]
    pub entropy_top_k: usize,
}

fn default_entropy_threshold() -> f64 {
    0.3
}

fn default_entropy_top_k() -> usize {
    3
}

impl FlyConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.window != Some(0), "window must be at least 1, got 0");
        ensure!(self.entropy_top_k >= 2, "entropy_top_k must be at least 2 (one token has no entropy), got {}", self.entropy_top_k);
        let most = (self.entropy_top_k as f64).ln();
        ensure!(
            self.entropy_threshold.is_finite() && (0.0..most).contains(&self.entropy_threshold),
            "entropy_threshold must be at least 0 and below ln(entropy_top_k) = {most:.3} (no top-{} distribution is more uncertain), got {}",
            self.entropy_top_k,
            self.entropy_threshold
        );
        Ok(())
    }
}

/// How FLy's refusals went (for reports and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlyCounts {
    /// Refusals where the target was unsure, so the window was read.
    pub deferred: u64,
    /// Of those, refusals overturned: the window agreed.
    pub held: u64,
}

pub struct Fly {
    config: FlyConfig,
    deferred: AtomicU64,
    held: AtomicU64,
}

impl Fly {
    pub fn new(config: FlyConfig) -> Self {
        Self { config, deferred: AtomicU64::new(0), held: AtomicU64::new(0) }
    }

    pub fn counts(&self) -> FlyCounts {
        FlyCounts { deferred: self.deferred.load(Ordering::Relaxed), held: self.held.load(Ordering::Relaxed) }
    }

    /// The window for a step of `gamma` drafts.
    fn window(&self, gamma: usize) -> usize {
        self.config.window.unwrap_or_else(|| gamma.saturating_sub(1).clamp(1, 6))
    }

    /// Whether the base rule keeps the draft at `position` whatever it draws.
    fn surely_kept(view: &StepView, position: usize) -> bool {
        let token = view.draft_token(position);
        if view.sampling().is_greedy() {
            return token == view.target_argmax(position);
        }
        let t = token as usize;
        view.target_probs(position)[t] >= view.draft_probs(position)[t]
    }
}

/// Entropy (nats) of the `k` largest of `probs`, renormalised.
pub fn top_k_entropy(probs: &[f32], k: usize) -> f64 {
    let mut top: Vec<f64> = probs.iter().map(|&p| p as f64).collect();
    let k = k.min(top.len());
    top.select_nth_unstable_by(k.saturating_sub(1), |a, b| b.total_cmp(a));
    top.truncate(k);
    let sum: f64 = top.iter().sum();
    if sum <= 0.0 {
        return 0.0;
    }
    -top.iter().map(|p| p / sum).filter(|&p| p > 0.0).map(|p| p * p.ln()).sum::<f64>()
}

impl Judge for Fly {
    fn name(&self) -> &str {
        "fly"
    }

    fn rescues(&self, view: &StepView, position: usize) -> Result<bool> {
        let window = self.window(view.gamma());
        // The drafts after `position` that this step verifies.
        if position + window >= view.gamma() {
            return Ok(false);
        }
        let entropy = top_k_entropy(view.target_probs(position), self.config.entropy_top_k);
        if entropy <= self.config.entropy_threshold {
            return Ok(false);
        }
        self.deferred.fetch_add(1, Ordering::Relaxed);
        let agrees = (position + 1..=position + window).all(|j| Self::surely_kept(view, j));
        tracing::debug!(position, entropy, window, agrees, "fly");
        if agrees {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
        Ok(agrees)
    }
}

#[cfg(test)]
mod tests {
    use mistralrs_core::speculative_hook::SamplingSettings;
    use rand::{rngs::StdRng, SeedableRng};

    use super::*;
    use crate::{
        judge::{JudgeStack, PositionOutcome},
        metrics::Metrics,
        rules::BaseRule,
        step_view::with_view,
    };

    const VOCAB: usize = 4;

    /// Logits whose softmax (temperature 1) is `probs` over a 4-token vocabulary.
    fn row(probs: [f32; VOCAB]) -> Vec<f32> {
        probs.iter().map(|p| p.max(1e-12).ln()).collect()
    }

    /// Unsure: top-3 entropy of (0.4, 0.35, 0.25) ≈ 1.08 nats.
    const UNSURE: [f32; VOCAB] = [0.4, 0.35, 0.25, 0.0];
    /// Sure: top-3 entropy of (0.97, 0.02, 0.01) ≈ 0.15 nats.
    const SURE: [f32; VOCAB] = [0.97, 0.02, 0.01, 0.0];

    /// Greedy drafts `drafts` over target rows `target` (γ = drafts, plus the bonus row):
    /// the outcome of position 0 under `exact` plus FLy, and the counts of FLy asked alone
    /// about that position (the base rule refuses it in every test here).
    fn first_position(fly: FlyConfig, target: &[[f32; VOCAB]], drafts: &[u32]) -> (PositionOutcome, FlyCounts) {
        let alone = Fly::new(fly.clone());
        let target: Vec<Vec<f32>> = target.iter().map(|p| row(*p)).collect();
        let draft_logits = vec![vec![0.0; VOCAB]; drafts.len()];
        let outcome = with_view(&draft_logits, &target, drafts, &SamplingSettings::default(), |view| {
            let mut stack = JudgeStack::lossless(BaseRule::Exact);
            stack.judges.push(Box::new(Fly::new(fly)));
            alone.rescues(view, 0).unwrap();
            stack.decide(view, 0, &mut StdRng::seed_from_u64(0), &Metrics::default()).unwrap()
        });
        (outcome, alone.counts())
    }

    fn config(window: usize) -> FlyConfig {
        FlyConfig { window: Some(window), entropy_threshold: 0.3, entropy_top_k: 3 }
    }

    #[test]
    fn top_k_entropy_matches_hand_computed_values() {
        // Top 3 of (0.5, 0.25, 0.25, 0): ln 2 · 0.5 + ln 4 · 0.5 = 1.5 ln 2.
        assert!((top_k_entropy(&[0.5, 0.25, 0.25, 0.0], 3) - 1.5 * 2f64.ln()).abs() < 1e-9);
        // Top 2 of (0.6, 0.2, 0.2): (0.75, 0.25) → −0.75 ln 0.75 − 0.25 ln 0.25.
        let expected = -(0.75f64 * 0.75f64.ln() + 0.25 * 0.25f64.ln());
        assert!((top_k_entropy(&[0.2, 0.6, 0.2], 2) - expected).abs() < 1e-6);
        assert_eq!(top_k_entropy(&[1.0, 0.0, 0.0], 3), 0.0);
    }

    #[test]
    fn an_unsure_refusal_followed_by_agreeing_drafts_is_kept() {
        // Draft 1 at position 0 (target's arg-max is 0); drafts 2 and 3 are the target's
        // own choices at positions 1 and 2.
        let target = [UNSURE, [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7], SURE];
        let (outcome, counts) = first_position(config(2), &target, &[1, 2, 3]);
        assert_eq!(outcome, PositionOutcome::Kept);
        assert_eq!(counts, FlyCounts { deferred: 1, held: 1 });
    }

    #[test]
    fn a_sure_target_refuses_whatever_the_window_says() {
        let target = [SURE, [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7], SURE];
        let (outcome, counts) = first_position(config(2), &target, &[1, 2, 3]);
        assert_eq!(outcome, PositionOutcome::Refused { correction: 0 });
        assert_eq!(counts, FlyCounts::default());
    }

    #[test]
    fn a_window_that_disagrees_refuses() {
        // Position 2's draft (3) is not the target's arg-max (2) there.
        let target = [UNSURE, [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.7, 0.1], SURE];
        let (outcome, counts) = first_position(config(2), &target, &[1, 2, 3]);
        assert_eq!(outcome, PositionOutcome::Refused { correction: 0 });
        assert_eq!(counts, FlyCounts { deferred: 1, held: 0 });
    }

    #[test]
    fn a_step_without_window_drafts_after_the_position_cannot_defer() {
        // Two drafts: only one after position 0, the window asks for two.
        let target = [UNSURE, [0.1, 0.1, 0.7, 0.1], SURE];
        let (outcome, counts) = first_position(config(2), &target, &[1, 2]);
        assert_eq!(outcome, PositionOutcome::Refused { correction: 0 });
        assert_eq!(counts, FlyCounts::default());
        // The default window for γ = 2 is 1: then it defers, and the window agrees.
        let default_window = FlyConfig { window: None, ..config(1) };
        let (outcome, _) = first_position(default_window, &target, &[1, 2]);
        assert_eq!(outcome, PositionOutcome::Kept);
    }

    #[test]
    fn without_the_judge_the_stack_is_its_base_rule() {
        let target: Vec<Vec<f32>> = [UNSURE, [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7], SURE].iter().map(|p| row(*p)).collect();
        let outcome = with_view(&vec![vec![0.0; VOCAB]; 3], &target, &[1, 2, 3], &SamplingSettings::default(), |view| {
            JudgeStack::lossless(BaseRule::Exact).decide(view, 0, &mut StdRng::seed_from_u64(0), &Metrics::default()).unwrap()
        });
        assert_eq!(outcome, PositionOutcome::Refused { correction: 0 });
    }

    #[test]
    fn under_sampling_only_drafts_kept_with_certainty_agree() {
        let sampling = SamplingSettings { temperature: Some(1.0), ..Default::default() };
        // Position 1: draft 2 with p = 0.7 ≥ q = 0.25 (uniform draft rows): surely kept.
        // Position 2: draft 3 with p = 0.1 < q = 0.25: a draw might refuse it.
        let fly = Fly::new(config(1));
        let target: Vec<Vec<f32>> = [UNSURE, [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.7, 0.1], SURE].iter().map(|p| row(*p)).collect();
        let draft_logits = vec![vec![0.0; VOCAB]; 3];
        with_view(&draft_logits, &target, &[1, 2, 3], &sampling, |view| {
            assert!(fly.rescues(view, 0).unwrap(), "window of 1: position 1 agrees");
            assert!(!fly.rescues(view, 1).unwrap(), "window of 1: position 2's draft might be refused by a draw");
        });
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(config(0).validate().unwrap_err().to_string().contains("window"));
        let wide = FlyConfig { entropy_threshold: 1.2, ..config(2) };
        assert!(wide.validate().unwrap_err().to_string().contains("ln(entropy_top_k)"));
        let one = FlyConfig { entropy_top_k: 1, ..config(2) };
        assert!(one.validate().unwrap_err().to_string().contains("entropy_top_k"));
        assert!(config(2).validate().is_ok());
    }
}
