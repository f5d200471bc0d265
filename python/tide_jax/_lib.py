"""Finding, loading and registering the native library (the Rust cdylib `libtide`).

Search order: `$TIDE_LIBRARY` (a path to the .so), the copy installed inside this package by
`pip install .`, then `target/release/libtide.so` of the source checkout this package lives in.
Registration of the XLA FFI targets happens once, lazily, on the first tide collective traced.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import threading

import jax

log = logging.getLogger("tide_jax")

#: FFI target names and the symbol prefixes that implement them (docs/design.md, "FFI contract").
TARGETS = {
    "tide_all_gather": "tide_ffi_all_gather",
    "tide_reduce_scatter": "tide_ffi_reduce_scatter",
}

_BUILD_HINT = (
    "Build and install it with `pip install .` at the root of the tide repository (needs a Rust "
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


def _check_settings(lib) -> None:
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
        _check_settings(lib)
        suffix = "_cuda" if platform == "CUDA" else "_cpu"
        for target, prefix in TARGETS.items():
            symbol = prefix + suffix
            try:
                fn = getattr(lib, symbol)
            except AttributeError as e:
                raise LibraryNotFoundError(
                    f"tide: {_lib_path} has no symbol {symbol} (needed for platform {platform}); "
                    f"the library is incomplete or stale. {_BUILD_HINT}"
                ) from e
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform=platform)
        _registered.add(platform)
