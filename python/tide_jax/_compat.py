"""Small shims over JAX API differences between the versions tide runs on: 0.10.2 (CI's first leg,
Python 3.11), 0.11.2 (the GPU machine) and the newest on PyPI (CI's second leg, scripts/newest-jax:
0.12.1 on 2026-12-06, whose API needed none; its XLA:CPU needs the same program in every process
of a job, which `_layout.Layout._build_device_map` gives on every version)."""

from __future__ import annotations

import inspect

import jax

try:  # jax >= 0.7: public shard_map
    _shard_map = jax.shard_map
except AttributeError:  # older: experimental module, check_rep instead of check_vma
    from jax.experimental.shard_map import shard_map as _shard_map

_SHARD_MAP_PARAMS = set(inspect.signature(_shard_map).parameters)


def shard_map(f, *, mesh, in_specs, out_specs, check_vma=True):
    """`jax.shard_map` with one spelling of the replication-check flag on every supported JAX."""
    kwargs = dict(mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    if "check_vma" in _SHARD_MAP_PARAMS:
        kwargs["check_vma"] = check_vma
    elif "check_rep" in _SHARD_MAP_PARAMS:
        kwargs["check_rep"] = check_vma
    return _shard_map(f, **kwargs)


def vma_of(x) -> frozenset:
    """The mesh axes a value varies over inside shard_map (empty when untracked)."""
    try:
        aval = jax.typeof(x)
    except AttributeError:  # pragma: no cover - very old JAX
        aval = jax.core.get_aval(x)
    return vma_of_aval(aval)


def vma_of_aval(aval) -> frozenset:
    """`vma_of` for an abstract value: `aval.vma` (jax 0.11), `aval.manual_axis_type.varying` (0.10)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or frozenset())


def mark_varying(x, axes):
    """Marks `x` as varying over `axes` (the vma an FFI result should carry), a no-op when it already does."""
    missing = tuple(a for a in axes if a not in vma_of(x))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    if hasattr(jax.lax, "pvary"):  # pragma: no cover - JAX versions between pvary and pcast
        return jax.lax.pvary(x, missing)
    return x  # pragma: no cover - no vma tracking at all


def enclosing_mesh():
    """The abstract mesh of the enclosing shard_map / mesh context (possibly empty)."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:  # pragma: no cover
        from jax._src import mesh as _mesh

        get = _mesh.get_abstract_mesh
    return get()


def manual_axes(abstract_mesh) -> frozenset:
    axes = getattr(abstract_mesh, "manual_axes", None)
    if axes is None:  # pragma: no cover - older AbstractMesh
        return frozenset()
    return frozenset(axes)
