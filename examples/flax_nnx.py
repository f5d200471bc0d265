"""A Flax NNX decoder trained with tide's FSDP (`tide_jax.nnx`), or the same model without tide.

    python examples/flax_nnx.py                          # tide, 8 CPU devices (no GPU needed)
    python examples/flax_nnx.py --mode plain             # the same training without tide
    python examples/flax_nnx.py --compare --size gpu     # both, one process each; their median step times

The model is NNX as its users write it: nnx.Embed, nnx.RMSNorm, nnx.Linear, attention through
`jax.nn.dot_product_attention`, a SwiGLU MLP, nnx.Dropout (its RngKey/RngCount state per layer), the
blocks created with `nnx.split_rngs` + `nnx.vmap` and trained with `nnx.Optimizer`. The lines that
differ from training it without tide are marked `# tide:` (README "Your own model"): the model runs
its blocks through `tide_jax.nnx.call_layers` (outside tide the `nnx.scan` loop it replaces),
`tide_jax.nnx.shard` shards it, `fsdp.value_and_grad` replaces `nnx.value_and_grad`.
Data: the bytes of this Python's standard-library sources (vocabulary 256).
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
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tide_jax.nnx  # noqa: E402  # tide:


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, cfg, *, rngs):
        d, dt = cfg["d_model"], jnp.dtype(cfg["dtype"])
        self.heads = cfg["heads"]
        self.attn_norm = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dt, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, dtype=dt, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.gate = nnx.Linear(d, cfg["d_ff"], use_bias=False, dtype=dt, rngs=rngs)
        self.up = nnx.Linear(d, cfg["d_ff"], use_bias=False, dtype=dt, rngs=rngs)
        self.down = nnx.Linear(cfg["d_ff"], d, use_bias=False, dtype=dt, rngs=rngs)
        self.dropout = nnx.Dropout(cfg["dropout"], rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.attn_norm(x)).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
        x = x + self.dropout(self.out(a))
        h = self.mlp_norm(x)
        return x + self.dropout(self.down(jax.nn.silu(self.gate(h)) * self.up(h)))


class Decoder(nnx.Module):
    def __init__(self, cfg, *, rngs):
        d, dt = cfg["d_model"], jnp.dtype(cfg["dtype"])
        self.embed = nnx.Embed(256, d, dtype=dt, rngs=rngs)
        self.pos = nnx.Embed(cfg["seq"], d, dtype=dt, rngs=rngs)

        @nnx.split_rngs(splits=cfg["layers"])
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.norm = nnx.RMSNorm(d, dtype=dt, rngs=rngs)
        self.head = nnx.Linear(d, 256, use_bias=False, dtype=dt, rngs=rngs)
        self.remat = cfg["remat"]

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        x = tide_jax.nnx.call_layers(self.blocks, x, remat=self.remat)  # tide: was nnx.scan over self.blocks
        return self.head(self.norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
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
    data = corpus()

    model = Decoder(cfg, rngs=nnx.Rngs(args.seed))
    if args.mode == "tide":
        fsdp = tide_jax.nnx.shard(model, mesh, "fsdp", layers="blocks", dtype=cfg["dtype"])  # tide: Params -> shards
    else:  # plain JAX: the parameters replicated, the batch split over the devices (data parallel)
        nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr or cfg["lr"], min(10, args.steps // 4 + 1),
                                            max(args.steps, 2), end_value=0.1 * (args.lr or cfg["lr"]))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grad_fn = fsdp.value_and_grad if args.mode == "tide" else nnx.value_and_grad  # tide: fsdp.value_and_grad

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = grad_fn(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    on_mesh = NamedSharding(mesh, P("fsdp"))
    losses, times = [], []
    for step in range(args.steps):
        tokens = jax.device_put(batch(data, cfg, step, args.seed), on_mesh)
        t0 = time.perf_counter()
        loss = float(train_step(model, optimizer, tokens))  # (float: waits for the step)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step % max(1, args.steps // 8) == 0 or step == args.steps - 1:
            print(f"{args.mode} step {step:4d}  loss {loss:.4f}  {1e3 * times[-1]:8.1f} ms", flush=True)
    steady = times[min(2, len(times) - 1):]  # the first steps compile
    n_params = sum(int(np.prod(q.shape)) for q in fsdp.plan.params) if args.mode == "tide" else sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
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
