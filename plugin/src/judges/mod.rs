//! The lossy verifiers and how `[[judge]]` tables become a [`JudgeStack`].
//!
//! Each judge's parameters are a typed struct that rejects unknown keys, so a typo in a
//! threshold is an error naming the table, never a silent default.

mod autojudge;
mod dropmatch;
mod fly;
mod fsd;
mod pad;

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use verdict_heads::ModelFingerprint;

pub use autojudge::{AutoJudge, AutoJudgeConfig, JudgeFeatures};
pub use dropmatch::{Criterion, DropMatch, DropMatchConfig};
pub use fly::{top_k_entropy, Fly, FlyConfig, FlyCounts};
pub use fsd::{Fsd, FsdConfig, FsdMode};
pub use pad::{Pad, PadConfig};

use crate::{
    judge::{Judge, JudgeStack},
    models::ModelSource,
    rules::BaseRule,
};

/// One `[[judge]]` table. The parameters depend on `kind`.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct JudgeConfig {
    pub kind: String,
    #[serde(default = "enabled_by_default")]
    pub enabled: bool,
    #[serde(flatten)]
    pub params: toml::Table,
}

fn enabled_by_default() -> bool {
    true
}

/// Judge kinds this build knows, as written in `kind = "..."`.
pub const KNOWN_JUDGES: &[&str] = &["fsd", "dropmatch", "autojudge", "pad", "fly"];

/// One `[[judge]]` table with its parameters parsed and checked.
#[derive(Clone, Debug)]
pub enum JudgeSpec {
    Fsd(FsdConfig),
    DropMatch(DropMatchConfig),
    AutoJudge(AutoJudgeConfig),
    Pad(PadConfig),
    Fly(FlyConfig),
}

/// The loaded models, for heads that must match them.
pub struct LoadedFingerprints<'a> {
    pub target: &'a ModelFingerprint,
    pub draft: Option<&'a ModelFingerprint>,
    /// The target's weights, for judges that read rows of its LM head.
    pub target_source: Option<&'a ModelSource>,
}

fn params<T: DeserializeOwned>(table: &JudgeConfig) -> Result<T> {
    Ok(toml::Value::Table(table.params.clone()).try_into()?)
}

impl JudgeSpec {
    /// Parse and validate a `[[judge]]` table; `at` names it in errors (`judge[2]`).
    pub fn parse(table: &JudgeConfig, at: &str) -> Result<Self> {
        let spec = match table.kind.as_str() {
            "fsd" => JudgeSpec::Fsd(params(table)?),
            "dropmatch" => JudgeSpec::DropMatch(params(table)?),
            "autojudge" => JudgeSpec::AutoJudge(params(table)?),
            "pad" => JudgeSpec::Pad(params(table)?),
            "fly" => JudgeSpec::Fly(params(table)?),
            other => bail!(
                "{at}.kind = {other:?} is not a judge this build knows (known: {})",
                KNOWN_JUDGES.join(", ")
            ),
        };
        spec.validate()
            .with_context(|| format!("{at} (kind = {:?})", table.kind))?;
        Ok(spec)
    }

    fn validate(&self) -> Result<()> {
        match self {
            JudgeSpec::Fsd(c) => c.validate(),
            JudgeSpec::DropMatch(c) => c.validate(),
            JudgeSpec::AutoJudge(c) => c.validate(),
            JudgeSpec::Pad(c) => c.validate(),
            JudgeSpec::Fly(c) => c.validate(),
        }
    }

    fn replaces_base(&self) -> bool {
        matches!(self, JudgeSpec::Fsd(c) if c.mode == FsdMode::Replace)
    }

    /// Build the judge; head paths are relative to `base_dir` (the config file's folder).
    fn build(&self, base_dir: &Path, models: &LoadedFingerprints) -> Result<Box<dyn Judge>> {
        Ok(match self {
            JudgeSpec::Fsd(c) => Box::new(Fsd::new(c.clone())),
            JudgeSpec::DropMatch(c) => Box::new(DropMatch::load(c.clone(), models)?),
            JudgeSpec::AutoJudge(c) => Box::new(AutoJudge::load(c, base_dir, models)?),
            JudgeSpec::Pad(c) => Box::new(Pad::load(c, base_dir, models)?),
            JudgeSpec::Fly(c) => Box::new(Fly::new(c.clone())),
        })
    }
}

/// Parse every table of a stack, checking that at most one judge replaces the base rule.
pub fn parse_stack(tables: &[JudgeConfig], at: &str) -> Result<Vec<(JudgeSpec, bool)>> {
    let mut specs = Vec::new();
    for (i, table) in tables.iter().enumerate() {
        let spec = JudgeSpec::parse(table, &format!("{at}[{i}]"))?;
        specs.push((spec, table.enabled));
    }
    let replacing = specs
        .iter()
        .filter(|(s, enabled)| *enabled && s.replaces_base())
        .count();
    if replacing > 1 {
        bail!("{at}: {replacing} enabled judges replace the base rule (fsd with mode = \"replace\"); at most one can");
    }
    Ok(specs)
}

/// The stack named `name`: `base` plus the enabled judges of `tables`, in order.
pub fn build_stack(
    name: &str,
    base: BaseRule,
    tables: &[JudgeConfig],
    at: &str,
    base_dir: &Path,
    models: &LoadedFingerprints,
) -> Result<JudgeStack> {
    let mut stack = JudgeStack::lossless(base);
    stack.name = name.to_string();
    for (i, (spec, enabled)) in parse_stack(tables, at)?.into_iter().enumerate() {
        if !enabled {
            continue;
        }
        let judge = spec
            .build(base_dir, models)
            .with_context(|| format!("{at}[{i}] (kind = {:?})", tables[i].kind))?;
        tracing::info!("stack {name}: judge {}", judge.name());
        if spec.replaces_base() {
            stack.replacement = Some(judge);
        } else {
            stack.judges.push(judge);
        }
    }
    Ok(stack)
}

/// A head path from a config: absolute, or relative to the config file's folder.
fn head_path(base_dir: &Path, head: &Path) -> std::path::PathBuf {
    if head.is_absolute() {
        head.to_path_buf()
    } else {
        base_dir.join(head)
    }
}
