//! The judge stack a config asks for: its top-level `[[judge]]` tables over the lossless
//! base rule, each judge's head checked against the loaded models.

use anyhow::Result;

use crate::{
    config::Config,
    engine::LoadedModels,
    judge::JudgeStack,
    judges::{build_stack, LoadedFingerprints},
};

/// The stack of the top-level `[[judge]]` tables, named after its parts
/// (`exact+fsd-js`), or the lossless base rule when there are none.
pub fn judge_stack(config: &Config, models: &LoadedFingerprints) -> Result<JudgeStack> {
    let base = config.speculative.base_rule;
    let mut stack = build_stack(
        base.name(),
        base,
        &config.judges,
        "judge",
        &config.base_dir,
        models,
    )?;
    let names: Vec<&str> = stack
        .replacement
        .iter()
        .chain(&stack.judges)
        .map(|j| j.name())
        .collect();
    if !names.is_empty() {
        stack.name = format!("{}+{}", base.name(), names.join("+"));
    }
    Ok(stack)
}

impl LoadedModels {
    /// The judge stack of `config`'s top-level `[[judge]]` tables.
    pub fn configured_stack(&self, config: &Config) -> Result<JudgeStack> {
        judge_stack(config, &self.fingerprints())
    }
}
