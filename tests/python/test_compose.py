"""FSDP that composes with tensor, expert and data parallelism (issue #23), on 8 CPU devices.

One block of the shapes large models shard this way, with sizes the FSDP axis does not divide:
Megatron-style attention and MLP (column-parallel `wq`/`wk`/`wv`/`w1`/`b1` split `P(None, tp)`,
row-parallel `wo`/`w2` split `P(tp, None)`, a psum over `tp` after each) and a mixture of experts
with its experts split `P(ep, None, None)` (each device runs its local experts on every token, weighted
by its share of the router's gates, a psum over `ep` combines them); norms and the router replicated
(`P()`). The gates are a softmax over all experts, not a top-k: a top-k choice flips where two gates
nearly tie, and bf16 rounding (which differs between one device and a split matmul) then moves the
router's gradient by far more than the tolerances below (examples/llama.py's mixture is top-2).
Every parameter is FSDP-sharded by tide along dim 0 of its local block. Meshes: fsdp x tensor 4 x 2 and 2 x 4 (the
experts over "tensor" too), fsdp x expert 4 x 2 (attention and MLP replicated over "expert"), and
data x fsdp x tensor 2 x 2 x 2 (HSDP: shards replicated over "data", `replicas=("data",)`).

Each is checked against the same block on full parameters on one device (bf16 matmuls both sides:
loss to 1e-2 relative, every gradient to 3e-2 relative norm) and against the pure-JAX backend on the
same mesh (same loss, gradients to fp32 summation order); a second step is bitwise the first. Under
shard_map's default check_vma=True: the block's code is plain Megatron (no tide-specific psum, no
manual pvary). The same through `scan_layers` (two stacked blocks on fsdp x tensor), through
`tide_jax.nnx` (an annotated NNX decoder, logical axis rules) and `tide_jax.equinox` (a specs
pytree, on data x fsdp x tensor); every refusal of `layout(specs=...)` raises before anything runs,
naming the parameter and the axis.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

D, H, HD, F, E, FE, T = 11, 4, 3, 12, 4, 5, 5  # width, heads, head dim, MLP, experts, expert MLP, tokens
BF16 = jnp.bfloat16

# (mesh shape, axis names, tensor axis, expert axis, replicas)
MESHES = {
    "fsdp4_tensor2": ((4, 2), ("fsdp", "tensor"), "tensor", "tensor", None),
    "fsdp2_tensor4": ((2, 4), ("fsdp", "tensor"), "tensor", "tensor", None),
    "fsdp4_expert2": ((4, 2), ("fsdp", "expert"), None, "expert", None),
    "data2_fsdp2_tensor2": ((2, 2, 2), ("data", "fsdp", "tensor"), "tensor", "tensor", ("data",)),
}


def init_block(rng) -> dict:
    def normal(*shape, std=0.15):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    return {
        "attn_norm": 1.0 + normal(D, std=0.1), "wq": normal(D, H * HD), "wk": normal(D, H * HD),
        "wv": normal(D, H * HD), "wo": normal(H * HD, D), "mlp_norm": 1.0 + normal(D, std=0.1),
        "w1": normal(D, F), "b1": normal(F, std=0.1), "w2": normal(F, D), "moe_norm": 1.0 + normal(D, std=0.1),
        "router": normal(D, E), "w_in": normal(E, D, FE), "w_out": normal(E, FE, D),
    }


def block_specs(tp, ep) -> dict:
    col, row, rep = P(None, tp), P(tp, None), P()
    return {"attn_norm": rep, "wq": col, "wk": col, "wv": col, "wo": row, "mlp_norm": rep, "w1": col,
            "b1": P(tp), "w2": row, "moe_norm": rep, "router": rep, "w_in": P(ep, None, None),
            "w_out": P(ep, None, None)}


def _manual(axis) -> bool:
    return axis is not None and axis in jax.sharding.get_abstract_mesh().manual_axes


def _psum(x, axis):
    """Megatron's reduction after a row-parallel matmul: over `axis` inside shard_map, nothing on full
    parameters (one device)."""
    return jax.lax.psum(x, axis) if _manual(axis) else x


def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def block(p, x, tp=None, ep=None):
    """x: (b, T, D) bf16 -> (b, T, D) bf16, with the local blocks of bf16 parameters `p` (the full
    parameters on one device)."""
    b, t, _ = x.shape
    h = _rms(x, p["attn_norm"])
    q, k, v = ((h @ p[w]).reshape(b, t, -1, HD) for w in ("wq", "wk", "wv"))  # this device's heads
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(HD)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(x.dtype), v)
    x = x + _psum(o.reshape(b, t, -1) @ p["wo"], tp)
    h = _rms(x, p["mlp_norm"])
    x = x + _psum(jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"], tp)
    # mixture of experts: the gates over every expert (replicated), this device's experts' share
    h = _rms(x, p["moe_norm"])
    gates = jax.nn.softmax((h @ p["router"]).astype(jnp.float32), axis=-1)
    local = p["w_in"].shape[0]
    first = jax.lax.axis_index(ep) * local if _manual(ep) else 0
    mine = jax.lax.dynamic_slice_in_dim(gates, first, local, axis=-1).astype(x.dtype)
    y = jnp.einsum("bte,btef,efd->btd", mine, jax.nn.gelu(jnp.einsum("btd,edf->btef", h, p["w_in"])), p["w_out"])
    return x + _psum(y, ep)


def _loss(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _bf16(tree):
    return jax.tree.map(lambda t: jnp.asarray(t).astype(BF16), tree)


def _reference(params, x, y, layers):
    """Loss and gradients of the same block(s) on full parameters, one device (bf16 matmuls)."""

    def loss(params, x, y):
        h = jnp.asarray(x).astype(BF16)
        for i in range(layers):
            h = block(_bf16(jax.tree.map(lambda t: t[i], params) if layers > 1 else params), h)
        return _loss(h, y)

    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
    return float(value), jax.tree.map(np.asarray, grads)


BATCH = 8  # sequences, split over the batch axes of every mesh (4, 2, 4 and 2 x 2 devices)


@pytest.fixture(scope="module")
def one_block():
    """Fresh random parameters and data, and the reference on one device (compiled once for every mesh)."""
    rng = np.random.default_rng()
    params = init_block(rng)
    x, y = (rng.standard_normal((BATCH, T, D)).astype(np.float32) for _ in range(2))
    return params, x, y, _reference(params, x, y, 1)


@pytest.fixture(scope="module")
def two_blocks():
    rng = np.random.default_rng()
    stacked = jax.tree.map(lambda *t: np.stack(t), *[init_block(rng) for _ in range(2)])
    x, y = (rng.standard_normal((BATCH, T, D)).astype(np.float32) for _ in range(2))
    return stacked, x, y, _reference(stacked, x, y, 2)


def _check(name, loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (name, loss, ref_loss)
    for k in ref_grads:
        g, r = np.asarray(grads[k], np.float64), np.asarray(ref_grads[k], np.float64)
        assert g.shape == r.shape, (name, k, g.shape, r.shape)
        rel = np.linalg.norm(g - r) / np.linalg.norm(r)
        assert rel <= 3e-2, f"{name}: gradient of {k}: relative norm difference {rel:.2e}"


def _same_as_twin(name, out, twin):
    (loss, grads), (loss_j, grads_j) = out, twin
    assert loss == loss_j, f"{name}: loss differs between tide and the pure-JAX backend: {loss} vs {loss_j}"
    for k in grads:
        g, j = np.asarray(grads[k]), np.asarray(grads_j[k])
        scale = np.abs(j).max()
        np.testing.assert_allclose(g, j, rtol=1e-5, atol=1e-6 * scale, err_msg=f"{name}: {k}: tide vs pure-JAX backend")


def _full(lay, tree, layers=0):
    """Global shard arrays -> full parameters on the host, each block's padding rows dropped (and
    checked to be zero)."""
    out = {}
    lead = (layers,) if layers else ()
    for p, g in zip(lay.params, jax.tree.leaves(tree)):
        g = np.asarray(g).reshape(*lead, p.blocks, p.padded_rows, -1)
        assert not g[..., p.rows:, :].any(), f"{p.path}: padding rows are not zero"
        out[p.path.strip("[]'")] = g[..., : p.rows, :].reshape(*lead, *p.shape)
    return out


def _bitwise(a, b):
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", list(MESHES))
def test_block_on_composed_meshes(tide_backend, one_block, name):
    shape, names, tp, ep, replicas = MESHES[name]
    mesh = make_mesh(shape, names)
    params, x, y, ref = one_block
    lay = tide_jax.layout(params, mesh, "fsdp", specs=block_specs(tp, ep), replicas=replicas)
    shards = lay.shard(params)
    # the global arrays: each block padded on its own (w2's 12 rows split over tp, then over fsdp)
    assert lay.spec["w2"] == (P(("tensor", "fsdp")) if tp else P("fsdp"))
    assert lay.spec["wq"] == (P("fsdp", "tensor") if tp else P("fsdp"))
    assert lay.spec["w_in"] == P((ep, "fsdp"))
    for p, s in zip(lay.params, jax.tree.leaves(shards)):
        assert s.shape == p.global_shape and s.sharding.spec == lay.spec[p.path.strip("[]'")], p
    assert any(p.padded_rows != p.rows for p in lay.params)  # uneven on purpose

    def forward(shards, x, backend):
        return block(tide_jax.gather_params(shards, lay, BF16, backend=backend), x, tp, ep)

    _run_both(name, mesh, lay, lay.spec, shards, x, y, forward, ref, layers=0)


@pytest.mark.parametrize("name", ["fsdp4_tensor2"])
def test_scan_layers_on_composed_meshes(tide_backend, two_blocks, name):
    """Two stacked blocks through scan_layers (prefetched gathers, overlapped reduce-scatters, layer
    gradients written in place): the same as on full parameters and as the pure-JAX backend. (On
    data x fsdp x tensor: the Equinox test below, whose layers run through scan_layers too.)"""
    shape, names, tp, ep, replicas = MESHES[name]
    mesh = make_mesh(shape, names)
    stacked, x, y, ref = two_blocks
    lay = tide_jax.layout(jax.tree.map(lambda t: t[0], stacked), mesh, "fsdp", specs=block_specs(tp, ep),
                          replicas=replicas)
    assert lay.stacked_spec["w2"] == P(None, ("tensor", "fsdp"))

    def forward(shards, x, backend):
        return tide_jax.scan_layers(lambda p, c: block(p, c, tp, ep), x, shards, lay, dtype=BF16, backend=backend)

    _run_both(name, mesh, lay, lay.stacked_spec, lay.shard_stacked(stacked), x, y, forward, ref, layers=2)


def _run_both(name, mesh, lay, spec, shards, x, y, forward, ref, layers):
    """One training step's loss and gradients with `forward(shards, x, backend)` under shard_map
    (check_vma on), on both backends: tide's against the reference on one device and the pure-JAX
    backend's; a second tide step bitwise the first."""
    batch_axes = tuple(a for a in mesh.axis_names if a in ("data", "fsdp"))
    n_batch = math.prod(mesh.shape[a] for a in batch_axes)
    data = NamedSharding(mesh, P(batch_axes))
    x_dev, y_dev = jax.device_put(x, data), jax.device_put(y, data)

    def make(backend):
        def step(shards, x, y):
            def loss_of(shards):
                return _loss(forward(shards, x.astype(BF16), backend), y) / n_batch

            loss, grads = jax.value_and_grad(loss_of)(shards)
            return jax.lax.psum(loss, batch_axes), grads

        return jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(spec, P(batch_axes), P(batch_axes)),
                                          out_specs=(P(), spec)))

    runs = {}
    for backend in ("tide", "jax"):
        f = make(backend)
        loss, grads = f(shards, x_dev, y_dev)
        runs[backend] = (float(loss), _full(lay, grads, layers))  # (checks the padding rows are zero)
        if backend == "tide":
            assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
            assert _bitwise((loss, grads), f(shards, x_dev, y_dev)), f"{name}: a repeated step differs"
    _check(name, *runs["tide"], *ref)
    _same_as_twin(name, runs["tide"], runs["jax"])


def test_shard_unshard_blocks():
    """Full parameters (replicated, or already split as their specs say) -> padded blocks -> back."""
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    rng = np.random.default_rng(3)
    params = init_block(rng)
    lay = tide_jax.layout(params, mesh, "fsdp", specs=block_specs("tensor", "tensor"))
    w2 = next(p for p in lay.params if p.path == "['w2']")
    assert (w2.local_shape, w2.blocks, w2.shard_rows, w2.global_shape) == ((6, D), 2, 2, (16, D))
    shards = lay.shard(params)
    g = np.asarray(shards["w2"])  # block b's rows at [8 b, 8 b + 6), zeros after them
    np.testing.assert_array_equal(g[0:6], params["w2"][0:6])
    np.testing.assert_array_equal(g[8:14], params["w2"][6:12])
    assert not g[6:8].any() and not g[14:16].any()
    back = lay.unshard(shards)
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), params[k])
        assert back[k].sharding.spec == lay.specs[k]
    # arrays that carry their NamedSharding supply their spec (an fsdp entry is tide's to replace)
    placed = {k: jax.device_put(v, NamedSharding(mesh, block_specs("tensor", "tensor")[k])) for k, v in params.items()}
    placed["router"] = jax.device_put(params["router"], NamedSharding(mesh, P(None, "fsdp")))
    carried = tide_jax.layout(placed, mesh, "fsdp")
    assert carried.spec == lay.spec and carried.replicas == ()
    stacked = jax.tree.map(lambda t: np.stack([t, 2 * t]), params)
    back = lay.unshard_stacked(lay.shard_stacked(stacked))
    for k in params:
        np.testing.assert_array_equal(np.asarray(back[k]), stacked[k])


def test_refusals_name_parameter_and_axis():
    """Every refusal raises when the layout is built (before anything is traced or runs)."""
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    w = {"w": np.zeros((6, 5), np.float32), "v": np.zeros((3,), np.float32)}
    with pytest.raises(ValueError, match=r"parameter \['w'\]: its spec .* names axis 'fsdp', the axis tide shards over"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P(None, "fsdp"), "v": P()})
    with pytest.raises(ValueError, match=r"parameter \['w'\] \(shape \(6, 5\)\): dim 1 \(5\) does not divide by mesh "
                                         r"axes \('tensor',\)"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P(None, "tensor"), "v": P()})
    with pytest.raises(ValueError, match=r"parameter \['v'\]: its spec .* names axis 'model', which the mesh does not"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P(), "v": P("model")})
    with pytest.raises(ValueError, match=r"parameter \['v'\] \(shape \(3,\)\): its spec .* has 2 entries"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P(), "v": P(None, "tensor")})
    with pytest.raises(ValueError, match=r"parameter \['w'\]: its spec .* names axis 'tensor' twice"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P("tensor", "tensor"), "v": P()})
    with pytest.raises(ValueError, match=r"replicas names axis 'tensor', but parameter \['w'\]'s spec splits it"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P("tensor"), "v": P()}, replicas=("tensor",))
    with pytest.raises(ValueError, match=r"specs must be a pytree of PartitionSpecs matching it or a prefix"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": P()})
    with pytest.raises(ValueError, match=r"the spec at \['w'\] is a tuple \(None, 'tensor'\), not a PartitionSpec: "
                                         r"write jax\.sharding\.PartitionSpec\(None, 'tensor'\)"):
        tide_jax.layout(w, mesh, "fsdp", specs={"w": (None, "tensor"), "v": P()})
    carried = jax.ShapeDtypeStruct((6, 5), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor")))
    with pytest.raises(ValueError, match=r"parameter \['w'\] \(shape \(6, 5\)\): dim 1 \(5\) does not divide.*"
                                         r"its NamedSharding's spec"):
        tide_jax.layout({"w": carried}, mesh, "fsdp")
    # a prefix of the pytree: one spec for a whole subtree
    sub = {"w": np.zeros((6, 5), np.float32), "v": np.zeros((4,), np.float32)}
    lay = tide_jax.layout({"a": sub, "b": sub}, mesh, "fsdp", specs={"a": P("tensor"), "b": P()})
    assert lay.spec == {"a": {"w": P(("tensor", "fsdp")), "v": P(("tensor", "fsdp"))},
                        "b": {"w": P("fsdp"), "v": P("fsdp")}}


# ----- the front doors: an annotated NNX model, an Equinox model with a specs pytree -----
V, L = 19, 2  # vocabulary, stacked layers
RULES = [("embed", "fsdp"), ("mlp", "tensor"), ("vocab", None)]  # MaxText-style; "embed" -> fsdp: tide's own


def test_nnx_annotated_model_on_fsdp_x_tensor(tide_backend):
    """An NNX decoder annotated as NNX users annotate (`nnx.with_partitioning` with logical names, the
    stacked layers' axis left unnamed by nnx.vmap), rules mapping "mlp" to "tensor": the front door
    splits the MLP Megatron-style, FSDP-shards every local block, splits the batch over "fsdp" only
    (the axis no parameter is split over), and loss and gradients equal the plain model's on one
    device (fp32 gathers: to fp32 rounding)."""
    nnx = pytest.importorskip("flax.nnx")
    from tide_jax import nnx as tnnx

    init = nnx.initializers.normal(0.3)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.RMSNorm(D, rngs=rngs)
            self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                                 bias_init=nnx.with_partitioning(init, ("mlp",)), rngs=rngs)
            self.down = nnx.Linear(F, D, use_bias=False, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                                   rngs=rngs)

        def __call__(self, x):
            return x + _psum(self.down(jax.nn.gelu(self.up(self.norm(x)))), "tensor")

    class Decoder(nnx.Module):
        def __init__(self, rngs, plain=False):
            self.embed = nnx.Embed(V, D, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)

            @nnx.split_rngs(splits=L)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)
            self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(init, ("embed", "vocab")), rngs=rngs)
            self.plain = plain

        def __call__(self, tokens):
            x = self.embed(tokens)
            if self.plain:
                @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
                def forward(x, block):
                    return block(x)

                x = forward(x, self.blocks)
            else:
                x = tnnx.call_layers(self.blocks, x)
            return self.head(x)

    def loss_fn(model, tokens, targets):
        logits = model(tokens).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    seed = int(np.random.default_rng().integers(1 << 30))
    with nnx.use_eager_sharding(False):
        ref, model = Decoder(nnx.Rngs(seed), plain=True), Decoder(nnx.Rngs(seed))
    mesh = make_mesh((4, 2), ("fsdp", "tensor"))
    fsdp = tnnx.shard(model, mesh, "fsdp", layers="blocks", rules=RULES)
    assert fsdp.batch_axes == ("fsdp",)
    assert fsdp.specs["blocks.up.kernel"] == P(None, "tensor") and fsdp.specs["blocks.down.kernel"] == P("tensor")
    assert fsdp.specs["embed.embedding"] == P() and fsdp.specs["blocks.norm.scale"] == P()
    assert model.blocks.down.kernel.shape == (L, 2 * 4 * 2, D)  # 6 rows per block, padded to 8 over 4
    rng = np.random.default_rng(seed)
    tokens, targets = rng.integers(0, V, (8, T)), rng.integers(0, V, (8, T))
    loss, grads = nnx.jit(fsdp.value_and_grad(loss_fn))(model, tokens, targets)
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(ref, tokens, targets)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    full = jax.tree.leaves(fsdp.unshard(grads))
    want = jax.tree.leaves(ref_grads)
    assert len(full) == len(want) == 7
    for g, r in zip(full, want):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape and np.linalg.norm(g - r) <= 1e-4 * np.linalg.norm(r), (g.shape, np.linalg.norm(g - r))
    with pytest.raises(ValueError, match=r"parameter blocks\.down\.kernel: its annotation .* names 'mlp', which no rule "
                                         r"maps to an axis of the mesh"):
        with nnx.use_eager_sharding(False):
            tnnx.shard(Decoder(nnx.Rngs(0)), mesh, "fsdp", layers="blocks", rules=[("vocab", None)])


def test_equinox_specs_pytree_on_data_x_fsdp_x_tensor(tide_backend):
    """An Equinox decoder (per-example modules, layers stacked with eqx.filter_vmap) with a specs
    pytree splitting its MLP over "tensor" (eqx.nn.Linear's weight is (out, in): column-parallel
    P("tensor", None), row-parallel P(None, "tensor")): on data x fsdp x tensor, loss and gradients
    equal the plain model's on one device (fp32 gathers)."""
    eqx = pytest.importorskip("equinox")
    from tide_jax import equinox as teqx

    class Block(eqx.Module):
        norm: eqx.nn.RMSNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.norm, self.up = eqx.nn.RMSNorm(D), eqx.nn.Linear(D, F, key=k1)
            self.down = eqx.nn.Linear(F, D, use_bias=False, key=k2)

        def __call__(self, x):  # one token
            return x + _psum(self.down(jax.nn.gelu(self.up(self.norm(x)))), "tensor")

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        layers: Block
        head: eqx.nn.Linear

        def __init__(self, key):
            k0, k1, k2 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(V, D, key=k0)
            self.layers = eqx.filter_vmap(Block)(jax.random.split(k1, L))
            self.head = eqx.nn.Linear(D, V, key=k2)

        def __call__(self, tokens):  # one sequence
            x = jax.vmap(self.embed)(tokens)
            x = teqx.call_layers(self.layers, x, fn=lambda layer, x: jax.vmap(layer)(x))
            return jax.vmap(self.head)(x)

    def loss_fn(model, tokens, targets):
        logits = jax.vmap(model)(tokens)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))

    seed = int(np.random.default_rng().integers(1 << 30))
    ref = Decoder(jax.random.key(seed))
    specs = jax.tree.map(lambda _: P(), ref)
    specs = eqx.tree_at(lambda s: (s.layers.up.weight, s.layers.up.bias, s.layers.down.weight), specs,
                        (P("tensor", None), P("tensor"), P(None, "tensor")))
    mesh = make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    model, fsdp = teqx.shard(ref, mesh, "fsdp", layers="layers", specs=specs)
    assert fsdp.batch_axes == ("data", "fsdp") and fsdp.layouts["layers"].replicas == ("data",)
    rng = np.random.default_rng(seed)
    tokens, targets = rng.integers(0, V, (8, T)), rng.integers(0, V, (8, T))
    loss, grads = eqx.filter_jit(fsdp.filter_value_and_grad(loss_fn))(model, tokens, targets)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(ref, tokens, targets)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    full, want = jax.tree.leaves(fsdp.unshard(grads)), jax.tree.leaves(ref_grads)
    assert len(full) == len(want) == 8  # (eqx.nn.RMSNorm has a weight and a bias)
    for g, r in zip(full, want):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert g.shape == r.shape and np.linalg.norm(g - r) <= 1e-4 * np.linalg.norm(r), (g.shape, np.linalg.norm(g - r))
    # batch_axes must split the batch over the FSDP axis too (it used to be taken, and the first
    # step failed inside shard_map with JAX's out_specs error naming neither tide nor batch_axes)
    for bad in [("data",), (), "data"]:
        with pytest.raises(ValueError, match=r"tide_jax\.equinox\.shard: batch_axes=.* leaves out the FSDP axis "
                                             r"'fsdp'.*batch_axes=\(('data', )?'fsdp',?\)"):
            teqx.shard(ref, mesh, "fsdp", layers="layers", specs=specs, batch_axes=bad)
    # a stacked parameter's short spec is one layer's; when that does not divide, the error says so
    odd = eqx.tree_at(lambda s: s.layers.down.weight, specs, P("tensor"))  # one layer's (11, 12): 11 / 2
    with pytest.raises(ValueError, match=r"dim 0 \(11\) does not divide.*were read as ONE layer's: a spec is the "
                                         r"stack's only with one entry per stacked dimension"):
        teqx.shard(ref, mesh, "fsdp", layers="layers", specs=odd)
