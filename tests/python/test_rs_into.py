"""The reduce-scatter into slices of larger buffers (issue #22: no fp32 result in flight, no copy
into the gradient buffer; [Note: reduce-scatter into slices] in tide_jax/_native.py).

`_start_into(grads, bufs, index)` + `_done_into` must equal
`dynamic_update_index_in_dim(bufs[i], reduce_scatter(grads)[i], index, 0)` bitwise for every index
(a negative one counting from the end, then clamped, as jax.lax does), leave every other slice as it was, on fresh random data with rows
that the world size does not divide, bf16 / f16 / f32 gradients, world sizes 1 (native), 2, 3 and
8; and scan_layers must give the same bits with it (TIDE_RS_INTO=1, the default) as without.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from tide_jax import _native, _ops
from conftest import make_mesh

AXIS = "fsdp"
SHAPES = {"w": (11, 6), "b": (5,), "s": (), "v": (3, 2, 3)}  # rows 11, 5 and 3: uneven over 2, 3, 8


def _params(rng):
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture
def world1_native():
    previous, _native._world1_native = _native._world1_native, True
    yield
    _native._world1_native = previous


def _check(world, dtype, seed, num=4, mesh=None, backend="tide"):
    rng = np.random.default_rng(seed)
    mesh = make_mesh((world,), (AXIS,)) if mesh is None else mesh
    lay = tide_jax.layout(_params(rng), mesh, AXIS)
    # per rank: a full gradient (different on every rank) and the (num, *shard) buffers, random
    grads = {k: rng.standard_normal((world, *s)).astype(np.float32) for k, s in SHAPES.items()}
    grads = {k: jnp.asarray(v).astype(dtype) for k, v in grads.items()}
    bufs = [rng.standard_normal((world, num, *p.shard_shape)).astype(np.float32) for p in lay.params]
    gspec = jax.tree.map(lambda _: P(AXIS), grads)

    def body(index, grads, bufs):
        g = jax.tree.map(lambda t: t[0], grads)
        b = [t[0] for t in bufs]
        h = _native.start_into(_ops.check_grads(g, lay, "test"), b, index, lay, backend)
        got = _native.done_into(h)
        shards = jax.tree_util.tree_leaves(tide_jax.reduce_scatter(g, lay, backend="jax"))
        want = [jax.lax.dynamic_update_index_in_dim(t, s, index, 0) for t, s in zip(b, shards)]
        return [t[None] for t in got], [t[None] for t in want]

    f = jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=(P(), gspec, [P(AXIS)] * len(bufs)),
                                   out_specs=([P(AXIS)] * len(bufs), [P(AXIS)] * len(bufs))))
    for index in (0, num - 1, 1, -2, num + 3):
        got, want = f(jnp.int32(index), grads, bufs)
        for k, (a, b, orig) in enumerate(zip(got, want, bufs)):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == orig.shape
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (world, dtype, index, k)
            slice_ = min(max(index + num if index < 0 else index, 0), num - 1)  # jax.lax's rule
            keep = [j for j in range(num) if j != slice_]
            assert np.array_equal(a[:, keep], orig[:, keep]), (world, index, k)


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_into_slices_equals_reduce_scatter_then_update(world, dtype):
    _check(world, dtype, seed=world * 10 + len(np.dtype(dtype).name))


def test_into_slices_world1_native(world1_native):
    _check(1, jnp.bfloat16, seed=7)


@pytest.mark.parametrize("world", [1, 3])
def test_into_slices_jax_backend_and_local(world):
    """The jax backend and world size 1 without native calls: the reduce-scatter, then the update."""
    _check(world, jnp.bfloat16, seed=11 + world, backend="jax")
    _check(world, jnp.float32, seed=13 + world, backend="tide")


def check_into_slices(mesh, seed):
    """`_check` on `mesh` (test_gpu.py runs it on GPUs), every gradient dtype."""
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        _check(mesh.devices.size, dtype, seed=seed, mesh=mesh)


def test_into_slices_refuses_a_wrong_buffer():
    mesh = make_mesh((2,), (AXIS,))
    lay = tide_jax.layout({"w": np.zeros((5, 3), np.float32)}, mesh, AXIS)

    def body(g, b):
        h = _native.start_into([g[0]], [b[0]], 0, lay, "tide")
        return _native.done_into(h)[0][None]

    f = jax.jit(tide_jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))
    with pytest.raises(ValueError, match=r"'w'.*float32\[L, 3, 3\]"):
        f(jnp.zeros((2, 5, 3), jnp.bfloat16), jnp.zeros((2, 4, 2, 3), jnp.float32))


def _loop_step(world, num_layers, remat, reshard, seed, mesh=None):
    from test_loop import AXIS as LAXIS, D, _one, layer_fn, model

    mesh = make_mesh((world,), (LAXIS,)) if mesh is None else mesh
    rng = np.random.default_rng(seed)
    stacked = model(rng, num_layers)
    lay = tide_jax.layout(_one(stacked), mesh, LAXIS)
    shards = lay.shard_stacked(stacked)
    x = jax.device_put(rng.standard_normal((2 * world, D)).astype(np.float32), NamedSharding(mesh, P(LAXIS)))
    specs = dict(mesh=mesh, in_specs=(lay.stacked_spec, P(LAXIS)), out_specs=(P(), (lay.stacked_spec, P(LAXIS))))

    def per_device(s, x):
        def loss(s, x):
            y = tide_jax.scan_layers(layer_fn, x, s, lay, prefetch=1, remat=remat, reshard_after_forward=reshard,
                                     dtype=jnp.bfloat16)
            return jnp.sum(y * y)

        v, g = jax.value_and_grad(loss, argnums=(0, 1))(s, x)
        return jax.lax.psum(v, LAXIS), g

    f = jax.jit(tide_jax.shard_map(per_device, **specs))
    return f, (shards, x)


def check_switch_same_bits(monkeypatch, var, on_target, off_target, world, num_layers, remat, reshard, mesh=None):
    """scan_layers' step with the switch `var` on (the HLO has `on_target` calls and no
    `off_target` ones) and off (the reverse) gives the same bits."""
    out = {}
    for value in ("1", "0"):
        monkeypatch.setenv(var, value)
        f, args = _loop_step(world, num_layers, remat, reshard, seed=world + num_layers, mesh=mesh)
        hlo = f.lower(*args).compile().as_text()
        n_on = len(re.findall(f'custom_call_target="{on_target}"', hlo))
        n_off = len(re.findall(f'custom_call_target="{off_target}"', hlo))
        if value == "1":
            assert n_on >= 1 and n_off == 0, (var, n_on, n_off)
        else:
            assert n_on == 0 and n_off >= 1, (var, n_on, n_off)
        out[value] = f(*args)
    for a, b in zip(jax.tree.leaves(out["1"]), jax.tree.leaves(out["0"])):
        assert np.array_equal(np.asarray(a), np.asarray(b)), var


def check_loop_same_bits(monkeypatch, world, num_layers, remat, reshard, mesh=None):
    check_switch_same_bits(monkeypatch, "TIDE_RS_INTO", "tide_reduce_scatter_into_start", "tide_reduce_scatter_start",
                           world, num_layers, remat, reshard, mesh)


@pytest.mark.parametrize("world,num_layers,remat,reshard", [(3, 5, "dots", True), (8, 2, None, False), (2, 1, True, True)])
def test_scan_layers_into_slices_same_bits(monkeypatch, world, num_layers, remat, reshard):
    """scan_layers writes each layer's gradient shards into the (L, ...) buffers in place (the HLO
    has the into calls and no plain reduce-scatter of the layers), with the same bits as a separate
    result and an update (TIDE_RS_INTO=0)."""
    check_loop_same_bits(monkeypatch, world, num_layers, remat, reshard)


def test_rs_into_setting_is_checked(monkeypatch):
    monkeypatch.setenv("TIDE_RS_INTO", "maybe")
    f, args = _loop_step(2, 2, None, True, seed=1)
    with pytest.raises(ValueError, match="TIDE_RS_INTO='maybe'"):
        f.lower(*args)


@pytest.mark.parametrize("into", ["1", "0"])
def test_only_the_last_reduce_scatter_is_urgent(monkeypatch, into):
    """scan_layers marks the backward's last reduce-scatter (layer 0's, which the update waits on)
    urgent, and no other: only it may take the whole GPU (src/call.rs `CallInfo::urgent`)."""
    monkeypatch.setenv("TIDE_RS_INTO", into)
    f, args = _loop_step(3, 5, "dots", True, seed=3)
    text = f.lower(*args).as_text()
    target = "tide_reduce_scatter_into_start" if into == "1" else "tide_reduce_scatter_start"
    calls = [line for line in text.splitlines() if f'"{target}"' in line or f"@{target}" in line]
    urgent = [c for c in calls if re.search(r"urgent = 1 : i64", c)]
    assert len(calls) >= 2 and len(urgent) == 1, (len(calls), len(urgent), calls[:2])
    assert all(re.search(r"urgent = [01] : i64", c) for c in calls)
    monkeypatch.setenv("TIDE_RS_URGENT", "0")  # the A/B switch: none urgent
    f, args = _loop_step(3, 5, "dots", True, seed=3)
    assert not re.search(r"urgent = 1 : i64", f.lower(*args).as_text())


def test_scan_unroll_ties_the_layers_of_an_iteration(monkeypatch):
    """With two layers per scan iteration each layer's reads are tied to the previous layer's work
    (`_Loop.after` / `read_after`: an i32 index through an optimization barrier with the carry or its
    cotangent): the forward's and the backward's prefetch starts, and the backward's reads of saved
    residuals (else XLA recomputes the second layer's activations beside the first's backward: 1b on
    the H200 held +0.76 GiB instead of +0.50 over plain JAX). The layers unrolled around the scan
    are tied too: layer 0 reads the stacks at a tied index (no static slice of a stack: XLA had fused
    its recompute into layer 1's and hoisted its rope work above the loss). With one per iteration
    none is needed."""
    tie = re.compile(r"stablehlo.optimization_barrier %\S+, %\S+ : tensor<i32>, ")
    # L = 7, prefetch 1: the forward scans layers 0-5 (stacks of 6), layer 6 runs after the scan
    stack_slice = re.compile(r"stablehlo.slice %\S+ \[[^\]]*\] : \(tensor<6x")
    counts, slices = {}, {}
    for unroll in ("1", "2"):
        monkeypatch.setenv("TIDE_SCAN_UNROLL", unroll)
        f, args = _loop_step(3, 7, "dots", True, seed=1)
        text = f.lower(*args).as_text()
        counts[unroll] = len(tie.findall(text))
        slices[unroll] = len(stack_slice.findall(text))
    assert counts["1"] == 0 and counts["2"] >= 4, counts
    assert slices["1"] >= 1 and slices["2"] == 0, slices
    # The local loop (world 1 without native calls: nothing carried from one layer's calls to the
    # next) scans one layer per iteration whatever the setting: the program is the same.
    text = {}
    for unroll in ("1", "2"):
        monkeypatch.setenv("TIDE_SCAN_UNROLL", unroll)
        f, args = _loop_step(1, 7, "dots", True, seed=1)
        text[unroll] = f.lower(*args).as_text()
    assert text["1"] == text["2"]


def _prevent_cse_flags(jaxpr, out):
    """The prevent_cse parameter of every checkpoint (remat) equation in `jaxpr`, nested included."""
    for e in jaxpr.eqns:
        if "prevent_cse" in e.params:
            out.append(bool(e.params["prevent_cse"]))
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _prevent_cse_flags(inner, out)
    return out


@pytest.mark.parametrize("unroll", ["1", "2"])
def test_layers_outside_the_scan_recompute_apart_from_their_forward(monkeypatch, unroll):
    """The layers run outside the scan (here layer 4, and with two per iteration none else: L = 5,
    prefetch 1) are straight-line code beside their backward: their recompute is guarded by
    prevent_cse (else XLA merges it with the forward and keeps the forward's activations alive: 1b on
    the H200 held two layers' `silu(gate) * up` and attention outputs across the loss). The scanned
    layers' recompute is not (different loops; a barrier would materialize each stack slice), and
    with no policy nothing is recomputed, so nothing is guarded."""
    monkeypatch.setenv("TIDE_SCAN_UNROLL", unroll)
    f, args = _loop_step(3, 5, "dots", True, seed=1)
    flags = _prevent_cse_flags(jax.make_jaxpr(f)(*args).jaxpr, [])
    assert True in flags and False in flags, flags
    f, args = _loop_step(3, 5, None, True, seed=1)
    assert _prevent_cse_flags(jax.make_jaxpr(f)(*args).jaxpr, []) == []


@pytest.mark.parametrize("world,num_layers,remat,reshard", [(3, 7, "dots", True), (2, 6, None, False), (8, 4, True, True)])
def test_scan_unroll_same_bits(monkeypatch, world, num_layers, remat, reshard):
    """Two layers per scan iteration (TIDE_SCAN_UNROLL=2, the default: no copy of each prefetched
    gather into the loop's buffer) gives the bits of one per iteration, for odd and even loop lengths."""
    out = {}
    for unroll in ("1", "2", "3"):
        monkeypatch.setenv("TIDE_SCAN_UNROLL", unroll)
        f, args = _loop_step(world, num_layers, remat, reshard, seed=world * num_layers)
        out[unroll] = f(*args)
    for u in ("2", "3"):
        for a, b in zip(jax.tree.leaves(out[u]), jax.tree.leaves(out["1"])):
            assert np.array_equal(np.asarray(a), np.asarray(b)), u
    monkeypatch.setenv("TIDE_SCAN_UNROLL", "0")
    f, args = _loop_step(2, 3, None, True, seed=1)
    with pytest.raises(ValueError, match="TIDE_SCAN_UNROLL='0'"):
        f.lower(*args)
