"""Every public op under jax.vmap, forward and gradient, equals the jax backend (issue #15).

The use that motivated it: a per-example forward (Equinox style, `jax.vmap(model)(xs)`) whose
layers run through `scan_layers`: its gradient vmaps the custom VJP, and with it the start/done
calls ([Note: start/done under vmap] in tide_jax/_native.py). On 3 CPU devices (native calls), odd shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"
WORLD = 3
B = 4  # the vmapped batch


def _setup(seed=0):
    mesh = make_mesh((WORLD,), (AXIS,))
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((7, 5)).astype(np.float32), "b": rng.standard_normal((5,)).astype(np.float32),
              "g": np.float32(1.3)}
    lay = tide_jax.layout(params, mesh, AXIS)
    return mesh, rng, params, lay


def _close(a, b, tol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        assert np.max(np.abs(x - y)) <= tol * max(1.0, float(np.max(np.abs(y)))), float(np.max(np.abs(x - y)))


def _both(fn, in_specs, out_specs, *args):
    """fn(backend, *args) under shard_map on both backends."""
    mesh = make_mesh((WORLD,), (AXIS,))
    out = {}
    for backend in ("tide", "jax"):
        f = jax.jit(tide_jax.shard_map(lambda *a, b=backend: fn(b, *a), mesh=mesh, in_specs=in_specs,
                                       out_specs=out_specs))
        out[backend] = jax.device_get(f(*args))
    return out


@pytest.mark.parametrize("op", ["all_gather", "all_gather_start_done"])
def test_gather_under_vmap(op):
    """A batch of B different shard sets per device, gathered under vmap."""
    mesh, rng, params, lay = _setup(1)
    batch = [jax.tree.map(lambda t: t + i, params) for i in range(B)]
    shards = jax.tree.map(lambda *t: jnp.stack(t), *[lay.shard(p) for p in batch])  # (B, P*rows, ...)
    spec = jax.tree.map(lambda s: P(None, *s), lay.spec, is_leaf=lambda s: isinstance(s, P))

    def fn(backend, s):
        def one(s):
            if op == "all_gather":
                return tide_jax.all_gather(s, lay, backend=backend)
            return tide_jax.all_gather_done(tide_jax.all_gather_start(s, lay, backend=backend))
        full = jax.vmap(one)(s)
        return jax.tree.map(lambda t: jax.lax.psum(t, AXIS) / WORLD, full)

    out = _both(fn, (spec,), P(), shards)
    _close(out["tide"], out["jax"])
    for i, p in enumerate(batch):
        _close(jax.tree.map(lambda t: t[i], out["tide"]), p)


@pytest.mark.parametrize("op", ["reduce_scatter", "reduce_scatter_start_done"])
def test_reduce_scatter_under_vmap(op):
    mesh, rng, params, lay = _setup(2)
    grads = {k: rng.standard_normal((WORLD * B, *np.shape(v))).astype(np.float32) for k, v in params.items()}
    grads = {k: jax.device_put(v, NamedSharding(mesh, P(AXIS))) for k, v in grads.items()}
    gspec = {k: P(AXIS) for k in params}

    def fn(backend, g):
        def one(g):
            if op == "reduce_scatter":
                return tide_jax.reduce_scatter(g, lay, backend=backend)
            return tide_jax.reduce_scatter_done(tide_jax.reduce_scatter_start(g, lay, backend=backend))
        return jax.vmap(one)(g)  # (B, shard_rows, ...) per device

    spec = jax.tree.map(lambda s: P(None, *s), lay.spec, is_leaf=lambda s: isinstance(s, P))
    out = _both(fn, (gspec,), spec, grads)
    _close(out["tide"], out["jax"])


def test_gather_params_value_and_grad_under_vmap():
    """Per-example loss with shared (unbatched) parameters: the gradient sums the per-example
    reduce-scatters."""
    mesh, rng, params, lay = _setup(3)
    shards = lay.shard(params)
    x = jax.device_put(rng.standard_normal((WORLD * B, 7)).astype(np.float32), NamedSharding(mesh, P(AXIS)))

    def fn(backend, s, x):
        def loss(s):
            def per_example(xi):
                p = tide_jax.gather_params(s, lay, jnp.float32, backend=backend)
                return jnp.sum(jnp.tanh(xi @ p["w"] + p["b"]) * p["g"])
            return jnp.sum(jax.vmap(per_example)(x))
        value, grads = jax.value_and_grad(loss)(s)
        return jax.lax.psum(value, AXIS), grads

    out = _both(fn, (lay.spec, P(AXIS)), (P(), lay.spec), shards, x)
    _close(out["tide"], out["jax"])


@pytest.mark.parametrize("reshard", [True, False])
def test_scan_layers_forward_and_gradient_under_vmap(reshard):
    """The Equinox pattern: jax.vmap of a per-sequence forward whose layers run through scan_layers."""
    import test_loop as T

    mesh = make_mesh((WORLD,), (AXIS,))
    rng = np.random.default_rng(4)
    stacked = T.model(rng, 4)
    lay = tide_jax.layout(T._one(stacked), mesh, AXIS)
    shards = lay.shard_stacked(stacked)
    x = jax.device_put(rng.standard_normal((WORLD * B, 3, T.D)).astype(np.float32), NamedSharding(mesh, P(AXIS)))

    def fn(backend, s, x):
        def loss(s, x):
            def per_sequence(xi):
                return tide_jax.scan_layers(T.layer_fn, xi, s, lay, dtype=jnp.float32, backend=backend,
                                            reshard_after_forward=reshard)
            y = jax.vmap(per_sequence)(x)
            return jnp.sum(y * y), y
        (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(s, x)
        return jax.lax.psum(value, AXIS), y, grads

    out = _both(fn, (lay.stacked_spec, P(AXIS)), (P(), P(AXIS), (lay.stacked_spec, P(AXIS))), shards, x)
    _close(out["tide"], out["jax"])
