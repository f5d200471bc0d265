"""The collectives: all_gather, reduce_scatter, gather_params, on either backend.

Every public op validates its inputs against the layout and the enclosing shard_map here, in Python,
before anything is traced into the program, so mistakes surface as exceptions that name the
parameter. Then it dispatches to the active backend:
- "tide": one `jax.ffi.ffi_call` per parameter group (variadic: N operands, N results) into the
  native library (docs/design.md, "FFI contract"), made by `_native` (the calls, start/done, the
  backend and world-1 switches: this module's bottom);
- "jax": the pure-JAX twins in `tide_jax.reference` (jax.lax.all_gather / psum_scatter).

Public API: the ops (`__all__`, re-exported by the package), `Handle`, `BACKENDS`, `set_backend`,
`get_backend` (`_native`'s), and for the modules above (`_loop`): `check_shards(shards, lay, op)` /
`check_grads(grads, lay, op)` (the leaves, validated against the layout), `maybe_cast(x, dtype)`,
`replica_axes(leaves, lay)`.

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

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _inflight, _native
from . import _linear as _linear_prim
from ._layout import Layout
from ._native import BACKENDS, Handle, get_backend, set_backend

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


def check_shards(shards, lay: Layout, op: str) -> list:
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


def check_grads(grads, lay: Layout, op: str) -> list:
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
        if np.dtype(x.dtype) not in _native.REDUCIBLE:
            raise TypeError(
                f"tide: {op}: {p.describe()}: gradient dtype {np.dtype(x.dtype).name} is not supported; "
                "reduce_scatter takes bfloat16, float16 or float32 (summed in float32)"
            )
    return leaves


def maybe_cast(x, dtype):
    """`x` as `dtype` if it is a real floating array (a complex one would lose its imaginary part:
    left as it is, like integers)."""
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x.astype(dtype)


def all_gather_start(shards, lay: Layout, dtype=None, *, backend: str | None = None) -> Handle:
    """Starts `all_gather(shards, lay, dtype)` and returns at once (its copies run on tide's streams
    while XLA goes on); `all_gather_done(handle)` returns the full parameters. Order them around
    compute with `ordered` (or `scan_layers`, which does it for a layer loop)."""
    _native.check_context(lay, "all_gather_start")
    leaves = [maybe_cast(x, dtype) for x in check_shards(shards, lay, "all_gather_start")]
    return _start_laned("all_gather", leaves, lay, _native.chosen(backend))


def all_gather_done(handle: Handle):
    """The gathered parameters (local blocks) of the all-gather `handle` started (same as `all_gather`)."""
    lay = handle.meta[1] if isinstance(handle, Handle) else None
    raw = []
    outs = _native.done(handle, "all_gather", raw)
    _inflight.release(handle.tag, raw)
    return jax.tree_util.tree_unflatten(lay.treedef, outs)


def reduce_scatter_start(grads, lay: Layout, *, backend: str | None = None) -> Handle:
    """Starts `reduce_scatter(grads, lay)` (bf16/f16/f32 in, fp32 sums) and returns at once;
    `reduce_scatter_done(handle, dtype)` returns this rank's shards."""
    _native.check_context(lay, "reduce_scatter_start")
    leaves = check_grads(grads, lay, "reduce_scatter_start")
    return _start_laned("reduce_scatter", leaves, lay, _native.chosen(backend))


def reduce_scatter_done(handle: Handle, dtype=jnp.float32):
    """This rank's shards of the sum `handle`'s start computes, cast to `dtype` (None: float32)."""
    lay = handle.meta[1] if isinstance(handle, Handle) else None
    raw = []
    outs = _native.done(handle, "reduce_scatter", raw)
    _inflight.release(handle.tag, raw)
    if dtype is not None:
        outs = [o if o.dtype == np.dtype(dtype) else o.astype(dtype) for o in outs]
    return jax.tree_util.tree_unflatten(lay.treedef, outs)


def _start_laned(op: str, leaves: list, lay: Layout, backend: str) -> Handle:
    """A hand-written start: on an in-flight lane of the traced program, tied after that lane's
    previous done ([Note: in-flight lanes] in `_inflight`), or, with every lane busy, the synchronous
    collective (its done passes the results on). Starts that make no native call are not laned."""
    part = lay._nonempty()
    if backend == "jax" or _native.is_local(lay, op) or (part is not None and part[1] is None) or _inflight.batched(leaves):
        return _native.start(op, leaves, lay, backend)  # (batched: synchronous per element, [Note: start/done under vmap])
    names = [p.path or "<root>" for p in lay.params[:2]]
    lane = _inflight.acquire(op, f"{op}_start of {', '.join(names)}{', ...' if len(lay.params) > 2 else ''}")
    if lane is None:  # not traced (no lanes to keep)
        return _native.start(op, leaves, lay, backend)
    tag, after = lane
    if isinstance(tag, str):  # every lane busy
        outs = (_native.tide_all_gather if op == "all_gather" else _native.tide_reduce_scatter)(leaves, lay)
        return Handle(outs, [], (op, lay, "local", ()))
    handle = _native.start(op, leaves, lay, backend, after=after)
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
    backend = _native.chosen(backend)
    if backend == "tide":
        return _native.tide_all_gather, _native.tide_reduce_scatter
    from . import _twins

    return _twins.all_gather_leaves, _twins.reduce_scatter_leaves


# ----- public ops -----
def _all_gather(shards, lay: Layout, dtype, backend: str | None):
    _native.check_context(lay, "all_gather")
    leaves = check_shards(shards, lay, "all_gather")
    leaves = [maybe_cast(x, dtype) for x in leaves]
    gather, _ = _impl(backend)
    return jax.tree_util.tree_unflatten(lay.treedef, gather(leaves, lay))


def _reduce_scatter(grads, lay: Layout, dtypes: list, backend: str | None, psum_axes=None):
    _native.check_context(lay, "reduce_scatter")
    leaves = check_grads(grads, lay, "reduce_scatter")
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
    _native.check_context(lay, "all_gather")
    leaves = check_shards(shards, lay, "all_gather")
    backend = _native.chosen(backend)
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
            if np.dtype(_native.widened(ct).dtype) in _native.REDUCIBLE:
                native.append((i, _native.widened(ct)))
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
    _native.check_context(lay, "reduce_scatter")
    leaves = check_grads(grads, lay, "reduce_scatter")
    backend = _native.chosen(backend)
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
    _native.check_context(lay, "gather_params")
    leaves = check_shards(shards, lay, "gather_params")
    for p, x in zip(lay.params, leaves):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"tide: gather_params: {p.describe()}: shard dtype {np.dtype(x.dtype).name} is not a "
                "floating type; only floating parameters can be differentiated"
            )
    shard_dtypes = [np.dtype(x.dtype) for x in leaves]
    backend = _native.chosen(backend)
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
        flat = [_native.widened(_compat.mark_varying(flat[i], sorted(shard_vmas[i] | set(replicas[i]) | {lay.axis})))
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
