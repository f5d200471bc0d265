"""GPU tests of tide's CUDA engine (issue #3), on 1 and 2 GPUs of one process.

Marked `gpu`; skipped where JAX has no GPU backend or fewer GPUs than a test needs. Run on the GPU
machine by `scripts/gpu run OUT pytest`:  python3 -m pytest tests/python/test_gpu.py -m gpu
Every test draws fresh random data (its seed is printed, so a failure can be replayed with
TIDE_TEST_SEED=<seed>).

What is checked, against an oracle independent of tide where possible:
  - all_gather: byte-exact vs jax.lax.all_gather of the same padded shards, and vs the host parameters,
    on every device's copy;
  - reduce_scatter: within fp32 rounding of an fp64 numpy sum (elementwise bound), and far below the
    error of JAX's bf16 psum_scatter on the same data;
  - odd shapes: 7 rows, 1-D, 0-d, 3-D, rows < P;
  - 200 iterations of all_gather + reduce_scatter inside one jitted lax.scan, run twice: bitwise equal
    (a race shows up as a difference), and close to the pure-JAX twin;
  - gather_params gradients equal tide_jax.reference's and the fp64 expectation.
"""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

AXIS = "fsdp"


def _gpus():
    """JAX's GPU devices. TIDE_GPU_TESTS_ON_CPU=1 runs these tests on CPU devices instead: only for
    checking the tests' own logic on a machine without a GPU (tide's CPU engine does the work then)."""
    try:
        import jax
        if os.environ.get("TIDE_GPU_TESTS_ON_CPU") == "1":
            return jax.devices("cpu")
        return jax.devices("gpu")
    except Exception:
        return []


def _need(n):
    devs = _gpus()
    if len(devs) < n:
        pytest.skip(f"needs {n} GPU(s) through JAX, found {len(devs)}")
    return devs[:n]


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("TIDE_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.name}: seed {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(scope="module")
def tide():
    if not _gpus():
        if os.environ.get("TIDE_REQUIRE_GPU") == "1":  # set by scripts/gpu: skipping would hide it
            pytest.fail("TIDE_REQUIRE_GPU=1 but JAX has no GPU backend")
        pytest.skip("no GPU backend in JAX")
    import tide_jax
    print(f"tide_jax from {tide_jax.__file__}, library {tide_jax.library_path()}")  # raises if none
    if hasattr(tide_jax, "set_backend"):
        tide_jax.set_backend("tide")  # the native library, whatever TIDE_BACKEND says
    return tide_jax


# ----------------------------------------------------------------------------------------------- helpers

def _mesh(devs):
    from jax.sharding import Mesh
    return Mesh(np.array(devs), (AXIS,))


def _smap(mesh, f, in_specs, out_specs):
    import jax
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    try:
        return jax.jit(shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    except TypeError:
        return jax.jit(shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False))


def _rows(shape):
    return 1 if len(shape) == 0 else shape[0]


def _shard_rows(shape, world):
    return -(-_rows(shape) // world)


def _pad(x, world):
    """FSDP2 dim-0 layout of the whole parameter: 0-d as one row, rows zero-padded to world*shard_rows."""
    x = np.asarray(x)
    x2 = x.reshape((1,)) if x.ndim == 0 else x
    sr = _shard_rows(x.shape, world)
    out = np.zeros((world * sr,) + x2.shape[1:], x2.dtype)
    out[:x2.shape[0]] = x2
    return out


def _bits(x):
    """Raw bytes of an array (bf16 included) as an unsigned-integer view, for byte-exact comparison."""
    x = np.ascontiguousarray(np.asarray(x))
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def _random(rng, shape, dtype):
    import jax.numpy as jnp
    return np.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(jnp.dtype(dtype))


def _params(rng, shapes, dtype):
    return {k: _random(rng, s, dtype) for k, s in shapes.items()}


def _stacked(rng, shapes, world, dtype, mesh):
    """Per-device full gradients: host (world, *shape) arrays and the device arrays sharded on dim 0."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    host = {k: _random(rng, (world,) + tuple(s), dtype) for k, s in shapes.items()}
    dev = {k: jax.device_put(v, NamedSharding(mesh, P(AXIS))) for k, v in host.items()}
    return host, dev


ODD_SHAPES = {"rows7": (7, 33), "vec": (13,), "scalar": (), "cube": (5, 3, 4), "one_row": (1, 16),
              "tall": (1031, 3)}
LLAMA_1664 = {"q": (1664, 1664), "k": (208, 1664), "v": (208, 1664), "o": (1664, 1664),
              "gate": (5824, 1664), "up": (5824, 1664), "down": (1664, 5824), "norm1": (1664,), "norm2": (1664,)}
GROUPS = {"odd": ODD_SHAPES, "llama_h1664": LLAMA_1664}


def _all_gather_both(tide, mesh, params, world):
    """tide's and jax.lax.all_gather's full parameters, every device's copy: {name: (world, *shape)}."""
    import jax
    from jax.sharding import PartitionSpec as P
    lay = tide.layout(params, mesh, AXIS)
    shards = lay.shard(params)
    stack_spec = {k: P(AXIS) for k in params}

    def f_tide(s):
        full = tide.all_gather(s, lay)
        return {k: v[None] for k, v in full.items()}

    def f_jax(s):
        out = {}
        for k, v in s.items():
            g = jax.lax.all_gather(v, AXIS, axis=0, tiled=True)
            shape = params[k].shape
            out[k] = g[:_rows(shape)].reshape(shape)[None]
        return out

    got = _smap(mesh, f_tide, (lay.spec,), stack_spec)(shards)
    ref = _smap(mesh, f_jax, (lay.spec,), stack_spec)(shards)
    return lay, shards, jax.device_get(got), jax.device_get(ref)


# ----------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_all_gather_byte_exact(tide, rng, n, group, dtype):
    import jax
    devs = _need(n)
    mesh = _mesh(devs)
    params = _params(rng, GROUPS[group], dtype)
    lay, shards, got, ref = _all_gather_both(tide, mesh, params, n)
    host_shards = jax.device_get(shards)
    for k, p in params.items():
        assert np.array_equal(_bits(host_shards[k]), _bits(_pad(p, n))), \
            f"{k}: lay.shard does not hold the zero-padded dim-0 layout (shape {p.shape}, P={n})"
        assert got[k].shape == (n,) + p.shape, f"{k}: tide all_gather shape {got[k].shape[1:]} != {p.shape}"
        assert got[k].dtype == p.dtype, f"{k}: dtype {got[k].dtype} != {p.dtype}"
        for d in range(n):
            assert np.array_equal(_bits(got[k][d]), _bits(ref[k][d])), \
                f"{k} {p.shape} on device {d}: tide all_gather differs from jax.lax.all_gather"
            assert np.array_equal(_bits(got[k][d]), _bits(p)), f"{k} on device {d}: differs from the parameter"


def _reduce_scatter_both(tide, mesh, grads_dev, shapes, world, lay):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    gspec = {k: P(AXIS) for k in shapes}

    def f_tide(g):
        return tide.reduce_scatter({k: v[0] for k, v in g.items()}, lay)

    def f_bf16(g):
        out = {}
        for k, v in g.items():
            x = v[0].reshape((1,)) if v[0].ndim == 0 else v[0]
            sr = _shard_rows(shapes[k], world)
            x = jnp.concatenate([x, jnp.zeros((world * sr - x.shape[0],) + x.shape[1:], x.dtype)])
            out[k] = jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
        return out

    got = _smap(mesh, f_tide, (gspec,), lay.spec)(grads_dev)
    bf16 = _smap(mesh, f_bf16, (gspec,), gspec)(grads_dev)
    return jax.device_get(got), jax.device_get(bf16)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_reduce_scatter_fp32_accuracy(tide, rng, n, group):
    devs = _need(n)
    mesh = _mesh(devs)
    shapes = GROUPS[group]
    params = _params(rng, shapes, "bfloat16")
    lay = tide.layout(params, mesh, AXIS)
    host, dev = _stacked(rng, shapes, n, "bfloat16", mesh)
    got, bf16 = _reduce_scatter_both(tide, mesh, dev, shapes, n, lay)
    worst_tide, worst_bf16 = 0.0, 0.0
    for k, s in shapes.items():
        g64 = host[k].astype(np.float64)
        exact = _pad(g64.sum(0), n)
        absum = _pad(np.abs(g64).sum(0), n)
        out = np.asarray(got[k])
        assert out.dtype == np.float32, f"{k}: reduce_scatter must return fp32 shards, got {out.dtype}"
        assert out.shape == exact.shape, f"{k} {s}: global result {out.shape}, expected {exact.shape}"
        assert np.all(np.isfinite(out)), f"{k}: non-finite values (unwritten or garbage output?)"
        # fp32 summation of n terms: |error| <= n * 2^-24 * sum|g| elementwise (padding rows exactly 0)
        bound = n * 2.0 ** -24 * absum
        err = np.abs(out.astype(np.float64) - exact)
        bad = err > bound
        assert not bad.any(), (f"{k} {s}: {int(bad.sum())} elements beyond fp32 rounding, worst "
                               f"{float(err.max()):.3e} at {np.unravel_index(int(err.argmax()), err.shape)}")
        den = np.linalg.norm(exact) or 1.0
        worst_tide = max(worst_tide, float(np.linalg.norm(out - exact)) / den)
        worst_bf16 = max(worst_bf16, float(np.linalg.norm(np.asarray(bf16[k], np.float64) - exact)) / den)
    print(f"relative error: tide {worst_tide:.3e}, JAX bf16 psum_scatter {worst_bf16:.3e} (P={n})")
    assert worst_tide < 1e-6
    if n > 1:
        assert worst_bf16 > 1e-4, "expected JAX's bf16 reduction to be lossy on random data"
        assert worst_tide < worst_bf16 / 100, f"tide {worst_tide:.3e} not far below bf16 {worst_bf16:.3e}"


@pytest.mark.parametrize("n", [1, 2])
def test_odd_shapes_rows_below_world(tide, rng, n):
    """Parameters with at most 2 rows: on 2 GPUs some ranks hold only padding."""
    devs = _need(n)
    mesh = _mesh(devs)
    shapes = {"one": (1, 5), "scalar": (), "vec1": (1,), "two": (2, 3)}
    params = _params(rng, shapes, "bfloat16")
    lay, _, got, ref = _all_gather_both(tide, mesh, params, n)
    for k, p in params.items():
        for d in range(n):
            assert np.array_equal(_bits(got[k][d]), _bits(p)), f"{k} on device {d}"
    host, dev = _stacked(rng, shapes, n, "bfloat16", mesh)
    rs, _ = _reduce_scatter_both(tide, mesh, dev, shapes, n, lay)
    for k, s in shapes.items():
        exact = _pad(host[k].astype(np.float64).sum(0), n)
        np.testing.assert_allclose(np.asarray(rs[k], np.float64), exact, rtol=1e-6, atol=0, err_msg=k)


SCAN_SHAPES = {"w": (1024, 1000), "rows7": (7, 33), "scalar": (), "cube": (5, 3, 4), "vec": (999,)}


def _scan_program(mod, mesh, lay, shapes, world, steps):
    """`steps` iterations of all_gather -> per-device gradient -> reduce_scatter -> new shards, in one
    jitted lax.scan. The map is contractive (errors do not grow) yet changes the values every step, so
    a read of a stale or half-written buffer changes the result."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    scale = float(sum(range(1, world + 1)))

    def local(shards, base):
        rank = jax.lax.axis_index(AXIS).astype(jnp.float32)

        def body(carry, t):
            s, acc = carry
            full = mod.all_gather(s, lay)
            tf = t.astype(jnp.float32)
            grads = {k: (v.astype(jnp.float32) * (1.0 + rank) + 0.01 * tf).astype(jnp.bfloat16)
                     for k, v in full.items()}
            red = mod.reduce_scatter(grads, lay)
            new = {k: (0.5 * red[k] / scale + 0.5 * base[k] * jnp.cos(0.1 * tf + 1.0)).astype(jnp.bfloat16)
                   for k in red}
            acc = acc + sum(jnp.sum(v.astype(jnp.float32)) for v in full.values())
            return (new, acc), None

        (s, acc), _ = jax.lax.scan(body, (shards, jnp.zeros((), jnp.float32)), jnp.arange(steps))
        return s, acc[None]

    return _smap(mesh, local, (lay.spec, lay.spec), (lay.spec, P(AXIS)))


@pytest.mark.parametrize("n", [1, 2])
def test_scan_200_iterations_bitwise_stable(tide, rng, n):
    import jax
    devs = _need(n)
    mesh = _mesh(devs)
    params = _params(rng, SCAN_SHAPES, "bfloat16")
    lay = tide.layout(params, mesh, AXIS)
    shards = lay.shard(params)
    from jax.sharding import NamedSharding, PartitionSpec as P
    base = {k: jax.device_put(_pad(_random(rng, s, "float32"), n), NamedSharding(mesh, P(AXIS)))
            for k, s in SCAN_SHAPES.items()}
    prog = _scan_program(tide, mesh, lay, SCAN_SHAPES, n, steps=200)
    a = jax.device_get(prog(shards, base))
    b = jax.device_get(prog(shards, base))
    for k in SCAN_SHAPES:
        assert np.array_equal(_bits(a[0][k]), _bits(b[0][k])), f"{k}: two runs of the same scan differ (race?)"
    assert np.array_equal(_bits(a[1]), _bits(b[1])), "checksums of the gathered parameters differ between runs"
    ref = jax.device_get(_scan_program(tide.reference, mesh, lay, SCAN_SHAPES, n, steps=200)(shards, base))
    for k in SCAN_SHAPES:
        x, y = np.asarray(a[0][k], np.float64), np.asarray(ref[0][k], np.float64)
        diff = np.abs(x - y)
        # bf16 results of a contractive map: allow one bf16 ulp of the larger value where fp32
        # rounding differs (2^-7 relative can fall just short of an ulp at a power-of-two boundary).
        # Races are caught above by the bitwise comparison of two runs.
        assert np.all(diff <= 2.0 ** -6 * np.maximum(np.abs(x), np.abs(y)) + 1e-6), \
            f"{k}: scan result differs from the pure-JAX twin by up to {float(diff.max()):.3e}"
    np.testing.assert_allclose(np.asarray(a[1], np.float64), np.asarray(ref[1], np.float64), rtol=1e-3)


@pytest.mark.parametrize("n", [1, 2])
def test_gather_params_gradients_match_reference(tide, rng, n):
    import jax
    import jax.numpy as jnp
    devs = _need(n)
    mesh = _mesh(devs)
    shapes = {**ODD_SHAPES, "w": (256, 96)}
    master = _params(rng, shapes, "float32")
    lay = tide.layout(master, mesh, AXIS)
    shards = lay.shard(master)
    xs_host, xs = _stacked(rng, shapes, n, "float32", mesh)
    from jax.sharding import PartitionSpec as P
    xspec = {k: P(AXIS) for k in shapes}

    def grads_with(mod):
        def local(s, x):
            def loss(s_):
                full = mod.gather_params(s_, lay, dtype=jnp.bfloat16)
                return sum(jnp.sum(full[k].astype(jnp.float32) * x[k][0]) for k in full)
            return jax.grad(loss)(s)
        return jax.device_get(_smap(mesh, local, (lay.spec, xspec), lay.spec)(shards, xs))

    got = grads_with(tide)
    ref = grads_with(tide.reference)
    for k, s in shapes.items():
        g, r = np.asarray(got[k]), np.asarray(ref[k])
        assert g.shape == r.shape and g.dtype == r.dtype, f"{k}: {g.shape}/{g.dtype} vs reference {r.shape}/{r.dtype}"
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7, err_msg=f"{k}: tide vs reference gradient")


@pytest.mark.parametrize("n", [1, 2])
def test_gather_params_gradients_accumulate_in_fp32(tide, rng, n):
    """The backward of gather_params is tide's bf16 -> fp32 reduce-scatter: fp64-exact up to fp32 rounding."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    devs = _need(n)
    mesh = _mesh(devs)
    shapes = {**ODD_SHAPES, "w": (256, 96)}
    lay = tide.layout(_params(rng, shapes, "float32"), mesh, AXIS)
    shards = lay.shard(_params(rng, shapes, "float32"))
    xs_host, xs = _stacked(rng, shapes, n, "float32", mesh)
    xspec = {k: P(AXIS) for k in shapes}

    def local(s, x):
        def loss(s_):
            full = tide.gather_params(s_, lay, dtype=jnp.bfloat16)
            return sum(jnp.sum(full[k].astype(jnp.float32) * x[k][0]) for k in full)
        return jax.grad(loss)(s)

    got = jax.device_get(_smap(mesh, local, (lay.spec, xspec), lay.spec)(shards, xs))
    for k in shapes:
        g = np.asarray(got[k])
        # the cotangent of each device's bf16 parameter is its x cast to bf16; summed over devices in fp32
        cot = xs_host[k].astype(jnp.bfloat16).astype(np.float64).sum(0)
        exact = _pad(cot, n)
        err = np.linalg.norm(g.astype(np.float64) - exact) / (np.linalg.norm(exact) or 1.0)
        assert err < 1e-5, f"{k}: gradient relative error {err:.3e} vs the fp64 expectation"


# ----- start/done and the layer loop on GPUs (issue #9) -----
def _scan_setup(devs, num_layers, d, seed):
    import jax
    import tide_jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import test_reuse as R

    mesh = Mesh(np.array(devs), (AXIS,))
    stacked, x = R._model_data(np.random.default_rng(seed), num_layers, d, batch=8 * len(devs))
    lay = tide_jax.layout({k: v[0] for k, v in stacked.items()}, mesh, AXIS)
    shards = lay.shard_stacked(stacked)
    xs = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    specs = dict(mesh=mesh, in_specs=(lay.stacked_spec, P(AXIS)), out_specs=(P(), (lay.stacked_spec, P(AXIS))))
    return R, lay, shards, xs, specs


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("prefetch,remat", [(1, False), (2, True)])
def test_scan_layers_gpu_matches_jax_backend(ngpu, prefetch, remat):
    """The layer loop with start/done on GPUs (2 gathers in flight with prefetch=2) equals the
    pure-JAX twin; run twice, bitwise equal (a race would differ)."""
    import jax
    import tide_jax

    R, lay, shards, xs, specs = _scan_setup(_need(ngpu), 12, 96, 5 + ngpu + prefetch)
    runs = {b: jax.jit(tide_jax.shard_map(R.scan_step(lay, b, prefetch, remat), **specs)) for b in ("tide", "jax")}
    got = jax.device_get(runs["tide"](shards, xs))
    again = jax.device_get(runs["tide"](shards, xs))
    want = jax.device_get(runs["jax"](shards, xs))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
    assert R._max_err(got, want) < 1e-3 * max(1.0, abs(float(want[0])))


def test_compiled_layer_loop_orders_start_compute_done():
    """On a GPU the compiled layer-loop step issues a layer's gather start before its matmul and the
    done after it (what makes the copy overlap the compute)."""
    import jax
    import tide_jax

    R, lay, shards, xs, specs = _scan_setup(_need(1), 4, 256, 3)
    f = jax.jit(tide_jax.shard_map(R.scan_step(lay, "tide", 1, False), **specs))
    text = f.lower(shards, xs).compile().as_text()
    R.assert_start_compute_done(text)


# ----- the layer loop's knobs and edges on GPUs (issue #14) -----
@pytest.fixture(autouse=True)
def _native_at_world_1():
    """At world size 1 tide_jax makes the collectives local (no native call); these tests run on one
    GPU too, so they ask for the native calls (TIDE_WORLD1_NATIVE) to test them through XLA:GPU."""
    from tide_jax import _native

    previous, _native._world1_native = _native._world1_native, True
    yield
    _native._world1_native = previous


def _edge_model(devs, seed, tied):
    import jax
    import jax.numpy as jnp
    import tide_jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import test_loop as T

    mesh = Mesh(np.array(devs), (AXIS,))
    rng = np.random.default_rng(seed)
    stacked, emb, head = T._embed_head_model(rng, 5, vocab=37)
    lay = tide_jax.layout(T._one(stacked), mesh, AXIS)
    lay_e, lay_h = tide_jax.layout(emb, mesh, AXIS), tide_jax.layout(head, mesh, AXIS)
    args = (lay.shard_stacked(stacked), lay_e.shard(emb), lay_h.shard(head))
    tokens = jax.device_put(rng.integers(0, 37, (4 * len(devs), 9)).astype(np.int32), NamedSharding(mesh, P(AXIS)))

    def step(remat, reshard, backend):
        def embed(pe, tok):
            return pe["tokens"][tok], (pe["tokens"] if tied else None)

        def logits(ph, x, table):
            return (x * ph["norm"]) @ (table.T if tied else ph["out"])

        def per_device(s, se, sh, tok):
            def loss(s, se, sh):
                out = tide_jax.scan_layers(T.layer_fn, tok, s, lay, dtype=jnp.float32, backend=backend, remat=remat,
                                           reshard_after_forward=reshard, prologue=(embed, se, lay_e),
                                           epilogue=(logits, sh, lay_h))
                return jnp.sum(jax.nn.log_softmax(out) ** 2)

            value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(s, se, sh)
            return jax.lax.psum(value, AXIS), grads

        return jax.jit(tide_jax.shard_map(per_device, mesh=mesh,
                                          in_specs=(lay.stacked_spec, lay_e.spec, lay_h.spec, P(AXIS)),
                                          out_specs=(P(), (lay.stacked_spec, lay_e.spec, lay_h.spec))))

    return step, args, tokens


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("remat,reshard", [(None, True), (None, False), ("dots", True), (True, True)])
def test_layer_loop_policies_and_edges_match_jax_backend(ngpu, remat, reshard):
    """scan_layers with a prologue (embedding) and epilogue (head, tied), every activation policy and
    reshard setting, native start/done on GPUs: equal to the pure-JAX twin; two runs bitwise equal."""
    import jax

    step, args, tokens = _edge_model(_need(ngpu), 11 + ngpu, tied=True)
    got = jax.device_get(step(remat, reshard, "tide")(*args, tokens))
    again = jax.device_get(step(remat, reshard, "tide")(*args, tokens))
    want = jax.device_get(step(remat, reshard, "jax")(*args, tokens))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # fp32 everywhere; the two programs differ in summation order (GPU matmul tiling): fp32 rounding
        assert np.max(np.abs(a - b)) <= 1e-4 * max(1.0, float(np.max(np.abs(b)))), float(np.max(np.abs(a - b)))


def test_compiled_edges_overlap_on_gpu():
    """The compiled step (XLA:GPU keeps the barriers' order): a layer gather start before the
    embedding lookup and its done after it; a layer reduce-scatter start before the lookup's
    backward (a scatter) and its done after it."""
    import re

    step, args, tokens = _edge_model(_need(1), 3, tied=False)
    text = step(None, True, "tide").lower(*args, tokens).compile().as_text()
    entry = text[text.index("ENTRY"):].splitlines()

    def rows(pred):
        return [n for n, line in enumerate(entry) if pred(line)]

    def target(name):
        return rows(lambda line: f'custom_call_target="{name}"' in line)

    lookup = rows(lambda line: re.search(r"gather", line.split("=", 1)[0]) or " gather(" in line)
    scatter = rows(lambda line: re.search(r"scatter", line.split("=", 1)[0]) and "tide_" not in line)
    ag_s, ag_d = target("tide_all_gather_start"), target("tide_all_gather_done")
    rs_s, rs_d = target("tide_reduce_scatter_start"), target("tide_reduce_scatter_done")
    assert lookup and scatter, "no gather/scatter op in the entry computation"
    assert any(s < lookup[0] < d for s in ag_s for d in ag_d), (ag_s, ag_d, lookup)
    assert any(s < scatter[-1] < d for s in rs_s for d in rs_d), (rs_s, rs_d, scatter)


# ----- the reduce-scatter into slices of the gradient buffers (issue #22) -----
@pytest.mark.parametrize("n", [1, 2])
def test_reduce_scatter_into_slices_on_gpus(n, rng, monkeypatch):
    """The native call writes each shard into slice `index` of its (L, ...) buffer, read on the
    device: bitwise the reduce-scatter then jax.lax's update, other slices untouched, for indices
    in range, negative and past the end; scan_layers gives the same bits with it as without."""
    from jax.sharding import Mesh

    import test_rs_into as T

    mesh = Mesh(np.array(_need(n)), (AXIS,))
    T.check_into_slices(mesh, seed=int(rng.integers(1 << 30)))
    T.check_loop_same_bits(monkeypatch, n, 4, "dots", True, mesh=mesh)
    T.check_loop_same_bits(monkeypatch, n, 3, None, False, mesh=mesh)


# ----- the casting all-gather: fp32 shards in, bf16 parameters out (issue #22) -----
@pytest.mark.parametrize("n", [1, 2])
def test_all_gather_cast_on_gpus(n, rng, monkeypatch):
    """Each rank rounds its rows of slice `index` of the fp32 stack into their place in the bf16
    result on XLA's stream, peers copy them from there: bitwise XLA's convert then the all-gather
    (any NaN for a NaN) for indices in range, negative and past the end, with ties, overflow,
    subnormals and NaNs; scan_layers gives the same bits with it as without (world 1: native calls)."""
    from jax.sharding import Mesh

    import test_ag_cast as T
    from tide_jax import _native

    if n == 1:
        monkeypatch.setattr(_native, "_world1_native", True)
    mesh = Mesh(np.array(_need(n)), (AXIS,))
    T.check_cast_gather(mesh, seed=int(rng.integers(1 << 30)))
    T.check_loop_same_bits(monkeypatch, n, 4, "dots", True, mesh=mesh)
    T.check_loop_same_bits(monkeypatch, n, 3, None, False, mesh=mesh)


@pytest.mark.parametrize("n", [1, 2])
def test_byte_wide_dtypes_empty_parameters_and_grad_on_gpus(tide, rng, n, monkeypatch):
    """float8 / complex / bool / int8 parameters all-gathered bitwise beside empty ones (tide's call
    runs on the others); jax.grad through tide.all_gather equals the reduce-scatter of the cotangent.
    TIDE_WORLD1_NATIVE=1 so one GPU runs the engine too."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import PartitionSpec as P
    monkeypatch.setenv("TIDE_WORLD1_NATIVE", "1")
    devs = _need(n)
    mesh = _mesh(devs)
    params = {"f8": rng.standard_normal((37, 5)).astype(ml_dtypes.float8_e4m3fn),
              "e5": rng.standard_normal((9,)).astype(ml_dtypes.float8_e5m2),
              "c": (rng.standard_normal((7, 3)) + 1j * rng.standard_normal((7, 3))).astype(np.complex64),
              "m": rng.integers(0, 2, (11,)).astype(np.bool_), "i8": rng.integers(-100, 100, (3, 4)).astype(np.int8),
              "empty": np.zeros((0, 8), np.float32), "lora": np.zeros((4, 0), ml_dtypes.bfloat16),
              "w": rng.standard_normal((1031, 3)).astype(np.float32)}
    lay = tide.layout(params, mesh, AXIS)
    out = _smap(mesh, lambda s: {k: v[None] for k, v in tide.all_gather(s, lay).items()}, (lay.spec,),
                {k: P(AXIS) for k in params})(lay.shard(params))
    for k, x in params.items():
        got = np.asarray(jax.device_get(out[k]))
        assert got.shape == (n, *x.shape) and got.dtype == x.dtype, k
        for d in range(n):
            assert got[d].tobytes() == x.tobytes(), f"{k} on device {d}"
    floats = {"w": params["w"], "empty": params["empty"]}
    flay = tide.layout(floats, mesh, AXIS)
    weights = (rng.integers(-8, 9, (n, 1031, 3)) / 4).astype(np.float32)

    def grads(s, w):
        return jax.grad(lambda s: jnp.sum(tide.all_gather(s, flay)["w"] * w[0]) + jnp.sum(tide.all_gather(s, flay)["empty"]))(s)

    from jax.sharding import NamedSharding
    g = _smap(mesh, grads, (flay.spec, P(AXIS)), flay.spec)(flay.shard(floats),
                                                            jax.device_put(weights, NamedSharding(mesh, P(AXIS))))
    want = _pad(weights.astype(np.float64).sum(0), n).astype(np.float32)
    assert np.asarray(jax.device_get(g["w"])).tobytes() == want.tobytes()
    assert np.shape(g["empty"]) == flay.params[0].global_shape


@pytest.mark.parametrize("n", [1, 2])
def test_forward_mode_and_hessian_vector_products_on_gpus(tide, rng, n, monkeypatch):
    """jax.jvp through tide.all_gather (the tangent is the gathered tangent, bitwise) and a
    Hessian-vector product (jvp of grad) through all_gather and reduce_scatter on the CUDA engine,
    against the jax backend. TIDE_WORLD1_NATIVE=1 so one GPU runs the engine too."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    monkeypatch.setenv("TIDE_WORLD1_NATIVE", "1")
    devs = _need(n)
    mesh = _mesh(devs)
    exact = lambda shape: (rng.integers(-16, 17, shape) / 8).astype(np.float32)  # noqa: E731
    params = {"w": exact((1031, 3)), "b": exact((5,))}
    tangent = {"w": exact((1031, 3)), "b": exact((5,))}
    lay = tide.layout(params, mesh, AXIS)
    t_out = _smap(mesh, lambda s, t: {k: v[None] for k, v in jax.jvp(lambda s: tide.all_gather(s, lay), (s,), (t,))[1].items()},
                  (lay.spec, lay.spec), {k: P(AXIS) for k in params})(lay.shard(params), lay.shard(tangent))
    for k in params:
        got = np.asarray(jax.device_get(t_out[k]))
        assert got.tobytes() == np.stack([tangent[k]] * n).tobytes(), k
    # The Hessian-vector product compares two different programs (tide's calls vs jax.lax's), which
    # XLA:GPU fuses and schedules differently, so it must be exact arithmetic to compare bitwise: a
    # polynomial loss (no tanh: the second derivative of tanh^2 near saturation is 1 - tanh^2, cancels
    # from ~1, and turns one ulp of a differently fused tanh into 1e-3 relative; an H100 run, seed
    # 1693729270, differed by 7.5e-5 in 26 of 3093 elements that way, while fp32 itself is off the
    # fp64 value by 6.4e-5 there) on quarters in [-1, 1], whose every intermediate is a multiple of
    # 2^-12 below 2^12: exact in float32, in any order. Dots at "highest": XLA:GPU's default lets an f32
    # dot run in TF32 (11 significant bits), chosen per program (cuBLAS, Triton or a fused multiply for
    # the HVP's outer product, whose vector here needs up to 18 bits).
    quarters = lambda shape: (rng.integers(-4, 5, shape) / 4).astype(np.float32)  # noqa: E731
    params = {"w": quarters((1031, 3)), "b": quarters((5,))}
    tangent = {"w": quarters((1031, 3)), "b": quarters((5,))}
    x = quarters((n, 3))

    def hvp(backend):
        def loss(s, x):
            full = tide.all_gather(s, lay, backend=backend)
            h = full["w"] @ x[0]
            rs = tide.reduce_scatter({"w": full["w"] * h[:, None], "b": full["b"]}, lay, backend=backend)
            return jax.lax.psum(jnp.sum(h ** 2) + jnp.sum(rs["w"] ** 2) + jnp.sum(full["b"] * x[0, 0]), AXIS)

        f = lambda s, x, v: jax.jvp(lambda s: jax.grad(loss)(s, x), (s,), (v,))[1]  # noqa: E731
        with jax.default_matmul_precision("highest"):
            return _smap(mesh, f, (lay.spec, P(AXIS), lay.spec), lay.spec)(
                lay.shard(params), jax.device_put(x, NamedSharding(mesh, P(AXIS))), lay.shard(tangent))

    got, want = hvp("tide"), hvp("jax")
    for k in params:
        np.testing.assert_array_equal(np.asarray(jax.device_get(got[k])), np.asarray(jax.device_get(want[k])))
    assert np.asarray(jax.device_get(got["w"])).any()


# ----- hand-written start/done: in flight bounded while tracing (issue #39) -----
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("loop", ["python", "fori"])
@pytest.mark.parametrize("pattern", ["prefetch", "backward", "ready"])
def test_hand_written_loops_on_gpus(n, loop, pattern):
    """The loops of tests/python/test_inflight.py on the CUDA engine (world 1: native calls): a
    prefetching forward (two gathers ahead), backward-style reduce-scatters, and reduce-scatters of
    gradients ready at entry (six per program, one start per done: before the in-flight lanes an
    H100 failed this with '4 tide reduce_scatter calls are already in flight'), in a Python loop and
    in lax.fori_loop. They run (no in-flight failure) and equal the jax backend bitwise."""
    import test_inflight as T

    T._inflight.reset()
    T.check_loop(pattern, loop, n, seed=7 * n + len(pattern) + len(loop), devices=_need(n))


# ----- scan_layers' memory at its defaults (issue #39) -----
@pytest.mark.parametrize("n", [1, 2])
def test_layer_loop_holds_prefetch_plus_one_gathered_layers_on_gpus(n, monkeypatch):
    """XLA:GPU's memory analysis of scan_layers' step (defaults: bf16, prefetch 1, two layers per scan
    iteration on GPUs; the calls real at world 1, as every test here: `_native_at_world_1`):
    - two layers per iteration hold no more than one (within half a gathered layer): XLA:GPU keeps
      the barriers that order an iteration's second layer after its first (XLA:CPU drops them, hence
      one per iteration there: test_loop.py);
    - with reshard_after_forward the temp memory does not grow with depth (16 layers vs 8: within
      half a gathered layer): it holds prefetch + 1 gathered layers whatever L, as FSDP2 does;
      without, it grows by a gathered layer per layer.
    (The CPU test's bar, on <= 0.4x off at 8 layers, does not carry over: XLA:CPU upcasts bf16 dots
    and so holds f32 copies of the saved layers without reshard. One H100 measured 0.47x at either
    unroll, 2324688 / 4948136 bytes: the layer's bf16 cotangents and the carry are held either way.)"""
    from jax.sharding import Mesh

    import test_loop as T

    mesh = Mesh(np.array(_need(n)), (AXIS,))
    d, f = 256, 512
    layer = 2 * (2 * d * f + d + f + 1)  # one gathered layer, bf16 bytes
    got = {}
    for unroll in ("", "1"):
        monkeypatch.setenv("TIDE_SCAN_UNROLL", unroll)
        for num in (8, 16):
            if unroll and num == 16:
                continue
            for reshard in (True, False):
                got[unroll or "default", num, reshard] = T.scan_layers_temp_bytes(mesh, reshard, num, d, f, rows=2)
    print(f"scan_layers temp bytes on {n} GPU(s) ((unroll, layers, reshard): bytes; a gathered layer {layer}): {got}")
    assert got["default", 8, True] <= got["1", 8, True] + layer // 2, got
    assert got["default", 16, True] - got["default", 8, True] <= layer // 2, got
    assert got["default", 16, False] - got["default", 8, False] >= 7 * layer, got
