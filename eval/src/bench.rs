//! `verdict bench`: plain target decoding and each speculative mode, in one process,
//! interleaved on the same problems. Reports accuracy, τ, and speed as a ratio to plain.
//!
//! Every finished (problem, mode) run is appended to a JSONL checkpoint, so an interrupted
//! bench resumes where it stopped.

use std::{
    collections::{BTreeMap, HashSet},
    fmt::Write as _,
    fs,
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{bail, ensure, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::{
    paired::{paired_stats, Pair, PairedStats},
    subset::Subset,
};
pub use crate::benchmark::TaskName;
use crate::modes::{known_modes, mode_drafting, named_stack, Mode, COMBINED_MODE_PREFIX, EAGLE_MODE_PREFIX};
use crate::{
    benchmark::{self, Answers, Benchmark, BenchmarkSource},
    sandbox::SandboxLimits,
};
use verdict::{
    proposers::scored::ScoredProposer,
    verify_latency::VerifyLatency,
    config::{Config, EagleDrafting},
    engine::{Engine, Generation, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate, generate_with_top_tokens},
    judge::JudgeStack,
    metrics::{Counters, Metrics},
    proposers::{combined::ChoiceCounts, draft_model::DraftModelProposer, eagle_proposer::EagleProposer},
    sv::{
        policy::VerifyPolicy,
    },
};

pub struct BenchOptions {
    /// What is measured: GSM8K (from `data_dir`'s `split`), HumanEval, MBPP or MATH-500.
    pub task: TaskName,
    pub data_dir: PathBuf,
    pub split: String,
    /// The interpreter HumanEval's and MBPP's tests run with, in the sandbox.
    pub sandbox_python: PathBuf,
    /// Which problems of the split (reports name them by their index in it).
    pub subset: Subset,
    pub modes: Vec<Mode>,
    /// The JSON report; the checkpoint sits beside it as `<out>.runs.jsonl`.
    pub out: PathBuf,
    /// Rerun plain decoding where a lossless mode's output differs, to locate and explain
    /// the first differing token (one extra plain generation per such problem); greedy
    /// decoding only.
    pub explain_divergences: bool,
    /// Up to this many problems are decoded together (speculative modes draft for all of them
    /// in one forward per draft position and verify them in one), the modes taking turns group
    /// by group: a load comparison in one process. Groups are consecutive problems with
    /// `server.ragged_batches`, else problems of equal prompt length (upstream batches only
    /// those on the CPU). 1 decodes one problem at a time.
    pub batch: usize,
    /// Engines keep finished requests' caches for later ones sharing their prefix (bounded by
    /// `[server] prefix_cache_mb`); every mode's engine has its own.
    pub prefix_cache: bool,
    /// Samples per problem and mode (sampling at a temperature): accuracy is the mean over
    /// them, and each is paired with plain decoding's sample of the same number.
    pub seeds: usize,
    /// Before each problem (each group when batched), wait while this file exists, so that
    /// other work can have the cores between problems without being timed into a run.
    pub hold_while: Option<PathBuf>,
}

/// Waits while `hold` names an existing file, saying so once on the progress bar and in the
/// log: a run is never timed while another job has the cores.
fn wait_while_held(hold: Option<&Path>, bar: &ProgressBar) {
    let Some(hold) = hold.filter(|h| h.exists()) else { return };
    tracing::info!("bench held: waiting while {} exists", hold.display());
    let message = bar.message();
    bar.set_message(format!("held while {} exists", hold.display()));
    while hold.exists() {
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    tracing::info!("bench resumed: {} is gone", hold.display());
    bar.set_message(message);
}

/// One (problem, mode) run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Run {
    /// The problem's index in the split.
    pub problem: usize,
    /// Which of the problem's `--seeds` samples this is (0 for the first, and for greedy).
    #[serde(default)]
    pub seed: usize,
    pub mode: Mode,
    pub correct: bool,
    pub answer: Option<String>,
    pub text: String,
    pub completion_tokens: usize,
    /// The request's wall clock; for a batched run, its batch's wall clock divided by the
    /// batch's size, so that tokens over seconds is the batch's throughput.
    pub seconds: f64,
    /// The engine's timing of the prompt's processing, for a run decoded alone (`None` in a
    /// batch, and in runs written before it was kept): decode speed without the prompt is
    /// `completion_tokens / (seconds − prompt_seconds)`, as llama.cpp reports its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_seconds: Option<f64>,
    pub counters: Option<Counters>,
    /// Problems decoded together with this one (1: alone).
    #[serde(default = "one")]
    pub batch_size: usize,
    /// A combined mode's choices during this run (a batch's go with its first run), so that
    /// a resumed bench reports every run's, not only those of its own process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combined_choices: Option<ChoiceCounts>,
}

fn one() -> usize {
    1
}

/// A mode's totals over every problem.
#[derive(Clone, Debug, Serialize)]
pub struct ModeSummary {
    pub mode: String,
    pub problems: usize,
    pub accuracy: f64,
    /// Share of responses that commit to an answer ("The final answer is N", `\boxed{N}`).
    pub committed_rate: f64,
    /// Against plain decoding on the same problems (speculative modes, when plain ran).
    pub paired: Option<PairedStats>,
    /// Whether runs were decoded in batches (tokens/s is then a batch throughput).
    pub batched: bool,
    pub mean_acceptance_length: Option<f64>,
    pub draft_acceptance_rate: Option<f64>,
    /// Completion tokens over wall clock, prompt processing included (what a user waits).
    pub tokens_per_second: f64,
    /// Drafting time per drafted token (draft model forwards or head steps).
    pub draft_ms_per_token: Option<f64>,
    pub speed_vs_plain: Option<f64>,
    /// Plain decoding's wall clock over this mode's on the problems both ran: how much sooner
    /// the answers come. A lossy mode writes other texts, of other lengths, so tokens/s alone
    /// can flatter it (a longer answer of easy tokens) or wrong it.
    pub time_vs_plain: Option<f64>,
    /// Runs whose text equals the plain target's on the same problem.
    pub identical_to_plain: Option<usize>,
    /// Time in the accept rule as a share of target verify time.
    pub accept_share_of_verify: Option<f64>,
    pub judges: BTreeMap<String, JudgeSummary>,
    /// Where a speculative step's wall clock goes (speculative modes).
    pub step_time: Option<StepTime>,
    pub counters: Option<Counters>,
}

/// A speculative step's wall clock split by what the pipeline timed, in ms per step (prompt
/// steps included); `other` is the rest: scheduling, sampling, KV rollback, the engine loop.
/// The prompt's forward (`prompt_ms`) is apart from `verify_ms`, the verify forwards of
/// decoding steps: on short answers it would otherwise dwarf them.
#[derive(Clone, Debug, Serialize)]
pub struct StepTime {
    pub tokens_per_step: f64,
    pub total_ms: f64,
    pub draft_ms: f64,
    pub observe_ms: f64,
    pub prompt_ms: f64,
    pub verify_ms: f64,
    pub accept_ms: f64,
    pub other_ms: f64,
}

impl StepTime {
    fn of(c: &Counters, seconds: f64) -> Option<Self> {
        if c.steps == 0 {
            return None;
        }
        let per_step = |s: f64| 1000.0 * s / c.steps as f64;
        let verify = c.verify_seconds + c.prefill_verify_seconds;
        Some(Self {
            tokens_per_step: c.emitted_tokens as f64 / c.steps as f64,
            total_ms: per_step(seconds),
            draft_ms: per_step(c.draft_seconds),
            observe_ms: per_step(c.observe_seconds),
            prompt_ms: per_step(c.prefill_verify_seconds),
            verify_ms: per_step(c.verify_seconds),
            accept_ms: per_step(c.accept_seconds),
            other_ms: per_step(
                seconds - c.draft_seconds - c.observe_seconds - verify - c.accept_seconds,
            ),
        })
    }
}

/// One judge's work over a mode's runs.
#[derive(Clone, Debug, Serialize)]
pub struct JudgeSummary {
    pub calls: u64,
    pub rescues: u64,
    pub vetoes: u64,
    /// Time in this judge as a share of target verify time.
    pub share_of_verify: f64,
    /// ... and of the whole speculative step (draft, verify, accept rule).
    pub share_of_step: f64,
    pub ms_per_step: f64,
}

/// The runs file (`<out>.runs.jsonl`) a bench run appends to and resumes from.
pub fn checkpoint_path(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".runs.jsonl");
    out.with_file_name(name)
}

pub fn load_checkpoint(path: &Path) -> Result<Vec<Run>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = fs::read_to_string(path)?;
    // A line cut short by a crash is dropped; the run is simply redone.
    Ok(text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect())
}

/// What `verdict bench` prints and writes.
pub struct BenchReport {
    pub summaries: Vec<ModeSummary>,
    pub divergences: Vec<Divergence>,
    /// Every (problem, seed, mode) run, resumed ones included.
    pub runs: Vec<Run>,
}

/// What EAGLE modes must share to share a proposer: the head, how it drafts, and the mode
/// itself where the proposer is the mode's own.
type ProposerKey<'a> = (Option<&'a str>, EagleDrafting, Option<Mode>);

pub fn run(config: &Config, options: &BenchOptions) -> Result<BenchReport> {
    if options.modes.is_empty() {
        bail!("--modes is empty");
    }
    let known = known_modes(config);
    // How the head drafts in each EAGLE mode, read once.
    let mut eagle_drafting: BTreeMap<Mode, EagleDrafting> = BTreeMap::new();
    for mode in &options.modes {
        // `eagle-<options>:<stack>` is known when `eagle:<stack>` is.
        let as_configured = match (mode.combines_lookup_and_head(), mode.drafts_with_eagle()) {
            (true, _) => format!("{COMBINED_MODE_PREFIX}{EAGLE_MODE_PREFIX}{}", mode.stack_name()),
            (false, true) => format!("{EAGLE_MODE_PREFIX}{}", mode.stack_name()),
            (false, false) => mode.0.clone(),
        };
        if !known.contains(&as_configured) {
            bail!(
                "unknown bench mode {:?}; known with this config: {} (an eagle: mode may say how the head drafts: eagle-q4k-g6-c0.5:exact)",
                mode.0,
                known.join(", ")
            );
        }
        if mode.drafts_with_eagle() {
            eagle_drafting.insert(mode.clone(), mode_drafting(config, mode)?);
            // A named head must exist before anything loads.
            config.eagle_head_named(mode.eagle_head_name()).with_context(|| format!("bench mode {:?}", mode.0))?;
        }
    }

    let cache_dir = verdict::models::cache_dir(config.models.cache_dir.as_deref());
    let benchmark = benchmark::load(
        options.task,
        &BenchmarkSource {
            gsm8k_dir: &options.data_dir,
            split: &options.split,
            cache_dir: &cache_dir,
            sandbox_python: &options.sandbox_python,
            sandbox_limits: SandboxLimits::default(),
        },
    )?;
    let selected = options.subset.indices(benchmark.len())?;
    ensure!(options.seeds >= 1, "--seeds 0: pass at least 1");
    if options.seeds > 1 && config.sampling.temperature == 0.0 {
        tracing::warn!("--seeds {} with greedy decoding: every sample of a problem is the same text", options.seeds);
    }
    // Each (problem, seed) is one unit of work, problems first.
    let units: Vec<(usize, usize)> = selected.iter().flat_map(|&p| (0..options.seeds).map(move |seed| (p, seed))).collect();
    if options.batch == 0 {
        bail!("--batch 0: pass at least 1");
    }
    let needs_draft = options.modes.iter().any(|m| !m.decodes_plainly() && !m.drafts_with_eagle() && !m.drafts_by_lookup());
    if needs_draft && config.models.draft.is_none() {
        bail!("speculative modes without the eagle: or ngram: prefix need models.draft in the config");
    }

    let checkpoint = checkpoint_path(&options.out);
    if let Some(parent) = checkpoint.parent() {
        fs::create_dir_all(parent)?;
    }
    let mut runs = load_checkpoint(&checkpoint)?;
    let selected_set: HashSet<usize> = selected.iter().copied().collect();
    runs.retain(|r| selected_set.contains(&r.problem) && r.seed < options.seeds && options.modes.contains(&r.mode));
    let done: HashSet<((usize, usize), Mode)> = runs.iter().map(|r| ((r.problem, r.seed), r.mode.clone())).collect();
    let resumed_runs = runs.len();
    if !done.is_empty() {
        tracing::info!(
            "resuming: {} runs already in {}",
            done.len(),
            checkpoint.display()
        );
    }

    let models = LoadedModels::load_with_draft(config, needs_draft)?;
    // One proposer per way of drafting the modes ask for; a proposer that learns keep
    // rates serves one mode, since each stack keeps drafts at its own rate.
    let mut built: Vec<(ProposerKey, _)> = Vec::new();
    let mut eagle_proposers = BTreeMap::new();
    for (mode, drafting) in &eagle_drafting {
        // A head that learns keep rates, or that a lookup shares steps with, is the mode's own.
        let key = (mode.eagle_head_name(), *drafting, (drafting.learn_keep_rates || mode.combines_lookup_and_head()).then(|| mode.clone()));
        let proposer = match built.iter().find(|(k, _)| *k == key) {
            Some((_, proposer)) => Arc::clone(proposer),
            None => {
                let proposer = models
                    .eagle_head(config, mode.eagle_head_name(), drafting)
                    .with_context(|| format!("bench mode {:?}", mode.0))?;
                built.push((key, proposer.clone()));
                proposer
            }
        };
        eagle_proposers.insert(mode.clone(), proposer);
    }
    // Every stack is built (heads loaded and checked) before the first run.
    let stacks: BTreeMap<Mode, Arc<JudgeStack>> = options
        .modes
        .iter()
        .filter(|m| !m.decodes_plainly())
        .map(|m| {
            let stack = named_stack(config, m.stack_name(), &models.fingerprints())?;
            if m.drafts_with_eagle() || m.drafts_by_lookup() {
                stack.check_drafts_without_model()?;
            }
            Ok((m.clone(), Arc::new(stack)))
        })
        .collect::<Result<_>>()?;
    let runtime = tokio::runtime::Runtime::new()?;
    let metrics = Arc::new(Metrics::default());
    let s = &config.speculative;
    let prefix_cache_bytes = config.server.prefix_cache_bytes().filter(|_| options.prefix_cache);
    let scheduling = |max_seqs| Scheduling {
        max_seqs,
        prefix_cache_bytes,
        ragged_batches: config.server.ragged_batches,
    };
    // One engine per speculative mode, so that each mode's prefix cache holds only its own
    // earlier requests, as plain decoding's does: modes sharing an engine would find each
    // problem's whole prompt cached by the mode that ran it first.
    let mut combined_proposers = BTreeMap::new();
    let mut eagle_policies: BTreeMap<Mode, Arc<VerifyPolicy<EagleProposer>>> = BTreeMap::new();
    let mut draft_policies: BTreeMap<Mode, Arc<VerifyPolicy<DraftModelProposer>>> = BTreeMap::new();
    let (plain, speculative) = runtime.block_on(async {
        let plain = Engine::plain(&models, scheduling(options.batch)).await;
        let lossless = || JudgeStack::lossless(s.base_rule);
        let mut speculative = BTreeMap::new();
        for mode in stacks.keys() {
            let engine = match eagle_drafting.get(mode) {
                Some(drafting) if mode.combines_lookup_and_head() => {
                    let combined = models.combined_proposer(config, eagle_proposers[mode].clone(), drafting.gamma, drafting)?;
                    combined_proposers.insert(mode.clone(), combined.clone());
                    let gamma = combined.proposer().gamma();
                    Engine::with_proposer(&models, combined, SpeculativeSetup { gamma, stack: lossless(), seed: s.seed, metrics: metrics.clone(), scheduling: scheduling(options.batch) }).await?
                }
                Some(drafting) => {
                    // Modes sharing a head share its policy: it learns what the head drafts.
                    let head = &eagle_proposers[mode];
                    let policy = match eagle_policies.values().find(|p| Arc::ptr_eq(p.proposer(), head)) {
                        Some(policy) => Arc::clone(policy),
                        None => models.verify_policy(config, drafting, head.clone())?,
                    };
                    eagle_policies.insert(mode.clone(), policy.clone());
                    Engine::with_proposer(&models, policy, SpeculativeSetup { gamma: drafting.gamma, stack: lossless(), seed: s.seed, metrics: metrics.clone(), scheduling: scheduling(options.batch) }).await?
                }
                None if mode.drafts_by_lookup() => {
                    Engine::with_proposer(&models, models.ngram_proposer(config)?, SpeculativeSetup { gamma: s.ngram_gamma, stack: lossless(), seed: s.seed, metrics: metrics.clone(), scheduling: scheduling(options.batch) }).await?
                }
                None if mode.drafts_with_model_under_sv() => {
                    let drafting = EagleDrafting { sv: true, ..mode_drafting(config, mode)? };
                    let Some(policy) = models.draft_model_policy(config, &drafting)? else {
                        bail!("bench mode {:?}: no SV policy for the draft model", mode.0);
                    };
                    draft_policies.insert(mode.clone(), policy.clone());
                    Engine::speculative_under(&models, policy, SpeculativeSetup { gamma: s.gamma, stack: lossless(), seed: s.seed, metrics: metrics.clone(), scheduling: scheduling(options.batch) }).await?
                }
                None => Engine::speculative(&models, SpeculativeSetup { gamma: s.gamma, stack: lossless(), seed: s.seed, metrics: metrics.clone(), scheduling: scheduling(options.batch) }).await?,
            };
            speculative.insert(mode.clone(), engine);
        }
        anyhow::Ok((plain, speculative))
    })?;

    let total = units.len() * options.modes.len();
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} runs  {elapsed} elapsed, ETA {eta}  {msg}",
        )
        .unwrap(),
    );
    bar.set_position(done.len() as u64);
    let mut log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&checkpoint)?;
    let mut record = |run: Run, runs: &mut Vec<Run>| -> Result<()> {
        tracing::info!(
            "problem {}{} {}: {} tokens in {:.1}s, answer {:?} ({}){}",
            run.problem,
            if options.seeds > 1 { format!(" seed {}", run.seed) } else { String::new() },
            run.mode.name(),
            run.completion_tokens,
            run.seconds,
            run.answer,
            if run.correct { "correct" } else { "wrong" },
            run.counters
                .as_ref()
                .map(|c| format!(", τ {:.2}", c.mean_acceptance_length()))
                .unwrap_or_default()
        );
        writeln!(log, "{}", serde_json::to_string(&run)?)?;
        log.flush()?;
        runs.push(run);
        bar.inc(1);
        Ok(())
    };
    let new_run = |(index, seed): (usize, usize), mode: &Mode, generation: Generation, counters, batch_size, combined_choices| {
        let grade = benchmark.grade(index, &generation.text);
        Run {
        problem: index,
        seed,
        mode: mode.clone(),
        correct: grade.correct,
        answer: grade.answer,
        text: generation.text,
        completion_tokens: generation.completion_tokens,
        seconds: generation.seconds,
        prompt_seconds: (batch_size == 1).then_some(generation.prompt_seconds),
        counters,
        batch_size,
        combined_choices,
    }
    };
    // A combined mode's choice counts now, to take the run's own from.
    let choices_of = |mode: &Mode| combined_proposers.get(mode).map(|p| p.proposer().choices());
    let choices_since = |mode: &Mode, before: Option<ChoiceCounts>| choices_of(mode).zip(before).map(|(now, before)| now.since(&before));
    if options.batch > 1 {
        let pending: Vec<(usize, usize)> = units
            .iter()
            .copied()
            .filter(|&u| options.modes.iter().any(|m| !done.contains(&(u, m.clone()))))
            .collect();
        let groups = match config.server.ragged_batches {
            true => pending.chunks(options.batch).map(<[(usize, usize)]>::to_vec).collect(),
            false => {
                let tokenizer = models
                    .target
                    .blocking_lock()
                    .tokenizer()
                    .context("the target has no tokenizer to group prompts by length")?;
                let mut lengths = Vec::with_capacity(pending.len());
                for &(index, seed) in &pending {
                    let prompt = benchmark.prompt(index);
                    let encoding = tokenizer
                        .encode(prompt.as_str(), false)
                        .map_err(anyhow::Error::msg)
                        .with_context(|| format!("cannot tokenize problem {index}"))?;
                    lengths.push(((index, seed), encoding.len()));
                }
                equal_length_batches(&lengths, options.batch)
            }
        };
        let n = options.modes.len();
        for (position, group) in groups.iter().enumerate() {
            wait_while_held(options.hold_while.as_deref(), &bar);
            // Modes take turns first, group by group, as the unbatched runs do per problem.
            for k in 0..n {
                let mode = &options.modes[(position + k) % n];
                let todo: Vec<(usize, usize)> = group.iter().copied().filter(|&u| !done.contains(&(u, mode.clone()))).collect();
                if todo.is_empty() {
                    continue;
                }
                bar.set_message(format!("{} problems at once, {}", todo.len(), mode.name()));
                let (engine, stack) = match stacks.get(mode) {
                    None => (&plain, None),
                    Some(stack) => (speculative.get(mode).expect("an engine per speculative mode"), Some(stack)),
                };
                if let Some(stack) = stack {
                    engine.rule.as_ref().unwrap().set_stack(stack.clone());
                }
                let before = metrics.snapshot();
                let choices_before = choices_of(mode);
                let verifies_before = mistralrs_core::batched_speculative_verifies();
                let started = std::time::Instant::now();
                let generations = runtime.block_on(async {
                    let mut set = tokio::task::JoinSet::new();
                    for &unit in &todo {
                        let mistralrs = engine.mistralrs.clone();
                        let prompt = Prompt::Chat(benchmark.prompt(unit.0));
                        let sampling = config.sampling.clone();
                        set.spawn(async move { (unit, generate(&mistralrs, &prompt, &sampling).await) });
                    }
                    let mut out = BTreeMap::new();
                    while let Some(joined) = set.join_next().await {
                        let (unit, generation) = joined?;
                        out.insert(unit, generation.with_context(|| format!("problem {} seed {}, mode {}", unit.0, unit.1, mode.name()))?);
                    }
                    engine.settle().await;
                    anyhow::Ok(out)
                })?;
                let elapsed = started.elapsed().as_secs_f64();
                let share = elapsed / todo.len() as f64;
                if stack.is_some() {
                    // Whether the group's steps verified its sequences together, or one by one.
                    tracing::info!(
                        "{} problems at once, {}: {} batched verifies in {:.1}s",
                        todo.len(),
                        mode.name(),
                        mistralrs_core::batched_speculative_verifies() - verifies_before,
                        elapsed
                    );
                }
                // The group's counters go with its first run (summaries add them up).
                let mut counters = stack.map(|_| metrics.snapshot().since(&before));
                let mut choices = choices_since(mode, choices_before);
                for (unit, mut generation) in generations {
                    generation.seconds = share;
                    record(new_run(unit, mode, generation, counters.take(), todo.len(), choices.take()), &mut runs)?;
                }
            }
        }
    }
    // Unbatched: one problem at a time, the modes rotated (a batched run has done its runs).
    let one_at_a_time = if options.batch > 1 { &[][..] } else { &units[..] };
    // The order is rotated per problem so no mode always runs first (warm caches, turbo);
    // `plain-again` runs last.
    let (last, rotated): (Vec<&Mode>, Vec<&Mode>) = options.modes.iter().partition(|m| **m == Mode::plain_again());
    let n = rotated.len();
    for (position, &(index, seed)) in one_at_a_time.iter().enumerate() {
        let order = (0..n).map(|k| rotated[(position + k) % n]).chain(last.iter().copied());
        if options.modes.iter().any(|m| !done.contains(&((index, seed), m.clone()))) {
            wait_while_held(options.hold_while.as_deref(), &bar);
        }
        for mode in order {
            let mode = mode.clone();
            if done.contains(&((index, seed), mode.clone())) {
                continue;
            }
            bar.set_message(format!("problem {index} {}", mode.name()));
            // `seed` numbers the sample: each engine's sampler draws afresh for it.
            let prompt = Prompt::Chat(benchmark.prompt(index));
            let choices_before = choices_of(&mode);
            let (generation, counters) = runtime
                .block_on(async {
                    match stacks.get(&mode) {
                        None => {
                            let generation = generate(&plain.mistralrs, &prompt, &config.sampling).await?;
                            plain.settle().await;
                            Ok::<_, anyhow::Error>((generation, None))
                        }
                        Some(stack) => {
                            let engine = speculative.get(&mode).expect("an engine per speculative mode");
                            engine.rule.as_ref().unwrap().set_stack(stack.clone());
                            let before = metrics.snapshot();
                            let generation =
                                generate(&engine.mistralrs, &prompt, &config.sampling).await?;
                            engine.settle().await;
                            Ok((generation, Some(metrics.snapshot().since(&before))))
                        }
                    }
                })
                .with_context(|| format!("problem {index} seed {seed}, mode {}", mode.name()))?;
            let choices = choices_since(&mode, choices_before);
            record(new_run((index, seed), &mode, generation, counters, 1, choices), &mut runs)?;
        }
    }
    bar.finish_and_clear();

    // Sampled texts differ from plain sampling's by chance: only greedy differences are bugs.
    let divergences = match options.explain_divergences && config.sampling.temperature <= 0.0 {
        true => runtime.block_on(explain_divergences(&plain, &*benchmark, &runs, config))?,
        false => Vec::new(),
    };
    let summaries = summarise(&runs, &options.modes, &*benchmark.answers());
    // T_v as each mode's proposer learned it by the end (`tvlearn`); the report has [rows, ms].
    let learned: BTreeMap<String, VerifyLatency> = eagle_policies
        .iter()
        .map(|(mode, p)| (mode, p.learned_latency()))
        .chain(combined_proposers.iter().map(|(mode, p)| (mode, p.learned_latency())))
        .chain(draft_policies.iter().map(|(mode, p)| (mode, p.learned_latency())))
        .filter_map(|(mode, learned)| Some((mode.name(), learned?.current().clone())))
        .collect();
    for (mode, latency) in &learned {
        // A draft model's drafts are priced apart, so its T_v times the verify alone.
        let timed = match draft_policies.iter().any(|(m, _)| m.name() == *mode) {
            true => "verify only",
            false => "drafting included",
        };
        tracing::info!("{mode}: T_v learned (rows: ms, {timed}) {}", latency.describe(8));
    }
    // What SV over the draft model priced its drafts by, as this process learned it.
    let draft_pricing: BTreeMap<String, serde_json::Value> = draft_policies
        .iter()
        .map(|(mode, p)| {
            let draft_ms = p.proposer().draft_ms();
            let confidences = [0.5f32, 0.7, 0.8, 0.9, 0.95, 0.99];
            let kept = p.keep_rates().map(|r| r.keep_rates(&confidences));
            tracing::info!("{}: drafting {draft_ms:?} ms a draft-model row; kept share at confidences {confidences:?}: {kept:?}", mode.name());
            (mode.name(), serde_json::json!({"draft_ms": draft_ms, "confidences": confidences, "keep_rates": kept}))
        })
        .collect();
    // Which proposal the combined modes' steps took over every run (resumed ones too), and
    // what lookup drafts were kept at as this process learned it.
    let combined_choices: BTreeMap<String, serde_json::Value> = combined_proposers
        .iter()
        .map(|(mode, p)| {
            let (mut choices, mut counted) = (ChoiceCounts::default(), 0);
            for c in runs.iter().filter(|r| &r.mode == mode).filter_map(|r| r.combined_choices) {
                choices += c;
                counted += 1;
            }
            tracing::info!("{}: steps took {:?} over {counted} runs", mode.name(), choices);
            // Runs checkpointed before runs kept their choices count as none.
            (mode.name(), serde_json::json!({"choices": choices, "runs_counted": counted, "lookup_keep_rates_this_process": p.proposer().keep_rates()}))
        })
        .collect();
    let report = serde_json::json!({
        "dataset": options.task.as_str(),
        "split": options.split,
        "problems": selected.len(),
        "seeds": options.seeds,
        "problem_ids": selected,
        "gamma": config.speculative.gamma,
        "target": config.models.target,
        "draft": config.models.draft,
        // The CPU quantized matmul the runs used (patched candle-core).
        "quant_kernel": verdict::kernels::QuantKernel::selected(),
        // Each engine's prefix cache bound (null: none, every prompt computed in full).
        "prefix_cache_mb": prefix_cache_bytes.map(|b| b >> 20),
        "sampling": {"temperature": config.sampling.temperature, "top_p": config.sampling.top_p, "max_tokens": config.sampling.max_tokens},
        "summary": summaries,
        "learned_verify_ms": learned.iter().map(|(mode, l)| (mode, l.points())).collect::<BTreeMap<_, _>>(),
        "combined_proposers": combined_choices,
        "draft_model_pricing_this_process": draft_pricing,
        "divergences": divergences,
        "runs": runs,
    });
    // A rerun with nothing left to do keeps the report of the process that made its runs
    // (what it learned as it ran is in no run), unless that report covers another selection.
    if runs.len() == resumed_runs && same_selection(&options.out, &report) {
        tracing::info!("{}: every run was already done; the report there stands", options.out.display());
    } else {
        fs::write(&options.out, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", options.out.display()))?;
    }
    Ok(BenchReport {
        summaries,
        divergences,
        runs,
    })
}

/// Whether the report at `path` covers the same problems, seeds and modes as `report`.
fn same_selection(path: &Path, report: &serde_json::Value) -> bool {
    let Some(old) = fs::read_to_string(path).ok().and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok()) else {
        return false;
    };
    let modes = |r: &serde_json::Value| r["summary"].as_array().map(|s| s.iter().map(|m| m["mode"].clone()).collect::<Vec<_>>());
    old["problem_ids"] == report["problem_ids"] && old["seeds"] == report["seeds"] && modes(&old) == modes(report)
}

/// Problems grouped by prompt token count, at most `batch` a group, shortest prompts first:
/// on the CPU mistral.rs batches only sequences of equal length.
pub fn equal_length_batches<K: Copy>(lengths: &[(K, usize)], batch: usize) -> Vec<Vec<K>> {
    let mut by_length: BTreeMap<usize, Vec<K>> = BTreeMap::new();
    for &(index, length) in lengths {
        by_length.entry(length).or_default().push(index);
    }
    by_length
        .into_values()
        .flat_map(|indices| {
            indices
                .chunks(batch.max(1))
                .map(<[K]>::to_vec)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Where a speculative output first differs from plain decoding, and how close the plain
/// target's two best tokens were there.
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub problem: usize,
    pub modes: Vec<String>,
    /// Index of the first differing generated token.
    pub token_index: usize,
    pub plain_token: String,
    pub speculative_text_at: String,
    /// The plain target's two best candidates there: (text, logit).
    pub best: (String, f32),
    pub runner_up: (String, f32),
    pub logit_gap: f32,
}

/// Rerun plain decoding with the top candidates for every problem where a speculative mode
/// differs, and locate the first differing token.
async fn explain_divergences(
    plain: &Engine,
    benchmark: &dyn Benchmark,
    runs: &[Run],
    config: &Config,
) -> Result<Vec<Divergence>> {
    let mut out = Vec::new();
    for index_of_problem in 0..benchmark.len() {
        let Some(plain_run) = runs
            .iter()
            .find(|r| r.problem == index_of_problem && r.seed == 0 && r.mode.is_plain())
        else {
            continue;
        };
        let differing: Vec<&Run> = runs
            .iter()
            .filter(|r| {
                r.problem == index_of_problem && r.seed == 0 && r.mode.is_lossless() && r.text != plain_run.text
            })
            .collect();
        let Some(first) = differing.first() else {
            continue;
        };
        let generation = generate_with_top_tokens(
            &plain.mistralrs,
            &Prompt::Chat(benchmark.prompt(index_of_problem)),
            &config.sampling,
            2,
        )
        .await?;
        // Text before each generated token, as the response reports it (leading space trimmed).
        let mut boundaries = vec![String::new()];
        for (token, _) in &generation.top_tokens {
            let next = format!("{}{token}", boundaries.last().unwrap());
            boundaries.push(next);
        }
        let spec_at = |i: usize| {
            first
                .text
                .get(boundaries[i].trim_start().len()..)
                .unwrap_or("")
        };
        let Some(mut index) = (0..generation.top_tokens.len())
            .find(|&i| !first.text.starts_with(boundaries[i + 1].trim_start()))
        else {
            continue;
        };
        // A speculative token that extends the previous plain token (" The" → " Therefore")
        // leaves the text equal one token longer: the choice was made a token earlier.
        if index > 0 {
            let (previous, top) = &generation.top_tokens[index - 1];
            if top.iter().skip(1).any(|(_, t, _)| {
                t.len() > previous.len() && spec_at(index - 1).starts_with(t.as_str())
            }) {
                index -= 1;
            }
        }
        let (token, top) = &generation.top_tokens[index];
        let candidate = |i: usize| {
            top.get(i)
                .map(|(_, t, score)| (t.clone(), *score))
                .unwrap_or_default()
        };
        let (best, runner_up) = (candidate(0), candidate(1));
        out.push(Divergence {
            problem: index_of_problem,
            modes: differing.iter().map(|r| r.mode.name()).collect(),
            token_index: index,
            plain_token: token.clone(),
            speculative_text_at: spec_at(index).chars().take(12).collect(),
            logit_gap: best.1 - runner_up.1,
            best,
            runner_up,
        });
    }
    Ok(out)
}

/// A problem's run in some mode against its run in the mode it is compared with (plain
/// decoding): correct each way, and whether both committed to the same answer.
pub fn pair(answers: &dyn Answers, baseline: &Run, run: &Run) -> Pair {
    let same_answer = match (answers.committed_answer(&baseline.text), answers.committed_answer(&run.text)) {
        (Some(x), Some(y)) => answers.answers_equivalent(&x, &y),
        (None, None) => true,
        _ => false,
    };
    Pair { plain_correct: baseline.correct, mode_correct: run.correct, same_answer }
}

/// Completion tokens over wall clock, summed over `runs` (0 for none).
pub fn tokens_per_second<'a>(runs: impl Iterator<Item = &'a Run>) -> f64 {
    let (tokens, seconds) = runs.fold((0usize, 0f64), |(t, s), r| (t + r.completion_tokens, s + r.seconds));
    if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    }
}

pub fn summarise(runs: &[Run], modes: &[Mode], answers: &dyn Answers) -> Vec<ModeSummary> {
    let plain_runs: BTreeMap<(usize, usize), &Run> = runs
        .iter()
        .filter(|r| r.mode.is_plain())
        .map(|r| ((r.problem, r.seed), r))
        .collect();
    let plain_text: BTreeMap<(usize, usize), &str> =
        plain_runs.iter().map(|(&i, r)| (i, r.text.as_str())).collect();
    let mode_tps = |mode: &Mode| tokens_per_second(runs.iter().filter(|r| &r.mode == mode));
    let plain_tps = modes
        .contains(&Mode::plain())
        .then(|| mode_tps(&Mode::plain()));
    modes
        .iter()
        .map(|mode| {
            let mine: Vec<&Run> = runs.iter().filter(|r| &r.mode == mode).collect();
            let counters = Counters::total(mine.iter().filter_map(|r| r.counters.as_ref()));
            let tps = mode_tps(mode);
            let seconds: f64 = mine.iter().map(|r| r.seconds).sum();
            let pairs: Vec<Pair> = mine
                .iter()
                .filter_map(|r| plain_runs.get(&(r.problem, r.seed)).map(|p| pair(answers, p, r)))
                .collect();
            ModeSummary {
                mode: mode.name(),
                problems: mine.len(),
                accuracy: mine.iter().filter(|r| r.correct).count() as f64
                    / mine.len().max(1) as f64,
                committed_rate: mine
                    .iter()
                    .filter(|r| answers.committed_answer(&r.text).is_some())
                    .count() as f64
                    / mine.len().max(1) as f64,
                paired: (!mode.is_plain() && !pairs.is_empty()).then(|| paired_stats(&pairs)),
                batched: mine.iter().any(|r| r.batch_size > 1),
                mean_acceptance_length: counters.as_ref().map(Counters::mean_acceptance_length),
                draft_acceptance_rate: counters.as_ref().map(Counters::draft_acceptance_rate),
                tokens_per_second: tps,
                draft_ms_per_token: counters
                    .as_ref()
                    .filter(|c| c.draft_tokens > 0)
                    .map(|c| 1000.0 * c.draft_seconds / c.draft_tokens as f64),
                speed_vs_plain: plain_tps.filter(|p| *p > 0.0).map(|p| tps / p),
                time_vs_plain: {
                    let (plain_seconds, own): (f64, f64) = mine
                        .iter()
                        .filter_map(|r| plain_runs.get(&(r.problem, r.seed)).map(|p| (p.seconds, r.seconds)))
                        .fold((0.0, 0.0), |(a, b), (p, m)| (a + p, b + m));
                    (!mode.is_plain() && own > 0.0).then(|| plain_seconds / own)
                },
                identical_to_plain: (!plain_text.is_empty() && !mode.is_plain()).then(|| {
                    mine.iter()
                        .filter(|r| plain_text.get(&(r.problem, r.seed)) == Some(&r.text.as_str()))
                        .count()
                }),
                accept_share_of_verify: counters
                    .as_ref()
                    .filter(|c| c.verify_seconds + c.prefill_verify_seconds > 0.0)
                    .map(|c| c.accept_seconds / (c.verify_seconds + c.prefill_verify_seconds)),
                judges: counters
                    .as_ref()
                    .map(|c| {
                        let verify = c.verify_seconds + c.prefill_verify_seconds;
                        let step = verify + c.draft_seconds + c.accept_seconds;
                        // Snapshots taken under another stack list its judges with no calls.
                        c.judges
                            .iter()
                            .filter(|(_, j)| j.calls > 0)
                            .map(|(name, j)| {
                                (
                                    name.clone(),
                                    JudgeSummary {
                                        rescues: j.rescues,
                                        vetoes: j.vetoes,
                                        calls: j.calls,
                                        share_of_verify: if verify > 0.0 {
                                            j.seconds / verify
                                        } else {
                                            0.0
                                        },
                                        share_of_step: if step > 0.0 { j.seconds / step } else { 0.0 },
                                        ms_per_step: 1000.0 * j.seconds / c.steps.max(1) as f64,
                                    },
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                step_time: counters.as_ref().and_then(|c| StepTime::of(c, seconds)),
                counters,
            }
        })
        .collect()
}

/// One line per divergence from plain decoding.
pub fn divergence_lines(divergences: &[Divergence]) -> String {
    let mut out = String::new();
    for d in divergences {
        let _ = writeln!(
            out,
            "problem {} ({}): first differs at generated token {}: plain {:?}, speculative {:?}…; plain target's best {:?} (logit {:.3}) vs runner-up {:?} (logit {:.3}), gap {:.3}",
            d.problem,
            d.modes.join(", "),
            d.token_index,
            d.plain_token,
            d.speculative_text_at,
            d.best.0,
            d.best.1,
            d.runner_up.0,
            d.runner_up.1,
            d.logit_gap
        );
    }
    out
}

/// The tables people read: answers (accuracy, paired with plain decoding) and speed. The
/// JSON report holds the same figures.
pub fn table(summaries: &[ModeSummary]) -> String {
    let mut out = String::new();
    let dash = || "–".to_string();
    let fixed = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(dash);
    let ratio = |v: Option<f64>| v.map(|v| format!("{v:.2}×")).unwrap_or_else(dash);
    let percent = |v: Option<f64>, digits: usize| {
        v.map(|v| format!("{:.digits$}%", 100.0 * v))
            .unwrap_or_else(dash)
    };
    let _ = writeln!(out, "| mode | problems | accuracy | committed | Δ accuracy vs plain [95% CI] | better / worse | McNemar p | same answer as plain | identical text |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|");
    for s in summaries {
        let paired = s.paired.as_ref();
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {:.1}% | {} | {} | {} | {} | {} |",
            s.mode,
            s.problems,
            100.0 * s.accuracy,
            100.0 * s.committed_rate,
            paired
                .map(|p| format!(
                    "{:+.1} pts [{:+.1}, {:+.1}]",
                    100.0 * p.accuracy_difference,
                    100.0 * p.difference_ci95.0,
                    100.0 * p.difference_ci95.1
                ))
                .unwrap_or_else(dash),
            paired
                .map(|p| format!("{} / {}", p.better, p.worse))
                .unwrap_or_else(dash),
            paired
                .map(|p| format!("{:.3}", p.mcnemar_p))
                .unwrap_or_else(dash),
            percent(paired.map(|p| p.agreement), 0),
            s.identical_to_plain
                .map(|n| format!("{n}/{}", s.problems))
                .unwrap_or_else(dash),
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "| mode | τ (mean accept len) | draft accept rate | draft ms / drafted token | ms / token | tokens/s | speed vs plain | time vs plain | accept time / verify time | judges: rescues, vetoes, time / verify, time / step |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for s in summaries {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1} | {:.2}{} | {} | {} | {} | {} |",
            s.mode,
            fixed(s.mean_acceptance_length),
            percent(s.draft_acceptance_rate, 1),
            fixed(s.draft_ms_per_token),
            1000.0 / s.tokens_per_second.max(1e-9),
            s.tokens_per_second,
            if s.batched { " (batched)" } else { "" },
            ratio(s.speed_vs_plain),
            ratio(s.time_vs_plain),
            percent(s.accept_share_of_verify, 2),
            judge_cell(&s.judges),
        );
    }
    out
}

/// Where each speculative mode's step time goes, beside plain decoding's time per token.
pub fn step_time_table(summaries: &[ModeSummary]) -> String {
    let mut out = String::new();
    let plain_ms = summaries
        .iter()
        .find(|s| s.mode == Mode::plain().name())
        .filter(|s| s.tokens_per_second > 0.0)
        .map(|s| 1000.0 / s.tokens_per_second);
    let _ = writeln!(out, "| mode | tokens / step | ms / step | draft | head observe | prompt | verify | accept rule | other | step in plain tokens |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|");
    for s in summaries {
        let Some(t) = &s.step_time else { continue };
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.1} | {} |",
            s.mode,
            t.tokens_per_step,
            t.total_ms,
            t.draft_ms,
            t.observe_ms,
            t.prompt_ms,
            t.verify_ms,
            t.accept_ms,
            t.other_ms,
            plain_ms
                .map(|p| format!("{:.2}", t.total_ms / p))
                .unwrap_or_else(|| "–".into()),
        );
    }
    out
}

fn judge_cell(judges: &BTreeMap<String, JudgeSummary>) -> String {
    if judges.is_empty() {
        return "–".into();
    }
    judges
        .iter()
        .map(|(name, j)| {
            format!(
                "{name}: {} rescued, {} vetoed, {:.2}%, {:.2}%",
                j.rescues,
                j.vetoes,
                100.0 * j.share_of_verify,
                100.0 * j.share_of_step
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;



    /// A checkpoint line written before runs kept a combined mode's choices still loads;
    /// a run with them writes and reads them back.
    #[test]
    fn runs_keep_their_combined_choices_and_older_lines_load() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("runs.jsonl");
        let old = r#"{"problem":3,"seed":0,"mode":"ngram+eagle:exact","correct":true,"answer":"1","text":"t","completion_tokens":5,"seconds":1.0,"counters":null,"batch_size":1}"#;
        let mut run: Run = serde_json::from_str(old).unwrap();
        assert_eq!(run.combined_choices, None);
        run.combined_choices = Some(ChoiceCounts { lookup: 2, head: 5, nothing: 1, head_skipped: 0 });
        fs::write(&path, format!("{old}\n{}\n", serde_json::to_string(&run).unwrap())).unwrap();
        let loaded = load_checkpoint(&path).unwrap();
        assert_eq!(loaded.iter().map(|r| r.combined_choices).collect::<Vec<_>>(), vec![None, run.combined_choices]);
    }


    #[test]
    fn batches_hold_equal_prompt_lengths_only() {
        let lengths = [(0, 90), (1, 88), (2, 90), (3, 90), (4, 88), (5, 70)];
        assert_eq!(
            equal_length_batches(&lengths, 2),
            vec![vec![5], vec![1, 4], vec![0, 2], vec![3]]
        );
        assert_eq!(equal_length_batches(&lengths, 1).len(), 6);
    }
}
