"""tide_jax.equinox, the front door for Equinox models (issue #15).

A small decoder written as Equinox users write it: per-example modules (eqx.nn.Embedding, eqx.nn.RMSNorm,
eqx.nn.Linear, eqx.nn.Dropout), called with `jax.vmap` over the batch, layers stacked with
`eqx.filter_vmap`, a per-layer int buffer, a bool buffer and a PRNG key stored in the model (state:
passed through unsharded), odd sizes (vocab 37, width 13, hidden 10), dropout on with per-example keys.
Trained for 5 AdamW steps with the front door and, from the same init on the same data, without tide
(the model's __call__ with the `eqx.partition` + `lax.scan` loop, eqx.filter_value_and_grad, one program
over the whole batch): loss, gradients and parameters agree to fp32 rounding on 1, 3 and 8 devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

from conftest import make_mesh  # noqa: E402
from tide_jax import equinox as teqx  # noqa: E402

V, D, F, L, T = 37, 13, 10, 3, 5
AXIS = "fsdp"


class Block(eqx.Module):
    norm: eqx.nn.RMSNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    drop: eqx.nn.Dropout
    index: jax.Array  # an int buffer, per layer

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.RMSNorm(D)
        self.up = eqx.nn.Linear(D, F, key=k1)
        self.down = eqx.nn.Linear(F, D, use_bias=False, key=k2)
        self.drop = eqx.nn.Dropout(0.2)
        self.index = jnp.zeros((2,), jnp.int32)

    def __call__(self, x, *, key=None):  # x: (T, D), one sequence
        h = jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(self.norm(t)))))(x)
        return x + self.drop(h, key=key, inference=key is None) * (1 + 0 * self.index[0])


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    layers: Block
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear
    mask: jax.Array  # a bool buffer
    seed: jax.Array  # a PRNG key held by the model
    plain: bool = eqx.field(static=True)

    def __init__(self, key, plain=False):
        k0, k1, k2 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(V, D, key=k0)
        self.layers = eqx.filter_vmap(Block)(jax.random.split(k1, L))
        self.norm = eqx.nn.RMSNorm(D)
        self.head = eqx.nn.Linear(D, V, key=k2)
        self.mask = jnp.ones((V,), jnp.bool_)
        self.seed = jax.random.key(7)
        self.plain = plain

    def __call__(self, tokens, *, key=None):
        x = jax.vmap(self.embed)(tokens)
        if self.plain:  # the model without tide: Equinox's scan-over-layers idiom
            dynamic, static = eqx.partition(self.layers, eqx.is_array)
            keys = None if key is None else jax.random.split(key, L)

            def f(x, layer_and_key):
                layer, k = layer_and_key
                return eqx.combine(layer, static)(x, key=k), None

            x, _ = jax.lax.scan(f, x, (dynamic, keys))
        else:
            x = teqx.call_layers(self.layers, x, key=key)
        return jnp.where(self.mask, jax.vmap(lambda t: self.head(self.norm(t)))(x), -1e9)


def loss_fn(model, tokens, targets, keys):
    logits = jax.vmap(model)(tokens, key=keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _data(world, seed):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(100 + seed), 2 * world)
    return rng.integers(0, V, (2 * world, T)), rng.integers(0, V, (2 * world, T)), keys


def _floats(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]


def _rel(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)) for x, y in zip(a, b))


def _step(vg, tx):
    @eqx.filter_jit
    def step(model, opt_state, x, y, k):
        loss, grads = vg(loss_fn)(model, x, y, k)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    return step


@pytest.mark.parametrize("world", [1, 3, 8])
def test_trains_like_the_model_without_tide(world, tide_backend):
    mesh = make_mesh((world,), (AXIS,))
    tx = optax.adamw(3e-2)
    ref = Decoder(jax.random.key(0), plain=True)
    model, fsdp = teqx.shard(Decoder(jax.random.key(0)), mesh, AXIS, layers="layers", dtype=jnp.float32)
    assert model.layers.up.weight.shape == (L, world * -(-F // world), D)
    ref_state = tx.init(eqx.filter(ref, eqx.is_inexact_array))
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    ref_step, step = _step(eqx.filter_value_and_grad, tx), _step(fsdp.filter_value_and_grad, tx)
    for i in range(5):
        x, y, k = _data(world, i)
        ref, ref_state, l_ref, g_ref = ref_step(ref, ref_state, x, y, k)
        model, state, l_tide, g_tide = step(model, state, x, y, k)
        assert abs(float(l_tide) - float(l_ref)) <= 2e-6 * abs(float(l_ref)), (i, float(l_tide), float(l_ref))
        assert _rel(_floats(fsdp.unshard(g_tide)), _floats(g_ref)) < 2e-5, i
    full = fsdp.unshard(model)
    assert _rel(_floats(full), _floats(ref)) < 1e-4
    # the state went through untouched
    assert full.mask.dtype == jnp.bool_ and bool(full.mask.all())
    np.testing.assert_array_equal(jax.random.key_data(full.seed), jax.random.key_data(ref.seed))
    assert full.layers.index.shape == (L, 2)


def test_apply_remat_bf16_and_errors(tide_backend):
    world = 3
    mesh = make_mesh((world,), (AXIS,))
    ref = Decoder(jax.random.key(1), plain=True)
    model, fsdp = teqx.shard(Decoder(jax.random.key(1)), mesh, AXIS, layers=lambda m: m.layers, remat="full",
                             dtype=jnp.bfloat16)
    x, y, k = _data(world, 3)
    # evaluation: no keys (dropout off), bf16 gathers
    logits = eqx.filter_jit(fsdp.apply(lambda m, x: jax.vmap(m)(x)))(model, x)
    want = jax.vmap(ref)(x)
    assert logits.shape == want.shape == (2 * world, T, V)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=0, atol=0.05)
    loss, grads = eqx.filter_jit(fsdp.filter_value_and_grad(loss_fn))(model, x, y, k)
    ref_loss, ref_grads = eqx.filter_value_and_grad(loss_fn)(ref, x, y, k)
    assert abs(float(loss) - float(ref_loss)) < 0.02 * float(ref_loss)
    assert _rel(_floats(fsdp.unshard(grads)), _floats(ref_grads)) < 0.05
    # a model that runs its stacked layers itself, not through call_layers
    plain, fsdp2 = teqx.shard(ref, mesh, AXIS, layers="layers")
    with pytest.raises(TypeError, match=r"tide_jax\.equinox\.call_layers\(self\.layers"):
        fsdp2.filter_value_and_grad(loss_fn)(plain, x, y, k)
    with pytest.raises(ValueError, match=r"layers='layer' names no parameters"):
        teqx.shard(ref, mesh, AXIS, layers="layer")
    with pytest.raises(ValueError, match="structure differs"):
        fsdp.filter_value_and_grad(loss_fn)(eqx.tree_at(lambda m: m.mask, model, None), x, y, k)
    # a complex array: inexact, so Equinox trains it, but float32 master shards cannot hold it
    cplx = eqx.tree_at(lambda m: m.head.bias, ref, ref.head.bias.astype(jnp.complex64))
    with pytest.raises(TypeError, match=r"parameter head\.bias has dtype complex64: the front doors keep float32 "
                                        r"master shards and cannot train complex parameters"):
        teqx.shard(cplx, mesh, AXIS, layers="layers")
