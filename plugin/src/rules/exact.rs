//! `exact`: keep a draft iff the target would have emitted the same token.

use anyhow::Result;
use rand::rngs::StdRng;

use super::BaseVerdict;
use crate::step_view::StepView;

/// Greedy: compare with the target's arg-max. Sampling: draw y ~ p once; keep the draft iff
/// y equals it, else emit y. Either way the emitted token is distributed as p.
pub fn verify(view: &StepView, position: usize, rng: &mut StdRng) -> Result<BaseVerdict> {
    let target = view.target_token(position, rng)?;
    Ok(if target == view.draft_token(position) {
        BaseVerdict::Accept
    } else {
        BaseVerdict::Reject { correction: target }
    })
}
