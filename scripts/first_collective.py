"""The first tide collective of a fresh install: an all-gather through tide_jax, checked, timed.

    python3 scripts/first_collective.py [--platform cpu|cuda] [--installed]

cpu (default): 2 forced CPU devices. cuda: every visible GPU (one GPU has world size 1, where tide_jax
skips the native call unless TIDE_WORLD1_NATIVE=1, which this sets). --installed: tide_jax and its
library must come from an installed copy (site-packages or a pip --target folder), with no
TIDE_LIBRARY, no source checkout and no cargo or rustc on PATH; what scripts/wheel check and
scripts/gpu run use. Prints where tide_jax and the library came from and the seconds from the start
of this process (import, then the first call: trace, compile and run) to the checked result.
"""

import argparse
import os
import shutil
import sys
import time

T0 = time.perf_counter()

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
parser.add_argument("--installed", action="store_true", help="fail unless tide_jax is an installed copy")
args = parser.parse_args()
if args.platform == "cpu":
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        + ["--xla_force_host_platform_device_count=2"])
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    os.environ["JAX_PLATFORMS"] = "cuda"
    os.environ.setdefault("TIDE_WORLD1_NATIVE", "1")
# Never this checkout's python/: a script's folder is sys.path[0], and scripts/ holds no tide_jax.

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tide_jax  # noqa: E402

t_import = time.perf_counter() - T0
package = os.path.dirname(os.path.abspath(tide_jax.__file__))
library = tide_jax.library_path()
print(f"tide_jax {tide_jax.__version__} from {package}")
print(f"library {library}")
if args.installed:
    problems = []
    if "TIDE_LIBRARY" in os.environ:
        problems.append(f"TIDE_LIBRARY is set ({os.environ['TIDE_LIBRARY']})")
    if library != os.path.join(package, "libtide.so"):
        problems.append(f"the library {library} is not the one inside the package {package}")
    if os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(package)), "src")) and \
            os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(package)), "Cargo.toml")):
        problems.append(f"tide_jax comes from a source checkout ({package})")
    for tool in ("cargo", "rustc"):
        if shutil.which(tool):
            problems.append(f"{tool} is on PATH ({shutil.which(tool)})")
    if problems:
        sys.exit("first_collective: not an installed copy: " + "; ".join(problems))

devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
params = {"w": np.arange(15 * len(devices), dtype=np.float32).reshape(5 * len(devices), 3), "b": np.ones(7, np.float32)}
lay = tide_jax.layout(params, mesh, "x")
gather = jax.jit(tide_jax.shard_map(lambda s: jax.tree.map(lambda a: a[None], tide_jax.all_gather(s, lay)),
                                    mesh=mesh, in_specs=(lay.spec,), out_specs=P("x")))
out = jax.tree.map(np.asarray, gather(lay.shard(params)))
for name, full in params.items():
    if not (out[name] == full[None]).all():
        sys.exit(f"first_collective: all_gather of {name!r} is wrong: {out[name]}")
total = time.perf_counter() - T0
print(f"first collective OK: all_gather on {len(devices)} {devices[0].platform} device(s) through "
      f"{os.path.basename(library)}; {total:.2f} s from process start (imports {t_import:.2f} s)")
