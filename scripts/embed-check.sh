#!/usr/bin/env bash
# Adding Verdict to an existing mistral.rs deployment, checked: writes a fresh Cargo project
# outside this workspace (default /tmp/verdict-embed-check) that depends on mistralrs-core
# 0.8.1 and the `verdict` crate, with the `[patch.crates-io]` entries a deployment copies,
# and a verdict.toml with a judge stack (prompt lookup drafting, `exact` rescued by FSD). It
# builds the project, serves one request through the engine the TOML asks for, prints the
# answer and the step counters, and exits. docs/hook-api.md shows the same steps.
#
# Needs the patched crates (`bash patches/apply.sh`) and the default target in the model
# cache (`verdict fetch-models`). A cold build takes about as long as this workspace's
# (own target folder: EMBED_TARGET, default ~/.cache/verdict/embed-target).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-/tmp/verdict-embed-check}"
[ -d "$repo/.patched/mistralrs-core" ] || { echo "run bash patches/apply.sh first" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir/src" "$dir/.cargo"

cat > "$dir/Cargo.toml" <<EOF
[package]
name = "verdict-embed-check"
version = "0.1.0"
edition = "2021"
publish = false

[dependencies]
mistralrs-core = "=0.8.1"
verdict = { path = "$repo/plugin" }
anyhow = "1"
tokio = { version = "1", features = ["full"] }

# What a deployment copies: the crates patches/apply.sh writes, in place of crates.io's.
[patch.crates-io]
mistralrs-core = { path = "$repo/.patched/mistralrs-core" }
mistralrs-quant = { path = "$repo/.patched/mistralrs-quant" }
candle-core = { path = "$repo/.patched/candle-core" }
candle-nn = { path = "$repo/.patched/candle-nn" }
EOF

# The CPU kernels need the host's SIMD, as in the workspace.
cp "$repo/.cargo/config.toml" "$dir/.cargo/config.toml"
# The dependency versions this workspace is tested with (cargo drops the entries it does not
# need); without it cargo resolves the newest compatible versions.
cp "$repo/Cargo.lock" "$dir/Cargo.lock"

cat > "$dir/verdict.toml" <<'EOF'
[models]
target = "qwen2.5-coder-1.5b-instruct-q4_k_m"

[speculative]
proposer = "ngram"
base_rule = "exact"

[[judge]]
kind = "fsd"
threshold = 0.2
mode = "rescue"

[sampling]
max_tokens = 64
EOF

cat > "$dir/src/main.rs" <<'EOF'
//! One request through the engine verdict.toml asks for, then exit.

use std::{path::Path, sync::Arc};

use anyhow::Result;
use verdict::{
    assembly::configured_engine,
    engine::{generate, LoadedModels, Prompt},
    metrics::Metrics,
    Config,
};

fn main() -> Result<()> {
    let config = Config::load(Path::new("verdict.toml"))?;
    let models = LoadedModels::load(&config)?;
    tokio::runtime::Runtime::new()?.block_on(async {
        let metrics = Arc::new(Metrics::default());
        let (engine, _policy) = configured_engine(&config, &models, metrics.clone()).await?;
        // A function to complete: the answer repeats its signature, which prompt lookup drafts.
        let prompt = Prompt::Chat(
            "Complete this function; answer with the whole function.\n\ndef square(x):\n    \"\"\"Return x times x.\"\"\"\n".into(),
        );
        let answer = generate(&engine.mistralrs, &prompt, &config.sampling).await?;
        println!("{}", answer.text);
        let c = metrics.snapshot();
        println!(
            "stack {}: {} steps, {} drafted, {} kept, {} emitted",
            engine.rule.as_ref().map_or("none".into(), |r| r.stack().name.clone()),
            c.steps,
            c.draft_tokens,
            c.accepted_tokens,
            c.emitted_tokens
        );
        Ok(())
    })
}
EOF

cd "$dir"
export CARGO_TARGET_DIR="${EMBED_TARGET:-$HOME/.cache/verdict/embed-target}"
cargo build --release
"$CARGO_TARGET_DIR/release/verdict-embed-check"
