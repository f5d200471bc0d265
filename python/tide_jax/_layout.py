"""Layouts: how a pytree of parameters is sharded over one mesh axis (FSDP2's dim-0 rule), on
meshes that also shard parameters over other axes (tensor, expert) and replicate them (data).

Each parameter has a PartitionSpec over the mesh's *other* axes (`specs=`, or the NamedSharding an
array carries; default `P()`, replicated): how the full parameter is already split. Its *local
block* is what one device holds of it under that spec alone: each dim divided by the sizes of the
mesh axes the spec names for it (which must divide it). tide shards the local block along its dim 0
over `axis` with FSDP2's rule, padding per block (the same arithmetic as `src/layout.rs`): with P
ranks along the axis, a block of shape `(rows, *rest)` has `shard_rows = ceil(rows / P)`; rank r
owns rows `[r * shard_rows, min((r + 1) * shard_rows, rows))`, zero-padded to `shard_rows`. A 0-d
parameter counts as one row of one element.

The global sharded array of a parameter of full shape `(R, *full_rest)` whose dim 0 is split over
other axes of total size B (1 when it is not) is `(B * P * shard_rows, *full_rest)`: the B blocks of
dim 0 one after another, each padded to `P * shard_rows` rows, sharded by the combined spec
`P((*dim0_axes, axis), *rest_of_spec)` (`Layout.spec`): the other axes major, `axis` minor, so the
device at (block b, rank r) holds rank r's shard of block b, `(shard_rows, *block_rest)` inside
shard_map. A 0-d parameter: `(P,)`. With every spec `P()` (pure FSDP) this is
`(P * shard_rows, *rest)` sharded `P(axis)`, replicated over the mesh's other axes.

Meshes with several axes: ranks run along `axis`; the devices that share their coordinates on every
other axis form one group, and each group runs its own collective (on its own blocks). The device
map passed to the native library (`device_ordinals`, `device_ranks`, `device_groups`) says, for
every local device of the mesh (a CPU mesh over several processes: every device, the same program
in each process, `Layout._build_device_map`), its XLA device ordinal (CPU: the global device id;
GPU: `local_hardware_id`), its rank and its group.

Replicas (`replicas=`, HSDP): mesh axes the batch is split over while the shards are replicated over
them (a data axis). `gather_params` / `scan_layers` type the gathered parameters as varying over
them and sum the fp32 gradient shards over them after the reduce-scatter, instead of letting JAX
reduce the parameter cotangent there in the compute dtype. Default: with no spec given and none
carried, every other mesh axis (pure FSDP and HSDP, unchanged); otherwise none (README "Meshes with
several axes").

Public API for the modules above (docs/design.md "Layers", item 4): `Layout`, `ParamInfo`, `layout`,
`shard_map`, `topology_from_env`, `dtype_bits` (bits per element: the drop-in refuses sub-byte
dtypes), and the front doors' `crop_blocks`, `pad_blocks`, `spec_leaves`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _distributed, _settings

__all__ = ["Layout", "ParamInfo", "layout", "shard_map", "topology_from_env"]

_LAYOUTS: "weakref.WeakSet" = weakref.WeakSet()  # live layouts, for shard_map's in_specs hints


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter's sharding. Sizes in elements / rows of its local block (the full parameter
    with every dim divided by the other mesh axes its spec names; the full parameter under P())."""

    path: str  # pytree key path, e.g. "['layers'][0]['wq']"; how errors name the parameter
    shape: tuple[int, ...]  # full (unsharded) shape
    dtype: np.dtype
    rows: int  # dim 0 of the local block (1 for 0-d)
    row_elems: int  # product of the local block's other dims
    shard_rows: int  # ceil(rows / world)
    world: int
    spec: PartitionSpec = PartitionSpec()  # how the full parameter is split over the other axes
    block: tuple[int, ...] | None = None  # the local block's shape (None: the full shape)
    blocks: int = 1  # how many blocks dim 0 is split into by the other axes (their sizes' product)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The local block: what the all-gather returns inside shard_map, and the gradient's shape."""
        return self.shape if self.block is None else self.block

    @property
    def rest(self) -> tuple[int, ...]:
        return self.local_shape[1:]

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Local shard inside shard_map: (shard_rows, *rest)."""
        return (self.shard_rows, *self.rest)

    @property
    def padded_rows(self) -> int:
        """Rows of one block's shards together: world * shard_rows."""
        return self.world * self.shard_rows

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The sharded global array: (blocks * world * shard_rows, *full_rest); 0-d: (world,)."""
        return (self.blocks * self.padded_rows, *self.shape[1:])

    def owned_rows(self, rank: int) -> tuple[int, int]:
        """Rows of the local block that rank owns."""
        start = min(rank * self.shard_rows, self.rows)
        end = min((rank + 1) * self.shard_rows, self.rows)
        return start, end

    def describe(self) -> str:
        spec = f", spec {self.spec}" if tuple(self.spec) else ""
        return f"parameter {self.path or '<root>'} (shape {self.shape}, {np.dtype(self.dtype).name}{spec})"


def topology_from_env(world: int) -> tuple[int, int]:
    """(nodes, gpus_per_node): single node unless TIDE_TOPOLOGY=NxG says otherwise (validated)."""
    return _settings.topology(world) or (1, world)


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


def dtype_bits(dtype: np.dtype) -> int:
    """Bits per element: fewer than 8 for the packed types (int4, uint4, int2, float4_e2m1fn, ...),
    whose NumPy itemsize (1) says nothing of how XLA stores them."""
    for info in (jnp.iinfo, jnp.finfo):
        try:
            return int(info(dtype).bits)
        except (TypeError, ValueError):
            pass
    return 8 * dtype.itemsize


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
        if np_dtype != np.dtype(bool) and not jnp.issubdtype(np_dtype, jnp.number):
            raise TypeError(f"tide: layout: leaf {name} has dtype {np_dtype} (not numbers); {_STATE_HINT}")
        if dtype_bits(np_dtype) < 8:
            raise TypeError(
                f"tide: layout: leaf {name} has dtype {np_dtype}, {dtype_bits(np_dtype)} bits per element: XLA may "
                "pack such elements several to a byte, and tide moves whole bytes per element; store it as "
                "int8 / uint8 / float8 and convert inside the step"
            )
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


def _spec_entries(spec) -> tuple:
    """A PartitionSpec's entries as tuples of axis names (None / () -> ())."""
    return tuple(_spec_axes(e) for e in tuple(spec))


def _as_spec(dim_axes) -> PartitionSpec:
    """Entries (tuples of axis names per dim) -> a PartitionSpec, trailing unsplit dims dropped."""
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in dim_axes]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _carried_spec(leaf):
    """The PartitionSpec of the NamedSharding an array (or ShapeDtypeStruct) carries, else None."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return None


def _resolve_spec(path: str, shape: tuple, spec, carried: bool, mesh: Mesh, axis: str) -> tuple:
    """One parameter's spec over the mesh's other axes, checked: per dim, the tuple of mesh axes
    that split it. Refuses (naming the parameter and the axis) a spec longer than the parameter's
    rank, an axis the mesh does not have, `axis` itself (an explicit spec; a carried NamedSharding's
    `axis` entries are dropped: tide's dim-0 rule replaces them), an axis named twice and a dim its
    axes do not divide."""
    name = path or "<root>"
    where = "its NamedSharding's spec" if carried else "its spec"
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"tide: layout: parameter {name}: specs must hold PartitionSpecs (or None), got "
                        f"{type(spec).__name__} {spec!r}")
    raw = tuple(spec)
    if len(raw) > len(shape):
        raise ValueError(
            f"tide: layout: parameter {name} (shape {shape}): {where} {spec} has {len(raw)} entries, more than "
            f"its {len(shape)} dims")
    dims, seen = [], {}
    for d, entry in enumerate(raw + (None,) * (len(shape) - len(raw))):
        if entry is PartitionSpec.UNCONSTRAINED:
            raise ValueError(f"tide: layout: parameter {name}: {where} {spec} leaves dim {d} unconstrained; "
                             "say how it is split (None: not split)")
        axes = _spec_axes(entry)
        kept = []
        for a in axes:
            if a not in mesh.axis_names:
                raise ValueError(
                    f"tide: layout: parameter {name}: {where} {spec} names axis {a!r}, which the mesh does not "
                    f"have (axes {tuple(mesh.axis_names)})")
            if a == axis:
                if carried:
                    continue
                raise ValueError(
                    f"tide: layout: parameter {name}: its spec {spec} names axis {axis!r}, the axis tide shards "
                    f"over: a spec says how the parameter is split over the mesh's other axes; tide shards "
                    f"each local block's dim 0 over {axis!r} itself (leave {axis!r} out)")
            if a in seen:
                raise ValueError(
                    f"tide: layout: parameter {name}: {where} {spec} names axis {a!r} twice (dims {seen[a]} and {d})")
            seen[a] = d
            kept.append(a)
        size = math.prod(int(mesh.shape[a]) for a in kept)
        if shape[d] % size:
            raise ValueError(
                f"tide: layout: parameter {name} (shape {shape}): dim {d} ({shape[d]}) does not divide by mesh "
                f"axes {tuple(kept)} of size {size} ({where} {spec}): a local block must be whole")
        dims.append(tuple(kept))
    return tuple(dims)


def spec_leaves(specs, tree, count: int, what: str) -> list:
    """The spec (or None) of every leaf of `tree` (`count` of them): `specs` is a pytree matching
    `tree` or a prefix of it (a PartitionSpec or None standing for a whole subtree)."""
    if specs is None:
        return [None] * count
    is_spec = lambda x: x is None or isinstance(x, PartitionSpec)  # noqa: E731
    # A plain tuple or list of axis names where a spec belongs (`(None, "tensor")`) is a pytree node
    # to JAX, so it would fail the match below with a message naming no parameter: name it here.
    looks_like_spec = lambda x: (isinstance(x, (tuple, list)) and not hasattr(x, "_fields") and len(x) > 0  # noqa: E731
                                 and all(e is None or isinstance(e, str) for e in x) and any(isinstance(e, str) for e in x))
    for kp, x in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: is_spec(x) or looks_like_spec(x))[0]:
        if looks_like_spec(x):
            raise ValueError(
                f"tide: {what}: the spec at {jax.tree_util.keystr(kp) or '<root>'} is a {type(x).__name__} {x!r}, not a "
                f"PartitionSpec: write jax.sharding.PartitionSpec{tuple(x)!r}")
    spec_leaves_, spec_tree = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    try:
        subtrees = spec_tree.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"tide: {what}: specs must be a pytree of PartitionSpecs matching it or a prefix of it: "
            f"{str(e).splitlines()[0]}") from None
    out = []
    for spec, sub in zip(spec_leaves_, subtrees):
        out.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
    if len(out) != count:  # pragma: no cover - flatten_up_to guarantees it
        raise ValueError(f"tide: {what}: specs do not match")
    return out


class Layout:
    """The sharding of a pytree of parameters over `axis` of `mesh`. Build with `tide_jax.layout`."""

    def __init__(self, abstract_params, mesh: Mesh, axis: str, topology=None, _prefix: str = "", specs=None,
                 replicas=None):
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
            self.nodes, self.gpus_per_node = _settings.parse_topology(topology, self.world)
        self._prefix = _prefix
        self._job: int | None = None

        leaves_with_path, self.treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
        if not leaves_with_path:
            raise ValueError("tide: empty parameter pytree: nothing to shard")
        for key_path, leaf in leaves_with_path:
            _check_leaf(_prefix + jax.tree_util.keystr(key_path), leaf)
        given = spec_leaves(specs, abstract_params, len(leaves_with_path), "layout: the parameters' specs")
        self.abstract = jax.tree_util.tree_unflatten(
            self.treedef, [_abstract(x) for _, x in leaves_with_path]
        )
        params = []
        named = {}  # other mesh axis -> the first parameter whose spec names it
        for (key_path, leaf), spec in zip(leaves_with_path, given):
            a = _abstract(leaf)
            path = _prefix + jax.tree_util.keystr(key_path)
            shape = tuple(int(d) for d in a.shape)
            carried = spec is None and _carried_spec(leaf) is not None
            dims = _resolve_spec(path, shape, spec if spec is not None else (_carried_spec(leaf) or PartitionSpec()),
                                 carried, mesh, axis)
            for d in dims:
                for ax in d:
                    named.setdefault(ax, path or "<root>")
            block = tuple(n // math.prod(int(mesh.shape[ax]) for ax in d) for n, d in zip(shape, dims))
            rows = block[0] if block else 1
            params.append(
                ParamInfo(
                    path=path,
                    shape=shape,
                    dtype=np.dtype(a.dtype),
                    rows=rows,
                    row_elems=math.prod(block[1:]),
                    shard_rows=-(-rows // self.world),
                    world=self.world,
                    spec=_as_spec(dims),
                    block=block,
                    blocks=math.prod(int(mesh.shape[ax]) for ax in dims[0]) if dims else 1,
                )
            )
        self.params: tuple[ParamInfo, ...] = tuple(params)
        self.replicas = self._check_replicas(replicas, named, specs is None and not named)
        self.sharding = NamedSharding(mesh, PartitionSpec(axis))  # of a parameter under P()
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self._device_map = self._build_device_map()
        _LAYOUTS.add(self)

    def _check_replicas(self, replicas, named: dict, legacy: bool) -> tuple:
        """The replica axes (HSDP), checked: mesh axes, not `axis`, named by no parameter's spec."""
        others = tuple(a for a in self.mesh.axis_names if a != self.axis)
        if replicas is None:
            return others if legacy else ()
        replicas = (replicas,) if isinstance(replicas, str) else tuple(replicas)
        for a in replicas:
            if a not in self.mesh.axis_names:
                raise ValueError(f"tide: layout: replicas names axis {a!r}, which the mesh does not have "
                                 f"(axes {tuple(self.mesh.axis_names)})")
            if a == self.axis:
                raise ValueError(f"tide: layout: replicas names {a!r}, the axis tide shards over; replicas are the "
                                 "other axes the shards are copied over (a data axis)")
            if a in named:
                raise ValueError(f"tide: layout: replicas names axis {a!r}, but parameter {named[a]}'s spec splits "
                                 f"it over {a!r}: an axis the shards are replicated over cannot also split them")
        return tuple(sorted(set(replicas), key=list(self.mesh.axis_names).index))

    # ----- the device map (FFI attributes) -----
    def _build_device_map(self):
        names = list(self.mesh.axis_names)
        axis_pos = names.index(self.axis)
        devices = np.asarray(self.mesh.devices)
        other_dims = [devices.shape[i] for i in range(devices.ndim) if i != axis_pos]
        ordinals, ranks, groups = [], [], []
        process = jax.process_index()
        flat = list(devices.flat)
        # A CPU mesh over several processes lists every device of the mesh, in every process, so
        # that every process compiles the same program: XLA:CPU of jax 0.12.1 hangs in the first
        # gloo collective of programs that differ between processes (even pure-JAX ones differing
        # in a constant; it matches collectives by the executable). With `job` set the native
        # library reads only the executing device's entry (CPU ordinals are global device ids,
        # distinct across processes). Otherwise (GPUs: ordinals are local_hardware_ids) this
        # process's devices.
        everywhere = (all(d.platform == "cpu" for d in flat)
                      and len({getattr(d, "process_index", process) for d in flat}) > 1)
        for idx in np.ndindex(*devices.shape):
            d = devices[idx]
            if getattr(d, "process_index", process) != process and not everywhere:
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

    def param_spec(self, p: ParamInfo, stacked: bool = False) -> PartitionSpec:
        """The combined spec of one parameter's global shard array: dim 0 over its other axes (major)
        and `axis` (minor), the other dims as its spec says; `stacked`: a layer axis first."""
        dims = _spec_entries(p.spec) + ((),) * (len(p.shape) - len(tuple(p.spec)))
        first = (*dims[0], self.axis) if dims else (self.axis,)
        spec = _as_spec((first, *dims[1:]))
        return PartitionSpec(None, *spec) if stacked else spec

    @property
    def spec(self):
        """Pytree of the shards' PartitionSpecs, for shard_map's in_specs / out_specs: P(axis) for a
        parameter under P(); P((*dim0_axes, axis), *rest_of_spec) for one split over other axes."""
        return self._tree(self.param_spec(p) for p in self.params)

    @property
    def specs(self):
        """Pytree of the parameters' own PartitionSpecs over the other axes (how the full parameters
        are split: `specs=` as resolved, P() for replicated)."""
        return self._tree(p.spec for p in self.params)

    @property
    def shardings(self):
        """Pytree of the NamedShardings (`spec`) of the sharded global arrays."""
        return self._tree(NamedSharding(self.mesh, self.param_spec(p)) for p in self.params)

    @property
    def global_shapes(self):
        """Pytree of ShapeDtypeStructs of the sharded global arrays (blocks * world * shard_rows, *rest)."""
        return self._tree(
            jax.ShapeDtypeStruct(p.global_shape, p.dtype, sharding=NamedSharding(self.mesh, self.param_spec(p)))
            for p in self.params
        )

    @property
    def shard_shapes(self):
        """Pytree of ShapeDtypeStructs of the local shards seen inside shard_map."""
        return self._tree(jax.ShapeDtypeStruct(p.shard_shape, p.dtype) for p in self.params)

    @property
    def local_shapes(self):
        """Pytree of ShapeDtypeStructs of the local blocks: what `all_gather` / `gather_params`
        return inside shard_map (the full parameters when every spec is P())."""
        return self._tree(jax.ShapeDtypeStruct(p.local_shape, p.dtype) for p in self.params)

    # ----- sharding and unsharding -----
    def _leaves_matching(self, tree, what: str):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"tide: {what} has pytree structure {treedef}, the layout has {self.treedef}"
            )
        return leaves

    def shard(self, params):
        """Full parameters (replicated, or split as their specs say) -> the global shard arrays
        (blocks * world * shard_rows, *rest): each block zero-padded, sharded as `spec`."""
        leaves = self._leaves_matching(params, "params passed to shard()")
        for p, x in zip(self.params, leaves):
            shape = tuple(np.shape(x))
            if shape != p.shape:
                raise ValueError(f"tide: shard(): {p.describe()} got an array of shape {shape}")
        return self._tree(self._jitted("shard", ())(leaves))

    def unshard(self, sharded):
        """Global shard arrays -> full parameters in their original shapes (padding dropped), sharded
        as their specs say (replicated under P())."""
        leaves = self._leaves_matching(sharded, "arrays passed to unshard()")
        for p, x in zip(self.params, leaves):
            shape = tuple(np.shape(x))
            if shape != p.global_shape:
                raise ValueError(
                    f"tide: unshard(): {p.describe()}: expected a sharded array of shape "
                    f"{p.global_shape}, got {shape}"
                )
        return self._tree(self._jitted("unshard", ())(self._placed_for_crop(leaves, ())))

    # ----- stacked layers (tide_jax.scan_layers) -----
    @property
    def stacked_spec(self):
        """Pytree of `spec` with a layer axis first (PartitionSpec(None, axis) under P()): in_specs /
        out_specs of stacked shards `(L, *global_shape)` (`shard_stacked`), sharded from dim 1 on."""
        return self._tree(self.param_spec(p, stacked=True) for p in self.params)

    def shard_stacked(self, stacked_params):
        """Stacked full parameters `(L, *shape)` (this layout's pytree, a leading layer axis on every
        leaf) -> global arrays `(L, *global_shape)`, zero-padded per layer and block, sharded as
        `stacked_spec`: what `scan_layers` takes."""
        leaves = self._leaves_matching(stacked_params, "params passed to shard_stacked()")
        num = _num_layers(leaves, self.params, "shard_stacked()", lambda p: p.shape)
        return self._tree(self._jitted("shard", (num,))(leaves))

    def unshard_stacked(self, stacked_sharded):
        """Inverse of `shard_stacked`: `(L, *global_shape)` -> `(L, *shape)`."""
        leaves = self._leaves_matching(stacked_sharded, "arrays passed to unshard_stacked()")
        num = _num_layers(leaves, self.params, "unshard_stacked()", lambda p: p.global_shape)
        return self._tree(self._jitted("unshard", (num,))(self._placed_for_crop(leaves, (num,))))

    def _full_sharding(self, p: ParamInfo, lead: tuple) -> NamedSharding:
        """How a full parameter (with `lead` layer axes) is placed: split as its spec says."""
        return NamedSharding(self.mesh, PartitionSpec(*([None] * len(lead)), *p.spec))

    def _jitted(self, what: str, lead: tuple):
        """One compiled function for the whole pytree: "shard" (full -> global shard arrays) or
        "unshard" (the inverse), for parameters with `lead` layer axes; cached on the layout."""
        cache = self.__dict__.setdefault("_jit_cache", {})
        key = (what, lead)
        if key not in cache:
            if what == "shard":
                fns = [pad_blocks(p, lead) for p in self.params]
                shardings = [NamedSharding(self.mesh, self.param_spec(p, stacked=bool(lead))) for p in self.params]
            else:
                fns = [crop_blocks(p, lead) for p in self.params]
                shardings = [self._full_sharding(p, lead) for p in self.params]
            cache[key] = jax.jit(lambda xs: [f(x) for f, x in zip(fns, xs)], out_shardings=shardings)
        return cache[key]

    def _placed_for_crop(self, leaves, lead: tuple) -> list:
        # Placed as the result first (dim 0 split over the block axes only, which divide it): slicing a
        # sharded dim to a size the mesh does not divide is not expressible under explicit sharding.
        return [jax.device_put(x, self._full_sharding(p, lead)) for p, x in zip(self.params, leaves)]

    # ----- sub-layouts -----
    def __getitem__(self, key) -> "Layout":
        sub = self.abstract[key]
        if isinstance(key, int) and hasattr(self.abstract, "_fields"):  # a namedtuple: JAX names it .field
            entry = jax.tree_util.GetAttrKey(self.abstract._fields[key])
        else:
            entry = jax.tree_util.SequenceKey(key) if isinstance(key, int) else jax.tree_util.DictKey(key)
        prefix = self._prefix + jax.tree_util.keystr((entry,))
        return Layout(sub, self.mesh, self.axis, topology=self._topology_arg, _prefix=prefix,
                      specs=self.specs[key], replicas=self.replicas)

    def _subset(self, indices) -> "Layout":
        """The layout of some of this one's parameters, as a list (the same paths, mesh, device map
        and job): what a collective over part of a group runs on (a backward that reduces only the
        floating leaves)."""
        indices = list(indices)
        self.job  # resolved once, on this layout (a multi-process job's set-up)
        sub = object.__new__(Layout)
        sub.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_jit_cache", "_nonempty_cache")})
        sub.params = tuple(self.params[i] for i in indices)
        sub.treedef = jax.tree_util.tree_structure([0] * len(indices))
        leaves = jax.tree_util.tree_leaves(self.abstract)
        sub.abstract = [leaves[i] for i in indices]
        return sub

    def _nonempty(self):
        """(indices, layout) of the parameters with elements when some have none (a dim of size 0),
        else None. The native library moves no empty parameter: tide's calls run on this subset and
        the empty ones' results are made where they are needed (empty arrays of their shapes)."""
        if "_nonempty_cache" not in self.__dict__:
            idx = [i for i, p in enumerate(self.params) if p.rows * p.row_elems > 0]
            self._nonempty_cache = None if len(idx) == len(self.params) else (idx, self._subset(idx) if idx else None)
        return self._nonempty_cache

    def same_mesh(self, other: "Layout") -> bool:
        return self.mesh == other.mesh and self.axis == other.axis

    def __len__(self) -> int:
        return len(self.params)

    def __repr__(self) -> str:
        replicas = f", replicas={self.replicas}" if self.replicas else ""
        lines = [
            f"Layout(axis={self.axis!r}, world={self.world}, topology={self.nodes}x{self.gpus_per_node}, "
            f"{len(self.params)} params{replicas})"
        ]
        for p in self.params:
            split = "" if not tuple(p.spec) else f" {p.spec} -> block {p.local_shape}"
            lines.append(f"  {p.path or '<root>'}: {p.shape} {p.dtype.name}{split} -> shard {p.shard_shape}")
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


def pad_blocks(p: ParamInfo, lead: tuple = ()):
    """A traceable function: a full parameter `(*lead, *shape)` -> its global shard array
    `(*lead, *global_shape)`, dim 0 cut into its blocks, each zero-padded to world * shard_rows rows."""
    rest = p.shape[1:]

    def pad(x):
        x = jnp.reshape(jnp.asarray(x, p.dtype), (*lead, p.blocks, p.rows, *rest))
        pad_rows = p.padded_rows - p.rows
        if pad_rows:
            x = jnp.pad(x, [(0, 0)] * (len(lead) + 1) + [(0, pad_rows)] + [(0, 0)] * len(rest))
        return jnp.reshape(x, (*lead, *p.global_shape))

    return pad


def crop_blocks(p: ParamInfo, lead: tuple = ()):
    """The inverse of `pad_blocks`: `(*lead, *global_shape)` -> `(*lead, *shape)`, padding dropped."""
    rest = p.shape[1:]

    def crop(x):
        x = jnp.reshape(x, (*lead, p.blocks, p.padded_rows, *rest))
        x = jax.lax.slice_in_dim(x, 0, p.rows, axis=len(lead) + 1)
        return jnp.reshape(x, (*lead, *p.shape))

    return crop


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
                split = [math.prod(int(mesh.shape[a]) for a in _spec_axes(e) if a in mesh.shape) for e in entries]
                stacked_with_spec = (
                    len(entries) >= 1 and lay.axis in _spec_axes(entries[0]) and len(shape) >= 1
                    and shape[1:] == p.global_shape and shape[0] % split[0] != 0
                )
                if stacked_with_spec:
                    raise ValueError(
                        f"tide: shard_map in_specs: an argument of shape {shape} is the stacked shards of "
                        f"{p.describe()} (L = {shape[0]} layers of {p.global_shape}), but its spec "
                        f"{spec} splits the layer axis over {split[0]} devices: use in_specs=lay.stacked_spec "
                        "(PartitionSpec(None, axis)) for stacked shards, lay.spec for one layer's"
                    )
                flat_with_stacked = (
                    shape == p.global_shape and len(entries) >= 2 and entries[0] is None
                    and lay.axis in _spec_axes(entries[1]) and (len(shape) < 2 or shape[1] % split[1] != 0)
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


def layout(params: Any, mesh: Mesh, axis: str, *, specs=None, replicas=None, topology=None) -> Layout:
    """The layout of `params` (a pytree of arrays or ShapeDtypeStructs with full shapes) on `axis`.

    `specs`: a pytree matching `params` (or a prefix of it) of PartitionSpecs over the mesh's other
    axes saying how each full parameter is already split (`P(None, "tensor")`, `P("expert")`, `P()`
    for replicated; None: the NamedSharding the array carries, if any, else `P()`). tide shards each
    parameter's local block along dim 0 over `axis` (module docstring). Refused before anything runs,
    naming the parameter and the axis: a spec naming `axis` itself, an axis the mesh does not have,
    an axis named twice, a dim its axes do not divide.
    `replicas`: the mesh axes the shards are replicated over while the batch is split over them
    (HSDP: a data axis; fp32 gradient shards summed over them). Default: every other axis when no
    spec is given or carried (pure FSDP), else none.
    `topology` ("NxG" or (nodes, gpus_per_node)) overrides TIDE_TOPOLOGY; default: one node.
    """
    return Layout(params, mesh, axis, topology=topology, specs=specs, replicas=replicas)
