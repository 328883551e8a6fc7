//! SV as a verify-length policy over any proposer: the proposer drafts and says what it
//! thinks of each draft (a score, read as the chance the target keeps it), and the policy
//! decides how many drafts each step sends to the target. A sequence verified alone drafts
//! while one more draft pays for its row; a batch's verify takes the drafts worth their
//! rows under load ([`VerifyBudget`]). The policy also learns what it prices by: the keep
//! rate of each score under the running judge stack ([`KeepRates`]) and T_v from the steps
//! this machine runs ([`LearnedLatency`], kept across runs by [`LatencyStore`]).
//!
//! Nothing here reads a draft's value before deciding whether it is verified: scores are
//! known before each draft is drawn, so lossless rules stay lossless.

use std::{
    borrow::Cow,
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Instant,
};

use candle_core::{Result, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use serde::{Deserialize, Serialize};

use super::{
    keep_rates::KeepRates,
    latency_store::{LatencyStore, SAVE_EVERY_SAMPLES},
    learned_latency::LearnedLatency,
    verify_budget::VerifyBudget,
};
use crate::{
    proposers::scored::{kept_drafts, propose_alone, DraftPricing, ScoredProposer},
    verify_latency::VerifyLatency,
};

/// What became of one verified draft: its score, its place in the step's chain, and
/// whether the target kept it. Drafts after a step's first refusal are not recorded: their
/// fate says nothing about them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DraftOutcome {
    /// The proposer's score of the draft (an EAGLE head's confidence).
    pub confidence: f32,
    /// 0 for a step's first draft.
    pub position: usize,
    pub kept: bool,
}

/// How the policy decides and what it learns.
#[derive(Clone, Debug, Default)]
pub struct PolicySettings {
    /// SV's goodput decides how many drafts are verified; `None`: every draft is.
    pub budget: Option<VerifyBudget>,
    /// Price drafts by the keep rates learned from verified drafts, starting from these.
    pub keep_rates: Option<KeepRates>,
    /// Price verify rows by T_v learned from the steps run, starting from this.
    pub learned_latency: Option<LearnedLatency>,
    /// Where the learned T_v is kept, and the samples of the runs before this one.
    pub latency_store: Option<(LatencyStore, u64)>,
}

/// One live sequence as the policy sees it.
#[derive(Default)]
struct SequenceState {
    /// The sequence's length when it last drafted: its first draft sat there.
    from: usize,
    drafts: Vec<u32>,
    scores: Vec<f32>,
    /// How many of `drafts` its verify took.
    verified: usize,
}

/// SV over the proposer `P`: itself a [`Proposer`] the pipeline drives.
pub struct VerifyPolicy<P: ScoredProposer> {
    proposer: Arc<P>,
    budget: Option<VerifyBudget>,
    keep_rates: Option<Mutex<KeepRates>>,
    learned_latency: Option<Mutex<LearnedLatency>>,
    latency_store: Option<(LatencyStore, u64)>,
    sequences: Mutex<HashMap<usize, SequenceState>>,
    /// The most drafts of one sequence the last batched verify took: with a budget,
    /// sequences drafted together draft at most one more (drafts no verify takes are
    /// wasted work).
    last_verified: Mutex<Option<usize>>,
    /// Each verified draft's score and fate, while recording (`train-head sv-profile`).
    outcomes: Mutex<Option<Vec<DraftOutcome>>>,
    /// The sequences of the step being drafted and verified, and when its timing began: its
    /// drafting, or its verify where the proposer prices its drafts itself (`draft_ms`).
    step_in_flight: Mutex<Option<(Vec<usize>, Instant)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<P: ScoredProposer> VerifyPolicy<P> {
    pub fn new(proposer: Arc<P>, settings: PolicySettings) -> Self {
        Self {
            proposer,
            budget: settings.budget,
            keep_rates: settings.keep_rates.map(Mutex::new),
            learned_latency: settings.learned_latency.map(Mutex::new),
            latency_store: settings.latency_store,
            sequences: Mutex::new(HashMap::new()),
            last_verified: Mutex::new(None),
            outcomes: Mutex::new(None),
            step_in_flight: Mutex::new(None),
        }
    }

    /// The wrapped proposer.
    pub fn proposer(&self) -> &Arc<P> {
        &self.proposer
    }

    /// Whether SV decides what is verified (else every draft is).
    pub fn has_budget(&self) -> bool {
        self.budget.is_some()
    }

    /// Sequences the policy holds state for (finished ones are released).
    pub fn live_sequences(&self) -> usize {
        lock(&self.sequences).len()
    }

    /// From now on, record every verified draft's score and fate ([`Self::take_outcomes`]).
    pub fn record_outcomes(&self) {
        lock(&self.outcomes).get_or_insert_with(Vec::new);
    }

    /// The draft outcomes recorded since the last call (none unless recording).
    pub fn take_outcomes(&self) -> Vec<DraftOutcome> {
        lock(&self.outcomes).as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The learned keep rates, if learning (for logs and tests).
    pub fn keep_rates(&self) -> Option<KeepRates> {
        self.keep_rates.as_ref().map(|r| lock(r).clone())
    }

    /// T_v as learned so far, if learning (for logs and tests).
    pub fn learned_latency(&self) -> Option<LearnedLatency> {
        self.learned_latency.as_ref().map(|l| lock(l).clone())
    }

    /// What the policy reads as each draft's chance of being kept: the learned keep rate of
    /// its score, or the score itself.
    fn priced(&self, scores: &[f32]) -> Vec<f32> {
        match &self.keep_rates {
            Some(rates) => lock(rates).keep_rates(scores),
            None => scores.to_vec(),
        }
    }

    /// The verify budget applied now: the configured one, its T_v replaced by the learned
    /// one when learning (copied only then).
    fn budget(&self) -> Option<Cow<'_, VerifyBudget>> {
        let budget = self.budget.as_ref()?;
        Some(match &self.learned_latency {
            Some(learned) => Cow::Owned(VerifyBudget { latency: lock(learned).current().clone(), ..budget.clone() }),
            None => Cow::Borrowed(budget),
        })
    }

    /// T_v as rows are priced now: learned on this machine, else the budget's, else a
    /// generic CPU shape.
    pub fn verify_latency(&self) -> VerifyLatency {
        match (&self.learned_latency, &self.budget) {
            (Some(learned), _) => lock(learned).current().clone(),
            (None, Some(budget)) => budget.latency.clone(),
            (None, None) => VerifyLatency::generic_prior(),
        }
    }

    /// Save the learned T_v now if steps were timed since its last save (a server stopping
    /// on a signal, where no destructor runs).
    pub fn keep_learned_latency(&self) {
        if let Some(learned) = &self.learned_latency {
            let learned = lock(learned);
            if learned.samples() % SAVE_EVERY_SAMPLES != 0 {
                self.save_learned_latency(&learned);
            }
        }
    }

    /// Save the learned T_v where it is kept, if it is; a failed save is logged, never
    /// fatal to decoding.
    fn save_learned_latency(&self, learned: &LearnedLatency) {
        if let Some((store, earlier)) = &self.latency_store {
            match store.save(learned, *earlier) {
                Ok(()) => tracing::debug!("SV: learned T_v saved to {} ({} steps)", store.path().display(), earlier + learned.samples()),
                Err(e) => tracing::warn!("SV: cannot save the learned T_v: {e:#}"),
            }
        }
    }

    /// The rows of the step in flight, now that its verify is observed, and when its
    /// drafting began: a sample of T_v once the proposer has taken those rows in. A prompt
    /// step (a forward that fed more rows than its verify's), or one whose sequences
    /// changed (one finished), gives no sample.
    fn step_in_flight_rows(&self, features: &[TargetFeatures<'_>]) -> Option<(usize, Instant)> {
        self.learned_latency.as_ref()?;
        let (ids, started) = lock(&self.step_in_flight).take()?;
        if ids.len() != features.len() || ids.iter().zip(features).any(|(id, f)| *id != f.seq_id) {
            return None;
        }
        let sequences = lock(&self.sequences);
        let widths: Vec<usize> = ids.iter().map(|id| sequences.get(id).map(|s| s.verified + 1)).collect::<Option<_>>()?;
        if features.iter().zip(&widths).any(|(f, &w)| f.next_tokens.len() > w) {
            return None;
        }
        let rows = match self.proposer.packs_verify_rows() {
            true => widths.iter().sum(),
            false => widths.len() * widths.iter().copied().max().unwrap_or(1),
        };
        Some((rows, started))
    }

    /// A step's time from the start of its drafting to the end of the proposer's intake of
    /// its verified rows is a sample of T_v at its rows.
    fn record_step_timing(&self, step: Option<(usize, Instant)>) {
        if let (Some(learned), Some((rows, started))) = (&self.learned_latency, step) {
            let mut learned = lock(learned);
            learned.record(rows, started.elapsed().as_secs_f64() * 1e3);
            if learned.samples() % SAVE_EVERY_SAMPLES == 0 {
                self.save_learned_latency(&learned);
            }
        }
    }

    /// Learn what became of each sequence's last verified drafts, now that `features` say
    /// what the target committed, and note where its next drafts will sit.
    fn settle(&self, features: &[TargetFeatures<'_>]) {
        let mut sequences = lock(&self.sequences);
        let mut log = lock(&self.outcomes);
        for f in features {
            let state = sequences.entry(f.seq_id).or_default();
            let fates = draft_fates(state, f.tokens);
            if let Some(rates) = &self.keep_rates {
                let mut rates = lock(rates);
                fates.iter().for_each(|o| rates.record(o.confidence, o.kept));
            }
            if let Some(log) = log.as_mut() {
                log.extend(fates);
            }
            *state = SequenceState { from: f.tokens.len(), ..SequenceState::default() };
        }
    }
}

/// The fates of a sequence's last verified drafts, read from its tokens now: the kept ones,
/// then the first refused (if the verify reached one).
fn draft_fates(state: &SequenceState, tokens: &[u32]) -> Vec<DraftOutcome> {
    let verified = state.verified.min(state.drafts.len()).min(state.scores.len());
    let kept = kept_drafts(&state.drafts[..verified], state.from, tokens);
    (0..verified.min(kept + 1))
        .map(|i| DraftOutcome { confidence: state.scores[i], position: i, kept: i < kept })
        .collect()
}

/// The policy's pricing during one draft call.
struct StepPricing<'a, P: ScoredProposer> {
    policy: &'a VerifyPolicy<P>,
    budget: Option<Cow<'a, VerifyBudget>>,
    /// The call drafts for one sequence: its verify holds its rows alone.
    alone: bool,
}

impl<P: ScoredProposer> DraftPricing for StepPricing<'_, P> {
    fn keep_chances(&self, scores: &[f32]) -> Vec<f32> {
        self.policy.priced(scores)
    }
    fn latency(&self) -> VerifyLatency {
        self.policy.verify_latency()
    }
    fn worth_drafting(&self, _request: usize, scores: &[f32]) -> bool {
        match (&self.budget, self.alone) {
            (Some(budget), true) => {
                budget.one_more_pays_alone_at(&self.policy.priced(scores), self.policy.proposer.draft_ms().unwrap_or(0.0))
            }
            _ => true,
        }
    }
}

impl<P: ScoredProposer> Proposer for VerifyPolicy<P> {
    fn target_layers(&self) -> Vec<usize> {
        self.proposer.target_layers()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> Result<()> {
        self.observe_batch(std::slice::from_ref(features))
    }

    /// The proposer takes the committed rows (and, when learning T_v, the step that
    /// verified them is timed, this intake included).
    fn observe_batch(&self, features: &[TargetFeatures<'_>]) -> Result<()> {
        let step = self.step_in_flight_rows(features);
        self.settle(features);
        self.proposer.observe_batch(features)?;
        self.record_step_timing(step);
        Ok(())
    }

    fn propose(&self, seq_id: usize, gamma: usize, sample: &mut dyn FnMut(&Tensor) -> Result<u32>) -> Result<(Vec<u32>, Tensor)> {
        propose_alone(self, seq_id, gamma, sample)
    }

    /// With a budget, sequences drafting for one batched verify each draft at most one more
    /// than the last batched verify took (so the width grows back when drafts get
    /// likelier); a sequence drafting for a verify of its own, while one more draft pays
    /// for its row (the pipeline steps a batch one sequence at a time where it cannot
    /// verify them together, as with a draft model under SV).
    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> Result<Vec<(Vec<u32>, Tensor)>> {
        let drafting_began = Instant::now();
        let alone = requests.len() == 1;
        if let (Some(_), false, Some(last)) = (&self.budget, alone, *lock(&self.last_verified)) {
            requests.iter_mut().for_each(|r| r.gamma = r.gamma.min(last + 1));
        }
        let pricing = StepPricing { policy: self, budget: self.budget(), alone };
        let drafted = self.proposer.propose_scored(requests, &pricing)?;
        if self.learned_latency.is_some() {
            // A proposer that prices its drafts itself has T_v time the verify alone.
            let started = if self.proposer.draft_ms().is_some() { Instant::now() } else { drafting_began };
            *lock(&self.step_in_flight) = Some((requests.iter().map(|r| r.seq_id).collect(), started));
        }
        if drafted.len() != requests.len() {
            candle_core::bail!("the proposer answered {} of {} draft requests", drafted.len(), requests.len());
        }
        let mut sequences = lock(&self.sequences);
        Ok(requests
            .iter()
            .zip(drafted)
            .map(|(r, d)| {
                let state = sequences.entry(r.seq_id).or_default();
                state.verified = d.tokens.len();
                state.drafts.clone_from(&d.tokens);
                state.scores = d.scores;
                (d.tokens, d.logits)
            })
            .collect())
    }

    fn verify_lengths(&self, seq_ids: &[usize], drafted: &[usize]) -> Vec<usize> {
        let Some(budget) = self.budget() else {
            return drafted.to_vec();
        };
        let mut sequences = lock(&self.sequences);
        let chances: Vec<Vec<f32>> = seq_ids
            .iter()
            .zip(drafted)
            .map(|(id, &n)| {
                let known = sequences.get(id).map_or(&[][..], |s| &s.scores[..]);
                // A draft the proposer gave no score is not worth a row.
                let scores: Vec<f32> = (0..n).map(|i| known.get(i).copied().unwrap_or(0.0)).collect();
                self.priced(&scores)
            })
            .collect();
        let lengths = budget.lengths(&chances);
        for (id, &n) in seq_ids.iter().zip(&lengths) {
            if let Some(state) = sequences.get_mut(id) {
                state.verified = n.min(state.drafts.len());
            }
            self.proposer.verifies(*id, n);
        }
        *lock(&self.last_verified) = Some(lengths.iter().copied().max().unwrap_or(0));
        lengths
    }

    fn packs_verify_rows(&self) -> bool {
        self.proposer.packs_verify_rows()
    }

    fn release(&self, seq_id: usize) {
        lock(&self.sequences).remove(&seq_id);
        self.proposer.release(seq_id);
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.proposer.cache_len(seq_id)
    }
}

/// The steps timed since the last save are saved when the engine lets go of the policy.
impl<P: ScoredProposer> Drop for VerifyPolicy<P> {
    fn drop(&mut self) {
        self.keep_learned_latency();
    }
}

/// What a server keeps of a policy when it stops, whatever proposer the policy wraps.
pub trait KeepsLearning: Send + Sync {
    /// Save what was learned that outlives the process (the learned T_v).
    fn keep_learned(&self);
}

impl<P: ScoredProposer> KeepsLearning for VerifyPolicy<P> {
    fn keep_learned(&self) {
        self.keep_learned_latency();
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::{
        proposers::eagle_proposer::EagleProposer,
        sv::schedule::GoodputOptions,
        verify_latency::VerifyLatency,
    };

    const HIDDEN: usize = 16;
    const VOCAB: usize = 30;

    /// An EAGLE proposer over a random head (each call draws another), under `settings`.
    fn policy(settings: PolicySettings) -> VerifyPolicy<EagleProposer> {
        let (head, embeddings) = crate::tiny_model::random_eagle3_head(HIDDEN, VOCAB, (0..VOCAB as u32).collect()).unwrap();
        let head = EagleProposer::new(Arc::new(head), Arc::new(embeddings), vec![0, 1, 2], VOCAB).unwrap();
        VerifyPolicy::new(Arc::new(head), settings)
    }

    fn budget(base: f64, per_row: f64) -> VerifyBudget {
        VerifyBudget { latency: VerifyLatency::linear(base, per_row), options: GoodputOptions::default(), padded: true, table: None }
    }

    /// What a sequence of `tokens` gives the proposer for positions `start..tokens.len() - 1`:
    /// rows of `features` (one per position, the same whatever the sequence) and the tokens.
    fn observe(p: &dyn Proposer, seq_id: usize, tokens: &[u32], start: usize, features: &Tensor) {
        let rows = tokens.len() - 1 - start;
        let layers: Vec<(usize, Tensor)> = (0..3)
            .map(|l| (l, features.narrow(0, start, rows).unwrap().narrow(1, l * HIDDEN, HIDDEN).unwrap()))
            .collect();
        p.observe_target(&TargetFeatures { seq_id, start, layers: &layers, next_tokens: &tokens[start + 1..], tokens }).unwrap();
    }

    fn greedy_drafts(p: &dyn Proposer, seq_id: usize) -> Vec<u32> {
        p.propose(seq_id, 3, &mut |row| row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()).unwrap().0
    }

    /// How many drafts each of `seq_ids` drafts when they draft in one call, for one verify.
    fn greedy_drafts_together(p: &dyn Proposer, seq_ids: &[usize]) -> Vec<usize> {
        let mut samplers: Vec<_> = seq_ids.iter().map(|_| |row: &Tensor| row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>()).collect();
        let mut requests: Vec<DraftRequest<'_>> = seq_ids
            .iter()
            .zip(samplers.iter_mut())
            .map(|(&seq_id, sample)| DraftRequest { seq_id, gamma: 3, sample, rows: None, greedy: true })
            .collect();
        p.propose_batch(&mut requests).unwrap().iter().map(|(tokens, _)| tokens.len()).collect()
    }

    fn features(rows: usize) -> Tensor {
        Tensor::randn(0f32, 1.0, (rows, 3 * HIDDEN), &Device::Cpu).unwrap()
    }

    #[test]
    fn with_a_budget_sequences_drafting_together_draft_one_more_than_was_verified_and_alone_what_pays() {
        // A verify row as dear as a forward: no draft of a batch pays for its row.
        let p = policy(PolicySettings { budget: Some(budget(10.0, 10.0)), ..Default::default() });
        let features = features(6);
        observe(&p, 1, &[1, 2, 3, 4, 5], 0, &features);
        // Alone, a sequence drafts while a draft pays for its row: a random head's never does
        // at 10 ms a row; with rows free, it drafts γ.
        assert_eq!(greedy_drafts(&p, 1).len(), 0);
        let q = policy(PolicySettings { budget: Some(budget(10.0, 0.0)), ..Default::default() });
        observe(&q, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert_eq!(greedy_drafts(&q, 1).len(), 3);
        observe(&p, 2, &[1, 2, 3, 4, 6], 0, &features);
        assert_eq!(greedy_drafts_together(&p, &[1, 2]), vec![3, 3], "no batched verify has happened yet");
        assert_eq!(p.verify_lengths(&[1, 2], &[3, 3]), vec![0, 0]);
        // Together, after a verify that took none: one draft each, to see whether it pays.
        assert_eq!(greedy_drafts_together(&p, &[1, 2]), vec![1, 1]);
        // A sequence drafting for a verify of its own, while others live, drafts what pays.
        assert_eq!(greedy_drafts(&p, 1).len(), 0);
        // Without a budget every draft is verified and γ drafted.
        let plain = policy(PolicySettings::default());
        observe(&plain, 1, &[1, 2, 3, 4, 5], 0, &features);
        observe(&plain, 2, &[1, 2, 3, 4, 6], 0, &features);
        assert_eq!(plain.verify_lengths(&[1, 2], &[3, 2]), vec![3, 2]);
        assert_eq!(greedy_drafts(&plain, 1).len(), 3);
        // A released sequence leaves no state behind, here or in the proposer.
        plain.release(1);
        plain.release(2);
        assert_eq!((plain.live_sequences(), plain.proposer().live_sequences()), (0, 0));
    }

    #[test]
    fn a_learned_t_v_prices_rows_and_each_verified_step_is_a_sample_at_its_rows() {
        let features = features(12);
        // Learned from this machine: every row beyond the first costs as much as a forward,
        // so no draft of a random head pays for its row, whatever the configured T_v says.
        let mut dear_rows = LearnedLatency::new(VerifyLatency::linear(10.0, 0.0), 1.0, 1.0).unwrap();
        for _ in 0..50 {
            (1..=4).for_each(|rows| dear_rows.record(rows, 10.0 * rows as f64));
        }
        let p = policy(PolicySettings { budget: Some(budget(10.0, 0.0)), learned_latency: Some(dear_rows), ..Default::default() });
        observe(&p, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert_eq!(greedy_drafts(&p, 1).len(), 0, "priced by the learned T_v, not the configured one");
        // Learning from scratch on the free-rows prior: a prompt gives no sample, a verified
        // step one at its rows (the last committed token and each draft).
        let q = policy(PolicySettings {
            budget: Some(budget(10.0, 0.0)),
            learned_latency: Some(LearnedLatency::new(VerifyLatency::linear(10.0, 0.0), 1.0, 1.0).unwrap()),
            ..Default::default()
        });
        observe(&q, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert!(q.learned_latency().unwrap().row_counts_seen().is_empty(), "a prompt is no verify");
        let drafts = greedy_drafts(&q, 1);
        assert_eq!(drafts.len(), 3);
        // The target kept the first draft and corrected the second.
        let mut tokens = vec![1, 2, 3, 4, 5, drafts[0], 9];
        observe(&q, 1, &tokens, 4, &features);
        assert_eq!(q.learned_latency().unwrap().row_counts_seen(), vec![4]);
        // A step drafted for one sequence and observed for another gives no sample.
        greedy_drafts(&q, 1);
        observe(&q, 2, &[3, 3, 3], 0, &features);
        tokens.push(5);
        observe(&q, 1, &tokens, 6, &features);
        assert_eq!(q.learned_latency().unwrap().row_counts_seen(), vec![4]);
        // Nor does a forward that fed more rows than the verify's (a draft model's prompt step).
        let samples = q.learned_latency().unwrap().samples();
        greedy_drafts(&q, 1);
        tokens.push(6);
        observe(&q, 1, &tokens, 0, &features);
        assert_eq!(q.learned_latency().unwrap().samples(), samples);
        // Kept across runs: saved when the policy goes, with the earlier runs' samples.
        let dir = tempfile::tempdir().unwrap();
        let store = LatencyStore::on_machine(dir.path().join("tv.json"), crate::sv::latency_store::tests::target(HIDDEN), "m".into());
        let learned = q.learned_latency().unwrap();
        let kept = policy(PolicySettings { learned_latency: Some(learned.clone()), latency_store: Some((store.clone(), 7)), ..Default::default() });
        drop(kept);
        let (kept_latency, kept_samples) = store.load().unwrap().unwrap();
        assert!(crate::sv::latency_store::tests::same_latency(&kept_latency, learned.current()));
        assert_eq!(kept_samples, 7 + learned.samples());
    }

    #[test]
    fn the_outcome_log_records_each_verified_draft_up_to_the_first_refusal() {
        let p = policy(PolicySettings::default());
        p.record_outcomes();
        let features = features(16);
        let mut tokens = vec![1, 2, 3, 4, 5];
        observe(&p, 1, &tokens, 0, &features);
        assert!(p.take_outcomes().is_empty(), "a prompt forward verifies no draft");
        let fates = |log: Vec<DraftOutcome>| log.iter().map(|o| (o.position, o.kept)).collect::<Vec<_>>();

        // The first draft kept, the second refused (the target wrote another token there).
        let drafts = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.extend([drafts[0], (drafts[1] + 1) % VOCAB as u32]);
        observe(&p, 1, &tokens, start, &features);
        let log = p.take_outcomes();
        assert!(log.iter().all(|o| o.confidence > 0.0 && o.confidence <= 1.0), "{log:?}");
        assert_eq!(fates(log), vec![(0, true), (1, false)]);

        // Every draft kept, then a bonus token.
        let drafts = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.extend(drafts.iter().copied().chain([7]));
        observe(&p, 1, &tokens, start, &features);
        assert_eq!(fates(p.take_outcomes()), vec![(0, true), (1, true), (2, true)]);

        // The first refused: nothing after it is recorded.
        let drafts = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.push((drafts[0] + 1) % VOCAB as u32);
        observe(&p, 1, &tokens, start, &features);
        assert_eq!(fates(p.take_outcomes()), vec![(0, false)]);
        assert!(p.take_outcomes().is_empty());

        // Only the drafts the verify took are judged: three drafted, one verified and kept,
        // and the target's own token after it happens to equal the second draft.
        let drafts = greedy_drafts(&p, 1);
        assert_eq!(drafts.len(), 3);
        lock(&p.sequences).get_mut(&1).unwrap().verified = 1;
        let start = tokens.len() - 1;
        tokens.extend([drafts[0], drafts[1]]);
        observe(&p, 1, &tokens, start, &features);
        assert_eq!(fates(p.take_outcomes()), vec![(0, true)]);
    }

    #[test]
    fn learned_keep_rates_follow_the_verified_drafts_fates() {
        let p = policy(PolicySettings { keep_rates: Some(KeepRates::new(20, 1.0).unwrap()), ..Default::default() });
        let features = features(16);
        let mut tokens = vec![1, 2, 3, 4, 5];
        observe(&p, 1, &tokens, 0, &features);
        assert_eq!(p.keep_rates().unwrap().recorded(), 0, "a prompt forward verifies no draft");

        // Every draft kept: each one's bin now says more than its score.
        let drafts = greedy_drafts(&p, 1);
        let scores = lock(&p.sequences)[&1].scores.clone();
        let start = tokens.len() - 1;
        tokens.extend(drafts.iter().copied().chain([7]));
        observe(&p, 1, &tokens, start, &features);
        let rates = p.keep_rates().unwrap();
        assert_eq!(rates.recorded(), 3);
        for &c in &scores {
            assert!(rates.keep_rate(c) > c, "a kept draft of score {c} is priced {}", rates.keep_rate(c));
        }
        assert_eq!(p.priced(&scores), rates.keep_rates(&scores), "SV reads the learned rates");
        assert!(p.take_outcomes().is_empty(), "learning does not fill the outcome log");

        // The first refused: one more draft reached, none kept.
        let drafts = greedy_drafts(&p, 1);
        let first = lock(&p.sequences)[&1].scores[0];
        let start = tokens.len() - 1;
        tokens.push((drafts[0] + 1) % VOCAB as u32);
        observe(&p, 1, &tokens, start, &features);
        let after = p.keep_rates().unwrap();
        assert_eq!(after.recorded(), 4);
        assert!(after.keep_rate(first) < rates.keep_rate(first));
    }
}
