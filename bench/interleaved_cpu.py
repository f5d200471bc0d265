"""Two tide programs launched from several Python threads at once on 8 CPU devices (issue #17):
which launch patterns stall inside XLA:CPU, and whether `tide_jax.dispatch_lock` prevents it.

    python3 bench/interleaved_cpu.py [--out DIR] [--calls 200] [--timeout-s 5] [--stall-ms MS]
                                     [--configs 2x48,4x40,4x40L] [--pjrt-nproc N]

Each configuration runs in its own process (a stall leaves XLA's queues in a state the next one
should not inherit): T threads, each launching `--calls` calls of its own program (two programs
with different layouts, one all_gather + one reduce_scatter each) and keeping up to W calls in
flight (waiting for the oldest result before the next launch), optionally under
`tide_jax.dispatch_lock`. Per configuration: calls correct, calls failed, how many failures were
timeouts ("did not arrive"), how many the interleaving message and how many tide's XLA:CPU stall
check (TIDE_STALL_MS; `--stall-ms 0` turns it off to see XLA's stall alone), the longest launch (a launch
blocks while XLA holds it back), the longest wait for a result, and the wall time (`--repeat` runs each). Writes DIR/results.md and DIR/results.json (default
bench/results/<date>-interleaved-cpu).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

CONFIGS = [  # (threads, calls in flight per thread, under dispatch_lock)
    (1, 64, False),
    (2, 1, False),
    (2, 16, False),
    (2, 18, False),
    (2, 20, False),
    (2, 32, False),
    (2, 48, False),
    (2, 48, True),
    (4, 40, False),
    (4, 40, True),
]


def worker(threads: int, window: int, locked: bool, calls: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("NPROC", "16")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    import tide_jax

    mesh = jax.make_mesh((8,), ("fsdp",))

    def program(rows, cols):
        params = {"w": np.zeros((rows, cols), np.float32), "b": np.zeros((rows,), np.float32)}
        lay = tide_jax.layout(params, mesh, "fsdp")

        def step(shards):
            full = tide_jax.all_gather(shards, lay)
            return tide_jax.reduce_scatter(jax.tree.map(lambda x: x.astype(jnp.bfloat16), full), lay)

        f = jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec,), out_specs=lay.spec, check_vma=False))
        return f, lay, rows, cols

    progs = [program(20, 3), program(9, 5)]
    jobs = []
    for t in range(threads):
        f, lay, rows, cols = progs[t % 2]
        v = float(t + 1)
        x = lay.shard({"w": np.full((rows, cols), v, np.float32), "b": np.full((rows,), -v, np.float32)})
        jax.block_until_ready(f(x))  # compile before timing
        jobs.append((f, lay, x, v))
    stats = dict(ok=0, wrong=0, failed=0, timeouts=0, interleaved=0, stalls=0, longest_wait_s=0.0, longest_launch_s=0.0)
    guard = threading.Lock()
    go = threading.Barrier(threads)

    def run(f, lay, x, v):
        go.wait()
        pending = []

        def collect(out):
            t0 = time.monotonic()
            try:
                full = lay.unshard(out)
                good = bool((np.asarray(full["w"]) == 8 * v).all() and (np.asarray(full["b"]) == -8 * v).all())
                key, msg = ("ok" if good else "wrong"), ""
            except Exception as e:  # noqa: BLE001 (counted)
                key, msg = "failed", str(e)
            with guard:
                stats[key] += 1
                stats["timeouts"] += "did not arrive" in msg
                stats["interleaved"] += "programs interleaved" in msg
                stats["stalls"] += "XLA:CPU never started" in msg
                stats["longest_wait_s"] = max(stats["longest_wait_s"], time.monotonic() - t0)

        for _ in range(calls):
            t0 = time.monotonic()
            if locked:
                with tide_jax.dispatch_lock(mesh):
                    pending.append(f(x))
            else:
                pending.append(f(x))
            with guard:  # a launch blocks while XLA holds it back (a device's 32 admitted)
                stats["longest_launch_s"] = max(stats["longest_launch_s"], time.monotonic() - t0)
            if len(pending) >= window:
                collect(pending.pop(0))
        for out in pending:
            collect(out)

    t0 = time.monotonic()
    ts = [threading.Thread(target=run, args=job) for job in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stats["wall_s"] = time.monotonic() - t0
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=200, help="calls per thread")
    ap.add_argument("--timeout-s", type=float, default=5.0, help="TIDE_TIMEOUT_S of each run")
    ap.add_argument("--stall-ms", type=int, default=None, help="TIDE_STALL_MS of each run (default: tide's)")
    ap.add_argument("--repeat", type=int, default=3, help="runs (processes) per configuration")
    ap.add_argument("--configs", default=None, help="only these rows, e.g. 2x48,4x40,4x40L (L: under the lock)")
    ap.add_argument("--pjrt-nproc", type=int, default=None,
                    help="PJRT_NPROC of each run: the size of XLA:CPU's launch pool (default: NPROC=16)")
    ap.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker[:2], bool(args.worker[2]), args.calls)))
        return 0
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{date}-interleaved-cpu")
    os.makedirs(out, exist_ok=True)
    rows = []
    wanted = None if not args.configs else set(args.configs.split(","))
    for threads, window, locked in CONFIGS:
        if wanted is not None and f"{threads}x{window}{'L' if locked else ''}" not in wanted:
            continue
        runs = []
        for _ in range(args.repeat):
            env = dict(os.environ, TIDE_TIMEOUT_S=str(args.timeout_s))
            if args.stall_ms is not None:
                env["TIDE_STALL_MS"] = str(args.stall_ms)
            if args.pjrt_nproc is not None:
                env["PJRT_NPROC"] = str(args.pjrt_nproc)
            cmd = [sys.executable, os.path.abspath(__file__), "--calls", str(args.calls),
                   "--worker", str(threads), str(window), str(int(locked))]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = [x for x in r.stdout.splitlines() if x.startswith("{")]
            runs.append(json.loads(line[-1]) if r.returncode == 0 and line else dict(error=(r.stderr or r.stdout)[-500:]))
        good = [x for x in runs if "error" not in x]
        res = dict(threads=threads, window=window, locked=locked, runs=runs, errors=len(runs) - len(good),
                   stalled_runs=sum(1 for x in good if x["failed"] + x["wrong"]))
        for k in ("ok", "wrong", "failed", "timeouts", "interleaved", "stalls"):
            res[k] = sum(x[k] for x in good)
        for k in ("longest_launch_s", "longest_wait_s", "wall_s"):
            res[k] = max((x[k] for x in good), default=0.0)
        rows.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    cmdline = "python3 bench/interleaved_cpu.py " + " ".join(sys.argv[1:])
    lines = [
        f"# Two tide programs from several threads on 8 CPU devices ({date})",
        "",
        f"Command: `{cmdline.strip()}` ({args.calls} calls per thread, TIDE_TIMEOUT_S={args.timeout_s:g}, "
        f"XLA:CPU launch pool {args.pjrt_nproc or 'NPROC=16'}, "
        f"{args.repeat} runs per row, each its own process; counts summed over the runs, times the largest).",
        f"Machine: {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}.",
        "",
        "| threads | in flight per thread | dispatch_lock | runs with failures | correct | failed | of which timeouts | of which interleaving | of which stalls | longest launch | longest wait for a result | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        crashed = f" ({r['errors']} crashed)" if r["errors"] else ""
        lines.append(
            f"| {r['threads']} | {r['window']} | {'yes' if r['locked'] else 'no'} | "
            f"{r['stalled_runs']} of {args.repeat - r['errors']}{crashed} | "
            f"{r['ok']} | {r['failed'] + r['wrong']} | {r['timeouts']} | {r['interleaved']} | {r.get('stalls', 0)} | "
            f"{r['longest_launch_s']:.2f} s | {r['longest_wait_s']:.2f} s | {r['wall_s']:.1f} s |"
        )
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(date=date, command=cmdline, calls=args.calls, timeout_s=args.timeout_s, pjrt_nproc=args.pjrt_nproc, rows=rows), f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
