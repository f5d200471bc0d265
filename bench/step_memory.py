"""Where a training step's memory goes, from XLA's own plan, without running it: compiles
examples/llama.py's train step for a model (abstract state: nothing allocated) under each backend
and prints XLA's memory analysis (arguments, outputs, aliased, temporaries) and, from the buffer
assignment XLA dumps, the largest buffers live at the step's peak.

    python3 bench/step_memory.py --model 8b-layers --remat dots          # CPU compile, 1 device
    python3 bench/step_memory.py --model 8b-layers --remat dots --devices 1 --runs tide-native,tide,jax-fp32

Runs: `tide` (tide_jax, world 1: the collectives are local, no native call), `tide-native` (the
same with the native calls, TIDE_WORLD1_NATIVE=1), `tide-native-nointo` (the native calls with
TIDE_RS_INTO=0: each layer's gradient shards reduce-scattered into a result of their own, then
copied into the gradient buffer), `tide-native-nocast` (the native calls with TIDE_AG_CAST=0: XLA's
convert to a bf16 shard, then the plain all-gather), `tide-native-unroll1` (the native calls,
TIDE_SCAN_UNROLL=1: one layer per scan iteration; the default is 2), `jax-fp32` (plain JAX, fp32 gradient sums).
On a CPU the plan is XLA:CPU's (its fusions and schedule differ from XLA:GPU's); on a GPU, XLA:GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def peak_buffers(dump_dir: str, top: int) -> list[str]:
    """The buffer assignment's peak-buffer lines of the train step (XLA's dump; XLA:CPU writes none)."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*jit_step*buffer-assignment.txt")), key=os.path.getmtime)
    if not files:
        return ["(no buffer assignment dumped)"]
    text = open(files[-1]).read()
    m = re.search(r"Peak buffers:\n(.*?)(\n\n|\Z)", text, re.S)
    if not m:  # newer XLA: the memory-usage report lists the allocations, largest first
        report = files[-1].replace("-buffer-assignment.txt", "-memory-usage-report.txt")
        if os.path.exists(report):
            lines = [ln.strip() for ln in open(report) if re.match(r"\s+[\d.]+[KMG]iB\(", ln)]
            return [ln[:300] for ln in lines[:top]]
        return [f"(no 'Peak buffers' section in {os.path.basename(files[-1])})"]
    out, cur = [], None
    for line in m.group(1).splitlines():
        if line.strip().startswith("Buffer "):
            cur = [line.strip()]
            out.append(cur)
        elif cur is not None and line.strip():
            cur.append(line.strip())
    return [" | ".join(b)[:300] for b in out[:top]]


_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def copies(hlo: str) -> tuple[int, float, int, float]:
    """(count, GiB) of the copy instructions in the compiled HLO text, then of those whose operand is a
    tide custom call's result (static occurrences: one in a loop body runs every iteration)."""
    tide = set(re.findall(r"%([\w.\-]+) = [^\n]*custom_call_target=\"tide_", hlo))
    n = n_tide = 0
    size = size_tide = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\S* copy\(%([\w.\-]+)", hlo):
        dt, dims, src = m.groups()
        b = _DTYPE_BYTES.get(dt, 4)
        for d in filter(None, dims.split(",")):
            b *= int(d)
        n, size = n + 1, size + b
        if src in tide:
            n_tide, size_tide = n_tide + 1, size_tide + b
    return n, size / 2**30, n_tide, size_tide / 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="8b-layers")
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--reshard", default="on", choices=["on", "off"])
    ap.add_argument("--runs", default="tide-native,tide-native-nocast,tide,jax-fp32")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="peak buffers to list per run")
    ap.add_argument("--vocab", type=int, default=32768,
                    help="the vocabulary (default 32768: the synthetic data bench/train_bench.py trains on, so the "
                         "plan is that of the step it times)")
    args = ap.parse_args()
    dump_root = os.environ.get("TIDE_STEP_MEMORY_DUMP") or tempfile.mkdtemp(prefix="tide-step-memory-")
    os.makedirs(dump_root, exist_ok=True)
    if not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_root} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*jit_step.*")
    if importlib.util.find_spec("tide_jax") is None:  # a source checkout without an installed tide_jax
        sys.path.insert(0, os.path.join(REPO, "python"))
    sys.path.append(os.path.join(REPO, "examples"))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import llama
    import tide_jax
    from tide_jax import _native

    devices = jax.devices()[: args.devices]
    mesh = Mesh(np.array(devices), (llama.AXIS,))
    cfg = llama.MODELS[args.model]
    cfg = dataclasses.replace(cfg, remat=args.remat, reshard=args.reshard == "on", vocab=args.vocab,
                              attention=llama.choose_attention(cfg, devices[0].platform, lambda *a: None))
    lays = llama.Layouts.build(cfg, mesh)
    tx = llama.optimizer(llama.OptConfig(steps=10, lr=cfg.lr, warmup=1), cfg)
    state = llama.abstract_state(cfg, lays, tx)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch = cfg.batch_per_device * len(devices)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq + 1), jnp.int32,
                                  sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(llama.AXIS)))
    gib = 1 << 30
    print(f"model {args.model}: {cfg.n_params() / 1e6:.0f}M params, {cfg.layers} layers, d {cfg.d_model}, vocab {cfg.vocab}; "
          f"remat {args.remat}, reshard {args.reshard}; {len(devices)} x {devices[0].device_kind}")
    for run in args.runs.split(","):
        _native._world1_native = run.startswith("tide-native")
        os.environ["TIDE_RS_INTO"] = "0" if run == "tide-native-nointo" else "1"
        os.environ["TIDE_AG_CAST"] = "0" if run == "tide-native-nocast" else "1"
        os.environ["TIDE_SCAN_UNROLL"] = "1" if run == "tide-native-unroll1" else "2"
        backend = llama.Backend("tide" if run.startswith("tide") else "jax", "fp32")
        step = llama.make_train_step(cfg, backend, lays, mesh, tx, shardings)
        compiled = step.lower(state, tokens).compile()
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        print(f"{run:18s} step {total / gib:7.3f} GiB = arguments {m.argument_size_in_bytes / gib:.3f} + outputs "
              f"{m.output_size_in_bytes / gib:.3f} - aliased {m.alias_size_in_bytes / gib:.3f} + temporaries "
              f"{m.temp_size_in_bytes / gib:.3f}")
        n, gb, nt, gbt = copies(compiled.as_text())
        print(f"{'':18s} copies in the compiled program: {n} ({gb:.2f} GiB, static), of tide results: {nt} ({gbt:.2f} GiB)")
        for line in peak_buffers(dump_root, args.top):
            print("    " + line)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
