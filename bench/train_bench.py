"""Step time of the FSDP training step (examples/train.py): tide vs plain JAX, per model and tokens/device.

    python3 bench/train_bench.py                                   # tiny model, 8 CPU devices
    python3 bench/train_bench.py --models 150m,1b --tokens 8192,16384   # GPUs (all of them)

For each model and tokens-per-device, `examples/train.py --compare` runs (one process each, XLA_FLAGS
differ) tide and plain-JAX FSDP in both reduction modes, with XLA's default flags and MaxText's:
    tide  tide:maxtext  jax-fp32:default  jax-fp32 (maxtext)  jax-bf16:default  jax-bf16 (maxtext)
Reported: median step time over the steps after compile and warm-up (--steps 30: 27 timed), tokens/s,
MFU and peak device memory. Writes OUT/results.md (date, machine, command, table), OUT/results.json,
OUT/train_bench.png and each run's per-step JSON under OUT/<model>-<tokens>/.
Arguments it does not know go to train.py (e.g. --devices 2, --layers 8, --remat, --data synthetic).
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
RUNS = "tide,tide:maxtext,jax-fp32:default,jax-fp32,jax-bf16:default,jax-bf16"


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated (default: tiny on CPU, 150m,1b on GPUs)")
    ap.add_argument("--tokens", help="tokens per device per step, comma-separated (default: the model's)")
    ap.add_argument("--runs", default=RUNS, help=f"train.py --runs (default {RUNS})")
    ap.add_argument("--steps", type=int, default=30, help="steps per run (>= 23 for 20 timed steps)")
    ap.add_argument("--out", help="default bench/results/<date>-train-<cpu|gpu>")
    args, passthrough = ap.parse_known_args()
    gpu = _gpu_present() and "--cpu" not in passthrough
    models = (args.models or ("150m,1b" if gpu else "tiny")).split(",")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = args.out or os.path.join(HERE, "results", f"{date}-train-{'gpu' if gpu else 'cpu'}")
    os.makedirs(out, exist_ok=True)

    sys.path.insert(0, os.path.join(REPO, "examples"))
    from model_sizes import MODELS  # noqa: E402  (the model table; no jax import)

    results, failed = [], []
    for model in models:
        seq = int(_opt(passthrough, "--seq") or MODELS[model].seq)
        tokens_list = [None] if not args.tokens else [int(t) for t in args.tokens.split(",")]
        for tokens in tokens_list:
            extra = [] if tokens is None else ["--batch-per-device", str(max(1, tokens // seq))]
            tag = f"{model}-{tokens or 'default'}"
            cmd = [sys.executable, TRAIN, "--compare", "--model", model, "--steps", str(args.steps),
                   "--eval-every", "0", "--runs", args.runs, "--out", os.path.join(out, tag), *extra, *passthrough]
            print(f"bench: {' '.join(cmd)}", flush=True)
            r = subprocess.run(cmd)
            if r.returncode:
                failed.append(tag)
            for name in args.runs.split(","):
                path = os.path.join(out, tag, f"{name.replace(':', '-')}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        res = json.load(f)
                    res.pop("records", None)
                    res["config_tag"] = tag
                    results.append(res)
    if not results:
        print("bench: no run finished", file=sys.stderr)
        return 1

    r0 = results[0]
    command = " ".join(["python3", "bench/train_bench.py", *sys.argv[1:]])
    lines = [
        f"# FSDP training step: tide vs plain JAX ({date})",
        "",
        f"- machine: {r0['devices']} x {r0['device_kind']} ({r0['platform']}), host {_cpu_model()}, "
        f"{os.cpu_count()} cores; jax {r0['jax']}",
        f"- command: `{command}`",
        f"- median step time over the steps after compile and warm-up ({r0['timed_steps']} of {args.steps}); "
        "MFU = 6 N + attention FLOPs per token / (time x peak bf16)",
        "",
        "| model | tokens/device | run | XLA flags | median step | tokens/s | MFU | peak memory | final loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        mem = res["peak_memory_bytes"]
        lines.append(
            f"| {res['model']} ({res['config']['layers']} layers) | {res['tokens_per_step'] // res['devices']} | "
            f"{res['name']} | {res['xla_flags']} | {1e3 * res['median_step_s']:.1f} ms | {res['tokens_per_s']:,.0f} | "
            f"{_pct(res['mfu'])} | {_gib(mem)} | {res['final_loss']:.4f} |")
    if failed:
        lines += ["", f"failed: {', '.join(failed)}"]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(date=date, command=command, results=results), f, indent=1)
    _plot(results, os.path.join(out, "train_bench.png"))
    return 1 if failed else 0


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _gib(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f} GiB"


def _opt(argv, name):
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"bench: no plot ({path}): matplotlib is not installed; the numbers are in results.md", flush=True)
        return
    tags = list(dict.fromkeys(r["config_tag"] for r in results))
    names = list(dict.fromkeys(r["name"] for r in results))
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(tags) + 2), 4.5))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, tag in enumerate(tags):
            for r in results:
                if r["config_tag"] == tag and r["name"] == name:
                    xs.append(i + (j - (len(names) - 1) / 2) * width)
                    ys.append(1e3 * r["median_step_s"])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(tags)), tags)
    r0 = results[0]
    ax.set(ylabel="median step time (ms)", title=f"FSDP training step, {r0['devices']} x {r0['device_kind']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"bench: wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
