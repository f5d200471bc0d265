"""On a GPU machine: does the library built here (against jaxlib 0.10.2's XLA FFI headers) register
and get called under the installed jax (0.11.2 there) on the CUDA platform, without taking the
backend down? Calls tide_all_gather on every GPU; succeeds if the CUDA engine is built, else must
fail with a clean Python exception from it. Then checks the GPU backend still works.

    python3 scripts/ffi_gpu_probe.py path/to/libtide.so
"""

import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

lib = ctypes.CDLL(sys.argv[1])
print("jax", jax.__version__, "devices", jax.devices())
for op in ("all_gather", "reduce_scatter"):
    jax.ffi.register_ffi_target(f"tide_{op}", jax.ffi.pycapsule(getattr(lib, f"tide_ffi_{op}_cuda")), platform="CUDA")
    jax.ffi.register_ffi_target(f"tide_{op}", jax.ffi.pycapsule(getattr(lib, f"tide_ffi_{op}_cpu")), platform="cpu")
print("registered CUDA and cpu targets")

devs = np.array(jax.devices())
world = len(devs)
mesh = Mesh(devs, ("x",))
attrs = dict(
    site=np.int64(1), world=np.int64(world), nodes=np.int64(1), gpus_per_node=np.int64(world),
    device_ordinals=np.array([d.local_hardware_id for d in devs], np.int64),
    device_ranks=np.arange(world, dtype=np.int64), device_groups=np.zeros(world, np.int64),
    names="probe.w",
)
rows = 7
sr = -(-rows // world)
f = jax.jit(jax.shard_map(
    lambda s: jax.ffi.ffi_call("tide_all_gather", jax.ShapeDtypeStruct((rows, 3), jnp.float32))(s, **attrs)[None],
    mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
x = jnp.arange(world * sr * 3, dtype=jnp.float32).reshape(world * sr, 3)
try:
    out = np.asarray(f(x))
    ok = all(np.array_equal(out[i], np.asarray(x)[:rows]) for i in range(world))
    print("CUDA all_gather ran:", "correct" if ok else "WRONG RESULT")
except Exception as e:
    print("CUDA all_gather raised (expected while the CUDA engine is a stub):", type(e).__name__, str(e).splitlines()[0][:300])

y = (jnp.ones((256, 256)) @ jnp.ones((256, 256))).sum()
print("GPU backend alive after the call:", float(y) == 256.0 ** 3)
