#!/usr/bin/env bash
# Runs Verdict's test suite: patches mistral.rs, then `cargo test` over the workspace in
# release mode (the tests decode with real mistral.rs pipelines on tiny generated models).
# The cargo target folder lives outside the clone so rebuilds are incremental across clones.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}"
bash patches/apply.sh
cargo test --release --workspace "$@"
