//! Reading and writing head files: f32 tensors plus string metadata, written atomically.

use std::{collections::HashMap, path::Path};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};

/// Metadata key holding the head's kind (`autojudge-logistic`, `pad-pivot-mlp`).
pub const KIND_KEY: &str = "kind";
/// Metadata key of the format version, bumped on incompatible changes.
pub const VERSION_KEY: &str = "format_version";
pub const FORMAT_VERSION: &str = "1";

/// The tensors and metadata of one head file.
pub struct HeadFile {
    pub tensors: HashMap<String, Tensor>,
    pub metadata: HashMap<String, String>,
}

impl HeadFile {
    /// Read `path`, checking that it holds a head of `kind`.
    pub fn read(path: &Path, kind: &str) -> Result<Self> {
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read head {}", path.display()))?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
            .with_context(|| format!("{} is not a safetensors file", path.display()))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        let found = metadata.get(KIND_KEY).map(String::as_str).unwrap_or("none");
        if found != kind {
            bail!(
                "{} holds a head of kind {found:?}, expected {kind:?}",
                path.display()
            );
        }
        let version = metadata
            .get(VERSION_KEY)
            .map(String::as_str)
            .unwrap_or("none");
        if version != FORMAT_VERSION {
            bail!(
                "{} has head format version {version:?}; this build reads {FORMAT_VERSION:?}",
                path.display()
            );
        }
        let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .with_context(|| format!("cannot read the tensors of {}", path.display()))?;
        Ok(Self { tensors, metadata })
    }

    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("head file has no tensor {name:?}"))
    }

    pub fn meta(&self, key: &str) -> Result<&str> {
        self.metadata
            .get(key)
            .map(String::as_str)
            .with_context(|| format!("head file has no metadata {key:?}"))
    }

    /// A metadata value parsed as `T` (a number, usually).
    pub fn meta_parsed<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let text = self.meta(key)?;
        text.parse()
            .map_err(|_| anyhow::anyhow!("head metadata {key:?} = {text:?} is not valid"))
    }

    /// The training report, or null when there is none.
    pub fn report(&self) -> serde_json::Value {
        self.metadata
            .get("report")
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or(serde_json::Value::Null)
    }

    pub fn meta_json<T: serde::de::DeserializeOwned>(&self, key: &str) -> Result<T> {
        serde_json::from_str(self.meta(key)?).with_context(|| format!("head metadata {key:?}"))
    }

    /// Write tensors and metadata (kind and format version added) to `path` via a temporary
    /// file, so a crash never leaves half a head behind.
    pub fn write(
        path: &Path,
        kind: &str,
        tensors: &[(&str, Tensor)],
        mut metadata: HashMap<String, String>,
    ) -> Result<()> {
        metadata.insert(KIND_KEY.into(), kind.into());
        metadata.insert(VERSION_KEY.into(), FORMAT_VERSION.into());
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("safetensors.tmp");
        let contiguous: Vec<(&str, Tensor)> = tensors
            .iter()
            .map(|(n, t)| Ok((*n, t.to_dtype(candle_core::DType::F32)?.contiguous()?)))
            .collect::<Result<_>>()?;
        safetensors::serialize_to_file(contiguous, Some(metadata), &tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move {} to {}", tmp.display(), path.display()))?;
        Ok(())
    }
}
