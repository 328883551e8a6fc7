//! The narrow interface between a proposer and the verify-length policy that may wrap it
//! (SV, [`crate::sv::policy::VerifyPolicy`]): a proposer drafts and scores each draft with the
//! chance it thinks the target keeps it, and asks a [`DraftPricing`] whether one more draft
//! is worth drafting. Proposers depend on this module only, never on the policy.

use candle_core::{Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer};

use crate::verify_latency::VerifyLatency;

/// A proposal whose drafts carry scores: `scores[i]` is the proposer's estimate, known
/// before draft i was drawn, that the target keeps it given that it keeps the ones before.
pub struct ScoredDrafts {
    pub tokens: Vec<u32>,
    /// `[tokens, vocab]`: the distribution each draft was drawn from.
    pub logits: Tensor,
    pub scores: Vec<f32>,
}

/// What the policy tells a proposer while it drafts.
pub trait DraftPricing {
    /// The chance each draft of these scores is kept, as the policy prices it.
    fn keep_chances(&self, scores: &[f32]) -> Vec<f32>;
    /// T_v as the policy prices verify rows now.
    fn latency(&self) -> VerifyLatency;
    /// Whether request `request` of the draft call should draft the last of `scores` (the
    /// drafts before it first). A proposer stops that sequence's chain at the first no.
    fn worth_drafting(&self, request: usize, scores: &[f32]) -> bool;
}

/// Pricing without a policy: scores taken as they are, every draft worth drafting.
pub struct DraftEverything;

impl DraftPricing for DraftEverything {
    fn keep_chances(&self, scores: &[f32]) -> Vec<f32> {
        scores.to_vec()
    }
    fn latency(&self) -> VerifyLatency {
        VerifyLatency::generic_prior()
    }
    fn worth_drafting(&self, _request: usize, _scores: &[f32]) -> bool {
        true
    }
}

/// A draft call's pricing for some of its requests, drafted as a call of their own:
/// request `i` of that call is request `requests[i]` of the whole.
pub struct RequestsOf<'a> {
    pub pricing: &'a dyn DraftPricing,
    pub requests: Vec<usize>,
}

impl DraftPricing for RequestsOf<'_> {
    fn keep_chances(&self, scores: &[f32]) -> Vec<f32> {
        self.pricing.keep_chances(scores)
    }
    fn latency(&self) -> VerifyLatency {
        self.pricing.latency()
    }
    fn worth_drafting(&self, request: usize, scores: &[f32]) -> bool {
        self.pricing.worth_drafting(self.requests[request], scores)
    }
}

/// A proposer a [`crate::sv::policy::VerifyPolicy`] can wrap.
pub trait ScoredProposer: Proposer {
    /// Draft for `requests` as [`Proposer::propose_batch`] does, each draft scored, each
    /// sequence's chain stopping where `pricing` says one more draft is not worth it.
    fn propose_scored(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> Result<Vec<ScoredDrafts>>;

    /// The target verifies only the first `verified` drafts of `seq_id`'s last proposal
    /// (a proposer learning from its drafts' fates must not count the others refused).
    fn verifies(&self, _seq_id: usize, _verified: usize) {}

    /// What making one draft costs, in milliseconds, where it is dear enough to price
    /// apart from the verify (a draft model's forward). `None`: drafting is nearly free,
    /// and the policy's learned T_v takes it in with the verify.
    fn draft_ms(&self) -> Option<f64> {
        None
    }
}

/// [`Proposer::propose`] as a batch of one request (a proposer drafting its batches itself).
/// `propose` does not say whether the sequence samples, so the request says it does: the
/// choices that keep rejection sampling lossless hold either way.
pub fn propose_alone(
    proposer: &dyn Proposer,
    seq_id: usize,
    gamma: usize,
    sample: &mut dyn FnMut(&Tensor) -> Result<u32>,
) -> Result<(Vec<u32>, Tensor)> {
    let mut drafted = proposer.propose_batch(&mut [DraftRequest { seq_id, gamma, sample, rows: None, greedy: false }])?;
    Ok(drafted.pop().expect("one request, one answer"))
}

/// [`Proposer::propose_batch`] of a scored proposer drafting without a policy.
pub fn propose_unpriced(proposer: &dyn ScoredProposer, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
    Ok(proposer.propose_scored(requests, &DraftEverything)?.into_iter().map(|d| (d.tokens, d.logits)).collect())
}

/// How many of `drafts`, drafted from sequence position `from`, the target kept, now that the
/// sequence holds `tokens`: draft i sat at `from + i` and was kept when the token there is it
/// and is not the last one (the step's own correction or bonus).
pub fn kept_drafts(drafts: &[u32], from: usize, tokens: &[u32]) -> usize {
    let committed = tokens.get(from..).unwrap_or(&[]);
    let kept = drafts.iter().zip(committed).take_while(|(d, c)| d == c).count();
    kept.min(committed.len().saturating_sub(1))
}
