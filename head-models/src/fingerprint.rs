//! What identifies a model to a head: a head's weights only mean something on the hidden
//! states of the model it was trained on.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelFingerprint {
    /// `general.architecture` of a GGUF, `model_type` of a safetensors config.
    pub architecture: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    /// sha256 of the tokenizer's tokens in id order.
    pub tokenizer_sha256: String,
    /// The file the fingerprint was taken from; shown in messages, never compared.
    #[serde(default)]
    pub source: String,
}

impl ModelFingerprint {
    pub fn describe(&self) -> String {
        format!(
            "{} (architecture {}, hidden size {}, {} layers, vocabulary {}, tokenizer {})",
            if self.source.is_empty() {
                "<unnamed>"
            } else {
                &self.source
            },
            self.architecture,
            self.hidden_size,
            self.num_layers,
            self.vocab_size,
            &self.tokenizer_sha256[..self.tokenizer_sha256.len().min(12)]
        )
    }

    /// Same model as far as a head can tell (the file name may differ).
    pub fn same_model(&self, other: &ModelFingerprint) -> bool {
        self.architecture == other.architecture
            && self.hidden_size == other.hidden_size
            && self.num_layers == other.num_layers
            && self.vocab_size == other.vocab_size
            && self.tokenizer_sha256 == other.tokenizer_sha256
    }

    /// Refuse a head trained for `self` when `loaded` is what runs, naming both.
    pub fn check_loaded(&self, head: &str, role: &str, loaded: &ModelFingerprint) -> Result<()> {
        if !self.same_model(loaded) {
            bail!(
                "head {head} was made for the {role} model {}, but the loaded {role} model is {}",
                self.describe(),
                loaded.describe()
            );
        }
        Ok(())
    }
}

/// Refuse a draft head made for another target: by the fingerprint it recorded when it has
/// one, else by hidden size and vocabulary (all that foreign checkpoints say). `kind` names
/// the head's family in the message ("EAGLE-3").
pub fn check_head_target(
    kind: &str,
    head: &str,
    recorded: Option<&ModelFingerprint>,
    hidden_size: usize,
    vocab_size: usize,
    target: &ModelFingerprint,
) -> Result<()> {
    if let Some(trained_for) = recorded {
        return trained_for.check_loaded(head, "target", target);
    }
    if hidden_size != target.hidden_size || vocab_size != target.vocab_size {
        bail!(
            "{kind} head {head} was made for a target with hidden size {hidden_size} and vocabulary {vocab_size}, but the loaded target is {}",
            target.describe()
        );
    }
    Ok(())
}
