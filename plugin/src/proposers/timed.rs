//! A proposer wrapper that times `observe_target` and `observe_batch`: the pipeline times
//! drafting and verify, but a head's forward over the committed positions runs after the
//! accept rule, outside both, and is part of what a head-drafted step costs. Every other
//! call, the batched ones included, goes straight to the wrapped proposer.

use std::{sync::Arc, time::Instant};

use candle_core::{Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};

use crate::metrics::Metrics;

pub struct TimedProposer {
    inner: Arc<dyn Proposer>,
    metrics: Arc<Metrics>,
}

impl TimedProposer {
    pub fn new(inner: Arc<dyn Proposer>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }
}

impl Proposer for TimedProposer {
    fn target_layers(&self) -> Vec<usize> {
        self.inner.target_layers()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> Result<()> {
        let start = Instant::now();
        let out = self.inner.observe_target(features);
        self.metrics.record_observe(start.elapsed());
        out
    }

    fn propose(
        &self,
        seq_id: usize,
        gamma: usize,
        sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
    ) -> Result<(Vec<u32>, Tensor)> {
        self.inner.propose(seq_id, gamma, sample)
    }

    fn observe_batch(&self, features: &[TargetFeatures<'_>]) -> Result<()> {
        let start = Instant::now();
        let out = self.inner.observe_batch(features);
        self.metrics.record_observe(start.elapsed());
        out
    }

    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        self.inner.propose_batch(requests)
    }

    fn verify_lengths(&self, seq_ids: &[usize], drafted: &[usize]) -> Vec<usize> {
        self.inner.verify_lengths(seq_ids, drafted)
    }

    fn packs_verify_rows(&self) -> bool {
        self.inner.packs_verify_rows()
    }

    fn release(&self, seq_id: usize) {
        self.inner.release(seq_id)
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.inner.cache_len(seq_id)
    }
}
