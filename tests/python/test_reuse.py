"""One traced call site, many calls (issue #8.1), start/done and the layer loop (issue #9).

A jitted layer helper called for every layer puts one `site` attribute on many HLO instructions,
which XLA:CPU runs in different orders on different devices. tide keys calls by (site, instance)
(docs/design.md "Call sites and instances"), so every layer's collective meets its own peers. Each
test compares the tide backend with the pure-JAX twin on fresh random data, forward and backward.

This file is also a multi-process worker: `python test_reuse.py worker --out DIR` (under
`python -m tide_jax.launch`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
AXIS = "fsdp"


def _layer(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]) * p["g"]


def _model_data(rng, num_layers, d, batch):
    stacked = {
        "w": (rng.standard_normal((num_layers, d, d)) / np.sqrt(d)).astype(np.float32),
        "b": (0.1 * rng.standard_normal((num_layers, d))).astype(np.float32),
        "g": (1.0 + 0.1 * rng.standard_normal((num_layers,))).astype(np.float32),
    }
    x = rng.standard_normal((batch, d)).astype(np.float32)
    return stacked, x


def reused_helper_step(mesh, lay_layer, num_layers, backend, remat):
    """A jitted per-layer helper called once per layer: every layer's gather shares one trace."""
    import tide_jax

    @jax.jit
    def layer(shards, x):
        p = tide_jax.gather_params(shards, lay_layer, dtype=jnp.float32, backend=backend)
        return _layer(p, x)

    if remat:
        layer = jax.checkpoint(layer)

    def step(all_shards, x):
        def loss(all_shards):
            h = x
            for i in range(num_layers):
                h = layer(all_shards[i], h)
            return jnp.sum(h * h)

        value, grads = jax.value_and_grad(loss)(all_shards)
        return jax.lax.psum(value, AXIS), grads

    return step


def scan_step(lay_layer, backend, prefetch, remat):
    import tide_jax

    def step(stacked, x):
        def loss(stacked, x):
            y = tide_jax.scan_layers(_layer, x, stacked, lay_layer, prefetch=prefetch, remat=remat,
                                     dtype=jnp.float32, backend=backend)
            return jnp.sum(y * y)

        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(stacked, x)
        return jax.lax.psum(value, AXIS), grads

    return step


def _fetch(tree):
    """Host copies of (possibly multi-process) global arrays."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def _max_err(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def run_reused(mesh, num_layers, d, remat, seeds):
    """Loss and gradients of the reused-helper model on both backends, for each seed."""
    import tide_jax

    one = {"w": np.zeros((d, d), np.float32), "b": np.zeros((d,), np.float32), "g": np.float32(1)}
    lay_layer = tide_jax.layout(one, mesh, AXIS)
    lay_all = tide_jax.layout([one] * num_layers, mesh, AXIS)
    results = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        stacked, x = _model_data(rng, num_layers, d, batch=2 * lay_all.world)
        params = [{k: v[i] for k, v in stacked.items()} for i in range(num_layers)]
        shards = lay_all.shard(params)
        xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
        out = {}
        for backend in ("tide", "jax"):
            step = reused_helper_step(mesh, lay_layer, num_layers, backend, remat)
            f = jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay_all.spec, P(AXIS)),
                                           out_specs=(P(), lay_all.spec)))
            out[backend] = _fetch(f(shards, xs))
        results.append(out)
    return results


# ----- in-process -----
@pytest.mark.parametrize("remat", [False, True])
def test_reused_jitted_layer_helper_16_layers(remat):
    """The report's case: 16 same-shaped layers through one jitted helper, several steps."""
    from conftest import make_mesh

    mesh = make_mesh((8,), (AXIS,))
    for out in run_reused(mesh, num_layers=16, d=32, remat=remat, seeds=[1, 2, 3]):
        (lt, gt), (lj, gj) = out["tide"], out["jax"]
        assert abs(float(lt) - float(lj)) <= 1e-4 * abs(float(lj)), (lt, lj)
        assert _max_err(gt, gj) < 1e-4, _max_err(gt, gj)


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("prefetch,remat", [(1, False), (1, True), (2, True), (0, False)])
def test_scan_layers_matches_the_loop_and_the_jax_backend(world, prefetch, remat):
    """scan_layers (16 layers, odd shapes) equals the plain loop of gather_params, both backends."""
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((world,), (AXIS,))
    num_layers, d = 16, 7  # 7 rows: uneven over 3 and 8 ranks
    rng = np.random.default_rng(100 + world + 10 * prefetch + remat)
    stacked, x = _model_data(rng, num_layers, d, batch=2 * world)
    one = {k: v[0] for k, v in stacked.items()}
    lay = tide_jax.layout(one, mesh, AXIS)
    shards = lay.shard_stacked(stacked)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(lay.unshard_stacked(shards)),
                                                   jax.tree.leaves(stacked)))
    xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    specs = dict(mesh=mesh, in_specs=(lay.stacked_spec, P(AXIS)), out_specs=(P(), (lay.stacked_spec, P(AXIS))))

    def loop_step(stacked, x):
        def loss(stacked, x):
            h = x
            for i in range(num_layers):
                p = tide_jax.gather_params(jax.tree.map(lambda t: t[i], stacked), lay, jnp.float32, backend="jax")
                h = _layer(p, h)
            return jnp.sum(h * h)

        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(stacked, x)
        return jax.lax.psum(value, AXIS), grads

    want = jax.jit(tide_jax.shard_map(loop_step, **specs))(shards, xs)
    for backend in ("tide", "jax"):
        got = jax.jit(tide_jax.shard_map(scan_step(lay, backend, prefetch, remat), **specs))(shards, xs)
        assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0])), (backend, got[0], want[0])
        assert _max_err(got[1], want[1]) < 1e-4, (backend, _max_err(got[1], want[1]))


def test_scan_layers_bf16_closure_and_unroll():
    """bf16 gathers, a layer_fn closing over a traced scale (its gradient summed over layers), L=1
    and L=5 with unroll: equal to the jax backend to bf16 rounding."""
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((3,), (AXIS,))
    for num_layers, unroll in ((1, False), (5, True)):
        rng = np.random.default_rng(num_layers)
        stacked, x = _model_data(rng, num_layers, 6, batch=6)
        lay = tide_jax.layout({k: v[0] for k, v in stacked.items()}, mesh, AXIS)
        shards = lay.shard_stacked(stacked)
        xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
        scale = jnp.float32(0.7)

        def step(stacked, x, scale, backend):
            def loss(stacked, scale):
                fn = lambda p, h: _layer(p, h.astype(jnp.bfloat16)).astype(jnp.float32) * scale  # noqa: E731
                y = tide_jax.scan_layers(fn, x, stacked, lay, backend=backend, unroll=unroll)
                return jnp.sum(y * y)

            value, grads = jax.value_and_grad(loss, argnums=(0, 1))(stacked, scale)
            return jax.lax.psum(value, AXIS), grads[0], jax.lax.psum(grads[1], AXIS)

        outs = {}
        for backend in ("tide", "jax"):
            f = jax.jit(tide_jax.shard_map(lambda s, x, c, b=backend: step(s, x, c, b), mesh=mesh,
                                           in_specs=(lay.stacked_spec, P(AXIS), P()),
                                           out_specs=(P(), lay.stacked_spec, P())))
            outs[backend] = jax.device_get(f(shards, xs, scale))
        assert _max_err(outs["tide"], outs["jax"]) < 2e-2 * max(1.0, abs(float(outs["jax"][0])))


def test_vmapped_gather_params_over_layers():
    """gather_params vmapped over a stack of 6 layers (each call of the batch shares one site; they
    run one after another): forward and backward equal the jax backend."""
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((4,), (AXIS,))
    rng = np.random.default_rng(9)
    lay = tide_jax.layout({"w": np.zeros((9, 5), np.float32)}, mesh, AXIS)
    shards = lay.shard_stacked({"w": rng.standard_normal((6, 9, 5)).astype(np.float32)})
    x = jax.device_put(rng.standard_normal((8, 9)).astype(np.float32), NamedSharding(mesh, P(AXIS)))

    def make(backend):
        def step(s, x):
            def loss(s):
                ps = jax.vmap(lambda t: tide_jax.gather_params(t, lay, jnp.float32, backend=backend))(s)
                return jnp.sum(jnp.tanh(x @ ps["w"]) ** 2)

            value, grads = jax.value_and_grad(loss)(s)
            return jax.lax.psum(value, AXIS), grads

        return jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.stacked_spec, P(AXIS)),
                                          out_specs=(P(), lay.stacked_spec)))

    got, want = jax.device_get(make("tide")(shards, x)), jax.device_get(make("jax")(shards, x))
    assert _max_err(got, want) < 1e-4 * max(1.0, abs(float(want[0])))


def test_start_done_four_in_flight_equal_the_synchronous_ops():
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((3,), (AXIS,))
    rng = np.random.default_rng(7)
    params = {"a": rng.standard_normal((7, 5)).astype(np.float32), "b": rng.standard_normal((2,)).astype(np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    shards = lay.shard(params)
    grads_full = jax.device_put(rng.standard_normal((3, 7, 5)).astype(np.float32).astype(jnp.bfloat16),
                                NamedSharding(mesh, P(AXIS)))

    def f(s, g):
        g = g[0]
        grads = {"a": g, "b": g[0, :2]}
        grads2 = {"a": g * 2, "b": g[1, :2]}
        h1 = tide_jax.all_gather_start(s, lay)
        h2 = tide_jax.all_gather_start(s, lay, dtype=jnp.bfloat16)
        h3 = tide_jax.reduce_scatter_start(grads, lay)
        h4 = tide_jax.reduce_scatter_start(grads2, lay)
        y = jnp.sin(s["a"]).sum()
        h1, h2, h3, h4, y = tide_jax.ordered(h1, h2, h3, h4, y)
        got = (tide_jax.all_gather_done(h1), tide_jax.all_gather_done(h2),
               tide_jax.reduce_scatter_done(h3), tide_jax.reduce_scatter_done(h4, dtype=jnp.bfloat16))
        want = (tide_jax.all_gather(s, lay), tide_jax.all_gather(s, lay, jnp.bfloat16),
                tide_jax.reduce_scatter(grads, lay), tide_jax.reduce_scatter(grads2, lay, jnp.bfloat16))
        twin = (tide_jax.reference.all_gather(s, lay), None, tide_jax.reference.reduce_scatter(grads, lay), None)
        full = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731
        return (full(got[0]), full(got[1]), got[2], got[3]), (full(want[0]), full(want[1]), want[2], want[3]), \
            (full(twin[0]), twin[2], y[None])

    spec_full = {"a": P(AXIS), "b": P(AXIS)}
    out_specs = ((spec_full, spec_full, lay.spec, lay.spec), (spec_full, spec_full, lay.spec, lay.spec),
                 (spec_full, lay.spec, P(AXIS)))
    got, want, twin = jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=(lay.spec, P(AXIS)), out_specs=out_specs,
                                                 check_vma=False))(shards, grads_full)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(twin[0])))
    assert _max_err(got[2], twin[1]) < 1e-5


def test_start_done_misuse_raises_at_once():
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((2,), (AXIS,))
    params = {"a": np.ones((4, 3), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    shards = lay.shard(params)

    def wrong_op(s):
        h = tide_jax.all_gather_start(s, lay)
        return tide_jax.reduce_scatter_done(h)["a"]

    with pytest.raises(ValueError, match="all_gather_start"):
        jax.jit(tide_jax.shard_map(wrong_op, mesh=mesh, in_specs=(lay.spec,), out_specs=P(AXIS)))(shards)
    with pytest.raises(TypeError, match="Handle"):
        tide_jax.all_gather_done({"a": 1})

    # done without its start, called through jax.ffi directly: a clear error, no hang.
    from tide_jax import _native

    def orphan_done(s):
        x = s["a"] + 1.0
        full = jnp.zeros((4, 3), jnp.float32) + x.sum()
        return jax.ffi.ffi_call("tide_all_gather_done", [jax.ShapeDtypeStruct((4, 3), jnp.float32)],
                                input_output_aliases={0: 0})(full, x, **_native.call_attrs(lay, 999_999))[0][None]

    from tide_jax import _lib

    _lib.ensure_registered("cpu")
    with pytest.raises(Exception, match="no matching start"):
        np.asarray(jax.jit(tide_jax.shard_map(orphan_done, mesh=mesh, in_specs=(lay.spec,), out_specs=P(AXIS),
                                              check_vma=False))(shards))


def assert_start_compute_done(text: str) -> None:
    """Some computation of `text` (a loop body) holds, in this order: an all-gather start (directly,
    or inside a fusion or async wrapper it calls), a matmul, and the all-gather done."""
    comps = {}
    for block in text.split("\n\n"):
        head = block.lstrip().split(" ", 1)[0]
        comps[head.lstrip("%")] = block

    def holds(block, target, depth=0):
        if f'custom_call_target="{target}"' in block:
            return True
        if depth > 3:
            return False
        import re

        return any(holds(comps.get(c, ""), target, depth + 1)
                   for c in re.findall(r"(?:calls|to_apply|async_execution_thread=\"\w+\", calls)=%([\w.\-]+)", block))

    def line_holds(line, target):
        import re

        if f'custom_call_target="{target}"' in line:
            return True
        m = re.search(r"calls=%([\w.\-]+)", line)
        return bool(m) and holds(comps.get(m.group(1), ""), target)

    def is_matmul(line):
        return any(k in line for k in (" dot(", "gemm_fusion", "__cublas", "cublas", "triton_gemm", "ynn_fusion"))

    found = False
    for block in comps.values():
        lines = block.splitlines()[1:]
        starts = [i for i, l in enumerate(lines) if line_holds(l, "tide_all_gather_start")]
        dones = [i for i, l in enumerate(lines) if line_holds(l, "tide_all_gather_done")]
        dots = [i for i, l in enumerate(lines) if is_matmul(l)]
        if any(s < d < e for s in starts for d in dots for e in dones):
            found = True
    assert found, "no computation orders a gather start -> matmul -> done"


# ----- multi-process (the launcher: 2 processes x 2 CPU devices) -----
def worker(out_dir: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import tide_jax

    tide_jax.initialize()
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    worst = 0.0
    for remat in (False, True):
        for out in run_reused(mesh, num_layers=16, d=16, remat=remat, seeds=[11, 12]):
            (lt, gt), (lj, gj) = out["tide"], out["jax"]
            assert abs(float(lt) - float(lj)) <= 1e-4 * abs(float(lj)), (lt, lj)
            worst = max(worst, _max_err(gt, gj))
    assert worst < 1e-4, worst
    # The layer loop across processes: start/done of one instruction in flight in consecutive loop
    # iterations, ordered on each lane by its ticket (src/ffi/cpu.rs).
    one = {"w": np.zeros((7, 7), np.float32), "b": np.zeros((7,), np.float32), "g": np.float32(1)}
    lay = tide_jax.layout(one, mesh, AXIS)
    stacked, x = _model_data(np.random.default_rng(21), 16, 7, batch=2 * lay.world)
    shards = lay.shard_stacked(stacked)
    xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    specs = dict(mesh=mesh, in_specs=(lay.stacked_spec, P(AXIS)), out_specs=(P(), (lay.stacked_spec, P(AXIS))))
    for prefetch, remat in ((1, False), (2, True)):
        got, want = (_fetch(jax.jit(tide_jax.shard_map(scan_step(lay, b, prefetch, remat), **specs))(shards, xs))
                     for b in ("tide", "jax"))
        err = _max_err(got, want)
        assert err < 1e-4 * max(1.0, abs(float(want[0]))), (prefetch, remat, err)
        worst = max(worst, err)
    print(f"rank {jax.process_index()}: reuse ok (worst {worst:.2e})", flush=True)


def test_reused_helper_and_layer_loop_multiprocess():
    from conftest import subprocess_pythonpath  # here: this file also runs as a worker, without pytest

    env = dict(os.environ)
    env["PYTHONPATH"] = subprocess_pythonpath(env)
    for k in ("XLA_FLAGS", "JAX_PLATFORMS"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "2", "--cpu-devices", "2", "--",
           sys.executable, os.path.abspath(__file__), "worker", "--out", "unused"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count("reuse ok") == 2, r.stdout[-4000:]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(sys.argv[3] if len(sys.argv) > 3 else "")


@pytest.mark.parametrize("tie", [True, False])
def test_start_done_in_a_loop_over_invariant_shards(tie):
    """README's overlap recipe (start, ordered, compute, ordered, done) in a lax.scan body whose
    shards are the same in every iteration (gradient accumulation: the parameters re-gathered per
    microbatch). XLA hoists such a start out of the loop, and the done kept in the loop by `ordered`
    would get a copy of its results: with the shards tied to the carry first (the README's fix) the
    result equals the jax backend's; without, it is right or fails naming that fix, never wrong."""
    import tide_jax
    from conftest import make_mesh

    mesh = make_mesh((3,), (AXIS,))
    rng = np.random.default_rng(8)
    params = {"w": rng.standard_normal((7, 2)).astype(np.float32), "b": rng.standard_normal((5,)).astype(np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    xs = rng.standard_normal((4, 3)).astype(np.float32)

    def run(backend):
        def f(s, xs):
            def body(c, x):
                if tie:
                    s_, c = tide_jax.ordered(s, c)
                else:
                    s_ = s
                h = tide_jax.all_gather_start(s_, lay, backend=backend)
                h, c = tide_jax.ordered(h, c)
                c = c * 0.5 + x.sum()  # the microbatch's compute, beside the gather
                h, c = tide_jax.ordered(h, c)
                full = tide_jax.all_gather_done(h)
                return c + full["w"].sum() * x[0] + full["b"][1:].sum(), None

            c0 = jax.lax.pcast(jnp.float32(0.0), AXIS, to="varying")
            return jax.lax.scan(body, c0, xs)[0][None]

        g = jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=(lay.spec, P()), out_specs=P(AXIS)))
        return np.asarray(g(lay.shard(params), xs))

    want = run("jax")
    try:
        got = run("tide")
    except Exception as e:  # the untied form, hoisted by XLA: the error names the fix
        assert not tie, e
        assert "hoists a start whose operands are the same in every iteration" in str(e), e
        assert "tide_jax.ordered(shards, carry)" in str(e), e
        return
    np.testing.assert_array_equal(got, want)
