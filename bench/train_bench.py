"""Step time and memory of the FSDP training step (examples/train.py): tide vs plain JAX, per model and
per memory setting (activation policy x parameter resharding), like for like.

    python3 bench/train_bench.py                                         # tiny model, 8 CPU devices
    python3 bench/train_bench.py --models 150m,1b,8b-layers --remat none,full,dots --reshard both   # GPU

For each model, one process (`examples/train.py --sweep`) runs every setting, and at each setting tide
and plain JAX (`--runs`, default tide,jax-fp32) back to back (which goes first alternates), with the
same XLA flags (`--xla-flags`, default XLA's own: one process has one flag set; at one device the
collective flags change nothing), the same data, init and optimizer. Both backends take the same
knobs with the same meaning (examples/llama.py): `--remat` the activation policy (tide_jax.remat_policy
names) and `--reshard` whether gathered parameters are freed after each layer's forward.
Reported per run: median step time over the steps after warm-up (`--steps`, default 26: 23 timed),
tokens/s, MFU, and the step's memory as XLA plans it (arguments + outputs - donated + temporaries:
per run, independent of what else ran in the process) next to the process's peak. Then, per model,
tide/jax at each setting and each backend's fastest setting that fits. Writes OUT/results.md (date,
machine, command, tables), OUT/results.json, OUT/train_bench.png and each run's JSON under OUT/<model>/.
Arguments it does not know go to train.py (e.g. --layers 8, --batch-per-device 4, --data stdlib).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TRAIN = os.path.join(REPO, "examples", "train.py")


def _gpu_present() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return os.path.exists("/dev/nvidiactl")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def settings(remat: str, reshard: str) -> str:
    hows = {"both": ["reshard", "no-reshard"], "on": ["reshard"], "off": ["no-reshard"]}[reshard]
    return ",".join(f"{r}:{h}" for r in remat.split(",") for h in hows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated (default: tiny on CPU, 150m,1b,8b-layers on GPUs)")
    ap.add_argument("--remat", default="none,full,dots", help="activation policies (default none,full,dots)")
    ap.add_argument("--reshard", choices=("both", "on", "off"), default="both",
                    help="parameter resharding after the forward: both settings (default), on, off")
    ap.add_argument("--runs", default="tide,jax-fp32", help="train.py runs at each setting (default tide,jax-fp32)")
    ap.add_argument("--steps", type=int, default=26, help="steps per run (>= 23 for 20 timed steps)")
    ap.add_argument("--xla-flags", choices=("default", "maxtext"), default="default")
    ap.add_argument("--out", help="default bench/results/<date>-train-<cpu|gpu>")
    args, passthrough = ap.parse_known_args()
    gpu = _gpu_present() and "--cpu" not in passthrough
    models = (args.models or ("150m,1b,8b-layers" if gpu else "tiny")).split(",")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or os.path.join(HERE, "results", f"{date}-train-{'gpu' if gpu else 'cpu'}")
    os.makedirs(out, exist_ok=True)
    sweep = settings(args.remat, args.reshard)
    extra = [] if any(a.startswith("--data") for a in passthrough) else ["--data", "synthetic"]
    if not any(a.startswith("--eval-every") for a in passthrough):
        extra += ["--eval-every", "0"]

    results, failed = [], []
    for model in models:
        cmd = [sys.executable, TRAIN, "--sweep", sweep, "--runs", args.runs, "--model", model, "--steps",
               str(args.steps), "--xla-flags", args.xla_flags, "--out", os.path.join(out, model),
               *extra, *passthrough]
        print(f"bench: {' '.join(cmd)}", flush=True)
        r = subprocess.run(cmd)
        if r.returncode:
            failed.append(model)
        folder = os.path.join(out, model)
        for fname in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if fname.endswith(".json"):
                with open(os.path.join(folder, fname)) as f:
                    res = json.load(f)
                res.pop("records", None)
                res.setdefault("model", model)
                results.append(res)
    if not results:
        print("bench: no run finished", file=sys.stderr)
        return 1
    command = " ".join(["python3", "bench/train_bench.py", *sys.argv[1:]])
    text = report(results, models, sweep, args, command, date)
    print(text, flush=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(date=date, command=command, results=results), f, indent=1)
    _plot(results, models, os.path.join(out, "train_bench.png"))
    if failed:
        print(f"bench: a sweep failed for {', '.join(failed)} (see above)", file=sys.stderr)
    return 1 if failed else 0


def _key(res):
    return (res.get("model"), res.get("remat"), bool(res.get("reshard")))


def report(results, models, sweep, args, command, date) -> str:
    ok = [r for r in results if "error" not in r]
    r0 = ok[0] if ok else results[0]
    runs = args.runs.split(",")
    lines = [
        f"# FSDP training step: tide vs plain JAX, per memory setting ({date})",
        "",
        f"- machine: {r0.get('devices', '?')} x {r0.get('device_kind', '?')} ({r0.get('platform', '?')}), host "
        f"{_cpu_model()}, {os.cpu_count()} cores; jax {r0.get('jax', '?')}; XLA flags: {args.xla_flags} for every run",
        f"- command: `{command}`",
        f"- per model one process; at each setting the runs back to back; median step over the steps after "
        f"warm-up ({r0.get('timed_steps', '?')} of {args.steps}); MFU = (6 N + attention) FLOPs per token / "
        "(time x peak bf16); memory: XLA's plan of the step (arguments + outputs - donated + temporaries)",
        "",
    ]
    by = {(_key(r), r.get("run")): r for r in results}
    for model in models:
        cfg = next((r["config"] for r in ok if r.get("model") == model), None)
        head = f"## {model}"
        tokens = next((r["tokens_per_step"] // r["devices"] for r in ok if r.get("model") == model), None)
        if cfg:
            head = f"## {model} ({cfg['layers']} layers, d {cfg['d_model']}, {tokens} tokens/device, attention {cfg.get('attention') or 'auto'})"
        lines += [head, "",
                  "| remat | reshard | " + " | ".join(f"{n} step (MFU)" for n in runs) + " | " +
                  f"{runs[0]} / {runs[-1]} | " + " | ".join(f"{n} memory" for n in runs) + " | memory diff |",
                  "| --- | --- | " + " | ".join("---" for _ in runs) + " | --- | " + " | ".join("---" for _ in runs) + " | --- |"]
        best = {}
        for item in sweep.split(","):
            remat, _, how = item.partition(":")
            key = (model, remat, how == "reshard")
            cells, mems, times = [], [], []
            for n in runs:
                r = by.get((key, n))
                if r is None:
                    cells.append("-"), mems.append("-"), times.append(None)
                elif "error" in r:
                    cells.append("does not fit" if r.get("oom") else "failed"), mems.append("-"), times.append(None)
                else:
                    cells.append(f"{1e3 * r['median_step_s']:.1f} ms ({_pct(r['mfu'])})")
                    mems.append(_gib(r.get("step_memory_bytes")))
                    times.append(r["median_step_s"])
                    b = best.get(n)
                    if b is None or r["median_step_s"] < b["median_step_s"]:
                        best[n] = r
            ratio = f"{times[0] / times[-1]:.3f}x" if times[0] and times[-1] else "-"
            mdiff = "-"
            ra, rb = by.get((key, runs[0])), by.get((key, runs[-1]))
            if ra and rb and ra.get("step_memory_bytes") and rb.get("step_memory_bytes"):
                mdiff = f"{(ra['step_memory_bytes'] - rb['step_memory_bytes']) / 2**30:+.2f} GiB"
            lines.append(f"| {remat} | {'yes' if how == 'reshard' else 'no'} | " + " | ".join(cells) +
                         f" | {ratio} | " + " | ".join(mems) + f" | {mdiff} |")
        if len(best) == len(runs):
            a, b = best[runs[0]], best[runs[-1]]
            lines += ["", f"fastest that fits: {runs[0]} {1e3 * a['median_step_s']:.1f} ms ({_pct(a['mfu'])}; remat "
                      f"{a['remat']}, reshard {'yes' if a['reshard'] else 'no'}) vs {runs[-1]} "
                      f"{1e3 * b['median_step_s']:.1f} ms ({_pct(b['mfu'])}; remat {b['remat']}, reshard "
                      f"{'yes' if b['reshard'] else 'no'}): {a['median_step_s'] / b['median_step_s']:.3f}x"]
        lines.append("")
    return "\n".join(lines) + "\n"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def _plot(results, models, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench: no plot ({path}): matplotlib is not installed; the numbers are in results.md", flush=True)
        return
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in ok if r.get("model") == model]
        tags = list(dict.fromkeys(f"{r['remat']}\n{'reshard' if r['reshard'] else 'keep'}" for r in rs))
        names = list(dict.fromkeys(r["run"] for r in rs))
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            xs, ys = [], []
            for i, tag in enumerate(tags):
                for r in rs:
                    if r["run"] == name and f"{r['remat']}\n{'reshard' if r['reshard'] else 'keep'}" == tag:
                        xs.append(i + (j - (len(names) - 1) / 2) * width)
                        ys.append(1e3 * r["median_step_s"])
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks(range(len(tags)), tags, fontsize=8)
        ax.set(ylabel="median step (ms)", title=model)
        ax.legend(fontsize=8)
    fig.suptitle(f"FSDP step per memory setting, {ok[0]['devices']} x {ok[0]['device_kind']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"bench: wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
