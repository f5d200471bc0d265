"""Pure-JAX twins of tide's collectives: the test oracle and a fallback (`set_backend("jax")`).

Same signatures, same validation, same results as the native ops:
- all_gather: `jax.lax.all_gather(tiled=True)` of the padded shards, then the padding is cropped;
- reduce_scatter: each gradient is upcast to float32 and zero-padded to `world * shard_rows` rows,
  then `jax.lax.psum_scatter(tiled=True)` sums in float32 (fp32-accurate, twice the bytes of bf16).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _ops
from ._layout import Layout

__all__ = ["all_gather", "reduce_scatter", "gather_params"]


def all_gather(shards, lay: Layout, dtype=None):
    """Pure-JAX `tide_jax.all_gather`."""
    return _ops.all_gather(shards, lay, dtype, backend="jax")


def reduce_scatter(grads, lay: Layout, dtype=jnp.float32):
    """Pure-JAX `tide_jax.reduce_scatter` (fp32 accumulate)."""
    return _ops.reduce_scatter(grads, lay, dtype, backend="jax")


def gather_params(shards, lay: Layout, dtype=jnp.bfloat16):
    """Pure-JAX `tide_jax.gather_params`."""
    return _ops.gather_params(shards, lay, dtype, backend="jax")


def lax_all_gather(x, axes: tuple, *, axis: int, to: str = "varying"):
    """`tide_jax.lax.all_gather`'s twin (one leaf, tiled): jax.lax.all_gather itself."""
    import jax

    return jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=axis, tiled=True, to=to)


def lax_psum_scatter(x, axes: tuple, *, scatter_dimension: int):
    """`tide_jax.lax.psum_scatter`'s twin (one leaf, tiled): float32 sums, as tide's, by
    jax.lax.psum_scatter of the operand widened to float32 (the result stays float32)."""
    import jax

    return jax.lax.psum_scatter(x.astype(jnp.float32), axes if len(axes) > 1 else axes[0],
                                scatter_dimension=scatter_dimension, tiled=True)
