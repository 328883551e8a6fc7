//! AutoJudge (runtime): a logistic head on hidden states at the position that encodes the
//! draft token says whether a mismatch matters; an unimportant one (P(important) < τ) is
//! kept.
//!
//! The target state encoding draft i is row i + 1 of the verify forward. The draft state
//! encoding draft i is the draft's forward i + 1, which exists only for i < γ − 1: the
//! last draft is never fed back to the draft model, so a head using draft features cannot
//! judge the last position and leaves it to the base rule.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use candle_core::DType;
use mistralrs_core::speculative_hook::CaptureRequest;
use serde::Deserialize;
use verdict_heads::LogisticHead;

use super::{head_path, LoadedFingerprints};
use crate::{judge::Judge, step_view::StepView};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoJudgeConfig {
    /// The head file `train-head` wrote; relative to the config file's folder.
    pub head: PathBuf,
    /// τ: keep a mismatch iff P(important) < τ. Defaults to the head's recommendation.
    pub threshold: Option<f64>,
}

impl AutoJudgeConfig {
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = self.threshold {
            ensure!(
                (0.0..=1.0).contains(&t),
                "threshold must be a probability in [0, 1], got {t}"
            );
        }
        Ok(())
    }
}

pub struct AutoJudge {
    head: LogisticHead,
    threshold: f32,
}

impl AutoJudge {
    pub fn load(
        config: &AutoJudgeConfig,
        base_dir: &Path,
        models: &LoadedFingerprints,
    ) -> Result<Self> {
        let path = head_path(base_dir, &config.head);
        let head = LogisticHead::load(&path)?;
        head.check_models(&path, models.target, models.draft)?;
        let threshold = config.threshold.map_or(head.threshold, |t| t as f32);
        tracing::info!(
            "autojudge head {} ({} features), τ = {threshold}",
            path.display(),
            head.features.name()
        );
        Ok(Self::new(head, threshold))
    }

    pub fn new(head: LogisticHead, threshold: f32) -> Self {
        Self { head, threshold }
    }

    /// P(important) of the draft at `position`, or `None` where the features do not exist.
    pub fn importance(&self, view: &StepView, position: usize) -> Result<Option<f32>> {
        Ok(match self.features(view, position)? {
            Some(features) => Some(self.head.probability(features.draft.as_deref(), &features.target)?),
            None => None,
        })
    }

    /// The head's inputs for the draft at `position`: the target's state at the position that
    /// reads the draft token (verify row `position + 1`), and the draft's (its forward
    /// `position + 1`) when the head uses it; `None` where the draft's does not exist. What
    /// `train-head features` stores for a mismatch must equal this.
    pub fn features(&self, view: &StepView, position: usize) -> Result<Option<JudgeFeatures>> {
        let target = view
            .ctx
            .target_hidden
            .last
            .as_ref()
            .context("AutoJudge needs the target's last hidden state; it was not captured")?;
        let target = target.get(position + 1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let draft = if self.head.features.uses_draft() {
            let draft =
                view.ctx.draft_hidden.last.as_ref().context(
                    "AutoJudge needs the draft's last hidden state; it was not captured",
                )?;
            if position + 1 >= draft.dim(0)? {
                return Ok(None);
            }
            Some(draft.get(position + 1)?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
        } else {
            None
        };
        Ok(Some(JudgeFeatures { target, draft }))
    }
}

/// One draft's features as the AutoJudge head reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct JudgeFeatures {
    pub target: Vec<f32>,
    /// `None` for a head on target features alone.
    pub draft: Option<Vec<f32>>,
}

impl Judge for AutoJudge {
    fn name(&self) -> &str {
        "autojudge"
    }

    fn target_capture(&self) -> CaptureRequest {
        CaptureRequest {
            last_hidden: true,
            ..Default::default()
        }
    }

    fn draft_capture(&self) -> CaptureRequest {
        CaptureRequest {
            last_hidden: self.head.features.uses_draft(),
            ..Default::default()
        }
    }

    fn rescues(&self, view: &StepView, position: usize) -> Result<bool> {
        let importance = self.importance(view, position)?;
        tracing::debug!(position, ?importance, threshold = self.threshold, "autojudge");
        Ok(importance.is_some_and(|p| p < self.threshold))
    }
}
