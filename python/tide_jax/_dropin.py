"""`tide_dropin`: the native call behind `tide_jax.lax`, one primitive per call of a pytree.

Contract: `bind(*leaves, op, axes, along, world, site, names, invariant)` gathers (op "all_gather") or sums and
scatters (op "reduce_scatter", float32 results) every leaf along its own dimension `along[i]` over
the mesh axes `axes` (JAX's order for a tuple: the first axis major), in ONE custom call
(`tide_all_gather` / `tide_reduce_scatter`, docs/design.md "FFI contract"). The library reads the
sharded dimension off the shapes (the one whose size differs between the full array and the
shard) and moves a dimension other than 0 with 2-D copies ([Note: strided parameters] in
src/layout.rs). Every leaf has at least one element and its dimension divides evenly (checked by
`tide_jax.lax` before binding).

Why a primitive of its own and not `jax.ffi.ffi_call`: the native call needs the device map of the
mesh (each device's ordinal and rank), and inside a `jax.shard_map` given a concrete mesh only the
abstract mesh is visible while tracing. The map is resolved here at lowering, from shard_map's
axis context, which holds the concrete mesh: `tide_jax.lax` needs no Layout and no mesh argument.
Under an abstract mesh alone (no devices to address) the lowering refuses, naming the call.

Rules: abstract eval keeps each operand's type (its varying axes) with the new shape and dtype, less
`axes` when `invariant` (all_gather's to="invarying"); `tide_jax.lax` types the rest as jax.lax's. Batching (vmap) maps the batch dimension straight
through: the gathered dimension moves one on when the batch dimension is before it, still one call.
No jvp or transpose here: `tide_jax.lax` binds this inside `_linear.linear`, whose rules follow
from linearity.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import Mesh

from . import _lib

tide_dropin_p = Primitive("tide_dropin")
tide_dropin_p.multiple_results = True

TARGETS = {"all_gather": "tide_all_gather", "reduce_scatter": "tide_reduce_scatter"}


def out_shape(op: str, shape: tuple, dim: int, world: int) -> tuple:
    shape = list(shape)
    shape[dim] = shape[dim] * world if op == "all_gather" else shape[dim] // world
    return tuple(shape)


def _impl(*args, **params):
    raise RuntimeError("tide: tide_jax.lax collectives run inside jax.jit(jax.shard_map(...)) only")


def _without_axes(aval, axes: tuple):
    """`aval` typed invariant over `axes` (jax.lax.all_gather's to="invarying"): `vma` on JAX >=
    0.11, `manual_axis_type.varying` on 0.10."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and hasattr(mat, "varying"):
        return aval.update(manual_axis_type=type(mat)(varying=frozenset(mat.varying) - set(axes),
                                                      unreduced=mat.unreduced, reduced=mat.reduced))
    vma = getattr(aval, "vma", None)
    return aval if vma is None else aval.update(vma=frozenset(vma) - set(axes))


def _abstract_eval(*avals, op, axes, along, world, site, names, invariant):
    del site, names
    dtype = lambda a: a.dtype if op == "all_gather" else np.dtype(np.float32)
    outs = [a.update(shape=out_shape(op, a.shape, d, world), dtype=dtype(a)) for a, d in zip(avals, along)]
    return [_without_axes(o, axes) for o in outs] if invariant else outs


def _batch(args, bdims, *, op, axes, along, world, site, names, invariant):
    moved = tuple(d if b is None else d + (b <= d) for d, b in zip(along, bdims))
    outs = tide_dropin_p.bind(*args, op=op, axes=axes, along=moved, world=world, site=site, names=names,
                              invariant=invariant)
    return outs, list(bdims)


@functools.lru_cache(maxsize=256)
def device_map(mesh: Mesh, axes: tuple):
    """(world, nodes, gpus_per_node, ordinals, ranks, groups, job, platform) of the collective over
    `axes` of `mesh`: a tuple of axes is one axis of their sizes' product, rank = row-major index
    over them in the given order (JAX's), as a Layout over a mesh with those axes merged computes
    it (topology, multi-process job and rail set-up included)."""
    from ._layout import Layout  # a Layout's device map, its topology and job: one rule

    names = list(mesh.axis_names)
    devices = np.asarray(mesh.devices)
    if len(axes) == 1:
        merged_mesh, merged = mesh, axes[0]
    else:
        others = [n for n in names if n not in axes]
        order = [names.index(n) for n in others] + [names.index(a) for a in axes]
        moved = np.transpose(devices, order)
        merged = "+".join(axes)
        shape = [devices.shape[names.index(n)] for n in others] + [math.prod(devices.shape[names.index(a)] for a in axes)]
        merged_mesh = Mesh(moved.reshape(shape), tuple(others) + (merged,))
    world = int(merged_mesh.shape[merged])
    lay = Layout({"x": jax.ShapeDtypeStruct((world,), np.float32)}, merged_mesh, merged)
    return (world, lay.nodes, lay.gpus_per_node, lay.device_ordinals, lay.device_ranks, lay.device_groups,
            lay.job, lay.platform)


def _lowering(ctx, *args, op, axes, along, world, site, names, invariant):
    del along, invariant
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if getattr(mesh, "device_ids", None) is None:
        raise ValueError(
            f"tide: tide_jax.lax.{'all_gather' if op == 'all_gather' else 'psum_scatter'} of "
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''} over {axes}: the enclosing shard_map has "
            "no concrete mesh (devices) to address; pass mesh=jax.sharding.Mesh(...) to jax.shard_map, or "
            "call it under jax.set_mesh(mesh)"
        )
    w, nodes, gpus, ordinals, ranks, groups, job, platform = device_map(mesh, tuple(axes))
    if w != world:
        raise ValueError(f"tide: tide_jax.lax over {axes}: traced for {world} ranks, the mesh has {w}")
    _lib.ensure_registered(platform)
    attrs = dict(
        urgent=np.int64(0),
        site=np.int64(site),
        world=np.int64(world),
        nodes=np.int64(nodes),
        gpus_per_node=np.int64(gpus),
        device_ordinals=ordinals,
        device_ranks=ranks,
        device_groups=groups,
        names="\n".join(names),
        job=np.int64(job),
    )
    return jax.ffi.ffi_lowering(TARGETS[op])(ctx, *args, **attrs)


tide_dropin_p.def_impl(_impl)
tide_dropin_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[tide_dropin_p] = _batch
mlir.register_lowering(tide_dropin_p, _lowering)

__all__ = ["tide_dropin_p", "device_map", "out_shape"]
