//! Prompt lookup and an EAGLE head together (`proposer = "ngram+eagle"`): each step, each
//! sequence sends the target the drafts worth most.
//!
//! Both proposals are priced as SV prices the head's alone: the expected tokens a step
//! yields (one, plus each draft's chance that it and every draft before it are kept) over
//! the verify's cost at its rows (T_v, learned on this machine when SV learns it), both as
//! the verify-length policy wrapping this proposer prices them. A lookup draft's score is a
//! keep rate learned per match length from the fates of earlier lookup drafts; a head
//! draft's is the head's confidence. The lookup's
//! drafts are cut to the count that maximises the step's goodput, and the head is not asked
//! at all when no proposal of its could beat the lookup's. When neither pays for a row,
//! the step decodes one token.
//!
//! Both proposals carry their exact distributions. When the sequence samples, which
//! proposal a step takes depends only on what was known before any draft was drawn: the
//! lookup's match length and the head's confidence in its first draft. (Each later
//! confidence is read from the row after a drawn draft, so a choice reading them would keep
//! the head's first draft more often for some values than for others, and rejection
//! sampling, whose keep test takes it as drawn from its row, would no longer be lossless.)
//! Decoding greedily the head's whole chain is priced: what is kept is the target's arg-max
//! whatever was drafted.

use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use serde::{Deserialize, Serialize};

use super::{
    eagle_proposer::EagleProposer,
    ngram::{LookupKeepRates, NgramProposer},
};
use super::scored::{propose_alone, propose_unpriced, DraftPricing, RequestsOf, ScoredDrafts, ScoredProposer};
use crate::verify_latency::VerifyLatency;

/// A step's expected tokens per ms with the first `k` of drafts whose chained keep
/// chances are `gains` (gain i: drafts 0..=i all kept).
fn goodput(gains: &[f64], k: usize, latency: &VerifyLatency) -> f64 {
    (1.0 + gains[..k].iter().sum::<f64>()) / latency.at(k + 1)
}

/// The chained keep chances of drafts each kept with `rates[i]` given the ones before.
fn chain(rates: impl IntoIterator<Item = f64>) -> Vec<f64> {
    rates
        .into_iter()
        .scan(1.0, |kept, rate| {
            *kept *= rate.clamp(0.0, 1.0);
            Some(*kept)
        })
        .collect()
}

/// The count of drafts (0..=len) that maximises goodput, and that goodput.
fn best_count(gains: &[f64], latency: &VerifyLatency) -> (usize, f64) {
    (0..=gains.len()).map(|k| (k, goodput(gains, k, latency))).fold((0, f64::MIN), |best, x| if x.1 > best.1 { x } else { best })
}

/// What the head's proposal of `scores` (`drafted` drafts made) is worth a step. When the
/// sequence samples, only its first score counts, taken for each of the `most` drafts the
/// head may make: that much was known before its first draft was drawn (see the module's
/// comment).
fn head_value(scores: &[f32], drafted: usize, most: usize, greedy: bool, pricing: &dyn DraftPricing, latency: &VerifyLatency) -> f64 {
    match (greedy, scores.first()) {
        (true, _) => {
            let gains = chain(pricing.keep_chances(scores).into_iter().map(f64::from));
            goodput(&gains, drafted.min(gains.len()), latency)
        }
        (false, Some(&first)) => {
            let gains = chain(pricing.keep_chances(&vec![first; most]).into_iter().map(f64::from));
            best_count(&gains, latency).1
        }
        (false, None) => goodput(&[], 0, latency),
    }
}

/// Counts of the choices made (for reports and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChoiceCounts {
    pub lookup: u64,
    pub head: u64,
    pub nothing: u64,
    /// Steps where the lookup's proposal made asking the head pointless.
    pub head_skipped: u64,
}

impl ChoiceCounts {
    /// The choices made since `before` was read.
    pub fn since(&self, before: &ChoiceCounts) -> ChoiceCounts {
        ChoiceCounts {
            lookup: self.lookup.saturating_sub(before.lookup),
            head: self.head.saturating_sub(before.head),
            nothing: self.nothing.saturating_sub(before.nothing),
            head_skipped: self.head_skipped.saturating_sub(before.head_skipped),
        }
    }
}

impl std::ops::AddAssign for ChoiceCounts {
    fn add_assign(&mut self, other: ChoiceCounts) {
        self.lookup += other.lookup;
        self.head += other.head;
        self.nothing += other.nothing;
        self.head_skipped += other.head_skipped;
    }
}

pub struct CombinedProposer {
    lookup: Arc<NgramProposer>,
    head: Arc<EagleProposer>,
    /// Drafts a lookup proposal may hold; the head drafts up to the step's γ.
    lookup_gamma: usize,
    head_gamma: usize,
    choices: Mutex<ChoiceCounts>,
}

impl CombinedProposer {
    pub fn new(lookup: Arc<NgramProposer>, head: Arc<EagleProposer>, lookup_gamma: usize, head_gamma: usize) -> Self {
        Self { lookup, head, lookup_gamma, head_gamma, choices: Mutex::new(ChoiceCounts::default()) }
    }

    /// The most drafts a step of this proposer holds (the engine's γ).
    pub fn gamma(&self) -> usize {
        self.lookup_gamma.max(self.head_gamma)
    }

    pub fn choices(&self) -> ChoiceCounts {
        *self.choices.lock().unwrap()
    }

    pub fn keep_rates(&self) -> LookupKeepRates {
        self.lookup.keep_rates()
    }

    /// The head drafting (for tests: its state is released with the sequence's).
    pub fn head(&self) -> &Arc<EagleProposer> {
        &self.head
    }
}

impl Proposer for CombinedProposer {
    fn target_layers(&self) -> Vec<usize> {
        self.head.target_layers()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> Result<()> {
        self.observe_batch(std::slice::from_ref(features))
    }

    fn observe_batch(&self, features: &[TargetFeatures<'_>]) -> Result<()> {
        for f in features {
            self.lookup.observe_target(f)?;
        }
        self.head.observe_batch(features)
    }

    fn propose(&self, seq_id: usize, gamma: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        propose_alone(self, seq_id, gamma, sample)
    }

    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        propose_unpriced(self, requests)
    }

    fn packs_verify_rows(&self) -> bool {
        self.head.packs_verify_rows()
    }

    fn release(&self, seq_id: usize) {
        self.lookup.release(seq_id);
        self.head.release(seq_id);
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.head.cache_len(seq_id)
    }
}

impl ScoredProposer for CombinedProposer {
    fn propose_scored(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> Result<Vec<ScoredDrafts>> {
        let latency = pricing.latency();
        let rates = self.lookup.keep_rates();
        // The lookup's best proposal per sequence: its drafts cut to the count that pays.
        let lookups: Vec<Option<(_, usize, f64)>> = requests
            .iter()
            .map(|r| {
                let found = self.lookup.lookup(r.seq_id, self.lookup_gamma.min(r.gamma))?;
                let scores = vec![rates.rate(found.n) as f32; found.drafts.len()];
                let gains = chain(pricing.keep_chances(&scores).into_iter().map(f64::from));
                let (k, value) = best_count(&gains, &latency);
                Some((found, k, value))
            })
            .collect();
        // The head's best imaginable proposal: all of its drafts kept.
        let head_best = goodput(&vec![1.0; self.head_gamma], self.head_gamma, &latency);
        let asks_head: Vec<bool> = lookups.iter().map(|l| l.as_ref().is_none_or(|(_, _, value)| *value < head_best)).collect();
        let head_gamma = self.head_gamma;
        let asking: Vec<usize> = (0..requests.len()).filter(|&i| asks_head[i]).collect();
        let mut head_requests: Vec<DraftRequest<'_>> = requests
            .iter_mut()
            .zip(&asks_head)
            .filter(|(_, asks)| **asks)
            .map(|(r, _)| DraftRequest { seq_id: r.seq_id, gamma: head_gamma.min(r.gamma), sample: &mut *r.sample, rows: None, greedy: r.greedy })
            .collect();
        let mut head_out = match head_requests.is_empty() {
            true => Vec::new(),
            false => self.head.propose_scored(&mut head_requests, &RequestsOf { pricing, requests: asking })?,
        }
        .into_iter();
        drop(head_requests);

        let mut out = Vec::with_capacity(requests.len());
        let mut choices = self.choices.lock().unwrap();
        for ((request, lookup), asked) in requests.iter_mut().zip(lookups).zip(asks_head) {
            let head = match asked {
                true => Some(head_out.next().expect("one head proposal per request that asked")),
                false => None,
            };
            let most = head_gamma.min(request.gamma);
            let head_worth = head.as_ref().map(|drafts| head_value(&drafts.scores, drafts.tokens.len(), most, request.greedy, pricing, &latency));
            let takes_lookup = match (&lookup, head_worth) {
                (Some((_, k, value)), head_worth) => *k > 0 && head_worth.is_none_or(|h| *value > h),
                (None, _) => false,
            };
            if takes_lookup {
                let (found, k, _) = lookup.expect("a lookup proposal was taken");
                choices.lookup += 1;
                choices.head_skipped += u64::from(!asked);
                out.push(self.lookup.propose_found(request.seq_id, &found, k, &mut *request.sample)?);
                continue;
            }
            match head {
                Some(proposal) => {
                    match proposal.tokens.is_empty() {
                        true => choices.nothing += 1,
                        false => choices.head += 1,
                    }
                    out.push(proposal);
                }
                // The lookup's proposal was not worth a row, and it made the head pointless
                // (never so: a worthless proposal is below any head's best) — decode one token.
                None => {
                    choices.nothing += 1;
                    out.push(self.lookup.propose_nothing(request.seq_id, &mut *request.sample)?);
                }
            }
        }
        Ok(out)
    }

    fn verifies(&self, seq_id: usize, verified: usize) {
        self.lookup.verifies(seq_id, verified);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proposers::scored::DraftEverything;

    /// The head's value, as the choice against the lookup reads it: when sampling, the same
    /// whatever its drafts after the first (each drawn after the one before); decoding
    /// greedily, its whole chain.
    #[test]
    fn a_sampled_step_prices_the_head_by_what_it_knew_before_drawing() {
        let latency = VerifyLatency::linear(50.0, 10.0);
        let sure_after = [0.8f32, 0.9, 0.9, 0.9];
        let unsure_after = [0.8f32, 0.1, 0.1, 0.1];
        let sampled = |scores: &[f32]| head_value(scores, scores.len(), 4, false, &DraftEverything, &latency);
        assert_eq!(sampled(&sure_after), sampled(&unsure_after));
        // Hand-computed: 0.8 for each of 4 drafts, gains 0.8, 0.64, 0.512, 0.4096; the best
        // count is 4, (1 + 2.3616) / 90.
        assert!((sampled(&unsure_after) - 3.3616 / 90.0).abs() < 1e-6, "{}", sampled(&unsure_after));
        // A chain cut short after its first draft is priced the same when sampling.
        assert_eq!(head_value(&sure_after[..1], 1, 4, false, &DraftEverything, &latency), sampled(&sure_after));
        let greedy = |scores: &[f32]| head_value(scores, scores.len(), 4, true, &DraftEverything, &latency);
        assert!(greedy(&sure_after) > greedy(&unsure_after));
        // No draft: a plain decode's worth.
        assert_eq!(head_value(&[], 0, 4, false, &DraftEverything, &latency), 1.0 / 50.0);
    }

    #[test]
    fn the_count_that_pays_is_chosen_against_the_verify_cost() {
        // A verify of r rows costs 50 + 10 (r − 1) ms.
        let latency = VerifyLatency::linear(50.0, 10.0);
        // Drafts kept 9 times in 10: worth all 4 (1 + 0.9 + 0.81 + … over 90 ms beats 1 / 50).
        let sure = chain([0.9; 4]);
        assert_eq!(best_count(&sure, &latency).0, 4);
        // Kept 1 time in 10: a row costs a fifth of a token, a draft brings a tenth: none.
        let unsure = chain([0.1; 4]);
        assert_eq!(best_count(&unsure, &latency), (0, 1.0 / 50.0));
        // Hand-computed, rows at 15 ms: two drafts at 0.5 each, (1 + 0.5 + 0.25) / 80 <
        // (1 + 0.5) / 65, and 1 / 50 below both.
        let steeper = VerifyLatency::linear(50.0, 15.0);
        let half = chain([0.5, 0.5]);
        assert_eq!(best_count(&half, &steeper), (1, 1.5 / 65.0));
        assert!((goodput(&half, 2, &steeper) - 1.75 / 80.0).abs() < 1e-12);
    }
}
