//! Fuzzy Speculative Decoding: keep a draft iff Div(p_target, q_draft) < T at its position.
//!
//! The test looks at the two raw distributions (temperature 1, full vocabulary), never at
//! the drafted token. In `replace` mode it is the paper's rule and a refusal emits the
//! target's own token (arg-max when greedy); in `rescue` mode it only overturns the base
//! rule's rejections.

use anyhow::{ensure, Result};
use serde::Deserialize;

use crate::{divergence::Divergence, judge::Judge, step_view::StepView};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum FsdMode {
    /// Accept iff Div < T, in place of the base rule (the paper).
    #[default]
    Replace,
    /// Accept what the base rule accepts, plus rejections with Div < T.
    Rescue,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsdConfig {
    pub threshold: f64,
    #[serde(default = "default_divergence")]
    pub divergence: Divergence,
    #[serde(default)]
    pub mode: FsdMode,
}

fn default_divergence() -> Divergence {
    Divergence::Js
}

impl FsdConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.threshold.is_finite() && self.threshold >= 0.0,
            "threshold must be a finite number >= 0, got {}",
            self.threshold
        );
        if self.divergence == Divergence::Js {
            ensure!(
                self.threshold <= std::f64::consts::LN_2,
                "threshold = {} with divergence = \"js\" accepts every draft (textbook JS is at most ln 2 = 0.693); \
                 for the FSD paper's thresholds use divergence = \"js-fsd\"",
                self.threshold
            );
        }
        if self.divergence == Divergence::Tv {
            ensure!(
                self.threshold <= 1.0,
                "threshold = {} with divergence = \"tv\" accepts every draft (TV is at most 1)",
                self.threshold
            );
        }
        Ok(())
    }
}

pub struct Fsd {
    config: FsdConfig,
    name: String,
}

impl Fsd {
    pub fn new(config: FsdConfig) -> Self {
        let name = format!("fsd-{}", config.divergence.name());
        Self { config, name }
    }

    pub fn divergence_at(&self, view: &StepView, position: usize) -> f64 {
        self.config.divergence.between(
            view.target_log_probs(position),
            view.draft_log_probs(position),
        )
    }
}

impl Judge for Fsd {
    fn name(&self) -> &str {
        &self.name
    }

    fn rescues(&self, view: &StepView, position: usize) -> Result<bool> {
        let divergence = self.divergence_at(view, position);
        tracing::debug!(
            position,
            divergence,
            matches_target = view.draft_token(position) == view.target_argmax(position),
            "{}",
            self.name
        );
        // A NaN divergence fails the test: the draft is refused.
        Ok(divergence < self.config.threshold)
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

    fn stack(threshold: f64, mode: FsdMode) -> JudgeStack {
        let fsd = Box::new(Fsd::new(FsdConfig {
            threshold,
            divergence: Divergence::Tv,
            mode,
        }));
        let mut stack = JudgeStack::lossless(BaseRule::Exact);
        match mode {
            FsdMode::Replace => stack.replacement = Some(fsd),
            FsdMode::Rescue => stack.judges.push(fsd),
        }
        stack
    }

    /// Target p = (0.9, 0.1) vs draft q = (0.5, 0.5): TV 0.4. Draft token `draft`.
    fn decide(stack: &JudgeStack, draft: u32, greedy: bool) -> PositionOutcome {
        let ln = |x: f32| x.ln();
        let target = vec![vec![ln(0.9), ln(0.1)], vec![0.0, 0.0]];
        let draft_logits = vec![vec![0.0, 0.0]];
        let sampling = SamplingSettings {
            temperature: (!greedy).then_some(1.0),
            ..Default::default()
        };
        with_view(&draft_logits, &target, &[draft], &sampling, |view| {
            stack
                .decide(view, 0, &mut StdRng::seed_from_u64(1), &Metrics::default())
                .unwrap()
        })
    }

    #[test]
    fn replace_mode_is_the_threshold_alone() {
        // TV = 0.4: under 0.5 even the target's non-arg-max token is kept…
        assert_eq!(
            decide(&stack(0.5, FsdMode::Replace), 1, true),
            PositionOutcome::Kept
        );
        // …over 0.3 even the arg-max is refused, and the target's arg-max is emitted.
        assert_eq!(
            decide(&stack(0.3, FsdMode::Replace), 0, true),
            PositionOutcome::Refused { correction: 0 }
        );
    }

    #[test]
    fn rescue_mode_keeps_every_base_acceptance() {
        assert_eq!(
            decide(&stack(0.3, FsdMode::Rescue), 0, true),
            PositionOutcome::Kept
        );
        assert_eq!(
            decide(&stack(0.3, FsdMode::Rescue), 1, true),
            PositionOutcome::Refused { correction: 0 }
        );
        assert_eq!(
            decide(&stack(0.5, FsdMode::Rescue), 1, true),
            PositionOutcome::Kept
        );
    }

    #[test]
    fn a_refusal_under_sampling_draws_from_the_target_distribution() {
        // Threshold 0 refuses everything; the correction is a sample of p = (0.9, 0.1).
        let mut ones = 0;
        let stack = stack(0.0, FsdMode::Replace);
        for seed in 0..2000u64 {
            let ln = |x: f32| x.ln();
            let target = vec![vec![ln(0.9), ln(0.1)], vec![0.0, 0.0]];
            let sampling = SamplingSettings {
                temperature: Some(1.0),
                ..Default::default()
            };
            let outcome = with_view(&[vec![0.0, 0.0]], &target, &[0], &sampling, |view| {
                stack
                    .decide(
                        view,
                        0,
                        &mut StdRng::seed_from_u64(seed),
                        &Metrics::default(),
                    )
                    .unwrap()
            });
            if outcome == (PositionOutcome::Refused { correction: 1 }) {
                ones += 1;
            }
        }
        // 200 expected; 5 standard deviations is ±67.
        assert!((133..=267).contains(&ones), "{ones}");
    }

    #[test]
    fn textbook_js_threshold_above_ln2_is_refused() {
        let config = FsdConfig {
            threshold: 0.7,
            divergence: Divergence::Js,
            mode: FsdMode::Replace,
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("js-fsd"), "{err}");
    }
}
