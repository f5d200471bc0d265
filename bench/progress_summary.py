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


def rows(path, rules):
    """One short text per line of `path` that a rule's pattern matches (`re.match`): the rule's
    format of the match, or nothing where it gives None."""
    out = []
    for line in open(path, errors="replace"):
        for pattern, fmt in rules:
            m = re.match(pattern, line)
            if m and (text := fmt(m)) is not None:
                out.append(text)
    return out


def in_bar(m):
    """Only worlds 1 and 8: the issue's bars."""
    return m[2] in ("1", "8")


JAX = (  # bench/progress.py
    (r"progress: (\w+) +(rs|ag) \|.*\| ratio ([\d.]+) \| overlap (-?[\d.]+) \|", lambda m: f"{m[1]}:{m[2]} ov {m[4]} (r {m[3]})"),
    (r"progress: (\w+) +(rs|ag) \| HBM bound .*both / bound ([\d.]+)", lambda m: f"{m[1]}:{m[2]} both/hbm {m[3]}"),
    (r"progress: (rs|ag) alone ([\d.]+) ms", lambda m: f"{m[1]} alone {m[2]} ms"),
)
ENGINE_PROGRESS = (  # interference progress
    (r"progress: (RS|AG) world (\d+)[^|]*\| (\w+) .*overlap +(-?[\d.]+),.*victim in both.*\(([-+\d.]+)%\), coll in both.*\(([-+\d.]+)%\)",
     lambda m: f"{m[1]}{m[2]} {m[3]} ov {m[4]} v{m[5]}% c{m[6]}%" if in_bar(m) else None),
)
ENGINE_BARS = (  # interference engine: each row's setting, its time alone, each victim's slowdown
    (r"(RS|AG) world (\d+)[^:]*: (.*?),? *(?:TIDE_\w+=\w+ +)?alone ([\d.]+) ms.*?\| (.*)",
     lambda m: f"{m[1]}{m[2]} {m[3].strip()} {m[4]}ms "
               + " ".join(f"{v} {p}" for v, p in re.findall(r"(\w+) [\d.]+ -> [\d.]+ ms ([-+\d.]+%)", m[5]))
     if in_bar(m) else None),
)


def main():
    root = sys.argv[1]
    names = sorted({re.sub(r"^(progress|interference-\w+)-|\.txt$", "", os.path.basename(p))
                    for p in glob.glob(os.path.join(root, "*.txt"))})
    for name in names:
        print(f"== {name}")
        for label, path, rules in (("jax", f"progress-{name}.txt", JAX),
                                   ("eng", f"interference-progress-{name}.txt", ENGINE_PROGRESS),
                                   ("#22", f"interference-engine-{name}.txt", ENGINE_BARS)):
            p = os.path.join(root, path)
            if os.path.exists(p):
                found = rows(p, rules)
                for k in range(0, len(found), 4):
                    print(f"  {label} " + " | ".join(found[k:k + 4]))


if __name__ == "__main__":
    main()
