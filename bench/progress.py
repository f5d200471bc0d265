"""Does tide's work finish behind the compute beside it? The JAX half (world 1) of issue #38.

#22 measured how much tide slows a victim kernel; this measures the other half, how much the victim
slows tide, in one run per (victim, op). One jitted program of L (6) layers, each layer

    g, y = ordered(g_i, y)            # the start follows the previous layer's compute (a backward pass)
    h = reduce_scatter_start(g, lay)  # one Llama-3-8B layer's bf16 gradients (9 parameters, 436 MB)
    h, y = ordered(h, y)              # the compute follows the start
    y = victim(y)                     # x reps, on XLA's stream
    h, y = ordered(h, y)              # the done follows the compute
    reduce_scatter_done(h)

(the all-gather: `all_gather_start(shards_i, lay, dtype=bfloat16)` of the layer's fp32 shards, XLA's
convert then tide's gather, then `all_gather_done`), in three shapes of that same structure, the
ties kept: **comp** (the victims alone), **coll** (the collectives alone), **both**. Per layer:

    overlap   = (comp + coll - both) / min(comp, coll)   1 = hidden, 0 = serialized (the issue's)
    added     = (both - comp) / L   ms per layer the step grows beside the victim: the collective's
                exposed latency (what a backward pass pays for it), valid as such when comp > coll
    exposed   = (both - comp) / coll   the same as a fraction of the collective alone
    slowdown  = both / comp - 1   the victim's slowdown as wall-clock sees it: exact when the
                collective finishes behind the victim (added small), else an upper bound that
                includes the collective's own exposed time; the kernel-level share is #22's bench
                (examples/interference.rs)
    ratio     = comp / coll   each victim's reps make it >= --ratio (1.2) x the slower collective
                alone, as the issue's bar asks; reported per op

Victims (per rep; the shapes of the issue's table): attn_many cuDNN flash attention 4x32x4096x128
causal (B, N, T, H; many waves), gemm_2wave bf16 4096x2048x16384 (M x N x K), gemm_1wave bf16
2048x2048x16384, attn_1wave flash attention 1x8x2048x128, elementwise fp32 y*a+b over 512 MiB
(HBM-bound). Each rep is one kernel, separated from the next by a barrier (no fusion across reps).

Times: wall clock of one call with block_until_ready, medians of REPS (15) rounds after a warm-up;
each round runs comp, coll and both of the (victim, op) in turn, so clock drift touches all alike.
At world 1 tide's calls are local identities unless TIDE_WORLD1_NATIVE=1: required on GPUs (warned
about otherwise, the numbers then mean nothing). Run on one GPU (about 2 minutes on an H100):

    TIDE_WORLD1_NATIVE=1 python3 bench/progress.py --out DIR [--victims a,b] [--ops rs,ag]
    scripts/gpu run OUT progress        # twice: TIDE_HIGH_PRIORITY=0 and 1

CPU smoke (the CPU engine, tiny shapes): JAX_PLATFORMS=cpu TIDE_WORLD1_NATIVE=1 python3
bench/progress.py --scale 64 --reps 3. It checks the plumbing, not the numbers: XLA:CPU drops
optimization barriers before its simplifier, which then computes only the elements kept, so the
victims cost nothing there and their reps run to --max-reps (XLA:GPU keeps the barriers).

Output: one line per (victim, op) starting `progress:` (with TIDE_HIGH_PRIORITY and the device),
`hlo:` lines (tide calls and top-level copies XLA put in each program: expected 2L calls and 0
copies; a copy of a layer's bytes before each start would be measured as the collective's, which is
why the gradients are donated and passed back), and DIR/progress-hp<TIDE_HIGH_PRIORITY>.json.
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax

VICTIMS = ("attn_many", "gemm_2wave", "gemm_1wave", "attn_1wave", "elementwise")
OPS = {"rs": "reduce_scatter", "ag": "all_gather"}


def dim(n, scale):
    """A dimension of the full-size benchmark at 1/scale (at least 8)."""
    return max(8, n // scale)


def llama8b_layer(scale):
    """One Llama-3-8B layer's parameter shapes (4096 model, 1024 kv, 14336 MLP), 1/scale per dim."""
    d, kv, f = dim(4096, scale), dim(1024, scale), dim(14336, scale)
    return {"wq": (d, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, d), "w1": (f, d), "w2": (d, f),
            "w3": (f, d), "attn_norm": (d,), "mlp_norm": (d,)}


def attention(shape, on_gpu):
    """A flash-attention victim of (B, N, T, H) = shape, causal; state (q, k, v) as (B, T, N, H)."""
    b, n, t, h = shape
    impl = "cudnn" if on_gpu else None

    def init(key):
        ks = jax.random.split(key, 3)
        return tuple(jax.random.normal(k, (b, t, n, h), jnp.bfloat16) for k in ks)

    def step(state):
        q, k, v = tide_jax.ordered(*state)
        return (jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl), k, v)

    return init, step


def gemm(m, n, k):
    """A bf16 GEMM victim (M x K) @ (K x N); state (acc, x, w): acc sums a few elements of every
    product (behind a barrier, so XLA cannot cut the product down to them), which keeps each GEMM
    live and the next one after it."""
    def init(key):
        k1, k2 = jax.random.split(key)
        x = jax.random.normal(k1, (m, k), jnp.bfloat16)
        w = (jax.random.normal(k2, (k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
        return (jnp.zeros((8,), jnp.float32), x, w)

    def step(state):
        acc, x, w = tide_jax.ordered(*state)
        out = tide_jax.ordered(jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
        return (acc + out[0, :8].astype(jnp.float32), x, w)

    return init, step


def elementwise(nbytes):
    """An fp32 y*a+b pass over nbytes (reads and writes them: HBM-bound); state (y,)."""
    def init(key):
        return (jax.random.normal(key, (nbytes // 4,), jnp.float32),)

    def step(state):
        y = tide_jax.ordered(state[0])
        return (y * 0.999 + 1e-3,)

    return init, step


def elementwise_bytes(scale):
    """The elementwise victim's buffer (512 MiB at scale 1, 1/scale^2 of it otherwise)."""
    return max(4096, (512 << 20) // (scale * scale))


def hbm_bound_ms(comp_ms, victim_bytes, coll_bytes):
    """Issue #38's bound for the HBM-bound victim: both programs' bytes at the card's copy rate,
    the rate being the victim's own alone in the same run (an fp32 read + write pass over HBM)."""
    return comp_ms * (1 + coll_bytes / victim_bytes)


def victim(name, scale, on_gpu):
    """(description, init, step) of a victim at 1/scale per dimension (the elementwise pass 1/scale^2
    of its bytes, as the layer's parameters)."""
    s = scale
    if name == "attn_many":
        shape = (4, 32, dim(4096, s), dim(128, s))
        return (f"flash attention {'x'.join(map(str, shape))} causal", *attention(shape, on_gpu))
    if name == "attn_1wave":
        shape = (1, 8, dim(2048, s), dim(128, s))
        return (f"flash attention {'x'.join(map(str, shape))} causal", *attention(shape, on_gpu))
    if name == "gemm_2wave":
        mnk = (dim(4096, s), dim(2048, s), dim(16384, s))
        return (f"bf16 GEMM {'x'.join(map(str, mnk))}", *gemm(*mnk))
    if name == "gemm_1wave":
        mnk = (dim(2048, s), dim(2048, s), dim(16384, s))
        return (f"bf16 GEMM {'x'.join(map(str, mnk))}", *gemm(*mnk))
    if name == "elementwise":
        nbytes = elementwise_bytes(s)
        return (f"fp32 elementwise over {nbytes / 2**20:g} MiB", *elementwise(nbytes))
    raise SystemExit(f"progress: unknown victim {name!r}; victims: {', '.join(VICTIMS)}")


def first(tree):
    """One element of the first leaf (keeps a result alive at no cost); a barrier first, so XLA
    cannot push the slice into the op that made it."""
    leaf = tide_jax.ordered(jax.tree.leaves(tree)[0])
    return leaf.reshape(-1)[:1].astype(jnp.float32)


def program(mesh, lay, op, layers, step, reps, with_coll, with_comp):
    """The jitted L-layer program (docstring): collective start / victim x reps / done per layer.
    Returns (a few result elements, the gradients): a reduce-scatter's gradients are donated and
    returned as its start passed them through to its done, so XLA can hand tide the very buffers
    (a start aliases its operands; of a parameter that is not donated XLA would copy every gradient,
    436 MB per layer on XLA's stream, before each start); the caller feeds them to the next call."""
    def body(colls, state):
        keep, passed = [], list(colls)  # (empty without the collectives)
        for i in range(layers):
            if with_coll:
                x, state = tide_jax.ordered(colls[i], state)  # after the previous layer's compute
                if op == "rs":
                    h = tide_jax.reduce_scatter_start(x, lay)
                else:
                    h = tide_jax.all_gather_start(x, lay, dtype=jnp.bfloat16)
                h, state = tide_jax.ordered(h, state)
            if with_comp:
                for _ in range(reps):
                    state = step(state)
            if with_coll:
                h, state = tide_jax.ordered(h, state)
                if op == "rs":
                    leaves, tree = jax.tree.flatten(x)
                    ops_ = list(getattr(h, "operands", []))
                    if len(ops_) == len(leaves) and all(a.shape == b.shape for a, b in zip(ops_, leaves)):
                        passed[i] = jax.tree.unflatten(tree, ops_)
                    else:  # no native call (local): nothing aliased
                        passed[i] = x
                out = tide_jax.reduce_scatter_done(h) if op == "rs" else tide_jax.all_gather_done(h)
                keep.append(first(out))
        keep.append(first(state[0]))  # every victim's state[0] depends on all its calls
        return jnp.concatenate(keep), (passed if op == "rs" else [])

    coll_spec = [P("fsdp") if op == "rs" else lay.spec] * (layers if with_coll else 0)
    f = tide_jax.shard_map(body, mesh=mesh, in_specs=(coll_spec, P()),
                           out_specs=(P(), coll_spec if op == "rs" else []), check_vma=False)
    return jax.jit(f, donate_argnums=(0,) if op == "rs" else ())


def hlo_census(exe):
    """What XLA put in the compiled program: tide custom calls and copies (ops, MiB)."""
    text = exe.as_text()
    tide = len(re.findall(r'custom_call_target="tide_', text))
    copies, fused = [], False
    for line in text.splitlines():
        if line and not line.startswith(" "):  # a computation's header: fusion bodies' copies are free
            fused = "fused" in line or "wrapped" in line
        elif not fused:
            copies += re.findall(r"= (\w+)\[([\d,]*)\][^=]*? copy\(", line)
    size = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1, "u8": 1, "pred": 1}
    mib = sum(size.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in copies) / 2**20
    return tide, len(copies), mib


class Buffers:
    """The collectives' inputs per op (None: none). A reduce-scatter program donates its gradients
    and returns them: they replace the ones passed (`program`)."""

    def __init__(self, colls):
        self.colls = {**colls, None: []}

    def call(self, fn, op, state):
        """One call, blocked on; its wall time in ms."""
        t = time.perf_counter()
        small, passed = fn(self.colls[op], state)
        jax.block_until_ready((small, passed))
        ms = (time.perf_counter() - t) * 1e3
        if op == "rs":
            self.colls[op] = passed
        return ms


def interleaved(bufs, progs, reps):
    """Median ms of each program (name -> (fn, op, state)) over `reps` rounds, each round calling
    every program once, after one warm-up call each."""
    for fn, op, state in progs.values():
        bufs.call(fn, op, state)
    ts = {name: [] for name in progs}
    for _ in range(reps):
        for name, (fn, op, state) in progs.items():
            ts[name].append(bufs.call(fn, op, state))
    return {name: statistics.median(v) for name, v in ts.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--victims", default=",".join(VICTIMS), help=f"a subset of {','.join(VICTIMS)}")
    ap.add_argument("--ops", default="rs,ag", help="rs (reduce-scatter), ag (all-gather, bf16 cast)")
    ap.add_argument("--layers", type=int, default=int(os.environ.get("PROGRESS_LAYERS", "6")))
    ap.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "15")), help="timed rounds")
    ap.add_argument("--ratio", type=float, default=1.2, help="victim >= ratio x the slower collective")
    ap.add_argument("--max-reps", type=int, default=64, help="victim calls per layer at most")
    ap.add_argument("--scale", type=int, default=int(os.environ.get("PROGRESS_SCALE", "1")),
                    help="every dimension / scale (the elementwise bytes / scale^2): 64 runs on CPU")
    args = ap.parse_args()
    victims = [v for v in args.victims.split(",") if v]
    ops = [o for o in args.ops.split(",") if o]
    for o in ops:
        if o not in OPS:
            raise SystemExit(f"progress: unknown op {o!r}; ops: rs, ag")
    for v in victims:
        if v not in VICTIMS:
            raise SystemExit(f"progress: unknown victim {v!r}; victims: {', '.join(VICTIMS)}")

    t_start = time.perf_counter()
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    native = os.environ.get("TIDE_WORLD1_NATIVE", "0")
    env = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
           "TIDE_WORLD1_NATIVE": native, "TIDE_HIGH_PRIORITY": os.environ.get("TIDE_HIGH_PRIORITY", "(0)"),
           "layers": args.layers, "reps": args.reps, "scale": args.scale}
    for k in ("TIDE_RS_MAX_CTAS", "TIDE_RS_CTA_BYTES", "TIDE_MAX_IN_FLIGHT", "TIDE_LOCAL_COPY"):
        if k in os.environ:
            env[k] = os.environ[k]
    envs = " ".join(f"{k}={v}" for k, v in env.items() if k not in ("device", "platform"))
    print(f"progress: env device={dev.device_kind!r} {envs}", flush=True)
    if native.strip().lower() not in ("1", "true", "on", "yes"):
        print("progress: WARNING: TIDE_WORLD1_NATIVE is not 1: at world 1 tide's calls are then local "
              "(no native call) and these numbers measure nothing of tide" + (" (required on GPUs)" if on_gpu else ""),
              flush=True)

    mesh = jax.make_mesh((1,), ("fsdp",), devices=[dev])
    shapes = llama8b_layer(args.scale)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
    lay = tide_jax.layout(params, mesh, "fsdp")
    layer_bytes = sum(math.prod(s) for s in shapes.values()) * 2
    key = jax.random.key(0)
    colls = {}
    if "rs" in ops:  # one layer's bf16 gradients per layer
        on_axis = NamedSharding(mesh, P("fsdp"))
        colls["rs"] = [{k: jax.device_put(jax.random.normal(jax.random.fold_in(key, 100 * i + j), s, jnp.bfloat16), on_axis)
                        for j, (k, s) in enumerate(shapes.items())} for i in range(args.layers)]
    if "ag" in ops:  # one layer's fp32 shards per layer (the whole layer at world 1)
        colls["ag"] = [lay.shard({k: jax.random.normal(jax.random.fold_in(key, 100 * i + j + 50), s, jnp.float32)
                                  for j, (k, s) in enumerate(shapes.items())}) for i in range(args.layers)]
    print(f"progress: {args.layers} layers of one Llama-3-8B layer at 1/{args.scale} per dim "
          f"({len(shapes)} parameters, {layer_bytes / 1e6:.0f} MB bf16 per layer); ops {','.join(ops)}; "
          f"victims {','.join(victims)}", flush=True)

    # The collectives alone, once per op (the victim does not enter them), to size each victim.
    bufs = Buffers(colls)
    del colls
    replicated = NamedSharding(mesh, P())

    def build(op, step, reps, with_coll, with_comp, state, label):
        """The program compiled for these inputs (called as it is: one compile each), its HLO census
        printed when it has collectives."""
        fn = program(mesh, lay, op, args.layers, step, reps, with_coll, with_comp)
        exe = fn.lower(bufs.colls[op], state).compile()
        if with_coll:
            tide, ncopy, mib = hlo_census(exe)
            print(f"hlo: {label}: {tide} tide calls, {ncopy} copies ({mib:.1f} MiB)", flush=True)
        return exe

    coll_fns, coll_ms = {}, {}
    dummy = (jax.device_put(jnp.zeros((8,), jnp.float32), replicated),)
    for o in ops:
        coll_fns[o] = build(o, None, 0, True, False, dummy, f"coll {o}")
        coll_ms[o] = interleaved(bufs, {o: (coll_fns[o], o, dummy)}, 3)[o]
        print(f"progress: {o} alone {coll_ms[o]:.3f} ms ({coll_ms[o] / args.layers:.3f} ms per layer, "
              f"{layer_bytes * args.layers / coll_ms[o] / 1e6:.0f} GB/s of bf16 layer bytes)", flush=True)
    target = args.ratio * max(coll_ms.values())  # each victim's program at least this long

    rows = []
    for vname in victims:
        desc, init, step = victim(vname, args.scale, on_gpu)
        state = jax.device_put(init(jax.random.fold_in(key, 7)), replicated)
        # reps per layer: from one rep, then refitted (a + b * reps) until the program is long enough
        reps, t_reps = 1, interleaved(bufs, {"one": (build(None, step, 1, False, True, state, ""), None, state)}, 3)["one"]
        t_one, comp = t_reps / args.layers, None
        for _ in range(3):
            if comp is not None and t_reps >= target:
                break
            if comp is None:
                new = math.ceil(target * 1.05 / t_reps)
            else:
                per_rep = max((t_reps - t_one * args.layers) / max(reps - 1, 1), 1e-6)
                new = reps + math.ceil((target * 1.05 - t_reps) / per_rep)
            reps = max(1, min(args.max_reps, new))
            comp = build(None, step, reps, False, True, state, "")
            t_reps = interleaved(bufs, {"comp": (comp, None, state)}, 3)["comp"]
            if reps == args.max_reps:
                break
        progs = {"comp": (comp, None, state)}
        for o in ops:
            progs[f"coll_{o}"] = (coll_fns[o], o, dummy)
            progs[f"both_{o}"] = (build(o, step, reps, True, True, state, f"both {vname} {o}"), o, state)
        t = interleaved(bufs, progs, args.reps)
        for o in ops:
            c, x, b = t["comp"], t[f"coll_{o}"], t[f"both_{o}"]
            row = dict(victim=vname, desc=desc, op=OPS[o], victim_reps=reps, victim_ms_per_call=t_one,
                       comp_ms=c, coll_ms=x, both_ms=b, ratio=c / x,
                       overlap=(c + x - b) / max(1e-9, min(c, x)),
                       added_ms_per_layer=(b - c) / args.layers, exposed=(b - c) / x,
                       victim_slowdown=b / c - 1, **env)
            if vname == "elementwise":
                # Read + written per layer: the victim's pass 2 x its buffer per rep; the call (world
                # 1) 6 bytes per element: bf16 read + fp32 written (rs), fp32 read + bf16 written (ag).
                vbytes = 2 * elementwise_bytes(args.scale) * reps * args.layers
                cbytes = 3 * layer_bytes * args.layers
                row["hbm_bound_ms"] = hbm_bound_ms(c, vbytes, cbytes)
                row["both_over_hbm_bound"] = b / row["hbm_bound_ms"]
            rows.append(row)
            print(f"progress: {vname:<11} {o} | {desc} x{reps} per layer | comp {c:.3f} coll {x:.3f} "
                  f"both {b:.3f} ms | ratio {row['ratio']:.2f} | overlap {row['overlap']:.2f} | "
                  f"added {row['added_ms_per_layer']:.3f} ms/layer (exposed {row['exposed']:.2f} of coll) | "
                  f"victim slowdown {100 * row['victim_slowdown']:+.1f}% | "
                  f"TIDE_HIGH_PRIORITY={env['TIDE_HIGH_PRIORITY']} {dev.device_kind}", flush=True)
            if "hbm_bound_ms" in row:
                print(f"progress: {vname:<11} {o} | HBM bound {row['hbm_bound_ms']:.3f} ms (both programs' bytes at "
                      f"the victim's own rate alone) | both / bound {row['both_over_hbm_bound']:.3f} "
                      f"(the bar: <= 1.10)", flush=True)
            if row["ratio"] < args.ratio:
                print(f"progress: note: {vname} {o}: victim only {row['ratio']:.2f}x the collective "
                      f"(< {args.ratio}): the calibration run was off", flush=True)
        del progs, state

    os.makedirs(args.out, exist_ok=True)
    tag = "hp" + str(env["TIDE_HIGH_PRIORITY"]).strip("()")
    path = os.path.join(args.out, f"progress-{tag}.json")
    with open(path, "w") as f:
        json.dump({"env": env, "coll_alone_ms": coll_ms, "rows": rows}, f, indent=1)
    print(f"progress: wrote {path} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
