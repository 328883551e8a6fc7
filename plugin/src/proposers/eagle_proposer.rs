//! The EAGLE-3 head as the pipeline's [`Proposer`]: one [`SequenceDrafter`] per sequence,
//! fed the target's captured layers after every target forward.

use std::{
    borrow::Cow,
    collections::HashMap,
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Instant,
};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use verdict_heads::{Eagle3Head, ModelFingerprint, WeightFormat};

pub use super::embeddings::target_embeddings;
use super::{
    eagle::{commit_together, draft_together, sure_enough, Commit, DraftSampler, SequenceDrafter, TokenEmbeddings},
    head_prefix_cache::HeadPrefixCache,
};
use crate::{
    models::ModelSource,
    sv::{
        keep_rates::KeepRates,
        latency_store::{LatencyStore, SAVE_EVERY_SAMPLES},
        latency::VerifyLatency,
        learned_latency::LearnedLatency,
        verify_budget::VerifyBudget,
    },
};

pub struct EagleProposer {
    head: Arc<Eagle3Head>,
    embeddings: Arc<dyn TokenEmbeddings>,
    /// Target decoder layers whose outputs the head fuses (low → high): the outputs of layers
    /// `l − 1` for the inputs of the head's layers `l`.
    layers: Vec<usize>,
    vocab_size: usize,
    /// Drafting stops before a draft the head gives less than this probability (0: never).
    min_confidence: f32,
    /// A step drafts nothing, decoding one token, when the head gives its first draft less
    /// than this probability (0: never).
    min_first_confidence: f32,
    sequences: Mutex<HashMap<usize, LiveSequence>>,
    /// Head caches of finished sequences, for later ones that share their prefix.
    prefix_cache: Mutex<HeadPrefixCache>,
    /// Head cache rows taken from `prefix_cache` so far.
    restored_rows: AtomicUsize,
    /// How many drafts of each sequence a batched verify takes (`[sv]`); `None`: all.
    verify_budget: Option<VerifyBudget>,
    /// The most drafts of one sequence the last batched verify took: with `[sv]`, sequences
    /// drafted together draft at most one more (drafts no verify takes cost ≈ 1 ms each).
    last_verified: AtomicUsize,
    /// Each verified draft's confidence and fate, while recording (`train-head sv-profile`).
    outcomes: Mutex<Option<Vec<DraftOutcome>>>,
    /// What the running stack keeps of each confidence, learned from every verified draft;
    /// with `verify_budget`, SV prices drafts by it (`sv.learn_keep_rates`).
    keep_rates: Option<Mutex<KeepRates>>,
    /// Sequences of a batched step draft, and take their committed rows, in one head
    /// forward per draft position (false: one sequence after another, as before batching).
    batched_drafting: bool,
    /// A batched verify feeds the target each sequence's own rows only.
    packed_verify_rows: bool,
    /// Calls that drafted for, or took the rows of, several sequences in one head forward
    /// per position.
    batched_calls: AtomicUsize,
    /// T_v learned from this machine's steps (`sv.learn_verify_ms`): SV prices rows by it
    /// instead of the budget's own.
    learned_latency: Option<Mutex<LearnedLatency>>,
    /// Where the learned T_v is kept across runs (`sv.learned_verify_ms_file`), and the
    /// samples of the runs before this one.
    latency_store: Option<(LatencyStore, u64)>,
    /// The sequences of the step being drafted and verified, and when its drafting began.
    step_in_flight: Mutex<Option<(Vec<usize>, Instant)>>,
}

/// What became of one verified draft: the head's confidence before drawing it, its place in
/// the step's chain, and whether the target kept it. Drafts after a step's first refusal
/// are not recorded: their fate says nothing about them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DraftOutcome {
    pub confidence: f32,
    /// 0 for a step's first draft.
    pub position: usize,
    pub kept: bool,
}

/// Bytes of finished sequences' head caches kept by default: a position costs the head
/// 2 KB with the Qwen2.5-1.5B target's shape, so ≈ 40 prompts of 800 tokens.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;

struct LiveSequence {
    drafter: SequenceDrafter,
    /// The sequence's tokens through the last committed position (the prefix cache's key).
    tokens: Vec<u32>,
    /// The head's confidence in each draft of the sequence's last proposal.
    confidences: Vec<f32>,
    /// The last proposal's drafts, and how many of them its verify took.
    drafts: Vec<u32>,
    verified: usize,
}

impl EagleProposer {
    /// `layers`: the target layers whose *outputs* to capture, one per third of the head's
    /// `fc` input.
    pub fn new(
        head: Arc<Eagle3Head>,
        embeddings: Arc<dyn TokenEmbeddings>,
        layers: Vec<usize>,
        vocab_size: usize,
    ) -> Result<Self> {
        ensure!(
            layers.len() == 3,
            "an EAGLE-3 head fuses 3 target layers, {} were given ({layers:?})",
            layers.len()
        );
        Ok(Self {
            head,
            embeddings,
            layers,
            vocab_size,
            min_confidence: 0.0,
            min_first_confidence: 0.0,
            sequences: Mutex::new(HashMap::new()),
            prefix_cache: Mutex::new(HeadPrefixCache::new(DEFAULT_PREFIX_CACHE_BYTES)),
            restored_rows: AtomicUsize::new(0),
            verify_budget: None,
            last_verified: AtomicUsize::new(usize::MAX),
            outcomes: Mutex::new(None),
            keep_rates: None,
            batched_drafting: true,
            packed_verify_rows: true,
            batched_calls: AtomicUsize::new(0),
            learned_latency: None,
            latency_store: None,
            step_in_flight: Mutex::new(None),
        })
    }

    /// From now on, record every verified draft's confidence and fate
    /// ([`Self::take_outcomes`]).
    pub fn record_outcomes(&self) {
        self.outcome_log().get_or_insert_with(Vec::new);
    }

    /// The draft outcomes recorded since the last call (none unless recording).
    pub fn take_outcomes(&self) -> Vec<DraftOutcome> {
        self.outcome_log().as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn outcome_log(&self) -> MutexGuard<'_, Option<Vec<DraftOutcome>>> {
        self.outcomes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Draft for a batched step's sequences in one head forward per draft position (the
    /// default), or one sequence after another (`false`, for comparing the two).
    pub fn with_batched_drafting(mut self, batched: bool) -> Self {
        self.batched_drafting = batched;
        self
    }

    /// Let a batched verify feed the target each sequence's own rows only (the default), or
    /// pad every sequence's rows to the widest (`false`, for comparing the two). A verify
    /// budget should price rows the same way ([`VerifyBudget::padded`]).
    pub fn with_packed_verify_rows(mut self, packed: bool) -> Self {
        self.packed_verify_rows = packed;
        self
    }

    /// Price drafts for SV by the keep rates learned from verified drafts, starting from
    /// `rates` (`None`: by the head's confidence, or `sv.table`).
    pub fn with_keep_rates(mut self, rates: Option<KeepRates>) -> Self {
        self.keep_rates = rates.map(Mutex::new);
        self
    }

    /// The learned keep rates, if learning (for logs and tests).
    pub fn keep_rates(&self) -> Option<KeepRates> {
        self.keep_rates.as_ref().map(|r| r.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// What SV reads as each draft's chance of being kept: the learned keep rate of its
    /// confidence, or the confidence itself.
    fn priced(&self, confidences: &[f32]) -> Vec<f32> {
        match &self.keep_rates {
            Some(rates) => rates.lock().unwrap_or_else(|e| e.into_inner()).keep_rates(confidences),
            None => confidences.to_vec(),
        }
    }

    /// Let a batched verify take only the drafts worth their rows under load (SV's schedule
    /// with the head's confidences as β); without it every draft is verified.
    pub fn with_verify_budget(mut self, budget: Option<VerifyBudget>) -> Self {
        self.verify_budget = budget;
        self
    }

    /// Price verify rows by T_v learned from the steps run, starting from `latency`
    /// (`None`: by the verify budget's own T_v).
    pub fn with_learned_latency(mut self, latency: Option<LearnedLatency>) -> Self {
        self.learned_latency = latency.map(Mutex::new);
        self
    }

    /// Keep the learned T_v in `store` (after `earlier_samples` from earlier runs): saved
    /// every [`SAVE_EVERY_SAMPLES`] steps timed and when the proposer is dropped.
    pub fn with_latency_store(mut self, store: Option<(LatencyStore, u64)>) -> Self {
        self.latency_store = store;
        self
    }

    /// T_v as SV prices rows now: learned on this machine, else the budget's, else a generic
    /// CPU shape (another proposer choosing between its drafts and the head's prices rows
    /// alike).
    pub fn verify_latency(&self) -> VerifyLatency {
        match (&self.learned_latency, &self.verify_budget) {
            (Some(learned), _) => learned.lock().unwrap_or_else(|e| e.into_inner()).current().clone(),
            (None, Some(budget)) => budget.latency.clone(),
            (None, None) => LearnedLatency::generic_prior(),
        }
    }

    /// What SV reads as the chance each draft of `seq_id`'s last proposal is kept.
    pub fn last_keep_chances(&self, seq_id: usize) -> Vec<f32> {
        let confidences = self.sequences().get(&seq_id).map(|live| live.confidences.clone()).unwrap_or_default();
        self.priced(&confidences)
    }

    /// `seq_id`'s last proposal was set aside for another proposer's `drafts` drafts: the
    /// head's drafts are never verified (their fate teaches nothing), and the step's verify
    /// has `drafts` rows besides the sequence's own (what a learned T_v samples).
    pub fn proposal_replaced(&self, seq_id: usize, drafts: usize) {
        if let Some(live) = self.sequences().get_mut(&seq_id) {
            live.drafts.clear();
            live.confidences.clear();
            live.verified = drafts;
        }
    }

    /// T_v as learned so far, if learning (for logs and tests).
    pub fn learned_latency(&self) -> Option<LearnedLatency> {
        self.learned_latency.as_ref().map(|l| l.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// The verify budget SV applies now: the configured one, its T_v replaced by the
    /// learned one when learning (copied only then).
    fn budget(&self) -> Option<Cow<'_, VerifyBudget>> {
        let budget = self.verify_budget.as_ref()?;
        Some(match &self.learned_latency {
            Some(learned) => Cow::Owned(VerifyBudget {
                latency: learned.lock().unwrap_or_else(|e| e.into_inner()).current().clone(),
                ..budget.clone()
            }),
            None => Cow::Borrowed(budget),
        })
    }

    /// With a learned T_v, the step whose drafting begins now is timed until the head has
    /// taken in its verified rows.
    fn start_step_timing(&self, requests: &[DraftRequest<'_>]) {
        if self.learned_latency.is_some() {
            let ids = requests.iter().map(|r| r.seq_id).collect();
            *self.step_in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some((ids, Instant::now()));
        }
    }

    /// The verify of the step in flight is about to be observed: the rows it verified and
    /// when its drafting began, which [`Self::record_step_timing`] turns into a sample of
    /// T_v once the head has taken those rows in. A prompt step, or one whose sequences
    /// changed (one finished), gives no sample.
    fn step_in_flight_rows(&self, sequences: &HashMap<usize, LiveSequence>, features: &[TargetFeatures<'_>]) -> Option<(usize, Instant)> {
        self.learned_latency.as_ref()?;
        let (ids, started) = self.step_in_flight.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        if ids.len() != features.len() || ids.iter().zip(features).any(|(id, f)| *id != f.seq_id) {
            return None;
        }
        let widths: Vec<usize> = ids.iter().map(|id| sequences.get(id).map(|live| live.verified + 1)).collect::<Option<_>>()?;
        let rows = match self.packed_verify_rows {
            true => widths.iter().sum(),
            false => widths.len() * widths.iter().copied().max().unwrap_or(1),
        };
        Some((rows, started))
    }

    /// A step's time from the start of its drafting to the end of the head's intake of its
    /// verified rows (the whole step the proposer prices) is a sample of T_v at its rows.
    fn record_step_timing(&self, step: Option<(usize, Instant)>) {
        if let (Some(learned), Some((rows, started))) = (&self.learned_latency, step) {
            let mut learned = learned.lock().unwrap_or_else(|e| e.into_inner());
            learned.record(rows, started.elapsed().as_secs_f64() * 1e3);
            if learned.samples() % SAVE_EVERY_SAMPLES == 0 {
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

    /// Save the learned T_v now if steps were timed since its last save (a server stopping
    /// on a signal, where no destructor runs).
    pub fn keep_learned_latency(&self) {
        if let Some(learned) = &self.learned_latency {
            let learned = learned.lock().unwrap_or_else(|e| e.into_inner());
            if learned.samples() % SAVE_EVERY_SAMPLES != 0 {
                self.save_learned_latency(&learned);
            }
        }
    }

    /// Keep at most `bytes` of finished sequences' head caches (0: keep none).
    pub fn with_prefix_cache_bytes(self, bytes: usize) -> Self {
        *self.prefix_cache() = HeadPrefixCache::new(bytes);
        self
    }

    /// Stop drafting before a draft whose best token the head gives less than `p` (the first
    /// draft is always made), so a step verifies fewer unlikely drafts.
    pub fn with_min_confidence(mut self, p: f32) -> Result<Self> {
        ensure!((0.0..1.0).contains(&p), "EAGLE min confidence {p} outside [0, 1)");
        self.min_confidence = p;
        Ok(self)
    }

    /// Draft nothing when the head gives its first draft less than `p`: the step then
    /// verifies one row, a plain decode, which here costs ≈ 30 % less than a verify of two.
    pub fn with_min_first_confidence(mut self, p: f32) -> Result<Self> {
        ensure!((0.0..1.0).contains(&p), "EAGLE min first-draft confidence {p} outside [0, 1)");
        self.min_first_confidence = p;
        Ok(self)
    }

    /// Load the head in `head_dir` for the loaded target: refused when it was made for
    /// another model; the target's own embeddings are shared with it.
    pub fn load(head_dir: &Path, weights: WeightFormat, target: &ModelSource, fingerprint: &ModelFingerprint) -> Result<Self> {
        let mut head = Eagle3Head::load(head_dir, &Device::Cpu)?;
        head.check_target(&head_dir.display().to_string(), fingerprint)?;
        head.quantize(weights)
            .with_context(|| format!("EAGLE-3 head {}: speculative.eagle_weights = \"{weights}\"", head_dir.display()))?;
        let layers = capture_layers(&head.config.aux_layers(fingerprint.num_layers), fingerprint.num_layers)
            .with_context(|| format!("EAGLE-3 head {}", head_dir.display()))?;
        let embeddings = target_embeddings(target)?;
        tracing::info!(
            "EAGLE-3 head {}: draft vocabulary {}, weights {weights}, fuses the outputs of target layers {layers:?}",
            head_dir.display(),
            head.config.draft_vocab()
        );
        Self::new(Arc::new(head), embeddings, layers, fingerprint.vocab_size)
    }

    fn sequences(&self) -> MutexGuard<'_, HashMap<usize, LiveSequence>> {
        self.sequences.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn prefix_cache(&self) -> MutexGuard<'_, HeadPrefixCache> {
        self.prefix_cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Head cache rows restored from finished sequences so far (prefix-cache hits).
    pub fn restored_rows(&self) -> usize {
        self.restored_rows.load(Ordering::Relaxed)
    }

    /// Bytes of finished sequences' head caches held.
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefix_cache().bytes()
    }

    /// A new sequence's drafter. When the target's first forward starts past a prefix it had
    /// cached, the head's rows for that prefix come from a finished sequence that shares it;
    /// failing that, the head drafts without them.
    fn start_sequence(&self, features: &TargetFeatures<'_>) -> Result<SequenceDrafter> {
        if features.start == 0 {
            return Ok(SequenceDrafter::default());
        }
        match self.prefix_cache().restore(features.tokens, features.start)? {
            Some(cache) => {
                self.restored_rows.fetch_add(features.start, Ordering::Relaxed);
                tracing::debug!("EAGLE head, sequence {}: {} prefix rows restored", features.seq_id, features.start);
                Ok(SequenceDrafter::resumed(cache))
            }
            None => {
                tracing::debug!(
                    "EAGLE head, sequence {}: no head cache for its {}-token cached prefix; drafting without it",
                    features.seq_id,
                    features.start
                );
                Ok(SequenceDrafter::default())
            }
        }
    }

    /// Draft or observe calls so far that served several sequences in one head forward per
    /// position (batched steps with `batched_drafting`).
    pub fn batched_calls(&self) -> usize {
        self.batched_calls.load(Ordering::Relaxed)
    }

    /// Sequences with drafting state (finished ones are released).
    pub fn live_sequences(&self) -> usize {
        self.sequences().len()
    }

    /// How many drafts a sequence may make this step: none when the head is unsure of the
    /// first (`min_first_confidence`); with `[sv]` among others, one more than the last
    /// batched verify took (so the width grows back when drafts get likelier); else γ.
    fn gamma_for(&self, live: &LiveSequence, gamma: usize, drafting_together: usize) -> Result<usize> {
        if self.min_first_confidence > 0.0 && live.drafter.first_draft_confidence()? < self.min_first_confidence {
            return Ok(0);
        }
        Ok(match (&self.verify_budget, drafting_together) {
            (Some(_), 2..) => gamma.min(self.last_verified.load(Ordering::Relaxed).saturating_add(1)),
            _ => gamma,
        })
    }

    /// Before a sequence takes a verify's features: start its state if it is new, and learn
    /// (keep rates, outcome log) what became of the drafts that verify judged.
    fn settle_last_drafts(&self, sequences: &mut HashMap<usize, LiveSequence>, features: &TargetFeatures<'_>) -> Result<()> {
        let live = match sequences.entry(features.seq_id) {
            std::collections::hash_map::Entry::Occupied(live) => live.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(LiveSequence {
                drafter: self.start_sequence(features)?,
                tokens: Vec::new(),
                confidences: Vec::new(),
                drafts: Vec::new(),
                verified: 0,
            }),
        };
        let mut log = self.outcome_log();
        if log.is_some() || self.keep_rates.is_some() {
            let fates = draft_fates(live, features);
            if let Some(rates) = &self.keep_rates {
                let mut rates = rates.lock().unwrap_or_else(|e| e.into_inner());
                fates.iter().for_each(|f| rates.record(f.confidence, f.kept));
            }
            if let Some(log) = log.as_mut() {
                log.extend(fates);
            }
        }
        live.drafts.clear();
        Ok(())
    }

    /// Every sequence's committed rows go through the head in one forward.
    fn commit_rows(&self, features: &[TargetFeatures<'_>]) -> candle_core::Result<()> {
        if features.len() > 1 {
            self.batched_calls.fetch_add(1, Ordering::Relaxed);
        }
        let aux = features
            .iter()
            .map(|f| Tensor::cat(&f.layers.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>(), 1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut sequences = self.sequences();
        for f in features {
            self.settle_last_drafts(&mut sequences, f).map_err(to_candle)?;
        }
        let ids: Vec<usize> = features.iter().map(|f| f.seq_id).collect();
        let mut lives = each_live(&mut sequences, &ids).map_err(to_candle)?;
        let mut commits: Vec<Commit<'_>> = lives
            .iter_mut()
            .zip(features)
            .zip(&aux)
            .map(|((live, f), aux)| Commit {
                drafter: &mut live.drafter,
                start: f.start,
                aux,
                next_tokens: f.next_tokens,
            })
            .collect();
        commit_together(&self.head, &*self.embeddings, &mut commits)
            .with_context(|| format!("EAGLE head, sequences {ids:?}"))
            .map_err(to_candle)?;
        drop(commits);
        for (live, f) in lives.iter_mut().zip(features) {
            live.tokens.clear();
            live.tokens.extend_from_slice(f.tokens);
        }
        Ok(())
    }

    /// Every sequence drafts in one head forward per draft position.
    fn draft(&self, requests: &mut [DraftRequest<'_>]) -> candle_core::Result<Vec<(Vec<u32>, Tensor)>> {
        if requests.len() > 1 {
            self.batched_calls.fetch_add(1, Ordering::Relaxed);
        }
        let mut sequences = self.sequences();
        let drafting_together = sequences.len();
        let ids: Vec<usize> = requests.iter().map(|r| r.seq_id).collect();
        let mut lives = each_live(&mut sequences, &ids).map_err(to_candle)?;
        let mut gammas = Vec::with_capacity(requests.len());
        for (live, request) in lives.iter().zip(requests.iter()) {
            gammas.push(self.gamma_for(live, request.gamma, drafting_together).map_err(to_candle)?);
        }
        // A sequence verified alone drafts while one more draft pays for its row (SV's
        // goodput); the confidence cut applies from the second draft on.
        let alone = drafting_together == 1;
        let budget = self.budget();
        let keep = |confidences: &[f32]| {
            sure_enough(confidences, self.min_confidence)
                && (!alone || budget.as_ref().is_none_or(|b| b.one_more_pays_alone(&self.priced(confidences))))
        };
        let mut samplers: Vec<Box<DraftSampler<'_>>> = requests
            .iter_mut()
            .map(|r| Box::new(move |row: &Tensor| Ok((r.sample)(row)?)) as Box<DraftSampler<'_>>)
            .collect();
        let mut samples: Vec<&mut DraftSampler<'_>> = samplers.iter_mut().map(|s| &mut **s as _).collect();
        let mut drafters: Vec<&mut SequenceDrafter> = lives.iter_mut().map(|l| &mut l.drafter).collect();
        let drafts = draft_together(
            &self.head,
            &*self.embeddings,
            &mut drafters,
            &gammas,
            &keep,
            self.vocab_size,
            &mut samples,
        )
        .with_context(|| format!("EAGLE head, sequences {ids:?}"))
        .map_err(to_candle)?;
        drop(drafters);
        Ok(lives
            .into_iter()
            .zip(drafts)
            .map(|(live, drafts)| {
                live.confidences = drafts.confidences;
                live.verified = drafts.tokens.len();
                live.drafts.clone_from(&drafts.tokens);
                (drafts.tokens, drafts.logits)
            })
            .collect())
    }
}

/// The steps timed since the last save are saved when the engine lets go of its proposer
/// (a bench mode done, a program's engine dropped).
impl Drop for EagleProposer {
    fn drop(&mut self) {
        self.keep_learned_latency();
    }
}

/// The live state of each of `ids`, in that order (each id once).
fn each_live<'a>(sequences: &'a mut HashMap<usize, LiveSequence>, ids: &[usize]) -> Result<Vec<&'a mut LiveSequence>> {
    let mut by_id: HashMap<usize, &'a mut LiveSequence> = sequences.iter_mut().map(|(id, live)| (*id, live)).collect();
    ids.iter()
        .map(|id| {
            by_id
                .remove(id)
                .with_context(|| format!("EAGLE head: sequence {id} has no target features yet, or was asked for twice"))
        })
        .collect()
}

/// The target layers to capture for fused layer *inputs* `aux` (EAGLE-3's convention): the
/// input of layer `l` is the output of layer `l − 1` (`l = L` names the last layer's output).
pub fn capture_layers(aux: &[usize], num_layers: usize) -> Result<Vec<usize>> {
    aux.iter()
        .map(|&l| match l {
            0 => bail!("fusing the input of layer 0 (the embeddings) is not supported"),
            l if l > num_layers => bail!("layer input {l} does not exist in a target of {num_layers} layers"),
            l => Ok(l - 1),
        })
        .collect()
}

/// The fates of a sequence's last verified drafts, read from the positions the verify
/// committed. The head's last committed row read the newest token and predicted the first
/// draft, so draft i sat at `committed_len + 1 + i`. It was kept when a committed position
/// holds it there: the verify committed positions `start..committed_end` and handed over
/// the token after each, the last of them the target's own correction or bonus.
fn draft_fates(live: &LiveSequence, features: &TargetFeatures<'_>) -> Vec<DraftOutcome> {
    let first_draft = live.drafter.committed_len() + 1;
    let committed_end = features.start + features.next_tokens.len();
    let mut fates = Vec::new();
    for (i, (&draft, &confidence)) in live.drafts.iter().zip(&live.confidences).take(live.verified).enumerate() {
        let position = first_draft + i;
        // next_tokens[j] is the token at position start + j + 1.
        let Some(j) = position.checked_sub(features.start + 1) else {
            break;
        };
        let kept = position < committed_end && features.next_tokens.get(j) == Some(&draft);
        fates.push(DraftOutcome { confidence, position: i, kept });
        if !kept {
            break;
        }
    }
    fates
}

fn to_candle(e: anyhow::Error) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

impl Proposer for EagleProposer {
    fn target_layers(&self) -> Vec<usize> {
        self.layers.clone()
    }

    fn observe_target(&self, features: &TargetFeatures<'_>) -> candle_core::Result<()> {
        self.observe_batch(std::slice::from_ref(features))
    }

    /// Every sequence's committed rows go through the head in one forward (and, when
    /// learning T_v, the step that verified them is timed, this intake included).
    fn observe_batch(&self, features: &[TargetFeatures<'_>]) -> candle_core::Result<()> {
        let step = self.step_in_flight_rows(&self.sequences(), features);
        if !self.batched_drafting && features.len() > 1 {
            features.iter().try_for_each(|f| self.commit_rows(std::slice::from_ref(f)))?;
        } else {
            self.commit_rows(features)?;
        }
        self.record_step_timing(step);
        Ok(())
    }

    fn propose(
        &self,
        seq_id: usize,
        gamma: usize,
        sample: &mut dyn FnMut(&Tensor) -> candle_core::Result<u32>,
    ) -> candle_core::Result<(Vec<u32>, Tensor)> {
        let mut drafted = self.propose_batch(&mut [DraftRequest { seq_id, gamma, sample }])?;
        Ok(drafted.pop().expect("one request, one answer"))
    }

    /// Every sequence drafts in one head forward per draft position (timed from here when
    /// learning T_v).
    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> candle_core::Result<Vec<(Vec<u32>, Tensor)>> {
        self.start_step_timing(requests);
        if !self.batched_drafting && requests.len() > 1 {
            return requests.iter_mut().map(|r| self.draft(std::slice::from_mut(r)).map(|mut d| d.remove(0))).collect();
        }
        self.draft(requests)
    }

    fn verify_lengths(&self, seq_ids: &[usize], drafted: &[usize]) -> Vec<usize> {
        let Some(budget) = self.budget() else {
            return drafted.to_vec();
        };
        let sequences = self.sequences();
        let confidences: Vec<Vec<f32>> = seq_ids
            .iter()
            .zip(drafted)
            .map(|(id, &n)| {
                let known = sequences.get(id).map_or(&[][..], |live| &live.confidences[..]);
                // A draft the head gave no confidence for is not worth a row.
                let confidences: Vec<f32> = (0..n).map(|i| known.get(i).copied().unwrap_or(0.0)).collect();
                self.priced(&confidences)
            })
            .collect();
        let lengths = budget.lengths(&confidences);
        drop(sequences);
        let mut sequences = self.sequences();
        for (id, &n) in seq_ids.iter().zip(&lengths) {
            if let Some(live) = sequences.get_mut(id) {
                live.verified = n.min(live.drafts.len());
            }
        }
        self.last_verified.store(lengths.iter().copied().max().unwrap_or(0), Ordering::Relaxed);
        lengths
    }

    fn packs_verify_rows(&self) -> bool {
        self.packed_verify_rows
    }

    fn release(&self, seq_id: usize) {
        let Some(live) = self.sequences().remove(&seq_id) else {
            return;
        };
        if let Some(cache) = live.drafter.cache_from_start() {
            if let Err(e) = self.prefix_cache().insert(&live.tokens, cache) {
                tracing::warn!("EAGLE head, sequence {seq_id}: head cache not kept for later prefixes: {e:#}");
            }
        }
    }

    fn cache_len(&self, seq_id: usize) -> usize {
        self.sequences().get(&seq_id).map_or(0, |live| live.drafter.committed_len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_layer_inputs_are_the_previous_layers_outputs() {
        // Qwen2.5-1.5B: inputs of 2, 14, 25 are outputs of 1, 13, 24 (SGLang's ids).
        assert_eq!(capture_layers(&[2, 14, 25], 28).unwrap(), vec![1, 13, 24]);
        assert_eq!(capture_layers(&[1, 2, 2], 2).unwrap(), vec![0, 1, 1]);
        let err = format!("{:#}", capture_layers(&[0, 1, 2], 28).unwrap_err());
        assert!(err.contains("layer 0"), "{err}");
        let err = format!("{:#}", capture_layers(&[2, 14, 29], 28).unwrap_err());
        assert!(err.contains("29") && err.contains("28 layers"), "{err}");
    }

    const HIDDEN: usize = 16;
    const VOCAB: usize = 30;

    /// Proposers over one random head (each call of `random_eagle3_head` draws another).
    fn proposers(n: usize) -> Vec<EagleProposer> {
        let (head, embeddings) =
            crate::tiny_model::random_eagle3_head(HIDDEN, VOCAB, (0..VOCAB as u32).collect()).unwrap();
        let (head, embeddings): (Arc<Eagle3Head>, Arc<dyn TokenEmbeddings>) = (Arc::new(head), Arc::new(embeddings));
        (0..n)
            .map(|_| EagleProposer::new(head.clone(), embeddings.clone(), vec![0, 1, 2], VOCAB).unwrap())
            .collect()
    }

    /// What a sequence of `tokens` gives the proposer for positions `start..tokens.len() - 1`:
    /// rows of `features` (one per position, the same whatever the sequence) and the tokens.
    fn observe(p: &EagleProposer, seq_id: usize, tokens: &[u32], start: usize, features: &Tensor) {
        let rows = tokens.len() - 1 - start;
        let layers: Vec<(usize, Tensor)> = (0..3)
            .map(|l| (l, features.narrow(0, start, rows).unwrap().narrow(1, l * HIDDEN, HIDDEN).unwrap()))
            .collect();
        p.observe_target(&TargetFeatures {
            seq_id,
            start,
            layers: &layers,
            next_tokens: &tokens[start + 1..],
            tokens,
        })
        .unwrap();
    }

    fn greedy_drafts(p: &EagleProposer, seq_id: usize) -> (Vec<u32>, Vec<f32>) {
        let (tokens, logits) = p
            .propose(seq_id, 3, &mut |row| row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>())
            .unwrap();
        (tokens, logits.flatten_all().unwrap().to_vec1().unwrap())
    }

    /// The three captured layers of `features` rows `start..start + rows` (one row per
    /// position, the same whatever the sequence).
    fn layers_of(features: &Tensor, start: usize, rows: usize) -> Vec<(usize, Tensor)> {
        (0..3)
            .map(|l| (l, features.narrow(0, start, rows).unwrap().narrow(1, l * HIDDEN, HIDDEN).unwrap()))
            .collect()
    }

    #[test]
    fn sequences_drafting_in_one_forward_draft_as_each_alone() {
        let [together, serial] = <[EagleProposer; 2]>::try_from(proposers(2)).ok().unwrap();
        let serial = serial.with_batched_drafting(false);
        let features = Tensor::randn(0f32, 1.0, (24, 3 * HIDDEN), &Device::Cpu).unwrap();
        let sequences: [Vec<u32>; 3] = [vec![1, 2, 3, 4, 5], vec![7, 8, 9, 10, 11, 12, 13, 14], vec![3, 1, 4]];
        let greedy = |row: &Tensor| row.argmax(candle_core::D::Minus1)?.to_scalar::<u32>();
        // Two rounds: the prompts, then each sequence commits a few more positions (as after
        // a verify: sequences 1 and 2 keep their first draft, sequence 3 none).
        let mut tokens: Vec<Vec<u32>> = sequences.to_vec();
        let mut starts = [0, 0, 0];
        for round in 0..2 {
            let layers: Vec<Vec<(usize, Tensor)>> = (0..3)
                .map(|i| layers_of(&features, starts[i], tokens[i].len() - 1 - starts[i]))
                .collect();
            let batch: Vec<TargetFeatures<'_>> = (0..3)
                .map(|i| TargetFeatures {
                    seq_id: i + 1,
                    start: starts[i],
                    layers: &layers[i],
                    next_tokens: &tokens[i][starts[i] + 1..],
                    tokens: &tokens[i],
                })
                .collect();
            together.observe_batch(&batch).unwrap();
            serial.observe_batch(&batch).unwrap();
            for (i, t) in tokens.iter().enumerate() {
                assert_eq!(together.cache_len(i + 1), t.len() - 1, "round {round}, sequence {}", i + 1);
                assert_eq!(serial.cache_len(i + 1), t.len() - 1);
            }
            // Up to 1, 3 and 4 drafts: chains that end after different head forwards.
            let drafted: Vec<Vec<(Vec<u32>, Tensor)>> = [&together, &serial]
                .iter()
                .map(|p| {
                    let mut samplers = [greedy, greedy, greedy];
                    let mut requests: Vec<DraftRequest<'_>> = samplers
                        .iter_mut()
                        .zip([1, 3, 4])
                        .enumerate()
                        .map(|(i, (sample, gamma))| DraftRequest { seq_id: i + 1, gamma, sample })
                        .collect();
                    p.propose_batch(&mut requests).unwrap()
                })
                .collect();
            for (i, ((a, la), (b, lb))) in drafted[0].iter().zip(&drafted[1]).enumerate() {
                assert_eq!(a, b, "round {round}, sequence {}", i + 1);
                assert_eq!(a.len(), [1, 3, 4][i]);
                let worst = (la - lb).unwrap().abs().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    .into_iter()
                    .filter(|d| d.is_finite())
                    .fold(0f32, f32::max);
                assert!(worst < 1e-4, "round {round}, sequence {}: logits differ by {worst}", i + 1);
            }
            // Drafting leaves every head cache at its committed length.
            for (i, t) in tokens.iter().enumerate() {
                assert_eq!(together.cache_len(i + 1), t.len() - 1);
            }
            // The target keeps the first drafts of sequences 1 and 2 and adds its own token.
            for i in 0..3 {
                starts[i] = tokens[i].len() - 1;
            }
            for i in 0..2 {
                let kept = drafted[0][i].0[0];
                tokens[i].extend([kept, 17 + i as u32]);
            }
            tokens[2].push(9);
        }
        assert_eq!((together.batched_calls(), serial.batched_calls()), (4, 0));
        // A sequence asked for twice in one batch, or one never seen, is refused by name.
        let mut samplers = [greedy, greedy];
        let mut requests: Vec<DraftRequest<'_>> =
            samplers.iter_mut().map(|sample| DraftRequest { seq_id: 9, gamma: 2, sample }).collect();
        let err = together.propose_batch(&mut requests).unwrap_err().to_string();
        assert!(err.contains("sequence 9"), "{err}");
    }

    #[test]
    fn a_prefix_hit_drafts_as_a_sequence_that_saw_the_whole_prompt() {
        let features = Tensor::randn(0f32, 1.0, (12, 3 * HIDDEN), &Device::Cpu).unwrap();
        let first: Vec<u32> = vec![5, 6, 7, 8, 9, 10, 11, 12, 13, 14];
        // Shares tokens 0..=6 with `first` (the target's cache hit covers 7 of them; it
        // redoes position 6, so the head needs rows 0..6, each valid up to token 6).
        let second: Vec<u32> = vec![5, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23];

        let [fresh, cached, other] = <[EagleProposer; 3]>::try_from(proposers(3)).ok().unwrap();
        observe(&fresh, 1, &second, 0, &features);
        let expected = greedy_drafts(&fresh, 1);

        observe(&cached, 1, &first, 0, &features);
        cached.release(1);
        assert!(cached.prefix_cache_bytes() > 0);
        observe(&cached, 2, &second, 6, &features);
        assert_eq!(cached.restored_rows(), 6);
        assert_eq!(cached.cache_len(2), second.len() - 1);
        let got = greedy_drafts(&cached, 2);
        assert_eq!(got.0, expected.0);
        let worst = got.1.iter().zip(&expected.1).filter(|(a, _)| a.is_finite()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "restored rows draft other logits (max difference {worst})");

        // One row more than the shared tokens allow is not restored: the head drafts
        // without the prefix, from position 7 on.
        observe(&other, 1, &first, 0, &features);
        other.release(1);
        observe(&other, 2, &second, 7, &features);
        assert_eq!(other.restored_rows(), 0);
        assert_eq!(other.cache_len(2), second.len() - 1);
    }

    #[test]
    fn with_a_verify_budget_sequences_drafting_together_draft_one_more_than_was_verified_and_alone_what_pays() {
        use crate::sv::{latency::VerifyLatency, schedule::GoodputOptions};
        // A verify row as dear as a forward: no draft of a batch pays for its row.
        let budget = VerifyBudget { latency: VerifyLatency::linear(10.0, 10.0), options: GoodputOptions::default(), padded: true, table: None };
        let p = proposers(1).remove(0).with_verify_budget(Some(budget));
        let features = Tensor::randn(0f32, 1.0, (6, 3 * HIDDEN), &Device::Cpu).unwrap();
        observe(&p, 1, &[1, 2, 3, 4, 5], 0, &features);
        // Alone, a sequence drafts while a draft pays for its row: a random head's never does
        // at 10 ms a row; with rows free, it drafts γ.
        assert_eq!(greedy_drafts(&p, 1).0.len(), 0);
        let free_rows = VerifyBudget { latency: VerifyLatency::linear(10.0, 0.0), options: GoodputOptions::default(), padded: true, table: None };
        let q = proposers(1).remove(0).with_verify_budget(Some(free_rows));
        observe(&q, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert_eq!(greedy_drafts(&q, 1).0.len(), 3);
        observe(&p, 2, &[1, 2, 3, 4, 6], 0, &features);
        assert_eq!(greedy_drafts(&p, 1).0.len(), 3, "no batched verify has happened yet");
        assert_eq!(greedy_drafts(&p, 2).0.len(), 3);
        assert_eq!(p.verify_lengths(&[1, 2], &[3, 3]), vec![0, 0]);
        // Together, after a verify that took none: one draft each, to see whether it pays.
        assert_eq!(greedy_drafts(&p, 1).0.len(), 1);
        assert_eq!(greedy_drafts(&p, 2).0.len(), 1);
        // Without a budget every draft is verified and γ drafted.
        let plain = proposers(1).remove(0);
        observe(&plain, 1, &[1, 2, 3, 4, 5], 0, &features);
        observe(&plain, 2, &[1, 2, 3, 4, 6], 0, &features);
        assert_eq!(plain.verify_lengths(&[1, 2], &[3, 2]), vec![3, 2]);
        assert_eq!(greedy_drafts(&plain, 1).0.len(), 3);
    }

    #[test]
    fn a_learned_t_v_prices_rows_and_each_verified_step_is_a_sample_at_its_rows() {
        use crate::sv::{latency::VerifyLatency, schedule::GoodputOptions};
        // The configured T_v says rows are free: alone, a sequence drafts γ.
        let free_rows = VerifyBudget { latency: VerifyLatency::linear(10.0, 0.0), options: GoodputOptions::default(), padded: true, table: None };
        let features = Tensor::randn(0f32, 1.0, (12, 3 * HIDDEN), &Device::Cpu).unwrap();
        // Learned from this machine: every row beyond the first costs as much as a forward,
        // so no draft of a random head pays for its row.
        let mut dear_rows = LearnedLatency::new(VerifyLatency::linear(10.0, 0.0), 1.0, 1.0).unwrap();
        for _ in 0..50 {
            (1..=4).for_each(|rows| dear_rows.record(rows, 10.0 * rows as f64));
        }
        let p = proposers(1).remove(0).with_verify_budget(Some(free_rows.clone())).with_learned_latency(Some(dear_rows));
        observe(&p, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert_eq!(greedy_drafts(&p, 1).0.len(), 0, "priced by the learned T_v, not the configured one");
        // Learning from scratch on the free-rows prior: a prompt gives no sample, a verified
        // step one at its rows (the last committed token and each draft).
        let q = proposers(1)
            .remove(0)
            .with_verify_budget(Some(free_rows))
            .with_learned_latency(Some(LearnedLatency::new(VerifyLatency::linear(10.0, 0.0), 1.0, 1.0).unwrap()));
        observe(&q, 1, &[1, 2, 3, 4, 5], 0, &features);
        assert!(q.learned_latency().unwrap().row_counts_seen().is_empty(), "a prompt is no verify");
        let (drafts, _) = greedy_drafts(&q, 1);
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
        // Kept across runs: saved when the proposer goes, with the earlier runs' samples.
        let dir = tempfile::tempdir().unwrap();
        let store = LatencyStore::on_machine(dir.path().join("tv.json"), crate::sv::latency_store::tests::target(HIDDEN), "m".into());
        let learned = q.learned_latency().unwrap();
        let kept = proposers(1).remove(0).with_learned_latency(Some(learned.clone())).with_latency_store(Some((store.clone(), 7)));
        drop(kept);
        let (kept_latency, kept_samples) = store.load().unwrap().unwrap();
        assert!(crate::sv::latency_store::tests::same_latency(&kept_latency, learned.current()));
        assert_eq!(kept_samples, 7 + learned.samples());
    }

    #[test]
    fn the_outcome_log_records_each_verified_draft_up_to_the_first_refusal() {
        let p = proposers(1).remove(0);
        p.record_outcomes();
        let features = Tensor::randn(0f32, 1.0, (16, 3 * HIDDEN), &Device::Cpu).unwrap();
        let mut tokens = vec![1, 2, 3, 4, 5];
        observe(&p, 1, &tokens, 0, &features);
        assert!(p.take_outcomes().is_empty(), "a prompt forward verifies no draft");
        let fates = |log: Vec<DraftOutcome>| log.iter().map(|o| (o.position, o.kept)).collect::<Vec<_>>();

        // The first draft kept, the second refused (the target wrote another token there).
        let (drafts, _) = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.extend([drafts[0], (drafts[1] + 1) % VOCAB as u32]);
        observe(&p, 1, &tokens, start, &features);
        let log = p.take_outcomes();
        assert!(log.iter().all(|o| o.confidence > 0.0 && o.confidence <= 1.0), "{log:?}");
        assert_eq!(fates(log), vec![(0, true), (1, false)]);

        // Every draft kept, then a bonus token.
        let (drafts, _) = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.extend(drafts.iter().copied().chain([7]));
        observe(&p, 1, &tokens, start, &features);
        assert_eq!(fates(p.take_outcomes()), vec![(0, true), (1, true), (2, true)]);

        // The first refused: nothing after it is recorded.
        let (drafts, _) = greedy_drafts(&p, 1);
        let start = tokens.len() - 1;
        tokens.push((drafts[0] + 1) % VOCAB as u32);
        observe(&p, 1, &tokens, start, &features);
        assert_eq!(fates(p.take_outcomes()), vec![(0, false)]);
        assert!(p.take_outcomes().is_empty());
    }

    #[test]
    fn learned_keep_rates_follow_the_verified_drafts_fates() {
        let p = proposers(1).remove(0).with_keep_rates(Some(KeepRates::new(20, 1.0).unwrap()));
        let features = Tensor::randn(0f32, 1.0, (16, 3 * HIDDEN), &Device::Cpu).unwrap();
        let mut tokens = vec![1, 2, 3, 4, 5];
        observe(&p, 1, &tokens, 0, &features);
        assert_eq!(p.keep_rates().unwrap().recorded(), 0, "a prompt forward verifies no draft");

        // Every draft kept: each one's bin now says more than its confidence.
        let (drafts, _) = greedy_drafts(&p, 1);
        let confidences = p.sequences()[&1].confidences.clone();
        let start = tokens.len() - 1;
        tokens.extend(drafts.iter().copied().chain([7]));
        observe(&p, 1, &tokens, start, &features);
        let rates = p.keep_rates().unwrap();
        assert_eq!(rates.recorded(), 3);
        for &c in &confidences {
            assert!(rates.keep_rate(c) > c, "a kept draft of confidence {c} is priced {}", rates.keep_rate(c));
        }
        assert_eq!(p.priced(&confidences), rates.keep_rates(&confidences), "SV reads the learned rates");
        assert!(p.take_outcomes().is_empty(), "learning does not fill the outcome log");

        // The first refused: one more draft reached, none kept.
        let (drafts, _) = greedy_drafts(&p, 1);
        let first = p.sequences()[&1].confidences[0];
        let start = tokens.len() - 1;
        tokens.push((drafts[0] + 1) % VOCAB as u32);
        observe(&p, 1, &tokens, start, &features);
        let after = p.keep_rates().unwrap();
        assert_eq!(after.recorded(), 4);
        assert!(after.keep_rate(first) < rates.keep_rate(first));
    }

    #[test]
    fn no_prefix_cache_bytes_keeps_nothing() {
        let p = proposers(1).remove(0).with_prefix_cache_bytes(0);
        let features = Tensor::randn(0f32, 1.0, (6, 3 * HIDDEN), &Device::Cpu).unwrap();
        observe(&p, 1, &[1, 2, 3, 4, 5], 0, &features);
        p.release(1);
        assert_eq!(p.prefix_cache_bytes(), 0);
        observe(&p, 2, &[1, 2, 3, 4, 6], 2, &features);
        assert_eq!(p.restored_rows(), 0);
    }
}
