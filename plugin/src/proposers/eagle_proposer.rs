//! The EAGLE-3 head as the pipeline's [`Proposer`]: one [`SequenceDrafter`] per sequence,
//! fed the target's captured layers after every target forward.

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex, MutexGuard,
    },
};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use mistralrs_core::speculative_hook::{DraftRequest, Proposer, TargetFeatures};
use verdict_heads::{Eagle3Head, ModelFingerprint, WeightFormat};

pub use super::embeddings::target_embeddings;
use super::{
    scored::{propose_alone, propose_unpriced, DraftPricing, RequestsOf, ScoredDrafts, ScoredProposer},
    eagle::{commit_together, draft_together, sure_enough, Commit, DraftSampler, SequenceDrafter, TokenEmbeddings},
    head_prefix_cache::HeadPrefixCache,
};
use crate::{
    models::ModelSource,
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
    /// Sequences of a batched step draft, and take their committed rows, in one head
    /// forward per draft position (false: one sequence after another, as before batching).
    batched_drafting: bool,
    /// A batched verify feeds the target each sequence's own rows only.
    packed_verify_rows: bool,
    /// Calls that drafted for, or took the rows of, several sequences in one head forward
    /// per position.
    batched_calls: AtomicUsize,
}

/// Bytes of finished sequences' head caches kept by default: a position costs the head
/// 2 KB with the Qwen2.5-1.5B target's shape, so ≈ 40 prompts of 800 tokens.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 64 << 20;

struct LiveSequence {
    drafter: SequenceDrafter,
    /// The sequence's tokens through the last committed position (the prefix cache's key).
    tokens: Vec<u32>,
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
            batched_drafting: true,
            packed_verify_rows: true,
            batched_calls: AtomicUsize::new(0),
        })
    }

    /// Draft for a batched step's sequences in one head forward per draft position (the
    /// default), or one sequence after another (`false`, for comparing the two).
    pub fn with_batched_drafting(mut self, batched: bool) -> Self {
        self.batched_drafting = batched;
        self
    }

    /// Let a batched verify feed the target each sequence's own rows only (the default), or
    /// pad every sequence's rows to the widest (`false`, for comparing the two). A verify
    /// budget should price rows the same way (the verify budget's `padded`).
    pub fn with_packed_verify_rows(mut self, packed: bool) -> Self {
        self.packed_verify_rows = packed;
        self
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
    /// verifies one row, a plain decode, which costs less than a verify of two.
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
    /// first (`min_first_confidence`), else γ.
    fn gamma_for(&self, live: &LiveSequence, gamma: usize) -> Result<usize> {
        if self.min_first_confidence > 0.0 && live.drafter.first_draft_confidence()? < self.min_first_confidence {
            return Ok(0);
        }
        Ok(gamma)
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
            if let std::collections::hash_map::Entry::Vacant(slot) = sequences.entry(f.seq_id) {
                let drafter = self.start_sequence(f).map_err(to_candle)?;
                slot.insert(LiveSequence { drafter, tokens: Vec::new() });
            }
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

    /// Every sequence drafts in one head forward per draft position, each chain going on
    /// while `pricing` finds one more draft worth it (and, from the second draft on, the
    /// head is sure enough of it).
    fn draft(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> candle_core::Result<Vec<ScoredDrafts>> {
        if requests.len() > 1 {
            self.batched_calls.fetch_add(1, Ordering::Relaxed);
        }
        let mut sequences = self.sequences();
        let ids: Vec<usize> = requests.iter().map(|r| r.seq_id).collect();
        let mut lives = each_live(&mut sequences, &ids).map_err(to_candle)?;
        let mut gammas = Vec::with_capacity(requests.len());
        for (live, request) in lives.iter().zip(requests.iter()) {
            gammas.push(self.gamma_for(live, request.gamma).map_err(to_candle)?);
        }
        let keep = |i: usize, confidences: &[f32]| sure_enough(confidences, self.min_confidence) && pricing.worth_drafting(i, confidences);
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
        Ok(drafts.into_iter().map(|d| ScoredDrafts { tokens: d.tokens, logits: d.logits, scores: d.confidences }).collect())
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

    /// Every sequence's committed rows go through the head in one forward.
    fn observe_batch(&self, features: &[TargetFeatures<'_>]) -> candle_core::Result<()> {
        if !self.batched_drafting && features.len() > 1 {
            features.iter().try_for_each(|f| self.commit_rows(std::slice::from_ref(f)))
        } else {
            self.commit_rows(features)
        }
    }

    fn propose(
        &self,
        seq_id: usize,
        gamma: usize,
        sample: &mut dyn FnMut(&Tensor) -> candle_core::Result<u32>,
    ) -> candle_core::Result<(Vec<u32>, Tensor)> {
        propose_alone(self, seq_id, gamma, sample)
    }

    /// Every sequence drafts in one head forward per draft position.
    fn propose_batch(&self, requests: &mut [DraftRequest<'_>]) -> candle_core::Result<Vec<(Vec<u32>, Tensor)>> {
        propose_unpriced(self, requests)
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

impl ScoredProposer for EagleProposer {
    /// Each draft's score is the head's probability of its best token there, before the
    /// draft is drawn.
    fn propose_scored(&self, requests: &mut [DraftRequest<'_>], pricing: &dyn DraftPricing) -> candle_core::Result<Vec<ScoredDrafts>> {
        if !self.batched_drafting && requests.len() > 1 {
            return requests
                .iter_mut()
                .enumerate()
                .map(|(i, r)| {
                    let one = RequestsOf { pricing, requests: vec![i] };
                    self.draft(std::slice::from_mut(r), &one).map(|mut d| d.remove(0))
                })
                .collect();
        }
        self.draft(requests, pricing)
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
                        .map(|(i, (sample, gamma))| DraftRequest { seq_id: i + 1, gamma, sample, rows: None, greedy: true })
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
            samplers.iter_mut().map(|sample| DraftRequest { seq_id: 9, gamma: 2, sample, rows: None, greedy: true }).collect();
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
