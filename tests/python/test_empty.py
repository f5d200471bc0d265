"""Parameters with no elements (a dim of size 0: a LoRA adapter of rank 0, a layer's absent experts)
are sharded and collected like any other (XLA's own all-gather refuses a dimension of size 0, so the
pure-JAX twins skip them too): tide's native call runs on the group's other parameters and the
empty ones' results have their shapes and dtypes (docs/design.md "Empty parameters"). A group of
nothing but empty parameters makes no call.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"
EMPTY = {"e0": (0,), "e1": (0, 5), "e2": (3, 0), "e3": (2, 0, 4)}


def group(rng, with_full=True):
    params = {k: np.zeros(shape, [np.float32, ml_dtypes.bfloat16][i % 2]) for i, (k, shape) in enumerate(EMPTY.items())}
    if with_full:
        params["w"] = rng.standard_normal((7, 3)).astype(np.float32)
        params["v"] = rng.standard_normal((5,)).astype(ml_dtypes.bfloat16)
    return params


def smap(f, mesh, in_specs, out_specs):
    return jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


@pytest.mark.parametrize("with_full", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_groups_with_empty_parameters_gather_and_reduce(backend, world, with_full):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(world)
    params = group(rng, with_full)
    lay = tide_jax.layout(params, mesh, AXIS)
    shards = lay.shard(params)
    assert all(np.shape(shards[k]) == p.global_shape for k, p in zip(sorted(params), lay.params))
    grads = {k: (rng.standard_normal((world, *np.shape(x)))).astype(x.dtype) for k, x in params.items()}
    stacked = {k: P(AXIS) for k in params}

    def f(s, g):
        g = jax.tree.map(lambda t: t[0], g)
        full = tide_jax.all_gather(s, lay)
        started = tide_jax.all_gather_done(tide_jax.all_gather_start(s, lay))
        rs = tide_jax.reduce_scatter(g, lay)
        rs_started = tide_jax.reduce_scatter_done(tide_jax.reduce_scatter_start(g, lay))
        up = lambda t: jax.tree.map(lambda x: x[None], t)  # noqa: E731
        return up(full), up(started), rs, rs_started

    full, started, rs, rs_started = smap(f, mesh, (lay.spec, stacked), (stacked, stacked, lay.spec, lay.spec))(
        shards, jax.device_put(grads, NamedSharding(mesh, P(AXIS))))
    for p in lay.params:
        k = p.path[2:-2]
        for got in (full[k], started[k]):
            assert got.shape == (world, *p.shape) and got.dtype == p.dtype, f"{k}: {got.dtype}{got.shape}"
            for r in range(world):
                assert np.asarray(got[r]).tobytes() == np.asarray(params[k]).tobytes(), f"{k} on rank {r}"
        want = np.asarray(grads[k], np.float64).sum(0).reshape(p.rows, p.row_elems)
        for got in (rs[k], rs_started[k]):
            assert got.shape == p.global_shape and got.dtype == np.float32, f"{k}: {got.dtype}{got.shape}"
            got = np.asarray(got, np.float64).reshape(p.padded_rows, p.row_elems)
            assert not got[p.rows:].any(), k
            np.testing.assert_allclose(got[: p.rows], want, rtol=1e-6, atol=1e-6, err_msg=k)
    back = lay.unshard(shards)
    assert all(np.shape(back[k]) == np.shape(x) and back[k].dtype == x.dtype for k, x in params.items())


@pytest.mark.parametrize("world", [1, 3, 8])
def test_gather_params_gradients_with_empty_parameters(world):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(10 + world)
    params = group(rng)
    lay = tide_jax.layout(params, mesh, AXIS)

    def run(backend):
        def loss(s):
            p = tide_jax.gather_params(s, lay, jnp.bfloat16, backend=backend)
            a = jnp.sum(p["w"].astype(jnp.float32) ** 2) + jnp.sum(p["v"].astype(jnp.float32))
            return a + sum(jnp.sum(p[k].astype(jnp.float32)) for k in EMPTY)

        return smap(jax.grad(loss), mesh, (lay.spec,), lay.spec)(lay.shard(params))

    got, want = run("tide"), run("jax")
    for k in params:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(want[k], np.float64), rtol=1e-6,
                                   err_msg=k)


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_loop_with_an_empty_parameter(world, dtype):
    """scan_layers over layers holding a rank-0 adapter: the casting all-gather (bf16) and the
    reduce-scatter into the gradient buffers run on the other parameters; loss and gradients equal
    the jax backend's."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(20 + world)
    layers, d = 3, 6
    stacked = {"w": (rng.standard_normal((layers, d, d)) / 3).astype(np.float32),
               "lora_a": np.zeros((layers, d, 0), np.float32), "lora_b": np.zeros((layers, 0, d), np.float32)}
    lay = tide_jax.layout(jax.tree.map(lambda t: t[0], stacked), mesh, AXIS)
    x = jax.device_put(rng.standard_normal((2 * world, d)).astype(np.float32), NamedSharding(mesh, P(AXIS)))

    def layer(p, h):
        h = h.astype(p["w"].dtype)
        return jnp.tanh(h @ p["w"] + (h @ p["lora_a"]) @ p["lora_b"]).astype(jnp.float32)

    def run(backend):
        def per_device(s, x):
            def loss(s):
                y = tide_jax.scan_layers(layer, x, s, lay, dtype=dtype, backend=backend)
                return jnp.sum(y * y)

            value, grads = jax.value_and_grad(loss)(s)
            return jax.lax.psum(value, AXIS), grads

        return jax.jit(tide_jax.shard_map(per_device, mesh=mesh, in_specs=(lay.stacked_spec, P(AXIS)),
                                          out_specs=(P(), lay.stacked_spec)))(lay.shard_stacked(stacked), x)

    (lg, gg), (lw, gw) = run("tide"), run("jax")
    assert abs(float(lg) - float(lw)) <= 1e-5 * abs(float(lw))
    for k in stacked:
        assert gg[k].shape == gw[k].shape and gg[k].dtype == gw[k].dtype, k
        np.testing.assert_allclose(np.asarray(gg[k]), np.asarray(gw[k]), rtol=1e-4, atol=1e-6, err_msg=k)
