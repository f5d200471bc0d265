"""tide_jax.lax, the drop-in for jax.lax's shard_map collectives, against jax.lax itself.

Every device gets its own fresh random data (the global input is (devices, *local) split over every
mesh axis) and returns its own result, so each rank's value is compared, not only a global array.
Meshes of 1, 2, 3 and 8 devices, 4x2 and 2x2x2; gathers bitwise for every dtype; psum_scatter in
float32 to 1e-6 relative, in bf16/f16 within the rounding of an fp64 reference and never worse than
jax.lax's; grad, jvp, Hessian-vector products and vmap equal to jax.lax's; the lowered programs hold
tide's custom calls and no XLA collective; the refusals name the leaf and the argument. Then the
patterns FSDP code is written in (custom_gradient helper, autodiff-only with remat, FSDP x TP,
expert weights gathered along dims 1 and 2) give jax.lax's losses and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

MESHES = {
    "1": ((1,), ("x",)),
    "2": ((2,), ("x",)),
    "3": ((3,), ("x",)),
    "8": ((8,), ("x",)),
    "4x2": ((4, 2), ("x", "y")),
    "2x2x2": ((2, 2, 2), ("x", "y", "z")),
}


def axis_choices(names):
    """The axis_name values a mesh offers: each axis, and for several axes tuples in both orders."""
    out = list(names)
    if len(names) > 1:
        out += [tuple(names[:2]), tuple(reversed(names[:2]))]
    if len(names) > 2:
        out.append(tuple(names))
    return out


def per_device(mesh, fn, lax, *locals_, check_vma=True):
    """Runs `fn(lax, *local values)` on every device of `mesh`; locals_[i] has shape (devices, ...):
    device k's own value is row k. Returns each device's result stacked the same way."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)

    def body(*xs):
        out = fn(lax, *[jax.tree.map(lambda a: a[0], x) for x in xs])
        return jax.tree.map(lambda o: o[None], out)

    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in locals_]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(jax.tree.map(lambda _: spec, x) for x in locals_),
                              out_specs=spec, check_vma=check_vma))
    return jax.tree.map(np.asarray, f(*args)), f, args


def random(rng, shape, dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def lowered_ops(f, args):
    text = f.lower(*args).as_text()
    return ("tide_all_gather" in text, "tide_reduce_scatter" in text,
            "stablehlo.all_gather" in text or "all-gather" in text,
            "stablehlo.reduce_scatter" in text or "reduce-scatter" in text)


GATHER_DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16, np.int8, np.uint8, np.int32, np.bool_,
                 np.complex64, ml_dtypes.float8_e4m3fn, np.uint16]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_all_gather_every_axis_and_dtype_bitwise(mesh_name):
    mesh = make_mesh(*MESHES[mesh_name])
    n = mesh.devices.size
    rng = np.random.default_rng(abs(hash(mesh_name)) % 2**32)
    for k, axis_name in enumerate(axis_choices(mesh.axis_names)):
        dtype = GATHER_DTYPES[k % len(GATHER_DTYPES)]
        tree = {"a": random(rng, (n, 3, 4, 5), dtype), "b": random(rng, (n, 2, 3), np.float32),
                "c": random(rng, (n, 6, 2), ml_dtypes.bfloat16)}
        for axis, tiled in [(0, True), (1, True), (2, True), (-1, True), (-2, True), (0, False), (1, False),
                            (-1, False)]:
            def fn(lax, t):
                a = lax.all_gather(t["a"], axis_name, axis=axis, tiled=tiled)
                rest = lax.all_gather({"b": t["b"], "c": t["c"]}, axis_name, axis=min(axis, 1) if axis >= 0 else -1,
                                      tiled=tiled)
                return {"a": a, **rest}

            want, _, _ = per_device(mesh, fn, jax.lax, tree)
            got, f, args = per_device(mesh, fn, tide_jax.lax, tree)
            for key in want:
                assert same_bits(got[key], want[key]), (mesh_name, axis_name, axis, tiled, key, np.dtype(dtype).name)
            ag, _, xla_ag, _ = lowered_ops(f, args)
            if n > 1:
                assert ag and not xla_ag, (mesh_name, axis_name, axis, tiled)


def fp64_psum_scatter(x, mesh, axes, dim):
    """Per device (rows of x as in `per_device`): (the float64 sum over the devices that differ from
    it only on `axes`, |x| summed likewise), its own slice along `dim`: rank = row-major index over
    `axes` in the given order (JAX's rule for a tuple of axis names)."""
    names = list(mesh.axis_names)
    shape = tuple(mesh.shape[a] for a in names)
    pos = [names.index(a) for a in axes]
    world = int(np.prod([shape[p] for p in pos]))
    full = x.astype(np.float64).reshape(shape + x.shape[1:])
    sums = full.sum(axis=tuple(pos), keepdims=True)
    abs_sums = np.abs(full).sum(axis=tuple(pos), keepdims=True)
    out, bound = [], []
    for k in range(x.shape[0]):
        coord = np.unravel_index(k, shape)
        rank = int(np.ravel_multi_index([coord[p] for p in pos], [shape[p] for p in pos]))
        at = tuple(0 if i in pos else coord[i] for i in range(len(shape)))
        for src, dst in ((sums, out), (abs_sums, bound)):
            s = src[at]
            d = dim % s.ndim
            c = s.shape[d] // world
            dst.append(np.take(s, range(rank * c, (rank + 1) * c), axis=d))
    return np.stack(out), np.stack(bound), world


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_psum_scatter_every_axis_and_dtype(mesh_name):
    mesh = make_mesh(*MESHES[mesh_name])
    n = mesh.devices.size
    rng = np.random.default_rng(7 + n)
    for k, axis_name in enumerate(axis_choices(mesh.axis_names)):
        axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        world = int(np.prod([mesh.shape[a] for a in axes]))
        for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
            x = random(rng, (n, 2, world * 3, 4), dtype)
            for dim in (0, 1, 2, -1, -2):
                size = x.shape[1:][dim]
                if size % world:
                    continue

                def fn(lax, v, **kw):
                    # JAX 0.10.2's own psum_scatter fails to lower a negative dimension: it gets dim's
                    # positive spelling, tide the one under test.
                    d = dim % v.ndim if lax is jax.lax else dim
                    return lax.psum_scatter(v, axis_name, scatter_dimension=d, tiled=True, **kw)

                want, _, _ = per_device(mesh, fn, jax.lax, x)
                got, f, args = per_device(mesh, fn, tide_jax.lax, x)
                wide, _, _ = per_device(mesh, functools.partial(fn, dtype=jnp.float32), tide_jax.lax, x)
                ref64, abs64, world = fp64_psum_scatter(x, mesh, axes, dim)
                assert got.dtype == want.dtype and got.shape == want.shape == ref64.shape
                assert wide.dtype == np.float32
                eps32 = float(np.finfo(np.float32).eps)
                # float32 sums: within float32 rounding of the float64 sum, whatever the order.
                assert np.all(np.abs(wide - ref64) <= world * eps32 * abs64 + 1e-30), (mesh_name, axis_name, dim)
                if np.dtype(dtype) == np.float32:
                    np.testing.assert_array_equal(got, wide)
                    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
                else:
                    # Rounded once from the float32 sum, so never worse than jax.lax's narrow sums.
                    np.testing.assert_array_equal(got, wide.astype(dtype))
                    err_tide = np.abs(got.astype(np.float64) - ref64).max()
                    err_lax = np.abs(want.astype(np.float64) - ref64).max()
                    assert err_tide <= err_lax, (mesh_name, axis_name, dim, err_tide, err_lax)
                _, rs, _, xla_rs = lowered_ops(f, args)
                if n > 1:
                    assert rs and not xla_rs


def test_untiled_psum_scatter_and_pytree_in_one_call():
    mesh = make_mesh((4,), ("x",))
    rng = np.random.default_rng(3)
    tree = {"w": random(rng, (4, 3, 4, 2), np.float32), "v": random(rng, (4, 4, 5), np.float32)}

    def fn(lax, t):
        return {"w": lax.psum_scatter(t["w"], "x", scatter_dimension=1, tiled=False),
                "v": lax.psum_scatter(t["v"], "x", scatter_dimension=0)}

    want, _, _ = per_device(mesh, fn, jax.lax, tree)
    got, _, _ = per_device(mesh, fn, tide_jax.lax, tree)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-6)
    # A pytree in one call: one custom call for all its leaves.
    f = jax.jit(jax.shard_map(lambda t: tide_jax.lax.all_gather(t, "x", axis=1, tiled=True), mesh=mesh,
                              in_specs=P(None, "x"), out_specs=P(None, "x")))
    text = f.lower({"a": jnp.zeros((3, 8)), "b": jnp.zeros((2, 8, 2)), "c": jnp.zeros((5, 4))}).as_text()
    assert text.count("tide_all_gather") == 1


@pytest.mark.parametrize("mesh_name", ["2", "3", "4x2"])
def test_grad_jvp_hvp_vmap_equal_jax_lax(mesh_name):
    mesh = make_mesh(*MESHES[mesh_name])
    n = mesh.devices.size
    axis_name = mesh.axis_names[0]
    world = mesh.shape[axis_name]
    rng = np.random.default_rng(11)
    x = random(rng, (n, 3, 2, 4), np.float32)
    t = random(rng, (n, 3, 2, 4), np.float32)

    def loss(lax, v):
        full = lax.all_gather(v, axis_name, axis=1, tiled=True)          # (3, 2 * world, 4)
        y = jnp.sin(full) * jnp.arange(full.size, dtype=jnp.float32).reshape(full.shape)
        s = lax.psum_scatter(y, axis_name, scatter_dimension=2 if 4 % world == 0 else 1, tiled=True)
        return jnp.sum(s ** 2)

    cases = {
        "grad": lambda lax, v, tv: jax.grad(functools.partial(loss, lax))(v),
        "jvp": lambda lax, v, tv: jax.jvp(functools.partial(loss, lax), (v,), (tv,))[1],
        "hvp": lambda lax, v, tv: jax.jvp(jax.grad(functools.partial(loss, lax)), (v,), (tv,))[1],
        "vmap": lambda lax, v, tv: jax.vmap(lambda a: lax.all_gather(a, axis_name, axis=1, tiled=True),
                                            in_axes=1, out_axes=2)(v),
        "vmap_grad": lambda lax, v, tv: jax.vmap(jax.grad(functools.partial(loss, lax)))(jnp.stack([v, tv])),
        "checkpoint": lambda lax, v, tv: jax.grad(jax.checkpoint(functools.partial(loss, lax),
                                                                 policy=jax.checkpoint_policies.dots_saveable))(v),
    }
    for name, fn in cases.items():
        want, _, _ = per_device(mesh, fn, jax.lax, x, t)
        got, f, args = per_device(mesh, fn, tide_jax.lax, x, t)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=name)
        _, _, xla_ag, xla_rs = lowered_ops(f, args)
        assert not xla_ag and not xla_rs, name


def test_refusals_name_the_leaf_and_argument():
    mesh = make_mesh((4,), ("x",))

    def trace(fn, x):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)).lower(x)

    cases = [
        (lambda v: tide_jax.lax.all_gather(v, "x", axis_index_groups=[[0, 1], [2, 3]]), {"w": jnp.zeros(4)},
         ("axis_index_groups",)),
        (lambda v: tide_jax.lax.all_gather(v, "x", to="reduced"), jnp.zeros(4), ("to='reduced'",)),
        (lambda v: tide_jax.lax.all_gather(v, "x", to="bogus"), jnp.zeros(4), ("to='bogus'",)),
        (lambda v: tide_jax.lax.all_gather(v, "nope"), jnp.zeros(4), ("'nope'", "axis_name")),
        (lambda v: tide_jax.lax.all_gather(v, "x", axis=3, tiled=True), {"layers": {"w": jnp.zeros((2, 3))}},
         ("['layers']['w']", "axis=3")),
        (lambda v: tide_jax.lax.psum_scatter(v, "x", scatter_dimension=1, tiled=True), {"g": jnp.zeros((2, 6))},
         ("['g']", "dimension 1", "not divisible", "'x'")),
        (lambda v: tide_jax.lax.psum_scatter(v, "x", scatter_dimension=0), {"g": jnp.zeros((3, 2))},
         ("['g']", "tiled=False", "dimension 0")),
        (lambda v: tide_jax.lax.psum_scatter(v, "x", tiled=True), {"i": jnp.zeros((8,), jnp.int32)},
         ("['i']", "int32")),
        (lambda v: tide_jax.lax.all_gather(v, "x", tiled=True), {"q": jnp.zeros((4,), jnp.int4)},
         ("['q']", "int4")),
        (lambda v: tide_jax.lax.psum_scatter(v, ("x", "x"), tiled=True), jnp.zeros(8), ("twice",)),
    ]
    for fn, x, words in cases:
        with pytest.raises((ValueError, TypeError, NameError, NotImplementedError)) as e:
            trace(fn, x)
        for w in words:
            assert w in str(e.value), (w, str(e.value))
    # Outside shard_map: named as such.
    with pytest.raises(NameError, match="outside jax.shard_map"):
        jax.jit(lambda v: tide_jax.lax.all_gather(v, "x")).lower(jnp.zeros(4))


def test_to_invarying_types_and_values_as_jax_lax():
    mesh = make_mesh((4,), ("x",))
    x = np.random.default_rng(5).standard_normal((8, 3)).astype(np.float32)

    def body(lax):
        def f(v):
            full = lax.all_gather(v, "x", tiled=True, to="invarying")
            assert "x" not in jax.typeof(full).manual_axis_type.varying if hasattr(jax.typeof(full), "manual_axis_type") \
                else "x" not in jax.typeof(full).vma
            return full, jax.grad(lambda w: jnp.sum(jnp.sin(lax.all_gather(w, "x", tiled=True, to="invarying"))))(v)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=(P(), P("x"))))

    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    (a, ga), (b, gb) = body(jax.lax)(xs), body(tide_jax.lax)(xs)
    assert same_bits(a, b)
    np.testing.assert_allclose(gb, ga, rtol=1e-6)


def test_jax_backend_is_the_fp32_twin(backend):
    mesh = make_mesh((2,), ("x",))
    x = random(np.random.default_rng(2), (2, 4, 3), ml_dtypes.bfloat16)
    fn = lambda lax, v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True, dtype=jnp.float32)
    got, _, _ = per_device(mesh, fn, tide_jax.lax, x)
    want = x.astype(np.float32).sum(0)
    np.testing.assert_array_equal(got, np.stack([want[:2], want[2:]]))


# ----- the patterns FSDP code is written in, with jax.lax and with tide_jax.lax -----
def flax_params(rng):
    return {"params": {"Dense_0": {"kernel": rng.standard_normal((16, 32)).astype(np.float32) / 4,
                                   "bias": np.zeros(32, np.float32)},
                       "Dense_1": {"kernel": rng.standard_normal((32, 8)).astype(np.float32) / 6,
                                   "bias": rng.standard_normal(8).astype(np.float32)}}}


def mlp(p, x):
    h = jax.nn.gelu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def run_both(make_step, *args):
    want = make_step(jax.lax)(*args)
    got = make_step(tide_jax.lax)(*args)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6),
                 got, want)
    return got


def test_custom_gradient_fsdp_helper_over_flax_params():
    mesh = make_mesh((8,), ("fsdp",))
    rng = np.random.default_rng(0)
    params, x = flax_params(rng), rng.standard_normal((64, 16)).astype(np.float32)
    y = rng.standard_normal((64, 8)).astype(np.float32)

    def make_step(lax):
        @jax.custom_gradient
        def gather(p):
            full = jax.tree.map(lambda w: lax.all_gather(w, "fsdp", axis=0, tiled=True), p)

            def bwd(g):
                return (jax.tree.map(lambda c: lax.psum_scatter(c, "fsdp", scatter_dimension=0, tiled=True), g),)
            return full, bwd

        def step(p, xb, yb):
            loss, g = jax.value_and_grad(lambda q: jnp.mean((mlp(gather(q)["params"], xb) - yb) ** 2))(p)
            return jax.lax.pmean(loss, "fsdp"), g

        specs = jax.tree.map(lambda _: P("fsdp"), params)
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P("fsdp"), P("fsdp")),
                                     out_specs=(P(), specs)))

    loss, grads = run_both(make_step, params, x, y)
    assert np.isfinite(loss) and grads["params"]["Dense_0"]["kernel"].shape == (16, 32)


def test_autodiff_only_fsdp_mlp_with_remat_policy():
    mesh = make_mesh((4,), ("fsdp",))
    rng = np.random.default_rng(1)
    params, x = flax_params(rng), rng.standard_normal((32, 16)).astype(np.float32)

    def make_step(lax):
        def layer(p, h, name):
            k = lax.all_gather(p[name]["kernel"], "fsdp", axis=1, tiled=True)   # columns sharded
            b = lax.all_gather(p[name]["bias"], "fsdp", tiled=True)
            return jax.nn.gelu(h @ k + b)

        def loss(p, xb):
            h = jax.checkpoint(functools.partial(layer, name="Dense_0"),
                               policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)(p, xb)
            out = jax.checkpoint(functools.partial(layer, name="Dense_1"))(p, h)
            return jax.lax.pmean(jnp.mean(out ** 2), "fsdp")

        specs = {k: {"kernel": P(None, "fsdp"), "bias": P("fsdp")} for k in params["params"]}
        return jax.jit(jax.shard_map(jax.value_and_grad(loss), mesh=mesh, in_specs=(specs, P("fsdp")),
                                     out_specs=(P(), specs)))

    run_both(make_step, params["params"], x)


def test_fsdp_times_tp_on_4x2_with_psum_scatter_on_dim_1():
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    rng = np.random.default_rng(2)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) / 4     # columns over tensor, rows over fsdp
    w2 = rng.standard_normal((32, 16)).astype(np.float32) / 6     # rows over tensor, columns over fsdp
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def make_step(lax):
        def loss(w1, w2, xb):
            a = lax.all_gather(w1, "fsdp", axis=0, tiled=True)        # (16, 16): this tensor rank's columns
            b = lax.all_gather(w2, "fsdp", axis=1, tiled=True)        # (16, 16): this tensor rank's rows
            h = jax.nn.relu(xb @ a)
            part = h @ b                                              # partial sums over tensor
            y = lax.psum_scatter(part, "tensor", scatter_dimension=1, tiled=True)   # (8, 8)
            return jax.lax.psum(jnp.sum(y ** 2), ("tensor", "fsdp"))

        return jax.jit(jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh,
                                     in_specs=(P("fsdp", "tensor"), P("tensor", "fsdp"), P("fsdp")),
                                     out_specs=(P(), (P("fsdp", "tensor"), P("tensor", "fsdp")))))

    run_both(make_step, w1, w2, x)


def test_expert_weights_gathered_along_dims_1_and_2():
    mesh = make_mesh((8,), ("fsdp",))
    rng = np.random.default_rng(3)
    up = rng.standard_normal((4, 16, 24)).astype(np.float32) / 4      # (experts, d, f): d over fsdp
    down = rng.standard_normal((4, 24, 16)).astype(np.float32) / 5    # f... dim 2 over fsdp
    x = rng.standard_normal((4, 8, 16)).astype(np.float32)

    def make_step(lax):
        def loss(up, down, xb):
            u = lax.all_gather(up, "fsdp", axis=1, tiled=True)
            d = lax.all_gather(down, "fsdp", axis=2, tiled=True)
            h = jax.nn.silu(jnp.einsum("etd,edf->etf", xb, u))
            return jax.lax.psum(jnp.mean(jnp.einsum("etf,efd->etd", h, d) ** 2), "fsdp")

        return jax.jit(jax.shard_map(jax.value_and_grad(loss, argnums=(0, 1)), mesh=mesh,
                                     in_specs=(P(None, "fsdp"), P(None, None, "fsdp"), P(None, "fsdp")),
                                     out_specs=(P(), (P(None, "fsdp"), P(None, None, "fsdp")))))

    run_both(make_step, up, down, x)
