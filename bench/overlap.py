"""How much of a tide collective hides behind independent compute in one jitted step (issue #9).

One command, on every visible GPU (a P-GPU mesh; P >= 2 is the real case: peer copies over NVLink):

    JAX_PLATFORMS=cuda python3 bench/overlap.py [--out DIR]     # tide_jax installed (scripts/gpu run overlap)

For the all-gather and the reduce-scatter of one bf16 parameter (per-GPU shard OVERLAP_MIB MiB,
default 256) next to a chain of OVERLAP_MM (8) bf16 OVERLAP_N x OVERLAP_N (8192) matmuls, median
wall times (ms) of one jitted program each:
    coll   the collective alone            mm    the matmul chain alone
    sync   the synchronous call and the chain, independent, in one program
    async  start -> ordered -> chain -> ordered -> done (tide_jax.ordered pins the order)
and overlap = (coll + mm - both) / min(coll, mm): 0 = serialized, 1 = fully hidden.
On 1 GPU (P = 1) the all-gather is a local copy-engine copy, which competes with the matmuls for
HBM and does not overlap (gpu-facts.md); the reduce-scatter is tide's reduction kernel (at most
TIDE_RS_MAX_CTAS CTAs) on tide's stream, which can share the SMs. Writes overlap.json to --out.
"""
import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax


def timeit(f, *args, reps=15):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    devs = jax.devices()
    world = len(devs)
    mesh = jax.make_mesh((world,), ("fsdp",))
    mib = int(os.environ.get("OVERLAP_MIB", "256"))
    k = int(os.environ.get("OVERLAP_MM", "8"))
    n = int(os.environ.get("OVERLAP_N", "8192"))
    cols = 8192
    rows = world * (mib << 20) // 2 // cols
    params = {"w": jnp.ones((rows, cols), jnp.bfloat16)}
    lay = tide_jax.layout(params, mesh, "fsdp")
    shards = lay.shard(params)
    grads = jax.device_put(
        jnp.full((world * rows, cols), 0.5, jnp.bfloat16), NamedSharding(mesh, P("fsdp"))
    )
    a = jax.device_put(jnp.ones((n, n), jnp.bfloat16) * 0.001, NamedSharding(mesh, P()))

    def chain(x0):
        x = x0
        for _ in range(k):
            x = (x @ x0).astype(jnp.bfloat16)
        return x.sum(dtype=jnp.float32)

    def coll_sync(op, s, g):
        if op == "all_gather":
            return tide_jax.all_gather(s, lay)["w"].sum(dtype=jnp.float32)
        return tide_jax.reduce_scatter({"w": g}, lay)["w"].sum(dtype=jnp.float32)

    def coll_async(op, s, g, compute_input, compute):
        if op == "all_gather":
            h = tide_jax.all_gather_start(s, lay)
        else:
            h = tide_jax.reduce_scatter_start({"w": g}, lay)
        h, x = tide_jax.ordered(h, compute_input)
        y = compute(x)
        h, y = tide_jax.ordered(h, y)
        out = tide_jax.all_gather_done(h) if op == "all_gather" else tide_jax.reduce_scatter_done(h)
        return out["w"].sum(dtype=jnp.float32), y

    def program(op, kind):
        def body(s, g, x):
            if kind == "coll":
                r = coll_sync(op, s, g)
            elif kind == "mm":
                r = chain(x)
            elif kind == "sync":
                r = coll_sync(op, s, g) + chain(x)
            else:
                c, y = coll_async(op, s, g, x, chain)
                r = c + y
            return r.reshape(1)

        f = tide_jax.shard_map(
            body, mesh=mesh, in_specs=(lay.spec, P("fsdp"), P()), out_specs=P("fsdp"), check_vma=False
        )
        return jax.jit(f)

    rows_out = []
    print(f"overlap: {world} GPU(s), shard {mib} MiB per GPU, {k} x bf16 {n}^3 matmuls; "
          f"jax {jax.__version__}; TIDE_RS_KERNEL={os.environ.get('TIDE_RS_KERNEL', '(default st)')}")
    print("| op | P | coll ms | mm ms | sync both ms | sync overlap | async both ms | async overlap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for op in ("all_gather", "reduce_scatter"):
        t = {kind: timeit(program(op, kind), shards, grads, a) for kind in ("coll", "mm", "sync", "async")}
        frac = lambda both: (t["coll"] + t["mm"] - both) / max(1e-9, min(t["coll"], t["mm"]))
        row = dict(op=op, world=world, shard_mib=mib, **{f"{k_}_ms": v for k_, v in t.items()},
                   sync_overlap=frac(t["sync"]), async_overlap=frac(t["async"]))
        rows_out.append(row)
        print(f"| {op} | {world} | {t['coll']:.3f} | {t['mm']:.3f} | {t['sync']:.3f} | {row['sync_overlap']:.2f} "
              f"| {t['async']:.3f} | {row['async_overlap']:.2f} |", flush=True)
    if world == 1:
        print("note: P=1: the all-gather is a local copy (HBM-bound, not expected to overlap); the reduce-scatter "
              "row shows tide's reduction kernel on tide's stream beside XLA's matmuls")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overlap.json"), "w") as f:
        json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
