#!/usr/bin/env bash
# Runs Verdict's test suite: patches mistral.rs, then `cargo test` over the workspace in
# release mode (the tests decode with real mistral.rs pipelines on tiny generated models),
# then clippy and rustdoc with warnings as errors.
# The cargo target folder lives outside the clone so rebuilds are incremental across clones.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}"
bash patches/apply.sh
cargo test --release --workspace "$@"
# Lints and the public API's documentation, both warning-free (our crates; the patched
# upstream crates keep their own warnings).
cargo clippy --release --workspace --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --workspace
