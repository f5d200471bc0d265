"""gather_params (custom_vjp: all-gather forward, fp32 reduce-scatter backward) under value_and_grad."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"


def init(rng):
    return {
        "w1": (0.5 * rng.standard_normal((7, 5))).astype(np.float32),
        "b1": (0.1 * rng.standard_normal((5,))).astype(np.float32),
        "w2": (0.5 * rng.standard_normal((5, 3))).astype(np.float32),
        "scale": np.float32(1.25),
    }


def local_loss(params, x):
    """A small bf16 MLP; params may be bf16 (gathered) or fp32 (the unsharded reference)."""
    x = x.astype(params["w1"].dtype)
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    y = (h @ params["w2"]) * params["scale"]
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def sharded_value_and_grad(lay, mesh, data_spec, backend):
    axes = tuple(mesh.axis_names)

    def step(shards, x):
        def loss_of_shards(shards):
            params = tide_jax.gather_params(shards, lay, dtype=jnp.bfloat16, backend=backend)
            return local_loss(params, x[0])

        loss, grads = jax.value_and_grad(loss_of_shards)(shards)
        return jax.lax.psum(loss, axes), grads

    return jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec, data_spec), out_specs=(P(), lay.spec)))


def unsharded_value_and_grad(params, xs):
    """Ground truth: each device's loss differentiated alone (bf16 math, as on the device), the
    per-device gradients summed in fp64."""

    def one(params, x):
        return local_loss(jax.tree.map(lambda t: t.astype(jnp.bfloat16), params), x)

    one_grad = jax.jit(jax.value_and_grad(one))
    per_device = [one_grad(params, x) for x in xs]
    loss = sum(float(l) for l, _ in per_device)
    grads = {k: sum(np.asarray(g[k], np.float64) for _, g in per_device) for k in params}
    return loss, grads


@pytest.mark.parametrize(
    "shape,names", [((8,), (AXIS,)), ((3,), (AXIS,)), ((2, 4), ("dp", AXIS)), ((4, 2), (AXIS, "dp"))]
)
def test_gather_params_value_and_grad(tide_backend, shape, names):
    mesh = make_mesh(shape, names)
    rng = np.random.default_rng(sum(shape))
    params = init(rng)
    lay = tide_jax.layout(params, mesh, AXIS)
    n_dev = int(np.prod(shape))
    data_spec = P(names) if len(names) > 1 else P(AXIS)
    xs = rng.standard_normal((n_dev, 4, 7)).astype(np.float32)
    xs_dev = jax.device_put(xs.reshape(*shape, 4, 7) if len(shape) > 1 else xs, NamedSharding(mesh, P(*names)))
    if len(shape) > 1:
        # local block (1, 1, 4, 7) -> (1, 4, 7) for the step function
        data_spec = P(*names)

    results = {}
    for backend in ("tide", "jax"):
        fn = sharded_value_and_grad(lay, mesh, data_spec, backend)
        if len(shape) > 1:
            fn = _squeeze_two_axis(lay, mesh, names, backend)
        loss, grads = fn(lay.shard(params), xs_dev)
        results[backend] = (float(loss), lay.unshard(grads))

    # device order of the data blocks, for the unsharded reference
    blocks = np.asarray(xs).reshape(n_dev, 4, 7)
    loss_ref, grads_ref = unsharded_value_and_grad(params, list(blocks))

    loss_tide, grads_tide = results["tide"]
    loss_jax, grads_jax = results["jax"]
    assert loss_tide == loss_jax, "forward differs between tide and the pure-JAX twin"
    # the reference runs the same bf16 math, fused differently by XLA: agree to bf16 rounding
    np.testing.assert_allclose(loss_tide, float(loss_ref), rtol=2e-3)
    for name in params:
        g_t, g_j, g_r = (np.asarray(g[name]) for g in (grads_tide, grads_jax, grads_ref))
        assert g_t.dtype == np.float32 and g_t.shape == np.shape(params[name]), name
        np.testing.assert_allclose(g_t, g_j, rtol=1e-5, atol=1e-6, err_msg=f"{name}: tide vs pure-JAX twin")
        # per-device bf16 math differs from the jitted one by bf16 roundings: bf16-level tolerance
        scale = np.abs(g_r).max()
        np.testing.assert_allclose(g_t, g_r, rtol=2e-2, atol=2e-2 * scale, err_msg=f"{name}: tide vs unsharded grad")


def _squeeze_two_axis(lay, mesh, names, backend):
    axes = tuple(names)

    def step(shards, x):
        def loss_of_shards(shards):
            params = tide_jax.gather_params(shards, lay, dtype=jnp.bfloat16, backend=backend)
            return local_loss(params, x[0, 0])

        loss, grads = jax.value_and_grad(loss_of_shards)(shards)
        return jax.lax.psum(loss, axes), grads

    return jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec, P(*names)), out_specs=(P(), lay.spec)))


def test_gather_params_forward_is_cast_all_gather(tide_backend):
    mesh = make_mesh((8,), (AXIS,))
    params = init(np.random.default_rng(0))
    lay = tide_jax.layout(params, mesh, AXIS)
    out = jax.jit(
        tide_jax.shard_map(
            lambda s: tide_jax.gather_params(s, lay), mesh=mesh, in_specs=(lay.spec,), out_specs=P(), check_vma=False
        )
    )(lay.shard(params))
    for name, x in params.items():
        assert out[name].dtype == jnp.bfloat16
        assert np.asarray(out[name]).tobytes() == np.asarray(x).astype(jnp.bfloat16).tobytes(), name


@pytest.mark.parametrize("policy", ["nothing_saveable", "everything_saveable"])
def test_gather_params_under_remat(tide_backend, policy):
    """FSDP with activation checkpointing: the gather inside `jax.checkpoint` is recomputed in the
    backward pass (or saved, by policy). Gradients and loss equal the run without remat and the
    pure-JAX twin's."""
    mesh = make_mesh((8,), (AXIS,))
    rng = np.random.default_rng(77)
    params = init(rng)
    lay = tide_jax.layout(params, mesh, AXIS)
    xs = rng.standard_normal((8, 4, 7)).astype(np.float32)
    xs_dev = jax.device_put(xs, NamedSharding(mesh, P(AXIS)))

    def make(backend, remat):
        def step(shards, x):
            def block(shards, x):
                params = tide_jax.gather_params(shards, lay, dtype=jnp.bfloat16, backend=backend)
                return local_loss(params, x)

            if remat:
                block = jax.checkpoint(block, policy=getattr(jax.checkpoint_policies, policy))
            loss, grads = jax.value_and_grad(block)(shards, x[0])
            return jax.lax.psum(loss, AXIS), grads

        return jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec, P(AXIS)), out_specs=(P(), lay.spec)))

    out = {}
    for backend in ("tide", "jax"):
        for remat in (False, True):
            loss, grads = make(backend, remat)(lay.shard(params), xs_dev)
            out[backend, remat] = (float(loss), {k: np.asarray(v) for k, v in lay.unshard(grads).items()})
    base_loss, base_grads = out["tide", False]
    for key, (loss, grads) in out.items():
        assert loss == base_loss, key
        for name in params:
            np.testing.assert_allclose(grads[name], base_grads[name], rtol=1e-5, atol=1e-6, err_msg=f"{key} {name}")
