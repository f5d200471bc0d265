"""Builds the Rust cdylib `libtide` (release) and installs it inside the `tide_jax` package.

Everything else is in pyproject.toml; setuptools-rust needs its RustExtension declared here.
`binding=NoBinding`: the library is not a Python extension module, it is loaded with ctypes and
registered as XLA FFI targets (python/tide_jax/_lib.py), and it loads CUDA, NVRTC and NCCL itself at
run time (dlopen). So it does not depend on the Python version: it lands as `tide_jax/libtide.so`
(not setuptools-rust's `libtide.<python-tag>.so`) and the wheel is tagged `py3-none-<platform>`,
one wheel for every Python >= 3.10 (scripts/wheel adds the manylinux platform tag with auditwheel).
Debug info is stripped from the installed copy (`strip -S`); target/release keeps it.

XLA FFI headers: build.rs takes them from TIDE_XLA_FFI_INCLUDE, else asks $PYO3_PYTHON (which
setuptools-rust sets to this interpreter) for `import jaxlib`. Under `pip install .` this interpreter
runs in pip's isolated build environment, whose jaxlib is the pinned 0.10.2 of pyproject.toml; we
set TIDE_XLA_FFI_INCLUDE from it explicitly so the choice never depends on what else is installed.
"""

import os
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip
from setuptools_rust.build import build_rust

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel


def _pin_xla_ffi_headers():
    if os.environ.get("TIDE_XLA_FFI_INCLUDE"):
        return
    try:
        import jaxlib
        import jaxlib.version
    except ImportError:
        return  # build.rs reports what is missing
    include = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    if os.path.isfile(os.path.join(include, "xla", "ffi", "api", "ffi.h")):
        os.environ["TIDE_XLA_FFI_INCLUDE"] = include
        print(f"tide: XLA FFI headers from jaxlib {jaxlib.version.__version__} at {include}", file=sys.stderr)
        if jaxlib.version.__version__ != "0.10.2":
            print(
                "tide: warning: headers are not jaxlib 0.10.2's; the library may be rejected by older jaxlibs",
                file=sys.stderr,
            )


class BuildRust(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        # tide_jax/libtide.so: the library is the same for every Python (see the module docstring).
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), target_fname.rsplit(".", 1)[-1] + ".so")


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


_pin_xla_ffi_headers()

setup(
    rust_extensions=[
        RustExtension(
            "tide_jax.libtide",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            debug=False,
            strip=Strip.Debug,
            # Both crate types, as Cargo.toml builds them: setuptools-rust would otherwise ask for
            # cdylib alone, another build of the crate than `cargo build --release` and the tests'.
            args=["--crate-type", "cdylib,rlib"],
        )
    ],
    cmdclass={"build_rust": BuildRust, "bdist_wheel": BdistWheel},
)
