//! One speculative step as the rules see it: rows of logits copied to the host once, when
//! first read, and distributions computed only for the positions that need them.

use std::cell::OnceCell;

use anyhow::Result;
use candle_core::{DType, Tensor};
use mistralrs_core::speculative_hook::{SamplingSettings, VerifyContext};
use rand::Rng;

use crate::{
    distribution::{argmax, probabilities, sample},
    divergence::log_softmax,
};

pub struct StepView<'a> {
    pub ctx: &'a VerifyContext<'a>,
    draft_logits: Vec<OnceCell<Vec<f32>>>,
    target_logits: Vec<OnceCell<Vec<f32>>>,
    draft_probs: Vec<OnceCell<Vec<f32>>>,
    target_probs: Vec<OnceCell<Vec<f32>>>,
    draft_log_probs: Vec<OnceCell<Vec<f32>>>,
    target_log_probs: Vec<OnceCell<Vec<f32>>>,
}

impl<'a> StepView<'a> {
    /// Rows are copied to the host when a rule first reads them: greedy `exact` reads the
    /// target's rows up to the first rejection and no draft row, each 151,936 floats here.
    pub fn new(ctx: &'a VerifyContext<'a>) -> Result<Self> {
        let (drafts, vocab) = ctx.draft_logits.dims2()?;
        let (scored, target_vocab) = ctx.target_logits.dims2()?;
        anyhow::ensure!(
            scored == drafts + 1,
            "target scored {scored} positions for {drafts} drafts; expected one more"
        );
        anyhow::ensure!(
            ctx.draft_logits.dtype() == DType::F32 && ctx.target_logits.dtype() == DType::F32,
            "logits come as {:?} (draft) and {:?} (target); the rules read f32",
            ctx.draft_logits.dtype(),
            ctx.target_logits.dtype()
        );
        anyhow::ensure!(
            drafts == 0 || vocab == target_vocab,
            "draft rows of {vocab} logits against target rows of {target_vocab}"
        );
        Ok(Self {
            ctx,
            draft_logits: vec![OnceCell::new(); drafts],
            target_logits: vec![OnceCell::new(); scored],
            draft_probs: vec![OnceCell::new(); drafts],
            target_probs: vec![OnceCell::new(); scored],
            draft_log_probs: vec![OnceCell::new(); drafts],
            target_log_probs: vec![OnceCell::new(); scored],
        })
    }

    /// The draft's raw logits at `position`.
    fn draft_logits(&self, position: usize) -> &[f32] {
        self.draft_logits[position].get_or_init(|| host_row(self.ctx.draft_logits, position))
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
        argmax(self.target_logits(position))
    }

    /// The target's raw logits at `position`.
    pub fn target_logits(&self, position: usize) -> &[f32] {
        self.target_logits[position].get_or_init(|| host_row(self.ctx.target_logits, position))
    }

    /// The target's distribution at `position` (temperature 1 when decoding greedily, so
    /// judges that compare distributions still have one).
    pub fn target_probs(&self, position: usize) -> &[f32] {
        self.target_probs[position]
            .get_or_init(|| probabilities(self.target_logits(position), self.ctx.sampling))
    }

    /// The draft's distribution at `position`, the one `draft_token(position)` was drawn from.
    pub fn draft_probs(&self, position: usize) -> &[f32] {
        self.draft_probs[position]
            .get_or_init(|| probabilities(self.draft_logits(position), self.ctx.sampling))
    }

    /// The target's raw distribution at `position` (temperature 1, no truncation) as
    /// log-probabilities: what the judges compare, whatever the sampling settings.
    pub fn target_log_probs(&self, position: usize) -> &[f32] {
        self.target_log_probs[position].get_or_init(|| log_softmax(self.target_logits(position)))
    }

    /// The draft's raw distribution at `position`, as [`Self::target_log_probs`].
    pub fn draft_log_probs(&self, position: usize) -> &[f32] {
        self.draft_log_probs[position].get_or_init(|| log_softmax(self.draft_logits(position)))
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

/// Row `position` of `(rows, vocab)` f32 logits ([`StepView::new`] checked both) on the host.
fn host_row(logits: &Tensor, position: usize) -> Vec<f32> {
    logits
        .get(position)
        .and_then(|row| row.to_vec1::<f32>())
        .expect("StepView::new checked the rows and their dtype")
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
    use candle_core::Device;
    let to_tensor = |rows: &[Vec<f32>]| {
        Tensor::from_vec(rows.concat(), (rows.len(), rows[0].len()), &Device::Cpu).unwrap()
    };
    let (draft, target) = (to_tensor(draft_logits), to_tensor(target_logits));
    with_tensors(&draft, &target, draft_tokens, sampling, (target_hidden, draft_hidden), |view| {
        body(view.unwrap())
    })
}

/// A [`StepView`] (or why there is none) over logits `draft` and `target` as given.
#[cfg(test)]
fn with_tensors<R>(
    draft: &Tensor,
    target: &Tensor,
    draft_tokens: &[u32],
    sampling: &SamplingSettings,
    (target_hidden, draft_hidden): (
        &mistralrs_core::speculative_hook::HiddenStates,
        &mistralrs_core::speculative_hook::HiddenStates,
    ),
    body: impl FnOnce(Result<&StepView>) -> R,
) -> R {
    let ctx = VerifyContext {
        seq_id: 0,
        prefix: &[],
        draft_tokens,
        draft_logits: draft,
        target_logits: target,
        target_hidden,
        draft_hidden,
        target_lm_head: None,
        sampling,
        draft_time: std::time::Duration::ZERO,
        verify_time: std::time::Duration::ZERO,
    };
    match StepView::new(&ctx) {
        Ok(view) => body(Ok(&view)),
        Err(e) => body(Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use mistralrs_core::speculative_hook::HiddenStates;

    use super::*;

    fn refusal(draft: &Tensor, target: &Tensor) -> String {
        let (none, sampling) = (HiddenStates::default(), SamplingSettings::default());
        with_tensors(draft, target, &[0, 0], &sampling, (&none, &none), |view| match view {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.to_string(),
        })
    }

    #[test]
    fn rows_are_read_where_asked_and_unreadable_logits_are_refused() {
        let rows = |n: usize, vocab: usize| {
            let values: Vec<f32> = (0..n * vocab).map(|i| ((i * 7) % 11) as f32).collect();
            Tensor::from_vec(values, (n, vocab), &Device::Cpu).unwrap()
        };
        let (draft, target) = (rows(2, 5), rows(3, 5));
        let (none, sampling) = (HiddenStates::default(), SamplingSettings::default());
        with_tensors(&draft, &target, &[1, 2], &sampling, (&none, &none), |view| {
            let view = view.unwrap();
            assert_eq!(view.gamma(), 2);
            assert_eq!(view.target_logits(2), target.get(2).unwrap().to_vec1::<f32>().unwrap());
            assert_eq!(view.draft_log_probs(1).len(), 5);
            assert_eq!(view.target_argmax(0), argmax(&target.get(0).unwrap().to_vec1::<f32>().unwrap()));
        });
        assert!(refusal(&draft, &rows(2, 5)).contains("target scored 2 positions for 2 drafts"));
        assert!(refusal(&draft, &rows(3, 6)).contains("draft rows of 5 logits against target rows of 6"));
        let half = target.to_dtype(DType::F16).unwrap();
        assert!(refusal(&draft, &half).contains("F16 (target)"), "{}", refusal(&draft, &half));
    }
}
