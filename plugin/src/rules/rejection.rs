//! `rejection`: speculative sampling (Leviathan et al. 2023, Chen et al. 2023).
//!
//! With x ~ q, keeping x with probability min(1, p(x)/q(x)) and otherwise drawing from
//! norm(max(0, p − q)) emits a token distributed exactly as p. Greedy decoding is the limit
//! of one-hot p and q, which reduces to arg-max matching.

use anyhow::Result;
use rand::{rngs::StdRng, Rng};

use super::BaseVerdict;
use crate::{
    distribution::{residual, sample},
    step_view::StepView,
};

pub fn verify(view: &StepView, position: usize, rng: &mut StdRng) -> Result<BaseVerdict> {
    if view.sampling().is_greedy() {
        // One-hot p and q: exactly arg-max matching.
        return super::exact::verify(view, position, rng);
    }
    let draft = view.draft_token(position);
    let p = view.target_probs(position);
    let q = view.draft_probs(position);
    let (p_x, q_x) = (p[draft as usize], q[draft as usize]);
    // q(x) > 0 because x was drawn from q; the guard only protects against a caller bug.
    let keep_probability = if q_x > 0.0 { (p_x / q_x).min(1.0) } else { 0.0 };
    if rng.random::<f32>() < keep_probability {
        Ok(BaseVerdict::Accept)
    } else {
        Ok(BaseVerdict::Reject {
            correction: sample(&residual(p, q), rng)?,
        })
    }
}
