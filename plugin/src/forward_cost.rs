//! `verdict forward-cost`: what one target forward costs over 1, γ+1 … tokens on this
//! machine, measured inside the engine. Speculation pays only if verifying m tokens costs
//! far less than m single-token forwards.

use std::sync::Arc;

use anyhow::Result;
use serde::Serialize;

use crate::{
    config::{Config, SamplingConfig},
    engine::{generate, Engine, LoadedModels, Prompt},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
};

#[derive(Debug, Serialize)]
pub struct ForwardCost {
    /// Tokens in the forward.
    pub tokens: usize,
    pub milliseconds: f64,
    /// Cost relative to a single-token forward.
    pub ratio_to_one: f64,
    pub samples: u64,
}

const PROMPT: &str = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May? Explain step by step.";

/// Decode steps of plain decoding give the 1-token cost; the verify forwards of speculative
/// engines with γ = m − 1 give the m-token cost (the target scores γ + 1 positions).
pub fn measure(
    config: &Config,
    sizes: &[usize],
    max_tokens: usize,
    repeats: usize,
) -> Result<Vec<ForwardCost>> {
    let models = LoadedModels::load(config)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let sampling = SamplingConfig {
        temperature: 0.0,
        max_tokens,
        ..SamplingConfig::default()
    };
    let prompt = Prompt::Chat(PROMPT.to_string());
    runtime.block_on(async {
        let plain = Engine::plain(&models, 1).await;
        let mut engines = Vec::new();
        for &m in sizes.iter().filter(|&&m| m > 1) {
            let metrics = Arc::new(Metrics::default());
            let engine = Engine::speculative(
                &models,
                m - 1,
                JudgeStack::lossless(BaseRule::Exact),
                0,
                metrics.clone(),
                1,
            )
            .await?;
            engines.push((m, engine, metrics));
        }
        let (mut decode_seconds, mut decode_steps) = (0.0, 0u64);
        for _ in 0..repeats {
            let g = generate(&plain.mistralrs, &prompt, &sampling).await?;
            // The first completion token comes from the prompt forward.
            decode_seconds += g.completion_seconds;
            decode_steps += g.completion_tokens.saturating_sub(1) as u64;
            for (_, engine, _) in &engines {
                generate(&engine.mistralrs, &prompt, &sampling).await?;
                engine.rule.as_ref().unwrap().settle().await;
            }
        }
        let one = 1000.0 * decode_seconds / decode_steps.max(1) as f64;
        let mut costs = vec![ForwardCost {
            tokens: 1,
            milliseconds: one,
            ratio_to_one: 1.0,
            samples: decode_steps,
        }];
        for (m, _, metrics) in &engines {
            let c = metrics.snapshot();
            let ms = 1000.0 * Metrics::mean_verify_seconds(&c);
            costs.push(ForwardCost {
                tokens: *m,
                milliseconds: ms,
                ratio_to_one: ms / one,
                samples: c.steps - c.prefill_steps,
            });
        }
        Ok(costs)
    })
}
