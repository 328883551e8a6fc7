#!/usr/bin/env bash
# One decode step of the default target on this machine, against the memory and llama.cpp:
#   - `verdict forward-cost`: the one-token forward, the weights it streams, and this
#     machine's streaming-read rate (so the share of the bound reached);
#   - llama.cpp's `llama-bench` on the same GGUF with as many threads, when LLAMA_BENCH
#     names its binary (built from the llama-cpp-python sdist, docs/patches-and-kernels.md);
#   - where the cycles of decoding go, by function (`perf`, when installed).
# Run it alone on the cores: pause background jobs (kill -STOP) first. REPEATS rounds, each
# llama-bench then `forward-cost` once per kernel instruction set in ISAS (default `auto`, the
# fastest the CPU runs; `ISAS="avx512vnni avx2"` times both kernels of an AVX-512 CPU), so that
# the machine's drift falls on every side alike. summary.md pairs each round's figures
# (scripts/decode_profile_summary.py). Output: OUT (default
# bench-results/decode-profile-<isa>-<date>, so that a run on another machine never overwrites
# the profiles committed from earlier ones).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}"
verdict="$CARGO_TARGET_DIR/release/verdict"
threads="$(nproc)"
model="$("$verdict" fetch-models qwen2.5-coder-1.5b-instruct-q4_k_m 2>/dev/null | sed -n 's/^[^:]*: //p' | tail -1)"
isa=avx2
grep -qw avx512f /proc/cpuinfo && isa=avx512
out="${OUT:-bench-results/decode-profile-$isa-$(date -u +%Y%m%d-%H%M)}"
mkdir -p "$out"
lscpu > "$out/lscpu.txt"
isas="${ISAS:-auto}"
for i in $(seq "${REPEATS:-2}"); do
  if [ -n "${LLAMA_BENCH:-}" ]; then
    # A 256-token context, as forward-cost's ≈ 230-token prompt.
    "$LLAMA_BENCH" -m "$model" -t "$threads" -p 5,8 -n 64 -d 256 -r 3 -o json > "$out/llama-$i.json" 2>/dev/null
  fi
  for kernels in $isas; do
    CANDLE_WS_ISA="$kernels" "$verdict" forward-cost --config configs/default.toml --tokens 1,5,8 \
      --kernels row-invariant --repeats 3 --matmul-repeats 0 --context-problems 3 \
      --out "$out/forward-$kernels-$i.json" 2>/dev/null
  done
done
python3 scripts/decode_profile_summary.py "$out" $isas | tee "$out/summary.md"
if command -v perf > /dev/null; then
  # Sampled while decoding only: attach once the model is loaded and the prompt is read.
  "$verdict" forward-cost --config configs/default.toml --tokens 1 --kernels row-invariant \
    --repeats 12 --matmul-repeats 0 --context-problems 3 > /dev/null 2>&1 &
  pid=$!
  sleep "${PERF_DELAY:-25}"
  perf_data="$(mktemp)"
  perf record -F 2999 -p "$pid" -o "$perf_data" -- sleep 10 2> /dev/null
  kill "$pid" 2> /dev/null || true
  perf report -i "$perf_data" --no-children --sort dso,symbol --stdio 2> /dev/null \
    | grep "%" | head -25 | cut -c1-140 | tee "$out/perf.txt"
  rm -f "$perf_data"
fi
echo "decode profile written to $out"
