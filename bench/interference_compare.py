"""Builds of the engine beside the same victims, from `scripts/gpu run OUT interference_ab` (which
writes OUT/interference-<mode>-<build>-<round>.json for build new, old and v1, v2, ...):

    python3 bench/interference_compare.py OUT

Prints a markdown table: per row of the interference bench and build, the medians over the rounds
of the call's time alone (GB/s), its host time to enqueue one call, and each victim's slowdown; and
per row each build's one-wave GEMM slowdown and time alone against `old`'s. Rounds whose file is
missing or unreadable are left out, and the table says how many each median took.
"""
import glob
import json
import os
import re
import statistics
import sys

VICTIMS = [("gemm_1wave", "one-wave"), ("elementwise_1GiB", "elementwise"), ("gemm_manywave", "many-wave")]
NAME = re.compile(r"interference-(?P<mode>[a-z]+)-(?P<build>new|old|v\d+)-(?P<round>\d+)\.json$")


def load(root):
    """{build: [rows of one round: {row name: row}]}"""
    builds = {}
    for path in sorted(glob.glob(os.path.join(root, "interference-*.json"))):
        m = NAME.search(os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                rows = {r["name"]: r for r in json.load(f)["rows"]}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        builds.setdefault(m["build"], []).append(rows)
    return builds


def median(vals):
    vals = [v for v in vals if v is not None]
    return (statistics.median(vals), len(vals)) if vals else (None, 0)


def summary(rounds, name):
    rows = [r[name] for r in rounds if name in r]
    out = {
        "alone_ms": median([r.get("alone_ms") for r in rows]),
        "host_ms": median([r.get("host_ms") for r in rows]),
        "gbps": median([r.get("gbps") for r in rows]),
    }
    for key, _ in VICTIMS:
        out[key] = median([v["slowdown_pct"] for r in rows for v in r.get("victims", []) if v.get("victim") == key])
    return out


def fmt(x, spec, unit=""):
    return "-" if x is None else format(x, spec) + unit


def order(build):
    return (0, 0) if build == "new" else (1, 0) if build == "old" else (2, int(build[1:]))


def table(builds):
    names = []
    for rounds in builds.values():
        for r in rounds:
            names += [n for n in r if n not in names]
    lines = ["| row | build | rounds | alone | host (enqueue) | GB/s | one-wave | elementwise | many-wave |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratios = []
    for name in names:
        base = summary(builds["old"], name) if "old" in builds else None
        for build in sorted(builds, key=order):
            s = summary(builds[build], name)
            if s["alone_ms"][1] == 0:
                continue
            lines.append(
                f"| {name} | {build} | {s['alone_ms'][1]} | {fmt(s['alone_ms'][0], '.3f', ' ms')} | "
                f"{fmt(s['host_ms'][0], '.3f', ' ms')} | {fmt(s['gbps'][0], '.0f')} | "
                + " | ".join(fmt(s[k][0], '+.1f', ' %') for k, _ in VICTIMS) + " |")
            if base and build != "old" and base["alone_ms"][0] and s["alone_ms"][0] is not None:
                one, one_old = s["gemm_1wave"][0], base["gemm_1wave"][0]
                ratios.append(f"- {name}: {build} / old: time alone {s['alone_ms'][0] / base['alone_ms'][0]:.3f}x, "
                              f"one-wave {fmt(one, '+.1f', ' %')} vs {fmt(one_old, '+.1f', ' %')}")
    return "\n".join(lines + ([""] + ratios if ratios else []))


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    builds = load(root)
    if not builds:
        print(f"no interference-<mode>-<build>-<round>.json under {root}")
        return 1
    print(table(builds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
