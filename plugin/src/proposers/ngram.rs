//! Prompt lookup: drafts the continuation of the longest recent n-gram match in the text so
//! far (the prompt and the tokens committed since), as transformers'
//! `prompt_lookup_num_tokens`, vLLM's `ngram` and llama.cpp's `ngram-*` do. It costs no
//! model call and pays where an answer copies its context: code repeating a signature or a
//! docstring, edits, quotes of earlier turns.
//!
//! A draft is a point mass at the drafted token: its logit row is 0 there and very negative
//! elsewhere, so the accept rule's sampler draws that token and knows q exactly. Under
//! `rejection` a draft is then kept with probability p(token), and a refusal resamples from
//! norm(max(0, p − q)): lossless, like any other proposer.
//!
//! Each draft's score, what a verify-length policy prices it by, is the keep rate learned
//! for the length of the match it continues ([`LookupKeepRates`]).

use std::{collections::HashMap, sync::Mutex};

use candle_core::{Device, Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use serde::Serialize;

use super::scored::{kept_drafts, propose_alone, propose_unpriced, DraftPricing, ScoredDrafts, ScoredProposer};

/// The logit of every token but the drafted one: exp() of it is 0 in f32 at any temperature
/// a sampler divides by, and it stays finite so divergences never meet inf − inf.
const POINT_MASS_ELSEWHERE: f32 = -1.0e9;

/// Which n-grams are looked up: the longest first, from `max_n` down to `min_n` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NgramSettings {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramSettings {
    fn default() -> Self {
        Self { min_n: 2, max_n: 4 }
    }
}

/// A lookup's result: the drafts and the length of the n-gram they continue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NgramMatch {
    pub drafts: Vec<u32>,
    pub n: usize,
}

/// One sequence's tokens and, for every n, where each n-gram last ended. Positions are
/// indexed incrementally as tokens are committed, so a lookup costs O(max_n) hashes
/// whatever the context's length.
#[derive(Clone, Debug, Default)]
pub struct NgramIndex {
    tokens: Vec<u32>,
    /// `last_end[n - min_n][hash of an n-gram]`: the largest p < len with the n-gram at
    /// `tokens[p - n..p]`, so the text continuing it starts at p.
    last_end: Vec<HashMap<u64, usize>>,
    /// Ends below this are indexed (every end but the current length, which is the suffix
    /// being looked up and must not match itself).
    indexed_to: usize,
    settings: NgramSettings,
}

fn hash(tokens: &[u32]) -> u64 {
    // FNV-1a over the token ids: collisions are caught by comparing the tokens on lookup.
    tokens.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

impl NgramIndex {
    pub fn new(settings: NgramSettings) -> Self {
        Self {
            last_end: vec![HashMap::new(); settings.max_n - settings.min_n + 1],
            settings,
            ..Default::default()
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Take the sequence's tokens so far. Usually they extend the ones seen; anything else
    /// (a sequence id reused, a history rewritten) starts the index afresh.
    pub fn update(&mut self, tokens: &[u32]) {
        if !tokens.starts_with(&self.tokens) {
            *self = Self::new(self.settings);
        }
        self.tokens.extend_from_slice(&tokens[self.tokens.len()..]);
        let len = self.tokens.len();
        for end in self.indexed_to.max(1)..len {
            for (k, map) in self.last_end.iter_mut().enumerate() {
                let n = self.settings.min_n + k;
                if end >= n {
                    map.insert(hash(&self.tokens[end - n..end]), end);
                }
            }
        }
        self.indexed_to = len.max(self.indexed_to);
    }

    /// Up to `gamma` tokens continuing the longest n-gram (from `max_n` down to `min_n`) that
    /// ends the text and also occurs earlier; the latest earlier occurrence wins.
    pub fn lookup(&self, gamma: usize) -> Option<NgramMatch> {
        let len = self.tokens.len();
        if gamma == 0 {
            return None;
        }
        for n in (self.settings.min_n..=self.settings.max_n).rev() {
            if len < n + 1 {
                continue;
            }
            let suffix = &self.tokens[len - n..];
            let Some(&start) = self.last_end[n - self.settings.min_n].get(&hash(suffix)) else { continue };
            if start < len && start >= n && &self.tokens[start - n..start] == suffix {
                let drafts = self.tokens[start..len.min(start + gamma)].to_vec();
                return Some(NgramMatch { drafts, n });
            }
        }
        None
    }
}

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

    /// A proposal of `verified` drafts after an `n`-token match kept its first `kept`.
    pub fn record(&mut self, n: usize, verified: usize, kept: usize) {
        let judged = (kept + 1).min(verified);
        let entry = &mut self.counts[n - self.min_n];
        entry.0 += kept as f64;
        entry.1 += judged as f64;
    }
}

/// A sequence's last lookup proposal, until the target's verdict on it.
#[derive(Clone, Debug)]
struct LastLookup {
    /// The length of the match the drafts continued.
    n: usize,
    drafts: Vec<u32>,
    /// The sequence's length when it drafted: the first draft sat there.
    from: usize,
    /// How many of the drafts the target verified.
    verified: usize,
}

/// The prompt-lookup proposer: one [`NgramIndex`] per live sequence.
pub struct NgramProposer {
    settings: NgramSettings,
    vocab_size: usize,
    sequences: Mutex<HashMap<usize, NgramIndex>>,
    keep_rates: Mutex<LookupKeepRates>,
    last: Mutex<HashMap<usize, LastLookup>>,
}

impl NgramProposer {
    /// `vocab_size`: the width of the target's logit rows.
    pub fn new(settings: NgramSettings, vocab_size: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(
            settings.min_n >= 1 && settings.min_n <= settings.max_n,
            "n-gram lengths {}..={}: need 1 <= ngram_min <= ngram_max",
            settings.min_n,
            settings.max_n
        );
        Ok(Self {
            settings,
            vocab_size,
            sequences: Mutex::new(HashMap::new()),
            // A lookup draft starts as a coin flip worth 8 drafts; a few steps then tell.
            keep_rates: Mutex::new(LookupKeepRates::new(settings.min_n, settings.max_n, 0.5, 8.0)),
            last: Mutex::new(HashMap::new()),
        })
    }

    /// The keep rates learned so far.
    pub fn keep_rates(&self) -> LookupKeepRates {
        self.keep_rates.lock().unwrap().clone()
    }

    /// The first `count` drafts of `found` as `seq_id`'s proposal, each scored by the keep
    /// rate of `found`'s match length; the target's verdict on them is learned from.
    pub fn propose_found(&self, seq_id: usize, found: &NgramMatch, count: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<ScoredDrafts> {
        let drafts = &found.drafts[..count.min(found.drafts.len())];
        let (tokens, logits) = self.point_mass_drafts(drafts, sample)?;
        let score = self.keep_rates.lock().unwrap().rate(found.n) as f32;
        let from = self.sequence_len(seq_id);
        self.last.lock().unwrap().insert(seq_id, LastLookup { n: found.n, drafts: tokens.clone(), from, verified: tokens.len() });
        Ok(ScoredDrafts { scores: vec![score; tokens.len()], tokens, logits })
    }

    /// No drafts for `seq_id` this step.
    pub fn propose_nothing(&self, seq_id: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<ScoredDrafts> {
        self.last.lock().unwrap().remove(&seq_id);
        let (tokens, logits) = self.point_mass_drafts(&[], sample)?;
        Ok(ScoredDrafts { tokens, logits, scores: Vec::new() })
    }

    /// Learn from what became of `seq_id`'s last lookup drafts, now that `tokens` are
    /// committed.
    fn settle(&self, seq_id: usize, tokens: &[u32]) {
        let Some(last) = self.last.lock().unwrap().remove(&seq_id) else {
            return;
        };
        let kept = kept_drafts(&last.drafts[..last.verified], last.from, tokens);
        self.keep_rates.lock().unwrap().record(last.n, last.verified, kept);
    }

    /// Sequences with state held (a test sees each released).
    pub fn live_sequences(&self) -> usize {
        self.sequences.lock().unwrap().len()
    }

    pub fn settings(&self) -> NgramSettings {
        self.settings
    }

    /// Tokens seen of `seq_id` so far.
    pub fn sequence_len(&self, seq_id: usize) -> usize {
        self.sequences.lock().unwrap().get(&seq_id).map_or(0, NgramIndex::len)
    }

    /// Up to `gamma` drafts for `seq_id` (within the target's vocabulary), if its text so
    /// far repeats an n-gram.
    pub fn lookup(&self, seq_id: usize, gamma: usize) -> Option<NgramMatch> {
        let mut found = self.sequences.lock().unwrap().get(&seq_id)?.lookup(gamma)?;
        if let Some(outside) = found.drafts.iter().position(|&t| t as usize >= self.vocab_size) {
            found.drafts.truncate(outside);
        }
        (!found.drafts.is_empty()).then_some(found)
    }

    /// `drafts` as a proposal: point-mass rows, each drawn by the rule's sampler so that it
    /// records q (a point mass can only give back its own token).
    pub fn point_mass_drafts(&self, drafts: &[u32], sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        let logits = self.point_masses(drafts)?;
        for (row, &token) in drafts.iter().enumerate() {
            let drawn = sample(&logits.get(row)?)?;
            if drawn != token {
                candle_core::bail!("the sampler drew {drawn} from a point mass at {token}");
            }
        }
        Ok((drafts.to_vec(), logits))
    }

    /// `[drafts, vocab]` rows, each a point mass at its draft.
    fn point_masses(&self, drafts: &[u32]) -> Result<Tensor> {
        let mut logits = vec![POINT_MASS_ELSEWHERE; drafts.len() * self.vocab_size];
        for (row, &token) in drafts.iter().enumerate() {
            logits[row * self.vocab_size + token as usize] = 0.0;
        }
        Tensor::from_vec(logits, (drafts.len(), self.vocab_size), &Device::Cpu)
    }
}

impl Proposer for NgramProposer {
    fn target_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> Result<()> {
        self.settle(features.seq_id, features.tokens);
        let mut sequences = self.sequences.lock().unwrap();
        sequences
            .entry(features.seq_id)
            .or_insert_with(|| NgramIndex::new(self.settings))
            .update(features.tokens);
        Ok(())
    }

    fn propose(&self, seq_id: usize, gamma: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        propose_alone(self, seq_id, gamma, sample)
    }

    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        propose_unpriced(self, requests)
    }

    fn release(&self, seq_id: usize) {
        self.sequences.lock().unwrap().remove(&seq_id);
        self.last.lock().unwrap().remove(&seq_id);
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.sequences.lock().unwrap().get(&seq_id).map_or(0, NgramIndex::len)
    }
}

impl ScoredProposer for NgramProposer {
    /// The longest match's continuation, cut before the first draft `pricing` finds not
    /// worth drafting (drafts cost nothing to make, so the cut comes after the lookup).
    fn propose_scored(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> Result<Vec<ScoredDrafts>> {
        requests
            .iter_mut()
            .enumerate()
            .map(|(i, r)| match self.lookup(r.seq_id, r.gamma) {
                Some(found) => {
                    let score = self.keep_rates.lock().unwrap().rate(found.n) as f32;
                    let scores = vec![score; found.drafts.len()];
                    let count = (1..=scores.len()).take_while(|&k| pricing.worth_drafting(i, &scores[..k])).count();
                    self.propose_found(r.seq_id, &found, count, &mut *r.sample)
                }
                None => self.propose_nothing(r.seq_id, &mut *r.sample),
            })
            .collect()
    }

    fn verifies(&self, seq_id: usize, verified: usize) {
        if let Some(last) = self.last.lock().unwrap().get_mut(&seq_id) {
            last.verified = verified.min(last.drafts.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(tokens: &[u32], min_n: usize, max_n: usize) -> NgramIndex {
        let mut index = NgramIndex::new(NgramSettings { min_n, max_n });
        index.update(tokens);
        index
    }

    #[test]
    fn no_earlier_occurrence_drafts_nothing() {
        assert_eq!(index(&[1, 2, 3, 4, 5], 1, 3).lookup(4), None);
        assert_eq!(index(&[], 1, 3).lookup(4), None);
        assert_eq!(index(&[7], 1, 3).lookup(4), None);
    }

    #[test]
    fn one_match_drafts_what_followed_it() {
        // "… 1 2 | 3 4 5 … 1 2": the bigram 1 2 was followed by 3 4 5.
        let found = index(&[9, 1, 2, 3, 4, 5, 8, 1, 2], 2, 3).lookup(3).unwrap();
        assert_eq!(found, NgramMatch { drafts: vec![3, 4, 5], n: 2 });
        // γ bounds the drafts.
        assert_eq!(index(&[9, 1, 2, 3, 4, 5, 8, 1, 2], 2, 3).lookup(1).unwrap().drafts, [3]);
    }

    #[test]
    fn the_longest_match_wins_then_the_latest() {
        // Suffix 5 1 2: the trigram occurred once (followed by 7), the bigram 1 2 later
        // (followed by 6). The trigram wins.
        let tokens = [5, 1, 2, 7, 0, 1, 2, 6, 0, 5, 1, 2];
        assert_eq!(index(&tokens, 2, 3).lookup(2).unwrap(), NgramMatch { drafts: vec![7, 0], n: 3 });
        // Bigrams only: the later occurrence (followed by 6) wins.
        assert_eq!(index(&tokens, 2, 2).lookup(2).unwrap(), NgramMatch { drafts: vec![6, 0], n: 2 });
    }

    #[test]
    fn a_match_near_the_end_drafts_only_what_exists() {
        // "1 2 1 2": the bigram 1 2 at the start is followed by 1 2 (the suffix itself).
        assert_eq!(index(&[1, 2, 1, 2], 2, 2).lookup(4).unwrap().drafts, [1, 2]);
        // "3 3 3": the bigram 3 3 ended at position 2, followed by one 3.
        assert_eq!(index(&[3, 3, 3], 2, 2).lookup(4).unwrap().drafts, [3]);
    }

    #[test]
    fn incremental_updates_index_like_one_update() {
        let tokens = [4, 1, 2, 3, 9, 4, 1, 2, 3, 5, 4, 1];
        let whole = index(&tokens, 1, 3);
        let mut grown = NgramIndex::new(NgramSettings { min_n: 1, max_n: 3 });
        for end in [3, 4, 9, 12] {
            grown.update(&tokens[..end]);
        }
        assert_eq!(grown.lookup(3), whole.lookup(3));
        assert_eq!(whole.lookup(3).unwrap(), NgramMatch { drafts: vec![2, 3, 5], n: 2 });
        // Another history under the same id starts afresh.
        grown.update(&[8, 9]);
        assert_eq!(grown.len(), 2);
        assert_eq!(grown.lookup(3), None);
    }

    #[test]
    fn drafts_are_point_masses_the_sampler_draws() {
        let proposer = NgramProposer::new(NgramSettings { min_n: 1, max_n: 2 }, 10).unwrap();
        let tokens = [1, 2, 3, 1, 2];
        proposer
            .observe_target(&TargetFeatures { seq_id: 7, start: 0, layers: &[], next_tokens: &tokens[1..], tokens: &tokens })
            .unwrap();
        assert_eq!(proposer.cache_len(7), 5);
        let mut drawn = Vec::new();
        let (drafts, logits) = proposer
            .propose(7, 4, &mut |row| {
                let t = row.argmax(0)?.to_scalar::<u32>()?;
                drawn.push(t);
                Ok(t)
            })
            .unwrap();
        assert_eq!(drafts, [3, 1, 2]);
        assert_eq!(drawn, drafts);
        let probs = candle_nn::ops::softmax_last_dim(&logits).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(probs[0][3], 1.0);
        assert_eq!(probs[0].iter().sum::<f32>(), 1.0);
        proposer.release(7);
        assert_eq!(proposer.live_sequences(), 0);
        assert_eq!(proposer.propose(7, 4, &mut |_| unreachable!()).unwrap().0, Vec::<u32>::new());
    }

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
    fn keep_rates_learn_from_the_verified_drafts_only() {
        let proposer = NgramProposer::new(NgramSettings { min_n: 1, max_n: 2 }, 10).unwrap();
        let mut greedy = |row: &Tensor| row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>();
        let observe = |tokens: &[u32]| {
            proposer
                .observe_target(&TargetFeatures { seq_id: 1, start: 0, layers: &[], next_tokens: &tokens[1..], tokens })
                .unwrap()
        };
        // "1 2 3 4 1 2" continues as "3 4 1 2" after the 2-gram "1 2".
        let mut tokens = vec![1, 2, 3, 4, 1, 2];
        observe(&tokens);
        let (drafts, _) = proposer.propose(1, 4, &mut greedy).unwrap();
        assert_eq!(drafts, vec![3, 4, 1, 2]);
        // The verify took two drafts, kept both and added a token equal to the third draft:
        // 2 judged, 2 kept, the unverified ones not counted refused.
        proposer.verifies(1, 2);
        tokens.extend([3, 4, 1]);
        observe(&tokens);
        let rates = proposer.keep_rates();
        assert_eq!(rates.rate(2), (2.0 + 4.0) / (2.0 + 8.0));
        assert_eq!(rates.rate(1), 0.5);
    }

    #[test]
    fn bad_lengths_are_refused() {
        let err = NgramProposer::new(NgramSettings { min_n: 3, max_n: 2 }, 10).err().unwrap().to_string();
        assert!(err.contains("3..=2"), "{err}");
        assert!(NgramProposer::new(NgramSettings { min_n: 0, max_n: 2 }, 10).is_err());
    }
}
