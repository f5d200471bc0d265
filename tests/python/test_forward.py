"""Forward mode through tide's collectives: `jax.jvp`, `jax.jacfwd` / `jax.hessian`, Hessian-vector
products as jvp of grad, `jax.linear_transpose`; as `jax.lax.all_gather` / `psum_scatter` allow.

Each collective is one linear primitive (`tide_jax._linear`): its tangent is the same collective of
the tangents, its transpose the other collective. Checked bitwise against NumPy (values exact in bf16
and their sums exact in fp32) and against JAX's own derivatives of the pure-JAX twins (backend "jax"),
at world 1/2/3/8, check_vma on and off, with integer leaves (float0 tangents) and with tangents or
cotangents that are zero for some leaves and not others (symbolic zeros, which JAX's own
`linear_call` cannot take).
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
from test_grad import AXIS, exact, smap  # exact: values whose products and sums stay exact in fp32


def group(rng):
    return {
        "w7": exact(rng, (7, 5)),
        "v13": exact(rng, (13,), ml_dtypes.bfloat16),
        "s": exact(rng, (), np.float32),
        "big": exact(rng, (37, 3), ml_dtypes.bfloat16),
        "n": rng.integers(-5, 5, size=(6,)).astype(np.int32),  # no tangent space: float0
    }


def stacked(tree):
    """Each rank's copy of a result, stacked over the mesh axis (out_specs P(AXIS))."""
    return jax.tree.map(lambda t: t[None], tree)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_jvp_of_all_gather_is_the_all_gather_of_the_tangents(tide_backend, world, check_vma, dtype):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(100 + world)
    params = group(rng)
    lay = tide_jax.layout(params, mesh, AXIS)
    floats = [k for k, x in params.items() if x.dtype != np.int32]
    tangent = {k: exact(rng, np.shape(params[k]), params[k].dtype) for k in floats}
    lay_t = tide_jax.layout(tangent, mesh, AXIS)  # shards the tangents as the parameters

    def run(shards, t):
        t = dict(t, n=np.zeros(shards["n"].shape, jax.dtypes.float0))
        out, t_out = jax.jvp(lambda s: tide_jax.all_gather(s, lay, dtype), (shards,), (t,))
        return stacked(out), stacked({k: t_out[k] for k in floats})

    spec = {k: P(AXIS) for k in params}
    out, t_out = smap(run, mesh, (lay.spec, lay_t.spec), (spec, {k: P(AXIS) for k in floats}),
                      check_vma)(lay.shard(params), lay_t.shard(tangent))
    for k in params:
        want = params[k] if dtype is None or k == "n" else params[k].astype(dtype)
        assert np.asarray(out[k]).tobytes() == np.stack([want] * world).tobytes(), k
    for k in floats:
        want = tangent[k] if dtype is None else tangent[k].astype(dtype)
        got = np.asarray(t_out[k])
        assert got.dtype == want.dtype, k
        assert got.tobytes() == np.stack([want] * world).tobytes(), f"{k}: tangent is not the gathered tangent"


@pytest.mark.parametrize("world", [1, 3, 8])
def test_jvp_of_reduce_scatter_and_gather_params_equal_jax(world):
    """Tangents of the reduce-scatter (fp32 sums of the tangents) and of gather_params, some leaves
    with zero tangents (a jvp in one leaf only), bitwise against JAX's jvp of jax.lax."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(7 * world)
    params = {k: x for k, x in group(rng).items() if x.dtype != np.int32}
    lay = tide_jax.layout(params, mesh, AXIS)
    g_in = {k: np.stack([exact(rng, np.shape(x), x.dtype) for _ in range(world)]) for k, x in params.items()}
    t_in = {k: np.stack([exact(rng, np.shape(x), x.dtype) for _ in range(world)]) for k, x in params.items()}
    t_sh = {p.path[2:-2]: exact(rng, p.global_shape) for p in lay.params}

    def run(backend):
        def body(g, t, shards, ts):
            g, t = jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], t)
            rs = jax.jvp(lambda g: tide_jax.reduce_scatter(g, lay, backend=backend), (g,), (t,))
            one = jax.jvp(lambda w: tide_jax.reduce_scatter(dict(g, w7=w), lay, backend=backend), (g["w7"],),
                          (t["w7"],))
            ts = jax.tree.map(lambda x: x.astype(jnp.float32), ts)
            shards = jax.tree.map(lambda x: x.astype(jnp.float32), shards)
            gp = jax.jvp(lambda s: tide_jax.gather_params(s, lay, backend=backend), (shards,), (ts,))
            return rs, one, stacked(gp)

        sh = {k: P(AXIS) for k in params}
        f = smap(body, mesh, (sh, sh, lay.spec, lay.spec), ((lay.spec, lay.spec), (lay.spec, lay.spec), (sh, sh)), True)
        return f(jax.device_put(g_in, NamedSharding(mesh, P(AXIS))), jax.device_put(t_in, NamedSharding(mesh, P(AXIS))),
                 lay.shard(params), jax.device_put(t_sh, lay.shardings))

    got, want = run("tide"), run("jax")
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, path[0]
        assert a.tobytes() == b.tobytes(), f"{jax.tree_util.keystr(path[0])}: differs from jax.lax's jvp"
    # the leaves without a tangent in the one-leaf jvp have zero tangents
    for k in params:
        if k != "w7":
            assert not np.asarray(got[1][1][k]).any(), k


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_hessian_vector_products_equal_jax(world, check_vma):
    """Forward over reverse (jvp of grad), the usual Hessian-vector product, through all_gather and
    reduce_scatter. One parameter enters the loss linearly, so its cotangent has a zero tangent while
    the others' do not: the transposed collective sees symbolic zeros for some leaves."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(31 + world)
    params = {"w": exact(rng, (7, 5)), "b": exact(rng, (5,)), "c": exact(rng, (3, 2))}
    lay = tide_jax.layout(params, mesh, AXIS)
    x = exact(rng, (world, 5))
    v = {k: exact(rng, np.shape(p)) for k, p in params.items()}

    def run(backend):
        def loss(shards, x):
            full = tide_jax.all_gather(shards, lay, backend=backend)
            h = jnp.tanh(full["w"] @ x[0]) * full["c"].sum()
            rs = tide_jax.reduce_scatter({"w": full["w"] * h[:, None], "b": full["b"], "c": full["c"] ** 2}, lay,
                                         backend=backend)
            return jax.lax.psum(jnp.sum(h ** 2) + jnp.sum(full["b"] * x[0]) + jnp.sum(rs["w"] ** 2)
                                + jnp.sum(rs["c"]), AXIS)

        def hvp(shards, x, v):
            return jax.jvp(lambda s: jax.grad(loss)(s, x), (shards,), (v,))

        return smap(hvp, mesh, (lay.spec, P(AXIS), lay.spec), (lay.spec, lay.spec), check_vma)(
            lay.shard(params), x, lay.shard(v))

    got, want = run("tide"), run("jax")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)
    assert np.asarray(got[1]["w"]).any() and np.asarray(got[1]["c"]).any()  # a Hessian that is not zero


@pytest.mark.parametrize("world", [1, 2])
def test_hessian_through_all_gather_equals_jax(world):
    """jax.hessian (jacfwd of jacrev: vmap of jvp of vjp) of a loss of the gathered parameters."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(5 + world)
    params = {"w": exact(rng, (3, 2)), "b": exact(rng, (2,))}
    lay = tide_jax.layout(params, mesh, AXIS)

    def run(backend):
        def hess(shards):
            def loss(s):
                full = tide_jax.all_gather(s, lay, backend=backend)
                return jax.lax.psum(jnp.sum(jnp.sin(full["w"]) * full["b"]) + jnp.sum(full["b"] ** 3), AXIS)

            h = jax.hessian(loss)(shards)
            return jax.tree.map(lambda t: t[None], h)

        spec = jax.tree.map(lambda _: P(AXIS), {"w": {"w": 0, "b": 0}, "b": {"w": 0, "b": 0}})
        return smap(hess, mesh, (lay.spec,), spec, True)(lay.shard(params))

    got, want = run("tide"), run("jax")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert any(np.asarray(a).any() for a in jax.tree.leaves(got))


@pytest.mark.parametrize("world", [2, 3])
def test_linear_transpose_of_all_gather_is_the_reduce_scatter(tide_backend, world):
    """jax.linear_transpose of tide's all_gather sums the cotangents (fp32) into the shards, and the
    transpose of that transpose gathers again."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(60 + world)
    params = {"w": exact(rng, (5, 3)), "b": exact(rng, (4,))}
    lay = tide_jax.layout(params, mesh, AXIS)
    cts = {k: np.stack([exact(rng, np.shape(x)) for _ in range(world)]) for k, x in params.items()}

    def body(shards, ct):
        gather = lambda s: tide_jax.all_gather(s, lay)
        t = jax.linear_transpose(gather, shards)
        (rs,) = t(jax.tree.map(lambda c: c[0], ct))
        (back,) = jax.linear_transpose(t, jax.tree.map(lambda c: c[0], ct))((shards,))
        return rs, stacked(back)

    sh = {k: P(AXIS) for k in params}
    rs, back = smap(body, mesh, (lay.spec, sh), (lay.spec, sh), True)(lay.shard(params),
                                                                jax.device_put(cts, NamedSharding(mesh, P(AXIS))))
    want_rs = lay.shard({k: c.sum(0).astype(np.float32) for k, c in cts.items()})
    for k in params:
        assert np.asarray(rs[k]).tobytes() == np.asarray(want_rs[k]).tobytes(), k
        assert np.asarray(back[k]).tobytes() == np.stack([params[k]] * world).tobytes(), k


def test_vmap_and_grad_compose_with_integer_leaves():
    """vmap of grad, grad of vmap, and grad of a vmap over the shards themselves (the batched
    primitive transposed), a group holding an integer leaf (no tangent): equal to jax.lax's."""
    mesh = make_mesh((3,), (AXIS,))
    rng = np.random.default_rng(11)
    params = {"w": exact(rng, (7, 5)), "n": np.arange(4, dtype=np.int32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    xs = exact(rng, (2, 5))

    def run(backend):
        def body(s, xs):
            def loss(s, x):
                f = tide_jax.all_gather(s, lay, backend=backend)
                return jnp.sum(jnp.sin(f["w"] @ x)) + f["n"].sum()

            g1 = jax.vmap(jax.grad(loss, allow_int=True), in_axes=(None, 0))(s, xs)
            g2 = jax.grad(lambda s: jnp.sum(jax.vmap(loss, in_axes=(None, 0))(s, xs)), allow_int=True)(s)
            sv = jax.tree.map(lambda t: jnp.stack([t, 2 * t]), s)
            g3 = jax.grad(lambda sv: jnp.sum(jax.vmap(loss)(sv, xs)), allow_int=True)(sv)
            return g1["w"], g2["w"], g3["w"]

        out_specs = (P(None, AXIS), P(AXIS), P(None, AXIS))
        return smap(body, mesh, (lay.spec, P()), out_specs, True)(lay.shard(params), xs)

    got, want = run("tide"), run("jax")
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        assert np.asarray(a).any()


def tide_operands(f, args, target: str) -> list:
    """The operand types of each `target` custom call (e.g. "tide_all_gather") in f's lowered program."""
    lines = [line for line in f.lower(*args).as_text().splitlines() if f"@{target}(" in line]
    return [line.split(") -> (")[0].rsplit(" : (", 1)[1] for line in lines]


@pytest.mark.parametrize("op", ["all_gather", "gather_params"])
@pytest.mark.parametrize("world", [2, 3])
def test_jvp_in_some_leaves_gathers_only_their_tangents(op, world):
    """Forward mode in the adapters of a LoRA group (the base weights closed over, an integer leaf
    beside them): the tangents' all-gather moves the adapters' tangents alone (the lowered program's
    second tide all-gather has their two operands, not the base's or the integer's), the base's
    output tangent is zero, and everything equals JAX's jvp of jax.lax bitwise."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(90 + world)
    params = {"base": exact(rng, (33, 8)), "a": exact(rng, (2, 8)), "b": exact(rng, (33, 2))}
    if op == "all_gather":
        params["n"] = rng.integers(-5, 5, size=(9,)).astype(np.int32)
    lay = tide_jax.layout(params, mesh, AXIS)
    trained = ("a", "b")
    tangent = {k: exact(rng, params[k].shape) for k in trained}
    lay_t = tide_jax.layout(tangent, mesh, AXIS)

    def run(backend):
        gather = getattr(tide_jax, op)

        def body(shards, t):
            out, t_out = jax.jvp(lambda lora: gather(dict(shards, **lora), lay, backend=backend),
                                 ({k: shards[k] for k in trained},), (t,))
            return stacked(out), stacked({k: v for k, v in t_out.items() if k != "n"})

        spec = {k: P(AXIS) for k in params}
        f = smap(body, mesh, (lay.spec, lay_t.spec), (spec, {k: P(AXIS) for k in ("base", "a", "b")}), True)
        return f, (lay.shard(params), lay_t.shard(tangent))

    f, args = run("tide")
    calls = tide_operands(f, args, "tide_all_gather")
    assert len(calls) == 2, calls  # the primals' gather, the tangents' gather
    rows = lambda r: -(-r // world)
    assert calls[0].count("tensor<") == len(params), calls[0]
    ty = "bf16" if op == "gather_params" else "f32"  # gather_params casts the shards, then gathers
    assert calls[1] == f"tensor<{rows(2)}x8x{ty}>, tensor<{rows(33)}x2x{ty}>", calls[1]
    got = f(*args)
    g, args_j = run("jax")
    want = g(*args_j)
    for a, b, path in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree_util.tree_leaves_with_path(got)):
        assert np.asarray(a).dtype == np.asarray(b).dtype, path[0]
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path[0])
    assert not np.asarray(got[1]["base"]).any() and np.asarray(got[1]["a"]).any()


@pytest.mark.parametrize("op", ["all_gather", "gather_params"])
def test_parameter_the_loss_does_not_use_costs_no_reduce_scatter(op):
    """A gathered parameter the loss never reads has a symbolic-zero cotangent: the backward's
    reduce-scatter leaves it out (its gradient is zero, as jax.lax's), the others bitwise as jax.lax."""
    world = 3
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(17)
    params = {"head": exact(rng, (10, 4)), "w": exact(rng, (7, 4)), "b": exact(rng, (7,))}
    lay = tide_jax.layout(params, mesh, AXIS)
    x = exact(rng, (world, 4))

    def run(backend):
        gather = getattr(tide_jax, op)

        def grads(shards, x):
            def loss(s):
                full = gather(s, lay, backend=backend)  # "head" unused: another task's
                h = full["w"].astype(jnp.float32) @ x[0] + full["b"].astype(jnp.float32)
                return jax.lax.psum(jnp.sum(h * h), AXIS)

            return jax.grad(loss)(shards)

        return smap(grads, mesh, (lay.spec, P(AXIS)), lay.spec, True), (lay.shard(params), x)

    f, args = run("tide")
    calls = tide_operands(f, args, "tide_reduce_scatter")
    assert len(calls) == 1 and calls[0].count("tensor<") == 2 and "10x4" not in calls[0], calls
    got = f(*args)
    g, args_j = run("jax")
    want = g(*args_j)
    for k in params:
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes(), k
    assert not np.asarray(got["head"]).any() and np.asarray(got["w"]).any()


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (3,), (2, 2)])
def test_hessian_vector_products_through_gather_params_equal_jax(mesh_shape):
    """Forward over reverse through gather_params (its backward differentiated too: the reduce-scatter
    of the cotangent, the fp32 sum over HSDP replicas on the (2, 2) mesh, the cast to the shards'
    dtype), and jax.hessian of the same loss: equal to JAX's derivatives of jax.lax."""
    names = (AXIS,) if len(mesh_shape) == 1 else ("data", AXIS)
    mesh = make_mesh(mesh_shape, names)
    rng = np.random.default_rng(sum(mesh_shape))
    params = {"w": exact(rng, (5, 3)), "b": exact(rng, (5,))}
    lay = tide_jax.layout(params, mesh, AXIS, replicas=names[:-1])
    v = {k: exact(rng, np.shape(p)) for k, p in params.items()}
    x = exact(rng, (mesh.size, 3))

    def run(backend):
        def loss(s, x):
            full = tide_jax.gather_params(s, lay, jnp.float32, backend=backend)
            h = jnp.tanh(full["w"] @ x[0] + full["b"])
            return jax.lax.psum(jnp.sum(h * h), names)

        def both(s, x, v):
            hvp = jax.jvp(lambda s: jax.grad(loss)(s, x), (s,), (v,))[1]
            hess = jax.tree.map(lambda t: t[None], jax.hessian(loss)(s, x))
            return hvp, hess

        hspec = jax.tree.map(lambda _: P(names), {k: dict.fromkeys(params, 0) for k in params})
        return smap(both, mesh, (lay.spec, P(names), lay.spec), (lay.spec, hspec), True)(
            lay.shard(params), x, lay.shard(v))

    got, want = run("tide"), run("jax")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)
    assert np.asarray(got[0]["w"]).any()
