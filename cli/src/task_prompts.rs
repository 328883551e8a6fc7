//! `verdict prompts`: a task's prompts as the target's chat template renders them, so that
//! another engine (llama.cpp's examples take raw text) answers the very prompts `verdict
//! bench` sends.

use std::io::Write;

use anyhow::{Context, Result};
use serde::Serialize;
use verdict::{
    config::Config,
    engine::{chat_tokens, Engine, LoadedModels},
};
use verdict_eval::{
    benchmark::{self, BenchmarkSource, TaskName},
    datasets,
    sandbox::{Sandbox, SandboxLimits},
    subset::Subset,
};

/// One problem's prompt.
#[derive(Debug, Serialize)]
pub struct TaskPrompt {
    pub task: String,
    /// The problem's index in the task, as `verdict bench` numbers it.
    pub problem: usize,
    /// The user turn.
    pub prompt: String,
    /// The whole prompt the target reads: the chat template applied, special tokens as text,
    /// ending with the assistant's turn opened.
    pub rendered: String,
    pub rendered_tokens: usize,
}

/// The prompts of `subset` of `task`, rendered by `config`'s target.
pub fn task_prompts(config: &Config, task: TaskName, subset: &Subset) -> Result<Vec<TaskPrompt>> {
    let cache_dir = verdict::models::cache_dir(config.models.cache_dir.as_deref());
    let gsm8k_dir = datasets::gsm8k_dir(None, &cache_dir);
    let python = Sandbox::default_python();
    let prompts = benchmark::prompts(
        task,
        &BenchmarkSource {
            gsm8k_dir: &gsm8k_dir,
            split: "test",
            cache_dir: &cache_dir,
            sandbox_python: &python,
            sandbox_limits: SandboxLimits::default(),
        },
    )?;
    let models = LoadedModels::load_with_draft(config, false)?;
    let tokenizer = models.target.blocking_lock().tokenizer().context("the target has no tokenizer")?;
    let runtime = tokio::runtime::Runtime::new()?;
    let engine = runtime.block_on(Engine::plain(&models, 1));
    subset
        .indices(prompts.len())?
        .into_iter()
        .map(|problem| {
            let prompt = prompts[problem].clone();
            let tokens = runtime.block_on(chat_tokens(&engine.mistralrs, &[("user".to_string(), prompt.clone())]))?;
            let rendered = tokenizer.decode(&tokens, false).map_err(anyhow::Error::msg)?;
            Ok(TaskPrompt { task: task.to_string(), problem, prompt, rendered, rendered_tokens: tokens.len() })
        })
        .collect()
}

/// Writes `prompts` as JSON Lines.
pub fn write_jsonl(prompts: &[TaskPrompt], out: &mut dyn Write) -> Result<()> {
    for p in prompts {
        writeln!(out, "{}", serde_json::to_string(p)?)?;
    }
    Ok(())
}
