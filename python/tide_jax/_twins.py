"""The pure-JAX twins of tide's collectives on validated leaves: what `tide_jax.reference` (the
test oracle) and the "jax" backend of `_ops` run. Depends on jax alone, so `_ops` and `reference`
both import it and neither imports the other's module at call time. Like the native ops they work
on each parameter's local block (`_layout`): the gathers and sums run over the layout's axis only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._layout import Layout


def all_gather_leaves(leaves: list, lay: Layout) -> list:
    outs = []
    for p, x in zip(lay.params, leaves):
        full = jax.lax.all_gather(x, lay.axis, axis=0, tiled=True)  # (world * shard_rows, *rest)
        outs.append(jnp.reshape(full[: p.rows], p.local_shape))
    return outs


def reduce_scatter_leaves(leaves: list, lay: Layout) -> list:
    outs = []
    for p, g in zip(lay.params, leaves):
        g = jnp.reshape(g, (p.rows, *p.rest)).astype(jnp.float32)
        pad_rows = p.padded_rows - p.rows
        if pad_rows:
            g = jnp.pad(g, [(0, pad_rows)] + [(0, 0)] * len(p.rest))
        outs.append(jax.lax.psum_scatter(g, lay.axis, scatter_dimension=0, tiled=True))
    return outs
