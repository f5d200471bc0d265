"""Sharded orbax checkpoints of examples/llama.py's training state.

Every process writes its own devices' shards (no gather to one host), asynchronously (orbax's
`CheckpointManager`: the device-to-host copy happens in `save`, the writes run behind the next
training steps), and every array is stored in its *logical* shape: the model's own shapes, without
the FSDP padding rows (FSDP2's dim-0 rule pads a parameter's rows to `P * ceil(rows / P)`, so the
padded shapes depend on the device count). So plain orbax, or anything that reads orbax's
tensorstore arrays, reads the checkpoint without tide, and a restore can land on any device count.

On disk, a `CheckpointManager` directory (`DIR/<step>/`, written atomically, finished ones only):
    state/  PyTree item: {"params": {"embed": {...}, "layers": {...}, "head": {...}}, "opt": optax's
            state}; every leaf an array in its logical shape (`layers.wq`: (L, d, H*hd), fp32; the
            AdamW moments like the parameters; the step counters as 0-d int32)
    meta/   JSON item: step, model, config, global batch, data, seed, devices saved on, ...

Saving: each addressable shard (replica 0 of it, so a replicated leaf is written once) is cropped to
the logical bounds (padding rows dropped; a shard that is all padding writes nothing) and written at
its index into the logical array. The write unit is the padded shard (every zarr chunk lies in one
device's shard, so no two processes write the same chunk). orbax's `ArrayHandler` writes the shards of a
`jax.Array`, whose shape must divide evenly by the mesh, which the logical shapes do not: so
`LogicalArrayHandler` (below) crops the shards itself and hands them to orbax's own writer. It
records the arrays as ordinary `jax.Array`s: reading needs only stock orbax.

Restoring: orbax reads, for every device of the new mesh, the rows of its padded shard from the
logical array (zero-filled beyond the logical rows: `ArrayRestoreArgs(strict=False)`), so each
process reads only its own rows and the padding comes back as the zeros FSDP expects.

Blocks (meshes with a "tensor" or "expert" axis, examples/llama.py): a parameter whose padded dim is
also split over another axis (a row-parallel weight, the experts) is padded per block, so its
padding lies between the blocks, not only at the end. Its logical ShapeDtypeStruct carries the
sharding of the full array (how many blocks each dim has); saving maps each shard's rows to the
logical rows of its block, in write chunks that never straddle two devices' rows (the gcd of the
shard's and the block's rows); restoring reads every block whole onto the devices of that block (each
device reads its block, the FSDP axis' size times its shard) and pads each block on the devices.
Logical arrays without such blocks take the path above.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

# orbax internals `LogicalArrayHandler` uses (tested with orbax-checkpoint 0.12.8, what CI pins): the
# writer of host-side shard pieces behind `ArrayHandler.serialize`, the per-array metadata store,
# and ArrayHandler's settings (`_primary_host`, `_metadata_key`, `_array_metadata_store`).
from orbax.checkpoint._src.metadata import array_metadata_store as _array_metadata_store
from orbax.checkpoint._src.serialization import jax_array_handlers as _jax_array_handlers

_write_pieces = getattr(_jax_array_handlers, "_async_serialize_replica_slices", None)
if _write_pieces is None:  # pragma: no cover
    raise ImportError(f"examples/checkpoint.py: orbax-checkpoint {getattr(ocp, '__version__', '?')} has no "
                      "_async_serialize_replica_slices (the writer this file uses); tested with 0.12.8")

STATE, META = "state", "meta"


# ----------------------------------------------------------------------------------------------
# saving arrays in their logical shapes
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Logical:
    """A global array saved as its logical array: along each dim, `blocks[d]` blocks, each the leading
    part (shape[d] / blocks[d] of array.shape[d] / blocks[d]) of its padded block (the rest is padding).
    One block per dim: the logical array is the array's leading `shape` part."""

    array: jax.Array
    shape: tuple[int, ...]
    blocks: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.array.ndim and not self.shape:
            raise ValueError("checkpoint: 0-d parameters (sharded as (P,) arrays) are not supported")
        blocks = self.blocks or (1,) * len(self.shape)
        if (len(self.shape) != self.array.ndim or len(blocks) != len(self.shape)
                or any(s > g or s % k or g % k for s, g, k in zip(self.shape, self.array.shape, blocks))):
            raise ValueError(f"checkpoint: logical shape {self.shape} in blocks {blocks} is not a part of "
                             f"{self.array.shape}")
        object.__setattr__(self, "blocks", tuple(blocks))


def blocks_of(logical, padded_shape) -> tuple:
    """Per dim, how many blocks the padded dims of a logical ShapeDtypeStruct have: the shards of its
    own sharding (a full array split over "tensor" / "expert") along a dim the padding changes; 1
    elsewhere (and without a sharding)."""
    shape = tuple(logical.shape)
    sharding = getattr(logical, "sharding", None)
    if sharding is None or shape == tuple(padded_shape):
        return (1,) * len(shape)
    shard = sharding.shard_shape(shape)
    return tuple(n // s if n != g else 1 for n, s, g in zip(shape, shard, padded_shape))


@dataclasses.dataclass(frozen=True)
class _Piece:
    index: tuple[slice, ...]  # where it goes in the logical array
    value: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """This process's pieces of one logical array, on the host; what orbax's writer consumes
    (the interface of orbax's `ReplicaSlices`, pieces of different shapes allowed)."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # the write chunk: the padded shard's shape
    dtype: np.dtype
    sharding: Any
    pieces: list
    is_on_host: bool = True

    @dataclasses.dataclass(frozen=True)
    class _Fragments:
        fragments: list

    def to_fragments(self):
        return self._Fragments(self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.value.nbytes for p in self.pieces)


def _logical_bounds(index, padded_shape, v: Logical) -> list:
    """The logical rows [lo, hi) of one shard's index in the padded array, per dim (empty: padding)."""
    bounds = []
    for s, g, n, k in zip(index, padded_shape, v.shape, v.blocks):
        lo, hi = s.start or 0, g if s.stop is None else s.stop
        block, padded, kept = lo // (g // k), g // k, n // k
        if hi > (block + 1) * padded:
            raise ValueError(f"checkpoint: a shard {lo}:{hi} spans blocks of {padded} rows")
        first = block * kept
        bounds.append((first + min(lo - block * padded, kept), first + min(hi - block * padded, kept)))
    return bounds


def _pieces(v: Logical, copies: list) -> _Pieces:
    arr = v.array
    pieces = []
    for shard, host in copies:
        bounds = _logical_bounds(shard.index, arr.shape, v)
        if any(hi <= lo for lo, hi in bounds):
            continue  # all padding
        value = host[(*(slice(0, hi - lo) for lo, hi in bounds), ...)]  # an ndarray, 0-d too
        pieces.append(_Piece(tuple(slice(lo, hi) for lo, hi in bounds), value))
    # the write chunk: every chunk within one device's rows (blocks: the gcd of shard and block rows)
    local = tuple(min(s, n) if k == 1 else math.gcd(s, n // k)
                  for s, n, k in zip(arr.sharding.shard_shape(arr.shape), v.shape, v.blocks))
    return _Pieces(tuple(v.shape), local, np.dtype(arr.dtype), arr.sharding, pieces)


def _to_host(values) -> list[list]:
    """(shard, host copy) of the shards this process writes (replica 0), all copies started first.
    A host copy that may alias the device buffer (CPU) is copied: the caller may donate the arrays
    (the training step does) while the write is still running."""
    mine = [[s for s in v.array.addressable_shards if s.replica_id == 0] for v in values]
    for shards in mine:
        for s in shards:
            s.data.copy_to_host_async()
    out = []
    for shards in mine:
        row = []
        for s in shards:
            host = np.asarray(s.data)
            if s.data.device.platform == "cpu":
                host = np.array(host, copy=True)
            row.append((s, host))
        out.append(row)
    return out


class LogicalArrayHandler(ocp.type_handlers.ArrayHandler):
    """orbax's `ArrayHandler` for `Logical` values: writes each array in its logical shape from this
    process's shards. Its typestr is the stock "jax.Array" one, and restoring is the stock
    `ArrayHandler.deserialize`."""

    def __init__(self):
        super().__init__(array_metadata_store=_array_metadata_store.Store(), enable_write_sharding_file=False)

    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        for v, info in zip(values, infos):
            if not isinstance(v, Logical):
                raise TypeError(f"checkpoint: {info.name}: expected a checkpoint.Logical, got {type(v).__name__}")
        host = [_pieces(v, copies) for v, copies in zip(values, _to_host(values))]

        async def write():
            await _write_pieces(
                host, infos, args, primary_host=self._primary_host, metadata_key=self._metadata_key,
                array_metadata_store=self._array_metadata_store, enable_replica_parallel_separate_folder=False,
                use_replica_parallel=False, ext_metadata={})

        return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="logical_array_handler")]


def type_handler_registry():
    """orbax's default type handlers plus `Logical` (registered first: "jax.Array" restores through the
    stock handler)."""
    handlers = [(Logical, LogicalArrayHandler())]
    handlers += [(ty, ocp.type_handlers.get_type_handler(ty)) for ty in ocp.type_handlers.supported_types()]
    return ocp.type_handlers.create_type_handler_registry(*handlers)


# ----------------------------------------------------------------------------------------------
# the run's checkpoints: a CheckpointManager directory
# ----------------------------------------------------------------------------------------------
def _handlers():
    return {STATE: ocp.PyTreeCheckpointHandler(type_handler_registry=type_handler_registry()),
            META: ocp.JsonCheckpointHandler()}


class Checkpoints:
    """Checkpoints of one run in `directory` (an orbax `CheckpointManager`: `directory/<step>/`).
    `save` returns once this process's shards are on the host; the writes finish in the background
    (the next `save`, `wait` and `close` wait for them)."""

    def __init__(self, directory: str, *, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=not read_only,
                                               read_only=read_only)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())

    def save(self, step: int, state, logical, meta: dict) -> None:
        """`logical`: `state`'s tree of ShapeDtypeStructs in the logical shapes (what is stored), with
        the full arrays' shardings where their padded dims are split in blocks (module docstring)."""
        if step in self.manager.all_steps():
            raise FileExistsError(f"checkpoint: {self.directory} already has a checkpoint of step {step}")
        tree = jax.tree.map(lambda x, lg: Logical(x, tuple(lg.shape), blocks_of(lg, x.shape)), state, logical)
        self.manager.save(step, force=True, args=ocp.args.Composite(
            **{STATE: ocp.args.PyTreeSave(tree), META: ocp.args.JsonSave(meta)}))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()  # waits for the writes in flight


def locate(path: str) -> tuple[str, int]:
    """(manager directory, step) of `path`: a checkpoint directory `DIR/<step>`, or a manager
    directory `DIR` (its latest finished checkpoint)."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, STATE)):
        return os.path.dirname(path), int(base)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint: no checkpoint directory {path}")
    step = _reader(path).latest_step()
    if step is None:
        raise FileNotFoundError(f"checkpoint: no finished checkpoint in {path} (holds {sorted(os.listdir(path))})")
    return path, step


def _reader(root: str):
    return ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers())


def read_meta(path: str) -> dict:
    """The JSON meta of the checkpoint at `path` (see `locate`), with its "step"."""
    root, step = locate(path)
    mngr = _reader(root)
    return dict(mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META])


def stored_shapes(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{orbax name: (shape, dtype)} of the state arrays in the checkpoint at `path` (see `locate`)."""
    return _stored_shapes(*locate(path))


def _stored_shapes(root: str, step: int):
    meta = ocp.PyTreeCheckpointer().metadata(os.path.join(root, str(step), STATE)).item_metadata.tree
    flat, _ = jax.tree_util.tree_flatten_with_path(meta)
    return {leaf_name(k): (tuple(m.shape), str(np.dtype(m.dtype))) for k, m in flat}


def leaf_name(key_path) -> str:
    """orbax's name of a leaf: the keys joined by '.'."""
    parts = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def restore(path: str, target, logical):
    """The state at `path` (see `locate`) on `target`'s devices: `target` is the state's tree of
    ShapeDtypeStructs (or arrays) with the shapes and shardings wanted (padded for this mesh);
    `logical` the same tree in the logical shapes, checked against the checkpoint's. Each process
    reads the rows of its own devices' shards; rows past the logical ones are zeros. Returns
    (state, meta)."""
    root, step = locate(path)
    stored = _stored_shapes(root, step)
    want = {leaf_name(k): (tuple(x.shape), str(np.dtype(x.dtype)))
            for k, x in jax.tree_util.tree_flatten_with_path(logical)[0]}
    if stored != want:
        missing = sorted(set(want) - set(stored))
        extra = sorted(set(stored) - set(want))
        differ = sorted(k for k in set(want) & set(stored) if want[k] != stored[k])
        raise ValueError(f"checkpoint: {root}/{step} does not hold this state: missing {missing[:5]}, unexpected "
                         f"{extra[:5]}, different {[(k, stored[k], want[k]) for k in differ[:5]]}")
    targets, treedef = jax.tree.flatten(target)
    logicals = jax.tree.leaves(logical)
    blocks = [blocks_of(lg, t.shape) for t, lg in zip(targets, logicals)]
    # leaves padded in blocks are read whole, as their blocks (the full array's sharding), then padded
    read = [jax.ShapeDtypeStruct(lg.shape, t.dtype, sharding=lg.sharding) if max(b, default=1) > 1 else t
            for t, lg, b in zip(targets, logicals, blocks)]
    restore_args = [ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=tuple(t.shape), dtype=t.dtype, strict=False)
                    for t in read]
    mngr = _reader(root)
    out = mngr.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.PyTreeRestore(item=jax.tree.unflatten(treedef, read),
                                      restore_args=jax.tree.unflatten(treedef, restore_args)),
        META: ocp.args.JsonRestore()}))
    state = [_pad_blocks(x, t, b) if max(b, default=1) > 1 else x
             for x, t, b in zip(jax.tree.leaves(out[STATE]), targets, blocks)]
    return jax.tree.unflatten(treedef, state), dict(out[META])


def _pad_blocks(x, target, blocks: tuple):
    """A logical array (split in `blocks` per dim) -> the padded `target` layout: each block padded
    with zeros to its share of the target's dim, on the devices."""

    def pad(x):
        for d, (n, g, k) in enumerate(zip(x.shape, target.shape, blocks)):
            if n == g:
                continue
            shape = x.shape
            x = jnp.reshape(x, (*shape[:d], k, n // k, *shape[d + 1:]))
            x = jnp.pad(x, [(0, 0)] * (d + 1) + [(0, (g - n) // k)] + [(0, 0)] * (len(shape) - d - 1))
            x = jnp.reshape(x, (*shape[:d], g, *shape[d + 1:]))
        return x

    return jax.jit(pad, out_shardings=target.sharding)(x)
