//! The TOML configuration: models, speculative decoding, sampling, server, judges.
//!
//! Unknown keys are errors (mistral.rs silently ignores them; a typo in a verifier's
//! threshold must not silently run the default).

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::rules::BaseRule;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub models: ModelsConfig,
    #[serde(default)]
    pub speculative: SpeculativeConfig,
    #[serde(default)]
    pub sampling: SamplingConfig,
    #[serde(default)]
    pub server: ServerConfig,
    /// `[[judge]]` tables, applied in this order.
    #[serde(default, rename = "judge")]
    pub judges: Vec<JudgeConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// A model name known to `verdict fetch-models`, a `.gguf` file, or a safetensors folder.
    pub target: String,
    /// Same forms as `target`; required when speculative decoding is enabled.
    pub draft: Option<String>,
    /// Where fetched models are cached; defaults to `$VERDICT_CACHE` or `~/.cache/verdict`.
    pub cache_dir: Option<PathBuf>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeConfig {
    pub enabled: bool,
    /// Tokens drafted per step (γ); the target scores γ + 1 positions.
    pub gamma: usize,
    pub base_rule: BaseRule,
    /// Seed of the accept rule's random draws (draft sampling, rejection tests).
    pub seed: u64,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            gamma: 4,
            base_rule: BaseRule::Exact,
            seed: 0,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SamplingConfig {
    /// 0 decodes greedily.
    pub temperature: f64,
    pub top_k: Option<usize>,
    pub top_p: Option<f64>,
    pub max_tokens: usize,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            max_tokens: 256,
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub host: IpAddr,
    pub port: u16,
    /// Sequences the scheduler runs at once.
    pub max_seqs: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: IpAddr::from([127, 0, 0, 1]),
            port: 8080,
            max_seqs: 4,
        }
    }
}

/// One `[[judge]]` table. The parameters depend on `kind`.
#[derive(Clone, Debug, Deserialize)]
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

/// Judge kinds this build knows. The verifiers arrive with their own issue; until then a
/// `[[judge]]` table is refused rather than ignored.
pub const KNOWN_JUDGES: &[&str] = &[];

impl Config {
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Config = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_toml(&text).with_context(|| format!("invalid config {}", path.display()))
    }

    pub fn validate(&self) -> Result<()> {
        let s = &self.speculative;
        if s.gamma == 0 {
            bail!("speculative.gamma must be at least 1 (tokens drafted per step), got 0");
        }
        if s.gamma > 32 {
            bail!(
                "speculative.gamma = {} is out of range; use 1..=32",
                s.gamma
            );
        }
        if s.enabled && self.models.draft.is_none() {
            bail!("speculative.enabled = true needs models.draft; set it or disable speculation");
        }
        let t = &self.sampling;
        if !(t.temperature >= 0.0 && t.temperature.is_finite()) {
            bail!(
                "sampling.temperature must be a finite number >= 0, got {}",
                t.temperature
            );
        }
        if let Some(p) = t.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("sampling.top_p must be in (0, 1], got {p}");
            }
        }
        if t.top_k == Some(0) {
            bail!("sampling.top_k must be at least 1, got 0");
        }
        if t.max_tokens == 0 {
            bail!("sampling.max_tokens must be at least 1, got 0");
        }
        if self.server.max_seqs == 0 {
            bail!("server.max_seqs must be at least 1, got 0");
        }
        for (i, judge) in self.judges.iter().enumerate() {
            if !KNOWN_JUDGES.contains(&judge.kind.as_str()) {
                bail!(
                    "judge[{i}].kind = {:?} is not a judge this build knows (known: {})",
                    judge.kind,
                    if KNOWN_JUDGES.is_empty() {
                        "none yet".to_string()
                    } else {
                        KNOWN_JUDGES.join(", ")
                    }
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n";

    fn error_of(text: &str) -> String {
        format!("{:#}", Config::from_toml(text).unwrap_err())
    }

    #[test]
    fn defaults_fill_every_optional_section() {
        let config = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(config.speculative.gamma, 4);
        assert_eq!(config.speculative.base_rule, BaseRule::Exact);
        assert_eq!(config.server.host.to_string(), "127.0.0.1");
        assert!(config.judges.is_empty());
    }

    #[test]
    fn unknown_key_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculative]\ngama = 3\n"));
        assert!(err.contains("unknown field `gama`"), "{err}");
    }

    #[test]
    fn unknown_section_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculation]\ngamma = 3\n"));
        assert!(err.contains("unknown field `speculation`"), "{err}");
    }

    #[test]
    fn gamma_zero_is_refused() {
        let err = error_of(&format!("{MINIMAL}[speculative]\ngamma = 0\n"));
        assert!(
            err.contains("speculative.gamma must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn unknown_base_rule_is_named() {
        let err = error_of(&format!("{MINIMAL}[speculative]\nbase_rule = \"greedy\"\n"));
        assert!(err.contains("unknown variant `greedy`"), "{err}");
    }

    #[test]
    fn speculation_without_draft_is_refused() {
        let err = error_of("[models]\ntarget = \"t.gguf\"\n");
        assert!(err.contains("needs models.draft"), "{err}");
    }

    #[test]
    fn unknown_judge_kind_is_named() {
        let err = error_of(&format!("{MINIMAL}[[judge]]\nkind = \"oracle\"\n"));
        assert!(err.contains("judge[0].kind = \"oracle\""), "{err}");
    }
}
