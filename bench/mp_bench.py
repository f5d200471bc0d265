"""Multi-process benchmark rows (issue #4): one process per GPU under the launcher, the same groups and
timing method as bench.py (R calls looped in one jitted step, median per call), tide next to JAX's own
collectives in the same processes.

    python3 -m tide_jax.launch -n 2 -- python3 bench/mp_bench.py --out OUTDIR [--groups 1664,3328]
    TIDE_TOPOLOGY=2x1 python3 -m tide_jax.launch -n 2 -- python3 bench/mp_bench.py --out OUTDIR --tide-only

Process 0 writes OUTDIR/mp_bench[-<topology>].json and prints a markdown table.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B  # noqa: E402  (shapes, data, op bodies and the timing method)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--groups", default="1664,3328")
    ap.add_argument("--tide-only", action="store_true")
    args = ap.parse_args()

    import jax
    import numpy as np
    import tide_jax

    tide_jax.initialize()
    from jax.sharding import Mesh

    devs = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devs), (B.AXIS,))
    cfg = dict(samples=15, warm=2, dispatch_n=10, dispatch_rounds=3)
    topo = os.environ.get("TIDE_TOPOLOGY", "") or "flat"
    rows = {}
    for h in [int(g) for g in args.groups.split(",")]:
        shapes = B.layer_shapes(h)
        params, grads = B.make_data(jax, mesh, shapes, seed=h)
        lay = tide_jax.layout(params, mesh, B.AXIS)
        for p in lay.params:  # these groups divide evenly: the dim-0 sharded params are the tide shards
            assert p.shard_rows * lay.world == p.rows, (p.path, p.rows, lay.world)
        bodies = B.op_bodies(jax, mesh, shapes, tide_jax, lay)
        names = ["tide_ag", "tide_rs"]
        if not args.tide_only:
            names = ["jax_ag_per_param", "jax_rs_bf16", "jax_rs_upcast_fp32"] + names
        for name in names:
            body, kind, osp = bodies[name]
            arg = params if kind == "params" else grads
            spec = lay.spec if name.startswith("tide") else {k: jax.sharding.PartitionSpec(B.AXIS) for k in shapes}
            # Every process must issue the same calls: R is fixed here (bench.py's choose_R times each
            # process separately and could pick different R, which tide reports as ranks in different calls).
            R = max(4, int(8.0 / (0.001 * h)))
            fn1 = B.build_step(jax, mesh, body, kind, osp, 1, spec)
            dispatch = B.time_dispatch(jax, fn1, arg, cfg["dispatch_n"], cfg["dispatch_rounds"])
            fnR = B.build_step(jax, mesh, body, kind, osp, R, spec)
            steps = B.time_step(jax, fnR, arg, cfg["samples"], cfg["warm"])
            rows[f"h{h}.{name}"] = dict(per_call_ms=B.stats_ms([t / R for t in steps]),
                                        dispatch_ms=B.stats_ms(dispatch), R=R)
        del params, grads
    if jax.process_index() == 0:
        os.makedirs(args.out, exist_ok=True)
        tag = "" if topo == "flat" else f"-{topo}"
        env = dict(jax=jax.__version__, processes=jax.process_count(), devices=[str(d) for d in devs],
                   topology=topo, job=lay.job)
        with open(os.path.join(args.out, f"mp_bench{tag}.json"), "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
        print(f"\n| op ({jax.process_count()} processes, topology {topo}) | median ms | p10 | p90 | dispatch ms | R |")
        print("| --- | --- | --- | --- | --- | --- |")
        for k, r in rows.items():
            s = r["per_call_ms"]
            print(f"| {k} | {s['median']:.4f} | {s['p10']:.4f} | {s['p90']:.4f} | {r['dispatch_ms']['median']:.4f} | {r['R']} |")
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier


if __name__ == "__main__":
    main()
