"""all_gather / reduce_scatter inside jit(shard_map) against jax.lax and fp64 numpy references.

Every test runs twice through the `backend` fixture: on the native library ("tide") and on the
pure-JAX twin ("jax"), so the twin is checked against the same references it serves as.
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
EPS32 = float(np.finfo(np.float32).eps)


def odd_params(rng, float_only=False):
    """Odd shapes: 7 rows on 8 ranks, 1-D, 0-d, 3-D, a single row, mixed dtypes in one group."""
    params = {
        "w7": rng.standard_normal((7, 5)).astype(np.float32),
        "v13": rng.standard_normal((13,)).astype(ml_dtypes.bfloat16),
        "scalar": np.float32(rng.standard_normal()),
        "t3d": rng.standard_normal((3, 4, 2)).astype(np.float16),
        "row": rng.standard_normal((1, 3)).astype(np.float32),
        "big": rng.standard_normal((37, 6)).astype(ml_dtypes.bfloat16),
    }
    if not float_only:
        params["ints"] = rng.integers(-100, 100, size=(10,)).astype(np.int32)
    return params


def same_bytes(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def smap(f, mesh, in_specs, out_specs):
    return jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def lax_all_gather(shards, lay):
    """The reference: jax.lax.all_gather(tiled=True), cropped to the original shapes."""
    return jax.tree.map(
        lambda t, p: jax.lax.all_gather(t, AXIS, tiled=True)[: p.rows].reshape(p.shape),
        shards,
        jax.tree.unflatten(lay.treedef, lay.params),
    )


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_all_gather_matches_lax(backend, world):
    mesh = make_mesh((world,), (AXIS,))
    params = odd_params(np.random.default_rng(world))
    lay = tide_jax.layout(params, mesh, AXIS)
    sharded = lay.shard(params)
    stacked = jax.tree.map(lambda _: P(AXIS), params)  # every rank's result, stacked on a new dim 0

    out = smap(
        lambda s: jax.tree.map(lambda t: t[None], tide_jax.all_gather(s, lay)), mesh, (lay.spec,), stacked
    )(sharded)
    ref = smap(lambda s: jax.tree.map(lambda t: t[None], lax_all_gather(s, lay)), mesh, (lay.spec,), stacked)(
        sharded
    )
    for name, x in params.items():
        assert out[name].shape == (world, *np.shape(x))
        for rank in range(world):
            assert same_bytes(out[name][rank], x), f"{name} on rank {rank}"
            assert same_bytes(out[name][rank], ref[name][rank]), f"{name} on rank {rank} vs jax.lax"


BYTE_WIDE = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.uint32, np.complex64, ml_dtypes.float8_e4m3fn,
             ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz,
             ml_dtypes.float8_e4m3, ml_dtypes.float8_e3m4, ml_dtypes.float8_e8m0fnu]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_all_gather_moves_every_byte_wide_dtype(backend, world):
    """The all-gather moves bytes: fp8 weights (FP8 all-gather), complex, bool and small integers
    arrive bitwise, in one group with odd shapes, by all_gather and by start/done."""
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(200 + world)
    params = {}
    for i, dt in enumerate(BYTE_WIDE):
        shape = [(7, 3), (13,), (), (3, 2, 2), (world + 1, 1)][i % 5]
        if np.dtype(dt).kind in "iub":
            params[np.dtype(dt).name] = rng.integers(0, 2 if dt is np.bool_ else 100, size=shape).astype(dt)
        elif np.dtype(dt).kind == "c":
            params[np.dtype(dt).name] = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        else:
            params[np.dtype(dt).name] = np.asarray(rng.standard_normal(shape) * 4).astype(dt)
    lay = tide_jax.layout(params, mesh, AXIS)
    stacked = jax.tree.map(lambda _: P(AXIS), params)

    def both(s):
        full = tide_jax.all_gather(s, lay)
        started = tide_jax.all_gather_done(tide_jax.all_gather_start(s, lay))
        return jax.tree.map(lambda t: t[None], full), jax.tree.map(lambda t: t[None], started)

    out, started = smap(both, mesh, (lay.spec,), (stacked, stacked))(lay.shard(params))
    for name, x in params.items():
        assert out[name].dtype == x.dtype, name
        for rank in range(world):
            assert same_bytes(out[name][rank], x), f"{name} on rank {rank}"
            assert same_bytes(started[name][rank], x), f"{name} on rank {rank} (start/done)"
    assert same_bytes(lay.unshard(lay.shard(params))["float8_e4m3fn"], params["float8_e4m3fn"])
    # dtype= casts the real floating shards only: float8 to bf16; complex, bool and ints as they are.
    cast = smap(lambda s: jax.tree.map(lambda t: t[None], tide_jax.all_gather(s, lay, jnp.bfloat16)), mesh,
                (lay.spec,), stacked)(lay.shard(params))
    for name, x in params.items():
        want = np.asarray(x).astype(ml_dtypes.bfloat16) if np.dtype(x.dtype).kind not in "biuc" else x
        assert same_bytes(cast[name][world - 1], want), f"{name} gathered as bfloat16"


@pytest.mark.parametrize("world", [3, 8])
def test_all_gather_with_cast(backend, world):
    mesh = make_mesh((world,), (AXIS,))
    params = odd_params(np.random.default_rng(10 + world))
    lay = tide_jax.layout(params, mesh, AXIS)
    out = jax.jit(
        tide_jax.shard_map(
            lambda s: tide_jax.all_gather(s, lay, dtype=jnp.bfloat16),
            mesh=mesh,
            in_specs=(lay.spec,),
            out_specs=P(),
            check_vma=False,
        )
    )(lay.shard(params))
    for name, x in params.items():
        want = x if x.dtype == np.int32 else np.asarray(x).astype(ml_dtypes.bfloat16)
        assert same_bytes(out[name], want), name


def per_rank_grads(rng, params, world, scale=1.0):
    """Random gradients, different on every rank: {name: (world, *shape)} in the parameter's dtype."""
    return {
        k: (scale * rng.standard_normal((world, *np.shape(x)))).astype(np.asarray(x).dtype)
        for k, x in params.items()
    }


def check_reduction(name, got_padded, grads_of_ranks, rows, bf16_margin=True):
    """got_padded: (world * shard_rows, *rest) fp32 sharded result; grads_of_ranks: (world, *shape)."""
    terms = np.asarray(grads_of_ranks).astype(np.float64)
    exact = terms.sum(axis=0).reshape(rows, -1)
    bound = terms.shape[0] * EPS32 * np.abs(terms).sum(axis=0).reshape(rows, -1) + 1e-30
    got = np.asarray(got_padded).astype(np.float64).reshape(got_padded.shape[0], -1)
    assert got_padded.dtype == np.float32, name
    assert not got[rows:].any(), f"{name}: padding rows of the result are not zero"
    err = np.abs(got[:rows] - exact)
    assert (err <= bound).all(), f"{name}: max error {err.max()} exceeds fp32 rounding bound"
    if bf16_margin and terms.shape[0] >= 2:
        # What a bf16 reduction (JAX's psum_scatter on bf16 operands) would give: each partial sum rounded.
        acc = terms[0].astype(ml_dtypes.bfloat16)
        for t in terms[1:]:
            acc = (acc.astype(np.float32) + t.astype(np.float32)).astype(ml_dtypes.bfloat16)
        bf16_err = np.abs(acc.astype(np.float64).reshape(rows, -1) - exact).max()
        assert err.max() * 100 <= bf16_err, f"{name}: error {err.max()} not far below bf16's {bf16_err}"


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_reduce_scatter_matches_fp64_sum(backend, world):
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(100 + world)
    params = odd_params(rng, float_only=True)
    lay = tide_jax.layout(params, mesh, AXIS)
    grads = per_rank_grads(rng, params, world)
    grads_dev = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))

    out = smap(
        lambda g: tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0], g), lay), mesh, (P(AXIS),), lay.spec
    )(grads_dev)
    for p in lay.params:
        name = p.path[2:-2]
        assert out[name].shape == p.global_shape
        check_reduction(name, out[name], grads[name], p.rows, bf16_margin=params[name].dtype == ml_dtypes.bfloat16)


def test_reduce_scatter_output_dtype(backend):
    mesh = make_mesh((8,), (AXIS,))
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((9, 3)).astype(ml_dtypes.bfloat16)}
    lay = tide_jax.layout(params, mesh, AXIS)
    grads = per_rank_grads(rng, params, 8)
    run = lambda dtype: smap(
        lambda g: tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0], g), lay, dtype=dtype),
        mesh,
        (P(AXIS),),
        lay.spec,
    )(jax.device_put(grads, NamedSharding(mesh, P(AXIS))))
    f32, bf16 = run(jnp.float32), run(jnp.bfloat16)
    assert f32["w"].dtype == np.float32 and bf16["w"].dtype == jnp.bfloat16
    assert same_bytes(np.asarray(f32["w"]).astype(ml_dtypes.bfloat16), bf16["w"])


@pytest.mark.parametrize("names", [("dp", AXIS), (AXIS, "dp")])
def test_two_axis_mesh_groups(backend, names):
    """A 2x4 mesh, the FSDP axis either way: each group of the other axis runs its own collective."""
    shape = (2, 4) if names[0] == "dp" else (4, 2)
    mesh = make_mesh(shape, names)
    world, groups = 4, 2
    rng = np.random.default_rng(5)
    per_group = [odd_params(rng, float_only=True) for _ in range(groups)]
    lay = tide_jax.layout(per_group[0], mesh, AXIS)
    assert lay.world == world
    gspec = P("dp", AXIS)

    # all-gather: group g holds the shards of per_group[g]
    shards = {}
    for p in lay.params:
        name = p.path[2:-2]
        padded = np.zeros((groups, *p.global_shape), dtype=p.dtype)
        for g in range(groups):
            padded[g, : p.rows] = np.reshape(per_group[g][name], (p.rows, *p.rest))
        shards[name] = jax.device_put(padded, NamedSharding(mesh, gspec))
    gathered = smap(
        lambda s: jax.tree.map(lambda t: t[None, None], tide_jax.all_gather(jax.tree.map(lambda t: t[0], s), lay)),
        mesh,
        (gspec,),
        gspec,
    )(shards)
    for name in per_group[0]:
        for g in range(groups):
            for rank in range(world):
                assert same_bytes(gathered[name][g, rank], per_group[g][name]), f"{name} group {g} rank {rank}"

    # reduce-scatter: every device has its own gradient; group g sums over its ranks only
    grads = {k: (rng.standard_normal((groups, world, *np.shape(x)))).astype(x.dtype) for k, x in per_group[0].items()}
    out = smap(
        lambda gr: jax.tree.map(
            lambda t: t[None], tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0, 0], gr), lay)
        ),
        mesh,
        (gspec,),
        jax.tree.map(lambda _: gspec, per_group[0]),
    )(jax.device_put(grads, NamedSharding(mesh, gspec)))
    for p in lay.params:
        name = p.path[2:-2]
        for g in range(groups):
            check_reduction(f"{name} group {g}", out[name][g], grads[name][g], p.rows, bf16_margin=False)


def scan_program(lay, mesh, steps):
    def body(carry, _):
        rank = jax.lax.axis_index(AXIS)
        full = tide_jax.all_gather(carry, lay)  # fp32 throughout: comparable to the twin over 200 steps
        grads = jax.tree.map(lambda t: t * ((rank + 1) / 8).astype(t.dtype), full)
        summed = tide_jax.reduce_scatter(grads, lay)
        new = jax.tree.map(lambda c, s: 0.5 * c + 0.1 * s, carry, summed)
        return new, sum(jnp.sum(s) for s in jax.tree.leaves(summed))

    def run(shards):
        final, trace = jax.lax.scan(body, shards, None, length=steps)
        return final, trace[None]

    return smap(run, mesh, (lay.spec,), (lay.spec, P(AXIS)))


def test_scan_200_calls_bitwise_stable(backend):
    mesh = make_mesh((8,), (AXIS,))
    rng = np.random.default_rng(3)
    params = {
        "w7": rng.standard_normal((7, 5)).astype(np.float32),
        "v": rng.standard_normal((29,)).astype(np.float32),
        "s": np.float32(1.5),
    }
    lay = tide_jax.layout(params, mesh, AXIS)
    program = scan_program(lay, mesh, 200)
    first = program(lay.shard(params))
    second = program(lay.shard(params))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert same_bytes(a, b), "two runs of the same program differ: a race or an unstable summation order"
    # and it computes the right thing: the pure-JAX twin agrees to fp32 rounding
    previous = tide_jax.set_backend("jax")
    try:
        ref = scan_program(lay, mesh, 200)(lay.shard(params))
    finally:
        tide_jax.set_backend(previous)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("topology", ["2x4", "4x2", "8x1"])
def test_multi_node_topologies(backend, topology):
    """The same results when the 8 ranks are declared as several nodes (the hierarchical plans)."""
    mesh = make_mesh((8,), (AXIS,))
    rng = np.random.default_rng(42)
    params = odd_params(rng, float_only=True)
    lay = tide_jax.layout(params, mesh, AXIS, topology=topology)
    assert f"{lay.nodes}x{lay.gpus_per_node}" == topology
    stacked = jax.tree.map(lambda _: P(AXIS), params)
    out = smap(
        lambda s: jax.tree.map(lambda t: t[None], tide_jax.all_gather(s, lay)), mesh, (lay.spec,), stacked
    )(lay.shard(params))
    for name, x in params.items():
        for rank in range(8):
            assert same_bytes(out[name][rank], x), f"{name} on rank {rank}"
    grads = per_rank_grads(rng, params, 8)
    summed = smap(
        lambda g: tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0], g), lay), mesh, (P(AXIS),), lay.spec
    )(jax.device_put(grads, NamedSharding(mesh, P(AXIS))))
    for p in lay.params:
        name = p.path[2:-2]
        check_reduction(name, summed[name], grads[name], p.rows, bf16_margin=False)


def test_many_independent_calls_in_one_step():
    """80 independent tide calls in one jitted step on 8 CPU devices (one per "layer", no data
    dependencies between them). XLA:CPU runs independent thunks concurrently on a small thread
    pool; collectives that blocked pool threads while waiting for their peers starved it (a
    deadlock until the timeout, seen with a 12-layer model). tide's CPU handlers are asynchronous:
    every call completes, each gather byte-exact and each reduce-scatter within fp32 rounding."""
    world = 8
    N_LAYERS = 40
    mesh = make_mesh((world,), (AXIS,))
    rng = np.random.default_rng(24)
    layers = [{"w": rng.standard_normal((29, 16)).astype(np.float32)} for _ in range(N_LAYERS)]
    lays = [tide_jax.layout(p, mesh, AXIS) for p in layers]
    shards = [lay.shard(p) for lay, p in zip(lays, layers)]
    grads = [rng.standard_normal((world, 29, 16)).astype(ml_dtypes.bfloat16) for _ in range(N_LAYERS)]
    gsharded = [jax.device_put(g.reshape(world * 29, 16), NamedSharding(mesh, P(AXIS))) for g in grads]

    def step(shards, gs):
        full = [tide_jax.all_gather(s, lay)["w"][None] for s, lay in zip(shards, lays)]
        rs = [tide_jax.reduce_scatter({"w": g}, lay)["w"] for g, lay in zip(gs, lays)]
        return full, rs

    out_specs = ([P(AXIS)] * N_LAYERS, [P(AXIS)] * N_LAYERS)
    full, rs = smap(step, mesh, ([lay.spec for lay in lays], [P(AXIS)] * N_LAYERS), out_specs)(shards, gsharded)
    for i, p in enumerate(layers):
        for rank in range(world):
            assert same_bytes(full[i][rank], p["w"]), f"layer {i} rank {rank}"
        exact = grads[i].astype(np.float64).sum(axis=0)
        got = np.asarray(rs[i]).reshape(world, -1, 16)
        shard_rows = lays[i].params[0].shard_rows
        for rank in range(world):
            lo, hi = rank * shard_rows, min((rank + 1) * shard_rows, 29)
            want = np.zeros((shard_rows, 16))
            if hi > lo:
                want[: hi - lo] = exact[lo:hi]
            tol = world * EPS32 * np.abs(grads[i].astype(np.float64)).sum(axis=0).max() + 1e-30
            assert np.abs(got[rank] - want).max() <= tol, f"layer {i} rank {rank}"
