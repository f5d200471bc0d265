"""Layouts: how a pytree of parameters is sharded over one mesh axis (FSDP2's dim-0 rule).

The rule (the same arithmetic as `src/layout.rs`): with P ranks along the axis, a parameter of
shape `(rows, *rest)` has `shard_rows = ceil(rows / P)`; rank r owns rows
`[r * shard_rows, min((r + 1) * shard_rows, rows))`, zero-padded to `shard_rows`. A 0-d parameter
counts as one row of one element. The global sharded array is `(P * shard_rows, *rest)` (a 0-d
parameter: `(P,)`), sharded on the axis, replicated over the mesh's other axes; each device sees its
local shard `(shard_rows, *rest)` inside `shard_map`.

Meshes with several axes: ranks run along `axis`; the devices that share their coordinates on every
other axis form one group, and each group runs its own collective. The device map passed to the
native library (`device_ordinals`, `device_ranks`, `device_groups`) says, for every local device of
the mesh, its XLA device ordinal (CPU: the global device id; GPU: `local_hardware_id`), its rank and
its group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _distributed

__all__ = ["Layout", "ParamInfo", "layout", "shard_map", "topology_from_env"]

_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()  # live layouts, for shard_map's in_specs hints


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter's sharding. Sizes in elements / rows."""

    path: str  # pytree key path, e.g. "['layers'][0]['wq']"; how errors name the parameter
    shape: tuple[int, ...]  # full (unsharded) shape
    dtype: np.dtype
    rows: int  # dim 0 (1 for 0-d)
    row_elems: int  # product of the other dims
    shard_rows: int  # ceil(rows / world)
    world: int

    @property
    def rest(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Local shard inside shard_map: (shard_rows, *rest)."""
        return (self.shard_rows, *self.rest)

    @property
    def padded_rows(self) -> int:
        return self.world * self.shard_rows

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The sharded global array: (world * shard_rows, *rest)."""
        return (self.padded_rows, *self.rest)

    def owned_rows(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.shard_rows, self.rows)
        end = min((rank + 1) * self.shard_rows, self.rows)
        return start, end

    def describe(self) -> str:
        return f"parameter {self.path or '<root>'} (shape {self.shape}, {np.dtype(self.dtype).name})"


def topology_from_env(world: int) -> tuple[int, int]:
    """(nodes, gpus_per_node): single node unless TIDE_TOPOLOGY=NxG says otherwise (validated)."""
    spec = os.environ.get("TIDE_TOPOLOGY", "").strip()
    if not spec:
        return 1, world
    return parse_topology(spec, world, source="TIDE_TOPOLOGY")


def parse_topology(spec, world: int, source: str = "topology") -> tuple[int, int]:
    if isinstance(spec, str):
        parts = spec.lower().split("x")
        try:
            if len(parts) != 2:
                raise ValueError
            nodes, gpus = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"tide: {source}={spec!r}: expected NODESxGPUS, e.g. 2x4") from None
    else:
        nodes, gpus = (int(v) for v in spec)
    if nodes < 1 or gpus < 1:
        raise ValueError(f"tide: {source}={spec!r}: nodes and gpus_per_node must be at least 1")
    if nodes * gpus != world:
        raise ValueError(
            f"tide: {source}={spec!r} has {nodes * gpus} ranks but the mesh axis has {world} devices"
        )
    return nodes, gpus


def _abstract(x) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    arr = np.asarray(x)
    return jax.ShapeDtypeStruct(arr.shape, arr.dtype)


_STATE_HINT = (
    "keep it out of the sharded pytree and pass it to shard_map replicated (in_specs P()); "
    "tide_jax.nnx.shard and tide_jax.equinox.shard do this for a model's RNG state, counters and buffers"
)


def _check_leaf(path: str, leaf) -> None:
    """Refuses what cannot be sharded as rows of numbers, naming the leaf: PRNG keys (extended
    dtypes such as key<fry>), Python objects, strings."""
    name = path or "<root>"
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None:
        try:
            extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
        except TypeError:
            extended = False
        if extended:
            kind = "a PRNG key array" if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else "an extended dtype"
            raise TypeError(
                f"tide: layout: leaf {name} has dtype {dtype} ({kind}, shape {tuple(getattr(leaf, 'shape', ()))}): "
                f"it cannot be sharded; {_STATE_HINT}"
            )
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"tide: layout: leaf {name} has dtype {dtype}, which is not an array dtype; {_STATE_HINT}") from None
        if np_dtype.kind not in "biufc" and np_dtype != np.dtype(jnp.bfloat16):
            raise TypeError(f"tide: layout: leaf {name} has dtype {np_dtype} (not numbers); {_STATE_HINT}")
        return
    if isinstance(leaf, (bool, int, float, complex, np.generic)):
        return  # Python / NumPy scalars: 0-d parameters
    raise TypeError(
        f"tide: layout: leaf {name} is a {type(leaf).__name__}, not an array: only arrays (and numbers) can "
        "be sharded; keep other Python values out of the parameters (static, closed over); "
        "tide_jax.nnx.shard and tide_jax.equinox.shard do this for a model's"
    )


def _device_ordinal(device) -> int:
    if device.platform == "cpu":
        return int(device.id)
    return int(getattr(device, "local_hardware_id", device.id))


class Layout:
    """The sharding of a pytree of parameters over `axis` of `mesh`. Build with `tide_jax.layout`."""

    def __init__(self, abstract_params, mesh: Mesh, axis: str, topology=None, _prefix: str = ""):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"tide: layout needs a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis not in mesh.axis_names:
            raise ValueError(f"tide: mesh has axes {tuple(mesh.axis_names)}, no axis {axis!r}")
        self.mesh = mesh
        self.axis = axis
        self.world = int(mesh.shape[axis])
        self._topology_arg = topology
        if topology is None and _distributed.is_multiprocess(mesh):
            # TIDE_TOPOLOGY, else one node per host (docs/multiprocess.md).
            self.nodes, self.gpus_per_node = _distributed.topology(mesh, axis)
        elif topology is None:
            self.nodes, self.gpus_per_node = topology_from_env(self.world)
        else:
            self.nodes, self.gpus_per_node = parse_topology(topology, self.world)
        self._prefix = _prefix
        self._job: int | None = None

        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        if not leaves_with_path:
            raise ValueError("tide: empty parameter pytree: nothing to shard")
        for key_path, leaf in leaves_with_path:
            _check_leaf(_prefix + jax.tree_util.keystr(key_path), leaf)
        self.abstract = jax.tree_util.tree_unflatten(
            self.treedef, [_abstract(x) for _, x in leaves_with_path]
        )
        params = []
        for key_path, leaf in leaves_with_path:
            a = _abstract(leaf)
            path = _prefix + jax.tree_util.keystr(key_path)
            shape = tuple(int(d) for d in a.shape)
            if any(d == 0 for d in shape):
                raise ValueError(
                    f"tide: parameter {path or '<root>'} has shape {shape}: zero-size parameters "
                    "cannot be sharded"
                )
            rows = shape[0] if shape else 1
            params.append(
                ParamInfo(
                    path=path,
                    shape=shape,
                    dtype=np.dtype(a.dtype),
                    rows=rows,
                    row_elems=math.prod(shape[1:]),
                    shard_rows=-(-rows // self.world),
                    world=self.world,
                )
            )
        self.params: tuple[ParamInfo, ...] = tuple(params)
        self.sharding = NamedSharding(mesh, PartitionSpec(axis))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._device_map = self._build_device_map()
        _LAYOUTS.add(self)

    # ----- the device map (FFI attributes) -----
    def _build_device_map(self):
        names = list(self.mesh.axis_names)
        axis_pos = names.index(self.axis)
        devices = np.asarray(self.mesh.devices)
        other_dims = [devices.shape[i] for i in range(devices.ndim) if i != axis_pos]
        ordinals, ranks, groups = [], [], []
        process = jax.process_index()
        for idx in np.ndindex(*devices.shape):
            d = devices[idx]
            if getattr(d, "process_index", process) != process:
                continue  # the native library only sees this process's devices
            other = [idx[i] for i in range(len(idx)) if i != axis_pos]
            group = int(np.ravel_multi_index(other, other_dims)) if other else 0
            ordinals.append(_device_ordinal(d))
            ranks.append(int(idx[axis_pos]))
            groups.append(group)
        return (
            np.asarray(ordinals, dtype=np.int64),
            np.asarray(ranks, dtype=np.int64),
            np.asarray(groups, dtype=np.int64),
        )

    @property
    def device_ordinals(self) -> np.ndarray:
        return self._device_map[0]

    @property
    def device_ranks(self) -> np.ndarray:
        return self._device_map[1]

    @property
    def device_groups(self) -> np.ndarray:
        return self._device_map[2]

    @property
    def job(self) -> int:
        """The FFI attribute `job`: 0 if every device of the mesh is in this process, else the
        multi-process job id (docs/multiprocess.md)."""
        if self._job is None:
            job = _distributed.job_id(self.mesh)
            if job and self.nodes > 1 and self.platform == "cpu":
                _distributed.setup_rail(self, job)  # copies between nodes go over TCP (docs/multiprocess.md)
            elif job and self.nodes > 1:
                _distributed.setup_nccl(self, job)  # per-node control plane when processes span hosts
            self._job = job
        return self._job

    @property
    def platform(self) -> str:
        return np.asarray(self.mesh.devices).flat[0].platform

    @property
    def names(self) -> str:
        """Parameter paths joined by newlines (the FFI `names` attribute)."""
        return "\n".join(p.path for p in self.params)

    # ----- pytrees the user needs -----
    def _tree(self, leaves):
        return jax.tree_util.tree_unflatten(self.treedef, list(leaves))

    @property
    def spec(self):
        """Pytree of PartitionSpec(axis), for shard_map's in_specs / out_specs of the shards."""
        return self._tree(PartitionSpec(self.axis) for _ in self.params)

    @property
    def shardings(self):
        """Pytree of NamedSharding(mesh, PartitionSpec(axis)) of the sharded global arrays."""
        return self._tree(self.sharding for _ in self.params)

    @property
    def global_shapes(self):
        """Pytree of ShapeDtypeStructs of the sharded global arrays (world * shard_rows, *rest)."""
        return self._tree(
            jax.ShapeDtypeStruct(p.global_shape, p.dtype, sharding=self.sharding) for p in self.params
        )

    @property
    def shard_shapes(self):
        """Pytree of ShapeDtypeStructs of the local shards seen inside shard_map."""
        return self._tree(jax.ShapeDtypeStruct(p.shard_shape, p.dtype) for p in self.params)

    # ----- sharding and unsharding -----
    def _leaves_matching(self, tree, what: str):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"tide: {what} has pytree structure {treedef}, the layout has {self.treedef}"
            )
        return leaves

    def shard(self, params):
        """Full parameters -> global arrays (world * shard_rows, *rest), zero-padded, sharded on axis."""
        leaves = self._leaves_matching(params, "params passed to shard()")
        out = []
        for p, x in zip(self.params, leaves):
            shape = tuple(np.shape(x))
            if shape != p.shape:
                raise ValueError(f"tide: shard(): {p.describe()} got an array of shape {shape}")
            out.append(_pad_and_place(x, p, self.sharding))
        return self._tree(out)

    def unshard(self, sharded):
        """Global sharded arrays -> full parameters in their original shapes (padding dropped)."""
        leaves = self._leaves_matching(sharded, "arrays passed to unshard()")
        out = []
        for p, x in zip(self.params, leaves):
            shape = tuple(np.shape(x))
            if shape != p.global_shape:
                raise ValueError(
                    f"tide: unshard(): {p.describe()}: expected a sharded array of shape "
                    f"{p.global_shape}, got {shape}"
                )
            out.append(_crop(x, p, self.replicated))
        return self._tree(out)

    # ----- stacked layers (tide_jax.scan_layers) -----
    @property
    def stacked_spec(self):
        """Pytree of PartitionSpec(None, axis): in_specs / out_specs of stacked shards
        `(L, world * shard_rows, *rest)` (`shard_stacked`), sharded on dim 1."""
        return self._tree(PartitionSpec(None, self.axis) for _ in self.params)

    def shard_stacked(self, stacked_params):
        """Stacked full parameters `(L, *shape)` (this layout's pytree, a leading layer axis on every
        leaf) -> global arrays `(L, world * shard_rows, *rest)`, zero-padded per layer, sharded on
        dim 1: what `scan_layers` takes."""
        leaves = self._leaves_matching(stacked_params, "params passed to shard_stacked()")
        sharding = NamedSharding(self.mesh, PartitionSpec(None, self.axis))
        num = _num_layers(leaves, self.params, "shard_stacked()", lambda p: p.shape)
        out = []
        for p, x in zip(self.params, leaves):

            def pad(x, p=p):
                x = jnp.reshape(jnp.asarray(x, p.dtype), (num, p.rows, *p.rest))
                pad_rows = p.padded_rows - p.rows
                if pad_rows:
                    x = jnp.pad(x, [(0, 0), (0, pad_rows)] + [(0, 0)] * len(p.rest))
                return x

            out.append(jax.jit(pad, out_shardings=sharding)(x))
        return self._tree(out)

    def unshard_stacked(self, stacked_sharded):
        """Inverse of `shard_stacked`: `(L, world * shard_rows, *rest)` -> `(L, *shape)`."""
        leaves = self._leaves_matching(stacked_sharded, "arrays passed to unshard_stacked()")
        num = _num_layers(leaves, self.params, "unshard_stacked()", lambda p: p.global_shape)
        out = []
        for p, x in zip(self.params, leaves):

            def crop(x, p=p):
                return jnp.reshape(x[:, : p.rows], (num, *p.shape))

            out.append(jax.jit(crop, out_shardings=self.replicated)(jax.device_put(x, self.replicated)))
        return self._tree(out)

    # ----- sub-layouts -----
    def __getitem__(self, key) -> "Layout":
        sub = self.abstract[key]
        prefix = self._prefix + jax.tree_util.keystr(
            (jax.tree_util.SequenceKey(key) if isinstance(key, int) else jax.tree_util.DictKey(key),)
        )
        return Layout(sub, self.mesh, self.axis, topology=self._topology_arg, _prefix=prefix)

    def same_mesh(self, other: "Layout") -> bool:
        return self.mesh == other.mesh and self.axis == other.axis

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        lines = [
            f"Layout(axis={self.axis!r}, world={self.world}, topology={self.nodes}x{self.gpus_per_node}, "
            f"{len(self.params)} params)"
        ]
        for p in self.params:
            lines.append(
                f"  {p.path or '<root>'}: {p.shape} {p.dtype.name} -> shard {p.shard_shape}"
            )
        return "\n".join(lines)


def _num_layers(leaves, params, what: str, shape_of) -> int:
    """The common leading layer count L of stacked leaves whose other dims are `shape_of(param)`."""
    num = None
    same = all(tuple(np.shape(x)) == tuple(shape_of(p)) for p, x in zip(params, leaves))
    for p, x in zip(params, leaves):
        shape = tuple(np.shape(x))
        if len(shape) < 1 or shape[1:] != tuple(shape_of(p)):
            hint = ""
            if same:
                hint = (
                    ": every leaf has exactly the layout's own shape, so the layout was built from the stacked "
                    "parameters; build it from ONE layer, e.g. tide_jax.layout(jax.tree.map(lambda x: x[0], "
                    "stacked), mesh, axis), and pass the stacked parameters here"
                )
            raise ValueError(
                f"tide: {what}: {p.describe()}: expected a stacked array (L, *{tuple(shape_of(p))}), "
                f"got shape {shape}{hint}"
            )
        if num is None:
            num = shape[0]
        elif shape[0] != num:
            raise ValueError(
                f"tide: {what}: {p.describe()} has {shape[0]} layers, earlier leaves have {num}"
            )
    return int(num)


def _pad_and_place(x, p: ParamInfo, sharding):
    def pad(x):
        x = jnp.reshape(jnp.asarray(x, p.dtype), (p.rows, *p.rest))
        pad_rows = p.padded_rows - p.rows
        if pad_rows:
            x = jnp.pad(x, [(0, pad_rows)] + [(0, 0)] * len(p.rest))
        return x

    return jax.jit(pad, out_shardings=sharding)(x)


def _crop(x, p: ParamInfo, replicated):
    def crop(x):
        return jnp.reshape(x[: p.rows], p.shape)

    # Replicate first: slicing a sharded dim to a size the mesh does not divide is not expressible
    # under explicit sharding.
    return jax.jit(crop, out_shardings=replicated)(jax.device_put(x, replicated))


# ----------------------------------------------------------------------------------------------
# shard_map with tide's checks of in_specs against the layouts' arrays
# ----------------------------------------------------------------------------------------------
def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _check_in_specs(in_specs, args, mesh) -> None:
    """Refuses, before JAX can, the two spec mix-ups JAX reports without naming tide's fix: stacked
    shards `(L, P * shard_rows, *rest)` with `lay.spec` (splits the layer axis) and one layer's shards
    with `lay.stacked_spec`. Only where JAX would refuse the pair anyway (it does not divide)."""
    try:
        is_spec = lambda x: x is None or isinstance(x, PartitionSpec)  # noqa: E731
        spec_leaves_with_path, spec_tree = jax.tree_util.tree_flatten_with_path(in_specs, is_leaf=is_spec)
        subtrees = spec_tree.flatten_up_to(args)
    except Exception:  # noqa: BLE001 - a prefix mismatch: JAX's own message says it
        return
    layouts = [lay for lay in list(_LAYOUTS) if lay.axis in getattr(mesh, "axis_names", ())]
    if not layouts:
        return
    for (spec_path, spec), sub in zip(spec_leaves_with_path, subtrees):
        if not isinstance(spec, PartitionSpec):
            continue
        entries = tuple(spec)
        for path, x in jax.tree_util.tree_flatten_with_path(sub)[0]:
            shape = getattr(x, "shape", None)
            if shape is None:
                continue
            shape = tuple(int(d) for d in shape)
            # Several live layouts may hold a parameter of this shape: those whose path ends the
            # argument's own path (in_specs' path, then the path inside the argument) first, so the
            # message names the right parameter.
            key = jax.tree_util.keystr(tuple(spec_path) + tuple(path))
            candidates = [(lay, p) for lay in layouts for p in lay.params]
            candidates.sort(key=lambda c: not (c[1].path and key.endswith(c[1].path)))
            for lay, p in candidates:
                world = int(mesh.shape[lay.axis])
                if p.world != world:
                    continue
                stacked_with_spec = (
                    len(entries) >= 1 and lay.axis in _spec_axes(entries[0]) and len(shape) >= 1
                    and shape[1:] == p.global_shape and shape[0] % world != 0
                )
                if stacked_with_spec:
                    raise ValueError(
                        f"tide: shard_map in_specs: an argument of shape {shape} is the stacked shards of "
                        f"{p.describe()} (L = {shape[0]} layers of {p.global_shape}), but its spec "
                        f"{spec} splits the layer axis over {world} devices: use in_specs=lay.stacked_spec "
                        "(PartitionSpec(None, axis)) for stacked shards, lay.spec for one layer's"
                    )
                flat_with_stacked = (
                    shape == p.global_shape and len(entries) >= 2 and entries[0] is None
                    and lay.axis in _spec_axes(entries[1]) and (len(shape) < 2 or shape[1] % world != 0)
                )
                if flat_with_stacked:
                    raise ValueError(
                        f"tide: shard_map in_specs: an argument of shape {shape} is the shards of "
                        f"{p.describe()} (no layer axis), but its spec {spec} is a stacked spec: use "
                        "in_specs=lay.spec for shards from lay.shard, lay.stacked_spec only for "
                        "lay.shard_stacked's"
                    )


def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
    """`jax.shard_map` (one spelling of the replication-check flag on every supported JAX) that checks
    its arguments against tide's layouts first: a stacked-shards / `spec` mix-up is reported with
    the fix (`lay.stacked_spec` / `lay.spec`) instead of JAX's divisibility message."""
    from . import _compat

    mapped = _compat.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    @functools.wraps(f)
    def call(*args):
        _check_in_specs(in_specs, args, mesh)
        return mapped(*args)

    return call


def layout(params: Any, mesh: Mesh, axis: str, *, topology=None) -> Layout:
    """The layout of `params` (a pytree of arrays or ShapeDtypeStructs with full shapes) on `axis`.

    `topology` ("NxG" or (nodes, gpus_per_node)) overrides TIDE_TOPOLOGY; default: one node.
    """
    return Layout(params, mesh, axis, topology=topology)
