"""Bad input raises a Python exception that names the problem, before anything reaches the library."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"


@pytest.fixture
def setup():
    mesh = make_mesh((8,), (AXIS,))
    params = {"w": np.ones((7, 5), np.float32), "b": np.ones((3,), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    return mesh, params, lay


def smap(f, mesh, in_specs, out_specs=P(AXIS)):
    return jax.jit(tide_jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def test_shard_shape_mismatch_names_parameter(backend, setup):
    mesh, params, lay = setup
    bad = {"w": jnp.ones((16, 5), jnp.float32), "b": jnp.ones((8,), jnp.float32)}  # w should be (8, 5)
    sharded = jax.device_put(bad, NamedSharding(mesh, P(AXIS)))
    with pytest.raises(ValueError, match=r"all_gather: parameter \['w'\].*\(2, 5\).*wants \(1, 5\)"):
        smap(lambda s: tide_jax.all_gather(s, lay)["w"], mesh, (lay.spec,))(sharded)


def test_shard_structure_mismatch(backend, setup):
    mesh, params, lay = setup
    sharded = lay.shard(params)
    with pytest.raises(ValueError, match="structure"):
        smap(lambda s: tide_jax.all_gather({"w": s["w"]}, lay["w"] if False else lay)["w"], mesh, (lay.spec,))(
            sharded
        )


def test_full_params_instead_of_shards_hint(backend, setup):
    mesh, params, lay = setup
    with pytest.raises(ValueError, match=r"\['b'\].*full parameter"):
        smap(lambda p: tide_jax.all_gather(p, lay)["w"], mesh, (P(),))(params)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64 if jax.config.jax_enable_x64 else jnp.int8])
def test_reduce_scatter_wrong_dtype(backend, setup, dtype):
    mesh, params, lay = setup
    grads = {"w": jnp.ones((7, 5), dtype), "b": jnp.ones((3,), jnp.float32)}
    with pytest.raises(TypeError, match=r"reduce_scatter: parameter \['w'\].*gradient dtype.*bfloat16, float16 or float32"):
        smap(lambda g: tide_jax.reduce_scatter(g, lay)["w"], mesh, (P(),))(grads)


def test_reduce_scatter_wrong_shape(backend, setup):
    mesh, params, lay = setup
    grads = {"w": jnp.ones((8, 5), jnp.float32), "b": jnp.ones((3,), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['w'\].*gradient has shape \(8, 5\).*\(7, 5\)"):
        smap(lambda g: tide_jax.reduce_scatter(g, lay)["w"], mesh, (P(),))(grads)


def test_layout_from_another_mesh(backend, setup):
    mesh, params, lay = setup
    other = make_mesh((4,), (AXIS,))
    lay4 = tide_jax.layout(params, other, AXIS)
    sharded = lay.shard(params)
    # shapes happen to differ too; the mesh check must come first and say so
    with pytest.raises(ValueError, match="another mesh"):
        smap(lambda s: tide_jax.all_gather(jax.tree.map(lambda t: t, s), lay4)["w"], mesh, (lay.spec,))(sharded)
    # same shapes, other axis name
    renamed = tide_jax.layout(params, make_mesh((8,), ("data",)), "data")
    with pytest.raises(ValueError, match=r"another mesh.*'data'"):
        smap(lambda s: tide_jax.all_gather(s, renamed)["w"], mesh, (lay.spec,))(sharded)


def test_layout_from_another_mesh_shape(backend):
    mesh = make_mesh((2, 4), ("dp", AXIS))
    params = {"w": np.ones((8, 2), np.float32)}
    lay_2d = tide_jax.layout(params, mesh, AXIS)
    flat = make_mesh((4,), (AXIS,))
    lay_1d = tide_jax.layout(params, flat, AXIS)
    with pytest.raises(ValueError, match="another mesh"):
        smap(lambda s: tide_jax.all_gather(s, lay_1d)["w"], mesh, (lay_2d.spec,))(lay_2d.shard(params))


@pytest.mark.parametrize("other", ["reversed", "other devices", "transposed 2d"])
def test_layout_from_a_mesh_with_other_devices(tide_backend, other):
    """Same axis names and sizes, devices in another order (or other devices): the abstract mesh
    matches, but tide addresses ranks by the layout's device order, so each shard would land at
    another rank's place. Refused when lowered, naming the call and both device orders, for every
    native call (all_gather, reduce_scatter, all_gather_start); the layout's own mesh, rebuilt from
    the same devices, is accepted (and the result checked)."""
    devs = np.array(jax.devices()[:8])
    if other == "transposed 2d":
        names = ("data", AXIS)
        mesh, here = Mesh(devs.reshape(2, 4), names), Mesh(devs.reshape(4, 2).T, names)
    else:
        names = (AXIS,)
        mesh = Mesh(devs[:4], names)
        here = Mesh(devs[:4][::-1] if other == "reversed" else devs[4:8], names)
    params = {"w": np.arange(14, dtype=np.float32).reshape(7, 2), "b": np.ones((3,), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    calls = {
        "all_gather": lambda s: tide_jax.all_gather(s, lay)["w"],
        "reduce_scatter": lambda s: tide_jax.reduce_scatter(tide_jax.all_gather(s, lay, backend="jax"), lay)["w"],
        "all_gather_start": lambda s: tide_jax.all_gather_done(tide_jax.all_gather_start(s, lay))["w"],
    }
    for op, f in calls.items():
        g = jax.jit(tide_jax.shard_map(f, mesh=here, in_specs=(lay.spec,), out_specs=P(names), check_vma=False))
        with pytest.raises(ValueError, match=rf"tide: {op} of \['b'\], \['w'\]: the layout was built for another mesh"
                                              r".*devices \[.*shard_map's.*has \[.*Build the layout from the mesh"):
            g.lower(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lay.shard(params)))
    same = Mesh(mesh.devices.copy(), names)
    got = jax.jit(tide_jax.shard_map(calls["all_gather"], mesh=same, in_specs=(lay.spec,), out_specs=P(names),
                                     check_vma=False))(lay.shard(params))
    np.testing.assert_array_equal(np.asarray(got)[:7], params["w"])


def test_layout_axis_not_manual(backend):
    """The layout's own mesh, but shard_map takes another axis only: the error says that axis is not
    manual (not that the mesh differs) and how to fix it."""
    mesh = make_mesh((2, 4), ("data", AXIS))
    params = {"w": np.zeros((7, 3), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    f = jax.jit(jax.shard_map(lambda s: tide_jax.all_gather(s, lay)["w"][None], mesh=mesh, in_specs=(P(),),
                              out_specs=P("data"), axis_names={"data"}))
    with pytest.raises(ValueError, match=r"all_gather: the layout's axis 'fsdp' is not manual in the enclosing "
                                         r"shard_map \(manual: \['data'\]\).*axis_names=\{'data', 'fsdp'\}"):
        f(lay.shard(params))


def test_grad_through_start_done_says_it_cannot_be_differentiated(tide_backend, setup):
    """The README's row for start/done: not differentiable, and JAX says so for the FFI call (the
    mesh guard in front of it passes tangents through rather than failing with a message of its own)."""
    mesh, params, lay = setup

    def loss(s):
        return jnp.sum(tide_jax.all_gather_done(tide_jax.all_gather_start(s, lay))["w"] ** 2)

    with pytest.raises(ValueError, match="The FFI call to `tide_all_gather_start` cannot be differentiated"):
        smap(jax.grad(loss), mesh, (lay.spec,), lay.spec)(lay.shard(params))


def test_outside_shard_map(backend, setup):
    mesh, params, lay = setup
    sharded = lay.shard(params)
    with pytest.raises(RuntimeError, match="outside shard_map"):
        jax.jit(lambda s: tide_jax.all_gather(s, lay))(sharded)
    with pytest.raises(RuntimeError, match="outside shard_map"):
        tide_jax.reduce_scatter(params, lay)


def test_gather_params_needs_floats(backend):
    mesh = make_mesh((8,), (AXIS,))
    params = {"w": np.ones((7, 5), np.float32), "n": np.arange(9, dtype=np.int32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    with pytest.raises(TypeError, match=r"gather_params: parameter \['n'\].*int32"):
        smap(lambda s: tide_jax.gather_params(s, lay)["w"], mesh, (lay.spec,))(lay.shard(params))


def test_not_a_layout(setup):
    mesh, params, lay = setup
    with pytest.raises(TypeError, match="Layout"):
        smap(lambda s: tide_jax.all_gather(s, {"w": None})["w"], mesh, (lay.spec,))(lay.shard(params))


def test_backend_switch():
    previous = tide_jax.set_backend("jax")
    try:
        assert tide_jax.get_backend() == "jax"
        with pytest.raises(ValueError, match="unknown backend"):
            tide_jax.set_backend("nccl")
    finally:
        tide_jax.set_backend(previous)


def _first_op(exc: str, before: str = "", after: str = "") -> str:
    """A fresh process's first tide op (an all_gather on 2 CPU devices), printing `MSG <error>` when
    it raises `tide_jax.<exc>`; `before` runs after the import, `after` once the op ran."""
    return (
        "import jax, numpy as np, tide_jax\n"
        "from jax.sharding import PartitionSpec as P\n"
        f"{before}"
        "mesh = jax.make_mesh((2,), ('x',), devices=jax.devices()[:2])\n"
        "lay = tide_jax.layout({'w': np.ones(3, np.float32)}, mesh, 'x')\n"
        "f = jax.jit(tide_jax.shard_map(lambda s: tide_jax.all_gather(s, lay)['w'][None], mesh=mesh,"
        " in_specs=(lay.spec,), out_specs=P('x')))\n"
        "try:\n"
        "    f(lay.shard({'w': np.ones(3, np.float32)}))\n"
        f"{after}"
        f"except tide_jax.{exc} as e:\n"
        "    print('MSG', e)\n"
    )


def _run_python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name,value,first_op", [
    ("TIDE_BACKEND", "nccl", True), ("TIDE_WORLD1_NATIVE", "7", True), ("TIDE_SCAN_UNROLL", "\u00b2", False),
    ("TIDE_KV_TIMEOUT_S", "-1", False), ("TIDE_NODE_LOCAL", "maybe", False), ("TIDE_RS_INTO", "perhaps", False)])
def test_invalid_python_settings_are_setting_errors(name, value, first_op):
    """Settings tide_jax reads in Python: `import tide_jax` and `tide_jax.info()` still work, info
    flags the bad value (`!! invalid setting: ...` naming the variable), and a setting read at import
    fails the first op traced with SettingError, as the native library's settings do."""
    code = _first_op("SettingError",
                     before="print('INFO', [l for l in tide_jax.info().splitlines() if l.startswith('!! invalid setting')])\n",
                     after="    print('RAN')\n")
    r = _run_python(code, **{name: value}, PYTHONPATH=os.path.dirname(tide_jax.__path__[0]))
    assert r.returncode == 0, r.stderr[-2000:]
    info = next(line for line in r.stdout.splitlines() if line.startswith("INFO"))
    assert f"tide: {name}=" in info and repr(value.strip().lower()) in info, info
    if first_op:
        assert f"MSG tide: {name}=" in r.stdout, r.stdout
    else:
        assert "RAN" in r.stdout, r.stdout


def test_backend_names_are_taken_alike_everywhere(setup):
    """"tide"/"jax" in any case, spaces ignored, by set_backend and by every op's backend=; anything
    else (an empty string, a number) is refused, not taken as the default."""
    mesh, params, lay = setup
    previous = tide_jax.set_backend(" JAX ")
    try:
        assert tide_jax.get_backend() == "jax"
        f = smap(lambda s: tide_jax.all_gather(s, lay, backend=" Tide ")["w"], mesh, (lay.spec,))
        assert np.asarray(f(lay.shard(params))).shape == (56, 5)
        for bad in ["", 0, "nccl"]:
            with pytest.raises(ValueError, match="unknown backend"):
                smap(lambda s: tide_jax.all_gather(s, lay, backend=bad)["w"], mesh, (lay.spec,))(lay.shard(params))
        with pytest.raises(ValueError, match="unknown backend"):
            tide_jax.set_backend("")
    finally:
        tide_jax.set_backend(previous)


def test_missing_library_is_a_clear_error():
    code = _first_op("LibraryNotFoundError")
    r = _run_python(code, TIDE_LIBRARY="/nonexistent/libtide.so", PYTHONPATH=os.path.dirname(tide_jax.__path__[0]))
    assert r.returncode == 0, r.stderr
    assert "MSG" in r.stdout and "/nonexistent/libtide.so" in r.stdout and "pip install ." in r.stdout


def test_library_is_present():
    """CI installs the native library; its absence must fail the run, not skip the native tests."""
    path = tide_jax.library_path()
    assert os.path.isfile(path)


def test_native_error_surfaces_naming_the_parameter(tide_backend):
    """Bypassing tide_jax's checks: the library itself rejects a call that contradicts the layout, and
    the error reaches Python as an exception naming the parameter, without killing the process."""
    from tide_jax import _lib, _native

    mesh = make_mesh((8,), (AXIS,))
    params = {"w": np.ones((9, 5), np.float32)}  # shard_rows = 2
    lay = tide_jax.layout(params, mesh, AXIS)
    _lib.ensure_registered("cpu")

    def bad_call(s):
        # a (1, 5) operand where the layout over 8 ranks wants (2, 5)
        out = jax.ffi.ffi_call("tide_all_gather", [jax.ShapeDtypeStruct((9, 5), jnp.float32)])(
            s["w"][:1], **_native.call_attrs(lay, _native.new_site())
        )
        return out[0][None]

    f = smap(bad_call, mesh, (lay.spec,))
    with pytest.raises(Exception, match=r"(?s)tide.*'w'"):
        jax.block_until_ready(f(lay.shard(params)))
    # the process and the library still work afterwards
    ok = smap(lambda s: tide_jax.all_gather(s, lay)["w"][None], mesh, (lay.spec,))(lay.shard(params))
    assert (np.asarray(ok) == 1).all()


# ----- issue #8: attributes any caller of jax.ffi.ffi_call can pass, and settings -----
def _direct_call(lay, **override):
    """A tide_all_gather through jax.ffi.ffi_call with tide_jax's attributes, some replaced."""
    from tide_jax import _lib, _native

    _lib.ensure_registered("cpu")
    attrs = dict(_native.call_attrs(lay, _native.new_site()), **override)

    def f(s):
        out = jax.ffi.ffi_call("tide_all_gather", [jax.ShapeDtypeStruct((9, 5), jnp.float32)])(s["w"], **attrs)
        return out[0][None]

    return f


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(world=np.int64(2**32), gpus_per_node=np.int64(2**32)), r"attribute 'world' is 4294967296"),
        (dict(world=np.int64(10**6), gpus_per_node=np.int64(10**6)), r"attribute 'world' is 1000000"),
        (dict(nodes=np.int64(768614336404564651), gpus_per_node=np.int64(24)), r"attribute 'nodes' is 768614336404564651"),
        (dict(device_ranks=np.array([0, 1, 2, 3, 4, 5, 6, 2], np.int64)), r"rank 2 appears twice in group 0"),
        (dict(world=np.int64(10**4), gpus_per_node=np.int64(10**4)), r"group 0 lacks rank 8"),
        (dict(job=np.int64(-5)), r"attribute 'job' is -5"),
    ],
    ids=["world-2^32", "world-1e6", "wrapping-topology", "duplicate-rank", "world-1e4", "negative-job"],
)
def test_adversarial_attributes_fail_fast_and_clearly(tide_backend, override, match):
    """Attributes tide_jax never builds: a clear exception in well under a second, not an abort,
    a hang or a timeout; the process and the library keep working."""
    import time

    mesh = make_mesh((8,), (AXIS,))
    params = {"w": np.ones((9, 5), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    sharded = lay.shard(params)
    f = smap(_direct_call(lay, **override), mesh, (lay.spec,))
    with pytest.raises(Exception, match=match):  # the first call compiles: not timed
        jax.block_until_ready(f(sharded))
    t0 = time.monotonic()
    with pytest.raises(Exception, match=match) as info:
        jax.block_until_ready(f(sharded))
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0, f"took {elapsed:.2f} s"
    message = str(info.value)
    assert "tide all_gather site" in message and "on device" in message
    assert len(message) < 4096, len(message)
    ok = smap(lambda s: tide_jax.all_gather(s, lay)["w"][None], mesh, (lay.spec,))(sharded)
    assert (np.asarray(ok) == 1).all()


@pytest.mark.parametrize("value", ["inf", "1e30", "0", "nan", "-1", "abc"])
def test_invalid_timeout_setting_is_a_clear_error(value):
    code = _first_op("SettingError")
    r = _run_python(code, TIDE_TIMEOUT_S=value, PYTHONPATH=os.path.dirname(tide_jax.__path__[0]))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f'MSG tide setting: TIDE_TIMEOUT_S="{value}" is not a valid setting' in r.stdout, r.stdout
    assert "[0.001, 1000000]" in r.stdout
