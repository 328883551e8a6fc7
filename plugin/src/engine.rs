//! Loading models into mistral.rs and running requests: the plain target engine and the
//! speculative engine with Verdict's accept rule.

use std::{num::NonZeroUsize, path::Path, sync::Arc, time::Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use either::Either;
use indexmap::IndexMap;
use mistralrs_core::{
    DefaultSchedulerMethod, DeviceMapSetting, GGUFLoaderBuilder, GGUFSpecificConfig, Loader,
    MistralRs, MistralRsBuilder, ModelDType, NormalLoaderBuilder, NormalRequest,
    NormalSpecificConfig, Pipeline, Request, RequestMessage, Response, SamplingParams,
    SchedulerConfig, SpeculativeConfig, SpeculativePipeline, TokenSource,
};
use mistralrs_core::speculative_hook::{AcceptRule, Proposer};
use tokio::sync::Mutex;

use verdict_heads::ModelFingerprint;

use crate::{
    accept::VerdictRule,
    config::{Config, Isq, ProposerKind, SamplingConfig, ServerConfig},
    fingerprint::fingerprint,
    judge::JudgeStack,
    judges::LoadedFingerprints,
    metrics::Metrics,
    models::{cache_dir, resolve, ModelSource},
    proposers::timed::TimedProposer,
};

pub type SharedPipeline = Arc<Mutex<dyn Pipeline + Send + Sync>>;

/// The id the engines answer to (`"model"` in OpenAI requests; `"default"` works too).
pub const MODEL_ID: &str = "verdict";

fn absolute(path: &Path) -> Result<String> {
    let abs =
        std::fs::canonicalize(path).with_context(|| format!("cannot open {}", path.display()))?;
    Ok(abs.to_string_lossy().into_owned())
}

fn loader_for(source: &ModelSource) -> Result<Box<dyn Loader>> {
    // Absolute local paths keep mistral.rs off the hub: it only lists a model id remotely
    // when no such path exists.
    match source {
        ModelSource::Gguf(file) => {
            let dir = absolute(file.parent().unwrap_or(Path::new(".")))?;
            let name = file
                .file_name()
                .context("GGUF path has no file name")?
                .to_string_lossy()
                .into_owned();
            Ok(GGUFLoaderBuilder::new(
                None,
                None,
                dir,
                vec![name],
                GGUFSpecificConfig::default(),
                false,
                None,
            )
            .build())
        }
        ModelSource::Safetensors(dir) => NormalLoaderBuilder::new(
            NormalSpecificConfig::default(),
            None,
            None,
            Some(absolute(dir)?),
            false,
            None,
        )
        .build(None),
    }
}

/// Load one model as a mistral.rs pipeline on the CPU in f32 activations, a safetensors
/// model's linear layers quantized to `isq` as they load.
pub fn load_pipeline(source: &ModelSource, isq: Option<Isq>) -> Result<SharedPipeline> {
    if let (Some(isq), ModelSource::Gguf(file)) = (isq, source) {
        bail!(
            "models.isq = \"{isq}\" quantizes safetensors models as they load; {} is a GGUF file, quantized already",
            file.display()
        );
    }
    let kernels = crate::kernels::QuantKernel::instruction_set();
    match isq {
        Some(isq) => tracing::info!("loading {}, quantizing it to {isq} (CPU kernels: {kernels})", source.path().display()),
        None => tracing::info!("loading {} (CPU kernels: {kernels})", source.path().display()),
    }
    let start = Instant::now();
    let pipeline = loader_for(source)?
        .load_model_from_hf(
            None,
            TokenSource::None,
            &ModelDType::F32,
            &Device::Cpu,
            true,
            DeviceMapSetting::dummy(),
            isq.map(Isq::isq_type),
            None,
        )
        .with_context(|| format!("cannot load model {}", source.path().display()))?;
    tracing::info!(
        "loaded {} in {:.1}s",
        source.path().display(),
        start.elapsed().as_secs_f64()
    );
    Ok(pipeline)
}

/// The process's resident memory (Linux `VmRSS`), in MiB.
pub fn resident_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb / 1024.0)
}

/// Target and (when speculation is on) draft, loaded once and shared by every engine.
pub struct LoadedModels {
    pub target: SharedPipeline,
    pub target_source: ModelSource,
    pub target_fingerprint: ModelFingerprint,
    pub draft: Option<(SharedPipeline, ModelSource)>,
    pub draft_fingerprint: Option<ModelFingerprint>,
}

impl LoadedModels {
    /// The target, and the draft when speculation drafts with it.
    pub fn load(config: &Config) -> Result<Self> {
        let s = &config.speculative;
        Self::load_with_draft(config, s.enabled && s.proposer == ProposerKind::DraftModel)
    }

    /// The target, and `models.draft` when `with_draft` (an EAGLE head needs no draft model).
    pub fn load_with_draft(config: &Config, with_draft: bool) -> Result<Self> {
        let cache = cache_dir(config.models.cache_dir.as_deref());
        let target_source = resolve(&config.models.target, &cache).context("models.target")?;
        let draft_source = match (&config.models.draft, with_draft) {
            (Some(draft), true) => Some(resolve(draft, &cache).context("models.draft")?),
            (None, true) => bail!("drafting with a draft model needs models.draft in the config"),
            _ => None,
        };
        let target = load_pipeline(&target_source, config.models.isq)?;
        let draft = match draft_source {
            Some(source) => {
                let draft = load_pipeline(&source, config.models.isq)?;
                check_same_vocabulary(&target, &target_source, &draft, &source)?;
                Some((draft, source))
            }
            None => None,
        };
        let target_fingerprint = fingerprint(&target, &target_source)?;
        let draft_fingerprint = draft
            .as_ref()
            .map(|(pipeline, source)| fingerprint(pipeline, source))
            .transpose()?;
        if let Some(mib) = resident_mib() {
            tracing::info!("models loaded: the process holds {mib:.0} MiB resident");
        }
        Ok(Self {
            target,
            target_source,
            target_fingerprint,
            draft,
            draft_fingerprint,
        })
    }

    pub fn fingerprints(&self) -> LoadedFingerprints<'_> {
        LoadedFingerprints {
            target: &self.target_fingerprint,
            draft: self.draft_fingerprint.as_ref(),
            target_source: Some(&self.target_source),
        }
    }
}

/// Speculation needs one token space; say which models differ and how.
fn check_same_vocabulary(
    target: &SharedPipeline,
    target_source: &ModelSource,
    draft: &SharedPipeline,
    draft_source: &ModelSource,
) -> Result<()> {
    let vocab = |p: &SharedPipeline| p.blocking_lock().tokenizer().map(|t| t.get_vocab(true));
    let (t, d) = (vocab(target), vocab(draft));
    let (Some(t), Some(d)) = (t, d) else {
        bail!("speculative decoding needs tokenizers for both models");
    };
    if t != d {
        let shared = t.iter().filter(|(tok, id)| d.get(*tok) == Some(id)).count();
        bail!(
            "draft {} and target {} have different vocabularies ({} vs {} tokens, {} shared with the same id); speculative decoding needs the same tokenizer",
            draft_source.path().display(),
            target_source.path().display(),
            d.len(),
            t.len(),
            shared
        );
    }
    Ok(())
}

/// A built mistral.rs engine and, for speculative engines, its accept rule.
///
/// Engines built over one [`LoadedModels`] share the target's KV working cache. Use one at
/// a time, and [`Engine::settle`] it before the next one runs: mistral.rs answers a request
/// while its last step is still cutting back and moving caches.
pub struct Engine {
    pub mistralrs: Arc<MistralRs>,
    pub rule: Option<Arc<VerdictRule>>,
    /// What the engine thread steps; it holds the lock for a whole step.
    pipeline: SharedPipeline,
}

/// What a speculative engine is built from besides its models and its drafter.
pub struct SpeculativeSetup {
    /// Drafts per step, at most.
    pub gamma: usize,
    /// Decides which drafts are kept.
    pub stack: JudgeStack,
    /// Seeds the accept rule's sampler.
    pub seed: u64,
    /// Where steps, drafts and judges are counted.
    pub metrics: Arc<Metrics>,
    pub scheduling: Scheduling,
}

/// How an engine schedules requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduling {
    /// Sequences the scheduler runs at once.
    pub max_seqs: usize,
    /// Bytes of finished requests' KV caches kept for later requests that share their prefix
    /// (a system prompt, few-shot examples), least recently used evicted first; `None`: no
    /// prefix cache. One bound for every engine of the process, each held to it.
    pub prefix_cache_bytes: Option<usize>,
    /// Sequences of different lengths decode in one batch (`server.ragged_batches`). One
    /// switch for the whole process: the last engine built sets it.
    pub ragged_batches: bool,
}

impl From<usize> for Scheduling {
    /// `max_seqs` sequences at once of any lengths, no prefix cache.
    fn from(max_seqs: usize) -> Self {
        Self {
            max_seqs,
            prefix_cache_bytes: None,
            ragged_batches: true,
        }
    }
}

impl From<&ServerConfig> for Scheduling {
    fn from(server: &ServerConfig) -> Self {
        Self {
            max_seqs: server.max_seqs,
            prefix_cache_bytes: server.prefix_cache_bytes(),
            ragged_batches: server.ragged_batches,
        }
    }
}

async fn build_mistralrs(pipeline: Arc<Mutex<dyn Pipeline>>, scheduling: Scheduling) -> Arc<MistralRs> {
    // A hit restores the target's cache; a draft model then reads the whole prompt, and an
    // EAGLE head restores its own rows (`HeadPrefixCache`).
    if let Some(bytes) = scheduling.prefix_cache_bytes {
        mistralrs_core::set_cpu_prefix_cache_limit(Some(bytes));
    }
    mistralrs_core::set_ragged_decode_batches(scheduling.ragged_batches);
    build_mistralrs_with(pipeline, scheduling.max_seqs, scheduling.prefix_cache_bytes.is_some_and(|b| b > 0)).await
}

/// A mistral.rs engine over one pipeline. With `prefix_cache`, a request that shares a
/// prefix with an earlier one computes only the tokens after the shared part (mining
/// continues one prompt many times).
pub async fn build_mistralrs_with(
    pipeline: Arc<Mutex<dyn Pipeline>>,
    max_seqs: usize,
    prefix_cache: bool,
) -> Arc<MistralRs> {
    let method = DefaultSchedulerMethod::Fixed(NonZeroUsize::new(max_seqs.max(1)).unwrap());
    MistralRsBuilder::new(
        pipeline,
        SchedulerConfig::DefaultScheduler { method },
        false,
        None,
    )
    .with_model_id(MODEL_ID)
    .with_no_prefix_cache(!prefix_cache)
    .build()
    .await
}

impl Engine {
    /// Plain decoding with the target alone.
    pub async fn plain(models: &LoadedModels, scheduling: impl Into<Scheduling>) -> Self {
        let pipeline = models.target.clone();
        Self {
            mistralrs: build_mistralrs(pipeline.clone(), scheduling.into()).await,
            rule: None,
            pipeline,
        }
    }

    /// Wait until the step that answered the last request has ended and reported: its
    /// metrics are then recorded, and another engine over the same target may run.
    pub async fn settle(&self) {
        if let Some(rule) = &self.rule {
            rule.settle().await;
        }
        // The engine thread holds the pipeline for the whole of a step.
        drop(self.pipeline.lock().await);
    }

    /// Speculative decoding with the draft model drafting γ tokens a step.
    pub async fn speculative(models: &LoadedModels, setup: SpeculativeSetup) -> Result<Self> {
        Self::with_draft_model(models, setup, None).await
    }

    /// [`Self::speculative`] with `policy` (SV over the draft model) deciding how many of the
    /// γ drafts each step draws: see [`LoadedModels::draft_model_policy`].
    pub async fn speculative_under(models: &LoadedModels, policy: Arc<dyn Proposer>, setup: SpeculativeSetup) -> Result<Self> {
        Self::with_draft_model(models, setup, Some(policy)).await
    }

    async fn with_draft_model(models: &LoadedModels, setup: SpeculativeSetup, policy: Option<Arc<dyn Proposer>>) -> Result<Self> {
        let Some((draft, _)) = &models.draft else {
            bail!("speculative decoding needs models.draft");
        };
        let gamma = setup.gamma;
        Self::over_speculative(setup, |accept_rule| {
            let pipeline = SpeculativePipeline::new(models.target.clone(), draft.clone(), SpeculativeConfig { gamma, accept_rule })?;
            match policy {
                Some(policy) => pipeline.with_draft_policy(policy),
                None => Ok(pipeline),
            }
        })
        .await
    }

    /// Speculative decoding with drafts from `proposer` (an EAGLE head, prompt lookup, both):
    /// no draft model.
    pub async fn with_proposer(models: &LoadedModels, proposer: Arc<dyn Proposer>, setup: SpeculativeSetup) -> Result<Self> {
        setup.stack.check_drafts_without_model()?;
        let proposer: Arc<dyn Proposer> = Arc::new(TimedProposer::new(proposer, setup.metrics.clone()));
        let gamma = setup.gamma;
        Self::over_speculative(setup, |accept_rule| {
            SpeculativePipeline::with_proposer(models.target.clone(), proposer, SpeculativeConfig { gamma, accept_rule })
        })
        .await
    }

    /// An engine over the speculative pipeline `build` makes around a Verdict rule.
    async fn over_speculative(
        setup: SpeculativeSetup,
        build: impl FnOnce(Option<Arc<dyn AcceptRule>>) -> candle_core::Result<SpeculativePipeline>,
    ) -> Result<Self> {
        let rule = Arc::new(VerdictRule::new(setup.stack, setup.seed, setup.metrics));
        let pipeline: SharedPipeline = Arc::new(Mutex::new(build(Some(rule.clone()))?));
        Ok(Self {
            mistralrs: build_mistralrs(pipeline.clone(), setup.scheduling).await,
            rule: Some(rule),
            pipeline,
        })
    }
}

/// A prompt: a chat turn (the model's chat template applies), raw text, or token ids
/// (continuing a chat-templated prompt from any point, as mining does).
#[derive(Clone, Debug)]
pub enum Prompt {
    /// One user turn, through the chat template.
    Chat(String),
    /// A conversation of (role, content) turns, through the chat template.
    Messages(Vec<(String, String)>),
    Text(String),
    Tokens(Vec<u32>),
}

/// A chat turn as mistral.rs takes chat messages.
pub fn chat_turn(role: &str, text: &str) -> IndexMap<String, mistralrs_core::MessageContent> {
    let mut turn = IndexMap::new();
    turn.insert("role".to_string(), Either::Left(role.to_string()));
    turn.insert("content".to_string(), Either::Left(text.to_string()));
    turn
}

/// One user turn, as mistral.rs takes chat messages.
pub fn user_turn(text: &str) -> IndexMap<String, mistralrs_core::MessageContent> {
    chat_turn("user", text)
}

/// A conversation of (role, content) turns as the engine's chat template renders it for the
/// model, generation prompt added: the tokens a chat request's prompt is.
pub async fn chat_tokens(mistralrs: &MistralRs, turns: &[(String, String)]) -> Result<Vec<u32>> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let request = mistralrs_core::Request::Tokenize(mistralrs_core::TokenizationRequest {
        text: Either::Left(turns.iter().map(|(role, text)| chat_turn(role, text)).collect()),
        tools: None,
        add_generation_prompt: true,
        add_special_tokens: true,
        enable_thinking: None,
        reasoning_effort: None,
        response: tx,
    });
    mistralrs.get_sender(None)?.send(request).await?;
    rx.recv().await.context("the engine dropped the tokenization request")?
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    pub finish_reason: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Wall clock of the whole request, prompt processing included.
    pub seconds: f64,
    /// The engine's own timing of the prompt and of the completion tokens.
    pub prompt_seconds: f64,
    pub completion_seconds: f64,
    /// Per generated token, when asked for: its text and the best candidates as
    /// (token id, text, score), the score being the target's log-probability (natural log,
    /// before temperature, as the patched mistral.rs reports it), so two scores differ as their logits do.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub top_tokens: Vec<(String, Vec<Candidate>)>,
}

/// A candidate token at one position: (token id, text, score).
pub type Candidate = (u32, String, f32);

pub fn sampling_params(sampling: &SamplingConfig) -> SamplingParams {
    SamplingParams {
        // mistral.rs treats a missing temperature as 1.0; below 1e-7 it decodes greedily.
        temperature: Some(sampling.temperature),
        top_k: sampling.top_k,
        top_p: sampling.top_p,
        max_len: Some(sampling.max_tokens),
        ..SamplingParams::neutral()
    }
}

/// Run one request to completion.
pub async fn generate(
    mistralrs: &MistralRs,
    prompt: &Prompt,
    sampling: &SamplingConfig,
) -> Result<Generation> {
    generate_with_top_tokens(mistralrs, prompt, sampling, 0).await
}

/// [`generate`], also returning the `top_n` best candidates at every generated token.
pub async fn generate_with_top_tokens(
    mistralrs: &MistralRs,
    prompt: &Prompt,
    sampling: &SamplingConfig,
    top_n: usize,
) -> Result<Generation> {
    let message = match prompt {
        Prompt::Chat(text) => RequestMessage::Chat {
            messages: vec![user_turn(text)],
            enable_thinking: None,
            reasoning_effort: None,
        },
        Prompt::Messages(turns) => RequestMessage::Chat {
            messages: turns.iter().map(|(role, text)| chat_turn(role, text)).collect(),
            enable_thinking: None,
            reasoning_effort: None,
        },
        Prompt::Text(text) => RequestMessage::Completion {
            text: text.clone(),
            echo_prompt: false,
            best_of: None,
        },
        Prompt::Tokens(tokens) => RequestMessage::CompletionTokens(tokens.clone()),
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let mut params = sampling_params(sampling);
    params.top_n_logprobs = top_n;
    let mut request =
        NormalRequest::new_simple(message, params, tx, mistralrs.next_request_id(), None, None);
    request.return_logprobs = top_n > 0;
    let start = Instant::now();
    mistralrs
        .get_sender(None)?
        .send(Request::Normal(Box::new(request)))
        .await
        .context("the engine stopped")?;
    let response = rx.recv().await.context("the engine dropped the request")?;
    let seconds = start.elapsed().as_secs_f64();
    let (text, finish_reason, usage, logprobs) = match response {
        Response::Done(r) => {
            let choice = r
                .choices
                .into_iter()
                .next()
                .context("no choice in response")?;
            (
                choice.message.content.unwrap_or_default(),
                choice.finish_reason,
                r.usage,
                choice.logprobs,
            )
        }
        Response::CompletionDone(r) => {
            let choice = r
                .choices
                .into_iter()
                .next()
                .context("no choice in response")?;
            (choice.text, choice.finish_reason, r.usage, choice.logprobs)
        }
        Response::InternalError(e) | Response::ValidationError(e) => bail!("request failed: {e}"),
        Response::ModelError(e, _) | Response::CompletionModelError(e, _) => {
            bail!("model error: {e}")
        }
        _ => bail!("unexpected response kind"),
    };
    Ok(Generation {
        text,
        finish_reason,
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
        seconds,
        prompt_seconds: usage.total_prompt_time_sec as f64,
        completion_seconds: usage.total_completion_time_sec as f64,
        top_tokens: logprobs
            .and_then(|l| l.content)
            .unwrap_or_default()
            .into_iter()
            .map(|t| {
                let top = t
                    .top_logprobs
                    .into_iter()
                    .map(|c| (c.token, c.bytes.unwrap_or_default(), c.logprob))
                    .collect();
                (t.token, top)
            })
            .collect(),
    })
}
