//! One speculative step as the rules see it: rows of logits copied to the host once, and
//! distributions computed only for the positions that need them.

use std::cell::OnceCell;

use anyhow::Result;
use mistralrs_core::speculative_hook::{SamplingSettings, VerifyContext};
use rand::Rng;

use crate::{
    distribution::{argmax, probabilities, sample},
    divergence::log_softmax,
};

pub struct StepView<'a> {
    pub ctx: &'a VerifyContext<'a>,
    draft_logits: Vec<Vec<f32>>,
    target_logits: Vec<Vec<f32>>,
    draft_probs: Vec<OnceCell<Vec<f32>>>,
    target_probs: Vec<OnceCell<Vec<f32>>>,
    draft_log_probs: Vec<OnceCell<Vec<f32>>>,
    target_log_probs: Vec<OnceCell<Vec<f32>>>,
}

impl<'a> StepView<'a> {
    pub fn new(ctx: &'a VerifyContext<'a>) -> Result<Self> {
        let draft_logits = ctx.draft_logits.to_vec2::<f32>()?;
        let target_logits = ctx.target_logits.to_vec2::<f32>()?;
        anyhow::ensure!(
            target_logits.len() == draft_logits.len() + 1,
            "target scored {} positions for {} drafts; expected one more",
            target_logits.len(),
            draft_logits.len()
        );
        Ok(Self {
            ctx,
            draft_probs: vec![OnceCell::new(); draft_logits.len()],
            target_probs: vec![OnceCell::new(); target_logits.len()],
            draft_log_probs: vec![OnceCell::new(); draft_logits.len()],
            target_log_probs: vec![OnceCell::new(); target_logits.len()],
            draft_logits,
            target_logits,
        })
    }

    /// γ, the number of drafted tokens.
    pub fn gamma(&self) -> usize {
        self.draft_logits.len()
    }

    pub fn draft_token(&self, position: usize) -> u32 {
        self.ctx.draft_tokens[position]
    }

    pub fn sampling(&self) -> &SamplingSettings {
        self.ctx.sampling
    }

    pub fn target_argmax(&self, position: usize) -> u32 {
        argmax(&self.target_logits[position])
    }

    /// The target's raw logits at `position`.
    pub fn target_logits(&self, position: usize) -> &[f32] {
        &self.target_logits[position]
    }

    /// The target's distribution at `position` (temperature 1 when decoding greedily, so
    /// judges that compare distributions still have one).
    pub fn target_probs(&self, position: usize) -> &[f32] {
        self.target_probs[position]
            .get_or_init(|| probabilities(&self.target_logits[position], self.ctx.sampling))
    }

    /// The draft's distribution at `position`, the one `draft_token(position)` was drawn from.
    pub fn draft_probs(&self, position: usize) -> &[f32] {
        self.draft_probs[position]
            .get_or_init(|| probabilities(&self.draft_logits[position], self.ctx.sampling))
    }

    /// The target's raw distribution at `position` (temperature 1, no truncation) as
    /// log-probabilities: what the judges compare, whatever the sampling settings.
    pub fn target_log_probs(&self, position: usize) -> &[f32] {
        self.target_log_probs[position].get_or_init(|| log_softmax(&self.target_logits[position]))
    }

    /// The draft's raw distribution at `position`, as [`Self::target_log_probs`].
    pub fn draft_log_probs(&self, position: usize) -> &[f32] {
        self.draft_log_probs[position].get_or_init(|| log_softmax(&self.draft_logits[position]))
    }

    /// What plain target decoding would emit at `position`: arg-max, or a sample from p.
    pub fn target_token(&self, position: usize, rng: &mut impl Rng) -> Result<u32> {
        if self.sampling().is_greedy() {
            Ok(self.target_argmax(position))
        } else {
            sample(self.target_probs(position), rng)
        }
    }
}

/// Draw a draft token from one row of draft logits.
pub fn draft_token(logits: &[f32], sampling: &SamplingSettings, rng: &mut impl Rng) -> Result<u32> {
    if sampling.is_greedy() {
        Ok(argmax(logits))
    } else {
        sample(&probabilities(logits, sampling), rng)
    }
}

/// Builds a [`VerifyContext`] from plain rows of logits, for tests of rules and judges.
#[cfg(test)]
pub(crate) fn with_view<R>(
    draft_logits: &[Vec<f32>],
    target_logits: &[Vec<f32>],
    draft_tokens: &[u32],
    sampling: &SamplingSettings,
    body: impl FnOnce(&StepView) -> R,
) -> R {
    let none = mistralrs_core::speculative_hook::HiddenStates::default();
    with_view_hidden(
        draft_logits,
        target_logits,
        draft_tokens,
        sampling,
        (&none, &none),
        body,
    )
}

/// [`with_view`] with captured `(target, draft)` hidden states.
#[cfg(test)]
pub(crate) fn with_view_hidden<R>(
    draft_logits: &[Vec<f32>],
    target_logits: &[Vec<f32>],
    draft_tokens: &[u32],
    sampling: &SamplingSettings,
    (target_hidden, draft_hidden): (
        &mistralrs_core::speculative_hook::HiddenStates,
        &mistralrs_core::speculative_hook::HiddenStates,
    ),
    body: impl FnOnce(&StepView) -> R,
) -> R {
    use candle_core::{Device, Tensor};
    let to_tensor = |rows: &[Vec<f32>]| {
        Tensor::from_vec(rows.concat(), (rows.len(), rows[0].len()), &Device::Cpu).unwrap()
    };
    let (draft, target) = (to_tensor(draft_logits), to_tensor(target_logits));
    let ctx = VerifyContext {
        seq_id: 0,
        prefix: &[],
        draft_tokens,
        draft_logits: &draft,
        target_logits: &target,
        target_hidden,
        draft_hidden,
        target_lm_head: None,
        sampling,
        draft_time: std::time::Duration::ZERO,
        verify_time: std::time::Duration::ZERO,
    };
    let view = StepView::new(&ctx).unwrap();
    body(&view)
}
