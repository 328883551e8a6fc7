//! Prompt lookup and an EAGLE head together (`proposer = "ngram+eagle"`): each step, each
//! sequence sends the target the drafts worth most.
//!
//! Both proposals are priced as SV prices the head's alone: the expected tokens a step
//! yields (one, plus each draft's chance that it and every draft before it are kept) over
//! the verify's cost at its rows (T_v, learned on this machine when SV learns it). A lookup
//! draft's chance is a keep rate learned per match length from the fates of earlier lookup
//! drafts; a head draft's is the head's confidence (or SV's keep rate for it). The lookup's
//! drafts are cut to the count that maximises the step's goodput, and the head is not asked
//! at all when no proposal of its could beat the lookup's. When neither pays for a row,
//! the step decodes one token.
//!
//! Which proposal a step takes never depends on a draft's value, only on match lengths and
//! confidences known before the drafts are drawn, and both proposals carry their exact
//! distributions: lossless rules stay lossless.

use std::{collections::HashMap, sync::Arc, sync::Mutex};

use candle_core::{Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use serde::Serialize;

use super::{eagle_proposer::EagleProposer, ngram::NgramProposer};
use crate::sv::latency::VerifyLatency;

/// Keep rates of lookup drafts by the length of the n-gram they continue: each draft's
/// chance of being kept given that the drafts before it were, counted from verified drafts
/// up to each step's first refusal, starting from a prior.
#[derive(Clone, Debug, Serialize)]
pub struct LookupKeepRates {
    min_n: usize,
    /// (kept, judged) per n, from `min_n` up.
    counts: Vec<(f64, f64)>,
    prior: f64,
    prior_weight: f64,
}

impl LookupKeepRates {
    pub fn new(min_n: usize, max_n: usize, prior: f64, prior_weight: f64) -> Self {
        Self {
            min_n,
            counts: vec![(0.0, 0.0); max_n - min_n + 1],
            prior,
            prior_weight,
        }
    }

    /// The chance a draft continuing an `n`-token match is kept, its predecessors kept.
    pub fn rate(&self, n: usize) -> f64 {
        let (kept, judged) = self.counts[n - self.min_n];
        (kept + self.prior * self.prior_weight) / (judged + self.prior_weight)
    }

    /// A proposal of `drafted` drafts after an `n`-token match kept its first `kept`.
    pub fn record(&mut self, n: usize, drafted: usize, kept: usize) {
        let judged = (kept + 1).min(drafted);
        let entry = &mut self.counts[n - self.min_n];
        entry.0 += kept as f64;
        entry.1 += judged as f64;
    }
}

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

/// What a sequence's last step sent.
#[derive(Clone, Debug)]
enum LastProposal {
    /// Lookup drafts after an `n`-token match, from sequence length `from`.
    Lookup { n: usize, drafts: Vec<u32>, from: usize },
    Head,
    Nothing,
}

/// Counts of the choices made (for reports and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ChoiceCounts {
    pub lookup: u64,
    pub head: u64,
    pub nothing: u64,
    /// Steps where the lookup's proposal made asking the head pointless.
    pub head_skipped: u64,
}

pub struct CombinedProposer {
    lookup: Arc<NgramProposer>,
    head: Arc<EagleProposer>,
    /// Drafts a lookup proposal may hold; the head drafts up to the step's γ.
    lookup_gamma: usize,
    head_gamma: usize,
    keep_rates: Mutex<LookupKeepRates>,
    last: Mutex<HashMap<usize, LastProposal>>,
    choices: Mutex<ChoiceCounts>,
}

impl CombinedProposer {
    pub fn new(lookup: Arc<NgramProposer>, head: Arc<EagleProposer>, lookup_gamma: usize, head_gamma: usize) -> Self {
        let settings = lookup.settings();
        Self {
            lookup,
            head,
            lookup_gamma,
            head_gamma,
            // A lookup draft starts as a coin flip worth 8 drafts; a few steps then tell.
            keep_rates: Mutex::new(LookupKeepRates::new(settings.min_n, settings.max_n, 0.5, 8.0)),
            last: Mutex::new(HashMap::new()),
            choices: Mutex::new(ChoiceCounts::default()),
        }
    }

    /// The most drafts a step of this proposer holds (the engine's γ).
    pub fn gamma(&self) -> usize {
        self.lookup_gamma.max(self.head_gamma)
    }

    pub fn choices(&self) -> ChoiceCounts {
        *self.choices.lock().unwrap()
    }

    pub fn keep_rates(&self) -> LookupKeepRates {
        self.keep_rates.lock().unwrap().clone()
    }

    /// Learn from what became of `seq_id`'s last lookup drafts, now that `tokens` are
    /// committed.
    fn settle(&self, seq_id: usize, tokens: &[u32]) {
        let last = self.last.lock().unwrap().remove(&seq_id);
        if let Some(LastProposal::Lookup { n, drafts, from }) = last {
            let committed = tokens.get(from..).unwrap_or(&[]);
            let kept = drafts.iter().zip(committed).take_while(|(d, c)| d == c).count();
            // The last committed token is the step's own (correction or bonus), not a draft.
            let kept = kept.min(committed.len().saturating_sub(1));
            self.keep_rates.lock().unwrap().record(n, drafts.len(), kept);
        }
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
            self.settle(f.seq_id, f.tokens);
            self.lookup.observe_target(f)?;
        }
        self.head.observe_batch(features)
    }

    fn propose(&self, seq_id: usize, gamma: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        let mut drafted = self.propose_batch(&mut [DraftRequest { seq_id, gamma, sample }])?;
        Ok(drafted.pop().expect("one request, one answer"))
    }

    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        let latency = self.head.verify_latency();
        let rates = self.keep_rates();
        // The lookup's best proposal per sequence: its drafts cut to the count that pays.
        let lookups: Vec<Option<(usize, Vec<u32>, f64)>> = requests
            .iter()
            .map(|r| {
                let found = self.lookup.lookup(r.seq_id, self.lookup_gamma.min(r.gamma))?;
                let gains = chain(std::iter::repeat_n(rates.rate(found.n), found.drafts.len()));
                let (k, value) = best_count(&gains, &latency);
                Some((found.n, found.drafts[..k].to_vec(), value))
            })
            .collect();
        // The head's best imaginable proposal: all of its drafts kept.
        let head_best = goodput(&vec![1.0; self.head_gamma], self.head_gamma, &latency);
        let asks_head: Vec<bool> = lookups.iter().map(|l| l.as_ref().is_none_or(|(_, _, value)| *value < head_best)).collect();
        let head_gamma = self.head_gamma;
        let mut head_requests: Vec<DraftRequest<'_>> = requests
            .iter_mut()
            .zip(&asks_head)
            .filter(|(_, asks)| **asks)
            .map(|(r, _)| DraftRequest { seq_id: r.seq_id, gamma: head_gamma.min(r.gamma), sample: &mut *r.sample })
            .collect();
        let mut head_out = match head_requests.is_empty() {
            true => Vec::new(),
            false => self.head.propose_batch(&mut head_requests)?,
        }
        .into_iter();
        drop(head_requests);

        let mut out = Vec::with_capacity(requests.len());
        let mut last = self.last.lock().unwrap();
        let mut choices = self.choices.lock().unwrap();
        for ((request, lookup), asked) in requests.iter_mut().zip(lookups).zip(asks_head) {
            let from = self.lookup.sequence_len(request.seq_id);
            let head = match asked {
                true => Some(head_out.next().expect("one head proposal per request that asked")),
                false => None,
            };
            let head_value = head.as_ref().map(|(drafts, _)| {
                let gains = chain(self.head.last_keep_chances(request.seq_id).iter().map(|&c| c as f64));
                goodput(&gains, drafts.len().min(gains.len()), &latency)
            });
            let takes_lookup = match (&lookup, head_value) {
                (Some((_, drafts, value)), head_value) => !drafts.is_empty() && head_value.is_none_or(|h| *value > h),
                (None, _) => false,
            };
            if takes_lookup {
                let (n, drafts, _) = lookup.unwrap();
                self.head.proposal_replaced(request.seq_id, drafts.len());
                let proposal = self.lookup.point_mass_drafts(&drafts, &mut *request.sample)?;
                choices.lookup += 1;
                choices.head_skipped += u64::from(!asked);
                last.insert(request.seq_id, LastProposal::Lookup { n, drafts, from });
                out.push(proposal);
            } else if let Some(proposal) = head {
                if proposal.0.is_empty() {
                    choices.nothing += 1;
                    last.insert(request.seq_id, LastProposal::Nothing);
                } else {
                    choices.head += 1;
                    last.insert(request.seq_id, LastProposal::Head);
                }
                out.push(proposal);
            } else {
                // The lookup's proposal was not worth a row, and it made the head pointless
                // (never so: a worthless proposal is below any head's best) — decode one token.
                choices.nothing += 1;
                last.insert(request.seq_id, LastProposal::Nothing);
                out.push(self.lookup.point_mass_drafts(&[], &mut *request.sample)?);
            }
        }
        Ok(out)
    }

    fn verify_lengths(&self, seq_ids: &[usize], drafted: &[usize]) -> Vec<usize> {
        let last = self.last.lock().unwrap();
        let from_head: Vec<bool> = seq_ids.iter().map(|id| matches!(last.get(id), Some(LastProposal::Head))).collect();
        drop(last);
        let (head_ids, head_drafted): (Vec<usize>, Vec<usize>) =
            seq_ids.iter().zip(drafted).zip(&from_head).filter(|(_, h)| **h).map(|((id, n), _)| (*id, *n)).unzip();
        let mut head_lengths = self.head.verify_lengths(&head_ids, &head_drafted).into_iter();
        // Lookup drafts were already cut to what pays.
        drafted.iter().zip(&from_head).map(|(&n, &h)| if h { head_lengths.next().unwrap_or(n) } else { n }).collect()
    }

    fn packs_verify_rows(&self) -> bool {
        self.head.packs_verify_rows()
    }

    fn release(&self, seq_id: usize) {
        self.last.lock().unwrap().remove(&seq_id);
        self.lookup.release(seq_id);
        self.head.release(seq_id);
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.head.cache_len(seq_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_rates_start_at_the_prior_and_count_drafts_up_to_the_first_refusal() {
        let mut rates = LookupKeepRates::new(2, 4, 0.5, 8.0);
        assert_eq!(rates.rate(3), 0.5);
        // 4 drafts, 2 kept: drafts 0, 1 kept, draft 2 refused, draft 3 never judged.
        rates.record(3, 4, 2);
        assert_eq!(rates.rate(3), (2.0 + 4.0) / (3.0 + 8.0));
        // All 4 kept: 4 judged.
        rates.record(3, 4, 4);
        assert_eq!(rates.rate(3), (6.0 + 4.0) / (7.0 + 8.0));
        assert_eq!(rates.rate(2), 0.5);
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
