"""The same jitted step launched from several Python threads at once (issue #8 part 4): every launch
gets its own results, in about the time of running them one after another, never a stall for
TIDE_TIMEOUT_S. Launches are told apart by XLA's RunId; a loop's calls of one site count per run
(src/rendezvous.rs `run_seq`), so interleaved launches on a device cannot swap their calls."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"


def test_same_step_from_threads_at_once(tide_backend):
    mesh = make_mesh((8,), (AXIS,))
    params = {"w": np.zeros((20, 3), np.float32), "b": np.zeros((5,), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    loops = 3

    def step(shards):
        def body(total, _):
            full = tide_jax.gather_params(shards, lay)  # all-gather; reduce-scatter in the grad
            loss = lambda s: sum(jnp.sum(x * x) for x in jax.tree.leaves(tide_jax.gather_params(s, lay)))
            grads = jax.grad(loss)(shards)
            return total + full["w"].sum() + full["b"].sum(), grads

        total, grads = jax.lax.scan(body, jnp.float32(0.0), None, length=loops)
        return total[None], jax.tree.map(lambda g: g[-1], grads)

    f = jax.jit(
        tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec,), out_specs=(P(AXIS), lay.spec), check_vma=False)
    )
    threads, rounds = 4, 10
    inputs = [lay.shard({"w": np.full((20, 3), t + 1.0, np.float32), "b": np.full((5,), -(t + 1.0), np.float32)})
              for t in range(threads)]
    jax.block_until_ready(f(inputs[0]))  # compile once
    failures, errors = [], []

    def run(t):
        try:
            v = t + 1.0
            for _ in range(rounds):
                total, grads = f(inputs[t])
                total, grads = np.asarray(total), lay.unshard(grads)
                if not (total == loops * (60 * v - 5 * v)).all():
                    failures.append((t, "total", total[:2]))
                # d/ds sum(x^2) of the gathered parameter, reduce-scattered over 8 devices: 8 * 2 * x
                if not (np.asarray(grads["w"]) == 16 * v).all() or not (np.asarray(grads["b"]) == -16 * v).all():
                    failures.append((t, "grads"))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((t, str(e)[:500]))

    t0 = time.monotonic()
    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t0
    assert not errors, errors
    assert not failures, failures[:5]
    assert elapsed < 60, f"{threads} threads x {rounds} steps took {elapsed:.1f} s"
