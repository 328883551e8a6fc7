//! PAD (runtime): a pivot MLP on the target's hidden state at layer L − 8 (at the draft
//! token's position) plus [entropy, p(token)] of the target distribution that scored it.
//! A refused draft is kept when P(pivot) ≤ σ; any draft whose target probability is below
//! the floor is refused, even one the base rule accepted.
//!
//! p and the entropy come from the raw target distribution (temperature 1), the same
//! convention `train-head` extracts features with.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use mistralrs_core::speculative_hook::CaptureRequest;
use serde::Deserialize;
use verdict_heads::PivotMlp;

use super::{head_path, LoadedFingerprints};
use crate::{divergence::entropy, judge::Judge, step_view::StepView};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PadConfig {
    /// The pivot head file; relative to the config file's folder.
    pub head: PathBuf,
    /// σ: keep a refused draft iff P(pivot) ≤ σ. Defaults to the head's recommendation.
    pub sigma: Option<f64>,
    /// Refuse any draft whose target probability is below this.
    #[serde(default = "default_floor")]
    pub floor: f64,
}

fn default_floor() -> f64 {
    1e-4
}

impl PadConfig {
    pub fn validate(&self) -> Result<()> {
        if let Some(s) = self.sigma {
            ensure!((0.0..=1.0).contains(&s), "sigma must be in [0, 1], got {s}");
        }
        ensure!(
            (0.0..=1.0).contains(&self.floor),
            "floor must be a probability in [0, 1], got {}",
            self.floor
        );
        Ok(())
    }
}

pub struct Pad {
    head: PivotMlp,
    sigma: f32,
    floor: f32,
    /// The absolute index of the tapped layer in the loaded target.
    layer: usize,
}

impl Pad {
    pub fn load(config: &PadConfig, base_dir: &Path, models: &LoadedFingerprints) -> Result<Self> {
        let path = head_path(base_dir, &config.head);
        let head = PivotMlp::load(&path)?;
        head.target
            .check_loaded(&path.display().to_string(), "target", models.target)?;
        let sigma = config.sigma.map_or(head.sigma, |s| s as f32);
        Ok(Self::new(head, sigma, config.floor as f32))
    }

    pub fn new(head: PivotMlp, sigma: f32, floor: f32) -> Self {
        let layer = head.resolved_layer(head.target.num_layers);
        Self {
            head,
            sigma,
            floor,
            layer,
        }
    }

    fn target_probability(&self, view: &StepView, position: usize) -> f32 {
        view.target_log_probs(position)[view.draft_token(position) as usize].exp()
    }

    /// P(pivot) of the draft at `position`.
    pub fn pivot_probability(&self, view: &StepView, position: usize) -> Result<f32> {
        let (_, states) = view
            .ctx
            .target_hidden
            .layers
            .iter()
            .find(|(layer, _)| *layer == self.layer)
            .with_context(|| {
                format!(
                    "PAD needs the target's layer {} output; it was not captured",
                    self.layer
                )
            })?;
        let hidden = states.get(position + 1)?.to_vec1::<f32>()?;
        let log_p = view.target_log_probs(position);
        self.head.probability(
            &hidden,
            entropy(log_p) as f32,
            self.target_probability(view, position),
        )
    }
}

impl Judge for Pad {
    fn name(&self) -> &str {
        "pad"
    }

    fn target_capture(&self) -> CaptureRequest {
        CaptureRequest {
            layers: vec![self.head.layer],
            ..Default::default()
        }
    }

    fn rescues(&self, view: &StepView, position: usize) -> Result<bool> {
        if self.target_probability(view, position) < self.floor {
            return Ok(false);
        }
        Ok(self.pivot_probability(view, position)? <= self.sigma)
    }

    fn vetoes(&self, view: &StepView, position: usize) -> Result<bool> {
        Ok(self.target_probability(view, position) < self.floor)
    }
}
