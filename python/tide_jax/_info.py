"""`tide_jax.info()` and `python -m tide_jax.info`: one block to paste into a bug report.

Which `tide_jax` and which native library were loaded (path and where it was found), the library's
own build stamp (version, git commit, the XLA FFI API and jaxlib version of its headers: from the
library, src/info.rs, so a stale or foreign library shows as such), the CUDA driver the library
finds ("not found: why" on a machine without one) and the NVRTC and NCCL this process has loaded
(never loading them), JAX and jaxlib with their XLA FFI API and devices, the CUDA wheels installed,
Python and the platform, the TIDE_* settings. Lines starting with `!!` are problems
found on the way (a library older than the package, headers newer than the runtime, two NCCLs).

Nothing here raises: every part that fails says why in its line.
"""

from __future__ import annotations

import os
import platform
import re
import sys

from . import _lib, _settings


def info() -> str:
    """The report as text (what `python -m tide_jax.info` prints)."""
    from . import __version__

    lines = [f"tide_jax {__version__} from {os.path.dirname(os.path.abspath(__file__))}"]
    problems = []
    lib = None
    try:
        path = _lib.library_path()
        lines.append(f"library: {path} ({_lib.library_origin()})")
        lib = _lib.load()
    except Exception as e:  # not found or not loadable: say so, report the rest
        lines.append(f"library: not loaded: {e}")
        problems.append("the native library could not be loaded (see `library:`)")

    jax_lines, runtime_api = _jax_report()  # before the probe: JAX loads its NCCL first
    build = None
    if lib is not None:
        build = _guard(lambda: _lib.build_info(lib))
        if isinstance(build, Exception):
            lines.append(f"  build: error: {build}")
        elif build is None:
            lines.append("  build: none (the library has no tide_build_info: built before the build stamp existed)")
            problems.append("the library predates its build stamp: a stale build; reinstall tide_jax")
        else:
            lines.append("  build: " + _build_line(build))
            problems += _build_problems(build, __version__, runtime_api)
        runtime = _guard(lambda: _lib.runtime_info(lib))
        if isinstance(runtime, Exception):
            lines.append(f"  runtime probe: error: {runtime}")
        elif runtime is None:
            lines.append("  runtime probe: none (the library has no tide_runtime_info)")
        else:
            for key, label in (("cuda driver", "CUDA driver"), ("cuda devices", "CUDA devices"),
                               ("nvrtc", "NVRTC"), ("nccl", "NCCL")):
                if key in runtime:
                    lines.append(f"  {label}: {runtime[key]}")
            for key, value in runtime.items():
                if key.startswith("loaded "):
                    files = value.split("\n")
                    lines += [f"  {key}: {f}" for f in files]
                    if key == "loaded libnccl" and len(files) > 1:
                        problems.append("two NCCL libraries in this process (see `loaded libnccl`): set "
                                        "TIDE_NCCL_LIB to the one JAX uses")
    lines += jax_lines
    lines.append("CUDA wheels: " + _cuda_wheels())
    lines.append(_python_line())
    settings = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("TIDE_"))
    lines.append("settings: " + (" ".join(settings) if settings else "none (TIDE_* unset: defaults)"))
    bad = _guard(_settings.problems)
    problems += [f"invalid setting: {e}" for e in (bad if isinstance(bad, list) else [f"cannot check: {bad}"])]
    if lib is not None:
        native = _guard(lambda: _lib.check_settings(lib))
        if isinstance(native, Exception):
            problems.append(f"invalid setting: {native}")
    lines += [f"!! {p}" for p in problems]
    return "\n".join(lines)


def _guard(fn):
    try:
        return fn()
    except Exception as e:  # reported, never raised
        return e


def _build_line(b: dict) -> str:
    return (f"{b.get('version', '?')}, commit {b.get('commit', '?')} (uncommitted changes: "
            f"{b.get('uncommitted changes', '?')}), XLA FFI API {b.get('xla ffi api', '?')} (jaxlib "
            f"{b.get('jaxlib headers', '?')} headers), {b.get('profile', '?')}, {b.get('rustc', '?')}, "
            f"{b.get('target', '?')}")


def _version(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split("."))
    except (AttributeError, ValueError):
        return None


def _build_problems(b: dict, package_version: str, runtime_api: str | None) -> list[str]:
    out = []
    if b.get("version") != package_version:
        out.append(f"the library is tide {b.get('version')}, the Python package tide_jax {package_version}: "
                   "install them together (one wheel, or `pip install .` of one checkout)")
    built, runs = _version(b.get("xla ffi api")), _version(runtime_api)
    if built and runs and built > runs:
        out.append(f"the library was built against XLA FFI API {b.get('xla ffi api')} headers, newer than "
                   f"this jaxlib's {runtime_api}: XLA refuses its handlers (build against jaxlib 0.10.2)")
    return out


def _jax_report() -> tuple[list[str], str | None]:
    """The `jax` line(s) and the runtime's XLA FFI API version ("0.4"), if readable."""
    try:
        import jax
        import jaxlib
    except Exception as e:
        return [f"jax: not importable: {e}"], None
    jaxlib_version = getattr(jaxlib, "__version__", None)
    if jaxlib_version is None:
        try:
            from jaxlib import version as _v

            jaxlib_version = _v.__version__
        except Exception:
            jaxlib_version = "?"
    api = None
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
        major = re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text)
        minor = re.search(r"#define XLA_FFI_API_MINOR (\d+)", text)
        if major and minor:
            api = f"{major.group(1)}.{minor.group(1)}"
    except Exception:
        pass
    line = f"jax {jax.__version__}, jaxlib {jaxlib_version} (XLA FFI API {api or '?'})"
    try:
        devices = jax.devices()
        kinds = sorted({getattr(d, "device_kind", d.platform) for d in devices})
        line += (f": backend {jax.default_backend()}, {len(devices)} device{'s' if len(devices) != 1 else ''} "
                 f"({', '.join(kinds)})")
    except Exception as e:
        line += f": no backend: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return [line], api


def _cuda_wheels() -> str:
    """The pip packages that bring JAX's CUDA backend, NCCL and NVRTC, with versions (not loaded)."""
    try:
        from importlib import metadata

        found = set()
        for dist in metadata.distributions():
            name = (dist.metadata["Name"] or "").lower().replace("_", "-")
            if name.startswith(("jax-cuda", "nvidia-nccl", "nvidia-cuda-nvrtc")):
                found.add(f"{name} {dist.version}")
        return ", ".join(sorted(found)) or "none (no jax-cuda, nvidia-nccl or nvidia-cuda-nvrtc package)"
    except Exception as e:
        return f"unknown: {e}"


def _python_line() -> str:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or "?"
    except (AttributeError, ValueError, OSError):
        libc = "?"
    return (f"python {platform.python_version()} at {sys.executable}; {platform.system()} "
            f"{platform.release()} {platform.machine()}; {libc}")


def main() -> int:
    # A report must not take the GPUs' memory from a job running beside it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(info())
    return 0
