#!/usr/bin/env python3
"""Per-mode answer quality beside accuracy, from a `verdict bench` checkpoint (<out>.runs.jsonl).

With a few dozen problems and many responses cut off at max_tokens, accuracy moves by whole
problems; two finer signals are how often a mode commits an answer ("The final answer is N") at all and how often its
answer is the plain target's. Only problems that every mode finished are counted, so a
partial checkpoint gives comparable rows.
"""
import argparse
import collections
import json
import re
import sys

# The GSM8K adapter's committed-answer pattern (cli/src/tasks/gsm8k.rs, FINAL_ANSWER): a
# response without it was cut off or never concluded, and scores by its last number.
FINAL_ANSWER = re.compile(
    r"(?i)(?:final answer is[:\s]*(?:\*\*)?\s*(?:\\\(|\\\[|\$)?\s*(?:\\boxed\{)?|\\boxed\{)\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)"
)


def same_number(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    try:
        return float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="a bench checkpoint, e.g. bench-results/x.json.runs.jsonl")
    parser.add_argument("--baseline", default="plain", help="mode whose answers others are compared to")
    parser.add_argument("--lossless", default="exact", help="mode whose τ the others are divided by")
    args = parser.parse_args()

    by_mode = collections.defaultdict(dict)
    for line in open(args.runs):
        if line.strip():
            run = json.loads(line)
            by_mode[run["mode"]][run["problem"]] = run
    if args.baseline not in by_mode:
        sys.exit(f"no '{args.baseline}' runs in {args.runs}")
    problems = sorted(set.intersection(*(set(runs) for runs in by_mode.values())))
    if not problems:
        sys.exit(f"no problem was finished by every mode in {args.runs}")

    def tau(mode: str) -> float | None:
        steps = accepted = 0
        for p in problems:
            counters = by_mode[mode][p]["counters"]
            if counters:
                steps += counters["steps"]
                accepted += counters["accepted_tokens"]
        return 1 + accepted / steps if steps else None

    def tokens_per_second(mode: str) -> float:
        runs = [by_mode[mode][p] for p in problems]
        return sum(r["completion_tokens"] for r in runs) / sum(r["seconds"] for r in runs)

    n = len(problems)
    base = by_mode[args.baseline]
    lossless_tau = tau(args.lossless) if args.lossless in by_mode else None
    print(f"{n} problems finished by all {len(by_mode)} modes\n")
    print(f"| mode | accuracy | committed an answer | same answer as {args.baseline} | τ | τ / {args.lossless} | tokens | speed vs {args.baseline} |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, runs in by_mode.items():
        correct = sum(runs[p]["correct"] for p in problems)
        committed = sum(bool(FINAL_ANSWER.search(runs[p]["text"])) for p in problems)
        same = sum(same_number(runs[p]["answer"], base[p]["answer"]) for p in problems)
        t = tau(mode)
        tau_text = f"{t:.2f}" if t else "–"
        ratio = f"{t / lossless_tau:.2f}×" if t and lossless_tau else "–"
        tokens = sum(runs[p]["completion_tokens"] for p in problems)
        speed = tokens_per_second(mode) / tokens_per_second(args.baseline)
        print(
            f"| {mode} | {correct}/{n} ({100 * correct / n:.1f}%) | {committed}/{n} | {same}/{n} "
            f"| {tau_text} | {ratio} | {tokens} | {speed:.2f}× |"
        )


if __name__ == "__main__":
    main()
