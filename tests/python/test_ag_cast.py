"""The casting all-gather: fp32 shards in, bf16 parameters out (issue #22: no bf16 shard held
between start and done, no own-shard copy; [Note: the casting all-gather] in tide_jax/_native.py).

`_start_cast(stacked, index)` + `all_gather_done` must equal
`all_gather([s[index].astype(bfloat16) for s in stacked])` bitwise (XLA's convert, then the gather)
for every index (a negative one counting from the end, then clamped), on fresh random data with rows
the world size does not divide, values that round to ties, overflow to infinity and NaNs, world sizes
1 (native), 2, 3 and 8; and scan_layers must give the same bits with it (TIDE_AG_CAST=1, the
default) as without.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tide_jax
from tide_jax import _native, _ops
from conftest import make_mesh

AXIS = "fsdp"
SHAPES = {"w": (11, 6), "b": (5,), "s": (), "v": (3, 2, 3)}  # rows 11, 5 and 3: uneven over 2, 3, 8


def _values(rng, shape):
    """Random fp32 with rounding edge cases mixed in: ties (both parities), values that round to
    +-inf, infinities, NaNs, subnormals, signed zeros."""
    x = rng.standard_normal(shape).astype(np.float32)
    bits = x.reshape(-1).view(np.uint32)
    kind = rng.integers(0, 8, bits.shape)
    bits[kind == 0] = (bits[kind == 0] & 0xFFFF0000) | 0x8000  # a tie
    bits[kind == 1] = 0x7F7F8000 + rng.integers(0, 0x8000, int((kind == 1).sum())).astype(np.uint32)
    specials = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000001, 0x80000000, 0x807FFFFF],
                        np.uint32)
    pick = kind == 2
    bits[pick] = specials[rng.integers(0, len(specials), int(pick.sum()))]
    return bits.view(np.float32).reshape(shape)


def _same(a, b) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (the payload is not kept)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    fa, fb = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(fa)
    return bool(np.array_equal(nan, np.isnan(fb))
                and np.array_equal(a[~nan].view(np.uint16), b[~nan].view(np.uint16)))


@pytest.fixture
def world1_native():
    previous, _native._world1_native = _native._world1_native, True
    yield
    _native._world1_native = previous


def _check(world, seed, num=4, mesh=None, backend="tide", expect_native=True):
    rng = np.random.default_rng(seed)
    mesh = make_mesh((world,), (AXIS,)) if mesh is None else mesh
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    lay = tide_jax.layout(params, mesh, AXIS)
    # per rank: (num, *shard) fp32 stacks, random
    stacks = [_values(rng, (world, num, *p.shard_shape)) for p in lay.params]

    def body(index, stacks):
        s = [t[0] for t in stacks]
        h = _native.start_cast(s, index, lay, backend)
        got = jax.tree_util.tree_leaves(_ops.all_gather_done(h))
        shards = [jax.lax.dynamic_index_in_dim(t, index, 0, keepdims=False).astype(jnp.bfloat16) for t in s]
        want = jax.tree_util.tree_leaves(
            tide_jax.all_gather(jax.tree_util.tree_unflatten(lay.treedef, shards), lay, backend="jax"))
        return [t[None] for t in got], [t[None] for t in want]

    f = jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=(P(), [P(AXIS)] * len(stacks)),
                                   out_specs=([P(AXIS)] * len(stacks), [P(AXIS)] * len(stacks))))
    hlo = f.lower(jnp.int32(0), stacks).as_text()
    n_cast = len(re.findall(r"tide_all_gather_cast_start", hlo))
    assert (n_cast >= 1) == expect_native, (n_cast, hlo[:2000])
    for index in (0, num - 1, 1, -2, num + 3, -num - 5):
        got, want = f(jnp.int32(index), stacks)
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == jnp.bfloat16
            assert _same(a, b), (world, index, k)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_cast_gather_equals_convert_then_gather(world):
    _check(world, seed=world * 7 + 1)


def test_cast_gather_world1_native(world1_native):
    _check(1, seed=5)


@pytest.mark.parametrize("world", [1, 3])
def test_cast_gather_jax_backend_and_local(world):
    """The jax backend, and world size 1 without native calls: XLA's convert, then the gather."""
    _check(world, seed=11 + world, backend="jax", expect_native=False)
    _check(world, seed=13 + world, backend="tide", expect_native=world > 1)


def test_cast_gather_off(monkeypatch):
    monkeypatch.setenv("TIDE_AG_CAST", "0")
    _check(3, seed=17, expect_native=False)


def check_cast_gather(mesh, seed):
    """`_check` on `mesh` (test_gpu.py runs it on GPUs)."""
    _check(mesh.devices.size, seed=seed, mesh=mesh)


def test_cast_gather_refuses_a_wrong_operand():
    mesh = make_mesh((2,), (AXIS,))
    lay = tide_jax.layout({"w": np.zeros((5, 3), np.float32)}, mesh, AXIS)

    def body(s):
        h = _native.start_cast([s[0]], 0, lay, "tide")
        return _ops.all_gather_done(h)["w"][None]

    f = jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    with pytest.raises(ValueError, match=r"'w'.*float32\[L, 3, 3\]"):
        f(jnp.zeros((2, 4, 2, 3), jnp.float32))


def test_cast_gather_native_refusals_name_the_parameter():
    """What the Python checks cannot see, the native edge refuses, naming call, rank and parameter:
    an operand of the wrong shape or dtype reaching tide_all_gather_cast_start directly."""
    mesh = make_mesh((2,), (AXIS,))
    lay = tide_jax.layout({"w": np.zeros((5, 3), np.float32)}, mesh, AXIS)
    call = jax.ffi.ffi_call("tide_all_gather_cast_start", [jax.ShapeDtypeStruct((5, 3), jnp.bfloat16)])

    def body(s):
        return call(s[0], jnp.int32(0), **_native.call_attrs(lay, _native.new_site()))[0][None]

    f = jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    with pytest.raises(Exception, match=r"all_gather_cast.*rank \d.*param 0 .*'w'.*float32\[2, 3, 3\]"):
        jax.block_until_ready(f(jnp.zeros((2, 2, 2, 3), jnp.bfloat16)))


def _loop_step(world, num_layers, remat, reshard, seed, mesh=None):
    from test_rs_into import _loop_step as rs_loop_step

    return rs_loop_step(world, num_layers, remat, reshard, seed, mesh=mesh)


def check_loop_same_bits(monkeypatch, world, num_layers, remat, reshard, mesh=None):
    from test_rs_into import check_switch_same_bits

    check_switch_same_bits(monkeypatch, "TIDE_AG_CAST", "tide_all_gather_cast_start", "tide_all_gather_start",
                           world, num_layers, remat, reshard, mesh)


@pytest.mark.parametrize("world,num_layers,remat,reshard", [(3, 5, "dots", True), (8, 2, None, False), (2, 1, True, True)])
def test_scan_layers_cast_gather_same_bits(monkeypatch, world, num_layers, remat, reshard):
    """scan_layers gathers every layer with the casting all-gather (the HLO has its starts and no
    plain all-gather start), with the same bits as XLA's convert then the gather (TIDE_AG_CAST=0)."""
    check_loop_same_bits(monkeypatch, world, num_layers, remat, reshard)


def test_ag_cast_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TIDE_AG_CAST", "maybe")
    f, args = _loop_step(2, 2, None, True, seed=1)
    with pytest.raises(ValueError, match="TIDE_AG_CAST='maybe'"):
        f.lower(*args)


def test_scan_layers_cast_gather_world1_native(monkeypatch, world1_native):
    """At world size 1 with native calls (TIDE_WORLD1_NATIVE) the gather is the rounding alone."""
    check_loop_same_bits(monkeypatch, 1, 3, "dots", True)
