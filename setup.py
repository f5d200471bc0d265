"""Builds the Rust cdylib `libtide` (release) and installs it inside the `tide_jax` package.

Everything else is in pyproject.toml; setuptools-rust needs its RustExtension declared here.
`binding=NoBinding`: the library is not a Python extension module, it is loaded with ctypes and
registered as XLA FFI targets (python/tide_jax/_lib.py). It lands as
tide_jax/libtide.<python-tag>.so, which _lib.py finds by the glob libtide*.so.

XLA FFI headers: build.rs takes them from TIDE_XLA_FFI_INCLUDE, else asks $PYO3_PYTHON (which
setuptools-rust sets to this interpreter) for `import jaxlib`. We set TIDE_XLA_FFI_INCLUDE to the copy
of jaxlib 0.10.2's headers in third_party/xla_ffi (so pip's build environment needs no jaxlib
download, and the choice never depends on what else is installed); without that folder, to the
headers of this interpreter's jaxlib.
"""

import os
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension


def _pin_xla_ffi_headers():
    if os.environ.get("TIDE_XLA_FFI_INCLUDE"):
        return
    vendored = os.path.join(os.path.dirname(os.path.abspath(__file__)), "third_party", "xla_ffi", "include")
    if os.path.isfile(os.path.join(vendored, "xla", "ffi", "api", "ffi.h")):
        os.environ["TIDE_XLA_FFI_INCLUDE"] = vendored
        print(f"tide: XLA FFI headers of jaxlib 0.10.2 from {vendored}", file=sys.stderr)
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


_pin_xla_ffi_headers()

setup(
    rust_extensions=[
        RustExtension(
            "tide_jax.libtide",
            path="Cargo.toml",
            binding=Binding.NoBinding,
            debug=False,
        )
    ],
)
