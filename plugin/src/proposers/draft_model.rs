//! The draft model as a scored proposer, so that SV's verify-length policy wraps it as it
//! wraps the EAGLE head and prompt lookup. The draft model itself runs inside the patched
//! pipeline, which hands its logits rows over one draft position at a time
//! ([`DraftRequest::rows`]); this proposer scores each row by its most likely token's
//! probability, asks the policy whether the draft is worth drawing, and draws it.
//!
//! A draft-model row is far dearer than a head's: drafting's cost per row read (forward,
//! score, draw), measured as it runs, prices each draft apart from the verify row
//! ([`ScoredProposer::draft_ms`]). The first forward is paid before its row can be scored,
//! so a sequence skips drafting altogether (the step decodes one token) when its last first
//! draft's score says even that draft would not pay; every
//! [`PROBE_EVERY`]-th skipped step drafts anyway, so the score follows the text. Both
//! choices rest on rows already drawn, never on the draft they decide about, so lossless
//! rules stay lossless.

use std::{collections::HashMap, sync::Mutex, time::Instant};

use candle_core::{DType, Device, Result, Tensor, D};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};

use super::scored::{propose_alone, propose_unpriced, DraftPricing, ScoredDrafts, ScoredProposer};

/// After this many steps in a row without drafting, a sequence drafts again to see whether
/// its drafts pay now.
pub const PROBE_EVERY: usize = 8;

/// Weight of the newest step in the running mean of drafting's cost per row read.
const ROW_MS_WEIGHT: f64 = 0.1;

/// What a sequence's earlier steps say about its next first draft.
#[derive(Clone, Copy, Debug, Default)]
struct FirstDraft {
    /// The score of the last first draft read (`None` before any).
    score: Option<f32>,
    /// Steps in a row that drafted nothing on that score.
    skipped: usize,
}

/// Drafts from the pipeline's draft model under a pricing policy.
pub struct DraftModelProposer {
    vocab_size: usize,
    first_drafts: Mutex<HashMap<usize, FirstDraft>>,
    /// Running mean of what drafting costs per draft-model row read, in milliseconds
    /// (`None` before the first step after a sequence's prompt).
    row_ms: Mutex<Option<f64>>,
}

impl DraftModelProposer {
    /// A proposer for a draft model over a vocabulary of `vocab_size` tokens.
    pub fn new(vocab_size: usize) -> Self {
        Self { vocab_size, first_drafts: Mutex::new(HashMap::new()), row_ms: Mutex::new(None) }
    }

    /// Fold one step's drafting cost per row read into the running mean.
    fn record_row_cost(&self, ms: f64) {
        let mut mean = self.row_ms.lock().unwrap();
        *mean = Some(match *mean {
            Some(m) => m + ROW_MS_WEIGHT * (ms - m),
            None => ms,
        });
    }

    /// Sequences with state held (a test sees each released).
    pub fn live_sequences(&self) -> usize {
        self.first_drafts.lock().unwrap().len()
    }

    /// Whether request `index` reads the draft model at all this step: not when its last
    /// first draft's score would not pay for a row, unless it skipped [`PROBE_EVERY`] steps.
    fn drafts_this_step(&self, seq_id: usize, index: usize, pricing: &dyn DraftPricing) -> bool {
        let mut first_drafts = self.first_drafts.lock().unwrap();
        let first = first_drafts.entry(seq_id).or_default();
        let Some(score) = first.score else {
            return true;
        };
        if pricing.worth_drafting(index, &[score]) || first.skipped + 1 >= PROBE_EVERY {
            first.skipped = 0;
            return true;
        }
        first.skipped += 1;
        false
    }

    /// Draw up to `r.gamma` drafts from the draft model's rows, each scored before it is
    /// drawn, stopping at the first `pricing` finds not worth drawing.
    fn draft(&self, index: usize, r: &mut DraftRequest<'_>, pricing: &dyn DraftPricing) -> Result<ScoredDrafts> {
        let Some(rows) = r.rows.as_mut() else {
            candle_core::bail!("the draft-model proposer was asked to draft without the draft model's rows");
        };
        let (mut tokens, mut logits, mut scores) = (Vec::new(), Vec::new(), Vec::new());
        // A sequence's first step reads its whole prompt: not a draft's cost.
        let first_step = !self.first_drafts.lock().unwrap().contains_key(&r.seq_id);
        let started = Instant::now();
        let mut read = 0;
        if r.gamma > 0 && self.drafts_this_step(r.seq_id, index, pricing) {
            let mut drawn = None;
            while tokens.len() < r.gamma {
                let row = rows.next_row(drawn)?;
                read += 1;
                scores.push(confidence(&row)?);
                if tokens.is_empty() {
                    self.first_drafts.lock().unwrap().entry(r.seq_id).or_default().score = Some(scores[0]);
                }
                if !pricing.worth_drafting(index, &scores) {
                    scores.pop();
                    break;
                }
                let token = (r.sample)(&row)?;
                tokens.push(token);
                logits.push(row.unsqueeze(0)?);
                drawn = Some(token);
            }
        }
        if read > 0 && !first_step {
            // Everything drafting took (forwards, scores, draws), per row read.
            self.record_row_cost(started.elapsed().as_secs_f64() * 1e3 / read as f64);
        }
        let logits = match logits.is_empty() {
            true => Tensor::zeros((0, self.vocab_size), DType::F32, &Device::Cpu)?,
            false => Tensor::cat(&logits, 0)?,
        };
        Ok(ScoredDrafts { tokens, logits, scores })
    }
}

/// A row's score: the probability its most likely token has under the softmax of `row`.
fn confidence(row: &Tensor) -> Result<f32> {
    let row = row.to_dtype(DType::F32)?;
    let max = row.max(D::Minus1)?;
    let sum = row.broadcast_sub(&max)?.exp()?.sum(D::Minus1)?;
    Ok(1.0 / sum.to_scalar::<f32>()?)
}

impl Proposer for DraftModelProposer {
    fn target_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    fn observe_target(&self, _features: &TargetFeatures<'_>) -> Result<()> {
        Ok(())
    }

    fn propose(&self, seq_id: usize, gamma: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        propose_alone(self, seq_id, gamma, sample)
    }

    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        propose_unpriced(self, requests)
    }

    fn release(&self, seq_id: usize) {
        self.first_drafts.lock().unwrap().remove(&seq_id);
    }

    /// The draft model's cache lives in the pipeline.
    fn cache_len(&self, _seq_id: usize) -> usize {
        0
    }
}

impl ScoredProposer for DraftModelProposer {
    fn propose_scored(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> Result<Vec<ScoredDrafts>> {
        requests.iter_mut().enumerate().map(|(i, r)| self.draft(i, r, pricing)).collect()
    }

    /// A draft costs one row of drafting (forward, score, draw), as long as rows so far took.
    fn draft_ms(&self) -> Option<f64> {
        Some(self.row_ms.lock().unwrap().unwrap_or(0.0))
    }
}

#[cfg(test)]
mod tests {
    use mistralrs_core::speculative_hook::DraftModelRows;

    use super::*;
    use crate::proposers::scored::DraftEverything;

    const VOCAB: usize = 4;

    /// Scripted draft-model rows, read in order; records the token handed back with each read.
    struct ScriptedRows {
        rows: Vec<Vec<f32>>,
        read: usize,
        drawn: Vec<Option<u32>>,
    }

    impl ScriptedRows {
        fn new(rows: Vec<Vec<f32>>) -> Self {
            Self { rows, read: 0, drawn: Vec::new() }
        }
    }

    impl DraftModelRows for ScriptedRows {
        fn next_row(&mut self, drawn: Option<u32>) -> Result<Tensor> {
            self.drawn.push(drawn);
            let row = Tensor::new(self.rows[self.read].as_slice(), &Device::Cpu)?;
            self.read += 1;
            Ok(row)
        }
    }

    /// Prices a draft worth drawing while every score so far is at least `floor`.
    struct Floor(f32);

    impl DraftPricing for Floor {
        fn keep_chances(&self, scores: &[f32]) -> Vec<f32> {
            scores.to_vec()
        }
        fn latency(&self) -> crate::verify_latency::VerifyLatency {
            DraftEverything.latency()
        }
        fn worth_drafting(&self, _request: usize, scores: &[f32]) -> bool {
            scores.iter().all(|&s| s >= self.0)
        }
    }

    /// Logits of a row whose most likely token `top` has probability `p` (the rest share
    /// what is left equally).
    fn row(top: usize, p: f32) -> Vec<f32> {
        let rest = (1.0 - p) / (VOCAB - 1) as f32;
        (0..VOCAB).map(|t| if t == top { p.ln() } else { rest.ln() }).collect()
    }

    fn draft(p: &DraftModelProposer, rows: &mut ScriptedRows, gamma: usize, pricing: &dyn DraftPricing) -> ScoredDrafts {
        let mut sample = |row: &Tensor| row.argmax(D::Minus1)?.to_scalar::<u32>();
        let mut requests = [DraftRequest { seq_id: 1, gamma, sample: &mut sample, rows: Some(rows), greedy: true }];
        p.propose_scored(&mut requests, pricing).unwrap().pop().unwrap()
    }

    #[test]
    fn drafts_each_row_scored_by_its_top_probability_and_feeds_back_what_it_drew() {
        let p = DraftModelProposer::new(VOCAB);
        let mut rows = ScriptedRows::new(vec![row(2, 0.9), row(1, 0.7), row(3, 0.6)]);
        let d = draft(&p, &mut rows, 3, &DraftEverything);
        assert_eq!(d.tokens, vec![2, 1, 3]);
        assert_eq!(d.logits.dims(), &[3, VOCAB]);
        for (score, want) in d.scores.iter().zip([0.9, 0.7, 0.6]) {
            assert!((score - want).abs() < 1e-5, "{:?}", d.scores);
        }
        // Each row after the first follows the token drawn from the one before.
        assert_eq!(rows.drawn, vec![None, Some(2), Some(1)]);
    }

    #[test]
    fn stops_before_the_first_draft_not_worth_drawing() {
        let p = DraftModelProposer::new(VOCAB);
        let mut rows = ScriptedRows::new(vec![row(2, 0.9), row(1, 0.3), row(3, 0.9)]);
        let d = draft(&p, &mut rows, 3, &Floor(0.5));
        assert_eq!(d.tokens, vec![2]);
        assert_eq!(d.scores.len(), 1);
        assert_eq!(d.logits.dims(), &[1, VOCAB]);
        assert_eq!(rows.read, 2, "the second row was read to be scored, the third never");
    }

    #[test]
    fn a_first_draft_that_would_not_pay_skips_the_draft_model_until_a_probe() {
        let p = DraftModelProposer::new(VOCAB);
        // The first step reads one row, scores it 0.3 and draws nothing.
        let mut rows = ScriptedRows::new(vec![row(0, 0.3); PROBE_EVERY + 1]);
        let d = draft(&p, &mut rows, 4, &Floor(0.5));
        assert!(d.tokens.is_empty() && d.logits.dims() == [0, VOCAB]);
        assert_eq!(rows.read, 1);
        // The next PROBE_EVERY - 1 steps read no row at all: they decode one token.
        for _ in 0..PROBE_EVERY - 1 {
            assert!(draft(&p, &mut rows, 4, &Floor(0.5)).tokens.is_empty());
        }
        assert_eq!(rows.read, 1);
        // Then one probes the draft model again.
        draft(&p, &mut rows, 4, &Floor(0.5));
        assert_eq!(rows.read, 2);
        // Without a pricing that refuses, every step drafts.
        let mut rows = ScriptedRows::new(vec![row(0, 0.3); 4]);
        assert_eq!(draft(&p, &mut rows, 2, &DraftEverything).tokens.len(), 2);
        p.release(1);
        assert_eq!(p.live_sequences(), 0);
    }

    #[test]
    fn each_draft_is_priced_at_the_draft_models_forward_time() {
        struct SlowRows(ScriptedRows);
        impl DraftModelRows for SlowRows {
            fn next_row(&mut self, drawn: Option<u32>) -> Result<Tensor> {
                std::thread::sleep(std::time::Duration::from_millis(5));
                self.0.next_row(drawn)
            }
        }
        let p = DraftModelProposer::new(VOCAB);
        assert_eq!(p.draft_ms(), Some(0.0), "nothing measured yet");
        let mut rows = SlowRows(ScriptedRows::new(vec![row(1, 0.9); 2]));
        let mut sample = |row: &Tensor| row.argmax(D::Minus1)?.to_scalar::<u32>();
        for step in 0..2 {
            rows.0.read = 0;
            let mut requests = [DraftRequest { seq_id: 1, gamma: 2, sample: &mut sample, rows: Some(&mut rows), greedy: true }];
            p.propose_scored(&mut requests, &DraftEverything).unwrap();
            if step == 0 {
                assert_eq!(p.draft_ms(), Some(0.0), "the first step, which reads the prompt, is not a draft's cost");
            }
        }
        assert!(p.draft_ms().unwrap() >= 5.0, "{:?}", p.draft_ms());
    }

    #[test]
    fn without_the_draft_models_rows_it_refuses_to_draft() {
        let p = DraftModelProposer::new(VOCAB);
        let err = p.propose(1, 3, &mut |row| row.argmax(D::Minus1)?.to_scalar::<u32>()).unwrap_err();
        assert!(err.to_string().contains("without the draft model's rows"), "{err}");
    }
}
