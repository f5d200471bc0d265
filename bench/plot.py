#!/usr/bin/env python3
"""Latency plot of a bench.json: per group, horizontal bars of per-call median ms with p10-p90 whiskers.

Usage: python3 bench/plot.py bench.json [latency.png]. Without matplotlib it says so and exits 0."""
import json
import os
import sys

ORDER = ["floor_ce_k1", "floor_ce_k4", "floor_ce_k4_pieces", "jax_ag_per_param", "jax_ag_flat_copyout",
         "tide_ag", "jax_rs_bf16", "jax_rs_upcast_fp32", "jax_rs_flat_fp32_pack", "jax_rs_fp32_prepacked", "tide_rs"]


def rows(report, group):
    out = []
    for sec in ("floor", "jax", "jaxflags", "tide"):
        for k, r in report.get("sections", {}).get(sec, {}).get("records", {}).items():
            if k.startswith(group + ".") and isinstance(r, dict) and "per_call_ms" in r:
                op = k.split(".", 1)[1]
                pc = r["per_call_ms"]
                out.append((op + ("+flags" if sec == "jaxflags" else ""), op, pc["median"], pc["p10"], pc["p90"]))
    rank = {op: i for i, op in enumerate(ORDER)}
    out.sort(key=lambda t: (rank.get(t[1], 99), t[0]))
    return out


def plot(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # matplotlib missing: the plot is optional
        return f"plot skipped: matplotlib not available ({exc})"
    groups = sorted({k.split(".")[0] for s in report.get("sections", {}).values()
                     for k in s.get("records", {}) if k.startswith("h")}, key=lambda g: int(g[1:]))
    groups = [g for g in groups if rows(report, g)]
    if not groups:
        return "plot skipped: no latency records"
    fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 5), squeeze=False)
    for ax, g in zip(axes[0], groups):
        rs = rows(report, g)
        labels = [r[0] for r in rs]
        med = [r[2] for r in rs]
        lo = [r[2] - r[3] for r in rs]
        hi = [r[4] - r[2] for r in rs]
        colors = ["tab:green" if r[1].startswith("tide") else "tab:gray" if r[1].startswith("floor")
                  else "tab:blue" for r in rs]
        y = list(range(len(rs)))
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms per call (median, p10-p90)")
        ax.set_title(f"{g}: {report.get('mode', '')} run, {report.get('date', '')}", fontsize=9)
        for yi, r in zip(y, rs):
            ax.text(r[4], yi, f"  {r[2]:.3f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written: {path}"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    with open(sys.argv[1]) as fh:
        rep = json.load(fh)
    dest = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(sys.argv[1]) or ".", "latency.png")
    print(plot(rep, dest))
