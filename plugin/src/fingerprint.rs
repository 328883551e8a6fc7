//! Fingerprints of the loaded models, compared with the ones a head was trained for.

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use verdict_heads::ModelFingerprint;

use std::sync::Arc;

use mistralrs_core::Pipeline;
use tokio::sync::Mutex;

use crate::models::ModelSource;

/// Architecture, sizes and tokenizer hash of a loaded model.
pub fn fingerprint(pipeline: &Arc<Mutex<dyn Pipeline + Send + Sync>>, source: &ModelSource) -> Result<ModelFingerprint> {
    let pipeline = pipeline.blocking_lock();
    let metadata = pipeline.get_metadata();
    let config = metadata
        .model_metadata
        .as_ref()
        .context("mistral.rs reports no model configuration for this model")?;
    let tokenizer = pipeline
        .tokenizer()
        .context("model has no tokenizer; heads need one to check compatibility")?;
    let mut vocab: Vec<(String, u32)> = tokenizer.get_vocab(true).into_iter().collect();
    vocab.sort_by_key(|(_, id)| *id);
    let mut hash = Sha256::new();
    for (token, id) in &vocab {
        hash.update(id.to_le_bytes());
        hash.update((token.len() as u32).to_le_bytes());
        hash.update(token.as_bytes());
    }
    Ok(ModelFingerprint {
        architecture: architecture(source)?,
        hidden_size: config.hidden_size(),
        num_layers: config.num_layers(),
        vocab_size: vocab.len(),
        tokenizer_sha256: format!("{:x}", hash.finalize()),
        source: source
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    })
}

/// `general.architecture` of a GGUF file, `model_type` of a safetensors folder's config.
fn architecture(source: &ModelSource) -> Result<String> {
    match source {
        ModelSource::Gguf(path) => {
            let mut file = std::fs::File::open(path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            let content = candle_core::quantized::gguf_file::Content::read(&mut file)
                .with_context(|| format!("cannot read the GGUF header of {}", path.display()))?;
            Ok(content
                .metadata
                .get("general.architecture")
                .and_then(|v| v.to_string().ok())
                .cloned()
                .unwrap_or_else(|| "unknown".into()))
        }
        ModelSource::Safetensors(dir) => {
            let path = dir.join("config.json");
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let config: serde_json::Value = serde_json::from_str(&text)?;
            Ok(config["model_type"]
                .as_str()
                .unwrap_or("unknown")
                .to_string())
        }
    }
}
