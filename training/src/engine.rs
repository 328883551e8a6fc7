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
    TokenizationRequest,
};
use tokenizers::Tokenizer;
use verdict::{
    config::SamplingConfig,
    engine::{
        build_mistralrs_with, generate_with_top_tokens, user_turn, LoadedModels, Prompt,
        SharedPipeline,
    },
};

use crate::{
    autojudge_head::FeatureModels,
    miner::{Continuation, MiningEngine},
    pad_mine::RolloutEngine,
};

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
    /// Chat-templated prompt tokens, by prompt text.
    prompts: HashMap<String, Vec<u32>>,
}

async fn engines_over(
    pipelines: &(SharedPipeline, SharedPipeline),
) -> (Arc<MistralRs>, Arc<MistralRs>) {
    (
        build_mistralrs_with(pipelines.0.clone(), 1, true).await,
        build_mistralrs_with(pipelines.1.clone(), 1, true).await,
    )
}

impl MistralEngines {
    pub fn new(models: &LoadedModels) -> Result<Self> {
        let (draft, _) = models
            .draft
            .as_ref()
            .context("mining needs a draft model (models.draft, speculative.enabled = true)")?;
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
        let pipelines = (models.target.clone(), draft.clone());
        let (target, draft) = runtime.block_on(engines_over(&pipelines));
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
                    .context("the draft has no fingerprint")?,
            },
            prompts: HashMap::new(),
        })
    }

    /// The prompt as the chat engine sees it: template applied, generation prompt added.
    pub fn prompt_tokens(&mut self, prompt: &str) -> Result<Vec<u32>> {
        if let Some(tokens) = self.prompts.get(prompt) {
            return Ok(tokens.clone());
        }
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let request = Request::Tokenize(TokenizationRequest {
            text: either::Either::Left(vec![user_turn(prompt)]),
            tools: None,
            add_generation_prompt: true,
            add_special_tokens: true,
            enable_thinking: None,
            reasoning_effort: None,
            response: tx,
        });
        let tokens = self.runtime.block_on(async {
            self.target.get_sender(None)?.send(request).await?;
            rx.recv().await.context("the engine dropped the request")?
        })?;
        self.prompts.insert(prompt.to_string(), tokens.clone());
        Ok(tokens)
    }

    /// Start both engines afresh, dropping their prefix caches: on the CPU mistral.rs never
    /// evicts cached sequences, so memory would grow with every request otherwise.
    pub fn clear_prefix_caches(&mut self) {
        let (target, draft) = self.runtime.block_on(engines_over(&self.pipelines));
        self.target = target;
        self.draft = draft;
    }

    /// The fingerprints of the loaded pair.
    pub fn models(&self) -> &FeatureModels {
        &self.models
    }

    fn engine(&self, model: Model) -> &MistralRs {
        match model {
            Model::Target => &self.target,
            Model::Draft => &self.draft,
        }
    }

    /// What `request` captures while `model` reads `tokens` (one forward, over the tokens
    /// the prefix cache lacks; the last position is always among them).
    pub fn capture(
        &self,
        model: Model,
        tokens: &[u32],
        request: CaptureRequest,
    ) -> Result<CapturedStates> {
        let sampling = SamplingConfig {
            max_tokens: 1,
            ..SamplingConfig::default()
        };
        hidden_capture::arm_shared(request);
        let generation = self.runtime.block_on(generate_with_top_tokens(
            self.engine(model),
            &Prompt::Tokens(tokens.to_vec()),
            &sampling,
            0,
        ));
        let states = hidden_capture::disarm_shared();
        generation?;
        states.context("nothing was captured")
    }

    /// `model`'s greedy tokens after `context`, at most `max_new`, EOS excluded.
    pub fn greedy(&self, model: Model, context: &[u32], max_new: usize) -> Result<Vec<u32>> {
        if max_new == 0 {
            return Ok(Vec::new());
        }
        let sampling = SamplingConfig {
            max_tokens: max_new,
            ..SamplingConfig::default()
        };
        let generation = self.runtime.block_on(generate_with_top_tokens(
            self.engine(model),
            &Prompt::Tokens(context.to_vec()),
            &sampling,
            1,
        ))?;
        // Under greedy decoding the emitted token is the best candidate at each step.
        let mut tokens = generation
            .top_tokens
            .iter()
            .map(|(_, top)| top.first().map(|c| c.0).context("no candidates returned"))
            .collect::<Result<Vec<_>>>()?;
        // The EOS that ended the response is reported too; it is not response text.
        if tokens.last().is_some_and(|t| self.eos.contains(t)) {
            tokens.pop();
        }
        ensure!(
            tokens.len() <= max_new,
            "the engine returned {} tokens for a cap of {max_new}",
            tokens.len()
        );
        Ok(tokens)
    }

    /// The draft's arg-max next token after each of the last positions of `tokens` (one
    /// teacher-forced forward): `(first, argmax)` where `argmax[i]` follows
    /// `tokens[first + i]`. With a prefix-cache hit only the positions after the shared
    /// prefix are computed, so `first` is where the cached part ends.
    pub fn draft_argmax(&self, tokens: &[u32]) -> Result<(usize, Vec<u32>)> {
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
            self.draft.next_request_id(),
            None,
            None,
        );
        request.return_raw_logits = true;
        let response = self.runtime.block_on(async {
            self.draft
                .get_sender(None)?
                .send(Request::Normal(Box::new(request)))
                .await?;
            rx.recv().await.context("the engine dropped the request")
        })?;
        let chunks = match response {
            Response::Raw { logits_chunks, .. } => logits_chunks,
            Response::InternalError(e) | Response::ValidationError(e) => {
                bail!("draft forward failed: {e}")
            }
            _ => bail!("the draft engine did not return raw logits"),
        };
        let rows = Tensor::cat(&chunks, 0)?;
        let rows = match rows.rank() {
            2 => rows,
            3 => rows.squeeze(0)?,
            r => bail!("raw logits of rank {r}"),
        };
        let argmax: Vec<u32> = rows.to_dtype(DType::F32)?.argmax(D::Minus1)?.to_vec1()?;
        ensure!(
            !argmax.is_empty() && argmax.len() <= tokens.len(),
            "draft returned {} rows for {} tokens",
            argmax.len(),
            tokens.len()
        );
        Ok((tokens.len() - argmax.len(), argmax))
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
        let new = self.greedy(
            Model::Target,
            &context,
            max_response_tokens.saturating_sub(prefix.len()),
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
        prefix: &[u32],
        n: usize,
        temperature: f64,
        max_response_tokens: usize,
    ) -> Result<Vec<String>> {
        let mut context = self.prompt_tokens(prompt)?;
        context.extend_from_slice(prefix);
        let head = self.decode(prefix)?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let params = SamplingParams {
            temperature: Some(temperature),
            max_len: Some(max_response_tokens.saturating_sub(prefix.len()).max(1)),
            n_choices: n,
            ..SamplingParams::neutral()
        };
        let request = NormalRequest::new_simple(
            RequestMessage::CompletionTokens(context),
            params,
            tx,
            self.target.next_request_id(),
            None,
            None,
        );
        let response = self.runtime.block_on(async {
            self.target
                .get_sender(None)?
                .send(Request::Normal(Box::new(request)))
                .await?;
            rx.recv().await.context("the engine dropped the request")
        })?;
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
    }
}
