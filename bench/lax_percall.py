"""Host cost of tide_jax.lax called once per leaf, against jax.lax, in one run.

Code written for jax.lax maps the collective over a params tree (`jax.tree.map(lambda w:
lax.all_gather(w, "fsdp", axis=1, tiled=True), params)`): one call per leaf. This times a jitted
shard_map step that does exactly that for LEAVES small leaves (gather along dim 1, then psum_scatter
of the result along dim 1), with jax.lax, with tide_jax.lax leaf by leaf, and with tide_jax.lax on
the whole tree in one call, on the devices of one platform (world = their number; on one GPU set
TIDE_WORLD1_NATIVE=1 so tide's calls are real). Medians of REPS timed steps after warm-up.

    TIDE_WORLD1_NATIVE=1 python bench/lax_percall.py [--leaves 64] [--reps 50] [--platform gpu]

Prints one line per variant (`lax_percall:`) and the ratios to jax.lax.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--platform", default=None)
    ap.add_argument("--shape", default="256,512", help="one leaf's global shape")
    args = ap.parse_args()
    devices = jax.devices(args.platform) if args.platform else jax.devices()
    mesh = Mesh(np.array(devices), ("fsdp",))
    world = len(devices)
    rows, cols = (int(s) for s in args.shape.split(","))
    cols = cols // world * world
    rng = np.random.default_rng(0)
    tree = {f"w{i}": jax.device_put(rng.standard_normal((rows, cols)).astype(jnp.bfloat16),
                                    NamedSharding(mesh, P(None, "fsdp"))) for i in range(args.leaves)}
    specs = jax.tree.map(lambda _: P(None, "fsdp"), tree)

    def variant(lax, whole):
        def body(t):
            if whole:
                full = lax.all_gather(t, "fsdp", axis=1, tiled=True)
                return lax.psum_scatter(full, "fsdp", scatter_dimension=1, tiled=True)
            full = jax.tree.map(lambda w: lax.all_gather(w, "fsdp", axis=1, tiled=True), t)
            return jax.tree.map(lambda w: lax.psum_scatter(w, "fsdp", scatter_dimension=1, tiled=True), full)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs))

    results = {}
    for name, f in [("jax.lax per leaf", variant(jax.lax, False)),
                    ("tide_jax.lax per leaf", variant(tide_jax.lax, False)),
                    ("tide_jax.lax whole tree", variant(tide_jax.lax, True))]:
        for _ in range(5):
            jax.block_until_ready(f(tree))
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            jax.block_until_ready(f(tree))
            times.append(time.perf_counter() - t)
        results[name] = statistics.median(times)
        text = f.lower(tree).as_text()
        calls = text.count("tide_all_gather") + text.count("tide_reduce_scatter")
        print(f"lax_percall: {name}: median step {results[name] * 1e6:.0f} us over {args.reps} "
              f"({args.leaves} leaves [{rows}, {cols}] bf16, world {world}, {devices[0].platform}; "
              f"tide custom calls in the program: {calls})", flush=True)
    base = results["jax.lax per leaf"]
    for name, t in results.items():
        print(f"lax_percall: {name} / jax.lax per leaf = {t / base:.2f}")


if __name__ == "__main__":
    main()
