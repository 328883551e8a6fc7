//! AutoJudge's Algorithm 1 with an EAGLE-3 head as the drafter (the paper's EAGLE appendix):
//! the mismatches are the positions where the head's first draft differs from the target's
//! greedy token. No draft model is loaded; the head reads the target's own layers.
//!
//! The head's prediction at response position `a` is its first draft after a verify that
//! committed every token before `a`: its committed row `a − 2` reads the target's layers at
//! `a − 2` and the token at `a − 1` (the target had not yet read that token), and its output
//! is the draft for `a`. One teacher-forced target forward over the context records the
//! layers; one step of the head's unrolled forward then gives every position's draft at once.
//! A continuation shares its prompt and prefix with an earlier one of the problem: those
//! positions' layers are taken from it, and the target computes only the rest (its prefix
//! cache in an engine that serves these captures alone).
//!
//! Built by [`EagleMiningEngine::new`], the target decodes continuations through a
//! [`DecodeLayerRecorder`], so the layers of a continuation's new positions come from the
//! decode that wrote it, and the teacher-forced capture runs only when a recording falls
//! short (a continuation of one token, or a prefix no earlier layers of the problem cover).
//! Only first drafts are mined: a step's later drafts read the head's own outputs, whose
//! mismatches follow from the first ones.

use std::{path::Path, sync::Arc};

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Tensor, D};
use verdict::{
    engine::LoadedModels,
    proposers::{
        eagle::TokenEmbeddings,
        eagle_proposer::{capture_layers, target_embeddings},
    },
};
use verdict_heads::{Eagle3Head, WeightFormat};

use crate::{
    decode_layers::{DecodeLayerRecorder, Recording},
    eagle_capture,
    engine::{MistralEngines, Model, TARGET_TOP_K},
    miner::{Continuation, MiningEngine},
};

/// Target continuations, and the head's first drafts along them.
pub struct EagleMiningEngine {
    engines: MistralEngines,
    head: Arc<Eagle3Head>,
    embeddings: Arc<dyn TokenEmbeddings>,
    /// The target layers whose outputs the head fuses.
    layers: Vec<usize>,
    /// This problem's captured sequences and their layers, `(T, 3H)` f16: the rows a later
    /// capture's prefix-cache hit leaves out.
    captured: Vec<(Vec<u32>, Tensor)>,
    /// Rows of layers taken from earlier captures instead of computed (for logs and tests).
    reused_rows: usize,
    /// What the last continuations' decodes recorded (engines with a recorder).
    recorded: Vec<Recording>,
    /// Rows of layers taken from decode recordings (for logs and tests).
    recorded_rows: usize,
}

impl EagleMiningEngine {
    /// The head in `head_dir`, checked against the loaded target, over target-only engines.
    pub fn new(models: &LoadedModels, head_dir: &Path) -> Result<Self> {
        let mut head = Eagle3Head::load(head_dir, &candle_core::Device::Cpu)?;
        let fingerprint = &models.target_fingerprint;
        head.check_target(&head_dir.display().to_string(), fingerprint)?;
        head.quantize(WeightFormat::F32)?;
        let layers = capture_layers(&head.config.aux_layers(fingerprint.num_layers), fingerprint.num_layers)
            .with_context(|| format!("EAGLE-3 head {}", head_dir.display()))?;
        let recorder = Arc::new(DecodeLayerRecorder::new(layers.clone()));
        Ok(Self::with_head(
            MistralEngines::target_only_recording(models, recorder)?,
            Arc::new(head),
            target_embeddings(&models.target_source)?,
            layers,
        ))
    }

    /// Over a head and embeddings already loaded (tests). Engines built with
    /// [`MistralEngines::target_only_recording`] over `layers` have their recordings used.
    pub fn with_head(engines: MistralEngines, head: Arc<Eagle3Head>, embeddings: Arc<dyn TokenEmbeddings>, layers: Vec<usize>) -> Self {
        Self { engines, head, embeddings, layers, captured: Vec::new(), reused_rows: 0, recorded: Vec::new(), recorded_rows: 0 }
    }

    /// Rows of target layers taken from earlier captures so far instead of computed.
    pub fn reused_rows(&self) -> usize {
        self.reused_rows
    }

    /// Rows of target layers taken from decode recordings so far.
    pub fn recorded_rows(&self) -> usize {
        self.recorded_rows
    }

    pub fn engines(&mut self) -> &mut MistralEngines {
        &mut self.engines
    }

    /// The head's first draft at each position `from..tokens.len()` of `tokens`, given every
    /// token before it (target token ids).
    pub fn head_predictions(&mut self, tokens: &[u32], from: usize) -> Result<Vec<u32>> {
        ensure!(from >= 2, "the head drafts from position 2 on (it reads one committed row and the token after it); asked from {from}");
        ensure!(from <= tokens.len(), "predictions from {from} of a {}-token sequence", tokens.len());
        if from == tokens.len() {
            return Ok(Vec::new());
        }
        // Rows 0..rows: the target's layers at each position, and the token after it.
        let rows = tokens.len() - 2;
        let aux = self.target_layers(&tokens[..rows])?.to_dtype(DType::F32)?;
        let embeds = self.embeddings.embed(&tokens[1..rows + 1])?;
        let out = self.head.forward_ttt_from(&aux, &[embeds], from - 2)?;
        let best: Vec<u32> = out[0].logits.argmax(D::Minus1)?.to_vec1()?;
        Ok(best.into_iter().map(|d| self.head.target_id(d)).collect())
    }
}

impl EagleMiningEngine {
    /// The target's layers at every position of `tokens`, `(T, 3H)` f16: from the decode
    /// that wrote them where the last continuations' recordings cover them, else computed
    /// past what an earlier capture of this problem shares with it; before that, taken from
    /// that earlier capture.
    pub fn target_layers(&mut self, tokens: &[u32]) -> Result<Tensor> {
        let aux = match self.recorded_layers(tokens)? {
            Some(aux) => aux,
            None => self.captured_layers(tokens)?,
        };
        ensure!(aux.dim(0)? == tokens.len(), "{} rows of layers for {} positions", aux.dim(0)?, tokens.len());
        self.captured.push((tokens.to_vec(), aux.clone()));
        Ok(aux)
    }

    /// The layers at every position of `tokens` from a decode recording of a sequence that
    /// starts with them, the rows before the recording from an earlier capture of the same
    /// prefix; `None` when either is missing.
    fn recorded_layers(&mut self, tokens: &[u32]) -> Result<Option<Tensor>> {
        let n = tokens.len();
        let mut covering = None;
        for recording in &self.recorded {
            if recording.start + recording.rows()? >= n && recording.tokens.len() >= n && recording.tokens[..n] == *tokens {
                covering = Some(recording);
                break;
            }
        }
        let Some(recording) = covering else {
            return Ok(None);
        };
        let before = recording.start.min(n);
        let earlier = match before {
            0 => None,
            _ => match self.earlier_rows(tokens, before)? {
                Some(earlier) => Some(earlier),
                None => return Ok(None),
            },
        };
        let recorded = recording.layers.narrow(0, 0, n - before)?;
        self.reused_rows += before;
        self.recorded_rows += n - before;
        Ok(Some(match earlier {
            Some(earlier) => Tensor::cat(&[&earlier, &recorded], 0)?,
            None => recorded,
        }))
    }

    /// The layers at positions `0..rows` of `tokens` from an earlier capture that shares
    /// them, if one does.
    fn earlier_rows(&self, tokens: &[u32], rows: usize) -> Result<Option<Tensor>> {
        match self.captured.iter().find(|(earlier, _)| earlier.len() >= rows && earlier[..rows] == tokens[..rows]) {
            Some((_, earlier)) => Ok(Some(earlier.narrow(0, 0, rows)?)),
            None => Ok(None),
        }
    }

    /// The layers at every position of `tokens` from a teacher-forced capture: computed past
    /// what the capture engine's prefix cache holds, taken before that from an earlier
    /// capture of this problem.
    fn captured_layers(&mut self, tokens: &[u32]) -> Result<Tensor> {
        // Captures run in the second target engine, whose prefix cache holds only them.
        let (forward, fresh) = eagle_capture::capture_layers_after_cache(&self.engines, Model::Draft, tokens, &self.layers)?;
        Ok(match forward.first {
            0 => fresh,
            first => match self.earlier_rows(tokens, first)? {
                Some(earlier) => {
                    self.reused_rows += first;
                    Tensor::cat(&[&earlier, &fresh], 0)?
                }
                // The cache held a sequence this engine did not record: capture it whole.
                None => eagle_capture::capture_layers(&mut self.engines, Model::Draft, tokens, &self.layers)?.1,
            },
        })
    }
}

impl MiningEngine for EagleMiningEngine {
    fn start_problem(&mut self) -> Result<()> {
        self.engines.clear_prefix_caches();
        self.captured.clear();
        Ok(())
    }

    fn continue_response(&mut self, prompt: &str, prefix: &[u32], max_response_tokens: usize) -> Result<Continuation> {
        let mut one = self.continue_responses(&[(prompt, prefix)], max_response_tokens)?;
        Ok(one.pop().expect("one continuation per request"))
    }

    /// The target's continuations decoded together, then the head's drafts along each.
    fn continue_responses(&mut self, requests: &[(&str, &[u32])], max_response_tokens: usize) -> Result<Vec<Continuation>> {
        let mut continuations = self.continue_responses_unpredicted(requests, max_response_tokens)?;
        for (continuation, (prompt, prefix)) in continuations.iter_mut().zip(requests) {
            continuation.predictions = self.predictions(prompt, &continuation.response, prefix.len())?;
        }
        Ok(continuations)
    }

    /// The head's drafts along a response: the target's layers over it (what its prefix
    /// cache and this problem's earlier captures do not hold), then one step of the head.
    fn predictions(&mut self, prompt: &str, response: &[u32], from: usize) -> Result<Vec<u32>> {
        if from == response.len() {
            return Ok(Vec::new());
        }
        let prompt_tokens = self.engines.prompt_tokens(prompt)?;
        let mut context = prompt_tokens.clone();
        context.extend_from_slice(response);
        let (started, recorded_before) = (std::time::Instant::now(), self.recorded_rows);
        let predictions = self.head_predictions(&context, prompt_tokens.len() + from)?;
        tracing::debug!(
            "head: {} positions in {:.1}s, {} rows of layers from the decode",
            predictions.len(),
            started.elapsed().as_secs_f64(),
            self.recorded_rows - recorded_before
        );
        // The search goes on from this response alone: the problem's earlier layers are
        // no longer needed (a capture whose prefix they held recomputes it).
        if let Some(latest) = self.captured.pop() {
            self.captured.retain(|(tokens, _)| !tokens.starts_with(&prompt_tokens));
            self.captured.push(latest);
        }
        Ok(predictions)
    }

    /// The target's continuations decoded together; the head's drafts are left to
    /// [`MiningEngine::predictions`], for the continuations a search keeps.
    fn continue_responses_unpredicted(&mut self, requests: &[(&str, &[u32])], max_response_tokens: usize) -> Result<Vec<Continuation>> {
        // Each request's whole context (prompt tokens, then the prefix) and the tokens the
        // target may add to it.
        let mut asked = Vec::with_capacity(requests.len());
        for (prompt, prefix) in requests {
            let mut context = self.engines.prompt_tokens(prompt)?;
            context.extend_from_slice(prefix);
            asked.push((context, max_response_tokens.saturating_sub(prefix.len())));
        }
        let started = std::time::Instant::now();
        if let Some(recorder) = self.engines.recorder() {
            recorder.clear();
        }
        let generated = self.engines.greedy_with_top_together(Model::Target, &asked, TARGET_TOP_K)?;
        self.recorded = self.engines.recorder().map(|r| r.take_finished()).unwrap_or_default();
        let continuations: Vec<Continuation> = requests
            .iter()
            .zip(generated)
            .map(|((_, prefix), (new, target_top))| Continuation { response: [prefix, new.as_slice()].concat(), predictions: Vec::new(), target_top })
            .collect();
        tracing::debug!(
            "target: {} continuations, {} new tokens in {:.1}s",
            requests.len(),
            continuations.iter().zip(requests).map(|(c, (_, prefix))| c.response.len() - prefix.len()).sum::<usize>(),
            started.elapsed().as_secs_f64()
        );
        Ok(continuations)
    }

    /// Drop the layers captured for this problem's sequences.
    fn finish_problem(&mut self, prompt: &str) -> Result<()> {
        let tokens = self.engines.prompt_tokens(prompt)?;
        self.captured.retain(|(captured, _)| !captured.starts_with(&tokens));
        Ok(())
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.engines.decode(tokens)
    }
}

