//! `VerdictRule`: the judge stack plugged into mistral.rs's speculative pipeline.
//!
//! This is where a drafted token is kept or refused: [`VerdictRule::accept`] walks the
//! drafts in order and asks the active [`JudgeStack`] about each one.

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, RwLock},
    time::Instant,
};

use candle_core::Tensor;
use mistralrs_core::speculative_hook::{
    AcceptDecision, AcceptRule, CaptureRequest, SamplingSettings, StepReport, VerifyContext,
};
use rand::{rngs::StdRng, SeedableRng};

use crate::{
    judge::{JudgeStack, PositionOutcome},
    metrics::Metrics,
    step_view::{draft_token, StepView},
};

pub struct VerdictRule {
    stack: RwLock<Arc<JudgeStack>>,
    rng: Mutex<StdRng>,
    metrics: Arc<Metrics>,
    /// Every [`StepReport`], kept only when asked (tests check cache lengths with it).
    step_log: Mutex<Option<Vec<StepReport>>>,
    /// Sequences past their first step; the first verify forward also processes the prompt.
    running: Mutex<HashSet<usize>>,
    /// Sequences whose step is decided but not yet reported: mistral.rs answers a request
    /// while committing its last tokens, a moment before that step's report arrives.
    steps_in_flight: Mutex<HashSet<usize>>,
}

impl VerdictRule {
    pub fn new(stack: JudgeStack, seed: u64, metrics: Arc<Metrics>) -> Self {
        Self {
            stack: RwLock::new(Arc::new(stack)),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            metrics,
            step_log: Mutex::new(None),
            running: Mutex::new(HashSet::new()),
            steps_in_flight: Mutex::new(HashSet::new()),
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Swap the judge stack used from the next step on (the bench runs several in turn).
    /// Capture needs are read per step, so a stack that needs hidden states gets them.
    pub fn set_stack(&self, stack: impl Into<Arc<JudgeStack>>) {
        *self.stack.write().unwrap_or_else(|e| e.into_inner()) = stack.into();
    }

    pub fn stack(&self) -> Arc<JudgeStack> {
        self.stack.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Start keeping step reports, dropping any kept so far.
    pub fn record_steps(&self) {
        *self.step_log.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    pub fn recorded_steps(&self) -> Vec<StepReport> {
        self.step_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    /// Wait (at most 2 s) until every decided step has been reported, so metrics read after
    /// a response include its last step.
    pub async fn settle(&self) {
        for _ in 0..2000 {
            if self.steps_in_flight.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        tracing::warn!("a speculative step was decided but never reported");
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, StdRng> {
        self.rng.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn to_candle(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

impl AcceptRule for VerdictRule {
    fn target_capture(&self) -> CaptureRequest {
        self.stack().capture(|j| j.target_capture())
    }

    fn draft_capture(&self) -> CaptureRequest {
        self.stack().capture(|j| j.draft_capture())
    }

    fn sample_draft(
        &self,
        _seq_id: usize,
        logits: &Tensor,
        sampling: &SamplingSettings,
    ) -> candle_core::Result<u32> {
        let logits = logits.to_vec1::<f32>()?;
        draft_token(&logits, sampling, &mut *self.rng()).map_err(to_candle)
    }

    fn accept(&self, ctx: &VerifyContext<'_>) -> candle_core::Result<AcceptDecision> {
        let start = Instant::now();
        let stack = self.stack();
        let view = StepView::new(ctx).map_err(to_candle)?;
        let mut rng = self.rng();
        let mut decision = None;
        for position in 0..view.gamma() {
            let outcome = stack
                .decide(&view, position, &mut rng, &self.metrics)
                .map_err(to_candle)?;
            if let PositionOutcome::Refused { correction } = outcome {
                decision = Some(AcceptDecision {
                    accepted: position,
                    next_token: correction,
                });
                break;
            }
        }
        let decision = match decision {
            Some(d) => d,
            // Every draft kept: the bonus token comes from the target's last position.
            None => AcceptDecision {
                accepted: view.gamma(),
                next_token: view
                    .target_token(view.gamma(), &mut *rng)
                    .map_err(to_candle)?,
            },
        };
        let prefill = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ctx.seq_id);
        self.metrics
            .record_timing(ctx.draft_time, ctx.verify_time, start.elapsed(), prefill);
        self.steps_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ctx.seq_id);
        Ok(decision)
    }

    fn forget(&self, seq_id: usize) {
        self.running.lock().unwrap_or_else(|e| e.into_inner()).remove(&seq_id);
        self.steps_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&seq_id);
    }

    fn observe(&self, report: &StepReport) {
        self.metrics.record_step(report);
        self.steps_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&report.seq_id);
        if report.finished {
            self.running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&report.seq_id);
        }
        if let Some(log) = self
            .step_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            log.push(report.clone());
        }
    }
}
