//! EAGLE-3 drafts with DropMatch deciding, from Rust: load the target alone, load the head as
//! the proposer (no draft model), build the speculative engine with the config's judges,
//! send a request, read τ and the drafting cost.
//!
//! cargo run --release -p verdict --example eagle_dropmatch -- configs/eagle-dropmatch.toml "What is 17 * 23?"

use std::sync::Arc;

use anyhow::Result;
use verdict::{
    config::Config,
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    metrics::Metrics,
};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let config = Config::load(args.next().as_deref().unwrap_or("configs/eagle-dropmatch.toml").as_ref())?;
    let prompt = args.next().unwrap_or_else(|| "What is 17 * 23?".to_string());

    // With `proposer = "eagle"` only the target loads.
    let models = LoadedModels::load(&config)?;
    // Refused, naming both models, when the head was trained for another target.
    let head = models.eagle_proposer(&config)?;
    let stack = models.configured_stack(&config)?;
    println!("judge stack: {}", stack.name);
    tokio::runtime::Runtime::new()?.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let s = &config.speculative;
        let engine = Engine::with_proposer(&models, head, SpeculativeSetup { gamma: s.gamma, stack, seed: s.seed, metrics: metrics.clone(), scheduling: Scheduling::from(1) }).await?;
        let answer = generate(&engine.mistralrs, &Prompt::Chat(prompt), &config.sampling).await?;
        engine.settle().await;
        println!("{}", answer.text);
        let c = metrics.snapshot();
        println!(
            "{:.1} tokens/s, τ = {:.2}, {:.1} ms per drafted token, {:.1}% of drafts kept",
            answer.completion_tokens as f64 / answer.seconds,
            c.mean_acceptance_length(),
            1000.0 * c.draft_seconds / c.draft_tokens.max(1) as f64,
            100.0 * c.draft_acceptance_rate()
        );
        Ok(())
    })
}
