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
    /// A judge that decides in place of the base rule (FSD's paper rule): its `rescues`
    /// answer is the verdict, and a refusal emits the target's own token.
    pub replacement: Option<Box<dyn Judge>>,
    pub judges: Vec<Box<dyn Judge>>,
}

impl JudgeStack {
    pub fn lossless(base: BaseRule) -> Self {
        Self {
            name: base.name().to_string(),
            base,
            replacement: None,
            judges: Vec::new(),
        }
    }

    fn all_judges(&self) -> impl Iterator<Item = &dyn Judge> {
        self.replacement
            .iter()
            .chain(&self.judges)
            .map(|j| j.as_ref())
    }

    /// Union of what the judges need captured.
    /// Refuse a stack whose judges read the draft model's hidden states when the drafts come
    /// from elsewhere (an EAGLE head has no draft model).
    pub fn check_drafts_without_model(&self) -> Result<()> {
        let needing: Vec<&str> = self
            .all_judges()
            .filter(|j| !j.draft_capture().is_empty())
            .map(|j| j.name())
            .collect();
        anyhow::ensure!(
            needing.is_empty(),
            "stack {:?}: {} read(s) the draft model's hidden states, which EAGLE drafting does not have; use a target-only AutoJudge head (`train-head fit --spec target`)",
            self.name,
            needing.join(", ")
        );
        Ok(())
    }

    pub fn capture(&self, of: impl Fn(&dyn Judge) -> CaptureRequest) -> CaptureRequest {
        let mut merged = CaptureRequest::default();
        for judge in self.all_judges() {
            let wanted = of(judge);
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
        let base = match &self.replacement {
            Some(judge) => replaced_verdict(judge.as_ref(), view, position, rng, metrics)?,
            None => self.base.verify(view, position, rng)?,
        };
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

    fn any_judge(
        &self,
        view: &StepView,
        position: usize,
        metrics: &Metrics,
        role: Role,
    ) -> Result<bool> {
        for judge in &self.judges {
            let start = Instant::now();
            let said_yes = match role {
                Role::Rescue => judge.rescues(view, position)?,
                Role::Veto => judge.vetoes(view, position)?,
            };
            metrics.record_judge(
                judge.name(),
                role == Role::Rescue && said_yes,
                role == Role::Veto && said_yes,
                start.elapsed(),
            );
            if said_yes {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// The verdict of a judge that replaces the base rule. Its counters compare it with greedy
/// matching: a rescue keeps a draft that differs from the target's arg-max, a veto refuses
/// one that equals it.
fn replaced_verdict(
    judge: &dyn Judge,
    view: &StepView,
    position: usize,
    rng: &mut StdRng,
    metrics: &Metrics,
) -> Result<BaseVerdict> {
    let start = Instant::now();
    let accepts = judge.rescues(view, position)?;
    let matches_target = view.draft_token(position) == view.target_argmax(position);
    metrics.record_judge(
        judge.name(),
        accepts && !matches_target,
        !accepts && matches_target,
        start.elapsed(),
    );
    Ok(match accepts {
        true => BaseVerdict::Accept,
        false => BaseVerdict::Reject {
            correction: view.target_token(position, rng)?,
        },
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Rescue,
    Veto,
}

/// The target's token at `position` with `excluded` removed from its distribution.
fn target_token_except(
    view: &StepView,
    position: usize,
    excluded: u32,
    rng: &mut StdRng,
) -> Result<u32> {
    let mut probs = view.target_probs(position).to_vec();
    probs[excluded as usize] = 0.0;
    if view.sampling().is_greedy() {
        Ok(argmax(&probs))
    } else {
        sample(&probs, rng)
    }
}

#[cfg(test)]
mod tests {
    use mistralrs_core::speculative_hook::SamplingSettings;
    use rand::SeedableRng;

    use super::*;
    use crate::step_view::with_view;

    use std::sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    };

    /// A judge that always gives the same answer, counting how often it was asked.
    struct Scripted {
        name: &'static str,
        rescue: bool,
        veto: bool,
        asked: Arc<AtomicUsize>,
    }

    impl Scripted {
        fn new(name: &'static str, rescue: bool, veto: bool) -> Box<Self> {
            Box::new(Self {
                name,
                rescue,
                veto,
                asked: Default::default(),
            })
        }
    }

    impl Judge for Scripted {
        fn name(&self) -> &str {
            self.name
        }
        fn rescues(&self, _: &StepView, _: usize) -> Result<bool> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Ok(self.rescue)
        }
        fn vetoes(&self, _: &StepView, _: usize) -> Result<bool> {
            self.asked.fetch_add(1, Ordering::Relaxed);
            Ok(self.veto)
        }
    }

    /// Target arg-max is token 0 at the single position; the draft proposed `draft`.
    fn decide(stack: &JudgeStack, draft: u32) -> PositionOutcome {
        let target = vec![vec![3.0, 2.0, 1.0], vec![0.0, 0.0, 1.0]];
        let draft_logits = vec![vec![0.0, 0.0, 0.0]];
        with_view(
            &draft_logits,
            &target,
            &[draft],
            &SamplingSettings::default(),
            |view| {
                stack
                    .decide(view, 0, &mut StdRng::seed_from_u64(0), &Metrics::default())
                    .unwrap()
            },
        )
    }

    fn stack(judges: Vec<Box<dyn Judge>>) -> JudgeStack {
        JudgeStack {
            name: "test".into(),
            base: BaseRule::Exact,
            replacement: None,
            judges,
        }
    }

    #[test]
    fn no_judges_is_the_base_rule() {
        assert_eq!(decide(&stack(vec![]), 0), PositionOutcome::Kept);
        assert_eq!(
            decide(&stack(vec![]), 1),
            PositionOutcome::Refused { correction: 0 }
        );
    }

    #[test]
    fn a_rescuer_overturns_a_rejection() {
        assert_eq!(
            decide(&stack(vec![Scripted::new("r", true, false)]), 2),
            PositionOutcome::Kept
        );
    }

    #[test]
    fn a_veto_overturns_an_acceptance_and_the_correction_avoids_the_vetoed_token() {
        // Draft 0 is the arg-max; vetoed, the emitted token is the best other one (1).
        let outcome = decide(&stack(vec![Scripted::new("v", false, true)]), 0);
        assert_eq!(outcome, PositionOutcome::Refused { correction: 1 });
    }

    #[test]
    fn a_veto_beats_a_rescue() {
        let judges: Vec<Box<dyn Judge>> = vec![
            Scripted::new("r", true, false),
            Scripted::new("v", false, true),
        ];
        assert_eq!(
            decide(&stack(judges), 2),
            PositionOutcome::Refused { correction: 0 }
        );
    }

    #[test]
    fn rescuers_are_not_asked_where_the_base_accepts() {
        let rescuer = Scripted::new("r", true, false);
        let asked = rescuer.asked.clone();
        decide(&stack(vec![rescuer]), 0);
        // Asked once: for a veto, never for a rescue.
        assert_eq!(asked.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn judge_counters_record_rescues_and_vetoes() {
        let metrics = Metrics::default();
        let stack = stack(vec![Scripted::new("r", true, false)]);
        let target = vec![vec![3.0, 2.0, 1.0], vec![0.0, 0.0, 1.0]];
        with_view(
            &[vec![0.0; 3]],
            &target,
            &[2],
            &SamplingSettings::default(),
            |view| {
                stack
                    .decide(view, 0, &mut StdRng::seed_from_u64(0), &metrics)
                    .unwrap()
            },
        );
        let c = metrics.snapshot();
        assert_eq!(
            (
                c.judges["r"].rescues,
                c.judges["r"].vetoes,
                c.judges["r"].calls
            ),
            (1, 0, 2)
        );
    }
}
