"""Per-call cost of this build vs a baseline, from alternating runs of bench/percall.py
(`scripts/gpu run OUT percall` with PERCALL_ROUNDS=K writes DIR/new-1..K and DIR/old-1..K):

    python3 bench/percall_compare.py DIR

Prints a markdown table: per group size and row (all-gather, all-gather as start+done,
reduce-scatter, XLA's elementwise op as the reference), the median us per call of each build over
the rounds, and new / old. With no baseline runs, this build's medians alone.
"""
import glob
import json
import os
import statistics
import sys

ROWS = [("ag_us", "all_gather"), ("ag_start_done_us", "all_gather start+done"), ("rs_us", "reduce_scatter"),
        ("copy_us", "XLA elementwise (reference)")]


def load(root, which):
    runs = []
    for d in sorted(glob.glob(os.path.join(root, f"{which}-*"))):
        try:
            with open(os.path.join(d, "percall.json")) as f:
                runs.append({r["params"]: r for r in json.load(f)})
        except (OSError, ValueError, KeyError):
            continue
    return runs


def medians(runs, n, key):
    vals = [r[n][key] for r in runs if n in r and key in r[n]]
    return (statistics.median(vals), len(vals)) if vals else (None, 0)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    new, old = load(root, "new"), load(root, "old")
    if not new:
        print(f"no runs of this build under {root}")
        return 1
    sizes = sorted({n for r in new for n in r})
    print(f"per-call cost, median over rounds: this build {len(new)} runs, baseline {len(old)} runs (us per call)\n")
    print("| params | row | this build | baseline | new / old |")
    print("| --- | --- | --- | --- | --- |")
    for n in sizes:
        for key, name in ROWS:
            a, _ = medians(new, n, key)
            b, _ = medians(old, n, key)
            if a is None:
                continue
            ratio = f"{a / b:.3f}" if b else "-"
            print(f"| {n} | {name} | {a:.1f} | {'-' if b is None else f'{b:.1f}'} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
