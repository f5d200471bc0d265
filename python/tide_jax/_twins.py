"""The pure-JAX twins of tide's collectives on validated leaves: what `tide_jax.reference` (the
test oracle) and the "jax" backend of `_ops` run. Depends on jax alone, so `_ops` and `reference`
both import it and neither imports the other's module at call time. Like the native ops they work
on each parameter's local block (`_layout`): the gathers and sums run over the layout's axis only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _compat
from ._layout import Layout


def _empty(x, shape, dtype, axis: str):
    """An empty parameter's result (XLA's collectives refuse a dimension of size 0), typed as the
    collective's would be."""
    return _compat.mark_varying(jnp.zeros(shape, dtype), sorted(_compat.vma_of(x) | {axis}))


def all_gather_leaves(leaves: list, lay: Layout) -> list:
    outs = []
    for p, x in zip(lay.params, leaves):
        if p.rows * p.row_elems == 0:
            outs.append(_empty(x, p.local_shape, x.dtype, lay.axis))
            continue
        full = jax.lax.all_gather(x, lay.axis, axis=0, tiled=True)  # (world * shard_rows, *rest)
        outs.append(jnp.reshape(full[: p.rows], p.local_shape))
    return outs


def reduce_scatter_leaves(leaves: list, lay: Layout, dtype=jnp.float32) -> list:
    """Summed in `dtype` (None: each gradient's own, e.g. float64 or complex)."""
    outs = []
    for p, g in zip(lay.params, leaves):
        if p.rows * p.row_elems == 0:
            outs.append(_empty(g, p.shard_shape, dtype or g.dtype, lay.axis))
            continue
        g = jnp.reshape(g, (p.rows, *p.rest)).astype(dtype or g.dtype)
        pad_rows = p.padded_rows - p.rows
        if pad_rows:
            g = jnp.pad(g, [(0, pad_rows)] + [(0, 0)] * len(p.rest))
        outs.append(jax.lax.psum_scatter(g, lay.axis, scatter_dimension=0, tiled=True))
    return outs
