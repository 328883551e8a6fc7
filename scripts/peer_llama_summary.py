#!/usr/bin/env python3
"""The table of scripts/peer-llama.sh: per engine and mode, per task, decode speed (tokens
over the time after the prompt), end-to-end speed (prompt included), the ratio of decode
speeds to llama.cpp's plain decoding, and tau = 1 + accepted / steps."""
import json
import sys
from collections import defaultdict
from pathlib import Path

out = Path(sys.argv[1])
# (engine, mode, task) -> [tokens, decode seconds, prompt seconds, steps, accepted]
totals = defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
rounds = defaultdict(lambda: [0, 0.0])
for line in open(out / "llama-runs.jsonl"):
    r = json.loads(line)
    t = totals[("llama.cpp", r["mode"], r["task"])]
    t[0] += r["tokens"]
    t[1] += r["decode_seconds"]
    t[2] += r["prompt_seconds"]
    # Each step writes one token and the drafts it kept.
    t[3] += r["tokens"] - r["accepted"]
    t[4] += r["accepted"]
    rd = rounds[(r["mode"], r["task"], r["round"])]
    rd[0] += r["tokens"]
    rd[1] += r["decode_seconds"]
tasks = sorted({task for (_, _, task) in totals})
for task in tasks:
    report = json.load(open(out / f"verdict-{task}.json"))
    for run in report["runs"]:
        mode = "plain" if run["mode"] == "plain" else run["mode"]
        t = totals[("Verdict", mode, task)]
        prompt = run.get("prompt_seconds") or 0.0
        t[0] += run["completion_tokens"]
        t[1] += run["seconds"] - prompt
        t[2] += prompt
        counters = run.get("counters") or {}
        steps = counters.get("steps") or run["completion_tokens"]
        t[3] += steps
        t[4] += counters.get("accepted_tokens", 0)

def speed(t):
    return t[0] / t[1] if t[1] else float("nan")

print(f"Greedy, answers capped as the run was; {len(tasks)} tasks; decode tok/s excludes the prompt, "
      "end to end includes it; × is the decode speed over llama.cpp plain decoding's on the task.\n")
print("| engine | mode | " + " | ".join(f"{t}: decode tok/s, ×, τ, end to end" for t in tasks) + " |")
print("|---|---|" + "---|" * len(tasks))
order = [("llama.cpp", "plain"), ("llama.cpp", "ngram-simple"), ("llama.cpp", "draft-simple"),
         ("Verdict", "plain"), ("Verdict", "ngram+eagle@general:exact")]
for engine, mode in order:
    cells = []
    for task in tasks:
        t = totals.get((engine, mode, task))
        base = totals.get(("llama.cpp", "plain", task))
        if not t or not base:
            cells.append("–")
            continue
        tau = 1 + t[4] / t[3] if t[3] else float("nan")
        e2e = t[0] / (t[1] + t[2])
        cells.append(f"{speed(t):.1f}, {speed(t) / speed(base):.2f}×, {tau:.2f}, {e2e:.1f}")
    print(f"| {engine} | {mode} | " + " | ".join(cells) + " |")
print("\nllama.cpp's decode tok/s per round (A before Verdict's runs, B after):\n")
for (mode, task, rnd), (tokens, seconds) in sorted(rounds.items()):
    print(f"- {task} {mode} round {rnd}: {tokens / seconds:.1f}")
