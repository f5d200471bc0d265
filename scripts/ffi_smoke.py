"""Smoke test of the XLA FFI edge on JAX's CPU platform, without the tide_jax package.

Loads the built cdylib with ctypes, registers the CPU handlers, calls them through jax.ffi.ffi_call
inside jax.jit(jax.shard_map(...)) on 8 forced CPU devices, and checks against jax.lax. Shows the
exact attribute encoding the FFI contract wants (docs/design.md "FFI contract").

    cargo build && python3 scripts/ffi_smoke.py [path/to/libtide.so]
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TIDE_TIMEOUT_S", "20")
os.environ.setdefault("TIDE_RS_SLOT_BYTES", "4096")  # tiny stage slots: many pipeline rounds

import ctypes
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "debug", "libtide.so")
lib = ctypes.CDLL(LIB)
jax.ffi.register_ffi_target("tide_all_gather", jax.ffi.pycapsule(lib.tide_ffi_all_gather_cpu), platform="cpu")
jax.ffi.register_ffi_target("tide_reduce_scatter", jax.ffi.pycapsule(lib.tide_ffi_reduce_scatter_cpu), platform="cpu")

_sites = itertools.count(1)


def attrs(mesh, axis, names, site=None, ordinal_offset=0, topo=None):
    """The attributes of one call: every scalar np.int64, every array np.int64 1-D, names a str."""
    world = mesh.shape[axis]
    ax = mesh.axis_names.index(axis)
    others = [i for i in range(mesh.devices.ndim) if i != ax]
    ordinals, ranks, groups = [], [], []
    for idx in np.ndindex(mesh.devices.shape):
        ordinals.append(mesh.devices[idx].id + ordinal_offset)  # CPU: DeviceOrdinal == global id
        ranks.append(idx[ax])
        g = 0
        for i in others:
            g = g * mesh.devices.shape[i] + idx[i]
        groups.append(g)
    return dict(
        site=np.int64(next(_sites) if site is None else site),
        world=np.int64(world),
        nodes=np.int64(topo[0] if topo else 1),
        gpus_per_node=np.int64(topo[1] if topo else world),
        device_ordinals=np.array(ordinals, np.int64),
        device_ranks=np.array(ranks, np.int64),
        device_groups=np.array(groups, np.int64),
        names="\n".join(names),
    )


def shard_rows(shape, world):
    rows = shape[0] if shape else 1
    return -(-rows // world)


def shard_global(x, world):
    """Full array -> (world * shard_rows, *rest) zero-padded, as tide_jax's layout.shard does."""
    x = np.asarray(x)
    if x.ndim == 0:
        x = x.reshape(1)
    sr = shard_rows(x.shape, world)
    pad = np.zeros((world * sr - x.shape[0],) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])


def tide_all_gather(mesh, axis, full_shapes, dtypes, names, **kw):
    world = mesh.shape[axis]
    a = attrs(mesh, axis, names, **kw)
    spec = P(axis)
    out_types = [jax.ShapeDtypeStruct(s, d) for s, d in zip(full_shapes, dtypes)]

    def body(*shards):
        outs = jax.ffi.ffi_call("tide_all_gather", out_types)(*shards, **a)
        return tuple(o[None] for o in outs)  # (1, *shape) per rank: check every rank's copy

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(full_shapes),
                                 out_specs=(P(axis),) * len(full_shapes), check_vma=False))


def check_all_gather(mesh, axis, params, names, topo=None):
    world = mesh.shape[axis]
    f = tide_all_gather(mesh, axis, [p.shape for p in params], [p.dtype for p in params], names, topo=topo)
    shards = [jnp.asarray(shard_global(p, world)) for p in params]
    outs = f(*shards)

    # Reference: jax.lax.all_gather of the padded shards, trimmed to the full shape.
    def ref_body(*s):
        return tuple(jax.lax.all_gather(x, axis, tiled=True)[None] for x in s)

    ref = jax.jit(jax.shard_map(ref_body, mesh=mesh, in_specs=(P(axis),) * len(params),
                                out_specs=(P(axis),) * len(params), check_vma=False))(*shards)
    for p, o, r in zip(params, outs, ref):
        o = np.asarray(o)
        r = np.asarray(r)
        copies = o.shape[0]
        for c in range(copies):
            want = r[c][: (p.shape[0] if p.ndim else 1)].reshape(p.shape)
            assert o[c].dtype == want.dtype, (o.dtype, want.dtype)
            assert o[c].shape == p.shape and o[c].tobytes() == np.asarray(want).tobytes(), (p.shape, c)
            assert o[c].tobytes() == np.asarray(p).tobytes(), (p.shape, c)
    return outs


def check_reduce_scatter(mesh, axis, shapes, dtype, topo=None):
    world = mesh.shape[axis]
    rng = np.random.default_rng(0)
    # Each rank's full gradient: global (world * rows, *rest) sharded on the axis.
    grads = [rng.standard_normal((world,) + (s if s else (1,))).astype(np.float32) for s in shapes]
    grads = [jnp.asarray(g, dtype) for g in grads]
    a = attrs(mesh, axis, [f"g{i}" for i in range(len(shapes))], topo=topo)
    out_types = [jax.ShapeDtypeStruct((shard_rows(s, world),) + tuple(s[1:]), jnp.float32) for s in shapes]

    def body(*gs):
        gs = [g[0].reshape(s) for g, s in zip(gs, shapes)]
        return tuple(jax.ffi.ffi_call("tide_reduce_scatter", out_types)(*gs, **a))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis),) * len(shapes),
                              out_specs=(P(axis),) * len(shapes), check_vma=False))
    outs = f(*grads)
    for s, g, o in zip(shapes, grads, outs):
        total = np.asarray(g, np.float64).sum(axis=0)  # fp64 reference sum over ranks
        want = shard_global(total.reshape(s), world)
        o = np.asarray(o)
        assert o.dtype == np.float32 and o.shape == want.shape, (o.dtype, o.shape, want.shape)
        err = np.abs(o - want).max()
        assert err <= 1e-5 * max(1.0, np.abs(want).max()) * world, (s, err)
    again = f(*grads)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(outs, again)), "not bitwise stable"


def expect_error(fn, *needles):
    try:
        jax.block_until_ready(fn())
    except Exception as e:  # XlaRuntimeError / JaxRuntimeError
        msg = str(e)
        for n in needles:
            assert n in msg, f"{n!r} not in error: {msg}"
        return msg
    raise AssertionError("expected an error")


def main():
    devs = np.array(jax.devices())
    assert len(devs) == 8, devs
    mesh = Mesh(devs, ("x",))
    rng = np.random.default_rng(1)

    # 1. All-gather, 8 ranks, odd shapes and mixed dtypes (7 rows on 8 ranks, 1-D, 3-D, 0-d).
    params = [
        rng.standard_normal((7, 5)).astype(np.float32),
        np.asarray(jnp.asarray(rng.standard_normal(16), jnp.bfloat16)),
        rng.standard_normal((3, 4, 2)).astype(np.float32),
        np.float32(3.5) * np.ones((), np.float32),
        rng.integers(0, 100, (9, 3)).astype(np.int32),
    ]
    check_all_gather(mesh, "x", params, ["w7x5", "b16", "t3x4x2", "scalar", "ints"])
    print("ok: all_gather 8 ranks, 5 params of odd shapes and mixed dtypes")

    # 2. Two groups of 4 ranks (2-D mesh, gather over 'x' within each 'y' group).
    mesh2 = Mesh(devs.reshape(4, 2), ("x", "y"))
    check_all_gather(mesh2, "x", [rng.standard_normal((10, 3)).astype(np.float32)], ["w"])
    print("ok: all_gather over 'x' of a (4, 2) mesh: 2 groups")

    # 3. Reduce-scatter, bf16 and f32 gradients into fp32 shards, bitwise stable on repeat.
    check_reduce_scatter(mesh, "x", [(7, 5), (16,), (3, 4, 2)], jnp.bfloat16)
    check_reduce_scatter(mesh, "x", [(33, 2), ()], jnp.float32)
    check_reduce_scatter(mesh, "x", [(300, 40), (5,)], jnp.float16)
    print("ok: reduce_scatter bf16/f16/f32 -> fp32 within rounding of the fp64 sum, bitwise stable")

    # 3b. Hierarchical plans: the same 8 CPU devices as 2 nodes x 4.
    check_all_gather(mesh, "x", params, ["w7x5", "b16", "t3x4x2", "scalar", "ints"], topo=(2, 4))
    check_reduce_scatter(mesh, "x", [(7, 5), (300, 40), ()], jnp.bfloat16, topo=(2, 4))
    print("ok: all_gather and reduce_scatter with topology 2x4")

    # 4. 200 calls in a lax.scan (one site, seq counting): bitwise stable.
    x = rng.standard_normal((13, 4)).astype(np.float32)
    a = attrs(mesh, "x", ["w"])
    out_t = jax.ShapeDtypeStruct((13, 4), jnp.float32)

    def scan_body(s):
        def step(c, _):
            full = jax.ffi.ffi_call("tide_all_gather", out_t)(s + c, **a)
            return c + 1.0, full.sum()
        _, sums = jax.lax.scan(step, 0.0, None, length=200)
        return sums[None]

    f = jax.jit(jax.shard_map(scan_body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    xs = jnp.asarray(shard_global(x, 8))
    r1, r2 = np.asarray(f(xs)), np.asarray(f(xs))
    assert np.array_equal(r1, r2)
    want = np.array([(x + c).sum() for c in range(200)], np.float32)
    assert np.allclose(r1[0], want, rtol=1e-5), (r1[0][:3], want[:3])
    assert all(np.array_equal(r1[0], r1[i]) for i in range(8))
    print("ok: 200 all_gathers in a lax.scan, twice, bitwise equal across runs and ranks")

    # 5. Errors surface as Python exceptions naming the problem.
    # 5a. Shard shape mismatch: operand has 3 rows where the layout over 8 ranks wants 1.
    bad = tide_all_gather(mesh, "x", [(7, 5)], [jnp.float32], ["layers.0.wq"])
    msg = expect_error(lambda: bad(jnp.zeros((24, 5), jnp.float32)),
                       "layers.0.wq", "operand (local shard) has shape [3, 5]", "wants [1, 5]")
    print("ok: shard shape mismatch ->", msg.splitlines()[0][:200])
    # 5b. A device not in 'device_ordinals' (a layout from another mesh).
    bad = tide_all_gather(mesh, "x", [(8, 2)], [jnp.float32], ["w"], ordinal_offset=100)
    msg = expect_error(lambda: bad(jnp.zeros((8, 2), jnp.float32)), "device ordinal", "device_ordinals")
    print("ok: unknown device ordinal ->", msg.splitlines()[0][:200])
    # 5c. Wrong dtype for the reduce-scatter result.
    a = attrs(mesh, "x", ["g"])
    f = jax.jit(jax.shard_map(
        lambda g: jax.ffi.ffi_call("tide_reduce_scatter", jax.ShapeDtypeStruct((1, 2), jnp.bfloat16))(g[0], **a),
        mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    msg = expect_error(lambda: f(jnp.zeros((8, 8, 2), jnp.bfloat16)), "result dtype is bfloat16")
    print("ok: reduce_scatter into bf16 ->", msg.splitlines()[0][:200])

    # 6. After those failures, calls still work (failed keys do not poison later ones).
    check_all_gather(mesh, "x", params[:2], ["a", "b"])
    check_reduce_scatter(mesh, "x", [(7, 5)], jnp.bfloat16)
    print("ok: calls after errors still work")
    print("ffi smoke: all ok")


if __name__ == "__main__":
    main()
