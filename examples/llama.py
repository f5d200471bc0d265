"""A Llama-style decoder trained with FSDP: the model, the data, the training step, checkpoints.

Used by `examples/train.py` (the command line), `bench/train_bench.py` and `tests/python/test_train.py`.
Import it after JAX's environment is set (XLA_FLAGS, JAX_PLATFORMS): it imports jax.

The model: RMSNorm, RoPE, grouped-query attention (`jax.nn.dot_product_attention`, cuDNN flash
attention on GPUs), SwiGLU MLP or a top-k mixture of SwiGLU experts (`Config.experts`), tied or
untied embeddings; fp32 master parameters, bf16 compute.

The parameters, as the training step sees them (`state["params"]`), are FSDP shards over the mesh's
"fsdp" axis:
    {"embed": {"tokens": (V, d)},                     layout `lays.embed`  (one gather, first)
     "layers": {"attn_norm": (L, d), "wq": (L, d, H*hd), ...},   each layer: `lays.layer`
     "head": {"norm": (d,), ["out": (d, V)]}}          layout `lays.head`   (one gather, last)
Every leaf is sharded on the rows of its local block (FSDP2's dim-0 rule, per layer for the stacked
ones), fp32, with AdamW's moments sharded the same way.

Meshes (`make_mesh`, train.py --mesh): "fsdp" (required), and optionally "tensor" (Megatron-style:
`wq`/`wk`/`wv`/`w_gate`/`w_up` column-parallel `P(None, "tensor")`, whole heads per device; `wo` and
`w_down` row-parallel `P("tensor", None)`, a psum over "tensor" after each), "expert" (the experts of
a mixture `P("expert", None, None)`: each device runs its experts on every token of its batch, a psum
over "expert" combines them; without an "expert" axis the experts go over "tensor") and "data" (HSDP:
the shards replicated over it, `replicas=("data",)`). The batch is split over "data" and "fsdp";
norms, router, embedding and head are replicated over "tensor" and "expert" (`layer_specs`).

Three ways to run the same step (`Backend`), same data, same init, same optimizer:
- "tide": `tide_jax.scan_layers` for the layers, with the embedding lookup as its prologue and the
  final norm and head as its epilogue (each its own gathered group, scheduled with the layers:
  prefetched all-gathers, overlapped reduce-scatters): bf16 all-gather, bf16 gradients
  reduce-scattered with fp32 accumulation;
- "jax" + reduce "bf16": `jax.lax.scan` over layers, `jax.lax.all_gather` of the bf16-cast shards;
  autodiff makes the backward a bf16 `psum_scatter` (JAX's default FSDP, lossy);
- "jax" + reduce "fp32": the same loop, gradients upcast to fp32 before `psum_scatter`
  (`tide_jax.reference.gather_params`, pure JAX): exact sums at twice the bytes.
Both take the same memory knobs with the same meaning (`Config.remat`, `Config.reshard`): the
activation policy (`tide_jax.remat_policy` names: none, full, dots, dots_with_context, ...; the
layer names its values with MaxText's names, so its named policies apply) and whether gathered
parameters are freed after each layer's forward and re-gathered in the backward (FSDP2's
reshard_after_forward). For plain JAX: `jax.checkpoint` of the scan body under the policy, with
the gathered parameters never saved (reshard) or always saved (no reshard).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sysconfig
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from model_sizes import MODELS, Config  # noqa: F401  (re-exported)

AXIS = "fsdp"
COMPUTE = jnp.bfloat16
MODEL_AXES = ("tensor", "expert")  # axes that split parameters; every other axis splits the batch


def make_mesh(devices, spec: str | None = None) -> Mesh:
    """The mesh of `devices` from "fsdp=4,tensor=2" (axes in that order, sizes multiplying to the
    device count; one size may be -1: the rest); None: every device on "fsdp"."""
    devices = list(devices)
    if not spec:
        return Mesh(np.array(devices), (AXIS,))
    names, sizes = [], []
    for item in spec.split(","):
        name, _, size = item.strip().partition("=")
        if name not in (AXIS, "data") + MODEL_AXES or name in names or not size.lstrip("-").isdigit():
            raise ValueError(f"--mesh {spec!r}: expected NAME=SIZE,... with names among fsdp, tensor, expert, data "
                             f"(each once), got {item!r}")
        names.append(name)
        sizes.append(int(size))
    if AXIS not in names:
        raise ValueError(f"--mesh {spec!r}: needs the {AXIS!r} axis (tide's FSDP axis)")
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"--mesh {spec!r}: sizes must be positive, and at most one of them -1 (the rest)")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes and len(devices) % known:
        raise ValueError(f"--mesh {spec!r}: the {len(devices)} devices used do not divide by {known} (the sizes "
                         "given), so -1 has no size")
    sizes = [len(devices) // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != len(devices):
        raise ValueError(f"--mesh {spec!r}: {math.prod(sizes)} devices, but {len(devices)} are used")
    return Mesh(np.array(devices).reshape(sizes), tuple(names))


def batch_axes(mesh: Mesh) -> tuple:
    """The axes the batch is split over: every axis that splits no parameter ("data", "fsdp")."""
    return tuple(a for a in mesh.axis_names if a not in MODEL_AXES)


def model_axes(mesh: Mesh) -> tuple:
    """(tensor axis or None, expert axis or None): the experts go over "expert", else over "tensor"."""
    tp = "tensor" if "tensor" in mesh.axis_names else None
    return tp, ("expert" if "expert" in mesh.axis_names else tp)


def layer_specs(cfg: Config, tp, ep) -> dict:
    """How one layer's parameters are split over the model axes (Megatron: column-parallel in,
    row-parallel out; experts over `ep`); norms and router replicated."""
    col, row = P(None, tp), P(tp, None)
    specs = {"attn_norm": P(), "wq": col, "wk": col, "wv": col, "wo": row, "mlp_norm": P()}
    if cfg.experts:
        specs.update(router=P(), w_gate=P(ep), w_up=P(ep), w_down=P(ep))
    else:
        specs.update(w_gate=col, w_up=col, w_down=row)
    return specs


def check_mesh(cfg: Config, mesh: Mesh) -> None:
    """Whole heads (query and key/value) per "tensor" device, whole experts per expert device."""
    tp, ep = model_axes(mesh)
    t = mesh.shape[tp] if tp else 1
    if cfg.heads % t or cfg.kv_heads % t:
        raise ValueError(f"mesh {dict(mesh.shape)}: {cfg.heads} query and {cfg.kv_heads} key/value heads do not split "
                         f"into whole heads over {t} '{tp}' devices")
    if cfg.experts and ep and cfg.experts % mesh.shape[ep]:
        raise ValueError(f"mesh {dict(mesh.shape)}: {cfg.experts} experts do not split over {mesh.shape[ep]} '{ep}' devices")


# ----------------------------------------------------------------------------------------------
# parameters
# ----------------------------------------------------------------------------------------------
def init_params(cfg: Config, seed: int) -> dict:
    """Full fp32 parameters (layers stacked on a leading axis). Deterministic in (cfg, seed) and
    independent of the device count."""
    d, hd, L = cfg.d_model, cfg.head_dim, cfg.layers
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

    def normal(shape, std):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(jnp.float32)

    out_std = 0.02 / math.sqrt(2 * L)  # GPT-2's scaled init of the residual projections
    params = {
        "embed": {"tokens": normal((cfg.vocab, d), 0.02)},
        "layers": {
            "attn_norm": jnp.ones((L, d), jnp.float32),
            "wq": normal((L, d, cfg.heads * hd), 0.02),
            "wk": normal((L, d, cfg.kv_heads * hd), 0.02),
            "wv": normal((L, d, cfg.kv_heads * hd), 0.02),
            "wo": normal((L, cfg.heads * hd, d), out_std),
            "mlp_norm": jnp.ones((L, d), jnp.float32),
        },
        "head": {"norm": jnp.ones((d,), jnp.float32)},
    }
    mlp = params["layers"]
    if cfg.experts:  # one SwiGLU per expert (L, E, ...) and the router
        e, f = cfg.experts, cfg.expert_ff
        mlp.update(w_gate=normal((L, e, d, f), 0.02), w_up=normal((L, e, d, f), 0.02),
                   w_down=normal((L, e, f, d), out_std), router=normal((L, d, e), 0.02))
    else:
        mlp.update(w_gate=normal((L, d, cfg.d_ff), 0.02), w_up=normal((L, d, cfg.d_ff), 0.02),
                   w_down=normal((L, cfg.d_ff, d), out_std))
    if not cfg.tied:
        params["head"]["out"] = normal((d, cfg.vocab), 0.02)
    return params


def abstract_params(cfg: Config) -> dict:
    return jax.eval_shape(lambda: init_params(cfg, 0))


def one_layer(stacked) -> Any:
    """The parameters of one layer (ShapeDtypeStructs) from the stacked ones."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape[1:]), x.dtype), stacked)


# ----------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Layouts:
    embed: Any
    layer: Any
    head: Any
    tp: str | None = None  # the mesh axis of Megatron's split, if any
    ep: str | None = None  # the mesh axis of the experts, if any
    batch: tuple = (AXIS,)  # the mesh axes of the batch

    @classmethod
    def build(cls, cfg: Config, mesh: Mesh) -> "Layouts":
        check_mesh(cfg, mesh)
        abstract = abstract_params(cfg)
        tp, ep = model_axes(mesh)
        batch = batch_axes(mesh)
        replicas = tuple(a for a in batch if a != AXIS)  # HSDP
        return cls(
            embed=tide_jax.layout(abstract["embed"], mesh, AXIS, specs=P(), replicas=replicas),
            layer=tide_jax.layout(one_layer(abstract["layers"]), mesh, AXIS, specs=layer_specs(cfg, tp, ep),
                                  replicas=replicas),
            head=tide_jax.layout(abstract["head"], mesh, AXIS, specs=P(), replicas=replicas),
            tp=tp, ep=ep, batch=batch,
        )

    @property
    def spec(self):
        return {"embed": self.embed.spec, "layers": self.layer.stacked_spec, "head": self.head.spec}

    @property
    def batch_spec(self):
        return P(self.batch)

    @property
    def n_batch(self) -> int:
        return math.prod(self.layer.mesh.shape[a] for a in self.batch)

    def shard(self, params):
        return {"embed": self.embed.shard(params["embed"]), "layers": self.layer.shard_stacked(params["layers"]),
                "head": self.head.shard(params["head"])}

    def unshard(self, shards):
        return {"embed": self.embed.unshard(shards["embed"]), "layers": self.layer.unshard_stacked(shards["layers"]),
                "head": self.head.unshard(shards["head"])}


# ----------------------------------------------------------------------------------------------
# the model (inside shard_map: full bf16 parameters of one group at a time)
# ----------------------------------------------------------------------------------------------
def rms_norm(x, scale, eps=1e-5):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, theta):
    """Rotary position embedding of x: (B, T, heads, hd), rotate-half convention."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    angles = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = jnp.asarray(np.cos(angles))[None, :, None, :]
    sin = jnp.asarray(np.sin(angles))[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : hd // 2], x32[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _reduce(x, axis):
    """Megatron's sum of partial results over `axis` (inside shard_map; on full parameters, nothing)."""
    if axis is None or axis not in jax.sharding.get_abstract_mesh().manual_axes:
        return x
    return jax.lax.psum(x, axis)


def layer_fn(cfg: Config, p, x, tp=None, ep=None):
    """One decoder layer on x: (B, T, d) bf16, with one layer's bf16 parameters: full, or this
    device's blocks of them (`layer_specs`: its heads, its MLP columns, its experts), the partial
    results summed over `tp` / `ep`. Values carry MaxText's checkpoint names (query_proj, key_proj,
    value_proj, context, out_proj, mlpwi, mlpwo), so its named remat policies
    (`tide_jax.remat_policy`) save the same things here."""
    b, t, d = x.shape
    hd = cfg.head_dim
    h = rms_norm(x, p["attn_norm"])
    q = checkpoint_name((h @ p["wq"]).reshape(b, t, -1, hd), "query_proj")  # this device's heads
    k = checkpoint_name((h @ p["wk"]).reshape(b, t, -1, hd), "key_proj")
    v = checkpoint_name((h @ p["wv"]).reshape(b, t, -1, hd), "value_proj")
    q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    # GQA: each kv head serves heads / kv_heads query heads; cuDNN flash attention on GPUs
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
    att = checkpoint_name(att, "context")
    x = x + _reduce(checkpoint_name(att.reshape(b, t, -1) @ p["wo"], "out_proj"), tp)
    h = rms_norm(x, p["mlp_norm"])
    if cfg.experts:
        return x + _reduce(checkpoint_name(experts(cfg, p, h, ep), "mlpwo"), ep)
    gate = checkpoint_name(h @ p["w_gate"], "mlpwi_0")
    up = checkpoint_name(h @ p["w_up"], "mlpwi_1")
    return x + _reduce(checkpoint_name((jax.nn.silu(gate) * up) @ p["w_down"], "mlpwo"), tp)


def experts(cfg: Config, p, h, ep):
    """This device's share of a top-k mixture of SwiGLU experts on every token of h (B, T, d): the
    router's gates over all experts (replicated), renormalized over each token's top k, times the
    outputs of this device's experts (`p["w_gate"]` etc. hold its experts: (E_local, ...))."""
    gates = jax.nn.softmax((h @ p["router"]).astype(jnp.float32), axis=-1)
    kth = jax.lax.top_k(gates, cfg.top_k)[0][..., -1:]
    gates = jnp.where(gates >= kth, gates, 0.0)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    local = p["w_gate"].shape[0]
    first = 0
    if ep is not None and ep in jax.sharding.get_abstract_mesh().manual_axes:
        first = jax.lax.axis_index(ep) * local
    mine = jax.lax.dynamic_slice_in_dim(gates, first, local, axis=-1).astype(h.dtype)
    gate = jnp.einsum("btd,edf->btef", h, p["w_gate"])
    up = jnp.einsum("btd,edf->btef", h, p["w_up"])
    return jnp.einsum("bte,btef,efd->btd", mine, jax.nn.silu(gate) * up, p["w_down"])


def choose_attention(cfg: Config, platform: str, say=print) -> str | None:
    """cuDNN flash attention on GPUs where it applies to this model (tried once at its shapes), else
    XLA's, with one line saying why; None (JAX's choice) elsewhere."""
    if cfg.attention is not None or platform != "gpu":
        return cfg.attention
    q = jnp.zeros((1, min(cfg.seq, 128), cfg.heads, cfg.head_dim), COMPUTE)
    kv = jnp.zeros((1, min(cfg.seq, 128), cfg.kv_heads, cfg.head_dim), COMPUTE)
    try:
        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").sum()

        jax.jit(jax.grad(attn, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return "cudnn"
    except Exception as e:  # noqa: BLE001 - any refusal means: not here
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        say(f"[attention] cuDNN flash attention does not apply here ({reason}): using XLA's")
        return "xla"


ONE_HOT_VOCAB = 4096  # up to this vocabulary the embedding lookup is a one-hot matmul


def lookup(table, inputs):
    """The embedding rows of `inputs`. A small vocabulary (bytes: 256) as a one-hot matmul (MaxText's
    `use_iota_embed`): the gather's backward is a scatter-add whose many colliding updates into few
    rows are slow on GPUs; the matmul's is a matmul."""
    if table.shape[0] <= ONE_HOT_VOCAB:
        return jax.nn.one_hot(inputs, table.shape[0], dtype=table.dtype) @ table
    return table[inputs]


GATHERED = "fsdp_gathered"  # the checkpoint name of the jax backend's gathered parameters


def jax_layer_policy(remat, reshard: bool):
    """The `jax.checkpoint` policy of the jax backend's scan body (gather + layer), or None for plain
    autodiff: `remat` as tide's, and the gathered parameters (named GATHERED) never saved with
    reshard, always saved without."""
    cp = jax.checkpoint_policies
    policy = tide_jax.remat_policy(remat)
    if policy is None:
        return cp.save_anything_except_these_names(GATHERED) if reshard else None
    base = cp.nothing_saveable if policy is True else policy
    if reshard:
        # a policy saving GATHERED by name is overridden: resharding means not keeping them
        return lambda prim, *a, **kw: False if kw.get("name") == GATHERED else base(prim, *a, **kw)
    return cp.save_from_both_policies(base, cp.save_only_these_names(GATHERED))


@dataclasses.dataclass(frozen=True)
class Backend:
    """How parameters are gathered (and gradients reduced): see the module docstring."""

    name: str = "tide"  # "tide" | "jax"
    reduce: str = "fp32"  # "jax" only: "bf16" | "fp32"

    @property
    def label(self) -> str:
        return "tide" if self.name == "tide" else f"jax-{self.reduce}"

    def gather(self, shards, lay):
        if self.name == "tide":
            return tide_jax.gather_params(shards, lay, COMPUTE)
        if self.reduce == "fp32":
            return tide_jax.reference.gather_params(shards, lay, COMPUTE)
        infos = jax.tree.unflatten(lay.treedef, lay.params)

        def gather(shard, info):  # JAX's FSDP: bf16 all-gather; autodiff: bf16 psum_scatter
            full = jax.lax.all_gather(shard.astype(COMPUTE), AXIS, tiled=True)
            return full[: info.rows].reshape(info.local_shape)

        return jax.tree.map(gather, shards, infos)

    def loss_fn(self, cfg: Config, lays: "Layouts", shards, tokens):
        """Mean next-token cross entropy of this device's batch. Inside shard_map."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        layer = partial(layer_fn, cfg, tp=lays.tp, ep=lays.ep)

        def embed(p, inputs):
            table = p["tokens"]
            return lookup(table, inputs), (table if cfg.tied else None)

        def head(p, x, table):
            w_out = table.T if cfg.tied else p["out"]
            logits = (rms_norm(x, p["norm"]) @ w_out).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

        if self.name == "tide":
            return tide_jax.scan_layers(
                layer, inputs, shards["layers"], lays.layer, remat=cfg.remat, reshard_after_forward=cfg.reshard,
                dtype=COMPUTE, prologue=(embed, shards["embed"], lays.embed),
                epilogue=(head, shards["head"], lays.head))
        x, table = embed(self.gather(shards["embed"], lays.embed), inputs)

        def body(x, layer_shards):
            p = jax.tree.map(lambda t: checkpoint_name(t, GATHERED), self.gather(layer_shards, lays.layer))
            return layer(p, x), None

        policy = jax_layer_policy(cfg.remat, cfg.reshard)
        if policy is not None:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        x, _ = jax.lax.scan(body, x, shards["layers"])
        return head(self.gather(shards["head"], lays.head), x, table)


def model_loss(cfg: Config, backend: Backend, lays: Layouts, shards, tokens):
    """Mean next-token cross entropy of this device's batch. Inside shard_map."""
    return backend.loss_fn(cfg, lays, shards, tokens)


# ----------------------------------------------------------------------------------------------
# optimizer and the training step
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptConfig:
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95


def schedule(opt: OptConfig):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opt.lr, warmup_steps=max(opt.warmup, 1),
        decay_steps=max(opt.steps, opt.warmup + 1), end_value=opt.lr * opt.min_lr_ratio)


def optimizer(opt: OptConfig, cfg: Config):
    """Clip by global norm, then AdamW; both run on the fp32 shards (global arrays sharded over the
    mesh: the norm is a sum of per-shard sums; padding rows are zero and stay zero). Weight decay
    on matrices only (by the shape of one layer's parameter)."""
    abstract = abstract_params(cfg)
    per_param = {"embed": abstract["embed"], "layers": one_layer(abstract["layers"]), "head": abstract["head"]}
    mask = jax.tree.map(lambda x: len(x.shape) >= 2, per_param)
    return optax.chain(
        optax.clip_by_global_norm(opt.clip),
        optax.adamw(schedule(opt), b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mask=mask),
    )


def make_train_step(cfg: Config, backend: Backend, lays: Layouts, mesh: Mesh, tx, state_shardings):
    n = lays.n_batch

    def loss_and_grads(shards, tokens):  # per device, inside shard_map
        def loss_fn(shards):
            local = model_loss(cfg, backend, lays, shards, tokens)
            return local / n, local  # gradient of the mean over the batch's devices

        (_, local), grads = jax.value_and_grad(loss_fn, has_aux=True)(shards)
        return jax.lax.pmean(local, lays.batch), grads

    sharded = tide_jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(lays.spec, lays.batch_spec),
                                 out_specs=(P(), lays.spec))

    def step(state, tokens):
        loss, grads = sharded(state["params"], tokens)
        updates, opt_state = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt_state}, {"loss": loss, "grad_norm": _global_norm(grads)}

    return jax.jit(step, donate_argnums=(0,), out_shardings=(state_shardings, None))


def _global_norm(tree):
    tree_ns = getattr(optax, "tree", None)
    return tree_ns.norm(tree) if hasattr(tree_ns, "norm") else optax.global_norm(tree)


def make_eval_step(cfg: Config, backend: Backend, lays: Layouts, mesh: Mesh):
    def loss(shards, tokens):
        return jax.lax.pmean(model_loss(cfg, backend, lays, shards, tokens), lays.batch)

    return jax.jit(tide_jax.shard_map(loss, mesh=mesh, in_specs=(lays.spec, lays.batch_spec), out_specs=P()))


def init_state(cfg: Config, lays: Layouts, tx, seed: int):
    shards = lays.shard(init_params(cfg, seed))
    return {"params": shards, "opt": _init_opt(tx, shards)}


def _init_opt(tx, shards):
    # Moments like the shards (same shape and sharding); counters on the first device, replicated.
    state = tx.init(shards)
    return _place_like_params(state, shards)


def _param_sharding(shards):
    return jax.tree.structure(shards), [x.sharding for x in jax.tree.leaves(shards)]


def _place_like_params(opt_state, shards):
    treedef, shardings = _param_sharding(shards)
    replicated = NamedSharding(jax.tree.leaves(shards)[0].sharding.mesh, P())

    def is_param_tree(node):
        return _structure(node) == treedef

    def place(node):
        if is_param_tree(node):
            return jax.tree.unflatten(treedef, [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(node), shardings)])
        return jax.device_put(node, replicated)

    return jax.tree.map(place, opt_state, is_leaf=is_param_tree)


def _structure(node):
    try:
        return jax.tree.structure(node)
    except Exception:  # pragma: no cover
        return None


def state_shardings(state):
    return jax.tree.map(lambda x: x.sharding, state)


# ----------------------------------------------------------------------------------------------
# data: bytes of the standard library's sources (default), a file, or synthetic tokens
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Data:
    name: str
    train: np.ndarray | None  # 1-D tokens; None for synthetic
    val: np.ndarray | None
    vocab: int

    def describe(self) -> str:
        if self.train is None:
            return f"{self.name} (vocab {self.vocab})"
        return f"{self.name}: {len(self.train):,} train / {len(self.val):,} val tokens, vocab {self.vocab}"

    def batch(self, seed: int, step: int, batch: int, seq: int) -> np.ndarray:
        """The global batch of `step`: (batch, seq + 1) int32. Depends only on (seed, step), so a
        resumed run sees exactly what the uninterrupted one saw."""
        rng = np.random.default_rng([seed, step])
        if self.train is None:
            return rng.integers(0, self.vocab, size=(batch, seq + 1), dtype=np.int32)
        return _windows(self.train, rng, batch, seq)

    def eval_batches(self, seed: int, n: int, batch: int, seq: int) -> list[np.ndarray]:
        rng = np.random.default_rng([seed, 1 << 30])
        if self.val is None:
            return [rng.integers(0, self.vocab, size=(batch, seq + 1), dtype=np.int32) for _ in range(n)]
        return [_windows(self.val, rng, batch, seq) for _ in range(n)]


def _windows(tokens: np.ndarray, rng, batch: int, seq: int) -> np.ndarray:
    if len(tokens) <= seq + 1:
        raise ValueError(f"data has {len(tokens)} tokens, fewer than one sequence of {seq + 1}")
    starts = rng.integers(0, len(tokens) - seq - 1, size=(batch, 1))
    return tokens[starts + np.arange(seq + 1)[None, :]].astype(np.int32)


def stdlib_corpus(max_bytes: int = 64 << 20) -> Data:
    """Bytes of this Python's standard library `.py` files, sorted by path; every 20th file is the
    validation split. Offline and deterministic for a given Python version."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    train, val, total = [], [], 0
    for i, f in enumerate(files):
        try:
            data = f.read_bytes()
        except OSError:
            continue
        (val if i % 20 == 0 else train).append(np.frombuffer(data + b"\n\n", np.uint8))
        total += len(data)
        if total >= max_bytes:
            break
    if not train or not val:
        raise RuntimeError(f"no Python sources found under {root}")
    return Data(f"stdlib .py bytes ({root}, {len(files)} files)", np.concatenate(train), np.concatenate(val), 256)


def file_corpus(path: str, vocab: int | None = None) -> Data:
    """`.npy` (integer tokens), `.bin` (uint16 tokens, nanoGPT's format) or any other file as bytes.
    The last 5% is the validation split."""
    if path.endswith(".npy"):
        tokens = np.load(path)
    elif path.endswith(".bin"):
        tokens = np.fromfile(path, dtype=np.uint16)
    else:
        tokens = np.fromfile(path, dtype=np.uint8)
        vocab = vocab or 256
    tokens = np.asarray(tokens).reshape(-1)
    vocab = vocab or int(tokens.max()) + 1
    cut = int(len(tokens) * 0.95)
    return Data(os.path.basename(path), tokens[:cut], tokens[cut:], vocab)


def load_data(spec: str, vocab: int | None = None) -> Data:
    if spec == "stdlib":
        return stdlib_corpus()
    if spec == "synthetic":
        return Data("synthetic uniform tokens", None, None, vocab or 32768)
    return file_corpus(spec, vocab)


def put_batch(tokens: np.ndarray, mesh: Mesh):
    """A global host batch onto the mesh, split over its batch axes ("data", "fsdp"; every process
    holds the same global batch, so this works with several processes too)."""
    sharding = NamedSharding(mesh, P(batch_axes(mesh)))
    return jax.make_array_from_callback(tokens.shape, sharding, lambda idx: tokens[idx])


# ----------------------------------------------------------------------------------------------
# checkpoints: orbax, every array in its logical (unpadded) shape (examples/checkpoint.py, which
# needs orbax-checkpoint: imported by train.py only for --save / --resume)
# ----------------------------------------------------------------------------------------------
def logical_state(state, lays: Layouts):
    """`state`'s tree (arrays or ShapeDtypeStructs) as ShapeDtypeStructs in the model's own shapes:
    every parameter-shaped tree (the parameters, AdamW's moments) without the FSDP padding rows, with
    the sharding of the full array on this mesh (how its spec splits it over "tensor" / "expert":
    where that splits the padded dim, each block is padded on its own, examples/checkpoint.py), the
    rest (step counters) as they are. What a checkpoint stores."""
    treedef = jax.tree.structure(state["params"])
    num_layers = jax.tree.leaves(state["params"]["layers"])[0].shape[0]

    def shapes(lay, lead=()):
        return jax.tree.unflatten(lay.treedef, [
            jax.ShapeDtypeStruct((*lead, *p.shape), p.dtype,
                                 sharding=NamedSharding(lay.mesh, P(*([None] * len(lead)), *p.spec)))
            for p in lay.params])

    model = jax.tree.leaves({"embed": shapes(lays.embed), "layers": shapes(lays.layer, (num_layers,)),
                             "head": shapes(lays.head)})

    def logical(node):
        if _structure(node) == treedef:
            return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(m.shape, x.dtype, sharding=m.sharding)
                                                for x, m in zip(jax.tree.leaves(node), model)])
        return jax.ShapeDtypeStruct(node.shape, node.dtype)

    return jax.tree.map(logical, state, is_leaf=lambda n: _structure(n) == treedef)


def abstract_state(cfg: Config, lays: Layouts, tx):
    """The state's ShapeDtypeStructs with this mesh's shapes and shardings, allocating nothing (what a
    checkpoint is restored into)."""
    abstract = abstract_params(cfg)
    params = {
        "embed": lays.embed.global_shapes,
        "layers": jax.tree.unflatten(lays.layer.treedef, [
            jax.ShapeDtypeStruct((cfg.layers, *p.global_shape), p.dtype,
                                 sharding=NamedSharding(lays.layer.mesh, lays.layer.param_spec(p, stacked=True)))
            for p in lays.layer.params]),
        "head": lays.head.global_shapes,
    }
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    treedef, shardings = jax.tree.structure(params), [x.sharding for x in jax.tree.leaves(params)]
    replicated = NamedSharding(lays.layer.mesh, P())
    opt = jax.eval_shape(tx.init, params)

    def place(node):
        if _structure(node) == treedef:
            return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                                for x, s in zip(jax.tree.leaves(node), shardings)])
        return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=replicated)

    return {"params": params, "opt": jax.tree.map(place, opt, is_leaf=lambda n: _structure(n) == treedef)}


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0}


def peak_tflops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, tf in PEAK_BF16_TFLOPS.items():
        if name.lower() in kind.lower():
            return tf
    return None


def peak_memory_bytes(devices) -> int | None:
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None
