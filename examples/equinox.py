"""An Equinox decoder trained with tide's FSDP (`tide_jax.equinox`), or the same model without tide.

    python examples/equinox.py                           # tide, 8 CPU devices (no GPU needed)
    python examples/equinox.py --mode plain              # the same training without tide
    python examples/equinox.py --compare --size gpu      # both, one process each; their median step times

The model is Equinox as its users write it: per-example modules (eqx.nn.Embedding, eqx.nn.RMSNorm,
eqx.nn.Linear, eqx.nn.Dropout with a key per example and layer) called with `jax.vmap` over the batch,
attention through `jax.nn.dot_product_attention`, a SwiGLU MLP, the layers created with
`eqx.filter_vmap`, optax on `eqx.filter(model, eqx.is_inexact_array)`. The lines that differ from
training it without tide are marked `# tide:` (README "Your own model"): the model runs its layers
through `tide_jax.equinox.call_layers` (outside tide the `eqx.partition` + `lax.scan` loop it
replaces), `tide_jax.equinox.shard` shards it, `fsdp.filter_value_and_grad` replaces
`eqx.filter_value_and_grad`. Data: the bytes of this Python's standard-library sources.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is called equinox.py: its directory must not shadow the equinox package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
SIZES = {  # vocab 256 (bytes); d_ff not a multiple of 8 on CPU: uneven shards
    "cpu": dict(d_model=64, layers=4, heads=4, d_ff=172, seq=64, batch=16, dropout=0.1, dtype="float32", lr=3e-3),
    "gpu": dict(d_model=2048, layers=16, heads=16, d_ff=5632, seq=2048, batch=4, dropout=0.0, dtype="bfloat16",
                lr=3e-4),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["tide", "plain"], default="tide")
    ap.add_argument("--compare", action="store_true", help="run tide then plain (one process each) and compare")
    ap.add_argument("--size", choices=sorted(SIZES), default="cpu")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--remat", default="full", help="none, full, dots, ... (tide_jax.remat_policy); both modes")
    ap.add_argument("--devices", type=int, default=8, help="CPU devices (--size cpu)")
    ap.add_argument("--layers", type=int, help="override the size's number of layers")
    ap.add_argument("--seq", type=int, help="override the size's sequence length")
    ap.add_argument("--batch", type=int, help="override the size's batch (sequences per step)")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the size's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="exit 1 unless the loss fell")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line (used by --compare)")
    return ap.parse_args(argv)


ARGS = parse_args()
if ARGS.size == "cpu":  # before jax is imported: CPU devices for the mesh
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
        + [f"--xla_force_host_platform_device_count={ARGS.devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 2 * ARGS.devices)))
if importlib.util.find_spec("tide_jax") is None:  # a source checkout without an installed tide_jax
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import equinox as eqx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tide_jax.equinox  # noqa: E402  # tide:


# ----------------------------------------------------------------------------------------------
# the model (per example: tokens (T,) -> logits (T, 256))
# ----------------------------------------------------------------------------------------------
class Block(eqx.Module):
    attn_norm: eqx.nn.RMSNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    mlp_norm: eqx.nn.RMSNorm
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    heads: int = eqx.field(static=True)

    def __init__(self, cfg, key):
        d, f = cfg["d_model"], cfg["d_ff"]
        keys = jax.random.split(key, 5)
        self.heads = cfg["heads"]
        self.attn_norm = eqx.nn.RMSNorm(d)
        self.qkv = eqx.nn.Linear(d, 3 * d, use_bias=False, key=keys[0])
        self.out = eqx.nn.Linear(d, d, use_bias=False, key=keys[1])
        self.mlp_norm = eqx.nn.RMSNorm(d)
        self.gate = eqx.nn.Linear(d, f, use_bias=False, key=keys[2])
        self.up = eqx.nn.Linear(d, f, use_bias=False, key=keys[3])
        self.down = eqx.nn.Linear(f, d, use_bias=False, key=keys[4])
        self.dropout = eqx.nn.Dropout(cfg["dropout"])

    def __call__(self, x, *, key=None):
        t, d = x.shape
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        qkv = jax.vmap(self.qkv)(jax.vmap(self.attn_norm)(x)).reshape(t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=1)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(t, d)
        x = x + self.dropout(jax.vmap(self.out)(a), key=k1, inference=key is None)
        h = jax.vmap(self.mlp_norm)(x)
        mlp = jax.vmap(lambda h: self.down(jax.nn.silu(self.gate(h)) * self.up(h)))(h)
        return x + self.dropout(mlp, key=k2, inference=key is None)


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    pos: eqx.nn.Embedding
    layers: Block
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear
    remat: object = eqx.field(static=True)

    def __init__(self, cfg, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(256, cfg["d_model"], key=keys[0])
        self.pos = eqx.nn.Embedding(cfg["seq"], cfg["d_model"], key=keys[1])
        self.layers = eqx.filter_vmap(lambda k: Block(cfg, k))(jax.random.split(keys[2], cfg["layers"]))
        self.norm = eqx.nn.RMSNorm(cfg["d_model"])
        self.head = eqx.nn.Linear(cfg["d_model"], 256, use_bias=False, key=keys[3])
        self.remat = cfg["remat"]

    def __call__(self, tokens, *, key=None):
        x = jax.vmap(self.embed)(tokens) + jax.vmap(self.pos)(jnp.arange(tokens.shape[0]))
        x = tide_jax.equinox.call_layers(self.layers, x, key=key, remat=self.remat)  # tide: was partition + lax.scan
        return jax.vmap(lambda x: self.head(self.norm(x)))(x)


def loss_fn(model, tokens, keys, dtype):
    # mixed precision, the Equinox way: compute in `dtype` (a no-op for tide's gathered parameters)
    model = jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)
    logits = jax.vmap(model)(tokens[:, :-1], key=keys).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# ----------------------------------------------------------------------------------------------
# data: random windows of the standard library's source bytes
# ----------------------------------------------------------------------------------------------
def corpus() -> np.ndarray:
    import sysconfig

    root, chunks, size = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".py") and size < 32 << 20:
                with open(os.path.join(dirpath, name), "rb") as f:
                    chunks.append(f.read())
                size += len(chunks[-1])
    return np.frombuffer(b"\n".join(chunks), np.uint8)


def batch(data, cfg, step, seed):
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - cfg["seq"] - 1, cfg["batch"])
    return np.stack([data[s:s + cfg["seq"] + 1] for s in starts]).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------
def train(args) -> dict:
    cfg = dict(SIZES[args.size], remat=tide_jax.remat_policy(args.remat))
    cfg.update({k: v for k, v in dict(layers=args.layers, seq=args.seq, batch=args.batch).items() if v})
    devices = jax.devices()
    if args.size == "gpu":
        devices = devices[:1]  # one GPU: the step-time comparison of issue #15
    mesh = jax.make_mesh((len(devices),), ("fsdp",), (jax.sharding.AxisType.Auto,), devices=devices)
    cfg["batch"] = max(cfg["batch"], len(devices)) // len(devices) * len(devices)
    dtype = jnp.dtype(cfg["dtype"])
    data = corpus()

    model = Decoder(cfg, jax.random.key(args.seed))
    if args.mode == "tide":
        model, fsdp = tide_jax.equinox.shard(model, mesh, "fsdp", layers="layers", dtype=dtype)  # tide: -> shards
    else:  # plain JAX: the parameters replicated, the batch split over the devices (data parallel)
        model = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())) if eqx.is_array(x) else x, model)
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr or cfg["lr"], min(10, args.steps // 4 + 1),
                                            max(args.steps, 2), end_value=0.1 * (args.lr or cfg["lr"]))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.1))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    value_and_grad = fsdp.filter_value_and_grad if args.mode == "tide" else eqx.filter_value_and_grad  # tide:

    @eqx.filter_jit
    def train_step(model, opt_state, tokens, keys):
        loss, grads = value_and_grad(loss_fn)(model, tokens, keys, dtype)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    on_mesh = NamedSharding(mesh, P("fsdp"))
    losses, times = [], []
    for step in range(args.steps):
        tokens = jax.device_put(batch(data, cfg, step, args.seed), on_mesh)
        keys = jax.device_put(jax.random.split(jax.random.key(1000 * args.seed + step), cfg["batch"]), on_mesh)
        t0 = time.perf_counter()
        model, opt_state, loss = train_step(model, opt_state, tokens, keys)
        loss = float(loss)  # (waits for the step)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step % max(1, args.steps // 8) == 0 or step == args.steps - 1:
            print(f"{args.mode} step {step:4d}  loss {loss:.4f}  {1e3 * times[-1]:8.1f} ms", flush=True)
    steady = times[min(2, len(times) - 1):]  # the first steps compile
    n_params = sum(int(np.prod(q.shape)) for q in fsdp.plan.params) if args.mode == "tide" else sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    return dict(mode=args.mode, size=args.size, remat=args.remat, devices=len(devices),
                platform=devices[0].platform, losses=losses, median_ms=1e3 * float(np.median(steady)),
                params=n_params)


def compare(args) -> int:
    """tide, then plain, one process each (each has the device to itself); prints both medians."""
    results = {}
    for mode in ("tide", "plain"):
        argv = [a for a in sys.argv[1:] if a != "--compare"] + ["--mode", mode, "--json"]
        r = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], capture_output=True, text=True)
        sys.stdout.write("".join(line + "\n" for line in r.stdout.splitlines() if not line.startswith("{")))
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            print(f"compare: the {mode} run failed (exit {r.returncode})")
            return 1
        results[mode] = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    t, p = results["tide"], results["plain"]
    print(f"\n{t['params'] / 1e6:.1f}M parameters, remat {t['remat']}, {t['devices']} {t['platform']} device(s), "
          f"{args.steps} steps")
    for r in (t, p):
        print(f"  {r['mode']:5s}  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}   median step {r['median_ms']:9.2f} ms")
    print(f"  tide / plain step time: {t['median_ms'] / p['median_ms']:.4f} ({100 * (t['median_ms'] / p['median_ms'] - 1):+.2f} %)")
    ok = all(r["losses"][-1] < r["losses"][0] for r in (t, p))
    if args.check and not ok:
        print("compare: the loss did not fall")
        return 1
    return 0


def main() -> int:
    args = ARGS
    if args.compare:
        return compare(args)
    res = train(args)
    fell = res["losses"][-1] < res["losses"][0] - 0.1
    print(f"{res['mode']}: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}, median step {res['median_ms']:.2f} ms")
    if args.json:
        print(json.dumps(res))
    if args.check and not fell:
        print(f"{res['mode']}: the loss did not fall")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
