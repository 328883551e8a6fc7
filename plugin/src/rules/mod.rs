//! Lossless base rules: they decide each drafted position before any judge looks at it.

mod exact;
mod rejection;

use anyhow::Result;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::step_view::StepView;

/// What a base rule says about one drafted position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseVerdict {
    Accept,
    /// The draft is refused; `correction` is the token to emit in its place.
    Reject {
        correction: u32,
    },
}

/// Which lossless rule to apply.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "kebab-case")]
pub enum BaseRule {
    /// Keep a draft iff it equals the token the target itself picks (arg-max, or a sample
    /// of p under sampling).
    #[default]
    Exact,
    /// Leviathan et al. / Chen et al.: keep with probability min(1, p/q), else draw from
    /// norm(max(0, p − q)).
    Rejection,
}

impl BaseRule {
    pub fn name(self) -> &'static str {
        match self {
            BaseRule::Exact => "exact",
            BaseRule::Rejection => "rejection",
        }
    }

    pub fn verify(self, view: &StepView, position: usize, rng: &mut StdRng) -> Result<BaseVerdict> {
        match self {
            BaseRule::Exact => exact::verify(view, position, rng),
            BaseRule::Rejection => rejection::verify(view, position, rng),
        }
    }
}
