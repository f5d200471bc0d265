"""tide_jax: zero-copy FSDP collectives for JAX.

    lay = tide_jax.layout(params, mesh, "fsdp")        # FSDP2 dim-0 sharding of a pytree
    shards = lay.shard(params)                          # global arrays (P * shard_rows, *rest)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(lay.spec, ...), out_specs=...)
    def step(shards, batch):
        params = tide_jax.gather_params(shards, lay)    # bf16 full params; grads reduce-scattered
        ...                                             # in fp32 into the fp32 shards

`tide_jax.info()` (or `python -m tide_jax.info`): the library loaded, its build, the CUDA driver it
finds and the NVRTC and NCCL loaded, JAX: one block for bug reports.

Meshes with several axes: `tide_jax.layout(params, mesh, "fsdp", specs={"w1": P(None, "tensor"), ...},
replicas=("data",))` FSDP-shards each parameter's local block (what a device holds of it under its
spec over the other axes); the collectives then work on those blocks, typed as jax.lax's are, so
Megatron-style code (its own psums over "tensor") differentiates correctly (README "Meshes with
several axes").

Backends: "tide" (the native library, default) or "jax" (pure-JAX twins in `tide_jax.reference`),
chosen with `set_backend` or TIDE_BACKEND.

Existing models: `tide_jax.nnx` (Flax NNX) and `tide_jax.equinox` (Equinox) shard a model and run its
own `__call__` under FSDP (README "Your own model"); imported on first use, so `import tide_jax`
never imports flax or equinox.
"""

from . import lax, reference
from ._layout import Layout, ParamInfo, layout, shard_map
from ._lib import LibraryNotFoundError, SettingError, library_path
from ._ops import (
    BACKENDS,
    Handle,
    all_gather,
    all_gather_done,
    all_gather_start,
    gather_params,
    get_backend,
    ordered,
    reduce_scatter,
    reduce_scatter_done,
    reduce_scatter_start,
    set_backend,
)
from ._loop import REMAT_NAMES, remat_policy, scan_layers
from ._distributed import initialize, report_uncaught_to_launcher as _report_uncaught_to_launcher
from ._dispatch import dispatch_lock

__version__ = "0.1.0"


def info() -> str:
    """Which tide_jax and native library this process uses, the library's build (version, commit,
    XLA FFI API and jaxlib of its headers), the CUDA driver it finds and the NVRTC and NCCL this
    process has loaded, JAX and the platform: one block to paste into a bug report (`python -m
    tide_jax.info` prints it)."""
    from ._info import info as report

    return report()


def __getattr__(name):
    # The front doors import flax / equinox, optional dependencies: only when asked for
    # (`tide_jax.nnx`, `from tide_jax import equinox`), never by `import tide_jax`.
    if name in ("nnx", "equinox"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "dispatch_lock",
    "Handle",
    "all_gather_done",
    "all_gather_start",
    "ordered",
    "reduce_scatter_done",
    "reduce_scatter_start",
    "Layout",
    "LibraryNotFoundError",
    "SettingError",
    "ParamInfo",
    "all_gather",
    "gather_params",
    "initialize",
    "get_backend",
    "lax",
    "info",
    "layout",
    "library_path",
    "reduce_scatter",
    "reference",
    "scan_layers",
    "remat_policy",
    "REMAT_NAMES",
    "set_backend",
    "shard_map",
]

_report_uncaught_to_launcher()  # under `python -m tide_jax.launch` only (TIDE_LAUNCH_DIR)
