//! `verdict forward-cost`: what one target forward costs over 1, γ+1 … tokens on this
//! machine, measured inside the engine, plus decode and prompt throughput, for each CPU
//! quantized matmul kernel, interleaved. Speculation pays only if verifying m tokens costs
//! far less than m single-token forwards.

use std::sync::Arc;

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use verdict::{
    config::{Config, SamplingConfig},
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    kernels::{ForwardThread, QuantKernel},
    metrics::{Counters, Metrics},
    rules::BaseRule,
};

#[derive(Debug, Serialize)]
pub struct ForwardCost {
    pub kernel: QuantKernel,
    pub forward_thread: ForwardThread,
    /// Tokens in the forward.
    pub tokens: usize,
    pub milliseconds: f64,
    /// Cost relative to a single-token forward with the same kernel.
    pub ratio_to_one: f64,
    pub samples: u64,
}

#[derive(Debug, Serialize)]
pub struct Throughput {
    pub kernel: QuantKernel,
    pub forward_thread: ForwardThread,
    /// Plain greedy decoding, prompt excluded.
    pub decode_tokens_per_second: f64,
    /// Prompt processing of a few GSM8K-style problems in one prompt (`prompt_tokens` long).
    pub prompt_tokens_per_second: f64,
    pub prompt_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct ForwardCostReport {
    /// Tokens of the prompt that decoding and verifying follow (`--context-problems`).
    pub measured_prompt_tokens: usize,
    pub forwards: Vec<ForwardCost>,
    pub throughput: Vec<Throughput>,
}

const PROMPT: &str = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Explain step by step.";

/// GSM8K training problems: the prompt throughput's prompt, and context before [`PROMPT`].
fn other_problems() -> [&'static str; 6] {
    [
        PROMPT,
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?",
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?",
        "Julie is reading a 120-page book. Yesterday, she was able to read 12 pages and today, she read twice as many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how many pages should she read?",
        "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
        "Mark has a garden with flowers. He planted plants of three different colors in it. Ten of them are yellow, and there are 80% more of those in purple. There are only 25% as many green flowers as there are yellow and purple flowers. How many flowers does Mark have in his garden?",
    ]
}

fn long_prompt() -> String {
    problems_prompt(other_problems())
}

/// One prompt asking for the last of `problems`.
fn problems_prompt<'a>(problems: impl IntoIterator<Item = &'a str>) -> String {
    let problems: Vec<&str> = problems.into_iter().collect();
    format!("Here are some problems. Solve only the last one.\n\n{}", problems.join("\n\n"))
}

/// `PROMPT` after `context_problems` other problems (cycled), so decoding and verifying run
/// at a longer context; `PROMPT` alone for 0.
pub fn measured_prompt(context_problems: usize) -> String {
    if context_problems == 0 {
        return PROMPT.to_string();
    }
    let before = other_problems().into_iter().skip(1).cycle().take(context_problems);
    problems_prompt(before.chain([PROMPT]))
}

/// What each measured request is.
#[derive(Clone, Copy, Debug)]
pub struct Requests {
    /// Tokens generated per request.
    pub max_tokens: usize,
    /// Rounds over every kernel.
    pub repeats: usize,
    /// Other problems before the measured one, ≈ 60 tokens each (0: the measured one alone).
    pub context_problems: usize,
}

/// Accumulates one (kernel, size) cell over the interleaved repeats.
#[derive(Default, Clone, Copy)]
struct Cell {
    seconds: f64,
    samples: u64,
}

/// Decode steps of plain decoding give the 1-token cost; the verify forwards of speculative
/// engines with γ = m − 1 give the m-token cost (the target scores γ + 1 positions). Every
/// repeat runs every kernel with every forward thread on the same prompts, so machine noise
/// hits them alike.
pub fn measure(
    config: &Config,
    sizes: &[usize],
    kernels: &[QuantKernel],
    threads: &[ForwardThread],
    Requests { max_tokens, repeats, context_problems }: Requests,
) -> Result<ForwardCostReport> {
    // Kernels are compared on the same weights: blocks, with panels beside them.
    QuantKernel::hold_weights_once(false);
    // The multi-token costs come from the verify forwards of draft-model engines, whatever
    // proposer the config serves with.
    let models = LoadedModels::load_with_draft(config, sizes.iter().any(|&m| m > 1))?;
    let runtime = tokio::runtime::Runtime::new()?;
    let sampling = SamplingConfig {
        temperature: 0.0,
        max_tokens,
        ..SamplingConfig::default()
    };
    let one_token = SamplingConfig {
        max_tokens: 1,
        ..sampling.clone()
    };
    let prompt = Prompt::Chat(measured_prompt(context_problems));
    let long = Prompt::Chat(long_prompt());
    let initial = QuantKernel::selected();
    let report = runtime.block_on(async {
        let plain = Engine::plain(&models, 1).await;
        let mut engines = Vec::new();
        for &m in sizes.iter().filter(|&&m| m > 1) {
            let metrics = Arc::new(Metrics::default());
            let engine = Engine::speculative(&models, SpeculativeSetup { gamma: m - 1, stack: JudgeStack::lossless(BaseRule::Exact), seed: 0, metrics: metrics.clone(), scheduling: Scheduling::from(1) })
            .await?;
            engines.push((m, engine, metrics));
        }
        let variants: Vec<(QuantKernel, ForwardThread)> =
            kernels.iter().flat_map(|&k| threads.iter().map(move |&t| (k, t))).collect();
        let bar = ProgressBar::new((repeats * variants.len()) as u64).with_style(
            ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed} < {eta}]")?,
        );
        bar.set_message("forward-cost");
        let mut decode = vec![Cell::default(); variants.len()];
        let mut prompt_cells = vec![Cell::default(); variants.len()];
        let mut verify = vec![vec![Cell::default(); engines.len()]; variants.len()];
        let mut prompt_tokens = 0;
        let mut measured_prompt_tokens = 0;
        for _ in 0..repeats {
            for (ki, (kernel, thread)) in variants.iter().enumerate() {
                kernel.select();
                thread.select();
                let g = generate(&plain.mistralrs, &prompt, &sampling).await?;
                measured_prompt_tokens = g.prompt_tokens;
                // The first completion token comes from the prompt forward.
                decode[ki].seconds += g.completion_seconds;
                decode[ki].samples += g.completion_tokens.saturating_sub(1) as u64;
                // One new token: the request is the prompt forward (mistral.rs 0.8.1 reports
                // no prompt time on the CPU, so the request's wall clock stands for it).
                let p = generate(&plain.mistralrs, &long, &one_token).await?;
                prompt_cells[ki].seconds += p.seconds;
                prompt_cells[ki].samples += p.prompt_tokens as u64;
                prompt_tokens = p.prompt_tokens;
                for (ei, (_, engine, metrics)) in engines.iter().enumerate() {
                    let before = metrics.snapshot();
                    generate(&engine.mistralrs, &prompt, &sampling).await?;
                    engine.settle().await;
                    let (seconds, steps) = verify_delta(&before, &metrics.snapshot());
                    verify[ki][ei].seconds += seconds;
                    verify[ki][ei].samples += steps;
                }
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        let mut forwards = Vec::new();
        let mut throughput = Vec::new();
        for (ki, &(kernel, forward_thread)) in variants.iter().enumerate() {
            let one = 1000.0 * decode[ki].seconds / decode[ki].samples.max(1) as f64;
            forwards.push(ForwardCost {
                kernel,
                forward_thread,
                tokens: 1,
                milliseconds: one,
                ratio_to_one: 1.0,
                samples: decode[ki].samples,
            });
            for (ei, (m, _, _)) in engines.iter().enumerate() {
                let cell = verify[ki][ei];
                let ms = 1000.0 * cell.seconds / cell.samples.max(1) as f64;
                forwards.push(ForwardCost {
                    kernel,
                    forward_thread,
                    tokens: *m,
                    milliseconds: ms,
                    ratio_to_one: ms / one,
                    samples: cell.samples,
                });
            }
            throughput.push(Throughput {
                kernel,
                forward_thread,
                decode_tokens_per_second: decode[ki].samples as f64 / decode[ki].seconds,
                prompt_tokens_per_second: prompt_cells[ki].samples as f64
                    / prompt_cells[ki].seconds,
                prompt_tokens,
            });
        }
        anyhow::Ok(ForwardCostReport {
            measured_prompt_tokens,
            forwards,
            throughput,
        })
    });
    initial.select();
    ForwardThread::ComputePool.select();
    report
}

/// Verify seconds and verify steps (prompt steps excluded) between two snapshots.
fn verify_delta(before: &Counters, after: &Counters) -> (f64, u64) {
    let steps = |c: &Counters| c.steps - c.prefill_steps;
    (
        after.verify_seconds - before.verify_seconds,
        steps(after) - steps(before),
    )
}
