//! The TOML configuration: models, speculative decoding, sampling, server, SV, judges.
//!
//! Unknown keys are errors (mistral.rs silently ignores them; a typo in a verifier's
//! threshold must not silently run the default).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use verdict_heads::WeightFormat;

use crate::{
    judges::{parse_stack, JudgeConfig},
    rules::BaseRule,
    verify_latency::VerifyLatency,
};

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub models: ModelsConfig,
    #[serde(default)]
    pub speculative: SpeculativeConfig,
    #[serde(default)]
    pub sampling: SamplingConfig,
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub sv: SvConfig,
    /// `[[judge]]` tables, applied in this order: the stack `serve` and `generate` run.
    #[serde(default, rename = "judge")]
    pub judges: Vec<JudgeConfig>,
    /// `[[stack]]` tables: named judge stacks `verdict bench --modes` can compare.
    #[serde(default, rename = "stack")]
    pub stacks: Vec<StackConfig>,
    /// `[[mode]]` tables: bench modes by name, each spelled out (what drafts, with which
    /// head and options, under which stack); `verdict bench --modes` lists their names.
    #[serde(default, rename = "mode")]
    pub modes: Vec<ModeConfig>,
    /// The config file's folder; head paths are relative to it.
    #[serde(skip, default = "current_dir")]
    pub base_dir: PathBuf,
}

/// A named bench mode: `[[mode]]` with `name`, `proposer`, and optionally `head`, `stack`
/// and `options`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModeConfig {
    pub name: String,
    /// What drafts: one of [`MODE_PROPOSERS`].
    pub proposer: String,
    /// The EAGLE head, by its `speculative.eagle_heads` name (default: `eagle_head`).
    pub head: Option<String>,
    /// The judge stack: `exact`, `rejection`, `config` or a `[[stack]]` name (default
    /// `exact`; ignored by `plain`).
    pub stack: Option<String>,
    /// How the EAGLE head drafts, as the bench's mode options: `"sv"`, `"q4k"`, `"g6"`, …
    #[serde(default)]
    pub options: Vec<String>,
}

/// What a `[[mode]]` may draft with: the target alone, the draft model (optionally under
/// SV), the EAGLE head, prompt lookup, or prompt lookup with the head.
pub const MODE_PROPOSERS: &[&str] = &["plain", "draft-model", "draft-model-sv", "eagle", "ngram", "ngram+eagle"];

fn current_dir() -> PathBuf {
    PathBuf::from(".")
}

/// A named judge stack: `[[stack]]` with `name`, an optional `base_rule` and `[[stack.judge]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StackConfig {
    pub name: String,
    /// Defaults to `speculative.base_rule`.
    pub base_rule: Option<BaseRule>,
    #[serde(default, rename = "judge")]
    pub judges: Vec<JudgeConfig>,
}

/// Names the bench gives its built-in modes (plain decoding, plain decoding once more, the
/// lossless rules, the top-level judges): no `[[stack]]` or `[[mode]]` may take one.
pub const RESERVED_MODE_NAMES: &[&str] = &["plain", "plain-again", "exact", "rejection", "config"];

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// A model name known to `verdict fetch-models`, a `.gguf` file, or a safetensors folder.
    pub target: String,
    /// Same forms as `target`; required when speculative decoding is enabled.
    pub draft: Option<String>,
    /// Where fetched models are cached; defaults to `$VERDICT_CACHE` or `~/.cache/verdict`.
    pub cache_dir: Option<PathBuf>,
    /// Quantize safetensors models' linear layers as they load (mistral.rs's in-situ
    /// quantization), so they run on the same quantized CPU kernels as a GGUF. GGUF files
    /// are quantized already and refuse it.
    pub isq: Option<Isq>,
}

/// The in-situ quantizations `models.isq` offers: the block formats of the default GGUFs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum Isq {
    /// 4-bit super-blocks of 256 values (the width of every quantized matrix must divide by 256).
    #[serde(rename = "q4k")]
    Q4K,
    /// 6-bit super-blocks of 256 values.
    #[serde(rename = "q6k")]
    Q6K,
    /// 8-bit blocks of 32 values.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl Isq {
    pub fn isq_type(self) -> mistralrs_core::IsqType {
        match self {
            Isq::Q4K => mistralrs_core::IsqType::Q4K,
            Isq::Q6K => mistralrs_core::IsqType::Q6K,
            Isq::Q8_0 => mistralrs_core::IsqType::Q8_0,
        }
    }
}

impl std::fmt::Display for Isq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Isq::Q4K => "q4k",
            Isq::Q6K => "q6k",
            Isq::Q8_0 => "q8_0",
        })
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    pub enabled: bool,
    /// Tokens drafted per step (γ); the target scores γ + 1 positions.
    pub gamma: usize,
    pub base_rule: BaseRule,
    /// Seed of the accept rule's random draws (draft sampling, rejection tests).
    pub seed: u64,
    /// What drafts: `models.draft`, or the EAGLE-3 head in `eagle_head`.
    pub proposer: ProposerKind,
    /// An EAGLE-3 head folder (`config.json` + `model.safetensors`), relative to the config
    /// file. Needed by `proposer = "eagle"` and by the bench's `eagle:` modes.
    pub eagle_head: Option<PathBuf>,
    /// Other heads for the same target, by name (`eagle_heads = { general = "…" }`), that
    /// bench modes pick with `eagle@<name>:<stack>` to compare heads in one run.
    pub eagle_heads: BTreeMap<String, PathBuf>,
    /// How the head keeps its matrices while drafting: "f32" (as trained), "q8_0" or "q4k".
    pub eagle_weights: WeightFormat,
    /// The head stops drafting before a draft it gives less than this probability (the first
    /// draft is always made): a step verifies up to γ drafts, fewer where they are unlikely
    /// to be kept. 0 drafts γ every step.
    pub eagle_min_confidence: f32,
    /// The head drafts nothing, and the step decodes one token, when it gives its first
    /// draft less than this probability: a one-row verify costs less than a two-row one, so
    /// unlikely first drafts do not pay for theirs. 0 always drafts.
    pub eagle_min_first_confidence: f32,
    /// The sequences of a batched step draft in one head forward per draft position (and
    /// take their verified rows in one); false drafts one sequence after another.
    pub eagle_batched_drafting: bool,
    /// A batched verify runs the target's MLPs and LM head on each sequence's own rows only
    /// (the patched mistral.rs Llama and Qwen2 forwards), so SV prices rows one by one; false
    /// pads every sequence's rows to the widest, and SV chooses one width for the batch.
    pub packed_verify_rows: bool,
    /// Prompt lookup (`proposer = "ngram"`, bench `ngram:` modes): the shortest n-gram whose
    /// earlier occurrence is drafted from.
    pub ngram_min: usize,
    /// ... and the longest, tried first.
    pub ngram_max: usize,
    /// The most drafts a lookup proposal holds (its drafts cost no model call, and copied
    /// text runs long).
    pub ngram_gamma: usize,
}

/// How the EAGLE head drafts: its matrices, up to how many drafts a step, and where it stops.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EagleDrafting {
    pub weights: WeightFormat,
    pub gamma: usize,
    pub min_confidence: f32,
    pub min_first_confidence: f32,
    /// SV's goodput decides how many drafts are verified (`[sv]`): a batched verify takes
    /// the drafts worth their rows, a sequence alone drafts while one more pays.
    pub sv: bool,
    /// With `sv`: SV prices drafts by the keep rates learned while decoding
    /// (`sv.learn_keep_rates`), not by the head's confidence.
    pub learn_keep_rates: bool,
    /// With `sv`: SV prices verify rows by T_v learned from this machine's steps
    /// (`sv.learn_verify_ms`), starting from `sv.verify_ms`.
    pub learn_verify_ms: bool,
    /// A batched step's sequences draft in one head forward per draft position.
    pub batched: bool,
    /// A batched verify feeds each sequence's own rows only (`packed_verify_rows`).
    pub packed: bool,
}

impl Config {
    /// How the EAGLE head drafts, as `[speculative]` and `[sv]` say.
    pub fn eagle_drafting(&self) -> EagleDrafting {
        let s = &self.speculative;
        EagleDrafting {
            weights: s.eagle_weights,
            gamma: s.gamma,
            min_confidence: s.eagle_min_confidence,
            min_first_confidence: s.eagle_min_first_confidence,
            sv: self.sv.enabled,
            learn_keep_rates: self.sv.learns_keep_rates(self.judges.iter().any(|j| j.enabled)),
            learn_verify_ms: self.sv.learns_verify_ms(),
            batched: s.eagle_batched_drafting,
            packed: s.packed_verify_rows,
        }
    }
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            gamma: 4,
            base_rule: BaseRule::Exact,
            seed: 0,
            proposer: ProposerKind::DraftModel,
            eagle_head: None,
            eagle_heads: BTreeMap::new(),
            eagle_weights: WeightFormat::F32,
            eagle_min_confidence: 0.0,
            eagle_min_first_confidence: 0.0,
            eagle_batched_drafting: true,
            packed_verify_rows: true,
            ngram_min: 2,
            ngram_max: 4,
            ngram_gamma: 8,
        }
    }
}

/// `[sv]`: Speculative Verification's schedule in batched steps. Each step of several
/// sequences sends the target only the drafts whose expected kept tokens pay for their
/// verify rows, judged by the EAGLE head's own confidence (the head is its own companion).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SvConfig {
    pub enabled: bool,
    /// T_v: `[rows, milliseconds]` of the target's verify forward on this machine, as
    /// `verdict forward-cost --tokens 1,5,8,16,24,32` measures it. With
    /// `learn_verify_ms`, where learning starts (empty: a generic CPU shape).
    pub verify_ms: Vec<(usize, f64)>,
    /// Learn T_v from the steps this machine runs, starting from `verify_ms` (default: learn
    /// when `verify_ms` is empty, else use it as given).
    pub learn_verify_ms: Option<bool>,
    /// Where T_v learned on this machine is kept (relative to the config file): learning
    /// starts from it when it was learned for this target on this machine, and it is saved
    /// every 64 timed steps, when the engine lets go of the head and when `verdict serve`
    /// stops on a signal. Unset: every run learns afresh.
    pub learned_verify_ms_file: Option<PathBuf>,
    /// Milliseconds a step costs besides its verify (drafting), added to every T_v.
    pub fixed_ms: f64,
    /// Count the token every verify yields besides the kept drafts in goodput (the knob
    /// `count_bonus_token` of the SV spec; default true here).
    #[serde(default = "yes")]
    pub count_bonus: bool,
    /// Drafts every sequence verifies at least, where it has them.
    pub min_gamma: usize,
    /// The acceptance table `train-head sv-profile` fitted for the head (relative to the
    /// config file): the chance the target keeps a draft of each confidence. Without it,
    /// the head's confidence is taken as that chance.
    pub table: Option<PathBuf>,
    /// Learn that chance while decoding, from the drafts already verified under the running
    /// judge stack (a lossy stack keeps more than the target's own choice). Not with `table`.
    /// Default: with SV on, learn under a stack with an enabled judge (the head's confidence
    /// says how often the target agrees, which undervalues drafts a judge keeps), unless
    /// `table` is given; not under a lossless one.
    pub learn_keep_rates: Option<bool>,
    /// How many drafts the head's own confidence counts as in each learned bin (default 50).
    pub keep_rate_prior_weight: Option<f64>,
}

/// Drafts the head's confidence counts as in each learned bin, unless configured.
pub const DEFAULT_KEEP_RATE_PRIOR_WEIGHT: f64 = 50.0;

fn yes() -> bool {
    true
}

impl SvConfig {
    /// Whether SV learns keep rates under a stack that is `lossy` (has an enabled judge) or
    /// not: as `learn_keep_rates` says, by default with SV on under a lossy stack without a
    /// `table`.
    pub fn learns_keep_rates(&self, lossy: bool) -> bool {
        self.learn_keep_rates.unwrap_or(self.learns_keep_rates_by_default(self.enabled, lossy))
    }

    /// The default of `learn_keep_rates` where SV is `sv` (on or off) and the stack `lossy`.
    pub fn learns_keep_rates_by_default(&self, sv: bool, lossy: bool) -> bool {
        sv && lossy && self.table.is_none()
    }

    /// Whether SV learns T_v while decoding (`learn_verify_ms`, by default when no
    /// `verify_ms` is given).
    pub fn learns_verify_ms(&self) -> bool {
        self.learn_verify_ms.unwrap_or(self.verify_ms.is_empty())
    }

    /// With `[sv]` on: `fixed_ms` a finite number ≥ 0, and T_v readable from `verify_ms`
    /// (or learned from the generic shape).
    fn validate(&self) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        self.checked_fixed_ms()?;
        self.configured_latency().map(drop)
    }

    /// `fixed_ms`, refused unless it is a finite number ≥ 0 (a bench mode may turn SV on
    /// over a config that has it off, so the budget checks it too).
    pub fn checked_fixed_ms(&self) -> Result<f64> {
        if !(self.fixed_ms >= 0.0 && self.fixed_ms.is_finite()) {
            bail!("sv.fixed_ms must be a finite number >= 0, got {}", self.fixed_ms);
        }
        Ok(self.fixed_ms)
    }

    /// T_v as configured: `verify_ms` fitted, or, with none given and learning on, the
    /// generic shape learning starts from.
    pub fn configured_latency(&self) -> Result<VerifyLatency> {
        if self.verify_ms.is_empty() && self.learns_verify_ms() {
            return Ok(VerifyLatency::generic_prior());
        }
        VerifyLatency::fit(&self.verify_ms).with_context(|| {
            format!(
                "sv.verify_ms = {:?}: give [rows, milliseconds] pairs of the verify forward, e.g. from `verdict forward-cost`, or leave it out and set sv.learn_verify_ms = true",
                self.verify_ms
            )
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProposerKind {
    /// A second, smaller model with the target's tokenizer (`models.draft`).
    DraftModel,
    /// An EAGLE-3 head drafting from the target's own hidden states; no draft model loads.
    Eagle,
    /// Prompt lookup: the continuation of the longest recent n-gram match in the text so
    /// far; no model call, no draft model.
    Ngram,
    /// Prompt lookup and the EAGLE head, each step taking the proposal worth most.
    #[serde(rename = "ngram+eagle")]
    NgramEagle,
}

#[derive(Clone, Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingConfig {
    /// 0 decodes greedily.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub max_tokens: usize,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            max_tokens: 256,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    /// Sequences the scheduler runs at once.
    pub max_seqs: usize,
    /// MiB of finished requests' KV caches kept for later requests that share their prefix
    /// (0: no prefix cache).
    pub prefix_cache_mb: usize,
    /// Decode sequences of different lengths in one batch, each with its own KV length.
    /// Off: only sequences of one length decode together (mistral.rs upstream), so
    /// concurrent requests take turns; turn it off for a model with sliding-window KV caches.
    pub ragged_batches: bool,
    /// Every route but `/health` requires `Authorization: Bearer <key>` (also from
    /// `$VERDICT_API_KEY`, which wins). Unset: no key.
    pub api_key: Option<String>,
    /// Origins browsers may call the server from (CORS); empty: none.
    pub cors_origins: Vec<String>,
    /// The largest request body, in bytes.
    pub max_request_bytes: usize,
    /// The most tokens a request may ask for (`max_tokens`).
    pub max_tokens_limit: usize,
    /// The most stop sequences a request may give.
    pub max_stop_sequences: usize,
    /// Seconds a client has to send its request headers, and its body.
    pub request_read_seconds: u64,
    /// Seconds a kept-alive connection may sit idle between requests.
    pub idle_seconds: u64,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// On SIGTERM or Ctrl-C, seconds requests in flight have to finish.
    pub shutdown_grace_seconds: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 8080,
            max_seqs: 4,
            prefix_cache_mb: 1024,
            ragged_batches: true,
            api_key: None,
            cors_origins: Vec::new(),
            max_request_bytes: 1 << 20,
            max_tokens_limit: 4096,
            max_stop_sequences: 4,
            request_read_seconds: 10,
            idle_seconds: 60,
            max_connections: 64,
            shutdown_grace_seconds: 30,
        }
    }
}

impl ServerConfig {
    /// The prefix cache's bound in bytes, `None` when it is off.
    pub fn prefix_cache_bytes(&self) -> Option<usize> {
        (self.prefix_cache_mb > 0).then_some(self.prefix_cache_mb << 20)
    }
}

impl Config {
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Config = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        let mut config =
            Self::from_toml(&text).with_context(|| format!("invalid config {}", path.display()))?;
        config.base_dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(current_dir, Path::to_path_buf);
        Ok(config)
    }

    /// The EAGLE head's folder, resolved against the config file's folder.
    pub fn eagle_head(&self) -> Option<PathBuf> {
        self.speculative.eagle_head.as_ref().map(|p| self.base_dir.join(p))
    }

    /// The folder of the head `eagle_heads` names `name` (resolved as `eagle_head` is), or
    /// `eagle_head` itself for `None`.
    pub fn eagle_head_named(&self, name: Option<&str>) -> Result<PathBuf> {
        match name {
            None => self.eagle_head().context("drafting with an EAGLE head needs speculative.eagle_head in the config"),
            Some(name) => match self.speculative.eagle_heads.get(name) {
                Some(path) => Ok(self.base_dir.join(path)),
                None => bail!(
                    "no EAGLE head named {name:?}: speculative.eagle_heads has {}",
                    match self.speculative.eagle_heads.is_empty() {
                        true => "none".to_string(),
                        false => self.speculative.eagle_heads.keys().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", "),
                    }
                ),
            },
        }
    }

    pub fn validate(&self) -> Result<()> {
        let s = &self.speculative;
        if s.gamma == 0 {
            bail!("speculative.gamma must be at least 1 (tokens drafted per step), got 0");
        }
        if s.gamma > 32 {
            bail!(
                "speculative.gamma = {} is out of range; use 1..=32",
                s.gamma
            );
        }
        if !(0.0..1.0).contains(&s.eagle_min_confidence) {
            bail!(
                "speculative.eagle_min_confidence = {} is out of range; use 0 (draft γ every step) up to below 1",
                s.eagle_min_confidence
            );
        }
        if !(0.0..1.0).contains(&s.eagle_min_first_confidence) {
            bail!(
                "speculative.eagle_min_first_confidence = {} is out of range; use 0 (always draft) up to below 1",
                s.eagle_min_first_confidence
            );
        }
        match s.proposer {
            ProposerKind::DraftModel if s.enabled && self.models.draft.is_none() => bail!(
                "speculative.enabled = true needs models.draft (or proposer = \"eagle\" with eagle_head, or proposer = \"ngram\"); set it or disable speculation"
            ),
            ProposerKind::Eagle | ProposerKind::NgramEagle if s.eagle_head.is_none() => bail!(
                "speculative.proposer = \"eagle\" or \"ngram+eagle\" needs speculative.eagle_head, the head's folder"
            ),
            _ => {}
        }
        if let Some(bad) = s.eagle_heads.keys().find(|name| name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')) {
            bail!("speculative.eagle_heads: the name {bad:?} is not letters, digits and '_' (bench modes name it as eagle@<name>:<stack>)");
        }
        if !(1..=32).contains(&s.ngram_gamma) {
            bail!("speculative.ngram_gamma = {} is out of range; use 1..=32", s.ngram_gamma);
        }
        if s.ngram_min < 1 || s.ngram_min > s.ngram_max || s.ngram_max > 64 {
            bail!(
                "speculative.ngram_min = {} and ngram_max = {}: need 1 <= ngram_min <= ngram_max <= 64",
                s.ngram_min,
                s.ngram_max
            );
        }
        self.sv.validate()?;
        let t = &self.sampling;
        if !(t.temperature >= 0.0 && t.temperature.is_finite()) {
            bail!(
                "sampling.temperature must be a finite number >= 0, got {}",
                t.temperature
            );
        }
        if let Some(p) = t.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("sampling.top_p must be in (0, 1], got {p}");
            }
        }
        if t.top_k == Some(0) {
            bail!("sampling.top_k must be at least 1, got 0");
        }
        if t.max_tokens == 0 {
            bail!("sampling.max_tokens must be at least 1, got 0");
        }
        let server = &self.server;
        for (key, value) in [
            ("max_request_bytes", server.max_request_bytes),
            ("max_tokens_limit", server.max_tokens_limit),
            ("request_read_seconds", server.request_read_seconds as usize),
            ("idle_seconds", server.idle_seconds as usize),
            ("max_connections", server.max_connections),
        ] {
            if value == 0 {
                bail!("server.{key} must be at least 1, got 0");
            }
        }
        if server.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            bail!("server.api_key is empty: give a key, or remove the line to serve without one");
        }
        if self.server.max_seqs == 0 {
            bail!("server.max_seqs must be at least 1, got 0");
        }
        parse_stack(&self.judges, "judge")?;
        let mut seen = std::collections::HashSet::new();
        for (i, stack) in self.stacks.iter().enumerate() {
            if RESERVED_MODE_NAMES.contains(&stack.name.as_str()) {
                bail!(
                    "stack[{i}].name = {:?} is reserved; pick another name",
                    stack.name
                );
            }
            if !seen.insert(stack.name.as_str()) {
                bail!("stack[{i}].name = {:?} is used twice", stack.name);
            }
            parse_stack(&stack.judges, &format!("stack[{i}].judge"))?;
        }
        self.validate_modes()
    }

    /// `[[mode]]` tables: unique names that are no built-in mode or stack, a known proposer,
    /// a head that exists, a stack that exists, options only where a head drafts.
    fn validate_modes(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for (i, mode) in self.modes.iter().enumerate() {
            let at = format!("mode[{i}] ({:?})", mode.name);
            if mode.name.is_empty() || mode.name.contains([',', ' ']) {
                bail!("{at}: a mode name is not empty and has no commas or spaces (--modes lists names)");
            }
            if RESERVED_MODE_NAMES.contains(&mode.name.as_str()) || self.stacks.iter().any(|s| s.name == mode.name) {
                bail!("{at}: the name is a built-in mode or a [[stack]]'s; pick another");
            }
            if !seen.insert(mode.name.as_str()) {
                bail!("{at}: the name is used twice");
            }
            if !MODE_PROPOSERS.contains(&mode.proposer.as_str()) {
                bail!("{at}: proposer = {:?} is not one of {}", mode.proposer, MODE_PROPOSERS.join(", "));
            }
            let drafts_with_head = mode.proposer.ends_with("eagle");
            if let Some(head) = &mode.head {
                if !drafts_with_head {
                    bail!("{at}: head = {head:?}, but proposer {:?} drafts with no EAGLE head", mode.proposer);
                }
                if !self.speculative.eagle_heads.contains_key(head) {
                    let known: Vec<&String> = self.speculative.eagle_heads.keys().collect();
                    bail!("{at}: head = {head:?} is not in speculative.eagle_heads (known: {known:?})");
                }
            } else if drafts_with_head && self.speculative.eagle_head.is_none() {
                bail!("{at}: proposer {:?} needs a head: set head, or speculative.eagle_head", mode.proposer);
            }
            if !mode.options.is_empty() && !drafts_with_head {
                bail!("{at}: options {:?} are the EAGLE head's; proposer {:?} has none", mode.options, mode.proposer);
            }
            if let Some(bad) = mode.options.iter().find(|o| o.is_empty() || o.contains([':', '-', '@'])) {
                bail!("{at}: option {bad:?} is one word such as \"sv\" or \"q4k\"");
            }
            if let Some(stack) = &mode.stack {
                let known = ["exact", "rejection", "config"].contains(&stack.as_str()) || self.stacks.iter().any(|s| &s.name == stack);
                if !known {
                    bail!("{at}: stack = {stack:?} is neither exact, rejection, config nor a [[stack]] name");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bad `[[mode]]` tables are refused, naming the mode and the bad value.
    #[test]
    fn bad_mode_tables_are_refused_by_name() {
        let base = "[models]\ntarget = \"t\"\n[speculative]\nproposer = \"ngram\"\neagle_heads = { general = \"g\" }\n[[stack]]\nname = \"lenient\"\n";
        let refused = |mode: &str, named: &[&str]| {
            let err = format!("{:#}", Config::from_toml(&format!("{base}[[mode]]\n{mode}")).unwrap_err());
            for n in named {
                assert!(err.contains(n), "{mode}: {err}");
            }
        };
        refused("name = \"m\"\nproposer = \"medusa\"", &["mode[0] (\"m\")", "\"medusa\"", "ngram+eagle"]);
        refused("name = \"m\"\nproposer = \"eagle\"\nhead = \"nope\"", &["\"nope\"", "eagle_heads"]);
        refused("name = \"m\"\nproposer = \"eagle\"", &["needs a head"]);
        refused("name = \"m\"\nproposer = \"ngram\"\nhead = \"general\"", &["drafts with no EAGLE head"]);
        refused("name = \"m\"\nproposer = \"ngram\"\noptions = [\"sv\"]", &["[\"sv\"]"]);
        refused("name = \"m\"\nproposer = \"ngram\"\nstack = \"strict\"", &["\"strict\""]);
        refused("name = \"exact\"\nproposer = \"ngram\"", &["built-in"]);
        refused("name = \"lenient\"\nproposer = \"ngram\"", &["[[stack]]"]);
        refused("name = \"a,b\"\nproposer = \"ngram\"", &["commas"]);
        refused("name = \"m\"\nproposer = \"eagle\"\nhead = \"general\"\noptions = [\"g-6\"]", &["\"g-6\""]);
        refused("name = \"m\"\nproposer = \"ngram\"\n[[mode]]\nname = \"m\"\nproposer = \"ngram\"", &["mode[1]", "twice"]);
        let fine = format!("{base}[[mode]]\nname = \"m\"\nproposer = \"eagle\"\nhead = \"general\"\nstack = \"lenient\"\noptions = [\"sv\"]");
        assert_eq!(Config::from_toml(&fine).unwrap().modes[0].name, "m");
    }

    /// Every config the repository ships parses, its judges and stacks checked.
    #[test]
    fn shipped_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut parsed = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Config::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                parsed += 1;
            }
        }
        assert!(parsed >= 2, "no configs found in {}", dir.display());
    }

    const MINIMAL: &str = "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n";

    fn error_of(text: &str) -> String {
        format!("{:#}", Config::from_toml(text).unwrap_err())
    }

    #[test]
    fn named_heads_resolve_against_the_config_folder_and_unknown_names_list_the_known() {
        let config = Config::from_toml(
            "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\neagle_heads = { general = \"../g\", gsm8k_2 = \"k\" }\n",
        )
        .unwrap();
        assert_eq!(config.eagle_head_named(Some("general")).unwrap(), config.base_dir.join("../g"));
        assert_eq!(config.eagle_head_named(None).unwrap(), config.base_dir.join("h"));
        let err = format!("{:#}", config.eagle_head_named(Some("coder")).unwrap_err());
        assert!(err.contains("\"coder\"") && err.contains("\"general\", \"gsm8k_2\""), "{err}");
        let err = error_of("[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"ngram\"\neagle_heads = { \"a-b\" = \"g\" }\n");
        assert!(err.contains("\"a-b\"") && err.contains("eagle@<name>"), "{err}");
    }

    #[test]
    fn defaults_fill_every_optional_section() {
        let config = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(config.speculative.gamma, 4);
        assert_eq!(config.speculative.base_rule, BaseRule::Exact);
        assert_eq!(config.server.host.to_string(), "127.0.0.1");
        assert!(config.judges.is_empty());
    }

    #[test]
    fn unknown_key_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculative]\ngama = 3\n"));
        assert!(err.contains("unknown field `gama`"), "{err}");
    }

    #[test]
    fn unknown_section_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculation]\ngamma = 3\n"));
        assert!(err.contains("unknown field `speculation`"), "{err}");
    }

    /// SV learns keep rates by default under a lossy stack (an enabled judge), where the
    /// head's confidence undervalues what the judges keep; not under a lossless stack, not
    /// without SV, not with an acceptance table, and never against an explicit setting.
    #[test]
    fn keep_rates_are_learned_by_default_under_a_lossy_stack() {
        let eagle = "[models]\ntarget = \"t.gguf\"\n[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n";
        let learns = |sv: &str, judges: &str| Config::from_toml(&format!("{eagle}[sv]\n{sv}\n{judges}")).unwrap().eagle_drafting().learn_keep_rates;
        let fsd = "[[judge]]\nkind = \"fsd\"\nthreshold = 0.5\n";
        assert!(learns("enabled = true", fsd));
        assert!(!learns("enabled = true", ""), "lossless");
        assert!(!learns("enabled = true", &format!("{fsd}enabled = false\n")), "its only judge disabled");
        assert!(!learns("", fsd), "no SV");
        assert!(!learns("enabled = true\ntable = \"t.json\"", fsd), "an acceptance table");
        assert!(!learns("enabled = true\nlearn_keep_rates = false", fsd));
        assert!(learns("enabled = true\nlearn_keep_rates = true", ""));
    }

    #[test]
    fn eagle_proposer_needs_a_head_and_no_draft() {
        let target_only = "[models]\ntarget = \"t.gguf\"\n";
        let err = error_of(&format!("{target_only}[speculative]\nproposer = \"eagle\"\n"));
        assert!(err.contains("speculative.eagle_head"), "{err}");
        let config =
            Config::from_toml(&format!("{target_only}[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\n")).unwrap();
        assert_eq!(config.speculative.proposer, ProposerKind::Eagle);
        let err = error_of(&format!("{target_only}[speculative]\nproposer = \"medusa\"\n"));
        assert!(err.contains("unknown variant `medusa`"), "{err}");
        assert_eq!(config.speculative.eagle_weights, WeightFormat::F32);
        let err = error_of(&format!("{target_only}[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\neagle_weights = \"q5\"\n"));
        assert!(err.contains("unknown variant `q5`") && err.contains("q8_0"), "{err}");
        let err = error_of(&format!("{target_only}[speculative]\nproposer = \"eagle\"\neagle_head = \"h\"\neagle_min_confidence = 1.5\n"));
        assert!(err.contains("speculative.eagle_min_confidence = 1.5"), "{err}");
    }

    #[test]
    fn gamma_zero_is_refused() {
        let err = error_of(&format!("{MINIMAL}[speculative]\ngamma = 0\n"));
        assert!(
            err.contains("speculative.gamma must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn unknown_base_rule_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculative]\nbase_rule = \"greedy\"\n"));
        assert!(err.contains("unknown variant `greedy`"), "{err}");
    }

    #[test]
    fn speculation_without_draft_is_refused() {
        let err = error_of("[models]\ntarget = \"t.gguf\"\n");
        assert!(err.contains("needs models.draft"), "{err}");
    }

    #[test]
    fn unknown_judge_kind_is_named() {
        let err = error_of(&format!("{MINIMAL}[[judge]]\nkind = \"oracle\"\n"));
        assert!(err.contains("judge[0].kind = \"oracle\""), "{err}");
        assert!(err.contains("fsd, dropmatch, autojudge, pad"), "{err}");
    }

    #[test]
    fn judge_parameters_are_typed_and_named_in_errors() {
        let err = error_of(&format!(
            "{MINIMAL}[[judge]]\nkind = \"fsd\"\nthreshhold = 0.1\n"
        ));
        assert!(err.contains("unknown field `threshhold`"), "{err}");
        let err = error_of(&format!(
            "{MINIMAL}[[judge]]\nkind = \"dropmatch\"\np = 1.5\n"
        ));
        assert!(
            err.contains("judge[0]") && err.contains("p must be in [0, 1), got 1.5"),
            "{err}"
        );
        let err = error_of(&format!(
            "{MINIMAL}[[stack]]\nname = \"a\"\n[[stack.judge]]\nkind = \"fsd\"\nthreshold = 0.9\n"
        ));
        assert!(
            err.contains("stack[0].judge[0]") && err.contains("ln 2"),
            "{err}"
        );
        let err = error_of(&format!(
            "{MINIMAL}[[judge]]\nkind = \"dropmatch\"\ncriterion = \"vote\"\n"
        ));
        assert!(err.contains("unknown variant `vote`"), "{err}");
        let err = error_of(&format!("{MINIMAL}[[judge]]\nkind = \"fly\"\nwindow = 0\n"));
        assert!(err.contains("judge[0]") && err.contains("window must be at least 1"), "{err}");
        let err = error_of(&format!("{MINIMAL}[[judge]]\nkind = \"fly\"\nentropy_treshold = 0.3\n"));
        assert!(err.contains("unknown field `entropy_treshold`"), "{err}");
    }

    #[test]
    fn stacks_parse_and_names_are_checked() {
        let text = format!(
            "{MINIMAL}[[stack]]\nname = \"fsd-0.1\"\n[[stack.judge]]\nkind = \"fsd\"\nthreshold = 0.1\n\
             [[stack]]\nname = \"dm\"\nbase_rule = \"rejection\"\n[[stack.judge]]\nkind = \"dropmatch\"\n"
        );
        let config = Config::from_toml(&text).unwrap();
        assert_eq!(config.stacks.len(), 2);
        assert_eq!(config.stacks[1].base_rule, Some(BaseRule::Rejection));
        let err = error_of(&format!("{MINIMAL}[[stack]]\nname = \"exact\"\n"));
        assert!(err.contains("reserved"), "{err}");
        let err = error_of(&format!(
            "{MINIMAL}[[stack]]\nname = \"a\"\n[[stack]]\nname = \"a\"\n"
        ));
        assert!(err.contains("used twice"), "{err}");
    }

    #[test]
    fn two_replacing_judges_are_refused() {
        let fsd = "[[judge]]\nkind = \"fsd\"\nthreshold = 0.1\n";
        let err = error_of(&format!("{MINIMAL}{fsd}{fsd}"));
        assert!(err.contains("at most one"), "{err}");
        // One of them disabled is fine.
        Config::from_toml(&format!("{MINIMAL}{fsd}{fsd}enabled = false\n")).unwrap();
    }
}
