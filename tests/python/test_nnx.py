"""tide_jax.nnx, the front door for Flax NNX models (issue #15).

A small decoder written as NNX users write it (nnx.Embed, nnx.RMSNorm, nnx.Linear, nnx.Dropout with its
RngKey/RngCount state, blocks stacked with nnx.split_rngs + nnx.vmap, an int and a bool buffer), odd
sizes (vocab 37, width 13, hidden 10: rows that 3 and 8 ranks do not divide), trained for 5 AdamW steps
with the front door and, from the same init on the same data, without tide:
- the plain model (its __call__ runs the blocks with nnx.scan, no tide import), nnx.value_and_grad,
  nnx.Optimizer, one program over the whole batch: on 1 device with dropout on; on 3 and 8 with dropout
  off (its state still present), since each device draws its dropout mask for its own part of the batch;
- the plain model trained data-parallel (shard_map, replicated parameters, pmean of the gradients): on 3
  and 8 devices with dropout on, the same masks as the front door's.
Loss, gradients and parameters agree to fp32 rounding (gathers in fp32).
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import tide_jax  # noqa: E402
from conftest import make_mesh, subprocess_pythonpath  # noqa: E402
from tide_jax import nnx as tnnx  # noqa: E402

V, D, F, L, T = 37, 13, 10, 3, 5
AXIS = "fsdp"


class Block(nnx.Module):
    def __init__(self, rate, rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.layer_id = nnx.Variable(jnp.zeros((), jnp.int32))  # an int buffer per layer

    def __call__(self, x):
        h = self.down(jax.nn.gelu(self.up(self.norm(x))))
        return x + self.drop(h) * (1.0 + 0.0 * self.layer_id[...])


class Decoder(nnx.Module):
    def __init__(self, rngs, *, rate=0.2, plain=False):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rate, rngs)

        self.blocks = make(rngs)
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.mask = nnx.Variable(jnp.ones((V,), jnp.bool_))  # a bool buffer
        self.plain = plain

    def __call__(self, tokens):
        x = self.embed(tokens)
        if self.plain:  # the model without tide: NNX's own idiom
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x, block):
                return block(x)

            x = forward(x, self.blocks)
        else:
            x = tnnx.call_layers(self.blocks, x)
        logits = self.head(self.drop(self.norm(x)))
        return jnp.where(self.mask[...], logits, -1e9)


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def _data(world, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (2 * world, T)), rng.integers(0, V, (2 * world, T))


def _params(model):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _rel(a, b):
    worst = 0.0
    for x, y in zip(a, b):
        worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return worst


def _plain_step(tx):
    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        opt.update(model, grads)
        return loss, grads

    return step


def _dp_step(mesh):
    """The plain model trained data-parallel: replicated parameters, each device's part of the batch
    (the gradient of a replicated parameter is summed over the devices by shard_map's autodiff)."""
    world = mesh.shape[AXIS]

    @nnx.jit
    def step(model, opt, x, y):
        gd, params, rest = nnx.split(model, nnx.Param, ...)

        def local(params, rest, x, y):
            m = nnx.merge(gd, params, rest)
            loss, grads = nnx.value_and_grad(lambda m, x, y: loss_fn(m, x, y) / world)(m, x, y)
            _, _, rest = nnx.split(m, nnx.Param, ...)
            return jax.lax.psum(loss, AXIS), grads, rest

        loss, grads, rest = tide_jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                               out_specs=(P(), P(), P()))(params, rest, x, y)
        nnx.update(model, rest)
        opt.update(model, grads)
        return loss, grads

    return step


def _tide_step(fsdp):
    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = fsdp.value_and_grad(loss_fn)(model, x, y)
        opt.update(model, grads)
        return loss, grads

    return step


CASES = [  # (world, dropout on, reference)
    (1, True, "plain"),
    (3, False, "plain"),
    (8, False, "plain"),
    (3, True, "dp"),
    (8, True, "dp"),
]


@pytest.mark.parametrize("world,dropout,reference", CASES)
def test_trains_like_the_model_without_tide(world, dropout, reference, tide_backend):
    mesh = make_mesh((world,), (AXIS,))
    tx = optax.adamw(3e-2)
    ref = Decoder(nnx.Rngs(0), plain=True)
    model = Decoder(nnx.Rngs(0))
    if not dropout:
        for m in (ref, model):
            m.set_attributes(deterministic=True)
    fsdp = tnnx.shard(model, mesh, AXIS, layers="blocks", dtype=jnp.float32)
    assert {s.name: s.num for s in fsdp.plan.stacks} == {"blocks": L}
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_step = _plain_step(tx) if reference == "plain" else _dp_step(mesh)
    step = _tide_step(fsdp)
    for i in range(5):
        x, y = _data(world, i)
        l_ref, g_ref = ref_step(ref, ref_opt, x, y)
        l_tide, g_tide = step(model, opt, x, y)
        assert abs(float(l_tide) - float(l_ref)) <= 2e-6 * abs(float(l_ref)), (i, float(l_tide), float(l_ref))
        g_full = fsdp.unshard(g_tide)
        assert jax.tree.structure(g_full) == jax.tree.structure(g_ref)
        rel = _rel([np.asarray(x, np.float64) for x in jax.tree.leaves(g_full)],
                   [np.asarray(x, np.float64) for x in jax.tree.leaves(g_ref)])
        assert rel < 2e-5, (i, rel)
    # the RNG counters advanced as NNX advances them (per layer and at the top), dropout on or off
    np.testing.assert_array_equal(np.asarray(model.blocks.drop.rngs.count[...]),
                                  np.asarray(ref.blocks.drop.rngs.count[...]))
    assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == (5 if dropout else 0)
    loss_start = float(l_ref)
    fsdp.unshard(model)
    assert _rel(_params(model), _params(ref)) < 1e-4
    assert np.isfinite(loss_start)


def test_apply_has_aux_unshard_roundtrip(tide_backend):
    world = 3
    mesh = jax.make_mesh((world,), (AXIS,), devices=jax.devices("cpu")[:world])  # explicit axes (jax's default)
    assert "Explicit" in str(mesh.axis_types)
    ref = Decoder(nnx.Rngs(1), plain=True)
    model = Decoder(nnx.Rngs(1))
    for m in (ref, model):
        m.set_attributes(deterministic=True)
    full = _params(model)
    fsdp = tnnx.shard(model, mesh, AXIS, layers=lambda m: m.blocks, dtype=jnp.float32, remat="full")
    # the Params are shards now, globally (P * shard_rows, ...), stacked (L, P * shard_rows, ...)
    assert model.blocks.up.kernel[...].shape == (L, world * 5, F)
    assert model.embed.embedding[...].shape == (world * 13, D)
    x, y = _data(world, 7)
    logits = jax.jit(lambda m, x: fsdp.apply(lambda m, x: m(x))(m, x))(model, x)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref(x)), rtol=2e-5, atol=2e-5)

    def with_aux(m, x, y):
        logits = m(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return loss.mean(), {"per_example": loss.mean(-1), "top": (logits.argmax(-1) == y).mean()}

    (loss, aux), grads = fsdp.value_and_grad(with_aux, has_aux=True)(model, x, y)
    (rloss, raux), rgrads = nnx.value_and_grad(with_aux, has_aux=True)(ref, x, y)
    assert abs(float(loss) - float(rloss)) < 1e-5
    np.testing.assert_allclose(np.asarray(aux["per_example"]), np.asarray(raux["per_example"]), rtol=2e-5)
    assert aux["per_example"].shape == (2 * world,)
    assert abs(float(aux["top"]) - float(raux["top"])) < 1e-6
    assert _rel([np.asarray(g) for g in jax.tree.leaves(fsdp.unshard(grads))],
                [np.asarray(g) for g in jax.tree.leaves(rgrads)]) < 2e-5
    fsdp.unshard(model)
    assert _rel(_params(model), full) == 0.0


def test_two_axis_mesh_hsdp(tide_backend):
    """Shards over "fsdp", replicated over "dp", the batch split over both: the gradient of the mean."""
    mesh = make_mesh((2, 4), ("dp", AXIS))
    ref = Decoder(nnx.Rngs(2), plain=True)
    model = Decoder(nnx.Rngs(2))
    for m in (ref, model):
        m.set_attributes(deterministic=True)
    fsdp = tnnx.shard(model, mesh, AXIS, layers="blocks", dtype=jnp.float32)
    x, y = _data(8, 1)
    loss, grads = jax.jit(lambda m, x, y: fsdp.value_and_grad(loss_fn)(m, x, y))(model, x, y)
    ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(ref, x, y)
    assert abs(float(loss) - float(ref_loss)) < 2e-6 * float(ref_loss)
    assert _rel([np.asarray(g) for g in jax.tree.leaves(fsdp.unshard(grads))],
                [np.asarray(g) for g in jax.tree.leaves(ref_grads)]) < 2e-5


def test_errors_name_what_to_do(tide_backend):
    mesh = make_mesh((3,), (AXIS,))
    # the stacked layers named wrong
    with pytest.raises(ValueError, match=r"layers='block' names no parameters.*'blocks'"):
        tnnx.shard(Decoder(nnx.Rngs(0)), mesh, AXIS, layers="block")
    # a non-floating Param: refused naming its path and dtype
    bad = Decoder(nnx.Rngs(0))
    bad.head.bias = nnx.Param(jnp.zeros((V,), jnp.int32))
    with pytest.raises(TypeError, match=r"head\.bias has dtype int32"):
        tnnx.shard(bad, mesh, AXIS, layers="blocks")
    # a model that runs its stacked layers itself, not through call_layers
    plain = Decoder(nnx.Rngs(0), plain=True)
    fsdp = tnnx.shard(plain, mesh, AXIS, layers="blocks")
    x, y = _data(3, 0)
    with pytest.raises(TypeError, match=r"tide_jax\.nnx\.call_layers\(self\.blocks"):
        fsdp.value_and_grad(loss_fn)(plain, x, y)
    # a batch the devices do not divide
    model = Decoder(nnx.Rngs(0))
    fsdp = tnnx.shard(model, mesh, AXIS, layers="blocks")
    with pytest.raises(ValueError, match=r"argument\[0\] has 4 rows .* over 3 devices"):
        fsdp.value_and_grad(loss_fn)(model, x[:4], y[:4])
    # not a scalar loss
    with pytest.raises(TypeError, match="scalar floating loss"):
        fsdp.value_and_grad(lambda m, x: m(x))(model, x)
    # an unsharded model given to the front door
    with pytest.raises(ValueError, match="its full, unsharded shape"):
        fsdp.value_and_grad(loss_fn)(Decoder(nnx.Rngs(0)), x, y)
    # the layout of an NNX state with its PRNG key, as the issue found it: a named error now
    with pytest.raises(TypeError, match=r"blocks.*rngs.*key.*key<fry>.*tide_jax\.nnx\.shard"):
        tide_jax.layout(nnx.state(Decoder(nnx.Rngs(0))), mesh, AXIS)


def test_state_varying_per_device_is_refused(tide_backend):
    class WithStats(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)
            self.bn = nnx.BatchNorm(D, rngs=rngs)

            @nnx.vmap(in_axes=None, out_axes=0, axis_size=2)
            def make():
                return nnx.Linear(D, D, rngs=nnx.Rngs(0))

            self.blocks = make()

        def __call__(self, x):
            x = tnnx.call_layers(self.blocks, self.lin(x))
            return self.bn(x)

    mesh = make_mesh((3,), (AXIS,))
    model = WithStats(nnx.Rngs(0))
    fsdp = tnnx.shard(model, mesh, AXIS, layers="blocks")
    x = np.random.default_rng(0).standard_normal((6, D)).astype(np.float32)
    with pytest.raises(ValueError, match=r"state bn\.mean .* differently on each device"):
        fsdp.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))(model, x)


def test_import_tide_jax_imports_neither_flax_nor_equinox():
    code = ("import sys; import tide_jax; assert 'flax' not in sys.modules and 'equinox' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('flax', 'equinox'))); print('ok')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": subprocess_pythonpath()}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
