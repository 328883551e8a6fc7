//! `verdict op-profile`: where one decode step of the target goes, op by op. The patched
//! GGUF Qwen2 forward times each op while asked (the patched mistral.rs); plain decoding of the
//! measured prompt for N + 1 tokens, less the same prompt for 1 token, leaves N decode
//! steps. Each matmul's time is set against the bytes of weights it reads, and those
//! against what this machine streams; what the ops leave of the step's wall clock is the
//! engine's own work (sampling, scheduling, hand-offs to the compute pool).

use std::{collections::BTreeMap, path::Path};

use anyhow::{bail, Result};
use serde::Serialize;
use verdict::{
    config::{Config, SamplingConfig},
    engine::{generate, Engine, LoadedModels, Prompt},
    models::ModelSource,
};

use crate::{
    forward_cost::measured_prompt,
    memory_bandwidth::{streaming_read, weights_by_role, StreamingRead},
};

/// One op's share of a decode step.
#[derive(Clone, Debug, Serialize)]
pub struct OpCost {
    pub op: String,
    pub calls_per_step: f64,
    pub ms_per_step: f64,
    /// For matmuls: the weights read per step, their quant types and the rate reached.
    pub weight_bytes: Option<u64>,
    pub quant_types: Vec<String>,
    pub gb_per_second: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpProfile {
    pub prompt_tokens: usize,
    pub decode_steps: u64,
    /// The engine's own timing of a decode step (what `forward-cost` reports as one token).
    pub step_ms: f64,
    pub ops: Vec<OpCost>,
    /// The step less the ops timed inside the forward.
    pub outside_ops_ms: f64,
    pub streaming_read: StreamingRead,
}

/// Op times, summed over `repeats` requests of `max_tokens` + 1 tokens less as many of one.
pub fn measure(config: &Config, max_tokens: usize, repeats: usize, context_problems: usize) -> Result<OpProfile> {
    if max_tokens == 0 || repeats == 0 {
        bail!("--max-tokens and --repeats must be at least 1");
    }
    let models = LoadedModels::load_with_draft(config, false)?;
    let ModelSource::Gguf(path) = &models.target_source else {
        bail!("op-profile times the GGUF Qwen2 forward; the target {} is not a GGUF file", models.target_source.path().display());
    };
    let prompt = Prompt::Chat(measured_prompt(context_problems));
    let decode = SamplingConfig { temperature: 0.0, max_tokens: max_tokens + 1, ..SamplingConfig::default() };
    let prompt_only = SamplingConfig { max_tokens: 1, ..decode.clone() };
    let runtime = tokio::runtime::Runtime::new()?;
    let (totals, steps, step_seconds, prompt_tokens) = runtime.block_on(async {
        let plain = Engine::plain(&models, 1).await;
        // Warm up: the first request pays for allocations and page faults.
        generate(&plain.mistralrs, &prompt, &prompt_only).await?;
        let mut totals: BTreeMap<&'static str, (f64, f64)> = BTreeMap::new();
        let (mut steps, mut seconds, mut prompt_tokens) = (0u64, 0f64, 0);
        for _ in 0..repeats {
            for (sampling, sign) in [(&decode, 1.0), (&prompt_only, -1.0)] {
                mistralrs_core::op_profile::take();
                mistralrs_core::op_profile::set_enabled(true);
                let g = generate(&plain.mistralrs, &prompt, sampling).await;
                mistralrs_core::op_profile::set_enabled(false);
                let g = g?;
                for (op, calls, s) in mistralrs_core::op_profile::take() {
                    let total = totals.entry(op).or_default();
                    total.0 += sign * calls as f64;
                    total.1 += sign * s;
                }
                if sign > 0.0 {
                    // The first completion token comes from the prompt forward.
                    steps += g.completion_tokens.saturating_sub(1) as u64;
                    seconds += g.completion_seconds;
                    prompt_tokens = g.prompt_tokens;
                }
            }
        }
        anyhow::Ok((totals, steps, seconds, prompt_tokens))
    })?;
    if steps == 0 {
        bail!("no decode step was timed: the answers ended at their first token");
    }
    let weights = weights_by_role(path)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(profile(totals, steps, step_seconds, prompt_tokens, &weights, streaming_read(threads, 1 << 30, 5)))
}

/// The profile of `steps` decode steps from op totals `(calls, seconds)`.
fn profile(
    totals: BTreeMap<&'static str, (f64, f64)>,
    steps: u64,
    step_seconds: f64,
    prompt_tokens: usize,
    weights: &BTreeMap<String, (u64, std::collections::BTreeSet<String>)>,
    streaming_read: StreamingRead,
) -> OpProfile {
    let per_step = |x: f64| x / steps as f64;
    let mut ops: Vec<OpCost> = totals
        .into_iter()
        .map(|(op, (calls, seconds))| {
            let ms = 1e3 * per_step(seconds);
            let role = weights.get(op);
            OpCost {
                op: op.to_string(),
                calls_per_step: per_step(calls),
                ms_per_step: ms,
                weight_bytes: role.map(|(bytes, _)| *bytes),
                quant_types: role.map(|(_, types)| types.iter().cloned().collect()).unwrap_or_default(),
                gb_per_second: role.map(|(bytes, _)| *bytes as f64 / ms / 1e6),
            }
        })
        .collect();
    ops.sort_by(|a, b| b.ms_per_step.total_cmp(&a.ms_per_step));
    let step_ms = 1e3 * per_step(step_seconds);
    let inside: f64 = ops.iter().map(|o| o.ms_per_step).sum();
    OpProfile { prompt_tokens, decode_steps: steps, step_ms, ops, outside_ops_ms: step_ms - inside, streaming_read }
}

/// The profile as a Markdown table.
pub fn table(p: &OpProfile) -> String {
    let mut out = format!(
        "{} decode steps after a {}-token prompt: {:.1} ms a step; this machine streams {:.1} GB/s ({} threads)\n\n| op | calls / step | ms / step | share of step | weights read / step | quant types | GB/s | share of the machine's rate |\n|---|---|---|---|---|---|---|---|\n",
        p.decode_steps, p.prompt_tokens, p.step_ms, p.streaming_read.gb_per_second, p.streaming_read.threads
    );
    let share = |ms: f64| format!("{:.1} %", 100.0 * ms / p.step_ms);
    for o in &p.ops {
        let (bytes, rate, of_machine) = match (o.weight_bytes, o.gb_per_second) {
            (Some(b), Some(r)) => (format!("{:.1} MB", b as f64 / 1e6), format!("{r:.1}"), format!("{:.0} %", 100.0 * r / p.streaming_read.gb_per_second)),
            _ => ("–".into(), "–".into(), "–".into()),
        };
        out += &format!(
            "| {} | {:.1} | {:.2} | {} | {bytes} | {} | {rate} | {of_machine} |\n",
            o.op,
            o.calls_per_step,
            o.ms_per_step,
            share(o.ms_per_step),
            if o.quant_types.is_empty() { "–".to_string() } else { o.quant_types.join(", ") }
        );
    }
    out += &format!("| outside the forward's ops (sampling, scheduling, hand-offs) | – | {:.2} | {} | – | – | – | – |\n", p.outside_ops_ms, share(p.outside_ops_ms));
    out
}

/// Writes `p` as JSON to `out`.
pub fn write(p: &OpProfile, out: &Path) -> Result<()> {
    std::fs::write(out, serde_json::to_string_pretty(p)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn op_totals_become_per_step_costs_against_the_weights_they_read() {
        let totals = BTreeMap::from([("ffn_down", (28.0, 0.070)), ("rope", (28.0, 0.010)), ("output", (1.0, 0.020))]);
        let weights = BTreeMap::from([
            ("ffn_down".to_string(), (140_000_000u64, BTreeSet::from(["Q4K".to_string(), "Q6K".to_string()]))),
            ("output".to_string(), (200_000_000u64, BTreeSet::from(["Q6K".to_string()]))),
        ]);
        let read = StreamingRead { threads: 2, bytes: 1 << 30, gb_per_second: 40.0 };
        // Two steps of 60 ms each: ffn_down 35 ms a step reading 140 MB is 4 GB/s.
        let p = profile(totals, 2, 0.120, 100, &weights, read);
        assert_eq!(p.ops.iter().map(|o| o.op.as_str()).collect::<Vec<_>>(), ["ffn_down", "output", "rope"]);
        let down = &p.ops[0];
        assert!((down.ms_per_step - 35.0).abs() < 1e-9 && (down.calls_per_step - 14.0).abs() < 1e-12);
        assert!((down.gb_per_second.unwrap() - 4.0).abs() < 1e-9, "{down:?}");
        assert_eq!(down.quant_types, ["Q4K", "Q6K"]);
        assert_eq!(p.ops[2].gb_per_second, None, "rope reads no weights");
        // 60 ms a step less 35 + 10 + 5 inside the ops.
        assert!((p.outside_ops_ms - 10.0).abs() < 1e-9, "{}", p.outside_ops_ms);
        assert!(table(&p).contains("| ffn_down | 14.0 | 35.00 | 58.3 % | 140.0 MB | Q4K, Q6K | 4.0 | 10 % |"), "{}", table(&p));
    }
}
