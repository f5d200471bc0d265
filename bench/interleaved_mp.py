"""Two tide programs reaching two processes in opposite orders, through JAX (issue #17 across
processes): what a user sees when each process launches them from its own threads in a different
order. Run under the launcher, one JAX device per process:

    python -m tide_jax.launch -n 2 --no-gpu-split -- python bench/interleaved_mp.py   # both on GPU 0
    python -m tide_jax.launch -n 2 --cpu-devices 1 -- python bench/interleaved_mp.py  # CPU devices

Each process: compiles and runs programs A (an all_gather + reduce_scatter on one layout) and B
(another layout) in the same order as its peer, checked exactly; then process 0 launches A while
process 1 launches B. Printed per process (one `interleaved_mp:` line): how long the mismatched
call took to fail and its message, then how long a later call took and its message. On GPUs calls
meet by launch order in the job's group, so both fail at the entry check (`--expect-fast`: within
1 s, naming the other's call and the fix); on CPU devices each call site has its own lane, so each
process waits in a different lane until TIDE_TIMEOUT_S.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--expect-fast", action="store_true", help="assert both fail within 1 s naming the fix")
    args = ap.parse_args()

    import jax
    import tide_jax

    tide_jax.initialize()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    world = len(devices)
    me = jax.process_index()

    def program(rows, cols):
        params = {"w": np.zeros((rows, cols), np.float32), "b": np.zeros((rows,), np.float32)}
        lay = tide_jax.layout(params, mesh, "fsdp")

        def step(shards):
            full = tide_jax.all_gather(shards, lay)
            return tide_jax.reduce_scatter(jax.tree.map(lambda x: x.astype(jnp.bfloat16), full), lay)

        f = jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec,), out_specs=lay.spec, check_vma=False))
        x = lay.shard({"w": np.full((rows, cols), 1.5, np.float32), "b": np.full((rows,), -2.0, np.float32)})

        want = {"w": world * 1.5, "b": -2.0 * world}

        def run_checked():
            # Each process checks its own shards (unshard would run an XLA collective, and NCCL
            # refuses two processes on one GPU): the owned rows hold the sum, padding rows zero.
            out = jax.block_until_ready(f(x))
            for p in lay.params:
                k = p.path.strip("[]'")
                for s in out[k].addressable_shards:
                    r = devices.index(s.device)
                    got = np.asarray(s.data).reshape(p.shard_rows, p.row_elems)
                    lo, hi = p.owned_rows(r)
                    assert (got[: hi - lo] == want[k]).all() and not got[hi - lo :].any(), f"{k} rank {r}"

        return f, x, run_checked

    a, b = program(20, 3), program(9, 5)
    for _ in range(2):  # compiled and run in the same order everywhere: exact
        a[2]()
        b[2]()

    def timed(prog):
        t0 = time.monotonic()
        try:
            jax.block_until_ready(prog[0](prog[1]))
            return time.monotonic() - t0, "completed"
        except Exception as e:  # noqa: BLE001 (reported)
            return time.monotonic() - t0, str(e)

    first, second = (a, b) if me == 0 else (b, a)
    t1, msg1 = timed(first)
    t2, msg2 = timed(second)
    print(f"interleaved_mp: process {me}: mismatched call failed after {t1:.3f} s: {msg1[:600]!r}; "
          f"later call after {t2:.3f} s: {msg2[:200]!r}", flush=True)
    if args.expect_fast:
        assert t1 < 1.0 and "is in a different call" in msg1 and "one thread per process" in msg1, (t1, msg1)
        assert t2 < 1.0 and msg2 != "completed", (t2, msg2)
    print(f"interleaved_mp: process {me}: ok", flush=True)


if __name__ == "__main__":
    main()
