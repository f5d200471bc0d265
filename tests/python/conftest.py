"""pytest setup for tide_jax: 8 forced CPU devices, set before jax is imported anywhere.

JAX_PLATFORMS defaults to cpu, or cuda,cpu where a GPU is present (an explicit setting wins). Tests that use
the native library fail, not skip, when it is missing: scripts/test builds it (target/release).
"""

import os
import sys

_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if "xla_force_host_platform_device_count" not in f and "xla_allow_excess_precision" not in f]
# Excess precision off: XLA:GPU may otherwise skip a bf16 rounding that the pure-JAX references
# write (convert to bf16 and back), so a reference would not compute what it says (seen on H200).
os.environ["XLA_FLAGS"] = " ".join(
    _flags + ["--xla_force_host_platform_device_count=8", "--xla_allow_excess_precision=false"])
def _gpu_present() -> bool:
    import importlib.util

    plugin = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return plugin and os.path.exists("/dev/nvidiactl")


# GPUs present: CUDA for the gpu-marked tests and the 8 CPU devices for the rest; else CPU only.
os.environ.setdefault("JAX_PLATFORMS", "cuda,cpu" if _gpu_present() else "cpu")
# XLA:CPU runs each device's program on a pool of max(NPROC or cores, devices) threads, and its
# collectives (and tide's) block a pool thread until every device arrives: with exactly as many
# threads as devices, one thread busy elsewhere starves the last device and XLA aborts the process
# after 40 s ("only 7 of them arrived"; seen on the 2-core CI). Spare threads avoid it.
os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 16)))
# test_random.py's cases come from this session's entropy: drawn here, in the first process that
# loads this file, and inherited by pytest-xdist's workers, so that every worker collects the same.
os.environ.setdefault("TIDE_RANDOM_ENTROPY", str(int.from_bytes(os.urandom(8), "little") >> 1))
# Test this checkout's package (python/), not a copy installed earlier; its native library is found
# by tide_jax._lib: $TIDE_LIBRARY, else target/release/libtide.so (which `cargo build --release`
# writes). TIDE_TEST_INSTALLED=1 tests the tide_jax installed in this Python instead (a wheel, e.g.
# on the GPU machine: scripts/gpu run), with the library inside it.
_here = os.path.dirname(os.path.abspath(__file__))
_checkout_python = os.path.join(os.path.dirname(os.path.dirname(_here)), "python")
INSTALLED = os.environ.get("TIDE_TEST_INSTALLED") == "1"
if not INSTALLED:
    sys.path.insert(0, _checkout_python)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import tide_jax  # noqa: E402

#: The folder holding the tide_jax under test: what a test's subprocess puts first on PYTHONPATH.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tide_jax.__file__)))
if INSTALLED and os.path.abspath(PACKAGE_ROOT) == os.path.abspath(_checkout_python):
    raise RuntimeError(f"TIDE_TEST_INSTALLED=1 but tide_jax comes from the checkout ({tide_jax.__file__}): "
                       "put the installed copy on PYTHONPATH or install it")


def subprocess_pythonpath(env=None) -> str:
    """PYTHONPATH for a test's subprocess: the package under test first, then `env`'s (os.environ's)."""
    rest = (os.environ if env is None else env).get("PYTHONPATH", "")
    return os.pathsep.join([PACKAGE_ROOT] + ([rest] if rest else []))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped where none are present)")


def cpu_devices(n):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.fail(f"need {n} CPU devices, have {len(devices)}: XLA_FLAGS was not applied before jax was imported")
    return devices[:n]


def make_mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(cpu_devices(n)).reshape(shape), names)


@pytest.fixture(params=["tide", "jax"])
def backend(request):
    """Runs a test on the native library and on the pure-JAX twin."""
    previous = tide_jax.set_backend(request.param)
    yield request.param
    tide_jax.set_backend(previous)


@pytest.fixture
def tide_backend():
    previous = tide_jax.set_backend("tide")
    yield "tide"
    tide_jax.set_backend(previous)


# What examples/train.py's setup_env writes into os.environ when a test calls train.main in this
# process (test_checkpoint.py, test_train.py): its device count (--devices 3 writes 3) and MaxText's
# XLA flags, JAX_PLATFORMS, NPROC. Those reach every later subprocess of the session, so they are
# put back after each test to what this file set. They used to be put back by whichever train.main
# call came next: under pytest-xdist a worker runs the tests in any order, and in a serial run where
# that call failed test_interleaved.py's subprocess got 3 devices for its 8-device mesh.
_ENV_AS_SET = {k: os.environ.get(k) for k in ("XLA_FLAGS", "JAX_PLATFORMS", "NPROC")}


@pytest.fixture(autouse=True)
def _environment_as_set():
    yield
    for k, v in _ENV_AS_SET.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
