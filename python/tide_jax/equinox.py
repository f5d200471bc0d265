"""tide's FSDP for Equinox models: shard a model, train it with its own `__call__`.

    from tide_jax import equinox as teqx

    class Decoder(eqx.Module):                       # the model, as Equinox users write it, except one line:
        def __call__(self, tokens, *, key=None):
            x = jax.vmap(self.embed)(tokens)
            x = teqx.call_layers(self.layers, x, key=key)   # was: eqx.partition + lax.scan over the layers
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    model = Decoder(cfg, key=jax.random.key(0))
    model, fsdp = teqx.shard(model, mesh, "fsdp", layers="layers")     # floating arrays -> fp32 shards
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, opt_state, tokens, targets, keys):
        loss, grads = fsdp.filter_value_and_grad(loss_fn)(model, tokens, targets, keys)  # was: eqx.filter_value_and_grad
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

`shard` finds the stacked layers by their path (`layers="layers"`, or `lambda m: m.layers`: a module
made with `eqx.filter_vmap`, every array with the layers on its first axis), builds one layer's layout
and one for the other floating arrays, and returns the model with every floating array replaced by its
fp32 FSDP shard (`(P * shard_rows, *rest)`, stacked `(L, P * shard_rows, *rest)`). Every other leaf
is state: non-floating arrays (PRNG keys, integer or boolean buffers) are passed through unsharded
(replicated, no gradient), complex arrays are refused (float32 master shards cannot hold them: store
the real and imaginary parts as two float arrays), and the rest (Python numbers, functions, `eqx.nn.Dropout`'s rate) stays
static, as under `eqx.filter_jit`.

`fsdp.filter_value_and_grad(loss_fn)(model, *batch)` runs `loss_fn(model, *batch)` on every device
under `shard_map` with the batch arguments split on their first axis and returns the loss averaged
over the devices and its gradient shaped like `eqx.filter_value_and_grad`'s (the model's pytree,
the shards' gradients at the floating leaves, None elsewhere), for optax on the shards.

`call_layers(layers, carry, *args, key=None, **kwargs)` is the one change to a model: each layer runs
`carry = layer(carry, *args, key=key_i, **kwargs)` with `key_i` the layer's part of
`jax.random.split(key, L)` (no `key=` when key is None); `fn=` for another call, `xs=` for per-layer
inputs. Outside the front door it is the `eqx.partition` + `lax.scan` loop, so the same model trains
without tide unchanged.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

try:
    import equinox as _eqx
except ImportError as e:  # pragma: no cover - equinox is an optional dependency
    raise ImportError("tide_jax.equinox needs equinox: pip install equinox (or tide-jax[equinox])") from e

from . import _models

__all__ = ["FSDP", "call_layers", "shard"]

HOOK = "tide_jax.equinox.call_layers"


def _classify(model):
    """[(path, leaf)], treedef, kinds ("param" | "state")."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(model)
    named = [(_models.path_str(kp), x) for kp, x in leaves]
    kinds = ["param" if _models.is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact) else "state" for _, x in named]
    return named, tree, kinds


def _layer_paths(model, layers) -> list[str]:
    items = _models.layer_items(layers, "tide_jax.equinox.shard", "layers")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        if not callable(item):
            raise TypeError(f"tide: tide_jax.equinox.shard: layers must be a path string or a function, got {type(item).__name__}")
        target = item(model)
        target_ids = {id(x) for x in jax.tree_util.tree_leaves(target) if _models.is_array(x)}
        paths = [_models.path_str(kp) for kp, x in jax.tree_util.tree_flatten_with_path(model)[0] if id(x) in target_ids]
        if not paths:
            raise ValueError("tide: tide_jax.equinox.shard: layers=<function> selects no arrays of the model")
        prefix = paths[0].split(".")
        for p in paths[1:]:
            parts = p.split(".")
            n = 0
            while n < min(len(prefix), len(parts)) and prefix[n] == parts[n]:
                n += 1
            prefix = prefix[:n]
        if not prefix:
            raise ValueError("tide: tide_jax.equinox.shard: layers=<function> selects arrays with no common path")
        out.append(".".join(prefix))
    return out


class FSDP(_models.FrontDoor):
    """The front door of one sharded Equinox model (`tide_jax.equinox.shard`)."""

    NAME = "tide_jax.equinox"

    def __init__(self, plan: _models.Plan, tree, kinds):
        super().__init__(plan)
        self.tree = tree
        self._kinds = kinds

    def _split(self, model, what: str):
        named, tree, kinds = _classify(model)
        if tree != self.tree:
            raise ValueError(
                f"tide: {what}: the model's structure differs from the one tide_jax.equinox.shard returned: "
                "pass that model (or one from eqx.apply_updates on it)"
            )
        pvals = [x for (_, x), k in zip(named, kinds) if k == "param"]
        svals = [x for (_, x), k in zip(named, kinds) if k == "state"]
        if len(pvals) != len(self.plan.params) or len(svals) != len(self.plan.state):
            raise ValueError(f"tide: {what}: the model's floating leaves are not those it was sharded with")
        return kinds, pvals, svals

    def _local(self, fn, kinds):
        tree = self.tree

        def local_fn(pvals, svals, args):
            ip, is_ = iter(pvals), iter(svals)
            model = jax.tree_util.tree_unflatten(tree, [next(ip) if k == "param" else next(is_) for k in kinds])
            return fn(model, *args), None

        return local_fn

    def _grads_tree(self, kinds, grads):
        it = iter(grads)
        return jax.tree_util.tree_unflatten(self.tree, [next(it) if k == "param" else None for k in kinds])

    def filter_value_and_grad(self, fn: Callable, *, has_aux: bool = False):
        """`eqx.filter_value_and_grad(fn)` under FSDP: `(model, *batch) -> (loss, grads)`
        (`((loss, aux), grads)` with has_aux). `fn(model, *batch)` returns the mean loss over its
        (local) batch; batch arguments are split on their first axis over the devices (per-example
        keys too; 0-d arrays replicated; arrays `fn` closes over are replicated, not split). The loss
        is averaged over the devices; aux: 0-d values averaged, arrays concatenated."""
        mode = "grad_aux" if has_aux else "grad"

        def wrapped(model, *args):
            kinds, pvals, svals = self._split(model, "filter_value_and_grad")
            out, grads, _ = self.plan.run(self._local(fn, kinds), pvals, svals, args, mode=mode, with_state=False)
            return out, self._grads_tree(kinds, grads)

        return wrapped

    def filter_grad(self, fn: Callable, *, has_aux: bool = False):
        """`eqx.filter_grad(fn)` under FSDP: `(model, *batch) -> grads` (`(grads, aux)` with has_aux)."""
        return self.grad_of(self.filter_value_and_grad(fn, has_aux=has_aux), has_aux)

    def apply(self, fn: Callable):
        """`(model, *batch) -> fn(model, *batch)` under FSDP, no gradient: 0-d outputs averaged over
        the devices, arrays concatenated along their first axis."""

        def wrapped(model, *args):
            kinds, pvals, svals = self._split(model, "apply")
            return self.plan.run(self._local(fn, kinds), pvals, svals, args, mode="apply", with_state=False)[0]

        return wrapped

    def unshard(self, tree):
        """Full (replicated) arrays from shards: the sharded model -> the full model; a tree shaped like
        its gradients (None at the non-floating leaves, e.g. `filter_value_and_grad`'s) -> full
        gradients."""
        _, t, kinds = _classify(tree)
        if t == self.tree:
            kinds, pvals, svals = self._split(tree, "unshard")
            full = iter(self.plan.unshard(pvals))
            it_s = iter(svals)
            return jax.tree_util.tree_unflatten(self.tree, [next(full) if k == "param" else next(it_s) for k in kinds])
        leaves = jax.tree_util.tree_leaves(tree)
        if len(leaves) != len(self.plan.params):
            raise ValueError("tide: FSDP.unshard: expected the sharded model or a tree shaped like its gradients")
        it = iter(self.plan.unshard(leaves))
        return jax.tree_util.tree_unflatten(
            self.tree, [next(it) if k == "param" else None for k in self._kinds])

    def shard(self, model):
        """A model of the same structure (full arrays) sharded with this front door's layouts."""
        named, tree, kinds = _classify(model)
        if tree != self.tree:
            raise ValueError("tide: FSDP.shard: the model's structure is not the one this front door was built for")
        pvals = [x for (_, x), k in zip(named, kinds) if k == "param"]
        for x, q in zip(pvals, self.plan.params):
            if _models.shape_of(x) != q.shape:
                raise ValueError(f"tide: FSDP.shard: {q.path} has shape {_models.shape_of(x)}, expected the full {q.shape}")
        sharded = iter(self.plan.shard(pvals))
        state = iter(self.plan.place_state([x for (_, x), k in zip(named, kinds) if k == "state"]))
        return jax.tree_util.tree_unflatten(tree, [next(sharded) if k == "param" else next(state) for k in kinds])


def shard(model, mesh, axis: str, *, layers, specs=None, dtype=None, remat=None, prefetch: int = 1,
          reshard_after_forward: bool = True, backend: str | None = None, batch_axes=None):
    """(the model with its floating arrays as fp32 FSDP shards over `axis` of `mesh`, its front door).

    layers: path of the stacked layers ("layers", "decoder.blocks"; several: a tuple; or a function
      `lambda m: m.layers`); the model must run them through `call_layers`.
    specs: how the floating arrays are split over the mesh's axes other than `axis`: a pytree of
      PartitionSpecs (None: not split) matching the model or a prefix of it (e.g.
      `eqx.tree_at(lambda m: m.layers.mlp.w1, jax.tree.map(lambda _: None, model), P(None, "tensor"))`);
      a stacked array's spec is one layer's, or the stack's when it has one entry per stacked
      dimension (its layer axis first and not split: `P(None, "expert", None, None)` for an (L, E, F,
      D) stack; a shorter spec is read as one layer's).
      The model's own code runs the psums a split needs (Megatron-style); tide shards dim 0 of each
      local block over `axis` (`tide_jax.layout`), and the batch is split over the axes no array is
      split over (`batch_axes`). Default: nothing split (pure FSDP).
    dtype: the dtype the floating arrays are gathered in (None: as stored, fp32, the model's numerics
      unchanged; jnp.bfloat16: the model computes in bf16, half the bytes moved, fp32 gradient sums).
    remat, prefetch, reshard_after_forward: `tide_jax.scan_layers`'s (remat=None: the one
      `call_layers` is given, default no recompute).
    backend: "tide" or "jax" (default: `tide_jax.get_backend()`).
    batch_axes: the mesh axes the batch is split over (default: every axis no array is split over);
      the shards are replicated over those other than `axis` (HSDP). They must include `axis`
      (every FSDP rank trains on its own part of the batch) and no axis a spec splits.
    """
    stacks = _layer_paths(model, layers)
    named, tree, kinds = _classify(model)
    params = [nx for nx, k in zip(named, kinds) if k == "param"]
    state = [nx for nx, k in zip(named, kinds) if k == "state"]
    leaf_specs = _models.specs_from_tree(specs, model, len(named), "tide_jax.equinox.shard")
    plan = _models.Plan(params, state, stacks, mesh, axis, dtype=dtype, remat=remat, prefetch=prefetch,
                        reshard_after_forward=reshard_after_forward, backend=backend, batch_axes=batch_axes,
                        hook=HOOK, what="tide_jax.equinox.shard",
                        specs=[sp for sp, k in zip(leaf_specs, kinds) if k == "param"])
    fsdp = FSDP(plan, tree, kinds)
    return fsdp.shard(model), fsdp


# ----------------------------------------------------------------------------------------------
# the hook
# ----------------------------------------------------------------------------------------------


def call_layers(layers, carry, *args, key=None, xs=None, fn: Callable | None = None, remat=None, **kwargs):
    """Runs the stacked layers `layers` (made with `eqx.filter_vmap`: every array with the layers on
    its first axis) on `carry`, one after the other:

        keys = jax.random.split(key, L)                     # when key is given
        for i, layer in enumerate(layers):
            carry = layer(carry, *args, key=keys[i], **kwargs)   # fn(layer, carry, *args, ...) with fn=
                                                                 # with xs: layer(carry, xs[i], *args, ...)

    Under `tide_jax.equinox.shard`'s front door: `tide_jax.scan_layers` over the layer shards.
    Elsewhere: `eqx.partition` + `lax.scan` (the Equinox idiom), so the model trains without tide
    unchanged. A layer's output carry is cast to the input carry's dtypes. `remat`: None, True, a
    `jax.checkpoint` policy or a name (`tide_jax.remat_policy`), in both cases."""
    call = fn or _models.default_call
    has_xs = xs is not None
    leaves, tree = jax.tree_util.tree_flatten(layers)
    found = _models.find_placeholders(leaves)
    if found is not None:
        ctx, sid = found
        _models.check_stack(ctx, sid, [x for x in leaves if isinstance(x, _models.Placeholder) or _models.is_float(x)], HOOK)
        num = ctx.plan.stacks[sid].num
    else:
        arrays = [x for x in leaves if _models.is_array(x)]
        if not arrays:
            raise ValueError(f"tide: {HOOK}: the stacked layers hold no arrays")
        num = _models.shape_of(arrays[0])[0]
    keys = None if key is None else jax.random.split(key, num)

    def run(layer, c, x_i, k_i, extra=(args, kwargs)):
        a, kw = extra
        kw = dict(kw)
        if keys is not None:
            kw["key"] = k_i
        out = call(layer, c, x_i, *a, **kw) if has_xs else call(layer, c, *a, **kw)
        return _models.cast_like(out, c, HOOK)

    state_idx = [j for j, x in enumerate(leaves) if _models.is_array(x) and not _models.is_float(x)]
    if found is not None:
        def layer_fn(p, c, x, extra):
            lv = list(leaves)
            for j, v in enumerate(leaves):
                if isinstance(v, _models.Placeholder):
                    lv[j] = p[v.path]
            for j, s in zip(state_idx, x["state"] if state_idx else ()):
                lv[j] = s
            return run(jax.tree_util.tree_unflatten(tree, lv), c, x.get("xs") if x else None,
                       x.get("key") if x else None, extra)

        xs_all = {}
        if state_idx:
            xs_all["state"] = [leaves[j] for j in state_idx]
        if has_xs:
            xs_all["xs"] = xs
        if keys is not None:
            xs_all["key"] = keys
        return ctx.scan(sid, layer_fn, carry, xs_all or None, (args, kwargs), remat)

    dyn, static = _eqx.partition(layers, _eqx.is_array)

    def body(c, x):
        d_i, x_i, k_i = x
        return run(_eqx.combine(d_i, static), c, x_i, k_i), None

    carry, _ = jax.lax.scan(_models.plain_checkpoint(body, remat), carry, (dyn, xs, keys))
    return carry
