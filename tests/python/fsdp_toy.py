"""The first toy example (now a test: tests/python/test_multiprocess.py runs it under the launcher):
FSDP training of a small decoder-only transformer with tide, next to the same model on plain JAX.
examples/train.py is the training script.

    python tests/python/fsdp_toy.py          # GPUs when present, else 8 CPU devices; 50 steps

Both runs start from the same fp32 parameter shards (one FSDP axis over every device) and the same
synthetic token data, and train with Adam on the fp32 shards; the forward computes in bf16.
- tide: per-layer `tide_jax.gather_params(shards, lay, bf16)`: all-gather of bf16 parameters,
  gradients reduce-scattered with fp32 accumulation into the fp32 shards.
- plain JAX: per-layer `jax.lax.all_gather` of the bf16-cast shards; JAX's autodiff turns it into a
  bf16 `psum_scatter` in the backward pass.
Prints both losses per step and exits non-zero if they disagree beyond bf16 tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def _gpu_present() -> bool:
    """Decided before jax is imported (XLA_FLAGS / JAX_PLATFORMS must be set first)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() in ("cpu",):
        return False
    has_plugin = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return has_plugin and os.path.exists("/dev/nvidiactl")


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="use 8 CPU devices even where GPUs exist")
    ap.add_argument("--devices", type=int, default=None, help="number of devices (default: all; 8 on CPU)")
    ap.add_argument("--backend", choices=("tide", "jax"), default="tide", help="tide_jax backend for the tide run")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=61)  # odd sizes on purpose: rows do not divide evenly
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch-per-device", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=2e-2, help="allowed relative loss difference (bf16 level)")
    return ap.parse_args()


args = _parse_args()
USE_GPU = not args.cpu and _gpu_present()
MULTIPROCESS = int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1  # under python -m tide_jax.launch
if not USE_GPU and not MULTIPROCESS:  # (the launcher's --cpu-devices sets the count per process)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={args.devices or 8}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    # XLA:CPU's pool has max(NPROC or cores, devices) threads and every collective blocks one per
    # device until all arrive: give it spare threads so a busy one cannot starve the last device
    # (a 40 s XLA abort on 2-core machines otherwise).
    os.environ.setdefault("NPROC", str(max(os.cpu_count() or 1, 2 * (args.devices or 8))))
# Running from a source checkout without `pip install .`: use python/.
_repo_python = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "python")
if importlib.util.find_spec("tide_jax") is None and os.path.isdir(_repo_python):
    sys.path.insert(0, _repo_python)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tide_jax  # noqa: E402

AXIS = "fsdp"


# ----- the model: pre-LN decoder-only transformer, bf16 compute -----
def init_params(key, vocab, d, layers, seq):
    keys = iter(jax.random.split(key, 4 + 6 * layers))
    normal = lambda shape, scale: (scale * jax.random.normal(next(keys), shape)).astype(jnp.float32)
    params = {
        "embed": {"tokens": normal((vocab, d), 0.1), "positions": normal((seq, d), 0.02)},
        "layers": [],
        "head": {"norm": jnp.ones((d,), jnp.float32), "out": normal((d, vocab), d**-0.5)},
    }
    for _ in range(layers):
        params["layers"].append(
            {
                "norm1": jnp.ones((d,), jnp.float32),
                "wqkv": normal((d, 3 * d), d**-0.5),
                "wo": normal((d, d), d**-0.5 / layers),
                "norm2": jnp.ones((d,), jnp.float32),
                "w1": normal((d, 4 * d), d**-0.5),
                "w2": normal((4 * d, d), (4 * d) ** -0.5 / layers),
            }
        )
    return params


def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def block(p, x, heads):
    b, s, d = x.shape
    h = rms_norm(x, p["norm1"])
    q, k, v = jnp.split(h @ p["wqkv"], 3, axis=-1)
    split = lambda t: t.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)
    q, k, v = split(q), split(k), split(v)
    scores = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(x.dtype)
    att = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
    x = x + att @ p["wo"]
    h = rms_norm(x, p["norm2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def model_loss(get, tokens, layers, heads):
    """`get(path)` returns the bf16 parameters of one sub-tree ("embed", ("layers", i), "head"),
    gathered just before use: the FSDP pattern."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    emb = get("embed")
    x = emb["tokens"][inputs] + emb["positions"][None, : inputs.shape[1]]
    for i in range(layers):
        x = block(get(("layers", i)), x, heads)
    head = get("head")
    logits = (rms_norm(x, head["norm"]) @ head["out"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


# ----- two ways to gather one sub-tree -----
def subtree(tree, path):
    if isinstance(path, str):
        return tree[path]
    for key in path:
        tree = tree[key]
    return tree


def tide_getter(shards, lay):
    def get(path):
        sub_lay = lay[path] if isinstance(path, str) else lay[path[0]][path[1]]
        return tide_jax.gather_params(subtree(shards, path), sub_lay, dtype=jnp.bfloat16)

    return get


def lax_getter(shards, lay):
    """Plain JAX FSDP: cast the local shard, jax.lax.all_gather, crop the padding. Autodiff makes the
    backward a bf16 psum_scatter."""

    def get(path):
        sub_lay = lay[path] if isinstance(path, str) else lay[path[0]][path[1]]
        infos = jax.tree.unflatten(sub_lay.treedef, sub_lay.params)

        def gather(shard, info):
            full = jax.lax.all_gather(shard.astype(jnp.bfloat16), AXIS, tiled=True)
            return full[: info.rows].reshape(info.shape)

        return jax.tree.map(gather, subtree(shards, path), infos)

    return get


# ----- Adam on the fp32 shards (elementwise: padding rows have zero grads and stay zero) -----
def adam(params, grads, state, lr, b1=0.9, b2=0.98, eps=1e-8):
    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1**t, 1 - b2**t
    params = jax.tree.map(lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps), params, m, v)
    return params, (m, v, t)


def make_train_step(lay, mesh, getter, cfg):
    world = lay.world

    def step(shards, opt_state, tokens):
        def loss_fn(shards):
            local = model_loss(getter(shards, lay), tokens, cfg.layers, cfg.heads)
            return local / world, local  # grads of the mean over ranks

        (_, local), grads = jax.value_and_grad(loss_fn, has_aux=True)(shards)
        shards, opt_state = adam(shards, grads, opt_state, cfg.lr)
        return shards, opt_state, jax.lax.pmean(local, AXIS)

    opt_spec = (lay.spec, lay.spec, P())
    return jax.jit(
        tide_jax.shard_map(
            step, mesh=mesh, in_specs=(lay.spec, opt_spec, P(AXIS)), out_specs=(lay.spec, opt_spec, P())
        ),
        donate_argnums=(0, 1),
    )


def synthetic_batches(rng, steps, batch, seq, vocab):
    """Learnable sequences: each token is an affine function of the previous one, with some noise."""
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(batch, 1))
        mult = rng.integers(1, 4, size=(batch, 1))
        seqs = [start]
        for _ in range(seq):
            seqs.append((seqs[-1] * mult + 1) % vocab)
        tokens = np.concatenate(seqs, axis=1)
        noise = rng.random(tokens.shape) < 0.05
        tokens = np.where(noise, rng.integers(0, vocab, size=tokens.shape), tokens)
        out.append(tokens.astype(np.int32))
    return out


def main():
    tide_jax.initialize()  # jax.distributed under a launcher; nothing for one process
    devices = jax.devices("gpu") if USE_GPU else jax.devices("cpu")
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    if args.devices:
        devices = devices[: args.devices]
    mesh = Mesh(np.array(devices), (AXIS,))
    tide_jax.set_backend(args.backend)
    print(
        f"tide fsdp_train: {len(devices)} x {devices[0].platform} devices, backend {args.backend}, jax {jax.__version__}, "
        f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, {args.steps} steps",
        flush=True,
    )

    params = init_params(jax.random.PRNGKey(args.seed), args.vocab, args.d_model, args.layers, args.seq)
    lay = tide_jax.layout(params, mesh, AXIS)
    batch = args.batch_per_device * len(devices)
    batches = synthetic_batches(np.random.default_rng(args.seed), args.steps, batch, args.seq, args.vocab)
    data_sharding = NamedSharding(mesh, P(AXIS))

    runs = {}
    for name, getter in (("tide", tide_getter), ("jax", lax_getter)):
        shards = lay.shard(params)
        zeros = jax.tree.map(jnp.zeros_like, shards)
        opt_state = (zeros, jax.tree.map(jnp.zeros_like, shards), jnp.zeros((), jnp.float32))
        step = make_train_step(lay, mesh, getter, args)
        losses, t0 = [], time.perf_counter()
        for tokens in batches:
            shards, opt_state, loss = step(shards, opt_state, jax.device_put(tokens, data_sharding))
            losses.append(loss)
        losses = [float(x) for x in losses]
        runs[name] = (losses, time.perf_counter() - t0, lay.unshard(shards))

    (tide_losses, tide_s, tide_params), (jax_losses, jax_s, jax_params) = runs["tide"], runs["jax"]
    print(f"{'step':>5} {'tide loss':>10} {'jax loss':>10} {'rel diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(tide_losses, jax_losses)):
        rel = abs(a - b) / max(abs(b), 1e-6)
        worst = max(worst, rel)
        print(f"{i:5d} {a:10.5f} {b:10.5f} {rel:9.2e}")
    drift = max(
        float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
        for a, b in zip(jax.tree.leaves(tide_params), jax.tree.leaves(jax_params))
    )
    print(
        f"tide: {tide_s:.1f}s, plain jax: {jax_s:.1f}s (compile included); loss {tide_losses[0]:.4f} -> "
        f"{tide_losses[-1]:.4f}; worst relative loss difference {worst:.2e}; final parameter drift {drift:.2e}"
    )
    if not tide_losses[-1] < tide_losses[0]:
        print("FAIL: the tide run did not learn", file=sys.stderr)
        return 1
    if worst > args.rtol or not np.all(np.isfinite(tide_losses)):
        print(f"FAIL: losses disagree beyond bf16 tolerance ({worst:.2e} > {args.rtol:.0e})", file=sys.stderr)
        return 1
    print("OK: the two loss curves agree to bf16 tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
