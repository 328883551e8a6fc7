#!/usr/bin/env python3
"""Pool several `verdict bench` reports over the union of their problems, mode by mode.

A 50-problem run cannot settle a few per cent of τ or a few points of accuracy, and a longer
run is often split over several reports (problems 0-49 in one, 50-199 in another, one mode
per run). This reads the reports' per-problem runs, keeps each (problem, mode) once (the
first report that has it), and prints per mode: problems, correct answers, τ pooled over all
steps (1 + accepted / steps that drafted, as the bench computes it per run), tokens per step,
and against the baseline mode on the problems both have: identical texts, answers better /
worse, McNemar's exact p. `--ratio A/B` prints τ(A) / τ(B) on the problems both have.

  python3 scripts/pool_reports.py bench-results/a.json bench-results/b.json \
      --baseline plain --ratio eagle-sv-tvlearn-learn:dropmatch/eagle-sv-tvlearn:exact

Tokens/s are not pooled: runs from different processes saw different machine speeds.
"""
import argparse
import json
import math
import sys


def mcnemar_exact_p(better: int, worse: int) -> float:
    """Two-sided exact binomial test on the discordant pairs."""
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def tau(runs) -> tuple[float, float]:
    """(τ, tokens per step) pooled over `runs`' step counters."""
    steps = sum(r["counters"]["steps"] for r in runs)
    undrafted = sum(r["counters"]["undrafted_steps"] for r in runs)
    accepted = sum(r["counters"]["accepted_tokens"] for r in runs)
    emitted = sum(r["counters"]["emitted_tokens"] for r in runs)
    drafted_steps = steps - undrafted
    t = 1 + accepted / drafted_steps if drafted_steps else float("nan")
    return t, (emitted / steps if steps else float("nan"))


def load(paths):
    """mode -> problem -> run, the first report holding a (problem, mode) winning."""
    by_mode = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for r in report["runs"]:
            by_mode.setdefault(r["mode"], {}).setdefault(r["problem"], r)
    return by_mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", help="bench JSON reports (--out files)")
    parser.add_argument("--baseline", default="plain", help="mode others are paired with")
    parser.add_argument("--ratio", action="append", default=[], help="A/B: τ of mode A over mode B")
    args = parser.parse_args()

    by_mode = load(args.reports)
    modes = sorted(by_mode, key=lambda m: (m != args.baseline, m))
    base = by_mode.get(args.baseline, {})

    print("| mode | problems | correct | τ | tokens / step | vs baseline: problems, identical, better / worse, McNemar p |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        mine = by_mode[m]
        correct = sum(r["correct"] for r in mine.values())
        speculative = [r for r in mine.values() if r.get("counters")]
        t, tps = tau(speculative) if speculative else (float("nan"), float("nan"))
        paired = "–"
        if m != args.baseline and base:
            common = sorted(set(mine) & set(base))
            same = sum(mine[p]["text"] == base[p]["text"] for p in common)
            better = sum(mine[p]["correct"] and not base[p]["correct"] for p in common)
            worse = sum(base[p]["correct"] and not mine[p]["correct"] for p in common)
            paired = f"{len(common)}, {same}, {better} / {worse}, {mcnemar_exact_p(better, worse):.2f}"
        print(f"| {m} | {len(mine)} | {correct} | {t:.3f} | {tps:.3f} | {paired} |")

    for spec in args.ratio:
        a, _, b = spec.partition("/")
        if a not in by_mode or b not in by_mode:
            sys.exit(f"--ratio {spec}: modes in the reports are {', '.join(modes)}")
        common = sorted(set(by_mode[a]) & set(by_mode[b]))
        ta, _ = tau([by_mode[a][p] for p in common])
        tb, _ = tau([by_mode[b][p] for p in common])
        print(f"τ({a}) / τ({b}) on {len(common)} problems: {ta:.3f} / {tb:.3f} = {ta / tb:.4f}")


if __name__ == "__main__":
    main()
