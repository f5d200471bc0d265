"""`tide_jax.info()` / `python -m tide_jax.info`: the bug-report block, with the build stamp read from
the library itself (src/info.rs) and a runtime probe that never fails (here: no CUDA)."""

import os
import re
import subprocess
import sys

import tide_jax
from tide_jax import _info, _lib

from conftest import subprocess_pythonpath


def test_build_info_comes_from_the_loaded_library():
    b = _lib.build_info()
    assert b is not None, "the library has no tide_build_info"
    assert b["version"] == tide_jax.__version__
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", b["commit"]), b
    assert b["uncommitted changes"].split()[0] in ("yes", "no", "unknown"), b
    assert b["xla ffi api"] == "0.3", b  # jaxlib 0.10.2's headers (build.rs MAX_API)
    assert b["jaxlib headers"] == "0.10.2", b
    assert b["target"].endswith("-linux-gnu"), b


def test_runtime_probe_names_cuda_nvrtc_and_nccl():
    r = _lib.runtime_info()
    assert r is not None
    for key in ("cuda driver", "nvrtc", "nccl"):
        assert key in r, r
    if not os.path.exists("/dev/nvidiactl"):  # a machine without NVIDIA's driver
        assert r["cuda driver"].startswith("not found: "), r


def test_info_is_one_block_naming_the_library_and_its_build():
    text = tide_jax.info()
    lines = text.splitlines()
    assert lines[0] == f"tide_jax {tide_jax.__version__} from {os.path.dirname(tide_jax.__file__)}"
    assert lines[1].startswith(f"library: {tide_jax.library_path()} ("), text
    build = next(line for line in lines if line.startswith("  build: "))
    assert "XLA FFI API 0.3 (jaxlib 0.10.2 headers)" in build, build
    assert _lib.build_info()["commit"] in build
    for label in ("CUDA driver: ", "NVRTC: ", "NCCL: ", "jax ", "python ", "settings: "):
        assert any(line.lstrip().startswith(label) for line in lines), (label, text)
    assert not [line for line in lines if line.startswith("!!")], text


def test_a_library_without_the_stamp_reads_as_stale():
    class OldLibrary:  # what ctypes gives for a library built before tide_build_info
        pass

    assert _lib.build_info(OldLibrary()) is None
    assert _lib.runtime_info(OldLibrary()) is None
    problems = _info._build_problems({"version": "0.0.9", "xla ffi api": "0.4"}, "0.1.0", "0.3")
    assert any("tide 0.0.9" in p and "tide_jax 0.1.0" in p for p in problems), problems
    assert any("newer than this jaxlib's 0.3" in p for p in problems), problems


def test_python_m_tide_jax_info_runs_without_warnings():
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath(), "PYTHONWARNINGS": "error::RuntimeWarning"}
    r = subprocess.run([sys.executable, "-m", "tide_jax.info"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RuntimeWarning" not in r.stderr, r.stderr
    assert r.stdout.startswith("tide_jax "), r.stdout
    assert "  build: " in r.stdout and "CUDA driver: " in r.stdout, r.stdout


def test_asking_loads_neither_nvrtc_nor_nccl():
    # The report must not change which NVRTC or NCCL tide (or JAX) loads later. With the NVRTC
    # wheel named by TIDE_NVRTC_LIB_DIR (as scripts/test sets it where installed), loading it
    # would be one dlopen away.
    code = ("import tide_jax; text = tide_jax.info(); "
            "maps = open('/proc/self/maps').read(); "
            "print('LOADED' if ('libnvrtc' in maps or 'libnccl' in maps) else 'CLEAN'); print(text)")
    env = {**os.environ, "PYTHONPATH": subprocess_pythonpath()}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("CLEAN"), r.stdout
    assert "NVRTC: not loaded yet" in r.stdout and "NCCL: not loaded yet" in r.stdout, r.stdout
