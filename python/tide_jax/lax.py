"""Drop-in for jax.lax's shard_map collectives: replace `jax.lax.` by `tide_jax.lax.` at the call.

    w = tide_jax.lax.all_gather(w_shard, "fsdp", axis=1, tiled=True)          # zero-copy, any axis
    g = tide_jax.lax.psum_scatter(g, "fsdp", scatter_dimension=1, tiled=True)  # bf16 in, fp32 sums

Same signatures as JAX 0.10.2's (unchanged in 0.12), same result shapes, dtypes and types under
shard_map's check_vma, for arrays and pytrees; inside `jax.jit(jax.shard_map(...))`, no Layout:

- `all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying")`: moves
  bytes (every dtype of whole bytes, bitwise as jax.lax); `to="invarying"` types the result
  invariant over the axes, as jax.lax does; `to="reduced"` is refused (JAX's reduced types).
- `psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False,
  dtype=None)`: bfloat16 / float16 / float32 in, summed in float32 and rounded once to the input
  dtype, or kept as `dtype` (tide's one extension: `dtype=jnp.float32` keeps the fp32 sums). So its
  result is at least as accurate as jax.lax's (which sums bf16 in bf16) and equal to it for float32
  inputs up to the order of the fp32 additions.

Every leaf of one call goes into one native call (one custom call per pytree, like a parameter
group). `axis` / `scatter_dimension` may be any dimension, negative ones included (JAX 0.10.2's own
psum_scatter fails to lower a negative one); a tuple of axis names gathers over their product, in
JAX's order. The dimension must divide by the axis size, as jax.lax requires. Autodiff and batching
are jax.lax's: the all_gather's transpose is tide's psum_scatter in the operand's dtype and back,
forward mode (jvp, Hessian-vector products), vmap (one call, the batch dimension mapped through),
`jax.checkpoint`, custom_vjp wrappers. With the "jax" backend (TIDE_BACKEND=jax, `set_backend`)
these are jax.lax's own collectives with psum_scatter summing in float32 (`tide_jax.reference`).

Refused before anything runs, naming the argument and the leaf: `axis_index_groups` (shard_map
meshes express groups as mesh axes), `to="reduced"`, an axis name that is not a manual axis of the
enclosing shard_map, a dimension out of range or not divisible by the axis size, a psum_scatter of
another dtype than bf16/f16/f32, sub-byte dtypes. Never a silent fallback to XLA's collectives.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from . import _layout
from . import _linear
from . import _native
from . import reference
from ._dropin import tide_dropin_p

__all__ = ["all_gather", "psum_scatter"]

_REDUCIBLE = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def _axes_and_world(axis_name, fn: str) -> tuple[tuple, int]:
    """The axis names as a tuple and the number of ranks over them, checked against the enclosing
    shard_map (each must be a manual axis of its mesh)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError(f"tide: tide_jax.lax.{fn}: axis_name is an empty tuple")
    if len(set(axes)) != len(axes):
        raise ValueError(f"tide: tide_jax.lax.{fn}: axis_name {axis_name!r} names an axis twice")
    mesh = _compat.enclosing_mesh()
    manual = _compat.manual_axes(mesh)
    shape = dict(getattr(mesh, "shape", {}) or {})
    for a in axes:
        if a not in manual:
            where = (f"the enclosing shard_map's manual axes are {sorted(manual)}" if manual
                     else "it was called outside jax.shard_map")
            raise NameError(f"tide: tide_jax.lax.{fn}: axis_name {a!r} is not a manual mesh axis here ({where}); "
                            "call it inside jax.jit(jax.shard_map(...)) over a mesh with that axis")
    return axes, math.prod(int(shape[a]) for a in axes)


def _leaves(x, fn: str):
    flat, treedef = jax.tree_util.tree_flatten_with_path(x)
    names, leaves = [], []
    for path, leaf in flat:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            leaf = jnp.asarray(leaf)
        names.append(jax.tree_util.keystr(path) or "x")
        leaves.append(leaf)
    return names, leaves, treedef


def _dim(d, ndim: int, name: str, arg: str, fn: str) -> int:
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool):
        raise TypeError(f"tide: tide_jax.lax.{fn}: {arg}={d!r} must be an int")
    if not -ndim <= d < ndim:
        raise ValueError(f"tide: tide_jax.lax.{fn}: leaf {name} has {ndim} dims, {arg}={d} is out of range "
                         f"[{-ndim}, {ndim})")
    return int(d) % ndim


def _check_bytes(leaf, name: str, fn: str):
    bits = _layout.dtype_bits(np.dtype(leaf.dtype))
    if bits < 8:
        raise TypeError(f"tide: tide_jax.lax.{fn}: leaf {name} has dtype {np.dtype(leaf.dtype).name} of {bits} "
                        "bits; tide moves whole bytes per element")


def _native_or_local(op: str, leaves: list, dims: list, axes: tuple, world: int, names: list,
                     invariant: bool = False) -> list:
    """The op on every leaf: one native call for the leaves with elements (empty ones need no
    moving: zeros of the result shape), none at world 1 unless TIDE_WORLD1_NATIVE asks for it."""
    outs: list = [None] * len(leaves)
    idx = [i for i, x in enumerate(leaves) if x is not None and x.size > 0]
    for i, x in enumerate(leaves):
        if x is not None and x.size == 0:
            shape = list(x.shape)
            shape[dims[i]] = shape[dims[i]] * world if op == "all_gather" else shape[dims[i]] // world
            outs[i] = jnp.zeros(shape, x.dtype if op == "all_gather" else jnp.float32)
    local = _native.is_local_at(world, op)
    if idx and local:
        for i in idx:
            outs[i] = leaves[i] if op == "all_gather" else leaves[i].astype(jnp.float32)
    elif idx:
        got = tide_dropin_p.bind(*[leaves[i] for i in idx], op=op, axes=axes, along=tuple(dims[i] for i in idx),
                                 world=world, site=_native.new_site(), names=tuple(names[i] for i in idx),
                                 invariant=invariant)
        for i, o in zip(idx, got):
            outs[i] = o
    return outs


def _typed(outs: list, ins: list, axes: tuple, varying: bool) -> list:
    """Results typed as jax.lax's: varying over their operand's axes and `axes` (or, `varying`
    False, as the operand less `axes`: already so by the primitive's abstract eval)."""
    if not varying:
        return outs
    return [o if o is None else _compat.mark_varying(o, sorted(_compat.vma_of(x) | set(axes)))
            for o, x in zip(outs, ins)]


def _gather_leaves(leaves: list, dims: list, axes: tuple, world: int, names: list, to: str) -> list:
    """The tiled all-gather of every leaf along dims[i], differentiable (transpose: the tiled
    psum_scatter in each leaf's dtype; for to="invarying", each rank's own slice)."""
    varying = to == "varying"

    def forward(xs):
        if varying:
            xs = [x if x is None else _compat.mark_varying(x, sorted(_compat.vma_of(x) | set(axes))) for x in xs]
        outs = _native_or_local("all_gather", xs, dims, axes, world, names, invariant=not varying)
        return _typed(outs, xs, axes, varying)

    def transpose(cts, needed):
        res = [None] * len(cts)
        idx = [i for i, n in enumerate(needed) if n]
        if not idx:
            return res
        if varying:
            sums = _scatter_leaves([_native.widened(cts[i]) for i in idx], [dims[i] for i in idx], axes, world,
                                   [names[i] for i in idx])
            for i, s in zip(idx, sums):
                res[i] = s.astype(leaves[i].dtype)
        else:
            # The result was the same on every rank: its cotangent too; each rank's operand is its slice.
            me = jax.lax.axis_index(axes)
            for i in idx:
                n = leaves[i].shape[dims[i]]
                ct = _compat.mark_varying(cts[i], sorted(_compat.vma_of(cts[i]) | set(axes)))
                res[i] = jax.lax.dynamic_slice_in_dim(ct, me * n, n, dims[i]).astype(leaves[i].dtype)
        return res

    return _linear.linear(forward, transpose, leaves)


def _scatter_leaves(leaves: list, dims: list, axes: tuple, world: int, names: list) -> list:
    """The tiled psum_scatter of every leaf along dims[i] as float32 sums, differentiable
    (transpose: the tiled all_gather of the cotangent in the operand's dtype)."""
    dtypes = [np.dtype(x.dtype) for x in leaves]

    def forward(xs):
        xs = [x if x is None else _compat.mark_varying(x, sorted(_compat.vma_of(x) | set(axes))) for x in xs]
        return _typed(_native_or_local("reduce_scatter", xs, dims, axes, world, names), xs, axes, True)

    def transpose(cts, needed):
        idx = [i for i, n in enumerate(needed) if n]
        res = [None] * len(cts)
        if idx:
            gathered = _gather_leaves([cts[i].astype(dtypes[i]) for i in idx], [dims[i] for i in idx], axes,
                                      world, [names[i] for i in idx], "varying")
            for i, g in zip(idx, gathered):
                res[i] = g
        return res

    return _linear.linear(forward, transpose, leaves)


def _common_checks(fn: str, axis_index_groups):
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"tide: tide_jax.lax.{fn}: axis_index_groups={axis_index_groups!r} is not supported: inside "
            "jax.shard_map, express the groups as mesh axes (e.g. a mesh (groups, size) and the collective "
            "over the second axis)")


def all_gather(x, axis_name, *, axis_index_groups=None, axis=0, tiled=False, to="varying"):
    """`jax.lax.all_gather` on tide: every leaf of `x` gathered along `axis` over `axis_name` in
    one native call, bitwise as jax.lax (module docstring)."""
    fn = "all_gather"
    _common_checks(fn, axis_index_groups)
    if to not in ("varying", "invarying", "reduced"):
        raise ValueError(f"tide: tide_jax.lax.all_gather: to={to!r}: expected 'varying', 'invarying' or 'reduced' "
                         "(jax.lax's values)")
    if to == "reduced":
        raise NotImplementedError("tide: tide_jax.lax.all_gather: to='reduced' (JAX's reduced types) is not "
                                  "supported; use to='varying' (the default) or 'invarying'")
    axes, world = _axes_and_world(axis_name, fn)
    names, leaves, treedef = _leaves(x, fn)
    dims = []
    for name, leaf in zip(names, leaves):
        _check_bytes(leaf, name, fn)
        if tiled:
            if leaf.ndim == 0:
                raise ValueError(f"tide: tide_jax.lax.all_gather: leaf {name} is a scalar; tiled=True needs an "
                                 "array with the dimension `axis`")
            dims.append(_dim(axis, leaf.ndim, name, "axis", fn))
        else:
            dims.append(_dim(axis, leaf.ndim + 1, name, "axis", fn))
    if not tiled:  # stack: a new dimension of size 1 at `axis`, gathered tiled
        leaves = [jnp.expand_dims(x, d) for x, d in zip(leaves, dims)]
    if _native.chosen(None) == "jax":
        outs = [reference.lax_all_gather(x, axes, axis=d, to=to) for x, d in zip(leaves, dims)]
    else:
        outs = _gather_leaves(leaves, dims, axes, world, names, to)
    return jax.tree_util.tree_unflatten(treedef, outs)


def psum_scatter(x, axis_name, *, scatter_dimension=0, axis_index_groups=None, tiled=False, dtype=None):
    """`jax.lax.psum_scatter` on tide: float32 sums of bf16/f16/f32 leaves, rounded once to the
    input dtype (or `dtype`), every leaf in one native call (module docstring)."""
    fn = "psum_scatter"
    _common_checks(fn, axis_index_groups)
    axes, world = _axes_and_world(axis_name, fn)
    names, leaves, treedef = _leaves(x, fn)
    dims, out_dtypes = [], []
    for name, leaf in zip(names, leaves):
        if np.dtype(leaf.dtype) not in _REDUCIBLE:
            raise TypeError(f"tide: tide_jax.lax.psum_scatter: leaf {name} has dtype {np.dtype(leaf.dtype).name}; "
                            "tide sums bfloat16, float16 or float32 (in float32)")
        if leaf.ndim == 0:
            raise ValueError(f"tide: tide_jax.lax.psum_scatter: leaf {name} is a scalar; it needs the dimension "
                             "scatter_dimension")
        d = _dim(scatter_dimension, leaf.ndim, name, "scatter_dimension", fn)
        size = leaf.shape[d]
        if tiled and size % world:
            raise ValueError(f"tide: tide_jax.lax.psum_scatter: leaf {name} (shape {tuple(leaf.shape)}): dimension "
                             f"{d} of size {size} is not divisible by the {world} ranks of axis {axis_name!r}")
        if not tiled and size != world:
            raise ValueError(f"tide: tide_jax.lax.psum_scatter: leaf {name} (shape {tuple(leaf.shape)}): with "
                             f"tiled=False dimension {d} must have the size of axis {axis_name!r} ({world}), "
                             f"got {size}")
        dims.append(d)
        out_dtypes.append(np.dtype(dtype) if dtype is not None else np.dtype(leaf.dtype))
    if _native.chosen(None) == "jax":
        sums = [reference.lax_psum_scatter(x, axes, scatter_dimension=d) for x, d in zip(leaves, dims)]
    else:
        sums = _scatter_leaves(leaves, dims, axes, world, names)
    outs = [s.astype(t) if s.dtype != t else s for s, t in zip(sums, out_dtypes)]
    if not tiled:
        outs = [jnp.squeeze(o, d) for o, d in zip(outs, dims)]
    return jax.tree_util.tree_unflatten(treedef, outs)
