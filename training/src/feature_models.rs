//! Which models a folder of features was computed with: written beside the features, read
//! by fitting (which loads no model) and by feature runs that add to the folder.

use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use verdict_heads::ModelFingerprint;

/// The models the features were computed with, written beside them (so fitting needs no
/// model loaded, and the head names the models it is for).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FeatureModels {
    pub target: ModelFingerprint,
    pub draft: ModelFingerprint,
}

impl FeatureModels {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join("models.json")
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        std::fs::write(Self::path(dir), serde_json::to_string_pretty(self)?)?;
        Ok(())
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let path = Self::path(dir);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (run `train-head features`)", path.display())
        })?;
        Ok(serde_json::from_str(&text)?)
    }

    /// Features computed with other models than `self` cannot be mixed in.
    pub fn check_same(&self, loaded: &FeatureModels, dir: &Path) -> Result<()> {
        ensure!(
            self.target.same_model(&loaded.target) && self.draft.same_model(&loaded.draft),
            "{} holds features of target {} / draft {}, but the config loads {} / {}; use another folder",
            dir.display(),
            self.target.describe(),
            self.draft.describe(),
            loaded.target.describe(),
            loaded.draft.describe()
        );
        Ok(())
    }
}
