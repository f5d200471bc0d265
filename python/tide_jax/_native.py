"""The native calls: everything a tide custom call needs, below every op that makes one.

The bottom of the ops (docs/design.md "Layers", item 4): it imports from tide_jax only `_compat`,
`_lib`, `_settings`, the `Layout` type of `_layout`, and the pure-JAX twins (`_twins`, the "jax"
backend of a start). `_ops` (the public collectives), `lax` (the drop-in) and `_loop` (scan_layers)
build on its public API:

- the backend (`BACKENDS`, `chosen(backend)`: a per-call `backend=` or the default; `set_backend`,
  `get_backend`; TIDE_BACKEND read at import) and the world-1 switch (`is_local(lay, op)`,
  `is_local_at(world, op)`: no native call at world size 1 unless TIDE_WORLD1_NATIVE, read at
  import); an invalid setting read at import is raised by `check_context`, the first op traced;
- `new_site()`: call-site ids (docs/design.md "Call sites and instances");
- `check_context(lay, op)`: inside shard_map over the layout's mesh; `guarded(leaves, lay, op)`: the
  first operand through the mesh guard ([Note: the mesh guard]);
- `call_attrs(lay, site, urgent)`: the attributes of every tide target ("FFI contract");
- `REDUCIBLE`, `widened(ct)`: the dtypes the reduce-scatter sums, a cotangent as it takes it;
- `local_all_gather` / `local_reduce_scatter`: the ops at world size 1 (no call);
  `tide_all_gather` / `tide_reduce_scatter`: the synchronous native calls, on validated leaves;
- `Handle`, `start(op, leaves, lay, backend, urgent, after)`, `done(handle, op, raw)`: start/done
  ([Note: start/done under vmap]); `start_into` / `done_into`: the reduce-scatter into slices of
  larger buffers ([Note: reduce-scatter into slices]); `cast_ok`, `start_cast`: the casting
  all-gather ([Note: the casting all-gather]). Parameters with no elements: [Note: empty parameters].

Every function here takes validated leaves (the checks against the layout are `_ops`'s).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _lib, _settings
from ._layout import Layout


REDUCIBLE = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def widened(ct):
    """A cotangent as the reduce-scatter takes it: float8 variants (parameters gathered in fp8) are
    widened to float32 first, exactly; bf16/f16/f32 and everything else as they are."""
    narrow = jnp.issubdtype(ct.dtype, jnp.floating) and np.dtype(ct.dtype).itemsize < 2
    return ct.astype(jnp.float32) if narrow and np.dtype(ct.dtype) not in REDUCIBLE else ct


# Read at import; an invalid value is raised by the first op traced (`_settings.at_import`).
_backend = _settings.at_import(_settings.backend, "tide")
# At world size 1 the collectives are local (no native call) unless TIDE_WORLD1_NATIVE asks for it:
# True, both ops native; a frozenset, the ops named in it (`_settings.world1_native`).
_world1_native = _settings.at_import(_settings.world1_native, False)


def is_local(lay: Layout, op: str | None = None) -> bool:
    """Whether `op` ("all_gather" / "reduce_scatter"; None: every op, as scan_layers asks whether
    to pipeline at all) runs without a native call: world size 1 unless TIDE_WORLD1_NATIVE asks
    for it."""
    return is_local_at(lay.world, op)


def is_local_at(world: int, op: str | None = None) -> bool:
    """`is_local` for a mesh axis of `world` devices (the drop-in has no Layout)."""
    if world != 1 or _world1_native is True:
        return False
    if not _world1_native:
        return True
    return op is not None and op not in _world1_native


BACKENDS = _settings.BACKENDS
_backend_name = _settings.backend_name


def chosen(backend) -> str:
    """A per-call `backend=`: None is the current default (`set_backend`, TIDE_BACKEND)."""
    return _backend if backend is None else _backend_name(backend)


def set_backend(name: str) -> str:
    """Selects the backend used when a tide op is traced: "tide" (native) or "jax" (pure JAX).

    Returns the previous backend. Functions already compiled keep the backend they were traced with.
    """
    global _backend
    previous, _backend = _backend, _backend_name(name)
    return previous


def get_backend() -> str:
    return _backend


# ----- call-site ids -----
# Each traced call gets a fresh id; the traced program is the same on every rank, so the id is too.
# JAX reuses a cached trace (an inner jax.jit called per layer, remat, ...), so one site can sit on
# several HLO instructions that XLA runs in any order on each device: the native side numbers them
# at XLA's instantiate stage and keys every call by (site, instance) (docs/design.md "Call sites and
# instances"), never by execution order.
_site_lock = threading.Lock()
_site_counter = itertools.count(1)


def new_site() -> int:
    with _site_lock:
        return next(_site_counter)


# ----- validation -----
def check_context(lay: Layout, op: str) -> None:
    """The op must run inside shard_map over the layout's mesh (its axis manual, same axis sizes)."""
    if not isinstance(lay, Layout):
        raise TypeError(f"tide: {op}: expected a tide_jax Layout, got {type(lay).__name__}")
    errors = _settings.import_errors()
    if errors:
        raise _lib.SettingError("; ".join(errors))
    mesh = _compat.enclosing_mesh()
    manual = _compat.manual_axes(mesh)
    if not manual:
        raise RuntimeError(
            f"tide: {op} must be called inside jax.shard_map (under jax.jit) over the layout's mesh "
            f"with axis {lay.axis!r}; it was called outside shard_map"
        )
    lay_shape = dict(lay.mesh.shape)
    here_shape = dict(getattr(mesh, "shape", {}))
    if here_shape == lay_shape and lay.axis not in manual:
        raise ValueError(
            f"tide: {op}: the layout's axis {lay.axis!r} is not manual in the enclosing shard_map (manual: "
            f"{sorted(manual)}): tide's collectives run over the shards of that axis, so shard_map must "
            f"take it, e.g. axis_names={{{', '.join(repr(a) for a in sorted(set(manual) | {lay.axis}))}}} "
            "(or leave axis_names out: every axis manual)"
        )
    if lay.axis not in manual or here_shape != lay_shape:
        raise ValueError(
            f"tide: {op}: the layout is from another mesh: it shards over axis {lay.axis!r} of a mesh "
            f"with axes {lay_shape}, but the enclosing shard_map's mesh has axes {here_shape} "
            f"(manual: {sorted(manual)}). Build the layout from the mesh passed to shard_map."
        )


# [Note: the mesh guard]
# `check_context` sees only the abstract mesh while tracing (axis names and sizes): a layout built
# for a mesh with the same axes but its devices in another order (or other devices) passes it. Yet
# the native call addresses rank r by the layout's device map, while XLA hands each device the shard
# of its position in shard_map's mesh: every rank would land its shard at another rank's place,
# silently. The concrete mesh is known at lowering (shard_map's axis context), so each native call's
# first operand goes through `tide_mesh_guard`, an identity that emits nothing and, when lowered,
# compares the two meshes' axis names and device ids and fails naming the call and both orders.
# Under an abstract mesh alone there is nothing to compare; the native call then still refuses a
# device missing from its map.
_mesh_guard_p = Primitive("tide_mesh_guard")
_mesh_guard_p.def_impl(lambda x, **_: x)
_mesh_guard_p.def_abstract_eval(lambda x, **_: x)


def _mesh_guard_jvp(primals, tangents, **params):
    return _mesh_guard_p.bind(*primals, **params), tangents[0]


def _mesh_guard_batch(args, dims, **params):
    return _mesh_guard_p.bind(*args, **params), dims[0]


def _mesh_guard_lowering(ctx, x, *, names, shape, devices, what):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    ids = getattr(mesh, "device_ids", None)  # a concrete Mesh; an AbstractMesh has none
    if ids is not None:
        here = (tuple(mesh.axis_names), tuple(np.shape(ids)), tuple(int(d) for d in np.ravel(ids)))
        if here != (names, shape, devices):
            axes = lambda n, sh: ", ".join(f"{a}={k}" for a, k in zip(n, sh))
            raise ValueError(
                f"tide: {what}: the layout was built for another mesh than the enclosing shard_map's: "
                f"the layout's mesh ({axes(names, shape)}) has devices {np.array(devices).reshape(shape).tolist()}, "
                f"shard_map's ({axes(*here[:2])}) has {np.asarray(ids).tolist()}. tide addresses each rank "
                "by its layout's device order, so each shard would land at another rank's place. Build the "
                "layout from the mesh passed to shard_map."
            )
    return [x]


ad.primitive_jvps[_mesh_guard_p] = _mesh_guard_jvp
batching.primitive_batchers[_mesh_guard_p] = _mesh_guard_batch
mlir.register_lowering(_mesh_guard_p, _mesh_guard_lowering)


def guarded(leaves: list, lay: Layout, op: str) -> list:
    """`leaves` with the first one through the mesh guard ([Note: the mesh guard])."""
    if not leaves:
        return leaves
    names = [p.path or "<root>" for p in lay.params[:3]]
    what = f"{op} of {', '.join(names)}{', ...' if len(lay.params) > 3 else ''}"
    ids = lay.mesh.device_ids
    first = _mesh_guard_p.bind(leaves[0], names=tuple(lay.mesh.axis_names), shape=tuple(np.shape(ids)),
                               devices=tuple(int(d) for d in np.ravel(ids)), what=what)
    return [first, *leaves[1:]]


def _out_vmas(ins, axis) -> tuple:
    """Per parameter, the varying axes jax.lax's collective would give its result: its operand's and
    `axis` ([Note: vma of the collectives] in `_ops`)."""
    return tuple(tuple(sorted(_compat.vma_of(x) | {axis})) for x in ins)


def _vary_like(outs, ins, axis):
    """Gives FFI results the types jax.lax's collectives would (shard_map's check_vma), one by one:
    varying over their own operand's axes and `axis`. A no-op under check_vma=False."""
    return [_compat.mark_varying(o, v) for o, v in zip(outs, _out_vmas(ins, axis))]


def call_attrs(lay: Layout, site: int, urgent: bool = False) -> dict[str, Any]:
    """The attributes of every tide target (docs/design.md "FFI contract"). `urgent`: the caller
    waits on this call's done next, so its reductions may take the whole GPU (src/call.rs)."""
    return dict(
        urgent=np.int64(1 if urgent else 0),
        site=np.int64(site),
        world=np.int64(lay.world),
        nodes=np.int64(lay.nodes),
        gpus_per_node=np.int64(lay.gpus_per_node),
        device_ordinals=lay.device_ordinals,
        device_ranks=lay.device_ranks,
        device_groups=lay.device_groups,
        names=lay.names,
        job=np.int64(lay.job),
    )


# ----- world size 1: the collectives are local -----
# One rank along the axis owns every row: the all-gather is the shard itself, the reduce-scatter the
# gradient in float32 (shard_rows == rows, no padding). No native call (nothing to move), as
# jax.lax's collectives are no-ops there; the result types are those of the native call.
def local_all_gather(leaves: list, lay: Layout) -> list:
    outs = [jnp.reshape(x, p.local_shape) for p, x in zip(lay.params, leaves)]
    return _vary_like(outs, leaves, lay.axis)


def local_reduce_scatter(leaves: list, lay: Layout) -> list:
    outs = [jnp.reshape(g, p.shard_shape).astype(jnp.float32) for p, g in zip(lay.params, leaves)]
    return _vary_like(outs, leaves, lay.axis)


# ----- parameters with no elements (a dim of size 0) -----
# [Note: empty parameters]
# The native library moves no empty parameter (src/layout.rs refuses them): a group with some runs
# its call on the others (`Layout._nonempty`, a sub-layout with the same paths and device map), and
# the empty ones' results are arrays of no elements (`_empty_outs`, typed as the call's), made at
# the start and carried through the handle to the done. A group with nothing but empty
# parameters makes no call at all.
def _empty_outs(op: str, leaves: list, lay: Layout, dtype=None) -> list:
    """Per parameter: for an empty one, the op's result (no elements; `dtype`, else the call's:
    the operand's for the all-gather, float32 for the reduce-scatter), typed as the call's; None
    for the others."""
    idx = set(lay._nonempty()[0])
    outs = []
    for i, (p, x) in enumerate(zip(lay.params, leaves)):
        if i in idx:
            outs.append(None)
            continue
        gather = op == "all_gather"
        o = jnp.zeros(p.local_shape if gather else p.shard_shape, dtype or (x.dtype if gather else jnp.float32))
        outs.append(_compat.mark_varying(o, sorted(_compat.vma_of(x) | {lay.axis})))
    return outs


def _without_empty(leaves: list, lay: Layout, run, op: str) -> list:
    idx, sub = lay._nonempty()
    outs = _empty_outs(op, leaves, lay)
    if sub is not None:
        for i, o in zip(idx, run([leaves[i] for i in idx], sub)):
            outs[i] = o
    return outs


def _part_handle(op: str, lay: Layout, inner: Handle, idx, empties: list, out_vmas) -> Handle:
    """The handle of a call started on the non-empty parameters (`inner`): every result in place,
    the empty parameters' (`empties`, made now) with them."""
    results = list(empties)
    for i, r in zip(idx, inner.results):
        results[i] = r
    return Handle(results, inner.operands, (op, lay, ("part", inner.meta, tuple(idx)), out_vmas))


def _part_done(handle: Handle, done) -> list:
    """`done` of a `_part_handle`: the inner call's done, the empty results as they came."""
    _, _, (_, inner_meta, idx), _ = handle.meta
    outs = list(handle.results)
    inner = Handle([outs[i] for i in idx], handle.operands, inner_meta)
    for i, o in zip(idx, done(inner)):
        outs[i] = o
    return outs


# ----- the native (tide) implementations, on validated leaves -----
def tide_all_gather(leaves: list, lay: Layout) -> list:
    if is_local(lay, "all_gather"):
        return local_all_gather(leaves, lay)
    if lay._nonempty() is not None:
        return _without_empty(leaves, lay, tide_all_gather, "all_gather")
    _lib.ensure_registered(lay.platform)
    result_types = [jax.ShapeDtypeStruct(p.local_shape, x.dtype) for p, x in zip(lay.params, leaves)]
    outs = jax.ffi.ffi_call("tide_all_gather", result_types, vmap_method="sequential")(
        *guarded(leaves, lay, "all_gather"), **call_attrs(lay, new_site()))
    return _vary_like(list(outs), leaves, lay.axis)


def tide_reduce_scatter(leaves: list, lay: Layout) -> list:
    if is_local(lay, "reduce_scatter"):
        return local_reduce_scatter(leaves, lay)
    if lay._nonempty() is not None:
        return _without_empty(leaves, lay, tide_reduce_scatter, "reduce_scatter")
    _lib.ensure_registered(lay.platform)
    result_types = [jax.ShapeDtypeStruct(p.shard_shape, jnp.float32) for p in lay.params]
    outs = jax.ffi.ffi_call("tide_reduce_scatter", result_types, vmap_method="sequential")(
        *guarded(leaves, lay, "reduce_scatter"), **call_attrs(lay, new_site()))
    return _vary_like(list(outs), leaves, lay.axis)


# ----- start/done (docs/design.md "Start/done") -----
@jax.tree_util.register_pytree_node_class
class Handle:
    """A collective in flight between its start and its done: what `all_gather_start` /
    `reduce_scatter_start` return and `*done` take. A pytree (its arrays are the start's results and
    operands), so it can go through `ordered`, `jax.lax.optimization_barrier` and scan carries; pass it
    to its done unchanged, exactly once."""

    def __init__(self, results, operands, meta, tag=None):
        self.results = list(results)
        self.operands = list(operands)
        self.meta = meta  # (op, layout, backend, per parameter its result's vma axes): static, the
        # same for every start of one layout (so handles of different iterations fit one scan carry)
        self.tag = tag  # a hand-written start's in-flight lane (`_inflight.Tag`, equal to every other)

    def tree_flatten(self):
        return (self.results, self.operands), (self.meta, self.tag)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], children[1], *aux)

    def __repr__(self):
        return f"Handle({self.meta[0]}, {len(self.results)} arrays, backend {self.meta[2]})"


def start(op: str, leaves: list, lay: Layout, backend: str, urgent: bool = False, after=()) -> Handle:
    """The start of `op` on validated leaves. `after`: values the native call waits for (an in-flight
    lane's previous done, [Note: in-flight lanes] in `_inflight`), tied in the barrier before it."""
    if backend == "jax" or is_local(lay, op):  # XLA schedules its own collectives, or nothing moves:
        # the handle holds the results
        if backend == "jax":
            from . import _twins

            gather, scatter = _twins.all_gather_leaves, _twins.reduce_scatter_leaves
        else:
            gather, scatter = local_all_gather, local_reduce_scatter
        outs = (gather if op == "all_gather" else scatter)(leaves, lay)
        return Handle(outs, [], (op, lay, "local", ()))
    if lay._nonempty() is not None:  # [Note: empty parameters]
        idx, sub = lay._nonempty()
        empties = _empty_outs(op, leaves, lay)
        if sub is None:
            return Handle(empties, [], (op, lay, "local", ()))
        inner = start(op, [leaves[i] for i in idx], sub, backend, urgent, after)
        return _part_handle(op, lay, inner, idx, empties, ())
    _lib.ensure_registered(lay.platform)
    if op == "all_gather":
        types = [jax.ShapeDtypeStruct(p.local_shape, x.dtype) for p, x in zip(lay.params, leaves)]
    else:
        types = [jax.ShapeDtypeStruct(p.shard_shape, jnp.float32) for p in lay.params]
    n = len(leaves)
    out_vmas = _out_vmas(leaves, lay.axis)
    # A barrier first: XLA:GPU's dynamic-slice fusion would otherwise fold a sliced operand (a layer
    # of stacked shards) into the custom call and not honor the aliasing below (seen on the H200).
    # The values in `after` go through it too, so the call cannot be issued before they exist.
    leaves = list(jax.lax.optimization_barrier((*leaves, *after)))[:n]
    # The operands come back as results N.. (aliased): done takes those, so XLA keeps the very
    # buffers tide reads alive until done, and cannot give done a recomputed copy.
    types = types + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    # In flight, the results are typed varying over the axis alone ([Note: vma of the collectives] in `_ops`).
    tracked = any(_compat.vma_of(x) for x in leaves)
    outs = _start_call(op, types, n, call_attrs(lay, new_site(), urgent), (lay.axis,) if tracked else ())(
        *guarded(leaves, lay, f"{op}_start"))
    return Handle(list(outs[:n]), list(outs[n:]), (op, lay, backend, out_vmas))


# [Note: start/done under vmap]
# A start and its done are two calls that meet through the buffers between them, so a batched start
# cannot become a loop of starts (XLA would stack their results into new buffers, which done could
# not find). Under jax.vmap (also a vmapped custom_vjp, e.g. scan_layers' gradient in a per-example
# forward) the start instead runs the synchronous collective on each batch element in turn (the sync
# target's vmap_method="sequential": calls of one site, one after the other) and returns finished
# results, and the batched done passes them on. A start and its done must therefore be traced at the
# same vmap level, as `scan_layers` and any program that pairs them does: the batched done cannot
# tell a batched start's handle from handles of unbatched starts stacked by hand (don't: such a done
# would not wait for them). A done batched on some of its arrays only is refused at trace time.
# Both forms type their results alike (varying over `vma`, the operands as they came), inside the
# custom_vmap: a cast after it would meet already-varying values once the rule has replaced the call.
# (`vma` is the in-flight type: the layout's axis alone; done types each result as its parameter's.)
def _start_call(op: str, types: list, n: int, attrs: dict, vma):
    call = jax.ffi.ffi_call(f"tide_{op}_start", types, input_output_aliases={i: n + i for i in range(n)})
    sync = jax.ffi.ffi_call(f"tide_{op}", types[:n], vmap_method="sequential")

    def typed(results, operands, like):
        results = [_compat.mark_varying(r, list(vma)) for r in results]
        operands = [_compat.mark_varying(o, sorted(_compat.vma_of(x))) for o, x in zip(operands, like)]
        return (*results, *operands)

    @jax.custom_batching.custom_vmap
    def start(*leaves):
        outs = call(*leaves, **attrs)
        return typed(outs[:n], outs[n:], leaves)

    @start.def_vmap
    def start_batched(axis_size, in_batched, *leaves):
        leaves = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(leaves, in_batched)]
        results = jax.vmap(lambda *xs: tuple(sync(*xs, **attrs)))(*leaves)
        return typed(results, leaves, leaves), (True,) * (2 * n)

    return start


def _done_call(op: str, types: list, n: int, attrs: dict, vma):
    call = jax.ffi.ffi_call(f"tide_{op}_done", types, input_output_aliases={i: i for i in range(n)})

    @jax.custom_batching.custom_vmap
    def done(*arrays):
        return tuple(_compat.mark_varying(o, list(vma)) for o in call(*arrays, **attrs))

    @done.def_vmap
    def done_batched(axis_size, in_batched, *arrays):
        if not all(in_batched[:n]):
            raise ValueError(
                f"tide: {op}_done is batched by jax.vmap but its {op}_start was not: trace a start and "
                "its done at the same vmap level ([Note: start/done under vmap] in tide_jax/_native.py)"
            )
        return tuple(arrays[:n]), (True,) * n  # the batched start's results are final

    return done


def done(handle: Handle, op: str, raw: list | None = None) -> list:
    """The done of `handle`'s start. `raw`, if given, receives the native done's results as the call
    returns them (typed varying over the layout's axis alone: what a later start may be tied to)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"tide: {op}_done: expected the Handle its {op}_start returned, got {type(handle).__name__}")
    hop, lay, backend, out_vmas = handle.meta
    if hop != op:
        raise ValueError(f"tide: {op}_done got the handle of a {hop}_start")
    if backend == "local":
        return list(handle.results)
    if isinstance(backend, tuple):  # started on the non-empty parameters
        return _part_done(handle, lambda inner: done(inner, op, raw))
    n = len(handle.results)
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in handle.results]
    tracked = any(out_vmas)
    target = "all_gather_cast" if backend == "tide-cast" else op  # [Note: the casting all-gather]
    outs = _done_call(target, types, n, call_attrs(lay, new_site()), (lay.axis,) if tracked else ())(
        *handle.results, *handle.operands)
    # A barrier after, as before start: XLA:GPU's dynamic-slice fusion would otherwise have done
    # write a result straight into a slice of a larger buffer (a scan's stacked outputs), which
    # breaks the aliasing done relies on (seen on the H200).
    outs = jax.lax.optimization_barrier(tuple(outs))
    if raw is not None:
        raw.extend(outs)
    return [_compat.mark_varying(o, v) for o, v in zip(outs, out_vmas)]


# ----- the reduce-scatter into slices of larger buffers (scan_layers' gradient buffers) -----
# [Note: reduce-scatter into slices]
# `start_into(grads, bufs, index, lay, backend)` starts the reduce-scatter of `grads` and writes
# each fp32 shard into slice `index` of its buffer `bufs[i]` (shape (L, *shard_shape), float32),
# as `jax.lax.dynamic_update_index_in_dim(bufs[i], shard_i, index, 0)` would (a negative index
# counts from the end, then it is clamped to [0, L - 1], as there); `done_into(handle)` returns the buffers. On the tide backend the native
# call writes the slice in place (`tide_reduce_scatter_into_start`/`done`: the buffers aliased in
# and out, the index read by the kernels on the device, src/call.rs `OutputAt`), so a layer loop
# holds no per-layer fp32 result and copies nothing into its gradient buffer (issue #22). On the
# jax backend and at world size 1 it is the reduce-scatter followed by that update.
def start_into(leaves: list, bufs: list, index, lay: Layout, backend: str, urgent: bool = False) -> Handle:
    n = len(leaves)
    index = jnp.asarray(index, jnp.int32)
    part = lay._nonempty()
    if backend == "jax" or is_local(lay, "reduce_scatter") or (part is not None and part[1] is None):
        h = start("reduce_scatter", leaves, lay, backend, urgent)
        return Handle(list(bufs), [h, index], ("reduce_scatter_into", lay, "wrapped", ()))
    if part is not None:  # [Note: empty parameters]: their buffers have no elements to write
        idx, sub = part
        inner = start_into([leaves[i] for i in idx], [bufs[i] for i in idx], index, sub, backend, urgent)
        return _part_handle("reduce_scatter_into", lay, inner, idx, list(bufs), ())
    _lib.ensure_registered(lay.platform)
    for p, b in zip(lay.params, bufs):
        if b.dtype != np.dtype(jnp.float32) or tuple(b.shape[1:]) != tuple(p.shard_shape) or b.ndim < 1:
            raise ValueError(
                f"tide: reduce_scatter into slices: {p.describe()}: buffer {jax.typeof(b)} is not "
                f"float32[L, {', '.join(map(str, p.shard_shape))}]"
            )
    buf_vmas = tuple(tuple(sorted(_compat.vma_of(b))) for b in bufs)
    leaves = list(jax.lax.optimization_barrier(tuple(leaves)))
    types = ([jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs]
             + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
             + [jax.ShapeDtypeStruct((), jnp.int32)])
    tracked = any(_compat.vma_of(x) for x in leaves) or any(buf_vmas)
    outs = _start_into_call(types, n, call_attrs(lay, new_site(), urgent), (lay.axis,) if tracked else (), buf_vmas)(
        *guarded(leaves, lay, "reduce_scatter_start"), *bufs, index)
    return Handle(list(outs[:n]), list(outs[n:]), ("reduce_scatter_into", lay, backend, buf_vmas))


def _start_into_call(types: list, n: int, attrs: dict, vma, buf_vmas):
    aliases = {n + i: i for i in range(n)} | {i: n + i for i in range(n)} | {2 * n: 2 * n}
    call = jax.ffi.ffi_call("tide_reduce_scatter_into_start", types, input_output_aliases=aliases)
    sync = jax.ffi.ffi_call("tide_reduce_scatter", [jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in types[:n]],
                            vmap_method="sequential")

    def typed(outs, args):
        # the buffers in flight: their own axes (as the caller typed them: inside the call JAX has
        # made every operand vary alike) and the layout's; the operands passed through as they came
        bufs = [_compat.mark_varying(o, sorted(set(vma) | set(v))) for o, v in zip(outs[:n], buf_vmas)]
        rest = [_compat.mark_varying(o, sorted(_compat.vma_of(x))) for o, x in zip(outs[n:], [*args[:n], args[2 * n]])]
        return (*bufs, *rest)

    @jax.custom_batching.custom_vmap
    def start(*args):
        return typed(call(*args, **attrs), args)

    @start.def_vmap
    def start_batched(axis_size, in_batched, *args):
        # [Note: start/done under vmap]: the synchronous collective per batch element, then the update.
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        grads, bufs, index = args[:n], args[n:2 * n], args[2 * n]

        def one(gs, bs, i):
            shards = sync(*gs, **attrs)
            return tuple(jax.lax.dynamic_update_index_in_dim(b, s, i, 0) for b, s in zip(bs, shards))

        new = jax.vmap(one)(grads, bufs, index)
        return typed((*new, *grads, index), args), (True,) * (2 * n + 1)

    return start


def done_into(handle: Handle) -> list:
    if not isinstance(handle, Handle) or handle.meta[0] != "reduce_scatter_into":
        raise TypeError("tide: reduce_scatter into slices: expected the handle of its start")
    _, lay, backend, buf_vmas = handle.meta
    if isinstance(backend, tuple):  # started on the non-empty parameters
        return _part_done(handle, done_into)
    if backend == "wrapped":
        return _done_wrapped(handle)
    n = len(handle.results)
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in handle.results]
    call = jax.ffi.ffi_call("tide_reduce_scatter_into_done", types, input_output_aliases={i: i for i in range(n)})
    attrs = call_attrs(lay, new_site())

    @jax.custom_batching.custom_vmap
    def done(*arrays):
        return tuple(_compat.mark_varying(o, list(v)) for o, v in zip(call(*arrays, **attrs), buf_vmas))

    @done.def_vmap
    def done_batched(axis_size, in_batched, *arrays):
        if not all(in_batched[:n]):
            raise ValueError("tide: reduce_scatter_into done is batched by jax.vmap but its start was not")
        return tuple(arrays[:n]), (True,) * n

    # (no barrier after, unlike `done`: the results are whole buffers, nothing slices them into a
    # larger one; and a barrier would type every buffer as varying over the union of their axes)
    return list(done(*handle.results, *handle.operands))


def _done_wrapped(handle: Handle) -> list:
    """`done_into` of a start that was the reduce-scatter (jax backend, world 1): the update now."""
    h, index = handle.operands
    outs = done(h, "reduce_scatter")
    return [jax.lax.dynamic_update_index_in_dim(b, o.astype(b.dtype), index, 0) for b, o in zip(handle.results, outs)]


# ----- the casting all-gather (fp32 shards in, bf16 parameters out) -----
# [Note: the casting all-gather]
# `start_cast(stacked, index, lay, backend)` starts the all-gather of
# `[s[index].astype(bfloat16) for s in stacked]` (each `stacked[i]` float32 (L, *shard_shape): a layer
# loop's stacked shards; `index` as jax.lax.dynamic_index_in_dim's, a negative one counting from the
# end, then clamped) and `all_gather_done` of its handle returns the bf16 parameters. On the tide
# backend the native call (`tide_all_gather_cast_start` / `done`, src/cast.rs) rounds this rank's rows
# of the slice straight into their place in the gathered result on XLA's stream, and peers copy them
# from there: no bf16 shard is made or held until done, no fp32 slice is cut out of the stack, and the
# own shard is not copied (issue #22: at world size 1 the gather is the rounding alone). Its bits are
# those of XLA's convert then the all-gather (round to nearest even; a NaN stays a NaN). Other dtypes,
# the jax backend and world size 1 without TIDE_WORLD1_NATIVE are the cast then `start`.
def cast_ok(lay: Layout, shard_dtypes, dtype, backend: str) -> bool:
    """Whether the casting all-gather applies: the tide backend (not local), float32 shards gathered
    as bfloat16, and TIDE_AG_CAST not 0."""
    return (_settings.ag_cast() and backend == "tide" and not is_local(lay, "all_gather")
            and dtype is not None and np.dtype(dtype) == np.dtype(jnp.bfloat16)
            and all(np.dtype(d) == np.dtype(np.float32) for d in shard_dtypes))


def start_cast(stacked: list, index, lay: Layout, backend: str) -> Handle:
    index = jnp.asarray(index, jnp.int32)
    part = lay._nonempty()
    if not cast_ok(lay, [s.dtype for s in stacked], jnp.bfloat16, backend) or (part is not None and part[1] is None):
        leaves = [jax.lax.dynamic_index_in_dim(s, index, 0, keepdims=False).astype(jnp.bfloat16) for s in stacked]
        return start("all_gather", leaves, lay, backend)
    if part is not None:  # [Note: empty parameters]
        idx, sub = part
        inner = start_cast([stacked[i] for i in idx], index, sub, backend)
        return _part_handle("all_gather", lay, inner, idx, _empty_outs("all_gather", stacked, lay, jnp.bfloat16), ())
    _lib.ensure_registered(lay.platform)
    for p, s in zip(lay.params, stacked):
        if s.ndim < 1 or tuple(s.shape[1:]) != tuple(p.shard_shape) or s.dtype != np.dtype(np.float32):
            raise ValueError(
                f"tide: all_gather_cast: {p.describe()}: operand {jax.typeof(s)} is not "
                f"float32[L, {', '.join(map(str, p.shard_shape))}]"
            )
    types = [jax.ShapeDtypeStruct(p.local_shape, jnp.bfloat16) for p in lay.params]
    out_vmas = _out_vmas(stacked, lay.axis)
    tracked = any(_compat.vma_of(x) for x in stacked)
    outs = _start_cast_call(types, len(stacked), call_attrs(lay, new_site()), (lay.axis,) if tracked else ())(
        *guarded(stacked, lay, "all_gather_start"), index)
    return Handle(list(outs), [], ("all_gather", lay, "tide-cast", out_vmas))


def _start_cast_call(types: list, n: int, attrs: dict, vma):
    call = jax.ffi.ffi_call("tide_all_gather_cast_start", types)
    sync = jax.ffi.ffi_call("tide_all_gather", types, vmap_method="sequential")

    def typed(results):
        return tuple(_compat.mark_varying(r, list(vma)) for r in results)

    @jax.custom_batching.custom_vmap
    def start(*args):
        return typed(call(*args, **attrs))

    @start.def_vmap
    def start_batched(axis_size, in_batched, *args):
        # [Note: start/done under vmap]: the convert and the synchronous all-gather per element.
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]

        def one(*a):
            shards = [jax.lax.dynamic_index_in_dim(s, a[n], 0, keepdims=False).astype(jnp.bfloat16) for s in a[:n]]
            return tuple(sync(*shards, **attrs))

        return typed(jax.vmap(one)(*args)), (True,) * n

    return start
