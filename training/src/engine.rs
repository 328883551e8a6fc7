//! Mining and feature capture on mistral.rs: the same loaders, dtype and kernels as
//! inference.
//!
//! Target and draft each run in a plain engine with the prefix cache on, so a request that
//! shares a prefix with an earlier one (the prompt and the response up to a swap) computes
//! only the tokens after it. The draft's predictions come from one teacher-forced forward
//! over prompt ⊕ response (`return_raw_logits`, never cached), whose row i is the draft's
//! next-token logits after token i. Features come from a one-token request with the
//! patched hidden-state capture armed for the engine's thread.

use std::{collections::HashMap, sync::Arc};

use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor, D};
use mistralrs_core::{
    hidden_capture::{self, CaptureRequest, CapturedStates},
    MistralRs, NormalRequest, Request, RequestMessage, Response, SamplingParams,
    SpeculativeConfig, SpeculativePipeline,
};
use tokenizers::Tokenizer;
use verdict::{
    config::SamplingConfig,
    engine::{
        build_mistralrs_with, chat_tokens, generate_with_top_tokens, LoadedModels, Prompt,
        SharedPipeline,
    },
};

use crate::{
    decode_layers::DecodeLayerRecorder,
    feature_models::FeatureModels,
    miner::{Continuation, MiningEngine, TopTokens},
    pad_mine::RolloutEngine,
};

/// The target's best tokens reported at each mined position (for `mine --important-below`).
pub const TARGET_TOP_K: usize = 8;

/// The logits of one teacher-forced forward: row i follows token `first + i`.
pub struct RawForward {
    pub first: usize,
    /// `[positions, vocab]`, f32.
    pub logits: Tensor,
}

/// Which of the pair a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    Target,
    Draft,
}

/// A blocking handle on a target engine and a draft engine.
pub struct MistralEngines {
    runtime: tokio::runtime::Runtime,
    pipelines: (SharedPipeline, SharedPipeline),
    target: Arc<MistralRs>,
    draft: Arc<MistralRs>,
    tokenizer: Arc<Tokenizer>,
    eos: Vec<u32>,
    models: FeatureModels,
    /// Positions the draft's prefix cache supplied in the last teacher-forced pass.
    last_draft_cached: usize,
    /// Chat-templated prompt tokens, by prompt text.
    prompts: HashMap<String, Vec<u32>>,
    /// Sequences the target engine runs at once: 1 for mining (one continuation at a
    /// time), 2N for PAD so all rollouts of a candidate share each forward.
    target_max_seqs: usize,
    /// The draft slot runs the target ([`Self::target_only`]): there is no draft model.
    target_only: bool,
    /// The target decodes through this recorder ([`Self::target_only_recording`]).
    recorder: Option<Arc<DecodeLayerRecorder>>,
}

async fn engines_over(
    pipelines: &(SharedPipeline, SharedPipeline),
    target_max_seqs: usize,
) -> (Arc<MistralRs>, Arc<MistralRs>) {
    (
        build_mistralrs_with(pipelines.0.clone(), target_max_seqs, true).await,
        build_mistralrs_with(pipelines.1.clone(), 1, true).await,
    )
}

impl MistralEngines {
    pub fn new(models: &LoadedModels) -> Result<Self> {
        let (draft, _) = models
            .draft
            .as_ref()
            .context("mining needs a draft model (models.draft, speculative.enabled = true)")?;
        Self::over(models, draft.clone(), false)
    }

    /// Engines for work that reads the target alone (EAGLE features): the draft slot runs
    /// the target too, so nothing asked of [`Model::Draft`] means a second model.
    pub fn target_only(models: &LoadedModels) -> Result<Self> {
        Self::over(models, models.target.clone(), true)
    }

    /// [`Self::target_only`], the target decoding under a speculative pipeline whose
    /// proposer, `recorder`, never drafts: its steps are plain decodes, and the recorder
    /// keeps the layers they compute (see [`crate::decode_layers`]). Captures still run in
    /// the draft slot, a plain engine over the target.
    pub fn target_only_recording(models: &LoadedModels, recorder: Arc<DecodeLayerRecorder>) -> Result<Self> {
        let decoding = SpeculativePipeline::with_proposer(models.target.clone(), recorder.clone(), SpeculativeConfig { gamma: 1, accept_rule: None })?;
        let decoding: SharedPipeline = Arc::new(tokio::sync::Mutex::new(decoding));
        Ok(Self::over_pipelines(models, (decoding, models.target.clone()), true, Some(recorder))?.settled())
    }

    /// The recorder the target decodes through, if it does ([`Self::target_only_recording`]).
    pub fn recorder(&self) -> Option<&Arc<DecodeLayerRecorder>> {
        self.recorder.as_ref()
    }

    /// Whether these engines read the target alone (no draft model).
    pub fn is_target_only(&self) -> bool {
        self.target_only
    }

    fn over(models: &LoadedModels, draft: SharedPipeline, target_only: bool) -> Result<Self> {
        Ok(Self::over_pipelines(models, (models.target.clone(), draft), target_only, None)?.settled())
    }

    /// Engines over `pipelines` (target slot, draft slot), not yet settled.
    fn over_pipelines(models: &LoadedModels, pipelines: (SharedPipeline, SharedPipeline), target_only: bool, recorder: Option<Arc<DecodeLayerRecorder>>) -> Result<Self> {
        let (tokenizer, eos) = {
            let target = models.target.blocking_lock();
            let tokenizer = target
                .tokenizer()
                .context("the target model has no tokenizer")?;
            (tokenizer, target.get_metadata().eos_tok.clone())
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let (target, draft) = runtime.block_on(engines_over(&pipelines, 1));
        Ok(Self {
            runtime,
            pipelines,
            target,
            draft,
            tokenizer,
            eos,
            models: FeatureModels {
                target: models.target_fingerprint.clone(),
                draft: models
                    .draft_fingerprint
                    .clone()
                    .unwrap_or_else(|| models.target_fingerprint.clone()),
            },
            last_draft_cached: 0,
            prompts: HashMap::new(),
            target_max_seqs: 1,
            target_only,
            recorder,
        })
    }

    /// Rebuild the target engine so it schedules up to `max_seqs` sequences per forward:
    /// rollouts of equal length are then decoded as one multi-row batch, which costs far
    /// less than one forward each with the weight-stationary kernel.
    pub fn set_target_batch(&mut self, max_seqs: usize) {
        self.target_max_seqs = max_seqs.max(1);
        self.clear_prefix_caches();
    }

    /// Ready the target engine to decode up to `sequences` continuations as one batch,
    /// whatever their lengths, with every prefix cache of the process bounded to
    /// `cache_bytes` (least recently used evicted first), so that problems mined together
    /// need no clearing between them.
    pub fn batch_continuations(&mut self, sequences: usize, cache_bytes: usize) {
        mistralrs_core::set_ragged_decode_batches(true);
        mistralrs_core::set_cpu_prefix_cache_limit(Some(cache_bytes));
        self.set_target_batch(sequences);
    }

    fn settled(self) -> Self {
        self.settle_both();
        self
    }

    /// The prompt as the chat engine sees it: template applied, generation prompt added.
    pub fn prompt_tokens(&mut self, prompt: &str) -> Result<Vec<u32>> {
        self.chat_tokens(&[("user".to_string(), prompt.to_string())])
    }

    /// A conversation of (role, content) turns as the chat engine sees it.
    pub fn chat_tokens(&mut self, turns: &[(String, String)]) -> Result<Vec<u32>> {
        let key = serde_json::to_string(turns)?;
        if let Some(tokens) = self.prompts.get(&key) {
            return Ok(tokens.clone());
        }
        let tokens = self.runtime.block_on(chat_tokens(&self.target, turns))?;
        self.prompts.insert(key, tokens.clone());
        Ok(tokens)
    }

    /// Start both engines afresh, dropping their prefix caches: on the CPU mistral.rs never
    /// evicts cached sequences, so memory would grow with every request otherwise.
    pub fn clear_prefix_caches(&mut self) {
        let (target, draft) = self
            .runtime
            .block_on(engines_over(&self.pipelines, self.target_max_seqs));
        self.target = target;
        self.draft = draft;
        if let Some(recorder) = &self.recorder {
            // The old engine's sequences are gone with it.
            recorder.clear();
        }
        self.settle_both();
    }

    /// [`Self::settle`] both engines (after their start-up dummy runs).
    fn settle_both(&self) {
        for model in [Model::Target, Model::Draft] {
            if let Err(e) = self.settle(model, 0) {
                tracing::warn!("{model:?} engine did not settle: {e:#}");
            }
        }
    }

    /// Positions of the last teacher-forced draft pass that came from the prefix cache.
    pub fn last_draft_cached(&self) -> usize {
        self.last_draft_cached
    }

    /// The fingerprints of the loaded pair.
    pub fn models(&self) -> &FeatureModels {
        &self.models
    }

    fn engine(&self, model: Model) -> &Arc<MistralRs> {
        match model {
            Model::Target => &self.target,
            Model::Draft => &self.draft,
        }
    }

    /// What `request` captures while `model` reads `tokens`, with the logits of the same
    /// forward: a teacher-forced pass over the tokens the prefix cache lacks (the last
    /// position is always among them).
    ///
    /// The capture is armed for whichever thread runs a forward, so a window could record a
    /// stray forward (stock mistral.rs 0.8.1 runs one more for a request its prompt step
    /// finished; the patch series stops it). Each capture is therefore checked: one recording per requested
    /// layer, the last hidden state over this forward's positions, and the LM head applied
    /// to it giving this forward's logits. A failed check is retried.
    pub fn capture(
        &self,
        model: Model,
        tokens: &[u32],
        request: CaptureRequest,
    ) -> Result<(RawForward, CapturedStates)> {
        let armed = CaptureRequest {
            last_hidden: true,
            lm_head: true,
            ..request.clone()
        };
        let mut last_error = None;
        for attempt in 0..5 {
            hidden_capture::arm_shared(armed.clone());
            let forward = self.raw_forward(model, tokens);
            let states = hidden_capture::disarm_shared();
            let forward = forward?;
            let mut states = states.context("nothing was captured")?;
            keep_last_forward(&mut states.layers);
            match check_capture(&forward, &states, &request) {
                Ok(()) => return Ok((forward, states)),
                Err(e) => {
                    tracing::warn!("{model:?} capture attempt {attempt} rejected: {e:#}");
                    last_error = Some(e);
                }
            }
        }
        Err(last_error
            .unwrap()
            .context("every capture attempt recorded another forward"))
    }

    /// One teacher-forced forward of `model` over `tokens` (`return_raw_logits`); mistral.rs
    /// caches it as a prefix (our patch), and a cache hit computes only the rest.
    pub fn raw_forward(&self, model: Model, tokens: &[u32]) -> Result<RawForward> {
        let engine = self.engine(model);
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let params = SamplingParams {
            temperature: Some(0.0),
            max_len: Some(1),
            ..SamplingParams::neutral()
        };
        let mut request = NormalRequest::new_simple(
            RequestMessage::CompletionTokens(tokens.to_vec()),
            params,
            tx,
            engine.next_request_id(),
            None,
            None,
        );
        request.return_raw_logits = true;
        let response = self.runtime.block_on(async {
            engine
                .get_sender(None)?
                .send(Request::Normal(Box::new(request)))
                .await?;
            rx.recv().await.context("the engine dropped the request")
        })?;
        let chunks = match response {
            Response::Raw { logits_chunks, .. } => logits_chunks,
            Response::InternalError(e) | Response::ValidationError(e) => {
                bail!("{model:?} forward failed: {e}")
            }
            _ => bail!("the {model:?} engine did not return raw logits"),
        };
        let logits = Tensor::cat(&chunks, 0)?;
        let logits = match logits.rank() {
            2 => logits,
            3 => logits.squeeze(0)?,
            r => bail!("raw logits of rank {r}"),
        }
        .to_dtype(DType::F32)?;
        let rows = logits.dim(0)?;
        ensure!(
            rows > 0 && rows <= tokens.len(),
            "{model:?} returned {rows} rows for {} tokens",
            tokens.len()
        );
        Ok(RawForward {
            first: tokens.len() - rows,
            logits,
        })
    }

    /// Wait until `model`'s engine has run every forward of the requests answered so far.
    ///
    /// mistral.rs answers a generation request and then still runs one more forward for it
    /// (seen as a stray one-position forward in capture windows). Two one-token passes in a
    /// row end only after the engine loop has gone round once more, past that forward.
    /// A recording target's pipeline returns no raw logits: two one-token generations go
    /// round its loop as well.
    fn settle(&self, model: Model, token: u32) -> Result<()> {
        for _ in 0..2 {
            if model == Model::Target && self.recorder.is_some() {
                let sampling = SamplingConfig { max_tokens: 1, ..SamplingConfig::default() };
                self.runtime.block_on(generate_with_top_tokens(&self.target, &Prompt::Tokens(vec![token]), &sampling, 1))?;
            } else {
                self.raw_forward(model, &[token])?;
            }
        }
        Ok(())
    }

    /// `model`'s greedy tokens after `context`, at most `max_new`, EOS excluded.
    pub fn greedy(&self, model: Model, context: &[u32], max_new: usize) -> Result<Vec<u32>> {
        Ok(self.greedy_with_top(model, context, max_new, 1)?.0)
    }

    /// [`Self::greedy`], with `model`'s `k` best tokens and their probabilities at each
    /// position, best first.
    pub fn greedy_with_top(&self, model: Model, context: &[u32], max_new: usize, k: usize) -> Result<(Vec<u32>, Vec<TopTokens>)> {
        let mut one = self.greedy_with_top_together(model, &[(context.to_vec(), max_new)], k)?;
        Ok(one.pop().expect("one answer per request"))
    }

    /// [`Self::greedy_with_top`] for several `(context, max_new)` requests, all queued before
    /// any is awaited, so the engine decodes them as one batch (up to its `max_seqs`; with
    /// ragged decode batches, whatever their lengths).
    pub fn greedy_with_top_together(&self, model: Model, requests: &[(Vec<u32>, usize)], k: usize) -> Result<Vec<(Vec<u32>, Vec<TopTokens>)>> {
        let engine = self.engine(model);
        let generations = self.runtime.block_on(async {
            let mut running = tokio::task::JoinSet::new();
            for (index, (context, max_new)) in requests.iter().enumerate().filter(|(_, (_, max_new))| *max_new > 0) {
                let (engine, prompt) = (engine.clone(), Prompt::Tokens(context.clone()));
                let sampling = SamplingConfig {
                    max_tokens: *max_new,
                    ..SamplingConfig::default()
                };
                running.spawn(async move { (index, generate_with_top_tokens(&engine, &prompt, &sampling, k.max(1)).await) });
            }
            let mut generations = vec![None; requests.len()];
            while let Some(joined) = running.join_next().await {
                let (index, generation) = joined?;
                generations[index] = Some(generation?);
            }
            anyhow::Ok(generations)
        })?;
        if let Some((context, _)) = requests.iter().find(|(_, max_new)| *max_new > 0) {
            self.settle(model, context[0])?;
        }
        requests
            .iter()
            .zip(generations)
            .map(|((_, max_new), generation)| {
                let Some(generation) = generation else {
                    return Ok((Vec::new(), Vec::new()));
                };
                let mut top: Vec<TopTokens> = generation
                    .top_tokens
                    .iter()
                    .map(|(_, candidates)| candidates.iter().map(|&(id, _, logprob)| (id, logprob.exp())).collect())
                    .collect();
                // Under greedy decoding the emitted token is the best candidate at each step.
                let mut tokens = generation
                    .top_tokens
                    .iter()
                    .map(|(_, top)| top.first().map(|c| c.0).context("no candidates returned"))
                    .collect::<Result<Vec<_>>>()?;
                // The EOS that ended the response is reported too; it is not response text.
                if tokens.last().is_some_and(|t| self.eos.contains(t)) {
                    tokens.pop();
                    top.pop();
                }
                ensure!(tokens.len() <= *max_new, "the engine returned {} tokens for a cap of {max_new}", tokens.len());
                Ok((tokens, top))
            })
            .collect()
    }

    /// The draft's arg-max next token after each position the forward computed:
    /// `(first, argmax)` where `argmax[i]` follows `tokens[first + i]`.
    pub fn draft_argmax(&self, tokens: &[u32]) -> Result<(usize, Vec<u32>)> {
        let forward = self.raw_forward(Model::Draft, tokens)?;
        Ok((forward.first, forward.logits.argmax(D::Minus1)?.to_vec1()?))
    }
}

impl MiningEngine for MistralEngines {
    fn start_problem(&mut self) -> Result<()> {
        self.clear_prefix_caches();
        Ok(())
    }

    fn continue_response(
        &mut self,
        prompt: &str,
        prefix: &[u32],
        max_response_tokens: usize,
    ) -> Result<Continuation> {
        let mut context = self.prompt_tokens(prompt)?;
        let prompt_len = context.len();
        context.extend_from_slice(prefix);
        let started = std::time::Instant::now();
        let (new, target_top) = self.greedy_with_top(
            Model::Target,
            &context,
            max_response_tokens.saturating_sub(prefix.len()),
            TARGET_TOP_K,
        )?;
        let generated = started.elapsed().as_secs_f64();
        let mut response = prefix.to_vec();
        response.extend_from_slice(&new);
        context.extend_from_slice(&new);
        // Response position p is predicted after context token prompt_len + p − 1.
        let predictions = if new.is_empty() {
            Vec::new()
        } else {
            let wanted = prompt_len + prefix.len() - 1;
            let (first, argmax) = self.draft_argmax(&context[..context.len() - 1])?;
            self.last_draft_cached = first;
            ensure!(
                first <= wanted,
                "the draft's prefix cache covered position {first}, past the swap at {wanted}"
            );
            tracing::debug!(
                "target: {} new tokens in {generated:.1}s; draft: {} of {} positions in {:.1}s",
                new.len(),
                argmax.len(),
                context.len() - 1,
                started.elapsed().as_secs_f64() - generated
            );
            argmax[wanted - first..].to_vec()
        };
        Ok(Continuation {
            response,
            predictions,
            target_top,
        })
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| anyhow::anyhow!("cannot decode tokens: {e}"))
    }
}

impl RolloutEngine for MistralEngines {
    fn start_candidate(&mut self) -> Result<()> {
        self.clear_prefix_caches();
        Ok(())
    }

    fn rollouts(
        &mut self,
        prompt: &str,
        prefixes: &[Vec<u32>],
        n: usize,
        temperature: f64,
        max_response_tokens: usize,
    ) -> Result<Vec<Vec<String>>> {
        let prompt_tokens = self.prompt_tokens(prompt)?;
        // One greedy token over the context every rollout shares puts it in the target's
        // prefix cache, so the 2N rollouts prefill only their own last tokens instead of
        // each prefilling prompt and prefix again.
        let mut shared = prompt_tokens.clone();
        shared.extend_from_slice(common_prefix(prefixes));
        self.greedy(Model::Target, &shared, 1)?;
        let mut receivers = Vec::with_capacity(prefixes.len());
        let mut requests = Vec::with_capacity(prefixes.len());
        for prefix in prefixes {
            let mut context = prompt_tokens.clone();
            context.extend_from_slice(prefix);
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let params = SamplingParams {
                temperature: Some(temperature),
                max_len: Some(max_response_tokens.saturating_sub(prefix.len()).max(1)),
                n_choices: n,
                ..SamplingParams::neutral()
            };
            requests.push(NormalRequest::new_simple(
                RequestMessage::CompletionTokens(context),
                params,
                tx,
                self.target.next_request_id(),
                None,
                None,
            ));
            receivers.push(rx);
        }
        // All requests are queued before any is awaited, so the scheduler batches them.
        let responses = self.runtime.block_on(async {
            let sender = self.target.get_sender(None)?;
            for request in requests {
                sender.send(Request::Normal(Box::new(request))).await?;
            }
            let mut responses = Vec::with_capacity(receivers.len());
            for rx in &mut receivers {
                responses.push(rx.recv().await.context("the engine dropped the request")?);
            }
            anyhow::Ok(responses)
        })?;
        prefixes
            .iter()
            .zip(responses)
            .map(|(prefix, response)| {
                let head = self.decode(prefix)?;
                match response {
                    Response::CompletionDone(done) => Ok(done
                        .choices
                        .into_iter()
                        .map(|c| format!("{head}{}", c.text))
                        .collect()),
                    Response::InternalError(e) | Response::ValidationError(e) => {
                        bail!("rollouts failed: {e}")
                    }
                    Response::CompletionModelError(e, _) => bail!("model error: {e}"),
                    _ => bail!("unexpected response to a rollout request"),
                }
            })
            .collect()
    }
}

/// The longest start all `prefixes` share.
fn common_prefix(prefixes: &[Vec<u32>]) -> &[u32] {
    let Some((first, rest)) = prefixes.split_first() else {
        return &[];
    };
    let len = rest.iter().fold(first.len(), |len, other| {
        first[..len]
            .iter()
            .zip(other)
            .take_while(|(a, b)| a == b)
            .count()
    });
    &first[..len]
}

/// Layer recordings pile up over every forward run while capture is armed, but the last
/// hidden state is the last forward's: keep only each layer's last recording so both come
/// from one forward, which [`check_capture`] then ties to the returned logits.
fn keep_last_forward(layers: &mut Vec<(usize, Tensor)>) {
    let mut seen = std::collections::HashSet::new();
    let mut kept: Vec<(usize, Tensor)> = layers
        .drain(..)
        .rev()
        .filter(|(layer, _)| seen.insert(*layer))
        .collect();
    kept.reverse();
    *layers = kept;
}

/// The recorded states belong to `forward` (see [`MistralEngines::capture`]).
fn check_capture(
    forward: &RawForward,
    states: &CapturedStates,
    request: &CaptureRequest,
) -> Result<()> {
    ensure!(
        states.layers.len() == request.layers.len(),
        "{} layer recordings for {} layers",
        states.layers.len(),
        request.layers.len()
    );
    let positions = forward.logits.dim(0)?;
    let hidden = states
        .last_hidden
        .as_ref()
        .context("no last hidden state")?;
    for t in std::iter::once(hidden).chain(states.layers.iter().map(|(_, t)| t)) {
        ensure!(
            t.dim(1)? == positions,
            "a recording over {} positions, the forward had {positions}",
            t.dim(1)?
        );
    }
    let lm_head = states.lm_head.as_ref().context("no LM head")?;
    let last = hidden.narrow(1, positions - 1, 1)?.contiguous()?;
    let recomputed = lm_head
        .forward(&last)?
        .flatten_all()?
        .to_dtype(DType::F32)?;
    let returned = forward.logits.get(positions - 1)?;
    let gap: f32 = (recomputed - &returned)?.abs()?.max(0)?.to_scalar()?;
    let scale: f32 = returned.abs()?.max(0)?.to_scalar()?;
    ensure!(
        gap <= 1e-3 * scale.max(1.0),
        "the LM head on the recorded state misses the returned logits by {gap}"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{common_prefix, keep_last_forward};
    use candle_core::{Device, Tensor};

    #[test]
    fn only_the_last_forward_recordings_are_kept() {
        let t = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap();
        // Two forwards recorded layers 3 and 5; the second forward's pair survives in order.
        let mut layers = vec![(3, t(1.0)), (5, t(2.0)), (3, t(3.0)), (5, t(4.0))];
        keep_last_forward(&mut layers);
        let got: Vec<(usize, f32)> = layers
            .iter()
            .map(|(l, x)| (*l, x.to_vec1::<f32>().unwrap()[0]))
            .collect();
        assert_eq!(got, vec![(3, 3.0), (5, 4.0)]);
    }

    #[test]
    fn common_prefix_of_rollout_contexts() {
        assert_eq!(
            common_prefix(&[vec![1, 2, 3, 9], vec![1, 2, 3, 4]]),
            &[1, 2, 3]
        );
        assert_eq!(common_prefix(&[vec![1, 2], vec![1, 2, 3]]), &[1, 2]);
        assert_eq!(common_prefix(&[vec![5], vec![6]]), &[] as &[u32]);
        assert_eq!(common_prefix(&[vec![7, 8]]), &[7, 8]);
        assert_eq!(common_prefix(&[]), &[] as &[u32]);
    }
}
