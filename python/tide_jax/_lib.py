"""Finding, loading and registering the native library (the Rust cdylib `libtide`).

Search order: `$TIDE_LIBRARY` (a path to the .so), the copy inside this package (installed by the
wheel or `pip install .`), then `target/release/libtide.so` of the source checkout this package lives in.
Registration of the XLA FFI targets happens once, lazily, on the first tide collective traced.

Public API: `library_path`, `library_origin`, `load`, `ensure_registered(platform)`, `build_info`,
`runtime_info`, `check_settings(lib)` (the native library's invalid settings as `SettingError`),
the errors `LibraryNotFoundError` and `SettingError` (raised for every invalid TIDE_* setting; the
Python side's are read by `_settings`).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading

import jax

log = logging.getLogger("tide_jax")

#: FFI target names and the symbol prefixes that implement them (docs/design.md, "FFI contract");
#: each has `<prefix>_instantiate` and `<prefix>_cpu` / `<prefix>_cuda` (src/ffi/mod.rs `targets`).
TARGETS = {
    "tide_all_gather": "tide_ffi_all_gather",
    "tide_reduce_scatter": "tide_ffi_reduce_scatter",
    "tide_all_gather_start": "tide_ffi_all_gather_start",
    "tide_all_gather_done": "tide_ffi_all_gather_done",
    "tide_reduce_scatter_start": "tide_ffi_reduce_scatter_start",
    "tide_reduce_scatter_done": "tide_ffi_reduce_scatter_done",
    "tide_reduce_scatter_into_start": "tide_ffi_reduce_scatter_into_start",
    "tide_reduce_scatter_into_done": "tide_ffi_reduce_scatter_into_done",
    "tide_all_gather_cast_start": "tide_ffi_all_gather_cast_start",
    "tide_all_gather_cast_done": "tide_ffi_all_gather_cast_done",
}

#: The instantiate-stage state type every target uses (docs/design.md "Call sites and instances").
INSTANCE_TYPE = "tide_instance"

_BUILD_HINT = (
    "Install the tide_jax wheel (`pip install tide_jax-*.whl`: the library inside, no Rust needed), "
    "or build and install it with `pip install .` at the root of the tide repository (needs a Rust "
    "toolchain), or build it with `cargo build --release` and point TIDE_LIBRARY at "
    "target/release/libtide.so. To run without it, use the pure-JAX backend: "
    "tide_jax.set_backend('jax') or TIDE_BACKEND=jax."
)

_lock = threading.Lock()
_lib = None
_lib_path = None
_registered: set[str] = set()


class LibraryNotFoundError(RuntimeError):
    """The native library could not be found or loaded."""


def _candidates() -> list[tuple[str, str]]:
    out = []
    env = os.environ.get("TIDE_LIBRARY")
    if env:
        out.append(("$TIDE_LIBRARY", env))
        return out  # an explicit choice is never silently replaced by another copy
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "libtide*.so"))):
        out.append(("installed package", path))
    # Source checkout: python/tide_jax/_lib.py -> <repo>/target/release/libtide.so
    repo = os.path.dirname(os.path.dirname(here))
    out.append(("source checkout", os.path.join(repo, "target", "release", "libtide.so")))
    return out


def library_origin() -> str:
    """Where the library that would be (or was) loaded comes from: "$TIDE_LIBRARY", "installed
    package" or "source checkout"."""
    path = library_path()
    for where, candidate in _candidates():
        if candidate == path:
            return where
    return "?"


def library_path() -> str:
    """Path of the native library that would be (or was) loaded; raises if there is none."""
    if _lib_path is not None:
        return _lib_path
    tried = []
    for where, path in _candidates():
        if os.path.isfile(path):
            return path
        tried.append(f"{where}: {path}")
    raise LibraryNotFoundError(
        "tide: native library libtide.so not found (looked in "
        + "; ".join(tried)
        + "). "
        + _BUILD_HINT
    )


def load() -> ctypes.CDLL:
    """Loads the native library once and returns it."""
    global _lib, _lib_path
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                _lib = ctypes.CDLL(path)
            except OSError as e:
                raise LibraryNotFoundError(f"tide: cannot load {path}: {e}. {_BUILD_HINT}") from e
            _lib_path = path
            log.debug("tide: loaded %s", path)
        return _lib


class SettingError(ValueError):
    """A TIDE_* environment variable has a value the native library does not accept."""


def check_settings(lib) -> None:
    """Raises SettingError naming each invalid TIDE_* setting, its value and accepted range.

    The library reads its settings once (src/config.rs) and would fail every call with the same
    message; asking here makes the mistake surface when the first tide op is traced."""
    fn = getattr(lib, "tide_settings_error", None)
    if fn is None:  # a library older than this check
        return
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(4096)
    n = fn(buf, len(buf))
    if n:
        raise SettingError(buf.raw[: min(n, len(buf))].decode("utf-8", "replace"))


def _key_values(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            out[key.strip()] = value.strip()
    return out


def build_info(lib=None) -> dict[str, str] | None:
    """The library's build stamp (src/info.rs `tide_build_info`): version, commit, uncommitted
    changes, xla ffi api, jaxlib headers, headers from, profile, rustc, target; None for a library
    built before the stamp existed (a stale library)."""
    lib = load() if lib is None else lib
    fn = getattr(lib, "tide_build_info", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    return _key_values(fn().decode("utf-8", "replace"))


def runtime_info(lib=None) -> dict[str, str] | None:
    """What the library finds now (src/info.rs `tide_runtime_info`): cuda driver, cuda devices,
    nvrtc, nccl ("not found: why" where absent), and `loaded <lib>` files; None for a library built
    before the probe existed. Loads NVRTC and NCCL into the process if they are found."""
    lib = load() if lib is None else lib
    fn = getattr(lib, "tide_runtime_info", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buf = ctypes.create_string_buffer(8192)
    n = fn(buf, len(buf))
    if n > len(buf):
        buf = ctypes.create_string_buffer(n)
        n = fn(buf, len(buf))
    text = buf.raw[: min(n, len(buf))].decode("utf-8", "replace")
    out = {}
    for line in text.splitlines():  # `loaded libnccl` may repeat: keep every file
        key, sep, value = line.partition(": ")
        if sep:
            out[key] = f"{out[key]}\n{value}" if key in out else value
    return out


def ensure_registered(platform: str = "cpu") -> None:
    """Registers the FFI targets for `platform` ("cpu", or "CUDA" / "gpu") once.

    Called with the platform of the layout's mesh when a tide op is first traced for it, so CUDA
    handlers are registered only where a GPU mesh is used (a CUDA backend is then present).
    Raises SettingError (before registering) if a TIDE_* setting is invalid.
    """
    platform = "CUDA" if platform.lower() in ("cuda", "gpu") else "cpu"
    if platform in _registered:
        return
    lib = load()
    with _lock:
        if platform in _registered:
            return
        check_settings(lib)
        suffix = "_cuda" if platform == "CUDA" else "_cpu"

        def symbol(name: str):
            try:
                return getattr(lib, name)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    f"tide: {_lib_path} has no symbol {name} (needed for platform {platform}); "
                    f"the library is incomplete or stale. {_BUILD_HINT}"
                ) from e

        # The state type first: XLA refuses a handler whose types are not registered yet.
        type_id, type_info = symbol("tide_ffi_instance_type_id"), symbol("tide_ffi_instance_type_info")
        type_id.restype = type_info.restype = ctypes.c_void_p
        jax.ffi.register_ffi_type(
            INSTANCE_TYPE,
            {"type_id": _capsule(type_id()), "type_info": _capsule(type_info())},
            platform=platform,
        )
        for target, prefix in TARGETS.items():
            handlers = {
                "instantiate": jax.ffi.pycapsule(symbol(prefix + "_instantiate")),
                "execute": jax.ffi.pycapsule(symbol(prefix + suffix)),
            }
            jax.ffi.register_ffi_target(target, handlers, platform=platform)
        _registered.add(platform)


def _capsule(address: int):
    """A PyCapsule holding a raw pointer (what jax.ffi.register_ffi_type takes)."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new(address, None, None)
