"""Per-call cost of tide's collectives through JAX vs the number of parameters in a group (issue #9;
the method of shared/baselines/percall_probe.py). On one GPU (P=1: the data movement is a local
copy, so what grows with N is per-parameter host and launch work), R calls in a `lax.scan`:

    JAX_PLATFORMS=cuda python3 bench/percall.py [--out DIR]     # tide_jax installed (scripts/gpu run percall)

Rows per N (bf16 64x1024 parameters): tide all-gather and reduce-scatter (synchronous targets),
the all-gather as start+done, and an XLA elementwise op on the same leaves as the reference; us per
call and per parameter. Target (issue #9): <= 1 us per parameter. PERCALL_N overrides the sizes
(comma-separated). Writes percall.json to --out.
"""
import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import tide_jax

R = 50


def t(f, *a):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(7):
        s = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - s)
    return statistics.median(ts) / R * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    mesh = jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1])
    sizes = [int(x) for x in os.environ.get("PERCALL_N", "1,8,64,256").split(",")]
    rows = []
    for n in sizes:
        params = {f"p{i:04d}": jnp.ones((64, 1024), jnp.bfloat16) for i in range(n)}
        lay = tide_jax.layout(params, mesh, "fsdp")
        sh = lay.shard(params)

        def loop(op):
            def body(s):
                def it(c, _):
                    if op == "ag":
                        c = tide_jax.all_gather(c, lay)
                    elif op == "ag_start_done":
                        c = tide_jax.all_gather_done(tide_jax.all_gather_start(c, lay))
                    elif op == "rs":
                        c = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tide_jax.reduce_scatter(c, lay))
                    else:
                        c = jax.tree.map(lambda x: x + 1, c)
                    return c, None

                c, _ = jax.lax.scan(it, s, None, length=R)
                return c

            return jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=(lay.spec,), out_specs=lay.spec, check_vma=False))

        r = {k: t(loop(k), sh) for k in ("ag", "ag_start_done", "rs", "copy")}
        rows.append(dict(params=n, **{f"{k}_us": v for k, v in r.items()}))
        print(
            f"{n:5d} params: tide AG {r['ag']:8.1f} us/call ({r['ag'] / n:5.2f}/param), AG start+done "
            f"{r['ag_start_done']:8.1f} ({r['ag_start_done'] / n:5.2f}/param), RS {r['rs']:8.1f} "
            f"({r['rs'] / n:5.2f}/param), XLA elementwise {r['copy']:7.1f} us/call",
            flush=True,
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "percall.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
