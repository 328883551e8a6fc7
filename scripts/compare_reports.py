#!/usr/bin/env python3
"""Two `verdict bench` reports of the same problems and modes, compared run by run: per mode,
how many texts are identical and τ = 1 + accepted / steps from each report's step counters.
Used to show that a change of code shape left decoding untouched:
    python3 scripts/compare_reports.py BEFORE.json AFTER.json
"""
import json
import sys


def runs(report):
    return {(r["problem"], r.get("seed", 0), r["mode"]): r for r in report["runs"]}


def tau(runs_by_key, keys):
    counters = [runs_by_key[k].get("counters") or {} for k in keys]
    accepted = sum(c.get("accepted_tokens", 0) for c in counters)
    steps = sum(c.get("steps", 0) for c in counters)
    return f"{1 + accepted / steps:.4f} ({accepted} kept / {steps} steps)" if steps else "–"


def main(before_path, after_path):
    before, after = runs(json.load(open(before_path))), runs(json.load(open(after_path)))
    if set(before) != set(after):
        sys.exit(f"the reports hold different runs: {len(before)} against {len(after)}")
    for mode in sorted({k[2] for k in before}):
        keys = [k for k in before if k[2] == mode]
        same = sum(before[k]["text"] == after[k]["text"] for k in keys)
        print(f"{mode}: identical texts {same}/{len(keys)}; τ before {tau(before, keys)}, after {tau(after, keys)}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
