#!/usr/bin/env python3
"""tide benchmark: FSDP all-gather and reduce-scatter on two Llama-like parameter groups, against the
copy-engine floor and JAX's own collectives, in one run (issue #3).

Sections, each run in its own subprocess so that a crash or hang in one keeps the others' results:
  floor         copy-engine floor: the bytes each GPU must receive, peer copies alone (cupy), k=1 and
                k=4 streams, and per-parameter pieces over 4 streams; both GPUs pulling at once.
  jax           JAX per-parameter all-gather, flat all-gather + copy-out, bf16 psum_scatter,
                upcast-fp32 psum_scatter, flat fp32 pack + psum_scatter (default XLA flags).
  tide          tide all_gather and reduce_scatter (bf16 in, fp32 out), plus correctness checks.
  interference  slowdown of a concurrent one-wave bf16 GEMM (torch, own stream, GPU 0) while each
                collective runs (JAX/NCCL AG, NCCL RS fp32/bf16, tide AG, tide RS); overlap checked.
  memory        extra device memory of each op: XLA temp bytes (compiled memory_analysis), device
                memory outside XLA's pool that appears at the first call (cudaMemGetInfo), and the
                growth of XLA's peak_bytes_in_use.
  jaxflags      the jax section again under MaxText-style XLA flags (latency-hiding scheduler,
                128 MiB combine thresholds, pipelined collectives, while-loop double buffering).

Timing: each op runs R times inside one jitted step (lax.fori_loop; an optimization_barrier ties the
inputs to the previous outputs so XLA can neither hoist nor elide the collective; the results are loop
carries, so every byte is really written). The step is timed on the host around block_until_ready;
per-call ms = step time / R; median and p10/p90 over >= 15 steps. A dispatch-style cross-check
(R=1 step called 20 times back to back, as in the baselines) is recorded too.

Usage (repo root):  python3 bench/bench.py --out DIR [--quick] [--cpu-smoke] [--sections a,b] [--budget S]
Writes DIR/bench.json, DIR/RESULTS.md (a section for bench/RESULTS.md) and DIR/latency.png.
Environment: tide_jax importable with its library (installed, or PYTHONPATH=python with
TIDE_LIBRARY naming libtide.so).
"""
import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import traceback

MiB = 1 << 20
AXIS = "fsdp"
ALL_SECTIONS = ("floor", "jax", "tide", "interference", "memory", "jaxflags")
GPU_ONLY = ("floor", "interference")
SECTION_LIMIT_S = {"floor": 90, "jax": 150, "tide": 150, "interference": 180, "memory": 150, "jaxflags": 150}
STRONG_XLA_FLAGS = [
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
]
# Which ops each section times; names are stable keys of bench.json.
AG_JAX = ("jax_ag_per_param", "jax_ag_flat_copyout")
RS_JAX_FP32 = ("jax_rs_upcast_fp32", "jax_rs_flat_fp32_pack")
RS_JAX_BF16 = ("jax_rs_bf16",)


# --------------------------------------------------------------------------------------------------
# shapes and configuration

def layer_shapes(h):
    """A Llama-like layer of 9 parameters scaled by hidden size h (the baselines' jax_probe.py shapes)."""
    f = int(3.5 * h)
    return {"q": (h, h), "k": (h // 8, h), "v": (h // 8, h), "o": (h, h), "gate": (f, h), "up": (f, h),
            "down": (h, f), "norm1": (h,), "norm2": (h,)}


def group_bytes(shapes, itemsize=2):
    return sum(math.prod(s) for s in shapes.values()) * itemsize


def run_config(args):
    """Sizes and repetition counts for the chosen mode."""
    if args.cpu_smoke:
        return dict(groups=[int(g) for g in args.groups.split(",")] if args.groups else [64, 128], samples=5, warm=1, target_step_ms=5.0, max_R=8, min_R=2,
                    dispatch_n=5, dispatch_rounds=3)
    groups = [int(g) for g in args.groups.split(",")] if args.groups else ([1664] if args.quick else [1664, 3328])
    if args.quick:
        return dict(groups=groups, samples=15, warm=2, target_step_ms=8.0, max_R=100, min_R=4,
                    dispatch_n=20, dispatch_rounds=3)
    return dict(groups=groups, samples=25, warm=3, target_step_ms=15.0, max_R=200, min_R=8,
                dispatch_n=20, dispatch_rounds=5)


def stats_ms(values):
    """Median, p10, p90, min, max of a list of milliseconds."""
    v = sorted(values)
    def pct(p):
        if len(v) == 1:
            return v[0]
        x = p * (len(v) - 1)
        lo = int(math.floor(x)); hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)
    return dict(median=statistics.median(v), p10=pct(0.10), p90=pct(0.90), min=v[0], max=v[-1], n=len(v))


class Results:
    """A section's results, written to disk after every change so a crash loses nothing recorded."""

    def __init__(self, path, section):
        self.path = path
        self.data = {"section": section, "started": now_iso(), "records": {}, "errors": {}}
        self.flush()

    def put(self, key, value):
        self.data["records"][key] = value
        self.flush()

    def error(self, key, exc):
        msg = f"{type(exc).__name__}: {exc}"
        tb = traceback.format_exc()
        self.data["errors"][key] = {"error": msg[:2000], "traceback": tb[-4000:]}
        print(f"[{self.data['section']}] FAILED {key}: {msg[:500]}", flush=True)
        self.flush()

    def flush(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1, default=str)
        os.replace(tmp, self.path)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def guarded(res, key):
    """Decorator-like helper: run fn, record its error under key, never raise."""
    def wrap(fn):
        try:
            out = fn()
            return out
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and the run goes on
            res.error(key, exc)
            return None
    return wrap


# --------------------------------------------------------------------------------------------------
# JAX side (imported inside workers only)

def jax_setup():
    import numpy as np
    import jax
    from jax.sharding import Mesh
    devs = jax.devices()
    if os.environ.get("TIDE_BENCH_EXPECT_GPU") == "1" and jax.default_backend() != "gpu":
        raise RuntimeError(f"expected JAX's GPU backend, got {jax.default_backend()!r} with devices {devs}: "
                           "no numbers from a CPU fallback")
    mesh = Mesh(np.array(devs), (AXIS,))
    return jax, mesh, devs


def smap(jax, mesh, f, in_specs, out_specs):
    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map
    try:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def make_data(jax, mesh, shapes, seed):
    """bf16 parameters sharded on dim 0, and per-device full bf16 gradients stacked as (P, *shape)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    W = mesh.shape[AXIS]
    key = jax.random.PRNGKey(seed)
    sh = NamedSharding(mesh, P(AXIS))
    params, grads = {}, {}
    for i, (name, s) in enumerate(shapes.items()):
        params[name] = jax.jit(lambda k, s=s: jax.random.normal(k, s, jnp.bfloat16), out_shardings=sh)(
            jax.random.fold_in(key, i))
        grads[name] = jax.jit(lambda k, s=s: jax.random.normal(k, (W,) + s, jnp.bfloat16), out_shardings=sh)(
            jax.random.fold_in(key, 1000 + i))
    jax.block_until_ready((params, grads))
    return params, grads


def fp32_grads(jax, mesh, grads):
    """The gradients already in fp32 (for NCCL's fp32 reduce-scatter without a cast in the timed op)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    sh = NamedSharding(mesh, P(AXIS))
    out = {k: jax.jit(lambda v: v.astype(jnp.float32), out_shardings=sh)(v) for k, v in grads.items()}
    jax.block_until_ready(out)
    return out


def pick_arg(kind, name, params, shards, grads, grads32):
    if kind == "params":
        return shards if name.startswith("tide") else params
    return grads32 if kind == "grads32" else grads


def op_bodies(jax, mesh, shapes, tide=None, lay=None):
    """Per-device bodies of every op: name -> (fn(local_inputs) -> local_outputs, input kind, out specs).

    Input kind "params": the local shards (shard_rows, *rest); "grads": the local (1, *shape) slice of the
    stacked per-device gradients, whose [0] is this device's full gradient."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    W = mesh.shape[AXIS]
    names = list(shapes)
    rep = {k: P() for k in names}
    shard_spec = {k: P(AXIS) for k in names}
    bodies = {}

    def ag_per_param(p):
        return {k: jax.lax.all_gather(v, AXIS, axis=0, tiled=True) for k, v in p.items()}

    def ag_flat_copyout(p):
        flat = jnp.concatenate([p[k].ravel() for k in names])
        g = jax.lax.all_gather(flat, AXIS, axis=0, tiled=False)  # (W, S)
        res, off = {}, 0
        for k in names:
            n = p[k].size
            res[k] = g[:, off:off + n].reshape((W * p[k].shape[0],) + p[k].shape[1:])
            off += n
        return res

    def rs_bf16(g):
        return {k: jax.lax.psum_scatter(v[0], AXIS, scatter_dimension=0, tiled=True) for k, v in g.items()}

    def rs_upcast_fp32(g):
        return {k: jax.lax.psum_scatter(v[0].astype(jnp.float32), AXIS, scatter_dimension=0, tiled=True)
                for k, v in g.items()}

    def rs_fp32_prepacked(g):
        return {k: jax.lax.psum_scatter(v[0], AXIS, scatter_dimension=0, tiled=True) for k, v in g.items()}

    def rs_flat_fp32_pack(g):
        chunks = []
        for r in range(W):
            for k in names:
                v = g[k][0]
                rows = v.shape[0] // W
                chunks.append(v[r * rows:(r + 1) * rows].astype(jnp.float32).ravel())
        flat = jnp.concatenate(chunks)
        s = jax.lax.psum_scatter(flat, AXIS, scatter_dimension=0, tiled=True)
        res, off = {}, 0
        for k in names:
            v = g[k][0]
            n = v.size // W
            res[k] = s[off:off + n].reshape((v.shape[0] // W,) + v.shape[1:])
            off += n
        return res

    bodies["jax_ag_per_param"] = (ag_per_param, "params", rep)
    bodies["jax_ag_flat_copyout"] = (ag_flat_copyout, "params", rep)
    bodies["jax_rs_bf16"] = (rs_bf16, "grads", shard_spec)
    bodies["jax_rs_upcast_fp32"] = (rs_upcast_fp32, "grads", shard_spec)
    bodies["jax_rs_flat_fp32_pack"] = (rs_flat_fp32_pack, "grads", shard_spec)
    bodies["jax_rs_fp32_prepacked"] = (rs_fp32_prepacked, "grads32", shard_spec)
    if tide is not None and lay is not None:
        bodies["tide_ag"] = (lambda p: tide.all_gather(p, lay), "params", rep)
        bodies["tide_rs"] = (lambda g: tide.reduce_scatter({k: v[0] for k, v in g.items()}, lay), "grads",
                             lay.spec)
    return bodies


def build_step(jax, mesh, body, in_kind, out_specs, R, param_spec):
    """A jitted step running `body` R times: the first call outside the loop, R-1 in a fori_loop whose
    carry is (inputs, outputs). optimization_barrier makes each call's inputs depend on the previous
    outputs, so the collective is neither hoisted out of the loop nor elided; outputs are loop carries,
    so they are fully written every time."""
    from jax.sharding import PartitionSpec as P
    in_spec = param_spec if in_kind == "params" else {k: P(AXIS) for k in param_spec}

    def local(x):
        out = body(x)
        if R > 1:
            def it(i, carry):
                inp, prev = jax.lax.optimization_barrier(carry)
                return inp, body(inp)
            _, out = jax.lax.fori_loop(0, R - 1, it, (x, out))
        return out

    return jax.jit(smap(jax, mesh, local, (in_spec,), out_specs))


def time_step(jax, fn, arg, samples, warm):
    for _ in range(warm):
        jax.block_until_ready(fn(arg))
    ts = []
    for _ in range(samples):
        t0 = time.perf_counter()
        out = fn(arg)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3)
        del out
    return ts


def time_dispatch(jax, fn, arg, n, rounds):
    """The baselines' method: n back-to-back calls of a one-call step, then block; ms per call."""
    jax.block_until_ready(fn(arg))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(arg)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) * 1e3 / n)
    return ts


def choose_R(jax, fn1, arg, cfg):
    """Repetitions per step so that one step lasts about cfg['target_step_ms']."""
    ts = time_dispatch(jax, fn1, arg, n=5, rounds=3)
    per = max(min(ts), 1e-3)
    R = int(math.ceil(cfg["target_step_ms"] / per))
    return max(cfg["min_R"], min(cfg["max_R"], R)), per


def measure_op(jax, mesh, name, body, in_kind, out_specs, param_spec, arg, cfg):
    fn1 = build_step(jax, mesh, body, in_kind, out_specs, 1, param_spec)
    R, est = choose_R(jax, fn1, arg, cfg)
    dispatch = time_dispatch(jax, fn1, arg, cfg["dispatch_n"], cfg["dispatch_rounds"])
    fnR = build_step(jax, mesh, body, in_kind, out_specs, R, param_spec)
    steps = time_step(jax, fnR, arg, cfg["samples"], cfg["warm"])
    per_call = [t / R for t in steps]
    rec = dict(R=R, per_call_ms=stats_ms(per_call), step_ms=stats_ms(steps), dispatch_ms=stats_ms(dispatch),
               estimate_ms=est, samples_per_call_ms=per_call)
    print(f"  {name:24s} R={R:4d} median {rec['per_call_ms']['median']:.4f} ms/call "
          f"(p10 {rec['per_call_ms']['p10']:.4f}, p90 {rec['per_call_ms']['p90']:.4f}; "
          f"dispatch-style {rec['dispatch_ms']['median']:.4f})", flush=True)
    return rec


def import_tide():
    """tide_jax and its library, or raise with a clear message."""
    import tide_jax
    tide_jax.library_path()  # raises, naming where it looked, if there is no library
    if hasattr(tide_jax, "set_backend"):
        tide_jax.set_backend("tide")  # the native library, whatever TIDE_BACKEND says
    return tide_jax


def rel_err(a, ref):
    import numpy as np
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(a - ref)) / (den if den > 0 else 1.0)


# --------------------------------------------------------------------------------------------------
# workers

def worker_jax(res, cfg, args, ops_filter=None):
    jax, mesh, devs = jax_setup()
    res.put("env", dict(jax=jax.__version__, devices=[str(d) for d in devs], backend=jax.default_backend(),
                        xla_flags=os.environ.get("XLA_FLAGS", "")))
    for h in cfg["groups"]:
        shapes = layer_shapes(h)
        g = f"h{h}"
        params, grads = make_data(jax, mesh, shapes, seed=h)
        grads32 = fp32_grads(jax, mesh, grads)
        spec = {k: jax.sharding.PartitionSpec(AXIS) for k in shapes}
        bodies = op_bodies(jax, mesh, shapes)
        print(f"[jax] group {g}: {len(shapes)} params, shard {group_bytes(shapes) / len(devs) / MiB:.1f} MiB/rank",
              flush=True)
        # correctness of the baselines (cheap): the two AG paths agree, RS error vs the exact sum
        def check():
            import numpy as np
            a = jax.jit(smap(jax, mesh, bodies["jax_ag_per_param"][0], (spec,), bodies["jax_ag_per_param"][2]))(params)
            b = jax.jit(smap(jax, mesh, bodies["jax_ag_flat_copyout"][0], (spec,), bodies["jax_ag_flat_copyout"][2]))(params)
            same = all(bool(jax.numpy.array_equal(a[k], b[k])) for k in shapes)
            out = dict(ag_paths_equal=same)
            for op in ("jax_rs_bf16", "jax_rs_upcast_fp32"):
                f, _, osp = bodies[op]
                r = jax.jit(smap(jax, mesh, f, ({k: jax.sharding.PartitionSpec(AXIS) for k in shapes},), osp))(grads)
                errs = {}
                for k in ("q", "k", "norm1"):
                    ref = np.asarray(grads[k], dtype=np.float64).sum(0)
                    errs[k] = rel_err(np.asarray(r[k], np.float64), ref)
                out[op + "_rel_err"] = errs
            return out
        chk = guarded(res, f"{g}.check")(check)
        if chk is not None:
            res.put(f"{g}.check", chk)
        for name, (body, kind, osp) in bodies.items():
            if ops_filter and name not in ops_filter:
                continue
            arg = pick_arg(kind, name, params, params, grads, grads32)
            rec = guarded(res, f"{g}.{name}")(
                lambda: measure_op(jax, mesh, name, body, kind, osp, spec, arg, cfg))
            if rec is not None:
                rec.update(group=g, shard_bytes=group_bytes(shapes) // len(devs), world=len(devs))
                res.put(f"{g}.{name}", rec)
        del params, grads, grads32


def worker_tide(res, cfg, args):
    import numpy as np
    jax, mesh, devs = jax_setup()
    tide = import_tide()
    res.put("env", dict(jax=jax.__version__, devices=[str(d) for d in devs], backend=jax.default_backend(),
                        tide_library=tide.library_path()))
    for h in cfg["groups"]:
        shapes = layer_shapes(h)
        g = f"h{h}"
        params, grads = make_data(jax, mesh, shapes, seed=h)
        lay = tide.layout(params, mesh, AXIS)
        shards = lay.shard(params)
        spec = lay.spec
        bodies = op_bodies(jax, mesh, shapes, tide, lay)
        print(f"[tide] group {g}", flush=True)

        def check():
            rep = bodies["jax_ag_per_param"][2]
            a = jax.jit(smap(jax, mesh, bodies["jax_ag_per_param"][0], (spec,), rep))(shards)
            t = jax.jit(smap(jax, mesh, bodies["tide_ag"][0], (spec,), rep))(shards)
            out = dict(tide_ag_bitwise_equal_jax={k: bool(jax.numpy.array_equal(
                jax.lax.bitcast_convert_type(a[k], jax.numpy.uint16),
                jax.lax.bitcast_convert_type(t[k], jax.numpy.uint16))) for k in shapes})
            gspec = {k: jax.sharding.PartitionSpec(AXIS) for k in shapes}
            r = jax.jit(smap(jax, mesh, bodies["tide_rs"][0], (gspec,), bodies["tide_rs"][2]))(grads)
            errs = {}
            for k in ("q", "k", "norm1"):
                ref = np.asarray(grads[k], dtype=np.float64).sum(0)
                got = np.asarray(r[k], np.float64)[:ref.shape[0]]
                errs[k] = rel_err(got, ref)
            out["tide_rs_rel_err"] = errs
            out["tide_rs_dtype"] = str(r["q"].dtype)
            return out
        chk = guarded(res, f"{g}.check")(check)
        if chk is not None:
            res.put(f"{g}.check", chk)
            print(f"  check: {json.dumps(chk)}", flush=True)
        for name in ("tide_ag", "tide_rs"):
            body, kind, osp = bodies[name]
            arg = pick_arg(kind, name, params, shards, grads, None)
            rec = guarded(res, f"{g}.{name}")(
                lambda: measure_op(jax, mesh, name, body, kind, osp, spec, arg, cfg))
            if rec is not None:
                rec.update(group=g, shard_bytes=group_bytes(shapes) // len(devs), world=len(devs))
                res.put(f"{g}.{name}", rec)
        del params, grads, shards


def worker_floor(res, cfg, args):
    """Copy-engine floor with cupy: every GPU pulls, from every other GPU, that GPU's shard, at once."""
    import cupy as cp
    rt = cp.cuda.runtime
    n = rt.getDeviceCount()
    if n < 2:
        raise RuntimeError(f"floor needs >= 2 GPUs, found {n}")
    for d in range(n):
        with cp.cuda.Device(d):
            for e in range(n):
                if e != d:
                    try:
                        rt.deviceEnablePeerAccess(e)
                    except Exception as exc:  # already enabled is fine
                        print(f"[floor] peer access {d}->{e}: {exc}", flush=True)
    res.put("env", dict(cupy=cp.__version__, gpus=n))

    def run(shapes, k, mode):
        piece_bytes = [math.prod(s) * 2 // n for s in shapes.values()]  # each param's shard (even shapes)
        shard = sum(piece_bytes)
        bufs = {}
        for d in range(n):
            with cp.cuda.Device(d):
                src = cp.random.random(shard // 4 + 1, dtype=cp.float32)
                dst = cp.empty((n * shard) // 4 + 1, dtype=cp.float32)
                streams = [cp.cuda.Stream(non_blocking=True) for _ in range(k)]
                lead = cp.cuda.Stream(non_blocking=True)
                bufs[d] = (src, dst, streams, lead)
        # copy list per device: (dst_off, src_dev, src_off, bytes)
        plan = {}
        for d in range(n):
            items = []
            for e in range(n):
                if e == d:
                    continue
                if mode == "pieces":
                    off = 0
                    for pb in piece_bytes:
                        items.append((e * shard + off, e, off, pb))
                        off += pb
                else:
                    chunk = -(-shard // k)
                    for i in range(k):
                        lo = i * chunk
                        if lo < shard:
                            items.append((e * shard + lo, e, lo, min(chunk, shard - lo)))
            plan[d] = items

        def once():
            evs = []
            for d in range(n):
                src_d, dst, streams, lead = bufs[d]
                with cp.cuda.Device(d):
                    start, stop = cp.cuda.Event(), cp.cuda.Event()
                    start.record(lead)
                    for s in streams:
                        s.wait_event(start)
                    for i, (doff, e, soff, nb) in enumerate(plan[d]):
                        s = streams[i % k]
                        rt.memcpyPeerAsync(dst.data.ptr + doff, d, bufs[e][0].data.ptr + soff, e, nb, s.ptr)
                    for s in streams:
                        ev = cp.cuda.Event()
                        ev.record(s)
                        lead.wait_event(ev)
                    stop.record(lead)
                    evs.append((start, stop))
            for a, b in evs:
                b.synchronize()
            return max(cp.cuda.get_elapsed_time(a, b) for a, b in evs)

        for _ in range(3):
            once()
        ts = [once() for _ in range(max(cfg["samples"], 15))]
        del bufs
        return ts, (n - 1) * shard

    for h in cfg["groups"]:
        shapes = layer_shapes(h)
        g = f"h{h}"
        for k, mode in ((1, "split"), (4, "split"), (4, "pieces")):
            name = f"floor_ce_k{k}" + ("_pieces" if mode == "pieces" else "")

            def m():
                ts, nbytes = run(shapes, k, mode)
                st = stats_ms(ts)
                rec = dict(per_call_ms=st, bytes_received_per_gpu=nbytes, group=g, streams=k, mode=mode,
                           GBps_each=nbytes / st["median"] / 1e6, samples_per_call_ms=ts)
                print(f"[floor] {g} {name}: {st['median']:.4f} ms ({rec['GBps_each']:.0f} GB/s each)", flush=True)
                return rec
            rec = guarded(res, f"{g}.{name}")(m)
            if rec is not None:
                res.put(f"{g}.{name}", rec)


def worker_interference(res, cfg, args):
    """GEMM slowdown on GPU 0 while a collective runs on both GPUs. The collective step is dispatched
    from a thread; after a lead-in the GEMM burst is launched on its own torch stream; host timestamps
    of the collective's completion and of the GEMM's end event show whether the two overlapped."""
    import torch
    jax, mesh, devs = jax_setup()
    import jax.numpy as jnp
    M, N, K = (2048, 2048, 16384)
    dev0 = torch.device("cuda", devs[0].local_hardware_id if hasattr(devs[0], "local_hardware_id") else 0)
    A = torch.randn(M, K, device=dev0, dtype=torch.bfloat16)
    B = torch.randn(K, N, device=dev0, dtype=torch.bfloat16)
    C = torch.empty(M, N, device=dev0, dtype=torch.bfloat16)
    gs = torch.cuda.Stream(dev0)

    def burst():
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(dev0), torch.cuda.stream(gs):
            e0.record(gs)
            for _ in range(10):
                torch.matmul(A, B, out=C)
            e1.record(gs)
        while not e1.query():
            time.sleep(20e-6)
        t_end = time.perf_counter()
        return e0.elapsed_time(e1), t_end

    for _ in range(5):
        burst()
    alone0 = statistics.median([burst()[0] for _ in range(7)])
    res.put("gemm", dict(shape=[M, N, K], count=10, alone_ms_initial=alone0, device=str(dev0)))
    print(f"[interference] GEMM burst alone: {alone0:.3f} ms", flush=True)

    tide, lay_err = None, None
    try:
        tide = import_tide()
    except Exception as exc:  # tide rows become errors, JAX rows still run
        lay_err = exc
        res.error("tide_import", exc)

    ops = ("jax_ag_per_param", "jax_rs_fp32_prepacked", "jax_rs_upcast_fp32", "jax_rs_bf16", "tide_ag", "tide_rs")
    reps = 7 if not args.quick else 5
    for h in cfg["groups"]:
        shapes = layer_shapes(h)
        g = f"h{h}"
        params, grads = make_data(jax, mesh, shapes, seed=h)
        grads32 = fp32_grads(jax, mesh, grads)
        spec = {k: jax.sharding.PartitionSpec(AXIS) for k in shapes}
        lay, shards = None, None
        if tide is not None:
            try:
                lay = tide.layout(params, mesh, AXIS)
                shards = lay.shard(params)
            except Exception as exc:
                res.error(f"{g}.tide_layout", exc)
        bodies = op_bodies(jax, mesh, shapes, tide if lay is not None else None, lay)
        out = {}
        # One op at a time, JAX's first and tide's last, each recorded as soon as it is measured: a
        # crash in one op (say a tide bug taking the process down) keeps every row measured before it.
        # GEMM-alone samples are interleaved with each op's samples, so drift cannot pose as slowdown.
        for name in ops:
            if name not in bodies:
                continue
            body, kind, osp = bodies[name]
            arg = pick_arg(kind, name, params, shards, grads, grads32)
            pspec = lay.spec if name.startswith("tide") else spec

            def prep():
                fn1 = build_step(jax, mesh, body, kind, osp, 1, pspec)
                per = min(time_dispatch(jax, fn1, arg, n=10, rounds=3))
                target = max(5 * alone0, 10.0)
                R = max(4, int(math.ceil(target / max(per, 1e-3))))
                fn = build_step(jax, mesh, body, kind, osp, R, pspec)
                alone = time_step(jax, fn, arg, samples=5, warm=2)
                return dict(fn=fn, arg=arg, R=R, per_call_ms=per, step_alone_ms=statistics.median(alone))
            st = guarded(res, f"{g}.{name}.prep")(prep)
            if st is None:
                continue
            print(f"[interference] {g} {name}: R={st['R']} step {st['step_alone_ms']:.2f} ms", flush=True)

            def one():
                box = {}
                dispatched = threading.Event()

                def runner():
                    box["t0"] = time.perf_counter()
                    out_ = st["fn"](st["arg"])
                    box["t_dispatch"] = time.perf_counter()
                    dispatched.set()
                    jax.block_until_ready(out_)
                    box["t1"] = time.perf_counter()
                th = threading.Thread(target=runner)
                th.start()
                # JAX dispatch is asynchronous: once the step is enqueued, give it a lead so the
                # collective is under way, then launch the GEMM burst. (Were dispatch synchronous, the
                # wait times out mid-step and the overlap check below says how much really overlapped.)
                dispatched.wait(timeout=0.3 * st["step_alone_ms"] / 1e3)
                time.sleep(0.5e-3 + 0.25 * st["step_alone_ms"] / 1e3)
                gemm_ms, t_end = burst()
                th.join()
                if "t1" not in box:
                    raise RuntimeError("the collective step did not complete (see the log)")
                g_lo, g_hi = t_end - gemm_ms / 1e3, t_end
                c_lo = max(box["t0"], box["t1"] - st["step_alone_ms"] / 1e3)
                c_hi = box["t1"]
                overlap = max(0.0, min(g_hi, c_hi) - max(g_lo, c_lo)) / (gemm_ms / 1e3)
                return dict(gemm_ms=gemm_ms, overlap=min(overlap, 1.0),
                            coll_ms=(box["t1"] - box["t0"]) * 1e3,
                            dispatch_ms=(box["t_dispatch"] - box["t0"]) * 1e3,
                            gemm_start_after_dispatch_ms=(g_lo - box["t0"]) * 1e3,
                            gemm_end_before_coll_end_ms=(c_hi - g_hi) * 1e3)

            alone_s, ss = [], []
            for rep in range(reps):
                alone_s.append(burst()[0])
                s_ = guarded(res, f"{g}.{name}.sample{rep}")(one)
                if s_ is not None:
                    ss.append(s_)
            alone_s.append(burst()[0])
            alone_med = statistics.median(alone_s)
            valid = [x for x in ss if x["overlap"] >= 0.9]
            rec = dict(R=st["R"], step_alone_ms=st["step_alone_ms"], samples=ss, n_valid=len(valid), n=len(ss),
                       gemm_alone_ms=stats_ms(alone_s))
            if valid:
                gm = statistics.median([x["gemm_ms"] for x in valid])
                rec.update(gemm_during_ms=stats_ms([x["gemm_ms"] for x in valid]),
                           slowdown_pct=100.0 * (gm / alone_med - 1.0),
                           overlap_min=min(x["overlap"] for x in ss))
                print(f"[interference] {g} {name}: GEMM {gm:.3f} ms vs alone {alone_med:.3f} "
                      f"-> {rec['slowdown_pct']:+.1f}% ({len(valid)}/{len(ss)} samples overlapped)", flush=True)
            else:
                print(f"[interference] {g} {name}: no sample overlapped the collective", flush=True)
            out[name] = rec
            out["gemm_alone_ms"] = stats_ms([x for r in out.values() if isinstance(r, dict) and "n_valid" in r
                                             for x in [r["gemm_alone_ms"]["median"]]])
            res.put(f"{g}.interference", out)
            del st
        del params, grads, grads32, shards


def worker_memory(res, cfg, args):
    jax, mesh, devs = jax_setup()
    on_gpu = jax.default_backend() == "gpu"
    cp = None
    if on_gpu:
        try:
            import cupy as cp  # noqa: F811 - only for cudaMemGetInfo
        except Exception as exc:
            res.error("cupy_import", exc)

    def free_bytes():
        if cp is None:
            return None
        out = []
        for d in devs:
            with cp.cuda.Device(d.local_hardware_id):
                out.append(int(cp.cuda.runtime.memGetInfo()[0]))
        return out

    def pool_stats():
        out = []
        for d in devs:
            try:
                s = d.memory_stats() or {}
            except Exception:
                s = {}
            out.append((int(s.get("bytes_in_use", 0)), int(s.get("peak_bytes_in_use", 0))))
        return out

    tide = None
    try:
        tide = import_tide()
    except Exception as exc:
        res.error("tide_import", exc)
    for h in cfg["groups"]:
        shapes = layer_shapes(h)
        g = f"h{h}"
        params, grads = make_data(jax, mesh, shapes, seed=h)
        grads32 = fp32_grads(jax, mesh, grads)
        spec = {k: jax.sharding.PartitionSpec(AXIS) for k in shapes}
        lay, shards = None, None
        if tide is not None:
            try:
                lay = tide.layout(params, mesh, AXIS)
                shards = lay.shard(params)
            except Exception as exc:
                res.error(f"{g}.tide_layout", exc)
        bodies = op_bodies(jax, mesh, shapes, tide if lay is not None else None, lay)
        # compile all first, then run in ascending order of XLA temp bytes so peak growth is visible
        compiled = {}
        for name, (body, kind, osp) in bodies.items():
            arg = pick_arg(kind, name, params, shards, grads, grads32)
            pspec = lay.spec if name.startswith("tide") else spec

            def comp():
                fn = build_step(jax, mesh, body, kind, osp, 1, pspec)
                c = fn.lower(arg).compile()
                ma = c.memory_analysis()
                mad = {f: int(getattr(ma, f)) for f in ("temp_size_in_bytes", "output_size_in_bytes",
                                                         "argument_size_in_bytes", "alias_size_in_bytes")
                       if ma is not None and hasattr(ma, f)}
                return dict(fn=c, arg=arg, ma=mad)
            r = guarded(res, f"{g}.{name}.compile")(comp)
            if r is not None:
                compiled[name] = r
        # JAX's ops first (a tide crash then loses only tide's rows), each kind by ascending temp bytes
        order = sorted(compiled, key=lambda n: (n.startswith("tide"), compiled[n]["ma"].get("temp_size_in_bytes", 0)))
        out = {}
        for name in order:
            c = compiled[name]

            def run():
                jax.block_until_ready(jax.device_put(0.0))
                f0, p0 = free_bytes(), pool_stats()
                o = c["fn"](c["arg"])
                jax.block_until_ready(o)
                f1, p1 = free_bytes(), pool_stats()
                del o
                rec = dict(xla=c["ma"], xla_temp_bytes=c["ma"].get("temp_size_in_bytes"))
                if f0 is not None:
                    rec["out_of_pool_growth_bytes"] = [a - b for a, b in zip(f0, f1)]
                rec["pool_in_use_before"] = [a for a, _ in p0]
                rec["pool_peak_growth_bytes"] = [
                    (pk1 - use0) if pk1 > pk0 else None for (use0, pk0), (_, pk1) in zip(p0, p1)]
                extra = rec["xla_temp_bytes"] or 0
                if f0 is not None:
                    extra += max(0, max(rec["out_of_pool_growth_bytes"]))
                rec["extra_bytes"] = extra
                print(f"[memory] {g} {name}: XLA temp {(rec['xla_temp_bytes'] or 0) / MiB:.1f} MiB, "
                      f"outside pool {rec.get('out_of_pool_growth_bytes')}", flush=True)
                return rec
            rec = guarded(res, f"{g}.{name}.run")(run)
            if rec is not None:
                out[name] = rec
                res.put(f"{g}.memory", out)
        del params, grads, grads32, shards, compiled


WORKERS = {"floor": worker_floor, "jax": worker_jax, "jaxflags": worker_jax, "tide": worker_tide,
           "interference": worker_interference, "memory": worker_memory}


def worker_main(args):
    import faulthandler
    if args.limit:  # a hang: every thread's stack lands in the log before the orchestrator kills us
        faulthandler.dump_traceback_later(max(5.0, args.limit - 8.0), exit=False)
    cfg = run_config(args)
    res = Results(args.part, args.worker)
    res.data["config"] = cfg
    res.flush()
    try:
        WORKERS[args.worker](res, cfg, args)
    except Exception as exc:  # the section's top-level failure, recorded
        res.error("section", exc)
        res.data["finished"] = now_iso()
        res.flush()
        return 1
    res.data["finished"] = now_iso()
    res.flush()
    return 0


# --------------------------------------------------------------------------------------------------
# orchestrator

def section_env(section, args):
    env = dict(os.environ)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    env["NVSHMEM_DISABLE_NVLS"] = "1"
    env["TIDE_MULTICAST"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
    if not args.cpu_smoke:
        env.setdefault("JAX_PLATFORMS", "cuda")  # fail loudly rather than fall back to the CPU
        env["TIDE_BENCH_EXPECT_GPU"] = "1"
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
        env.setdefault("NPROC", str(max(os.cpu_count() or 1, 16)))  # spare XLA:CPU pool threads (conftest.py)
    if section == "jaxflags":
        env["XLA_FLAGS"] = " ".join(env.get("XLA_FLAGS", "").split() + STRONG_XLA_FLAGS)
    return env


def run_section(section, args, out_dir, deadline):
    part = os.path.join(out_dir, f".part-{section}.json")
    if os.path.exists(part):
        os.remove(part)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", section, "--part", part]
    if args.quick:
        cmd.append("--quick")
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    if args.groups:
        cmd += ["--groups", args.groups]
    env = section_env(section, args)
    limit = min(SECTION_LIMIT_S[section], deadline - time.time() - 5)
    if limit < 15:
        return {"section": section, "errors": {"section": {"error": "skipped: out of time budget"}}, "records": {}}
    cmd += ["--limit", f"{limit:.0f}"]
    attempts = 2 if section == "jaxflags" else 1
    rc, tail = None, ""
    t0 = time.time()
    for attempt in range(attempts):
        print(f"=== section {section} (limit {limit:.0f} s){' retry' if attempt else ''}", flush=True)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines = []
        timer = threading.Timer(limit, lambda: _kill(proc))
        timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(f"[{section}] {line}" if not line.startswith("[") else line)
                sys.stdout.flush()
                lines.append(line)
                lines = lines[-200:]
            rc = proc.wait()
        finally:
            timer.cancel()
        tail = "".join(lines[-60:])
        if section == "jaxflags" and rc != 0 and "Unknown flag" in tail and attempt == 0:
            bad = [f for f in STRONG_XLA_FLAGS if f.split("=")[0].lstrip("-") in tail]
            print(f"=== jaxflags: dropping unknown flags {bad}", flush=True)
            env["XLA_FLAGS"] = " ".join(f for f in env["XLA_FLAGS"].split() if f not in bad)
            limit = min(SECTION_LIMIT_S[section], deadline - time.time() - 5)
            continue
        break
    data = {"section": section, "records": {}, "errors": {}}
    if os.path.exists(part):
        try:
            with open(part) as fh:
                data = json.load(fh)
        except Exception as exc:
            data["errors"]["part_file"] = {"error": repr(exc)}
        os.remove(part)
    data["rc"] = rc
    data["wall_s"] = time.time() - t0
    if section == "jaxflags":
        data["xla_flags"] = env.get("XLA_FLAGS", "")
    if rc != 0:
        why = "killed at the time limit" if rc in (-9, -15) else f"exit code {rc}"
        data.setdefault("errors", {})["section_process"] = {"error": why, "tail": tail[-3000:]}
        print(f"=== section {section} FAILED ({why})", flush=True)
    return data


def _kill(proc):
    try:
        os.killpg(proc.pid, 9)
    except Exception:
        pass


def machine_info():
    info = dict(host=platform.node(), python=sys.version.split()[0])
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["gpus"] = [l.strip() for l in q.stdout.strip().splitlines() if l.strip()]
        t = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
        info["topo"] = t.stdout.strip()[:2000]
    except Exception as exc:
        info["gpus"] = [f"nvidia-smi unavailable: {exc}"]
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out", help="folder for bench.json, RESULTS.md, latency.png")
    ap.add_argument("--quick", action="store_true", help="smoke test on the GPUs: h=1664 only, fewer samples")
    ap.add_argument("--cpu-smoke", action="store_true", help="8 forced CPU devices, tiny shapes (no GPU sections)")
    ap.add_argument("--sections", default=",".join(ALL_SECTIONS), help="comma-separated subset of " + ",".join(ALL_SECTIONS))
    ap.add_argument("--groups", default=None, help="hidden sizes, e.g. 1664,3328")
    ap.add_argument("--budget", type=float, default=480.0, help="wall-clock seconds for all sections")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)

    t_start = time.time()
    deadline = t_start + args.budget
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in sections:
        if s not in ALL_SECTIONS:
            ap.error(f"unknown section {s!r}; choose from {ALL_SECTIONS}")
    if args.cpu_smoke:
        skipped = [s for s in sections if s in GPU_ONLY]
        sections = [s for s in sections if s not in GPU_ONLY]
        if skipped:
            print(f"cpu-smoke: skipping GPU-only sections {skipped}", flush=True)
    report = dict(date=now_iso(), command=" ".join(shlex.quote(a) for a in sys.argv),
                  mode="cpu-smoke" if args.cpu_smoke else ("quick" if args.quick else "full"),
                  machine=machine_info(), tide_library=os.environ.get("TIDE_LIBRARY"),
                  env={k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                       "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE")},
                  sections={})
    json_path = os.path.join(out_dir, "bench.json")

    def save():
        report["elapsed_s"] = time.time() - t_start
        report["summary"] = summarize(report)
        tmp = json_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        os.replace(tmp, json_path)
        try:
            with open(os.path.join(out_dir, "RESULTS.md"), "w") as fh:
                fh.write(render_markdown(report))
        except Exception:
            traceback.print_exc()

    save()
    for s in sections:
        report["sections"][s] = run_section(s, args, out_dir, deadline)
        save()
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plot
        msg = plot.plot(report, os.path.join(out_dir, "latency.png"))
        report["plot"] = msg
    except Exception as exc:
        report["plot"] = f"plot failed: {exc!r}"
    print(report["plot"], flush=True)
    save()
    print("\n" + render_markdown(report), flush=True)
    n_err = sum(len(v.get("errors", {})) for v in report["sections"].values())
    print(f"bench: wrote {json_path}, RESULTS.md, latency.png in {out_dir}; {n_err} recorded errors; "
          f"{time.time() - t_start:.0f} s", flush=True)
    return 1 if n_err else 0  # results are written either way; the exit code says whether all ran


# --------------------------------------------------------------------------------------------------
# summary and markdown

def summarize(report):
    """Ratios and targets of issue #3, per group, from whatever sections have results."""
    groups = sorted({k.split(".")[0] for sec in report["sections"].values()
                     for k in sec.get("records", {}) if k.startswith("h")}, key=lambda g: int(g[1:]))
    out = {}
    for g in groups:
        lat = {}
        for sec_name in ("floor", "jax", "tide"):
            for k, r in report["sections"].get(sec_name, {}).get("records", {}).items():
                if k.startswith(g + ".") and isinstance(r, dict) and "per_call_ms" in r:
                    lat[k.split(".", 1)[1]] = r["per_call_ms"]["median"]
        for k, r in report["sections"].get("jaxflags", {}).get("records", {}).items():
            if k.startswith(g + ".") and isinstance(r, dict) and "per_call_ms" in r:
                lat[k.split(".", 1)[1] + "+flags"] = r["per_call_ms"]["median"]
        s = {"latency_ms": lat}
        floors = [v for k, v in lat.items() if k.startswith("floor_")]
        floor = min(floors) if floors else None
        s["floor_ms"] = floor
        ag_jax = {k: v for k, v in lat.items() if k.split("+")[0] in AG_JAX}
        rs32_jax = {k: v for k, v in lat.items() if k.split("+")[0] in RS_JAX_FP32}
        rs16_jax = {k: v for k, v in lat.items() if k.split("+")[0] in RS_JAX_BF16}
        best = lambda d: (min(d, key=d.get), min(d.values())) if d else (None, None)
        s["best_jax_ag"], s["best_jax_ag_ms"] = best(ag_jax)
        s["best_jax_rs_fp32"], s["best_jax_rs_fp32_ms"] = best(rs32_jax)
        s["best_jax_rs_bf16"], s["best_jax_rs_bf16_ms"] = best(rs16_jax)
        tag, trs = lat.get("tide_ag"), lat.get("tide_rs")
        ratio = lambda a, b: (a / b) if (a is not None and b) else None
        s["tide_ag_over_floor"] = ratio(tag, floor)
        s["tide_rs_over_floor"] = ratio(trs, floor)
        s["best_jax_ag_over_tide"] = ratio(s["best_jax_ag_ms"], tag)
        s["best_jax_rs_fp32_over_tide"] = ratio(s["best_jax_rs_fp32_ms"], trs)
        s["jax_rs_bf16_over_tide"] = ratio(s["best_jax_rs_bf16_ms"], trs)
        ag_speedup_target = 3.0 if int(g[1:]) <= 2048 else 2.0
        targets = {}
        def tgt(name, value, ok):
            targets[name] = dict(value=value, met=(None if value is None else bool(ok(value))))
        tgt("tide AG <= 1.15x floor", s["tide_ag_over_floor"], lambda v: v <= 1.15)
        tgt(f"tide AG >= {ag_speedup_target:g}x faster than best JAX AG", s["best_jax_ag_over_tide"],
            lambda v: v >= ag_speedup_target)
        tgt("tide RS <= 1.3x floor (bf16 bytes)", s["tide_rs_over_floor"], lambda v: v <= 1.3)
        tgt("tide RS >= 2.5x faster than best JAX fp32 RS", s["best_jax_rs_fp32_over_tide"], lambda v: v >= 2.5)
        tgt("tide RS faster than JAX bf16 RS", s["jax_rs_bf16_over_tide"], lambda v: v > 1.0)
        inter = report["sections"].get("interference", {}).get("records", {}).get(f"{g}.interference")
        if inter:
            sd = {k: v.get("slowdown_pct") for k, v in inter.items() if isinstance(v, dict) and "n_valid" in v}
            s["gemm_slowdown_pct"] = sd
            def third(a, b):
                if sd.get(a) is None or sd.get(b) is None:
                    return None
                return sd[a] <= max(sd[b], 0.0) / 3.0
            for a, b, label in (("tide_ag", "jax_ag_per_param", "GEMM slowdown tide AG <= 1/3 of NCCL AG (tide %, NCCL %)"),
                                ("tide_rs", "jax_rs_fp32_prepacked", "GEMM slowdown tide RS <= 1/3 of NCCL fp32 RS (tide %, NCCL %)")):
                v = third(a, b)
                targets[label] = dict(value=(sd.get(a), sd.get(b)), met=v)
        s["targets"] = targets
        out[g] = s
    return out


def _fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


OP_LABELS = {
    "floor_ce_k1": "copy-engine floor, 1 stream",
    "floor_ce_k4": "copy-engine floor, 4 streams",
    "floor_ce_k4_pieces": "copy-engine floor, per-param pieces, 4 streams",
    "jax_ag_per_param": "JAX AG per-parameter",
    "jax_ag_flat_copyout": "JAX AG flat + copy-out",
    "jax_rs_bf16": "JAX RS bf16 (lossy)",
    "jax_rs_upcast_fp32": "JAX RS upcast fp32",
    "jax_rs_flat_fp32_pack": "JAX RS flat fp32 pack",
    "jax_rs_fp32_prepacked": "JAX/NCCL RS fp32, grads already fp32 (not a bf16 path)",
    "tide_ag": "**tide AG**",
    "tide_rs": "**tide RS (bf16 in, fp32 out)**",
}


def render_markdown(report):
    L = []
    m = report.get("machine", {})
    L.append(f"## Run of {report['date']} ({report['mode']})")
    L.append("")
    L.append(f"- machine: {'; '.join(m.get('gpus', []))} (host {m.get('host')}, Python {m.get('python')})")
    jenv = report["sections"].get("jax", {}).get("records", {}).get("env") or \
        report["sections"].get("tide", {}).get("records", {}).get("env") or {}
    if jenv:
        L.append(f"- JAX {jenv.get('jax')}, backend {jenv.get('backend')}, {len(jenv.get('devices', []))} devices")
    L.append(f"- command: `{report['command']}`; TIDE_LIBRARY={report.get('tide_library')}")
    fl = report["sections"].get("jaxflags", {}).get("xla_flags")
    if fl:
        L.append(f"- `+flags` rows: XLA_FLAGS=`{fl}`")
    L.append("- per-call ms: a jitted step loops the op R times (fori_loop, barrier-chained), host-timed around "
             "block_until_ready; median and p10/p90 over the steps. `dispatch` = the baselines' method "
             "(20 back-to-back one-call steps). Floor: cupy peer copies, both GPUs pulling at once, events.")
    L.append("")
    summ = report.get("summary", {})
    for g, s in summ.items():
        L.append(f"### {g}")
        L.append("")
        L.append("| op | median ms | p10 | p90 | dispatch ms | R | GB/s each | vs tide |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for sec_name in ("floor", "jax", "jaxflags", "tide"):
            recs = report["sections"].get(sec_name, {}).get("records", {})
            for k, r in recs.items():
                if not k.startswith(g + ".") or not isinstance(r, dict) or "per_call_ms" not in r:
                    continue
                op = k.split(".", 1)[1]
                label = OP_LABELS.get(op, op) + (" +flags" if sec_name == "jaxflags" else "")
                pc = r["per_call_ms"]
                nbytes = r.get("bytes_received_per_gpu") or (r.get("shard_bytes", 0) * (r.get("world", 2) - 1))
                gbps = nbytes / pc["median"] / 1e6 if nbytes else None
                ref = s["latency_ms"].get("tide_ag" if ("_ag" in op or op.startswith("floor")) else "tide_rs")
                vs = f"{pc['median'] / ref:.2f}x" if ref else "-"
                d = r.get("dispatch_ms", {}).get("median")
                L.append(f"| {label} | {_fmt(pc['median'], 4)} | {_fmt(pc['p10'], 4)} | {_fmt(pc['p90'], 4)} | "
                         f"{_fmt(d, 4)} | {r.get('R', '-')} | {_fmt(gbps, 0)} | {vs} |")
        L.append("")
        if s.get("targets"):
            L.append("| target (issue #3) | measured | met |")
            L.append("| --- | --- | --- |")
            for name, t in s["targets"].items():
                v = t["value"]
                vs = ", ".join(_fmt(x, 2) for x in v) if isinstance(v, (tuple, list)) else _fmt(v, 2)
                met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
                L.append(f"| {name} | {vs} | {met} |")
            L.append("")
        for sec_name in ("jax", "tide"):
            chk = report["sections"].get(sec_name, {}).get("records", {}).get(f"{g}.check")
            if chk:
                L.append(f"- {sec_name} checks: `{json.dumps(chk)}`")
        inter = report["sections"].get("interference", {}).get("records", {}).get(f"{g}.interference")
        if inter:
            L.append("")
            ga = inter.get("gemm_alone_ms", {})
            L.append(f"Interference: 10 x bf16 GEMM 2048x2048x16384 on GPU 0 on its own stream; alone "
                     f"{_fmt(ga.get('median'))} ms (median of the per-op medians); slowdown is against the "
                     f"alone samples interleaved with that op's")
            L.append("")
            L.append("| concurrent op | GEMM ms alone (interleaved) | GEMM ms during | slowdown | overlapped samples | collective step ms |")
            L.append("| --- | --- | --- | --- | --- | --- |")
            for name, r in inter.items():
                if not isinstance(r, dict) or "n_valid" not in r:
                    continue
                gd = r.get("gemm_during_ms", {}).get("median")
                sd = r.get("slowdown_pct")
                L.append(f"| {OP_LABELS.get(name, name)} | {_fmt(r.get('gemm_alone_ms', {}).get('median'))} | {_fmt(gd)} | "
                         f"{'-' if sd is None else f'{sd:+.1f} %'} | {r['n_valid']}/{r['n']} | "
                         f"{_fmt(r.get('step_alone_ms'), 2)} (R={r.get('R')}) |")
        mem = report["sections"].get("memory", {}).get("records", {}).get(f"{g}.memory")
        if mem:
            L.append("")
            L.append("| op (one call) | XLA temp MiB | outside XLA pool MiB (per GPU, first call) | pool peak growth MiB | extra MiB |")
            L.append("| --- | --- | --- | --- | --- |")
            for name, r in mem.items():
                oop = r.get("out_of_pool_growth_bytes")
                oops = ", ".join(f"{b / MiB:.1f}" for b in oop) if oop else "-"
                pk = ", ".join("-" if b is None else f"{b / MiB:.1f}" for b in r.get("pool_peak_growth_bytes", []))
                L.append(f"| {OP_LABELS.get(name, name)} | {(r.get('xla_temp_bytes') or 0) / MiB:.1f} | {oops} | "
                         f"{pk or '-'} | {r.get('extra_bytes', 0) / MiB:.1f} |")
        L.append("")
    errs = []
    for sec_name, sec in report["sections"].items():
        for k, e in sec.get("errors", {}).items():
            errs.append(f"| {sec_name} | {k} | {str(e.get('error', e))[:300].replace('|', '/').replace(chr(10), ' ')} |")
    if errs:
        L.append("Errors recorded (details in bench.json):")
        L.append("")
        L.append("| section | item | error |")
        L.append("| --- | --- | --- |")
        L.extend(errs)
        L.append("")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
