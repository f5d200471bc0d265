"""Layout arithmetic (FSDP2 dim-0 rule), shard/unshard, specs, sub-layouts, device map, topology."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh


def _params(rng):
    return {
        "w": rng.standard_normal((7, 5)).astype(np.float32),
        "b": rng.standard_normal((13,)).astype(jnp.bfloat16),
        "s": np.float32(2.5),
        "t": rng.standard_normal((3, 4, 2)).astype(np.float16),
        "i": np.arange(10, dtype=np.int32),
    }


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shard_arithmetic(world):
    mesh = make_mesh((world,), ("fsdp",))
    params = _params(np.random.default_rng(0))
    lay = tide_jax.layout(params, mesh, "fsdp")
    info = {p.path: p for p in lay.params}
    for name, x in params.items():
        p = info[f"['{name}']"]
        rows = x.shape[0] if np.ndim(x) else 1
        assert p.rows == rows
        assert p.shard_rows == -(-rows // world)
        assert p.shard_shape == (p.shard_rows, *np.shape(x)[1:])
        assert p.global_shape == (world * p.shard_rows, *np.shape(x)[1:])
        covered = [r for rank in range(world) for r in range(*p.owned_rows(rank))]
        assert covered == list(range(rows))
    assert lay.world == world and (lay.nodes, lay.gpus_per_node) == (1, world)


@pytest.mark.parametrize("world", [1, 3, 8])
def test_shard_unshard_roundtrip(world):
    mesh = make_mesh((world,), ("fsdp",))
    params = _params(np.random.default_rng(1))
    lay = tide_jax.layout(params, mesh, "fsdp")
    sharded = lay.shard(params)
    for p, x in zip(lay.params, jax.tree.leaves(sharded)):
        assert x.shape == p.global_shape
        assert x.sharding.spec == P("fsdp")
        host = np.asarray(x)
        assert not host[p.rows :].any(), f"{p.path}: padding rows not zero"
        for shard in x.addressable_shards:
            assert shard.data.shape == p.shard_shape
    back = lay.unshard(sharded)
    for name in params:
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(params[name]))
        assert back[name].dtype == np.asarray(params[name]).dtype


def test_layout_from_shape_dtype_structs_and_spec():
    mesh = make_mesh((8,), ("fsdp",))
    abstract = {"a": jax.ShapeDtypeStruct((9, 3), jnp.float32), "b": [jax.ShapeDtypeStruct((), jnp.bfloat16)]}
    lay = tide_jax.layout(abstract, mesh, "fsdp")
    assert lay.spec == {"a": P("fsdp"), "b": [P("fsdp")]}
    assert [p.path for p in lay.params] == ["['a']", "['b'][0]"]
    assert lay.names == "['a']\n['b'][0]"
    shapes = lay.global_shapes
    assert shapes["a"].shape == (16, 3) and shapes["b"][0].shape == (8,)
    assert lay.shard_shapes["a"].shape == (2, 3)


def test_sub_layouts():
    mesh = make_mesh((4,), ("fsdp",))
    params = {"layers": [{"wq": np.zeros((6, 2), np.float32)}, {"wq": np.zeros((5, 2), np.float32)}]}
    lay = tide_jax.layout(params, mesh, "fsdp")
    sub = lay["layers"][1]
    assert [p.path for p in sub.params] == ["['layers'][1]['wq']"]
    assert sub.params[0].shard_rows == 2
    direct = tide_jax.layout(params["layers"][1], mesh, "fsdp")
    assert direct.treedef == sub.treedef and direct.params[0].shape == sub.params[0].shape


def test_sub_layouts_name_parameters_as_the_whole_layout_does():
    """A sub-layout taken through namedtuples, lists, tuples and dicts names each parameter by the
    same path as the whole layout (namedtuple fields as .field, as JAX's keystr does)."""
    import collections

    nt = collections.namedtuple("NT", "w b")
    mesh = make_mesh((3,), ("fsdp",))
    params = {"layers": [nt(np.zeros((4, 2), np.float32), np.zeros((2,), np.float32)) for _ in range(2)],
              "head": (np.zeros((5,), np.float32), {"g": np.zeros((3,), np.float32)})}
    lay = tide_jax.layout(params, mesh, "fsdp")
    whole = [p.path for p in lay.params]
    for keys in [("layers",), ("layers", 1), ("layers", 1, 0), ("layers", 0, 1), ("head",), ("head", 1, "g")]:
        sub = lay
        for k in keys:
            sub = sub[k]
        for p in sub.params:
            assert p.path in whole, (keys, p.path, whole)
    assert lay["layers"][1][0].params[0].path == "['layers'][1].w"


@pytest.mark.parametrize("names,axis", [(("dp", "fsdp"), "fsdp"), (("fsdp", "dp"), "fsdp")])
def test_device_map_two_axes(names, axis):
    shape = (2, 4) if names[0] == "dp" else (4, 2)
    mesh = make_mesh(shape, names)
    lay = tide_jax.layout({"w": np.zeros((5,), np.float32)}, mesh, axis)
    assert lay.world == 4
    ordinals, ranks, groups = lay.device_ordinals, lay.device_ranks, lay.device_groups
    assert ordinals.dtype == ranks.dtype == groups.dtype == np.int64
    assert len(ordinals) == len(ranks) == len(groups) == 8
    axis_pos = names.index(axis)
    for idx in np.ndindex(*shape):
        d = mesh.devices[idx]
        k = list(ordinals).index(d.id)
        assert ranks[k] == idx[axis_pos]
        assert groups[k] == idx[1 - axis_pos]
    # every group has every rank exactly once
    for g in range(2):
        assert sorted(ranks[groups == g]) == [0, 1, 2, 3]


def test_topology_env(monkeypatch):
    mesh = make_mesh((8,), ("fsdp",))
    params = {"w": np.zeros((5,), np.float32)}
    monkeypatch.setenv("TIDE_TOPOLOGY", "2x4")
    lay = tide_jax.layout(params, mesh, "fsdp")
    assert (lay.nodes, lay.gpus_per_node) == (2, 4)
    monkeypatch.setenv("TIDE_TOPOLOGY", "3x4")
    with pytest.raises(ValueError, match="TIDE_TOPOLOGY.*12 ranks.*8 devices"):
        tide_jax.layout(params, mesh, "fsdp")
    monkeypatch.setenv("TIDE_TOPOLOGY", "two by four")
    with pytest.raises(ValueError, match="NODESxGPUS"):
        tide_jax.layout(params, mesh, "fsdp")
    monkeypatch.delenv("TIDE_TOPOLOGY")
    assert tide_jax.layout(params, mesh, "fsdp", topology=(4, 2)).nodes == 4
    assert tide_jax.layout(params, mesh, "fsdp", topology=[np.int64(2), 4]).nodes == 2
    for bad in [(1.5, 2), (4,), (True, 8), (2, 4, 1), "2x4x1", None.__class__]:
        with pytest.raises(ValueError, match=r"topology=.*(two integers|NODESxGPUS)"):
            tide_jax.layout(params, mesh, "fsdp", topology=bad)


def test_layout_errors():
    mesh = make_mesh((4,), ("fsdp",))
    with pytest.raises(ValueError, match="no axis 'x'"):
        tide_jax.layout({"w": np.zeros(3)}, mesh, "x")
    # Zero-size parameters are sharded like any other (tests/python/test_empty.py runs them).
    lay = tide_jax.layout({"w": np.zeros((0, 3)), "v": np.zeros((5, 0))}, mesh, "fsdp")
    assert [(p.rows, p.shard_rows, p.global_shape) for p in lay.params] == [(5, 2, (8, 0)), (0, 0, (0, 3))]
    with pytest.raises(ValueError, match="empty"):
        tide_jax.layout({}, mesh, "fsdp")
    lay = tide_jax.layout({"w": np.zeros((5, 3), np.float32)}, mesh, "fsdp")
    with pytest.raises(ValueError, match=r"\['w'\].*shape \(5, 2\)"):
        lay.shard({"w": np.zeros((5, 2), np.float32)})
    with pytest.raises(ValueError, match="structure"):
        lay.shard([np.zeros((5, 3), np.float32)])


def test_non_array_leaves_are_refused_naming_leaf_and_dtype():
    """PRNG keys (NNX Dropout's key<fry>) and Python objects: a named error saying what to do, not
    JAX's or NumPy's TypeError (issue #15). Integer and boolean arrays are sharded like any other."""
    mesh = make_mesh((4,), ("fsdp",))
    with pytest.raises(TypeError, match=r"leaf \['rng'\]\['key'\] has dtype key<fry> \(a PRNG key array.*P\(\)"):
        tide_jax.layout({"w": np.zeros(3), "rng": {"key": jax.random.key(0)}}, mesh, "fsdp")
    with pytest.raises(TypeError, match=r"leaf \['act'\] is a str, not an array"):
        tide_jax.layout({"w": np.zeros(3), "act": "gelu"}, mesh, "fsdp")
    lay = tide_jax.layout({"c": np.zeros((), np.uint32), "m": np.ones(5, bool)}, mesh, "fsdp")
    assert [p.dtype for p in lay.params] == [np.dtype(np.uint32), np.dtype(bool)]
    lay = tide_jax.layout({"f8": np.zeros(5, ml_dtypes.float8_e4m3fn), "c": np.zeros(3, np.complex64)}, mesh, "fsdp")
    assert [p.dtype for p in lay.params] == [np.dtype(np.complex64), np.dtype(ml_dtypes.float8_e4m3fn)]  # key order
    # Packed sub-byte types: XLA may store several elements to a byte; refused before anything runs.
    for dt in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.float4_e2m1fn):
        with pytest.raises(TypeError, match=rf"leaf \['q'\] has dtype {np.dtype(dt).name}, [24] bits per element"):
            tide_jax.layout({"w": np.zeros(3), "q": np.zeros(4, dt)}, mesh, "fsdp")


def test_first_wrong_call_names_the_fix():
    """A layout built from the stacked parameters, and spec / stacked_spec swapped: tide's message,
    raised before JAX's divisibility error can hide it (issue #15)."""
    mesh = make_mesh((8,), ("fsdp",))
    # Another live layout holds a parameter of the same shape: the message still names this one.
    other = tide_jax.layout({"w2": np.ones((5, 3), np.float32), "v": np.ones((5, 3), np.float32)}, mesh, "fsdp")
    stacked = {"w": np.ones((4, 5, 3), np.float32)}
    wrong = tide_jax.layout(stacked, mesh, "fsdp")
    with pytest.raises(ValueError, match=r"built from the stacked parameters; build it from ONE layer"):
        wrong.shard_stacked(stacked)
    lay = tide_jax.layout({"w": np.ones((5, 3), np.float32)}, mesh, "fsdp")
    shards = lay.shard_stacked(stacked)
    f = tide_jax.shard_map(lambda s: tide_jax.scan_layers(lambda p, c: c, jnp.zeros(3), s, lay), mesh=mesh,
                           in_specs=(lay.spec,), out_specs=P())
    with pytest.raises(ValueError, match=r"stacked shards of parameter \['w'\].*in_specs=lay\.stacked_spec"):
        jax.jit(f)(shards)
    g = tide_jax.shard_map(lambda s: s, mesh=mesh, in_specs=(lay.stacked_spec,), out_specs=P())
    with pytest.raises(ValueError, match=r"\(no layer axis\).*in_specs=lay\.spec"):
        jax.jit(g)(lay.shard({"w": np.ones((5, 3), np.float32)}))
    del other


def test_nccl_roles_rail_ids_made_by_node0_and_read_by_every_member():
    """Multi-host GPU bootstrap: rail r of a group (ranks r, r+G, r+2G, ...) gets its ncclUniqueId
    from the process of rank r (node 0); every process holding a member reads it."""
    from tide_jax._distributed import nccl_roles

    # 2 groups (another mesh axis), 3 nodes x 2 GPUs, one process per node holding both its GPUs.
    procs = np.array([[0, 0, 1, 1, 2, 2], [3, 3, 4, 4, 5, 5]])
    assert nccl_roles(procs, 2, 0) == ([(0, 0), (0, 1)], [(0, 0), (0, 1)])
    assert nccl_roles(procs, 2, 1) == ([], [(0, 0), (0, 1)])
    assert nccl_roles(procs, 2, 5) == ([], [(1, 0), (1, 1)])
    # One process per GPU: process q holds rank q; rail 1 = ranks 1, 3, 5.
    procs = np.arange(6).reshape(1, 6)
    assert nccl_roles(procs, 2, 1) == ([(0, 1)], [(0, 1)])
    assert nccl_roles(procs, 2, 4) == ([], [(0, 0)])
    # A node split unevenly over processes; every (group, rail) needed somewhere is created once.
    procs = np.array([[0, 1, 1, 2, 2, 2, 3, 3, 3]])
    made = [c for p in range(4) for c in nccl_roles(procs, 3, p)[0]]
    assert sorted(made) == [(0, 0), (0, 1), (0, 2)]
    needed = {c for p in range(4) for c in nccl_roles(procs, 3, p)[1]}
    assert needed == set(made)
