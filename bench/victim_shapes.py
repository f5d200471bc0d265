"""The launch shapes of bench/progress.py's victims, for issue #38: is each one a grid of many short
CTAs (a pending tide CTA of higher priority gets an SM whenever one of them retires) or a persistent
grid of about one CTA per SM that holds every SM until the kernel ends (then nothing of tide's can
start beside it, whatever its priority)?

Runs each victim's jitted step once after a warm-up (autotuning done), between cuProfilerStart and
cuProfilerStop, so a profiler started with `--profile-from-start off` sees exactly those kernels:

    ncu --profile-from-start off --csv --metrics launch__grid_size,launch__block_size,\
launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__waves_per_multiprocessor,\
launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem python3 bench/victim_shapes.py

Without a profiler it prints each victim's step time and nothing else (a smoke test; also on CPU:
JAX_PLATFORMS=cpu python3 bench/victim_shapes.py --scale 64).
"""
import argparse
import ctypes
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import progress  # noqa: E402  (the victims' definitions)


def cuda_profiler():
    """(start, stop) of the CUDA driver's profiler range, or no-ops off GPUs."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return lib.cuProfilerStart, lib.cuProfilerStop
    except OSError:
        return (lambda: 0), (lambda: 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--victims", default=",".join(progress.VICTIMS))
    ap.add_argument("--scale", type=int, default=1)
    args = ap.parse_args()
    on_gpu = jax.devices()[0].platform == "gpu"
    start, stop = cuda_profiler()
    for name in args.victims.split(","):
        desc, init, step = progress.victim(name, args.scale, on_gpu)
        state = init(jax.random.key(0))
        f = jax.jit(step)
        jax.block_until_ready(f(state))  # compile and autotune outside the range
        jax.block_until_ready(f(state))
        t = time.perf_counter()
        start()
        jax.block_until_ready(f(state))
        stop()
        print(f"victim_shapes: {name} ({desc}): one step {1e3 * (time.perf_counter() - t):.3f} ms "
              f"wall (inside the profiled range)", flush=True)


if __name__ == "__main__":
    main()
