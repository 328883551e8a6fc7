//! Embed Verdict in a mistral.rs deployment from Rust: load a target/draft pair, build a
//! speculative engine whose accept rule is a judge stack, send a request, read the metrics.
//!
//! cargo run --release -p verdict --example embed -- configs/default.toml "What is 17 * 23?"

use std::sync::Arc;

use anyhow::Result;
use verdict::{
    config::Config,
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let config = Config::load(
        args.next()
            .as_deref()
            .unwrap_or("configs/default.toml")
            .as_ref(),
    )?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "What is 17 * 23?".to_string());

    // Models load once; any number of engines (plain or speculative) can share them.
    let models = LoadedModels::load(&config)?;
    tokio::runtime::Runtime::new()?.block_on(async {
        let metrics = Arc::new(Metrics::default());
        // Lossless speculative sampling; judges go into `JudgeStack::judges`.
        let stack = JudgeStack::lossless(BaseRule::Rejection);
        let engine = Engine::speculative(&models, SpeculativeSetup { gamma: config.speculative.gamma, stack, seed: 0, metrics: metrics.clone(), scheduling: Scheduling::from(1) })
        .await?;
        // `engine.mistralrs` is a plain `Arc<mistralrs_core::MistralRs>`: hand it to
        // mistralrs-server-core's router, or send `Request`s to it as below.
        let answer = generate(&engine.mistralrs, &Prompt::Chat(prompt), &config.sampling).await?;
        println!("{}", answer.text);
        let c = metrics.snapshot();
        println!(
            "τ = {:.2} over {} steps, {:.1}% of drafts kept",
            c.mean_acceptance_length(),
            c.steps,
            100.0 * c.draft_acceptance_rate()
        );
        Ok(())
    })
}
