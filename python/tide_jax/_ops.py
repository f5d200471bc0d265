"""The collectives: all_gather, reduce_scatter, gather_params, on either backend.

Every public op validates its inputs against the layout and the enclosing shard_map here, in Python,
before anything is traced into the program, so mistakes surface as exceptions that name the
parameter. Then it dispatches to the active backend:
- "tide": one `jax.ffi.ffi_call` per parameter group (variadic: N operands, N results) into the
  native library (docs/design.md, "FFI contract");
- "jax": the pure-JAX twins in `tide_jax.reference` (jax.lax.all_gather / psum_scatter).

On meshes with several axes every op works on local blocks (`_layout`): the all-gather returns each
parameter's block (full over the layout's axis, still split over the other axes its spec names), the
reduce-scatter takes the block's gradient. [Note: vma of the collectives]: under shard_map's
check_vma, each result is typed as jax.lax's collective would type it, per parameter: varying over
its own operand's axes and the layout's axis. So a block split over "tensor" varies over "tensor",
one replicated over it does not, and JAX's own autodiff inserts the psums Megatron-style code needs.
One native call carries parameters of different types: JAX makes its operands agree (pvary), and
the results are typed one by one afterwards (an FFI result has no varying axes of its own). What a
start returns is typed varying over the layout's axis alone, whatever the parameters: those arrays
only travel to their done (which types its results per parameter), and `ordered` can then tie them
to any value that varies over the axis without changing that value's type.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _inflight, _lib
from . import _linear as _linear_prim
from ._layout import Layout

__all__ = [
    "Handle",
    "all_gather_start",
    "all_gather_done",
    "reduce_scatter_start",
    "reduce_scatter_done",
    "ordered",
    "all_gather",
    "reduce_scatter",
    "gather_params",
    "set_backend",
    "get_backend",
    "BACKENDS",
]

BACKENDS = ("tide", "jax")
REDUCIBLE = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def _widened(ct):
    """A cotangent as the reduce-scatter takes it: float8 variants (parameters gathered in fp8) are
    widened to float32 first, exactly; bf16/f16/f32 and everything else as they are."""
    narrow = jnp.issubdtype(ct.dtype, jnp.floating) and np.dtype(ct.dtype).itemsize < 2
    return ct.astype(jnp.float32) if narrow and np.dtype(ct.dtype) not in REDUCIBLE else ct


def _backend_from_env() -> str:
    name = os.environ.get("TIDE_BACKEND", "tide").strip().lower() or "tide"
    if name not in BACKENDS:
        raise _lib.SettingError(f"tide: TIDE_BACKEND={name!r}: expected one of {BACKENDS}")
    return name


# Settings read at import that have invalid values: raised by the first op traced (as the native
# library's are, `_lib._check_settings`), so `import tide_jax` and `tide_jax.info` still work.
_setting_errors: list[str] = []


def _at_import(read, fallback):
    try:
        return read()
    except _lib.SettingError as e:
        _setting_errors.append(str(e))
        return fallback


_backend = _at_import(_backend_from_env, "tide")


def _world1_native_from_env():
    value = os.environ.get("TIDE_WORLD1_NATIVE", "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    # attribution of the world-1 step's cost: one op native, the other local; or "pipeline": both
    # local but scan_layers' pipeline (starts, barriers, dones) as with native calls
    if value in ("all_gather", "reduce_scatter", "pipeline"):
        return frozenset({value})
    raise _lib.SettingError(f"tide: TIDE_WORLD1_NATIVE={value!r}: expected 0/1 (false/true, off/on, "
                            "no/yes), all_gather, reduce_scatter or pipeline")


# At world size 1 the collectives are local (no native call) unless TIDE_WORLD1_NATIVE=1: a test
# knob, so one GPU can still run the native start/done path through XLA (tests/python/test_gpu.py).
# True: both ops native; a frozenset: the ops named in it (TIDE_WORLD1_NATIVE=all_gather, ...).
_world1_native = _at_import(_world1_native_from_env, False)


def _is_local(lay: Layout, op: str | None = None) -> bool:
    """Whether `op` ("all_gather" / "reduce_scatter"; None: every op, as scan_layers asks whether
    to pipeline at all) runs without a native call: world size 1 unless TIDE_WORLD1_NATIVE asks
    for it."""
    if lay.world != 1 or _world1_native is True:
        return False
    if not _world1_native:
        return True
    return op is not None and op not in _world1_native


def _backend_name(name) -> str:
    """A backend name as every entry point takes it: "tide" or "jax", any case, spaces ignored."""
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        raise ValueError(f"tide: unknown backend {name!r}: expected one of {BACKENDS}")
    return name.strip().lower()


def _chosen(backend) -> str:
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


def _new_site() -> int:
    with _site_lock:
        return next(_site_counter)


# ----- validation -----
def _check_context(lay: Layout, op: str) -> None:
    """The op must run inside shard_map over the layout's mesh (its axis manual, same axis sizes)."""
    if not isinstance(lay, Layout):
        raise TypeError(f"tide: {op}: expected a tide_jax Layout, got {type(lay).__name__}")
    if _setting_errors:
        raise _lib.SettingError("; ".join(_setting_errors))
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
# `_check_context` sees only the abstract mesh while tracing (axis names and sizes): a layout built
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


def _guarded(leaves: list, lay: Layout, op: str) -> list:
    """`leaves` with the first one through the mesh guard ([Note: the mesh guard])."""
    if not leaves:
        return leaves
    names = [p.path or "<root>" for p in lay.params[:3]]
    what = f"{op} of {', '.join(names)}{', ...' if len(lay.params) > 3 else ''}"
    ids = lay.mesh.device_ids
    first = _mesh_guard_p.bind(leaves[0], names=tuple(lay.mesh.axis_names), shape=tuple(np.shape(ids)),
                               devices=tuple(int(d) for d in np.ravel(ids)), what=what)
    return [first, *leaves[1:]]


def _flatten_like(tree, lay: Layout, op: str, what: str) -> list:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if treedef != lay.treedef:
        raise ValueError(
            f"tide: {op}: {what} do not match the layout's pytree structure: got {treedef}, the layout "
            f"has {lay.treedef}"
        )
    for p, x in zip(lay.params, leaves):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"tide: {op}: {p.describe()}: expected an array, got {type(x).__name__}")
    return leaves


def _check_shards(shards, lay: Layout, op: str) -> list:
    leaves = _flatten_like(shards, lay, op, "the shards")
    for p, x in zip(lay.params, leaves):
        if tuple(x.shape) != p.shard_shape:
            hint = ""
            if tuple(x.shape) == p.global_shape:
                hint = " (that is the global sharded shape: call this inside shard_map with in_specs=lay.spec)"
            elif tuple(x.shape) in (p.shape, p.local_shape):
                hint = " (that is the full parameter: shard it with lay.shard first)"
            raise ValueError(
                f"tide: {op}: {p.describe()}: local shard has shape {tuple(x.shape)}, the layout over "
                f"{lay.world} ranks of axis {lay.axis!r} wants {p.shard_shape}{hint}"
            )
    return leaves


def _check_grads(grads, lay: Layout, op: str) -> list:
    leaves = _flatten_like(grads, lay, op, "the gradients")
    for p, x in zip(lay.params, leaves):
        if tuple(x.shape) != p.local_shape:
            what = "the full parameter shape" if p.local_shape == p.shape else "the shape of its local block"
            hint = ""
            if tuple(x.shape) == p.shape:
                hint = (f" (the full parameter: its spec {p.spec} splits it over other mesh axes, so each device "
                        "has the gradient of its local block)")
            raise ValueError(
                f"tide: {op}: {p.describe()}: gradient has shape {tuple(x.shape)}, expected {what} "
                f"{p.local_shape}{hint}"
            )
        if np.dtype(x.dtype) not in REDUCIBLE:
            raise TypeError(
                f"tide: {op}: {p.describe()}: gradient dtype {np.dtype(x.dtype).name} is not supported; "
                "reduce_scatter takes bfloat16, float16 or float32 (summed in float32)"
            )
    return leaves


def _maybe_cast(x, dtype):
    """`x` as `dtype` if it is a real floating array (a complex one would lose its imaginary part:
    left as it is, like integers)."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def _out_vmas(ins, axis) -> tuple:
    """Per parameter, the varying axes jax.lax's collective would give its result: its operand's and
    `axis` ([Note: vma of the collectives])."""
    return tuple(tuple(sorted(_compat.vma_of(x) | {axis})) for x in ins)


def _vary_like(outs, ins, axis):
    """Gives FFI results the types jax.lax's collectives would (shard_map's check_vma), one by one:
    varying over their own operand's axes and `axis`. A no-op under check_vma=False."""
    return [_compat.mark_varying(o, v) for o, v in zip(outs, _out_vmas(ins, axis))]


def _attrs(lay: Layout, site: int, urgent: bool = False) -> dict[str, Any]:
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
def _local_all_gather(leaves: list, lay: Layout) -> list:
    outs = [jnp.reshape(x, p.local_shape) for p, x in zip(lay.params, leaves)]
    return _vary_like(outs, leaves, lay.axis)


def _local_reduce_scatter(leaves: list, lay: Layout) -> list:
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
def _tide_all_gather(leaves: list, lay: Layout) -> list:
    if _is_local(lay, "all_gather"):
        return _local_all_gather(leaves, lay)
    if lay._nonempty() is not None:
        return _without_empty(leaves, lay, _tide_all_gather, "all_gather")
    _lib.ensure_registered(lay.platform)
    result_types = [jax.ShapeDtypeStruct(p.local_shape, x.dtype) for p, x in zip(lay.params, leaves)]
    outs = jax.ffi.ffi_call("tide_all_gather", result_types, vmap_method="sequential")(
        *_guarded(leaves, lay, "all_gather"), **_attrs(lay, _new_site()))
    return _vary_like(list(outs), leaves, lay.axis)


def _tide_reduce_scatter(leaves: list, lay: Layout) -> list:
    if _is_local(lay, "reduce_scatter"):
        return _local_reduce_scatter(leaves, lay)
    if lay._nonempty() is not None:
        return _without_empty(leaves, lay, _tide_reduce_scatter, "reduce_scatter")
    _lib.ensure_registered(lay.platform)
    result_types = [jax.ShapeDtypeStruct(p.shard_shape, jnp.float32) for p in lay.params]
    outs = jax.ffi.ffi_call("tide_reduce_scatter", result_types, vmap_method="sequential")(
        *_guarded(leaves, lay, "reduce_scatter"), **_attrs(lay, _new_site()))
    return _vary_like(list(outs), leaves, lay.axis)


# ----- start/done (docs/design.md "Start/done") -----
@jax.tree_util.register_pytree_node_class
class Handle:
    """A collective in flight between its start and its done: what `all_gather_start` /
    `reduce_scatter_start` return and `*_done` take. A pytree (its arrays are the start's results and
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


def _start(op: str, leaves: list, lay: Layout, backend: str, urgent: bool = False, after=()) -> Handle:
    """The start of `op` on validated leaves. `after`: values the native call waits for (an in-flight
    lane's previous done, [Note: in-flight lanes] in `_inflight`), tied in the barrier before it."""
    if backend == "jax" or _is_local(lay, op):  # XLA schedules its own collectives, or nothing moves:
        # the handle holds the results
        if backend == "jax":
            gather, scatter = _impl("jax")
        else:
            gather, scatter = _local_all_gather, _local_reduce_scatter
        outs = (gather if op == "all_gather" else scatter)(leaves, lay)
        return Handle(outs, [], (op, lay, "local", ()))
    if lay._nonempty() is not None:  # [Note: empty parameters]
        idx, sub = lay._nonempty()
        empties = _empty_outs(op, leaves, lay)
        if sub is None:
            return Handle(empties, [], (op, lay, "local", ()))
        inner = _start(op, [leaves[i] for i in idx], sub, backend, urgent, after)
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
    # In flight, the results are typed varying over the axis alone ([Note: vma of the collectives]).
    tracked = any(_compat.vma_of(x) for x in leaves)
    outs = _start_call(op, types, n, _attrs(lay, _new_site(), urgent), (lay.axis,) if tracked else ())(
        *_guarded(leaves, lay, f"{op}_start"))
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
                "its done at the same vmap level ([Note: start/done under vmap] in tide_jax/_ops.py)"
            )
        return tuple(arrays[:n]), (True,) * n  # the batched start's results are final

    return done


def _done(handle: Handle, op: str, raw: list | None = None) -> list:
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
        return _part_done(handle, lambda inner: _done(inner, op, raw))
    n = len(handle.results)
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in handle.results]
    tracked = any(out_vmas)
    target = "all_gather_cast" if backend == "tide-cast" else op  # [Note: the casting all-gather]
    outs = _done_call(target, types, n, _attrs(lay, _new_site()), (lay.axis,) if tracked else ())(
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
# `_start_into(grads, bufs, index, lay, backend)` starts the reduce-scatter of `grads` and writes
# each fp32 shard into slice `index` of its buffer `bufs[i]` (shape (L, *shard_shape), float32),
# as `jax.lax.dynamic_update_index_in_dim(bufs[i], shard_i, index, 0)` would (a negative index
# counts from the end, then it is clamped to [0, L - 1], as there); `_done_into(handle)` returns the buffers. On the tide backend the native
# call writes the slice in place (`tide_reduce_scatter_into_start`/`_done`: the buffers aliased in
# and out, the index read by the kernels on the device, src/call.rs `OutputAt`), so a layer loop
# holds no per-layer fp32 result and copies nothing into its gradient buffer (issue #22). On the
# jax backend and at world size 1 it is the reduce-scatter followed by that update.
def _start_into(leaves: list, bufs: list, index, lay: Layout, backend: str, urgent: bool = False) -> Handle:
    n = len(leaves)
    index = jnp.asarray(index, jnp.int32)
    part = lay._nonempty()
    if backend == "jax" or _is_local(lay, "reduce_scatter") or (part is not None and part[1] is None):
        h = _start("reduce_scatter", leaves, lay, backend, urgent)
        return Handle(list(bufs), [h, index], ("reduce_scatter_into", lay, "wrapped", ()))
    if part is not None:  # [Note: empty parameters]: their buffers have no elements to write
        idx, sub = part
        inner = _start_into([leaves[i] for i in idx], [bufs[i] for i in idx], index, sub, backend, urgent)
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
    outs = _start_into_call(types, n, _attrs(lay, _new_site(), urgent), (lay.axis,) if tracked else (), buf_vmas)(
        *_guarded(leaves, lay, "reduce_scatter_start"), *bufs, index)
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


def _done_into(handle: Handle) -> list:
    if not isinstance(handle, Handle) or handle.meta[0] != "reduce_scatter_into":
        raise TypeError("tide: reduce_scatter into slices: expected the handle of its start")
    _, lay, backend, buf_vmas = handle.meta
    if isinstance(backend, tuple):  # started on the non-empty parameters
        return _part_done(handle, _done_into)
    if backend == "wrapped":
        h, index = handle.operands
        outs = _done(h, "reduce_scatter")
        return [jax.lax.dynamic_update_index_in_dim(b, o.astype(b.dtype), index, 0) for b, o in zip(handle.results, outs)]
    n = len(handle.results)
    types = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in handle.results]
    call = jax.ffi.ffi_call("tide_reduce_scatter_into_done", types, input_output_aliases={i: i for i in range(n)})
    attrs = _attrs(lay, _new_site())

    @jax.custom_batching.custom_vmap
    def done(*arrays):
        return tuple(_compat.mark_varying(o, list(v)) for o, v in zip(call(*arrays, **attrs), buf_vmas))

    @done.def_vmap
    def done_batched(axis_size, in_batched, *arrays):
        if not all(in_batched[:n]):
            raise ValueError("tide: reduce_scatter_into done is batched by jax.vmap but its start was not")
        return tuple(arrays[:n]), (True,) * n

    # (no barrier after, unlike `_done`: the results are whole buffers, nothing slices them into a
    # larger one; and a barrier would type every buffer as varying over the union of their axes)
    return list(done(*handle.results, *handle.operands))


# ----- the casting all-gather (fp32 shards in, bf16 parameters out) -----
# [Note: the casting all-gather]
# `_start_cast(stacked, index, lay, backend)` starts the all-gather of
# `[s[index].astype(bfloat16) for s in stacked]` (each `stacked[i]` float32 (L, *shard_shape): a layer
# loop's stacked shards; `index` as jax.lax.dynamic_index_in_dim's, a negative one counting from the
# end, then clamped) and `all_gather_done` of its handle returns the bf16 parameters. On the tide
# backend the native call (`tide_all_gather_cast_start` / `_done`, src/cast.rs) rounds this rank's rows
# of the slice straight into their place in the gathered result on XLA's stream, and peers copy them
# from there: no bf16 shard is made or held until done, no fp32 slice is cut out of the stack, and the
# own shard is not copied (issue #22: at world size 1 the gather is the rounding alone). Its bits are
# those of XLA's convert then the all-gather (round to nearest even; a NaN stays a NaN). Other dtypes,
# the jax backend and world size 1 without TIDE_WORLD1_NATIVE are the cast then `_start`.
def _cast_ok(lay: Layout, shard_dtypes, dtype, backend: str) -> bool:
    """Whether the casting all-gather applies: the tide backend (not local), float32 shards gathered
    as bfloat16, and TIDE_AG_CAST not 0."""
    return (_ag_cast_enabled() and backend == "tide" and not _is_local(lay, "all_gather")
            and dtype is not None and np.dtype(dtype) == np.dtype(jnp.bfloat16)
            and all(np.dtype(d) == np.dtype(np.float32) for d in shard_dtypes))


def _ag_cast_enabled() -> bool:
    """TIDE_AG_CAST (default on): the layer loop gathers float32 shards as bfloat16 with the casting
    all-gather; 0 restores XLA's convert then the plain all-gather (the A/B switch)."""
    return _lib.env_flag("TIDE_AG_CAST")


def _start_cast(stacked: list, index, lay: Layout, backend: str) -> Handle:
    index = jnp.asarray(index, jnp.int32)
    part = lay._nonempty()
    if not _cast_ok(lay, [s.dtype for s in stacked], jnp.bfloat16, backend) or (part is not None and part[1] is None):
        leaves = [jax.lax.dynamic_index_in_dim(s, index, 0, keepdims=False).astype(jnp.bfloat16) for s in stacked]
        return _start("all_gather", leaves, lay, backend)
    if part is not None:  # [Note: empty parameters]
        idx, sub = part
        inner = _start_cast([stacked[i] for i in idx], index, sub, backend)
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
    outs = _start_cast_call(types, len(stacked), _attrs(lay, _new_site()), (lay.axis,) if tracked else ())(
        *_guarded(stacked, lay, "all_gather_start"), index)
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


def all_gather_start(shards, lay: Layout, dtype=None, *, backend: str | None = None) -> Handle:
    """Starts `all_gather(shards, lay, dtype)` and returns at once (its copies run on tide's streams
    while XLA goes on); `all_gather_done(handle)` returns the full parameters. Order them around
    compute with `ordered` (or `scan_layers`, which does it for a layer loop)."""
    _check_context(lay, "all_gather_start")
    leaves = [_maybe_cast(x, dtype) for x in _check_shards(shards, lay, "all_gather_start")]
    return _start_laned("all_gather", leaves, lay, _chosen(backend))


def all_gather_done(handle: Handle):
    """The gathered parameters (local blocks) of the all-gather `handle` started (same as `all_gather`)."""
    lay = handle.meta[1] if isinstance(handle, Handle) else None
    raw = []
    outs = _done(handle, "all_gather", raw)
    _inflight.release(handle.tag, raw)
    return jax.tree_util.tree_unflatten(lay.treedef, outs)


def reduce_scatter_start(grads, lay: Layout, *, backend: str | None = None) -> Handle:
    """Starts `reduce_scatter(grads, lay)` (bf16/f16/f32 in, fp32 sums) and returns at once;
    `reduce_scatter_done(handle, dtype)` returns this rank's shards."""
    _check_context(lay, "reduce_scatter_start")
    leaves = _check_grads(grads, lay, "reduce_scatter_start")
    return _start_laned("reduce_scatter", leaves, lay, _chosen(backend))


def reduce_scatter_done(handle: Handle, dtype=jnp.float32):
    """This rank's shards of the sum `handle`'s start computes, cast to `dtype` (None: float32)."""
    lay = handle.meta[1] if isinstance(handle, Handle) else None
    raw = []
    outs = _done(handle, "reduce_scatter", raw)
    _inflight.release(handle.tag, raw)
    if dtype is not None:
        outs = [o if o.dtype == np.dtype(dtype) else o.astype(dtype) for o in outs]
    return jax.tree_util.tree_unflatten(lay.treedef, outs)


def _start_laned(op: str, leaves: list, lay: Layout, backend: str) -> Handle:
    """A hand-written start: on an in-flight lane of the traced program, tied after that lane's
    previous done ([Note: in-flight lanes] in `_inflight`), or, with every lane busy, the synchronous
    collective (its done passes the results on). Starts that make no native call are not laned."""
    part = lay._nonempty()
    if backend == "jax" or _is_local(lay, op) or (part is not None and part[1] is None) or _inflight.batched(leaves):
        return _start(op, leaves, lay, backend)  # (batched: synchronous per element, [Note: start/done under vmap])
    names = [p.path or "<root>" for p in lay.params[:2]]
    lane = _inflight.acquire(op, f"{op}_start of {', '.join(names)}{', ...' if len(lay.params) > 2 else ''}")
    if lane is None:  # not traced (no lanes to keep)
        return _start(op, leaves, lay, backend)
    tag, after = lane
    if isinstance(tag, str):  # every lane busy
        outs = (_tide_all_gather if op == "all_gather" else _tide_reduce_scatter)(leaves, lay)
        return Handle(outs, [], (op, lay, "local", ()))
    handle = _start(op, leaves, lay, backend, after=after)
    handle.tag = tag
    return handle


def ordered(*xs):
    """Pins program order between collectives and compute: returns `xs` unchanged, but everything
    computed from any output waits for all inputs. `h, x = ordered(h, x)` after a start makes the
    compute on `x` follow the start; `h, y = ordered(h, y)` before a done makes the done follow the
    compute producing `y` (`jax.lax.optimization_barrier`; XLA does not move a done earlier by
    itself, but without this it may place it right after its start)."""
    out = jax.lax.optimization_barrier(xs)
    return out[0] if len(xs) == 1 else out


def _impl(backend: str | None):
    backend = _chosen(backend)
    if backend == "tide":
        return _tide_all_gather, _tide_reduce_scatter
    from . import _twins

    return _twins.all_gather_leaves, _twins.reduce_scatter_leaves


# ----- public ops -----
def _all_gather(shards, lay: Layout, dtype, backend: str | None):
    _check_context(lay, "all_gather")
    leaves = _check_shards(shards, lay, "all_gather")
    leaves = [_maybe_cast(x, dtype) for x in leaves]
    gather, _ = _impl(backend)
    return jax.tree_util.tree_unflatten(lay.treedef, gather(leaves, lay))


def _reduce_scatter(grads, lay: Layout, dtypes: list, backend: str | None, psum_axes=None):
    _check_context(lay, "reduce_scatter")
    leaves = _check_grads(grads, lay, "reduce_scatter")
    _, scatter = _impl(backend)
    outs = scatter(leaves, lay)
    if psum_axes:  # per parameter, replicas of its shard (HSDP): sum the fp32 shards, not the bf16 gradients
        outs = [jax.lax.psum(o, tuple(axes)) if axes else o for o, axes in zip(outs, psum_axes)]
    outs = [o if dt is None or o.dtype == dt else o.astype(dt) for o, dt in zip(outs, dtypes)]
    return jax.tree_util.tree_unflatten(lay.treedef, outs)


def all_gather(shards, lay: Layout, dtype=None, *, backend: str | None = None):
    """Local shards `(shard_rows, *rest)` -> full parameters (original shapes), inside shard_map; on a
    mesh whose other axes split a parameter (its spec), its local block (full over the layout's axis).

    `dtype` (e.g. jnp.bfloat16) casts every floating shard before the gather, so only the local shard
    is converted and the wire carries the narrow type. One native call per pytree (parameter group).

    Differentiable like `jax.lax.all_gather`, in reverse and forward mode (`_linear.py`): the tangent
    is the all-gather of the tangents; the cotangent of the gathered parameters is reduce-scattered
    (`reduce_scatter`: float32 sums) and cast to each shard's dtype. `gather_params` is the same
    gather with the FSDP recipe's defaults (bf16, HSDP replicas summed in float32).
    """
    _check_context(lay, "all_gather")
    leaves = _check_shards(shards, lay, "all_gather")
    backend = _chosen(backend)
    if backend == "jax" or not any(jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves):
        return _all_gather(shards, lay, dtype, backend)  # jax.lax's own autodiff / nothing to differentiate
    shard_vmas = [_compat.vma_of(x) for x in leaves]

    def bwd(cotangent, needed):
        cts = lay.treedef.flatten_up_to(cotangent)
        outs = [None] * len(leaves)
        native, own = [], []  # summed by tide in float32 / by jax.lax in their own dtype (f64, complex)
        for i, (x, ct, s) in enumerate(zip(leaves, cts, shard_vmas)):
            if not jnp.issubdtype(x.dtype, jnp.inexact) or not needed[i]:
                continue  # no tangent space, or nobody asks for this shard's gradient: no collective
            ct = _compat.mark_varying(ct, sorted(s | {lay.axis}))  # a no-op under check_vma=False
            if np.dtype(_widened(ct).dtype) in REDUCIBLE:
                native.append((i, _widened(ct)))
            else:
                own.append((i, ct))
        if native:
            sub = lay._subset([i for i, _ in native])
            for (i, _), o in zip(native, reduce_scatter([ct for _, ct in native], sub, None, backend=backend)):
                outs[i] = o
        if own:
            from . import _twins

            sub = lay._subset([i for i, _ in own])
            for (i, _), o in zip(own, _twins.reduce_scatter_leaves([ct for _, ct in own], sub, dtype=None)):
                outs[i] = o
        return [None if o is None else _typed_like(o.astype(x.dtype), s) for o, x, s in zip(outs, leaves, shard_vmas)]

    return _linear(lambda t: _all_gather(t, lay, dtype, backend), bwd, shards,
                   lambda xs, idx: _on_subset(lambda t, sub: _all_gather(t, sub, dtype, backend), xs, lay, idx))


def reduce_scatter(grads, lay: Layout, dtype=jnp.float32, *, backend: str | None = None):
    """Full gradients `(rows, *rest)` (bf16 / f16 / f32; local blocks where a spec splits the
    parameter over other axes) -> this rank's shards of their sum over the layout's axis.

    The sum is accumulated in float32; the result is `(shard_rows, *rest)` float32 with padding rows
    zero, cast to `dtype` afterwards if that differs.

    Differentiable like `jax.lax.psum_scatter` (reverse and forward mode: the tangent is the
    reduce-scatter of the tangents): the cotangent of the shards is all-gathered and cast
    to each gradient's dtype.
    """
    n = len(lay.params) if isinstance(lay, Layout) else 0
    dtypes = [None if dtype is None else np.dtype(dtype)] * n
    _check_context(lay, "reduce_scatter")
    leaves = _check_grads(grads, lay, "reduce_scatter")
    backend = _chosen(backend)
    if backend == "jax":
        return _reduce_scatter(grads, lay, dtypes, backend)  # jax.lax's own autodiff
    grad_vmas = [_compat.vma_of(x) for x in leaves]

    def bwd(cotangent, needed):
        idx = [i for i, n in enumerate(needed) if n]
        cts = lay.treedef.flatten_up_to(cotangent)
        cts = [_compat.mark_varying(cts[i], sorted(grad_vmas[i] | {lay.axis})) for i in idx]
        outs = [None] * len(leaves)
        for i, f in zip(idx, _on_subset(lambda t, sub: all_gather(t, sub, backend=backend), cts, lay, idx)):
            outs[i] = _typed_like(f.astype(leaves[i].dtype), grad_vmas[i])
        return outs

    return _linear(lambda t: _reduce_scatter(t, lay, dtypes, backend), bwd, grads,
                   lambda xs, idx: _on_subset(lambda t, sub: _reduce_scatter(t, sub, [dtypes[i] for i in idx], backend),
                                              xs, lay, idx))


def _linear(forward, transpose, tree, forward_on):
    """`forward(tree)`, a linear map made of tide calls (which JAX cannot differentiate), with
    `transpose(cotangent of the result, needed) -> [cotangent of leaf i of tree, or None where not
    needed[i]]` and `forward_on(leaves, idx) -> [result i for i in idx]`, the map on some leaves
    alone: one `tide_linear` primitive (`_linear.py`), so reverse mode, forward mode and vmap all
    follow from linearity. A leaf nobody differentiates (a frozen parameter beside trained ones in one
    group) is left out of the transpose's collective, and a leaf whose tangent is zero out of the
    jvp's. Leaf i of the result is the map of leaf i of `tree` (the same structure, in order)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out_tree = []

    def flat_forward(xs):
        if any(x is None for x in xs):  # a jvp's tangents, some zero: the others' collective alone
            idx = [i for i, x in enumerate(xs) if x is not None]
            outs = [None] * len(xs)
            for i, o in zip(idx, forward_on([xs[i] for i in idx], idx)):
                outs[i] = o
            return outs
        flat, tree_out = jax.tree_util.tree_flatten(forward(jax.tree_util.tree_unflatten(treedef, xs)))
        out_tree[:] = [tree_out]
        return flat

    def flat_transpose(cts, needed):
        return list(transpose(jax.tree_util.tree_unflatten(out_tree[0], cts), needed))

    outs = _linear_prim.linear(flat_forward, flat_transpose, leaves)  # traces flat_forward: sets out_tree
    return jax.tree_util.tree_unflatten(out_tree[0], outs)


def _on_subset(op, leaves: list, lay: Layout, idx: list) -> list:
    """`op(tree, layout)` on the parameters `idx` of `lay` (their `leaves`, in order), as a list: on
    `lay` itself when `idx` names all of them (the usual case, every parameter differentiated: the
    very call a full-group op makes), else on the layout of those."""
    if len(idx) == len(lay.params):
        return lay.treedef.flatten_up_to(op(jax.tree_util.tree_unflatten(lay.treedef, leaves), lay))
    return list(op(leaves, lay._subset(idx)))


def _typed_like(t, vma: frozenset):
    """A backward's result typed as its primal (`vma`, under check_vma): summed over the axes it
    varies over and the primal does not (the primal was the same on every rank there, and JAX's
    broadcast of it transposes to a sum), then marked varying as the primal is. A no-op when nothing
    is tracked (check_vma=False: no value has varying axes)."""
    extra = _compat.vma_of(t) - vma
    if extra:
        t = jax.lax.psum(t, tuple(sorted(extra)))
    return _compat.mark_varying(t, sorted(vma)) if vma else t


def gather_params(shards, lay: Layout, dtype=jnp.bfloat16, *, backend: str | None = None):
    """Differentiable all-gather: the FSDP mixed-precision recipe in one call.

    Forward: all_gather of the shards cast to `dtype` (e.g. fp32 master shards -> bf16 parameters).
    Backward: reduce_scatter of the parameters' cotangent (fp32 accumulate) into the shards' dtype.
    """
    _check_context(lay, "gather_params")
    leaves = _check_shards(shards, lay, "gather_params")
    for p, x in zip(lay.params, leaves):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"tide: gather_params: {p.describe()}: shard dtype {np.dtype(x.dtype).name} is not a "
                "floating type; only floating parameters can be differentiated"
            )
    shard_dtypes = [np.dtype(x.dtype) for x in leaves]
    backend = _chosen(backend)
    shard_vmas, replicas = replica_axes(leaves, lay)

    def gather(shards):
        full = _all_gather(shards, lay, dtype, backend)
        flat, tree = jax.tree_util.tree_flatten(full)
        flat = [_compat.mark_varying(t, r) if r else t for t, r in zip(flat, replicas)]
        return jax.tree_util.tree_unflatten(tree, flat)

    def gather_on(xs, idx):
        full = _on_subset(lambda t, sub: _all_gather(t, sub, dtype, backend), xs, lay, idx)
        return [_compat.mark_varying(t, replicas[i]) if replicas[i] else t for i, t in zip(idx, full)]

    def bwd(cotangent, needed):
        # A cotangent may be typed less varying than the primal output (e.g. the same on every rank);
        # its values are still per device, so type it as such before summing it over devices.
        idx = [i for i, n in enumerate(needed) if n]
        flat = lay.treedef.flatten_up_to(cotangent)
        flat = [_widened(_compat.mark_varying(flat[i], sorted(shard_vmas[i] | set(replicas[i]) | {lay.axis})))
                for i in idx]
        # The public reduce_scatter (float32 sums), itself differentiable: forward over reverse (a
        # Hessian-vector product) differentiates this backward too. Replicas summed in float32, then
        # the cast to each shard's dtype, as `_reduce_scatter(..., psum_axes)` does.
        sums = _on_subset(lambda t, sub: reduce_scatter(t, sub, None, backend=backend), flat, lay, idx)
        outs = [None] * len(leaves)
        for i, g in zip(idx, sums):
            g = jax.lax.psum(g, tuple(replicas[i])) if replicas[i] else g
            g = g if g.dtype == shard_dtypes[i] else g.astype(shard_dtypes[i])
            outs[i] = _typed_like(g, shard_vmas[i])
        return outs

    return _linear(gather, bwd, shards, gather_on)


def replica_axes(leaves, lay: Layout) -> tuple[list, list]:
    """(per shard its varying axes, per shard the replica axes it is summed over).

    The replica axes of a shard are the layout's `replicas` (HSDP: the mesh axes its shards are
    copied over while the batch is split over them) it does not already vary over. Its gathered
    block is declared varying over them, so JAX does not insert its own reduction of the (bf16)
    cotangent there; the backward sums the fp32 shards over them instead. Any other axis the shard is
    replicated over (a tensor or expert axis) keeps jax.lax's typing ([Note: vma of the collectives]):
    JAX's autodiff sums the cotangent over it where the block meets values that vary over it.
    Only when shard_map tracks varying axes (check_vma=True); with check_vma=False the caller
    reduces over replicas, as with any collective."""
    shard_vmas = [_compat.vma_of(x) for x in leaves]
    if not any(shard_vmas):
        return shard_vmas, [()] * len(leaves)
    manual = _compat.manual_axes(_compat.enclosing_mesh())
    wanted = set(lay.replicas) & set(manual)
    return shard_vmas, [tuple(sorted(wanted - s - {lay.axis})) if s else () for s in shard_vmas]
