//! `train-head`: mine GSM8K for important tokens, compute features, fit the heads.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use verdict::{
    config::Config,
    engine::LoadedModels,
};
use verdict_eval::{
    packaged,
    sandbox::{Sandbox, SandboxLimits},
    tasks::{
        gsm8k,
        math::Math,
        mbpp::{self, MbppTests},
        GivenPrompts, TaskAdapter,
    },
};
use verdict_heads::FeatureSpec;
use verdict_training::{
    autojudge_head::{fit_autojudge_head, LabelSet},
    feature_models::FeatureModels,
    eagle_fit::EagleFitOptions,
    eagle_mine::EagleMiningEngine,
    eagle_pipeline::{replay_held_out, train_eagle, EaglePlan},
    eagle_replay::DraftTree,
    engine::MistralEngines,
    features::compute_features,
    fit::FitOptions,
    mine::{mine, MiningPlan},
    miner::MiningEngine,
    pad_fit::PadFitOptions,
    pad_head::{compute_pad_features, fit_pad_head},
    pad_mine::{mine_pivots, PadPlan},
    sv_profile::{profile_sv, SvProfilePlan},
};

#[derive(Parser)]
#[command(
    name = "train-head",
    version,
    about = "Mine labelled draft/target mismatches and fit the heads Verdict loads"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// With no subcommand: mine, compute features and fit, end to end (each step resumes).
    #[command(flatten)]
    all: AllArgs,
}

#[derive(Subcommand)]
enum Command {
    /// AutoJudge's Algorithm 1: label which mismatches change the answer (resumable).
    Mine(MineArgs),
    /// Hidden states of both models at every labelled mismatch (resumable).
    Features(FeaturesArgs),
    /// Fit the head on labels and features; writes the head and its reports.
    Fit(FitArgs),
    /// An EAGLE-3 draft head, self-distilled: the target's greedy responses to GSM8K train
    /// prompts, their features, training; every stage resumes where a kill left it.
    Eagle(EagleArgs),
    /// The general prompt mixture (GSM8K train, MATH outside MATH-500, MBPP tasks in sixteen
    /// languages outside the evaluated ones, question answering) for `eagle --prompts`,
    /// checked by text against every evaluation set; writes the prompts and a report.
    Mixture(MixtureArgs),
    /// Replay an EAGLE-3 head's greedy chain drafting on the held-out problems' features:
    /// the τ a greedy `exact` bench of those responses would measure, without running one.
    EagleReplay(EagleReplayArgs),
    /// Speculative Verification's acceptance table for an EAGLE head: greedy `exact`
    /// speculation over GSM8K train problems records each verified draft's confidence and
    /// fate, and the table maps a confidence to the chance the target keeps the draft
    /// (`[sv] table` in a config); resumable, with held-out calibration in a report.
    SvProfile(SvProfileArgs),
}

#[derive(Args)]
struct SvProfileArgs {
    /// A verdict config drafting with an EAGLE head (`proposer = "eagle"`), greedy.
    #[command(flatten)]
    task: TaskArgs,
    /// First problem of the split to profile.
    #[arg(long, default_value_t = 0)]
    first: usize,
    #[arg(long, default_value_t = 100)]
    problems: usize,
    /// Every n-th problem is held out of the fit to evaluate it.
    #[arg(long, default_value_t = 5)]
    hold_out_every: usize,
    /// Confidence bins of equal draft counts.
    #[arg(long, default_value_t = 20)]
    bins: usize,
    /// Bins with fewer drafts fall back to the overall keep rate.
    #[arg(long, default_value_t = 20)]
    min_count: u32,
    /// The table (JSON); `<name>.report.json` and `<name>.outcomes.jsonl` go beside it.
    #[arg(long, default_value = "heads/gsm8k-eagle3/sv_table.json")]
    out: PathBuf,
}

#[derive(Args)]
struct EagleReplayArgs {
    /// A verdict config naming the target (its embeddings feed the head).
    #[arg(long, short, default_value = "configs/default.toml")]
    config: PathBuf,
    /// The head folder (config.json, model.safetensors).
    #[arg(long, default_value = "heads/gsm8k-eagle3")]
    head: PathBuf,
    /// The head's matrices: f32, q8_0 or q4k.
    #[arg(long, default_value = "f32")]
    weights: verdict_heads::WeightFormat,
    /// `train-head eagle`'s work folder (its features/).
    #[arg(long, default_value = ".verdict-work/gsm8k/eagle")]
    work: PathBuf,
    #[arg(long, default_value_t = 20)]
    hold_out_every: usize,
    #[arg(long, default_value_t = 4)]
    gamma: usize,
    /// Replay a draft tree instead of a γ chain: its root-to-leaf paths, each the rank of the
    /// draft taken at each depth (0 = the head's best), e.g. `0000,1000` (two chains parting
    /// at the first draft). Says whether tree verification would pay, before building it.
    #[arg(long)]
    tree: Option<DraftTree>,
    /// Stop a chain before a draft the head gives less than this probability (the first
    /// draft is always made); reports the drafts verified per step beside τ.
    #[arg(long, default_value_t = 0.0)]
    min_confidence: f32,
}

#[derive(Args)]
struct MixtureArgs {
    /// A verdict config (its `models.cache_dir` holds the fetched data).
    #[arg(long, short, default_value = "configs/default.toml")]
    config: PathBuf,
    /// The folder holding GSM8K's train.jsonl (else $VERDICT_GSM8K).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 600)]
    gsm8k: usize,
    #[arg(long, default_value_t = 600)]
    math: usize,
    #[arg(long, default_value_t = 600)]
    code: usize,
    #[arg(long, default_value_t = 400)]
    qa: usize,
    /// The prompts file; its report is written beside it as `<out>.report.json`.
    #[arg(long, default_value = ".verdict-work/general/prompts.jsonl")]
    out: PathBuf,
}

fn run_mixture(args: &MixtureArgs) -> Result<()> {
    let config = Config::load(&args.config)?;
    let cache = verdict::models::cache_dir(config.models.cache_dir.as_deref());
    let gsm8k_dir = verdict_eval::datasets::gsm8k_dir(args.data_dir.clone(), &cache);
    let plan = verdict_eval::mixture::MixturePlan {
        gsm8k: args.gsm8k,
        math: args.math,
        code: args.code,
        qa: args.qa,
    };
    let (records, report) = verdict_eval::mixture::build(&gsm8k_dir, &cache, &plan)?;
    verdict_eval::prompts::save(&args.out, &records)?;
    let mut report_path = args.out.clone().into_os_string();
    report_path.push(".report.json");
    std::fs::write(&report_path, serde_json::to_string_pretty(&report)?)?;
    tracing::info!(
        "{} prompts ({:?}) in {}; {} training statements checked against {:?}: no overlap; report {}",
        records.len(),
        report.prompts_per_source,
        args.out.display(),
        report.overlap_check.training_statements,
        report.overlap_check.evaluation_sets,
        std::path::Path::new(&report_path).display()
    );
    Ok(())
}

#[derive(Args)]
struct EagleArgs {
    #[command(flatten)]
    task: TaskArgs,
    /// First problem of the split to use.
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// Problems (or prompts of --prompts) to generate responses for and train on (every
    /// --hold-out-every-th is held out).
    #[arg(long, default_value_t = 1000)]
    problems: usize,
    /// With --prompts: the responses' sampling temperature (0: greedy); default the config's.
    #[arg(long)]
    temperature: Option<f64>,
    /// With --prompts: nucleus sampling of the responses; default the config's.
    #[arg(long)]
    top_p: Option<f64>,
    /// With --prompts: the responses' token budget; default the config's.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// The last stage to run: responses, features, or head (all).
    #[arg(long, value_enum, default_value = "head")]
    until: verdict_training::eagle_pipeline::EagleStage,
    #[arg(long, default_value_t = 20)]
    hold_out_every: usize,
    /// Responses decoded together (prompts of equal token count only).
    #[arg(long, default_value_t = 8)]
    generate_batch: usize,
    /// Rows of the head's LM head: the most frequent response tokens.
    #[arg(long, default_value_t = 4096)]
    draft_vocab: usize,
    /// The head's MLP width (the target's is 8960; smaller drafts faster here).
    #[arg(long, default_value_t = 2048)]
    intermediate_size: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Unrolled steps of the training-time test (≥ the γ it will draft).
    #[arg(long, default_value_t = 4)]
    ttt_steps: usize,
    #[arg(long, default_value_t = 2)]
    epochs: usize,
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    /// Problems per optimizer update.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 5)]
    checkpoint_minutes: u64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Responses, features and the training checkpoint.
    #[arg(long, default_value = ".verdict-work/gsm8k/eagle")]
    work: PathBuf,
    /// The head folder (config.json, model.safetensors, report.json).
    #[arg(long, default_value = "heads/gsm8k-eagle3")]
    out: PathBuf,
}

fn run_eagle(args: &EagleArgs) -> Result<()> {
    if let Some(source) = &args.task.source {
        anyhow::bail!("--source {source}: it picks prompts to mine; `eagle` trains on every prompt of --prompts");
    }
    let (config, data_dir) = args.task.config_and_data_dir()?;
    let plan = EaglePlan {
        data_dir,
        split: args.task.split.clone(),
        first: args.first,
        problems: args.problems,
        prompts: args.task.prompts.clone(),
        until: args.until,
        response_sampling: args.task.prompts.as_ref().map(|_| {
            let mut sampling = config.sampling.clone();
            sampling.temperature = args.temperature.unwrap_or(sampling.temperature);
            sampling.top_p = args.top_p.or(sampling.top_p);
            sampling.max_tokens = args.max_tokens.unwrap_or(sampling.max_tokens);
            sampling
        }),
        generate_batch: args.generate_batch,
        hold_out_every: args.hold_out_every,
        draft_vocab: args.draft_vocab,
        intermediate_size: args.intermediate_size,
        heads: args.heads,
        kv_heads: args.kv_heads,
        work: args.work.clone(),
        out: args.out.clone(),
    };
    let options = EagleFitOptions {
        ttt_steps: args.ttt_steps,
        epochs: args.epochs,
        lr: args.lr,
        batch: args.batch,
        checkpoint_secs: args.checkpoint_minutes * 60,
        seed: args.seed,
        ..EagleFitOptions::default()
    };
    train_eagle(&config, &plan, &options)?;
    Ok(())
}

/// The task and the models every step works with.
#[derive(Args, Clone)]
struct TaskArgs {
    /// A verdict config naming the target and draft (`[models]`).
    #[arg(long, short, default_value = "configs/default.toml")]
    config: PathBuf,
    /// `mbpp` (mining and features only): MBPP's Python tasks after the evaluated ones (ids
    /// above 210), in file order, a response's answer being whether its code passes the
    /// task's asserts in the sandbox.
    #[arg(long, default_value = "gsm8k", value_parser = ["gsm8k", "mbpp"])]
    task: String,
    /// Folder holding `<split>.jsonl` (default: $VERDICT_GSM8K, else the fetched copy in the
    /// cache; GSM8K train is in no registry package, so name its folder here).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value = "train")]
    split: String,
    /// A prompts file instead of GSM8K's split (JSON Lines of {"prompt": …} or
    /// {"messages": […]}, e.g. a request log, or `train-head mixture`'s). `eagle` trains on
    /// the target's responses to all of them; `mine` and `features` take those whose
    /// `source` is `--source`, problem ids being their order among those.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Which prompts of `--prompts` to mine, their answers read as that task reads them.
    #[arg(long, value_parser = ["gsm8k", "math"])]
    source: Option<String>,
}

/// Where the draft model's mined labels are kept.
const DRAFT_MODEL_LABELS: &str = "heads/gsm8k_labels.jsonl";

#[derive(Args, Clone)]
struct LabelArgs {
    /// Append-only label file; problems already in it are skipped.
    #[arg(long, default_value = DRAFT_MODEL_LABELS)]
    labels: PathBuf,
}

#[derive(Args, Clone)]
struct FeatureDirArgs {
    /// One safetensors file per problem, plus models.json.
    #[arg(long, default_value = ".verdict-work/gsm8k/features")]
    features: PathBuf,
}

#[derive(Args, Clone)]
struct HeadArgs {
    /// `draft+target` (the paper's main setup) or `target` (target hidden state only).
    #[arg(long, default_value = "draft+target", value_parser = parse_spec)]
    spec: FeatureSpec,
    /// Wanted recall of important tokens on the selection problems; τ is the largest
    /// threshold reaching it.
    #[arg(long, default_value_t = 0.9)]
    min_recall: f64,
    /// Share of problems held out of training to choose C and τ (PAD: the epoch) [default:
    /// 0.1, PAD 0.2].
    #[arg(long, value_parser = parse_share)]
    selection_share: Option<f64>,
    /// Share of problems held out of training and of those choices: the AUC reported
    /// [default: 0.1, PAD 0.2].
    #[arg(long, value_parser = parse_share)]
    validation_share: Option<f64>,
    /// The head file; reports go beside it (.report.json, .report.md) [default:
    /// heads/gsm8k_head.safetensors for `--spec target` (a judge of EAGLE drafts, the name
    /// deployments use), heads/gsm8k_draft_model_head.safetensors for `draft+target`].
    #[arg(long)]
    out: Option<PathBuf>,
}

impl HeadArgs {
    /// `--out`, or the spec's default file.
    fn out(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| match self.spec {
            FeatureSpec::TargetOnly => "heads/gsm8k_head.safetensors".into(),
            FeatureSpec::DraftAndTarget => "heads/gsm8k_draft_model_head.safetensors".into(),
        })
    }
}

fn parse_probability(text: &str) -> Result<f32, String> {
    match text.parse::<f32>() {
        Ok(p) if (0.0..1.0).contains(&p) => Ok(p),
        _ => Err(format!("{text:?} is not a probability in [0, 1)")),
    }
}

fn parse_spec(text: &str) -> Result<FeatureSpec, String> {
    match text {
        "draft+target" => Ok(FeatureSpec::DraftAndTarget),
        "target" => Ok(FeatureSpec::TargetOnly),
        other => Err(format!(
            "unknown feature spec {other:?} (draft+target or target)"
        )),
    }
}

#[derive(Args, Clone)]
struct AllArgs {
    #[command(flatten)]
    mine: MineArgs,
    #[command(flatten)]
    features: FeatureDirArgs,
    #[command(flatten)]
    head: HeadArgs,
}

/// Where PAD's labels and features live.
#[derive(Args, Clone)]
struct PadFileArgs {
    #[arg(long, default_value = "heads/gsm8k_pad_labels.jsonl")]
    pad_labels: PathBuf,
    #[arg(long, default_value = ".verdict-work/gsm8k/pad-features")]
    pad_features: PathBuf,
}

#[derive(Args)]
struct FeaturesArgs {
    /// `autojudge` (last hidden states of both models) or `pad` (target layer L − 8 and
    /// [entropy, p] for the PAD labels).
    #[arg(long, default_value = "autojudge", value_parser = ["autojudge", "pad"])]
    kind: String,
    #[command(flatten)]
    pad: PadFileArgs,
    #[command(flatten)]
    task: TaskArgs,
    #[command(flatten)]
    labels: LabelArgs,
    #[command(flatten)]
    features: FeatureDirArgs,
    /// Capture the target's states alone, loading no draft model: for labels mined with
    /// `mine --eagle-head`, fitted with `fit --spec target`.
    #[arg(long)]
    target_only: bool,
}

#[derive(Args)]
struct FitArgs {
    /// `autojudge` (logistic head) or `pad` (pivot MLP).
    #[arg(long, default_value = "autojudge", value_parser = ["autojudge", "pad"])]
    kind: String,
    #[command(flatten)]
    pad: PadFileArgs,
    /// PAD: accept a candidate iff P(pivot) ≤ sigma (stored in the head as its default).
    #[arg(long, default_value_t = 0.5)]
    sigma: f32,
    /// PAD head file.
    #[arg(long, default_value = "heads/gsm8k_pad_head.safetensors")]
    pad_out: PathBuf,
    #[command(flatten)]
    labels: LabelArgs,
    #[command(flatten)]
    features: FeatureDirArgs,
    #[command(flatten)]
    head: HeadArgs,
    /// Another label file and its features' folder (`LABELS,FEATURES`, repeatable), fitted
    /// together with --labels and --features: each set holds out its own share of problems,
    /// and the report gives each set's validation AUC.
    #[arg(long = "and", value_name = "LABELS,FEATURES", value_parser = parse_label_set)]
    and: Vec<LabelSet>,
}

#[derive(Args, Clone)]
struct MineArgs {
    #[command(flatten)]
    task: TaskArgs,
    #[command(flatten)]
    labels: LabelArgs,
    /// First problem (index into the split).
    #[arg(long, default_value_t = 0)]
    first: usize,
    /// Problems to mine from `first` on.
    #[arg(long, default_value_t = 100)]
    problems: usize,
    /// Cap on the total response length (prefix included) of every generation.
    #[arg(long, default_value_t = 320)]
    max_response_tokens: usize,
    /// Mine the first drafts of this EAGLE-3 head instead of the draft model's (no draft
    /// model is loaded): labels for a judge of EAGLE drafts, fitted with `fit --spec target`.
    #[arg(long)]
    eagle_head: Option<PathBuf>,
    /// Label a draft token the target gives less than this probability important without
    /// regenerating (the AutoJudge paper's shortcut for EAGLE mining); 0 tests every one.
    #[arg(long, default_value_t = 0.0, value_parser = parse_probability)]
    important_below: f32,
    /// With --eagle-head: problems mined together, the continuations they wait for decoded
    /// as one batch (1: one problem at a time) [default: 8 with --eagle-head, else 1].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=32))]
    together: Option<u16>,
    #[command(flatten)]
    pad: PadArgs,
}

#[derive(Args, Clone)]
struct PadArgs {
    /// `autojudge`: Algorithm 1 into --labels. `pad`: rollout labels for a sample of the
    /// mismatches in --labels, into --pad-labels.
    #[arg(long, default_value = "autojudge", value_parser = ["autojudge", "pad"])]
    method: String,
    #[arg(long, default_value = "heads/gsm8k_pad_labels.jsonl")]
    pad_labels: PathBuf,
    /// PAD: target rollouts per side (prefix + target token, prefix + draft token).
    #[arg(long, default_value_t = 4)]
    rollouts: usize,
    /// PAD: candidates to label (a seeded sample of the mined mismatches).
    #[arg(long, default_value_t = 200)]
    candidates: usize,
    /// PAD: pivot iff candidate success rate < alpha × base success rate.
    #[arg(long, default_value_t = 0.8)]
    alpha: f64,
}

impl TaskArgs {
    /// The config, and the folder of the task's data (named, or else the fetched copy).
    fn config_and_data_dir(&self) -> Result<(Config, PathBuf)> {
        let config = Config::load(&self.config)?;
        let cache = verdict::models::cache_dir(config.models.cache_dir.as_deref());
        let data_dir = verdict_eval::datasets::gsm8k_dir(self.data_dir.clone(), &cache);
        Ok((config, data_dir))
    }

    fn problems(&self) -> Result<Vec<gsm8k::Problem>> {
        anyhow::ensure!(self.task == "gsm8k", "--task {}: this step takes GSM8K problems only (MBPP mines AutoJudge labels)", self.task);
        gsm8k::load(&self.config_and_data_dir()?.1, &self.split)
    }

    /// MBPP's tasks after the evaluated ones, and the task that runs their asserts.
    fn mbpp(&self) -> Result<(MbppTests, Vec<mbpp::Problem>)> {
        let config = Config::load(&self.config)?;
        let cache = verdict::models::cache_dir(config.models.cache_dir.as_deref());
        let problems: Vec<mbpp::Problem> = packaged::MBPP
            .docs::<mbpp::Problem>(&cache)?
            .into_iter()
            .filter(|p| p.task_id > mbpp::LAST_EVALUATION_TASK)
            .collect();
        anyhow::ensure!(!problems.is_empty(), "MBPP holds no task after the evaluated ones (ids above {})", mbpp::LAST_EVALUATION_TASK);
        let sandbox = Sandbox::new(Sandbox::default_python(), SandboxLimits::default())?;
        Ok((MbppTests { sandbox: Arc::new(sandbox) }, problems))
    }

    /// `--prompts` and `--source` come together or not at all.
    fn check_prompt_source(&self) -> Result<()> {
        if let (Some(path), "mbpp") = (&self.prompts, self.task.as_str()) {
            anyhow::bail!("--prompts {} with --task mbpp: MBPP's tasks carry their own prompts and tests; name one or the other", path.display());
        }
        match (&self.prompts, &self.source) {
            (Some(path), None) => anyhow::bail!("--prompts {}: say which prompts to mine with --source (gsm8k or math)", path.display()),
            (None, Some(source)) => anyhow::bail!("--source {source}: it picks prompts of a --prompts file, and none was named"),
            _ => Ok(()),
        }
    }

    /// The single-turn prompts of `--prompts` from `--source`, in file order; `None` without
    /// `--prompts`.
    fn given_prompts(&self) -> Result<Option<Vec<String>>> {
        self.check_prompt_source()?;
        let (Some(path), Some(source)) = (&self.prompts, self.source.as_deref()) else {
            return Ok(None);
        };
        let prompts: Vec<String> = verdict_eval::prompts::load(path)?
            .into_iter()
            .filter(|r| r.source == source)
            .map(|r| r.prompt.ok_or_else(|| anyhow::anyhow!("{}: record {:?} is a chat; mining takes single prompts", path.display(), r.id)))
            .collect::<Result<_>>()?;
        anyhow::ensure!(!prompts.is_empty(), "{} holds no prompt from source {source:?}", path.display());
        Ok(Some(prompts))
    }

    /// The prompt of each problem id: `--prompts`' or the GSM8K split's.
    fn prompt_of(&self) -> Result<Box<dyn Fn(usize) -> Result<String>>> {
        let prompts: Vec<String> = match self.given_prompts()? {
            Some(prompts) => prompts,
            None if self.task == "mbpp" => {
                let (task, problems) = self.mbpp()?;
                problems.iter().map(|p| task.prompt(p)).collect()
            }
            None => self.problems()?.iter().map(|p| gsm8k::Gsm8k.prompt(p)).collect(),
        };
        let from = self.prompts.as_ref().map_or_else(|| format!("split {}", self.split), |p| p.display().to_string());
        Ok(Box::new(move |id| prompts.get(id).cloned().ok_or_else(|| anyhow::anyhow!("problem {id} is not in {from}"))))
    }

    /// Algorithm 1 over this task's problems with `engine`.
    fn mine(&self, engine: &mut impl MiningEngine, plan: &MiningPlan, labels: &Path) -> Result<()> {
        match (self.given_prompts()?, self.source.as_deref()) {
            (Some(prompts), Some("math")) => mine(engine, &GivenPrompts(Math), &prompts, plan, labels)?,
            (Some(prompts), _) => mine(engine, &GivenPrompts(gsm8k::Gsm8k), &prompts, plan, labels)?,
            (None, _) if self.task == "mbpp" => {
                let (task, problems) = self.mbpp()?;
                mine(engine, &task, &problems, plan, labels)?
            }
            (None, _) => mine(engine, &gsm8k::Gsm8k, &self.problems()?, plan, labels)?,
        };
        Ok(())
    }

    fn engines(&self) -> Result<MistralEngines> {
        let config = Config::load(&self.config)?;
        MistralEngines::new(&LoadedModels::load(&config)?)
    }
}

impl MineArgs {
    /// The mining run these flags ask for, `together` problems at a time.
    fn plan(&self, together: usize) -> MiningPlan {
        MiningPlan {
            problems: self.first..self.first + self.problems,
            max_response_tokens: self.max_response_tokens,
            important_below: (self.important_below > 0.0).then_some(self.important_below),
            together,
        }
    }
}

/// `--together` is for EAGLE mining only (checked before any model loads).
fn check_together(args: &MineArgs) -> Result<()> {
    match args.together.filter(|&n| n > 1 && args.eagle_head.is_none()) {
        Some(together) => anyhow::bail!("--together {together}: only EAGLE mining (--eagle-head) decodes problems together; the draft model's predictions take one forward per continuation"),
        None => Ok(()),
    }
}

fn run_mine(args: &MineArgs, engines: &mut MistralEngines) -> Result<()> {
    if args.pad.method == "pad" {
        let plan = PadPlan {
            rollouts: args.pad.rollouts,
            alpha: args.pad.alpha,
            candidates: args.pad.candidates,
            max_response_tokens: args.max_response_tokens,
            ..PadPlan::default()
        };
        let problems = args.task.problems()?;
        // Both sides' rollouts of a candidate have equal lengths: one batch of 2N.
        engines.set_target_batch(2 * plan.rollouts);
        return mine_pivots(
            engines,
            &gsm8k::Gsm8k,
            &problems,
            &args.labels.labels,
            &plan,
            &args.pad.pad_labels,
        );
    }
    args.task.mine(engines, &args.plan(1), &args.labels.labels)
}

/// Problems an EAGLE mining run mines together unless told: a batch of continuations
/// decodes far more tokens a second than one does, and waits for the longest of them.
const EAGLE_MINED_TOGETHER: u16 = 8;

/// Each prefix cache's bound when problems are mined together: the caches are then never
/// cleared. What a step reuses is each running problem's response and its latest swap, well
/// under this; a larger bound only holds finished problems longer (two caches, each bound
/// apart).
const TOGETHER_CACHE_BYTES: usize = 1 << 30;

/// Algorithm 1 over an EAGLE head's first drafts, into `--labels`.
fn run_eagle_mine(args: &MineArgs) -> Result<()> {
    let head = args.eagle_head.as_ref().ok_or_else(|| anyhow::anyhow!("--eagle-head"))?;
    anyhow::ensure!(
        args.pad.method == "autojudge",
        "--eagle-head mines AutoJudge labels (--method autojudge); PAD's rollouts compare the draft model's tokens"
    );
    anyhow::ensure!(
        args.labels.labels != Path::new(DRAFT_MODEL_LABELS),
        "--eagle-head: name the label file with --labels (e.g. heads/eagle_labels.jsonl); {DRAFT_MODEL_LABELS} holds the draft model's labels, and the two must not mix"
    );
    args.task.check_prompt_source()?;
    let config = Config::load(&args.task.config)?;
    let models = LoadedModels::load_with_draft(&config, false)?;
    let mut engine = EagleMiningEngine::new(&models, head)?;
    let together = usize::from(args.together.unwrap_or(EAGLE_MINED_TOGETHER));
    if together > 1 {
        engine.engines().batch_continuations(together, TOGETHER_CACHE_BYTES);
    }
    args.task.mine(&mut engine, &args.plan(together), &args.labels.labels)
}

fn prompt_lookup<'a>(
    problems: &'a [gsm8k::Problem],
    split: &str,
) -> impl Fn(usize) -> Result<String> + 'a {
    let split = split.to_string();
    move |id| {
        let problem = problems
            .get(id)
            .ok_or_else(|| anyhow::anyhow!("problem {id} is not in split {split}"))?;
        Ok(gsm8k::Gsm8k.prompt(problem))
    }
}

fn run_features(
    task: &TaskArgs,
    labels: &LabelArgs,
    features: &FeatureDirArgs,
    engines: &mut MistralEngines,
) -> Result<()> {
    let dir = &features.features;
    std::fs::create_dir_all(dir)?;
    let loaded = engines.models().clone();
    if FeatureModels::path(dir).exists() {
        FeatureModels::load(dir)?.check_same(&loaded, dir)?;
    } else {
        loaded.save(dir)?;
    }
    compute_features(engines, task.prompt_of()?, &labels.labels, dir)
}

fn run_fit(labels: &LabelArgs, features: &FeatureDirArgs, head: &HeadArgs, more: &[LabelSet]) -> Result<()> {
    let defaults = FitOptions::default();
    let options = FitOptions {
        min_recall: head.min_recall,
        selection_share: head.selection_share.unwrap_or(defaults.selection_share),
        validation_share: head.validation_share.unwrap_or(defaults.validation_share),
        ..defaults
    };
    check_shares(options.selection_share, options.validation_share)?;
    let mut sets = vec![LabelSet { labels: labels.labels.clone(), features: features.features.clone() }];
    sets.extend_from_slice(more);
    fit_autojudge_head(&sets, head.spec, &options, &head.out())?;
    Ok(())
}

/// PAD's fit options, with the shares asked for.
fn pad_options(head: &HeadArgs) -> Result<PadFitOptions> {
    let defaults = PadFitOptions::default();
    let options = PadFitOptions {
        selection_share: head.selection_share.unwrap_or(defaults.selection_share),
        validation_share: head.validation_share.unwrap_or(defaults.validation_share),
        ..defaults
    };
    check_shares(options.selection_share, options.validation_share)?;
    Ok(options)
}

/// Training keeps some problems only if the two held-out shares leave it some.
fn check_shares(selection: f64, validation: f64) -> Result<()> {
    anyhow::ensure!(
        selection + validation < 1.0,
        "--selection-share {selection} and --validation-share {validation} leave no problems to train on (they must sum to less than 1)"
    );
    Ok(())
}

/// A share of problems: a number in (0, 1).
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if share > 0.0 && share < 1.0 => Ok(share),
        _ => Err(format!("{text:?} is not a share of problems: give a number between 0 and 1, such as 0.1")),
    }
}

/// `LABELS,FEATURES`: a label file and its features' folder.
fn parse_label_set(text: &str) -> Result<LabelSet, String> {
    match text.split_once(',') {
        Some((labels, features)) if !labels.is_empty() && !features.is_empty() => {
            Ok(LabelSet { labels: labels.into(), features: features.into() })
        }
        _ => Err(format!("{text:?} is not LABELS,FEATURES (a label file and its features folder)")),
    }
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                "verdict=info,verdict_training=info,train_head=info,mistralrs_core=warn".into()
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    verdict::memory::keep_freed_memory();
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Mine(args)) if args.eagle_head.is_some() => run_eagle_mine(&args),
        Some(Command::Mine(args)) => {
            check_together(&args)?;
            run_mine(&args, &mut args.task.engines()?)
        }
        Some(Command::Features(args)) if args.kind == "pad" => {
            let mut engines = args.task.engines()?;
            let problems = args.task.problems()?;
            std::fs::create_dir_all(&args.pad.pad_features)?;
            engines.models().save(&args.pad.pad_features)?;
            compute_pad_features(
                &mut engines,
                prompt_lookup(&problems, &args.task.split),
                &args.pad.pad_labels,
                &args.pad.pad_features,
            )
        }
        Some(Command::Features(args)) => {
            let mut engines = match args.target_only {
                true => MistralEngines::target_only(&LoadedModels::load_with_draft(&Config::load(&args.task.config)?, false)?)?,
                false => args.task.engines()?,
            };
            run_features(&args.task, &args.labels, &args.features, &mut engines)
        }
        Some(Command::Fit(args)) if args.kind == "pad" => fit_pad_head(
            &args.pad.pad_labels,
            &args.pad.pad_features,
            &FeatureModels::load(&args.pad.pad_features)?,
            args.sigma,
            &pad_options(&args.head)?,
            &args.pad_out,
        ),
        Some(Command::Fit(args)) => run_fit(&args.labels, &args.features, &args.head, &args.and),
        Some(Command::Eagle(args)) => run_eagle(&args),
        Some(Command::Mixture(args)) => run_mixture(&args),
        Some(Command::SvProfile(args)) => {
            let (config, data_dir) = args.task.config_and_data_dir()?;
            let plan = SvProfilePlan {
                data_dir,
                split: args.task.split.clone(),
                first: args.first,
                problems: args.problems,
                hold_out_every: args.hold_out_every,
                bins: args.bins,
                min_count: args.min_count,
                out: args.out.clone(),
            };
            let report = profile_sv(&config, &plan)?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Some(Command::EagleReplay(args)) => {
            let config = Config::load(&args.config)?;
            let tree = args.tree.clone().unwrap_or_else(|| DraftTree::chain(args.gamma));
            let replay = replay_held_out(&config, &args.head, args.weights, &args.work, args.hold_out_every, &tree, args.min_confidence)?;
            println!(
                "{}: τ {:.3} over {} steps (draft tree {}: depth {}, {} nodes; min confidence {}: {:.2} drafts verified per step), accepted per draft position {:?}",
                args.head.display(),
                replay.tau(),
                replay.steps,
                replay.tree,
                replay.gamma,
                replay.nodes,
                replay.min_confidence,
                replay.drafts_per_step(),
                replay.accepted_per_position
            );
            Ok(())
        }
        None => {
            let all = cli.all;
            check_together(&all.mine)?;
            let mut engines = all.mine.task.engines()?;
            run_mine(&all.mine, &mut engines)?;
            run_features(
                &all.mine.task,
                &all.mine.labels,
                &all.features,
                &mut engines,
            )?;
            drop(engines);
            run_fit(&all.mine.labels, &all.features, &all.head, &[])
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// No subcommand defines a flag twice: with two flattened groups that both define one (as
    /// `eagle --prompts` and the task's `--prompts` once did) the value silently went to one
    /// of them. (clap's own `debug_assert` checks nothing in a release build.)
    #[test]
    fn no_flag_is_defined_twice() {
        let cli = super::Cli::command();
        for command in std::iter::once(&cli).chain(cli.get_subcommands()) {
            let mut ids = std::collections::HashSet::new();
            for arg in command.get_arguments() {
                assert!(ids.insert(arg.get_id().clone()), "`{}` defines {} twice", command.get_name(), arg.get_id());
            }
        }
    }

    /// `fit`'s held-out shares: a bad one is named, and shares that leave nothing to train
    /// on are refused; PAD takes the flags too (it once ignored them).
    #[test]
    fn held_out_shares_are_checked_and_reach_pad() {
        use clap::Parser;
        let Err(err) = super::Cli::try_parse_from(["train-head", "fit", "--selection-share", "1.5"]) else { panic!("a share of 1.5 was taken") };
        let err = err.to_string();
        assert!(err.contains("\"1.5\" is not a share of problems"), "{err}");
        let err = format!("{:#}", super::check_shares(0.6, 0.4).unwrap_err());
        assert!(err.contains("--selection-share 0.6 and --validation-share 0.4 leave no problems"), "{err}");
        let cli = super::Cli::try_parse_from(["train-head", "fit", "--kind", "pad", "--validation-share", "0.3"]).unwrap();
        let Some(super::Command::Fit(args)) = cli.command else { panic!("not a fit") };
        let options = super::pad_options(&args.head).unwrap();
        assert_eq!((options.selection_share, options.validation_share), (0.2, 0.3));
    }
}
