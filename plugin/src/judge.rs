//! The judge stack: lossy verifiers layered on a lossless base rule.
//!
//! Combination (Judge Decoding / AutoJudge): a position is kept iff
//! (the base rule accepts OR an enabled rescuer accepts) AND no enabled judge vetoes.
//! Verification stops at the first refused position; the token emitted there comes from
//! the target (the base rule's correction, or the target distribution without the vetoed
//! token). With no judges the stack is exactly its base rule.

use std::time::Instant;

use anyhow::Result;
use mistralrs_core::speculative_hook::CaptureRequest;
use rand::rngs::StdRng;

use crate::{
    distribution::{argmax, sample},
    metrics::Metrics,
    rules::{BaseRule, BaseVerdict},
    step_view::StepView,
};

/// A lossy verifier looking at one drafted position at a time.
pub trait Judge: Send + Sync {
    /// Stable name used in metrics and logs.
    fn name(&self) -> &str;
    /// What the judge needs captured in the target's verify forward.
    fn target_capture(&self) -> CaptureRequest {
        CaptureRequest::default()
    }
    /// What the judge needs captured in the draft's forwards.
    fn draft_capture(&self) -> CaptureRequest {
        CaptureRequest::default()
    }
    /// Asked only where the draft stands refused: keep it anyway?
    fn rescues(&self, _view: &StepView, _position: usize) -> Result<bool> {
        Ok(false)
    }
    /// Asked only where the draft is about to be kept: refuse it?
    fn vetoes(&self, _view: &StepView, _position: usize) -> Result<bool> {
        Ok(false)
    }
}

/// How one drafted position ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionOutcome {
    Kept,
    Refused { correction: u32 },
}

/// A base rule and the enabled judges, in the order of the configuration.
pub struct JudgeStack {
    pub name: String,
    pub base: BaseRule,
    pub judges: Vec<Box<dyn Judge>>,
}

impl JudgeStack {
    pub fn lossless(base: BaseRule) -> Self {
        Self {
            name: base.name().to_string(),
            base,
            judges: Vec::new(),
        }
    }

    /// Union of what the judges need captured.
    pub fn capture(&self, of: impl Fn(&dyn Judge) -> CaptureRequest) -> CaptureRequest {
        let mut merged = CaptureRequest::default();
        for judge in &self.judges {
            let wanted = of(judge.as_ref());
            merged.last_hidden |= wanted.last_hidden;
            merged.lm_head |= wanted.lm_head;
            for layer in wanted.layers {
                if !merged.layers.contains(&layer) {
                    merged.layers.push(layer);
                }
            }
        }
        merged
    }

    pub fn decide(
        &self,
        view: &StepView,
        position: usize,
        rng: &mut StdRng,
        metrics: &Metrics,
    ) -> Result<PositionOutcome> {
        let base = self.base.verify(view, position, rng)?;
        let kept = match base {
            BaseVerdict::Accept => true,
            BaseVerdict::Reject { .. } => self.any_judge(view, position, metrics, Role::Rescue)?,
        };
        if !kept {
            let BaseVerdict::Reject { correction } = base else {
                unreachable!("a refused position has a base rejection")
            };
            return Ok(PositionOutcome::Refused { correction });
        }
        if self.any_judge(view, position, metrics, Role::Veto)? {
            return Ok(PositionOutcome::Refused {
                correction: target_token_except(view, position, view.draft_token(position), rng)?,
            });
        }
        Ok(PositionOutcome::Kept)
    }

    fn any_judge(&self, view: &StepView, position: usize, metrics: &Metrics, role: Role) -> Result<bool> {
        for judge in &self.judges {
            let start = Instant::now();
            let said_yes = match role {
                Role::Rescue => judge.rescues(view, position)?,
                Role::Veto => judge.vetoes(view, position)?,
            };
            metrics.record_judge(judge.name(), role == Role::Rescue && said_yes, role == Role::Veto && said_yes, start.elapsed());
            if said_yes {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Rescue,
    Veto,
}

/// The target's token at `position` with `excluded` removed from its distribution.
fn target_token_except(view: &StepView, position: usize, excluded: u32, rng: &mut StdRng) -> Result<u32> {
    let mut probs = view.target_probs(position).to_vec();
    probs[excluded as usize] = 0.0;
    if view.sampling().is_greedy() {
        Ok(argmax(&probs))
    } else {
        sample(&probs, rng)
    }
}
