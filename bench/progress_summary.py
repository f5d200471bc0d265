"""One compact table per setting of a bench/progress_sweep.sh OUT (issue #38): the JAX rows of
bench/progress.py (overlap, exposed share, the elementwise HBM bound), the engine half
(`interference progress`: overlap, victim and call slowdowns, world 1 and 8) and issue #22's bars
(`interference engine`: each victim's slowdown beside the engine's calls).

    python3 bench/progress_summary.py OUT/sweep

Reads the text the runs printed (progress-<name>.txt, interference-<mode>-<name>.txt); prints
only what the bars need, so a device call's returned tail holds every setting.
"""
import glob
import os
import re
import sys


def jax_rows(path):
    out = []
    for line in open(path, errors="replace"):
        m = re.match(r"progress: (\w+) +(rs|ag) \|.*\| ratio ([\d.]+) \| overlap (-?[\d.]+) \|.*exposed (-?[\d.]+)", line)
        if m:
            out.append(f"{m[1]}:{m[2]} ov {m[4]} (r {m[3]})")
        m = re.match(r"progress: (\w+) +(rs|ag) \| HBM bound .*both / bound ([\d.]+)", line)
        if m:
            out.append(f"{m[1]}:{m[2]} both/hbm {m[3]}")
        m = re.match(r"progress: (rs|ag) alone ([\d.]+) ms", line)
        if m:
            out.append(f"{m[1]} alone {m[2]} ms")
    return out


def engine_progress_rows(path):
    out = []
    for line in open(path, errors="replace"):
        m = re.match(r"progress: (RS|AG) world (\d+)[^|]*\| (\w+) .*coll +([\d.]+) ms.*overlap +(-?[\d.]+),.*victim in both.*\(([-+\d.]+)%\), coll in both.*\(([-+\d.]+)%\)", line)
        if m and m[2] in ("1", "8"):
            out.append(f"{m[1]}{m[2]} {m[3]} ov {m[5]} v{m[6]}% c{m[7]}%")
    return out


def engine_bar_rows(path):
    out = []
    for line in open(path, errors="replace"):
        m = re.match(r"(RS|AG) world (\d+)[^|]*alone ([\d.]+) ms.*?\| (.*)", line)
        if m and m[2] in ("1", "8"):
            bars = re.findall(r"(\w+) [\d.]+ -> [\d.]+ ms ([-+\d.]+%)", m[4])
            out.append(f"{m[1]}{m[2]} {m[3]}ms " + " ".join(f"{v} {p}" for v, p in bars))
    return out


def main():
    root = sys.argv[1]
    names = sorted({re.sub(r"^(progress|interference-\w+)-|\.txt$", "", os.path.basename(p))
                    for p in glob.glob(os.path.join(root, "*.txt"))})
    for name in names:
        print(f"== {name}")
        for label, path, fn in (("jax", f"progress-{name}.txt", jax_rows),
                                ("eng", f"interference-progress-{name}.txt", engine_progress_rows),
                                ("#22", f"interference-engine-{name}.txt", engine_bar_rows)):
            p = os.path.join(root, path)
            if os.path.exists(p):
                rows = fn(p)
                for k in range(0, len(rows), 4):
                    print(f"  {label} " + " | ".join(rows[k:k + 4]))


if __name__ == "__main__":
    main()
