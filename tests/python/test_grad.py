"""`tide_jax.all_gather` and `reduce_scatter` under `jax.grad`, as `jax.lax.all_gather` and
`psum_scatter` are: the all-gather's cotangent is reduce-scattered (float32 sums) into each shard's
dtype, the reduce-scatter's is all-gathered into each gradient's dtype.

Checked against fp64 NumPy references built from the definition (every rank's loss weights the
gathered parameters, or the scattered shards, with its own random numbers; the gradient is the sum
over ranks), with values exact in bf16 so tide's result must equal the reference bitwise; and against
JAX's own autodiff of the pure-JAX twins (backend "jax") on composed meshes, for complex parameters
(summed by jax.lax in their own dtype) and for second derivatives.
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


def smap(f, mesh, in_specs, out_specs, check_vma):
    return jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def exact(rng, shape, dtype=np.float32):
    """Random numbers exact in bf16 (and their sums over <= 8 ranks exact in fp32)."""
    return (rng.integers(-16, 17, size=shape) / 8).astype(dtype)


def group(rng):
    return {
        "w7": exact(rng, (7, 5)),
        "v13": exact(rng, (13,), ml_dtypes.bfloat16),
        "s": exact(rng, (), np.float32),
        "t": exact(rng, (3, 4, 2), np.float16),
        "big": exact(rng, (37, 3), ml_dtypes.bfloat16),
        "n": rng.integers(-5, 5, size=(6,)).astype(np.int32),  # not differentiated: float0
    }


def per_rank(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_all_gather_gradient_is_the_reduce_scatter_of_the_cotangent(tide_backend, world, check_vma, dtype):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(world)
    params = group(rng)
    lay = tide_jax.layout(params, mesh, AXIS)
    floats = [k for k, x in params.items() if x.dtype != np.int32]
    weights = {k: exact(rng, (world, *np.shape(params[k]))) for k in floats}  # rank q's weights

    def grads(shards, w):
        def loss(shards):
            full = tide_jax.all_gather(shards, lay, dtype)
            return sum(jnp.sum(full[k].astype(jnp.float32) * w[k][0]) for k in floats)

        return jax.grad(loss, allow_int=True)(shards)

    out = smap(grads, mesh, (lay.spec, {k: P(AXIS) for k in floats}), lay.spec, check_vma)(
        lay.shard(params), per_rank(mesh, weights))
    for p in lay.params:
        k = p.path[2:-2]
        got = np.asarray(out[k])
        if k not in floats:
            assert got.dtype == jax.dtypes.float0 and got.shape == p.global_shape, k
            continue
        total = np.asarray(weights[k], np.float64).sum(0).reshape(p.rows, -1)
        want = np.zeros((p.padded_rows, total.shape[1]))
        want[: p.rows] = total
        want = want.astype(params[k].dtype).reshape(p.global_shape)
        assert got.dtype == params[k].dtype and got.shape == p.global_shape, f"{k}: {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), f"{k}: gradient differs from the sum of the ranks' weights"


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_reduce_scatter_gradient_is_the_all_gather_of_the_cotangent(tide_backend, world, check_vma):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(50 + world)
    params = {k: x for k, x in group(rng).items() if x.dtype != np.int32}
    lay = tide_jax.layout(params, mesh, AXIS)
    grads_in = {k: np.stack([exact(rng, np.shape(x), x.dtype) for _ in range(world)]) for k, x in params.items()}
    weights = {p.path[2:-2]: exact(rng, p.global_shape) for p in lay.params}  # each rank weights its shard

    def grads(g, w):
        def loss(g):
            shards = tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0], g), lay)
            return sum(jnp.sum(shards[k] * w[k]) for k in shards)

        return jax.grad(loss)(g)

    out = smap(grads, mesh, ({k: P(AXIS) for k in params}, lay.spec), {k: P(AXIS) for k in params}, check_vma)(
        per_rank(mesh, grads_in), jax.device_put(weights, lay.shardings))
    for p in lay.params:
        k = p.path[2:-2]
        got = np.asarray(out[k])
        full = np.asarray(weights[k]).reshape(p.padded_rows, -1)[: p.rows].reshape(p.shape)
        want = np.stack([full] * world).astype(params[k].dtype)  # every rank: the gathered weights
        assert got.dtype == params[k].dtype and got.shape == want.shape, f"{k}: {got.dtype}{got.shape}"
        assert got.tobytes() == want.tobytes(), f"{k}: gradient differs from the gathered weights"


MESHES = [((2, 4), ("data", AXIS), {}), ((4, 2), (AXIS, "tensor"), {"w": P(None, "tensor")}),
          ((2, 2, 2), ("data", AXIS, "tensor"), {"w": P("tensor")})]


@pytest.mark.parametrize("shape,names,specs", MESHES)
def test_gradients_on_composed_meshes_equal_jax_autodiff(shape, names, specs):
    """HSDP (shards copied over "data") and parameters split over "tensor": JAX's own autodiff of
    jax.lax.all_gather / psum_scatter (the "jax" backend) gives the same gradients."""
    mesh = make_mesh(shape, names)
    rng = np.random.default_rng(sum(shape))
    params = {"w": exact(rng, (6, 4)), "b": exact(rng, (5,), ml_dtypes.bfloat16)}
    full_specs = {"w": specs.get("w", P()), "b": P()}
    lay = tide_jax.layout(params, mesh, AXIS, specs=full_specs if specs else None)
    batch = exact(rng, (mesh.size, 4))
    batch_spec = P(tuple(n for n in names if n != "tensor"))

    def run(backend):
        def loss(shards, x):
            full = tide_jax.all_gather(shards, lay, jnp.bfloat16, backend=backend)
            x = x[:, : full["w"].shape[1]]  # the columns of w's local block
            h = x.astype(jnp.bfloat16) @ full["w"].T  # (batch, rows of w's block)
            shards2 = tide_jax.reduce_scatter({"w": jnp.outer(h.sum(0), x.sum(0)).astype(jnp.float32),
                                               "b": full["b"] * 2}, lay, backend=backend)
            return jax.lax.psum(jnp.sum(h.astype(jnp.float32) ** 2) + jnp.sum(shards2["w"] ** 2) * 1e-3
                                + jnp.sum(shards2["b"]), names)

        f = smap(lambda s, x: jax.grad(loss)(s, x), mesh, (lay.spec, batch_spec), lay.spec, True)
        return f(lay.shard(params), batch)

    got, want = run("tide"), run("jax")
    for k in params:
        g, w = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        assert got[k].dtype == want[k].dtype and g.shape == w.shape, k
        assert np.abs(g - w).max() <= 1e-2 * np.abs(w).max() + 1e-6, f"{k}: {np.abs(g - w).max()}"


def test_complex_parameters_and_second_derivatives_equal_jax_autodiff(tide_backend):
    """complex64 shards (their cotangents summed by jax.lax in complex64) and grad of grad (the
    backward of each op runs the other, itself differentiable)."""
    world = 3
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(7)
    params = {"c": (exact(rng, (5, 2)) + 1j * exact(rng, (5, 2))).astype(np.complex64), "w": exact(rng, (7, 3))}
    lay = tide_jax.layout(params, mesh, AXIS)
    weights = exact(rng, (world, 7, 3))

    def run(backend):
        def first(shards, w):
            full = tide_jax.all_gather(shards, lay, backend=backend)
            return jnp.sum(jnp.abs(full["c"]) ** 2) + jnp.sum(w[0] * full["w"] ** 3)

        def second(shards, w):
            g = jax.grad(first)(shards, w)
            return jnp.sum(g["w"] ** 2) + jnp.sum(jnp.abs(g["c"]) ** 2)

        def both(shards, w):
            return jax.grad(first)(shards, w), jax.grad(second)(shards, w)

        return smap(both, mesh, (lay.spec, P(AXIS)), (lay.spec, lay.spec), True)(
            lay.shard(params), per_rank(mesh, weights))

    for got, want in zip(run("tide"), run("jax")):
        for k in params:
            assert got[k].dtype == want[k].dtype, k
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5, err_msg=k)


def test_operands_the_same_on_every_rank_get_their_cotangents_summed(tide_backend):
    """Under check_vma, a gradient or shard passed in replicated (in_specs P(): the same on every
    rank) is broadcast by JAX; its cotangent is the sum over ranks, as JAX's autodiff gives
    (gather_params too: its backward refused such shards before, "manual axis types do not match")."""
    world = 3
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(11)
    params = {"w": exact(rng, (7, 2)), "b": exact(rng, (4,), ml_dtypes.bfloat16)}
    lay = tide_jax.layout(params, mesh, AXIS)
    weights = {p.path[2:-2]: exact(rng, p.global_shape) for p in lay.params}
    shards = {k: exact(rng, p.shard_shape, p.dtype) for k, p in zip(sorted(params), lay.params)}

    def run(backend):
        def f(g, s, w):
            rs = jax.grad(lambda g: sum(jnp.sum(v * w[k]) for k, v in tide_jax.reduce_scatter(g, lay, backend=backend).items()))
            ag = jax.grad(lambda s: sum(jnp.sum(v.astype(jnp.float32) ** 2) for v in
                                        tide_jax.all_gather(s, lay, backend=backend).values()))
            gp = jax.grad(lambda s: sum(jnp.sum(v.astype(jnp.float32) ** 2) for v in
                                        tide_jax.gather_params(s, lay, backend=backend).values()))
            return rs(g), ag(s), gp(s)

        return smap(f, mesh, (P(), P(), lay.spec), (P(), P(), P()), True)(
            params, shards, jax.device_put(weights, lay.shardings))

    for got, want in zip(run("tide"), run("jax")):
        for k in params:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k


@pytest.mark.parametrize("world", [3, 8])
def test_float8_shards_get_float32_sums_of_their_cotangent(tide_backend, world):
    """float8 shards gathered as float8: their cotangent (float8) is widened and summed in float32
    by tide, then rounded once to float8, as NumPy does the same sum (values exact in e4m3; one
    rank's 1 and the others' 1/16 would sum to 1 in float8 steps). XLA:CPU's own psum of float8
    widens too, so the values cannot tell which of the two summed them: the lowered program must
    hold tide's reduce-scatter of q's cotangent as float32 and no collective of XLA's own."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(30 + world)
    f8 = ml_dtypes.float8_e4m3fn
    params = {"q": exact(rng, (7, 3), f8), "w": exact(rng, (5,))}
    lay = tide_jax.layout(params, mesh, AXIS)
    weights = {k: exact(rng, (world, *np.shape(x))) for k, x in params.items()}
    weights["q"][:, 0, 0] = [1.0] + [1 / 16] * (world - 1)

    def grads(shards, w):
        def loss(shards):
            full = tide_jax.all_gather(shards, lay)
            return sum(jnp.sum(full[k].astype(jnp.float32) * w[k][0]) for k in params)

        return jax.grad(loss)(shards)

    f = smap(grads, mesh, (lay.spec, {k: P(AXIS) for k in params}), lay.spec, True)
    program = f.lower(lay.shard(params), per_rank(mesh, weights)).as_text()
    calls = [line for line in program.splitlines() if "@tide_reduce_scatter(" in line]
    assert len(calls) == 1 and "(tensor<7x3xf32>, tensor<5xf32>) ->" in calls[0], calls
    assert not any(op in program for op in ("stablehlo.reduce_scatter", "stablehlo.all_reduce")), "an XLA collective"
    out = f(lay.shard(params), per_rank(mesh, weights))
    for p in lay.params:
        k = p.path[2:-2]
        cts = np.asarray(weights[k]).astype(params[k].dtype).astype(np.float32)  # each rank's cotangent
        want = np.zeros((p.padded_rows, p.row_elems), np.float32)
        want[: p.rows] = cts.sum(0).reshape(p.rows, p.row_elems)
        want = want.astype(params[k].dtype).reshape(p.global_shape)
        got = np.asarray(out[k])
        assert got.dtype == params[k].dtype and got.tobytes() == want.tobytes(), k


@pytest.mark.parametrize("op", ["all_gather", "gather_params"])
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_cost_no_reduce_scatter(op, world):
    """A group gathered in one call, differentiated in some leaves only (LoRA: the base weights
    frozen, the adapters trained): the backward reduce-scatters the adapters' cotangents alone (the
    lowered program's one tide reduce-scatter has their operands, not the base's), and the gradients
    equal JAX's autodiff of jax.lax bitwise."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(70 + world)
    params = {"base": exact(rng, (33, 8)), "a": exact(rng, (2, 8)), "b": exact(rng, (33, 2))}
    lay = tide_jax.layout(params, mesh, AXIS)
    x = exact(rng, (world, 4, 8))

    def run(backend):
        gather = getattr(tide_jax, op)

        def grads(shards, x):
            def loss(lora):
                full = gather(dict(shards, **lora), lay, backend=backend)
                h = x[0] @ full["base"].T.astype(jnp.float32)
                h = h + (x[0] @ full["a"].T.astype(jnp.float32)) @ full["b"].T.astype(jnp.float32)
                return jax.lax.psum(jnp.sum(h * h), AXIS)

            return jax.grad(loss)({k: shards[k] for k in ("a", "b")})

        spec = {k: lay.spec[k] for k in ("a", "b")}
        return smap(grads, mesh, (lay.spec, P(AXIS)), spec, True), (lay.shard(params), x)

    f, args = run("tide")
    calls = [line for line in f.lower(*args).as_text().splitlines() if "@tide_reduce_scatter(" in line]
    assert len(calls) == 1, calls
    operands = calls[0].split(") -> (")[0].rsplit(" : (", 1)[1]
    assert operands.startswith("tensor<2x8x") and ", tensor<33x2x" in operands and "33x8" not in operands, operands
    got = f(*args)
    g, args_j = run("jax")
    want = g(*args_j)
    for k in ("a", "b"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


def test_frozen_parameters_with_hsdp_replicas():
    """The same on an HSDP mesh (shards copied over "data", their fp32 gradients summed over it):
    only the trained leaves are reduce-scattered and summed over the replicas, bitwise as jax.lax."""
    mesh = make_mesh((2, 4), ("data", AXIS))
    rng = np.random.default_rng(3)
    params = {"base": exact(rng, (33, 8)), "a": exact(rng, (2, 8)), "b": exact(rng, (33, 2))}
    lay = tide_jax.layout(params, mesh, AXIS, replicas=("data",))
    x = exact(rng, (8, 4, 8))

    def run(backend):
        def grads(shards, x):
            def loss(lora):
                full = tide_jax.gather_params(dict(shards, **lora), lay, backend=backend)
                h = x[0] @ full["base"].T.astype(jnp.float32)
                h = h + (x[0] @ full["a"].T.astype(jnp.float32)) @ full["b"].T.astype(jnp.float32)
                return jax.lax.psum(jnp.sum(h * h), ("data", AXIS))

            return jax.grad(loss)({k: shards[k] for k in ("a", "b")})

        f = smap(grads, mesh, (lay.spec, P(("data", AXIS))), {k: lay.spec[k] for k in ("a", "b")}, True)
        return f, (lay.shard(params), x)

    f, args = run("tide")
    calls = [line for line in f.lower(*args).as_text().splitlines() if "@tide_reduce_scatter(" in line]
    assert len(calls) == 1 and "33x8" not in calls[0].split(") -> (")[0].rsplit(" : (", 1)[1], calls
    got = f(*args)
    g, args_j = run("jax")
    want = g(*args_j)
    for k in ("a", "b"):
        assert np.asarray(want[k]).any(), k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.parametrize("world", [1, 3])
def test_gather_params_and_scan_layers_in_float8(world):
    """fp32 master shards gathered in float8 (gather_params' and scan_layers' dtype): the float8
    cotangents are widened (exactly) to float32 before the reduce-scatter, as all_gather's backward
    does; before, gather_params refused them at trace time and scan_layers failed at run time on the
    native backend only. Bitwise equal to the jax backend."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(4 + world)
    params = {"w": exact(rng, (7, 2)), "b": exact(rng, (3,))}
    lay = tide_jax.layout(params, mesh, AXIS)
    stacked = {k: np.stack([v, 2 * v]) for k, v in params.items()}
    x = exact(rng, (world, 2))
    f8 = jnp.float8_e4m3fn

    def run(backend):
        def grads(shards, st, x):
            def loss(s):
                p = tide_jax.gather_params(s, lay, f8, backend=backend)
                return jax.lax.psum(jnp.sum((p["w"].astype(jnp.float32) @ x[0]) ** 2) + jnp.sum(p["b"].astype(jnp.float32)), AXIS)

            def layer(p, c):
                return c + jnp.sum(jnp.tanh(p["w"].astype(jnp.float32) @ x[0])) * p["b"].astype(jnp.float32).sum()

            def loss_scan(st):
                return jax.lax.psum(tide_jax.scan_layers(layer, jnp.float32(0), st, lay, dtype=f8, backend=backend), AXIS)

            return jax.grad(loss)(shards), jax.grad(loss_scan)(st)

        f = smap(grads, mesh, (lay.spec, lay.stacked_spec, P(AXIS)), (lay.spec, lay.stacked_spec), True)
        return f(lay.shard(params), lay.shard_stacked(stacked), x)

    got, want = run("tide"), run("jax")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).dtype == np.float32
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert all(np.asarray(a).any() for a in jax.tree.leaves(got))
