"""Every `TIDE_*` setting tide_jax reads in Python, read here and only here: the twin of src/config.rs
(which documents and reads the native library's own).

Each reader below reads its variable when it is called, parses it and raises `SettingError` naming
the variable, its value and what it accepts; the module above decides when to call it (README,
"Tunables"), which this module leaves as it was:

| variable | default | accepted | reader | read |
| --- | --- | --- | --- | --- |
| `TIDE_BACKEND` | `tide` | `tide` or `jax` (any case, spaces ignored) | `backend()` | at import (`_native`) |
| `TIDE_WORLD1_NATIVE` | 0 | a flag, or `all_gather`, `reduce_scatter`, `pipeline` | `world1_native()` | at import (`_native`) |
| `TIDE_AG_CAST` | 1 | a flag | `ag_cast()` | each layer loop traced (`_native.cast_ok`) |
| `TIDE_RS_INTO` | 1 | a flag | `rs_into()` | each layer loop traced (`_loop`) |
| `TIDE_RS_URGENT` | 1 | a flag | `rs_urgent()` | each layer loop traced (`_loop`) |
| `TIDE_SCAN_UNROLL` | 2 on GPUs, 1 on CPU devices | an integer in [1, 64] | `scan_unroll(platform)` | each layer loop traced (`_loop`) |
| `TIDE_MAX_IN_FLIGHT` | 4 | an integer in [1, 16] (a leading `+` allowed) | `max_in_flight()` | each laned start traced (`_inflight`); the native library reads it too |
| `TIDE_TOPOLOGY` | unset: one node per host | `NODESxGPUS`, product the axis size | `topology(world)` | each `layout` (`_layout`, `_distributed`) |
| `TIDE_KV_TIMEOUT_S` | 300 | seconds in [0.001, 86400] | `kv_timeout_ms()` | when a multi-process job is set up (`_distributed`) |
| `TIDE_NODE_LOCAL` | 0 | a flag | `node_local()` | when a multi-process GPU job is set up (`_distributed`) |
| `TIDE_RAIL_HOST` | the route to the coordinator | a host or address | `rail_host()` | when a CPU rail is set up (`_distributed`) |
| `TIDE_RAIL_BIND` | `0.0.0.0` (`127.0.0.1` for a loopback host) | an address | `rail_bind(host)` | when a CPU rail is set up (`_distributed`) |

A flag takes 0/1 (false/true, off/on, no/yes, any case, spaces ignored); an empty value is unset.
Not settings, so not here: `TIDE_LIBRARY` (where `_lib` loads the library from) and the variables
`tide_jax.launch` hands its processes (`TIDE_LAUNCH_DIR`, `TIDE_LOCAL_RANK`, `TIDE_JOB_ID`: read by
`_distributed`).

Public API (for the modules above): the readers, `flag`, `seconds`, `parse_topology` (also the
`topology=` argument of `layout`), `BACKENDS`, `backend_name`, `problems()` (the invalid Python-side
settings, what `tide_jax.info` lists), and `at_import` / `import_errors()` (settings read at import
whose values are invalid, raised by the first op traced as the native library's are).
"""

from __future__ import annotations

import os

import numpy as np

from ._lib import SettingError

__all__ = [
    "BACKENDS", "SettingError", "flag", "seconds", "backend", "backend_name", "world1_native",
    "ag_cast", "rs_into", "rs_urgent", "scan_unroll", "max_in_flight", "topology", "parse_topology",
    "kv_timeout_ms", "node_local", "rail_host", "rail_bind", "at_import", "import_errors", "problems",
]

BACKENDS = ("tide", "jax")


def flag(name: str, default: bool = True) -> bool:
    """A tide_jax switch from the environment: 0/1, false/true, off/on, no/yes (any case, spaces
    ignored); unset or empty is `default`; anything else raises SettingError naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    if value == "":
        return default
    raise SettingError(f"tide: {name}={value!r}: expected 0/1 (false/true, off/on, no/yes)")


def seconds(name: str, default: float, lo: float, hi: float) -> float:
    """A duration in seconds from the environment, in [lo, hi]; unset or empty is `default`."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not lo <= x <= hi:  # also nan and inf
        raise SettingError(f"tide: {name}={value!r}: expected seconds in [{lo:g}, {hi:g}]")
    return x


def backend() -> str:
    """TIDE_BACKEND: "tide" (native) or "jax" (pure JAX); default "tide"."""
    name = os.environ.get("TIDE_BACKEND", "tide").strip().lower() or "tide"
    if name not in BACKENDS:
        raise SettingError(f"tide: TIDE_BACKEND={name!r}: expected one of {BACKENDS}")
    return name


def backend_name(name) -> str:
    """A backend name as every entry point takes it: "tide" or "jax", any case, spaces ignored."""
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        raise ValueError(f"tide: unknown backend {name!r}: expected one of {BACKENDS}")
    return name.strip().lower()


def world1_native():
    """TIDE_WORLD1_NATIVE: False (default), True, or a frozenset of the ops run native at world 1.

    At world size 1 the collectives are local (no native call) unless it is set: a test knob, so one
    GPU can still run the native start/done path through XLA (tests/python/test_gpu.py). Besides a
    flag, the attribution of the world-1 step's cost: "all_gather" / "reduce_scatter" (that op
    native, the other local), or "pipeline" (both local but scan_layers' pipeline of starts,
    barriers and dones as with native calls)."""
    value = os.environ.get("TIDE_WORLD1_NATIVE", "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("all_gather", "reduce_scatter", "pipeline"):
        return frozenset({value})
    raise SettingError(f"tide: TIDE_WORLD1_NATIVE={value!r}: expected 0/1 (false/true, off/on, "
                       "no/yes), all_gather, reduce_scatter or pipeline")


def ag_cast() -> bool:
    """TIDE_AG_CAST (default on): the layer loop gathers float32 shards as bfloat16 with the casting
    all-gather; 0 restores XLA's convert then the plain all-gather (the A/B switch)."""
    return flag("TIDE_AG_CAST")


def rs_into() -> bool:
    """TIDE_RS_INTO (default on): scan_layers reduce-scatters layer gradients into their slice of the
    gradient buffers in place; 0 restores a separate fp32 result and an update (the A/B switch of
    bench/train_bench.py)."""
    return flag("TIDE_RS_INTO")


def rs_urgent() -> bool:
    """TIDE_RS_URGENT (default on): the backward's last reduce-scatters (layer 0's and the
    prologue's, which the update waits on) are urgent, their sums taking the whole GPU; 0 sums them
    as every other (the A/B switch)."""
    return flag("TIDE_RS_URGENT")


def scan_unroll(platform) -> int:
    """TIDE_SCAN_UNROLL: layers per iteration of scan_layers' lax.scan, an integer in [1, 64];
    unset, 2 on GPUs and 1 on CPU devices (why: `_loop.scan_unroll`)."""
    value = os.environ.get("TIDE_SCAN_UNROLL", "").strip()
    if not value:
        return 2 if str(platform).lower() in ("cuda", "gpu", "rocm") else 1
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= 64:
        raise SettingError(f"tide: TIDE_SCAN_UNROLL={value!r}: expected an integer in [1, 64]")
    return int(value)


def max_in_flight() -> int:
    """TIDE_MAX_IN_FLIGHT as the native library reads it (src/config.rs: default 4, an integer in
    [1, 16], spaces ignored)."""
    value = os.environ.get("TIDE_MAX_IN_FLIGHT", "").strip()
    if not value:
        return 4
    digits = value[1:] if value.startswith("+") else value
    if not (digits.isascii() and digits.isdigit()) or not 1 <= int(digits) <= 16:
        raise SettingError(f"tide: TIDE_MAX_IN_FLIGHT={value!r}: expected an integer in [1, 16]")
    return int(digits)


def topology(world: int) -> tuple[int, int] | None:
    """TIDE_TOPOLOGY for a mesh axis of `world` devices: (nodes, gpus_per_node), validated; None
    when unset (the caller's default: one node per host)."""
    spec = os.environ.get("TIDE_TOPOLOGY", "").strip()
    if not spec:
        return None
    return parse_topology(spec, world, source="TIDE_TOPOLOGY")


def parse_topology(spec, world: int, source: str = "topology") -> tuple[int, int]:
    """(nodes, gpus_per_node) from "NxG" or a pair of integers whose product is `world`; errors
    name `source` (the variable, or the `topology=` argument)."""
    error = SettingError if source.startswith("TIDE_") else ValueError
    if isinstance(spec, str):
        parts = spec.lower().split("x")
        try:
            if len(parts) != 2:
                raise ValueError
            nodes, gpus = int(parts[0]), int(parts[1])
        except ValueError:
            raise error(f"tide: {source}={spec!r}: expected NODESxGPUS, e.g. 2x4") from None
    else:
        ok = isinstance(spec, (tuple, list)) and len(spec) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in spec)
        if not ok:
            raise error(f"tide: {source}={spec!r}: expected (nodes, gpus_per_node), two integers, or 'NxG'")
        nodes, gpus = int(spec[0]), int(spec[1])
    if nodes < 1 or gpus < 1:
        raise error(f"tide: {source}={spec!r}: nodes and gpus_per_node must be at least 1")
    if nodes * gpus != world:
        raise error(f"tide: {source}={spec!r} has {nodes * gpus} ranks but the mesh axis has {world} devices")
    return nodes, gpus


def kv_timeout_ms() -> int:
    """How long a process waits for its peers' keys in the key-value store (TIDE_KV_TIMEOUT_S,
    default 300 s, at most a day), in milliseconds."""
    return int(seconds("TIDE_KV_TIMEOUT_S", 300.0, 0.001, 86400.0) * 1000)


def node_local() -> bool:
    """TIDE_NODE_LOCAL (default off): a per-node control plane for GPU jobs even on one host."""
    return flag("TIDE_NODE_LOCAL", False)


def rail_host() -> str:
    """TIDE_RAIL_HOST: the address other hosts reach this process's CPU rail at; "" when unset."""
    return os.environ.get("TIDE_RAIL_HOST", "").strip()


def rail_bind(host: str) -> str:
    """TIDE_RAIL_BIND: the address the CPU rail listens on; unset, 127.0.0.1 when the advertised
    `host` is a loopback address, else 0.0.0.0."""
    return os.environ.get("TIDE_RAIL_BIND", "127.0.0.1" if host.startswith("127.") else "0.0.0.0")


# Settings read at import that have invalid values: raised by the first op traced (as the native
# library's are, `_lib.check_settings`), so `import tide_jax` and `tide_jax.info` still work.
_import_errors: list[str] = []


def at_import(read, fallback):
    """`read()`, or `fallback` with its SettingError kept for `import_errors()`."""
    try:
        return read()
    except SettingError as e:
        _import_errors.append(str(e))
        return fallback


def import_errors() -> list[str]:
    """The errors of the settings read at import (`at_import`), in order."""
    return list(_import_errors)


def problems() -> list[str]:
    """The TIDE_* settings tide_jax reads in Python that have invalid values, each as its error
    (the native library's own are `_lib.check_settings`'): what `tide_jax.info` reports."""
    checks = [backend, world1_native, lambda: scan_unroll("cpu"), kv_timeout_ms, node_local,
              rs_into, ag_cast, rs_urgent]
    out = []
    for check in checks:
        try:
            check()
        except SettingError as e:
            out.append(str(e))
    return out
