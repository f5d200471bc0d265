"""Fresh random cases on every run, against references: the shapes, dtypes, meshes and loop settings
nobody wrote down.

Each test draws its cases from a new seed (printed in every failure; `TIDE_RANDOM_SEED=S` replays
one, `TIDE_RANDOM_CASES=N` runs N per test instead of 6):
- `test_random_pytrees`: 1-6 parameters of 0-3 dims (sizes 1-70, rarely dividing the world, now and
  then one of size 0), f32 /
  bf16 / f16 and, all-gathered only, int8-32 / uint8-32 / bool / complex64 / float8, on 1-8 of the
  CPU devices. all_gather gives every rank each parameter's bytes;
  the reduce-scatter of per-rank random gradients is within fp32 rounding of the fp64 sum, padding
  rows zero.
- `test_random_composed_meshes`: fsdp beside a tensor axis (either order) or data x fsdp x tensor,
  parameters split over "tensor" on a random dim: gather_params bitwise equal to the parameters and
  to the pure-JAX twin's, the gradients of a loss through them equal to the twin's to fp32
  summation order, all_gather_start / done equal to gather_params.
- `test_random_layer_loops`: scan_layers over 1-4 layers with random remat, prefetch,
  reshard_after_forward and unroll, on fsdp, data x fsdp, fsdp x tensor and data x fsdp x tensor
  meshes: loss and gradients equal to the pure-JAX twin's.
"""

from __future__ import annotations

import math
import os
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

EPS32 = float(np.finfo(np.float32).eps)
FLOATS = [np.float32, ml_dtypes.bfloat16, np.float16]
OTHERS = [np.int32, np.int8, np.uint8, np.int16, np.uint32, np.bool_, np.complex64, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2]
CASES = int(os.environ.get("TIDE_RANDOM_CASES", "6"))


def seeds(name):
    """This run's seeds for test `name`: TIDE_RANDOM_SEED, else fresh ones, drawn from the session's
    entropy (TIDE_RANDOM_ENTROPY, which conftest.py draws once and pytest-xdist's workers inherit:
    each worker collects the same cases)."""
    fixed = os.environ.get("TIDE_RANDOM_SEED")
    if fixed is not None:
        return [int(fixed)]
    entropy = os.environ.get("TIDE_RANDOM_ENTROPY")
    seq = (np.random.SeedSequence(int(entropy), spawn_key=(zlib.crc32(name.encode()),)) if entropy
           else np.random.SeedSequence())
    return [int(s) for s in seq.generate_state(CASES, dtype=np.uint32)]


def same_bytes(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def smap(f, mesh, in_specs, out_specs):
    return jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def close_to_twin(got, twin, rtol, what):
    g, j = np.asarray(got, np.float64), np.asarray(twin, np.float64)
    assert got.dtype == twin.dtype and g.shape == j.shape, f"{what}: {got.dtype}{g.shape} vs {twin.dtype}{j.shape}"
    scale = np.abs(j).max() if j.size else 0.0
    err = np.abs(g - j).max() if j.size else 0.0
    assert err <= rtol * scale + 1e-30, f"{what}: max difference {err:.3g} (largest value {scale:.3g})"


def random_params(rng, ints: bool):
    params = {}
    for i in range(int(rng.integers(1, 7))):
        shape = tuple(int(rng.integers(1, 12)) if rng.random() > 0.05 else int(rng.integers(12, 71))
                      for _ in range(int(rng.integers(0, 4))))
        if shape and rng.random() < 0.08:  # an empty parameter now and then
            shape = tuple(0 if d == int(rng.integers(0, len(shape))) else n for d, n in enumerate(shape))
        if ints and rng.random() < 0.25:  # all-gathered only: moved as bytes
            other = OTHERS[rng.integers(0, len(OTHERS))]
            if np.dtype(other).kind in "iub":
                params[f"p{i}"] = rng.integers(-50, 50, size=shape).astype(other)
            elif np.dtype(other).kind == "c":
                params[f"p{i}"] = (np.asarray(rng.standard_normal(shape)) * (1 + 1j)).astype(other)
            else:
                params[f"p{i}"] = np.asarray(rng.standard_normal(shape)).astype(other)
        else:
            params[f"p{i}"] = np.asarray(rng.standard_normal(shape)).astype(FLOATS[rng.integers(0, 3)])
    return params


@pytest.mark.parametrize("seed", seeds("pytrees"))
def test_random_pytrees(tide_backend, seed):
    rng = np.random.default_rng(seed)
    world = int(rng.integers(1, 9))
    mesh = make_mesh((world,), ("fsdp",))
    params = random_params(rng, ints=True)
    case = f"seed {seed}, world {world}, " + ", ".join(f"{k} {np.dtype(v.dtype).name}{np.shape(v)}" for k, v in params.items())

    lay = tide_jax.layout(params, mesh, "fsdp")
    stacked = jax.tree.map(lambda _: P("fsdp"), params)
    out = smap(lambda s: jax.tree.map(lambda t: t[None], tide_jax.all_gather(s, lay)), mesh, (lay.spec,), stacked)(
        lay.shard(params))
    for k, x in params.items():
        for rank in range(world):
            assert same_bytes(out[k][rank], x), f"all_gather of {k} on rank {rank}: {case}"

    floats = {k: v for k, v in params.items() if v.dtype in [np.dtype(f) for f in FLOATS]}
    if not floats:
        return
    lay = tide_jax.layout(floats, mesh, "fsdp")
    grads = {k: rng.standard_normal((world, *np.shape(x))).astype(x.dtype) for k, x in floats.items()}
    per_rank = {k: jax.device_put(g, NamedSharding(mesh, P("fsdp"))) for k, g in grads.items()}
    out = smap(lambda g: tide_jax.reduce_scatter(jax.tree.map(lambda t: t[0], g), lay), mesh,
               (jax.tree.map(lambda _: P("fsdp"), floats),), lay.spec)(per_rank)
    for k, x in floats.items():
        rows = int(np.shape(x)[0]) if np.ndim(x) else 1
        row = math.prod(np.shape(x)[1:])
        terms = np.asarray(grads[k]).astype(np.float64)
        exact = terms.sum(0).reshape(rows, row)
        bound = world * EPS32 * np.abs(terms).sum(0).reshape(rows, row) + 1e-30
        got = np.asarray(out[k])
        assert got.dtype == np.float32, f"reduce_scatter of {k}: {got.dtype}: {case}"
        got = got.astype(np.float64).reshape(got.shape[0], row)
        assert not got[rows:].any(), f"reduce_scatter of {k}: padding rows not zero: {case}"
        err = np.abs(got[:rows] - exact)
        assert (err <= bound).all(), f"reduce_scatter of {k}: error {err.max():.3g} over the fp32 bound: {case}"


COMPOSED = [((2, 4), ("fsdp", "tensor")), ((4, 2), ("tensor", "fsdp")), ((3, 2), ("fsdp", "tensor")),
            ((1, 8), ("fsdp", "tensor")), ((8, 1), ("fsdp", "tensor")), ((2, 2, 2), ("data", "fsdp", "tensor"))]


@pytest.mark.parametrize("seed", seeds("composed"))
def test_random_composed_meshes(seed):
    rng = np.random.default_rng(seed)
    shape, names = COMPOSED[rng.integers(0, len(COMPOSED))]
    mesh = make_mesh(shape, names)
    tp = mesh.shape["tensor"]
    params, specs = {}, {}
    for i in range(int(rng.integers(1, 6))):
        dims = [int(rng.integers(1, 13)) for _ in range(int(rng.integers(0, 4)))]
        spec = [None] * len(dims)
        if dims and rng.random() < 0.6:
            d = int(rng.integers(0, len(dims)))
            dims[d], spec[d] = tp * int(rng.integers(1, 5)), "tensor"
        params[f"p{i}"] = rng.standard_normal(dims).astype(FLOATS[rng.integers(0, 3)])
        specs[f"p{i}"] = P(*spec)
    dtype = [jnp.bfloat16, jnp.float32][rng.integers(0, 2)]
    replicas = ("data",) if "data" in names else None
    batch = tuple(a for a in names if a in ("data", "fsdp"))
    n_batch = math.prod(mesh.shape[a] for a in batch)
    case = (f"seed {seed}, mesh {dict(mesh.shape)}, gathered as {jnp.dtype(dtype).name}, "
            + ", ".join(f"{k} {np.dtype(v.dtype).name}{np.shape(v)} {specs[k]}" for k, v in params.items()))

    lay = tide_jax.layout(params, mesh, "fsdp", specs=specs, replicas=replicas)
    consts = {k: jax.device_put(rng.standard_normal(np.shape(v)).astype(np.float32), NamedSharding(mesh, specs[k]))
              for k, v in params.items()}
    weights = jax.device_put(rng.uniform(0.5, 2.0, n_batch).astype(np.float32), NamedSharding(mesh, P(batch)))

    def make(backend):
        def step(shards, c, w):
            def loss_of(shards):
                full = tide_jax.gather_params(shards, lay, dtype, backend=backend)
                return sum(jnp.sum((full[k].astype(jnp.float32) * c[k]) ** 2) for k in full) * w[0] / n_batch

            loss, grads = jax.value_and_grad(loss_of)(shards)
            started = tide_jax.all_gather_done(tide_jax.all_gather_start(shards, lay, dtype, backend=backend))
            return (jax.lax.psum(loss, names), grads, tide_jax.gather_params(shards, lay, dtype, backend=backend),
                    started)

        return smap(step, mesh, (lay.spec, specs, P(batch)), (P(), lay.spec, specs, specs))

    shards = lay.shard(params)
    loss, grads, full, started = make("tide")(shards, consts, weights)
    loss_j, grads_j, full_j, _ = make("jax")(shards, consts, weights)
    for k, x in params.items():
        want = np.asarray(x).astype(dtype)
        assert same_bytes(full[k], want), f"gather_params of {k}: {case}"
        assert same_bytes(full[k], full_j[k]), f"gather_params of {k} vs the pure-JAX twin: {case}"
        assert same_bytes(started[k], want), f"all_gather_start/done of {k}: {case}"
    close_to_twin(loss, loss_j, 1e-5, f"loss: {case}")
    for k in grads:
        close_to_twin(grads[k], grads_j[k], 1e-5 if grads[k].dtype == np.float32 else 1e-2, f"gradient of {k}: {case}")


LOOP_MESHES = [((1,), ("fsdp",)), ((2,), ("fsdp",)), ((3,), ("fsdp",)), ((5,), ("fsdp",)), ((8,), ("fsdp",)),
               ((2, 2), ("data", "fsdp")), ((4, 2), ("fsdp", "tensor")), ((3, 2), ("fsdp", "tensor")),
               ((2, 2, 2), ("data", "fsdp", "tensor"))]


@pytest.mark.parametrize("seed", seeds("loops"))
def test_random_layer_loops(seed):
    rng = np.random.default_rng(seed)
    shape, names = LOOP_MESHES[rng.integers(0, len(LOOP_MESHES))]
    mesh = make_mesh(shape, names)
    tp = "tensor" in names
    width = int(rng.integers(1, 9)) * (mesh.shape["tensor"] if tp else 1)
    layers = int(rng.integers(1, 5))
    pdtype = [np.float32, ml_dtypes.bfloat16][rng.integers(0, 2)]
    remat = [None, True, "dots"][rng.integers(0, 3)]
    prefetch, reshard, unroll = int(rng.integers(0, 3)), bool(rng.integers(0, 2)), bool(rng.random() < 0.3)
    stacked = {"w": (0.3 * rng.standard_normal((layers, width, width))).astype(pdtype),
               "b": (0.1 * rng.standard_normal((layers, width))).astype(pdtype),
               "s": (1 + 0.1 * rng.standard_normal((layers,))).astype(pdtype)}
    specs = {"w": P(None, "tensor"), "b": P("tensor"), "s": P()} if tp else None
    replicas = ("data",) if "data" in names else None
    batch = tuple(a for a in names if a in ("data", "fsdp"))
    n_batch = math.prod(mesh.shape[a] for a in batch)
    x = rng.standard_normal((n_batch * int(rng.integers(1, 3)), width)).astype(np.float32)
    case = (f"seed {seed}, mesh {dict(mesh.shape)}, {layers} layers of width {width} in {np.dtype(pdtype).name}, "
            f"remat {remat}, prefetch {prefetch}, reshard_after_forward {reshard}, unroll {unroll}")

    lay = tide_jax.layout(jax.tree.map(lambda t: t[0], stacked), mesh, "fsdp", specs=specs, replicas=replicas)

    def layer(p, h):
        y = (h.astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32) + p["b"].astype(jnp.float32)
        y = jnp.tanh(y) * p["s"].astype(jnp.float32)
        if tp:  # column-parallel: this device's columns
            y = jax.lax.all_gather(y, "tensor", axis=1, tiled=True)
        return h + y

    def make(backend):
        def step(shards, x):
            def loss_of(shards):
                h = tide_jax.scan_layers(layer, x, shards, lay, prefetch=prefetch, remat=remat,
                                         reshard_after_forward=reshard, unroll=unroll, backend=backend)
                return jnp.sum(h ** 2) / n_batch

            loss, grads = jax.value_and_grad(loss_of)(shards)
            return jax.lax.psum(loss, batch), grads

        return smap(step, mesh, (lay.stacked_spec, P(batch)), (P(), lay.stacked_spec))

    shards = lay.shard_stacked(stacked)
    x = jax.device_put(x, NamedSharding(mesh, P(batch)))
    (loss, grads), (loss_j, grads_j) = make("tide")(shards, x), make("jax")(shards, x)
    close_to_twin(loss, loss_j, 1e-5, f"loss: {case}")
    for k in grads:
        # The ranks' terms may cancel here (random data): fp32 summation order can then be worth
        # more than 1e-5 of the largest gradient; 1e-4 still catches a missing or misplaced term.
        close_to_twin(grads[k], grads_j[k], 1e-4 if grads[k].dtype == np.float32 else 1e-2, f"gradient of {k}: {case}")
