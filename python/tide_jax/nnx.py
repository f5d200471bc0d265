"""tide's FSDP for Flax NNX models: shard a model in place, train it with its own `__call__`.

    from tide_jax import nnx as tnnx

    class Decoder(nnx.Module):                      # the model, as NNX users write it, except one line:
        def __call__(self, tokens):
            x = self.embed(tokens)
            x = tnnx.call_layers(self.blocks, x)    # was: nnx.scan(...)(x, self.blocks)
            return self.head(self.norm(x))

    model = Decoder(cfg, rngs=nnx.Rngs(0))
    fsdp = tnnx.shard(model, mesh, "fsdp", layers="blocks")    # the Params become fp32 shards, in place
    optimizer = nnx.Optimizer(model, optax.adamw(3e-4), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        loss, grads = fsdp.value_and_grad(loss_fn)(model, tokens, targets)   # was: nnx.value_and_grad
        optimizer.update(model, grads)
        return loss

`shard` finds the stacked layers by their path (`layers="blocks"`: a module made with
`nnx.split_rngs` + `nnx.vmap`, every leaf with the layers on its first axis), builds one layer's
layout and one for the other parameters, and replaces every `nnx.Param` value by its fp32 FSDP shard
(`(P * shard_rows, *rest)`, stacked `(L, P * shard_rows, *rest)`, sharded over `axis`). On a mesh
with tensor or expert axes, `shard(..., rules=[("mlp", "tensor"), ...])` reads the Params' own
annotations (`nnx.with_partitioning`) through logical axis rules and FSDP-shards each local block
(`tide_jax.layout(specs=...)`); the model's code runs its own psums (Megatron-style).

`fsdp.value_and_grad(loss_fn)(model, *batch)` runs `loss_fn(model, *batch)` on every device under
`shard_map`: the batch arguments split on their first axis, the model rebuilt with the other
parameters gathered (in `dtype`: as stored by default, or bf16) and the stacked layers run by
`tide_jax.scan_layers` when the model calls `call_layers(self.blocks, ...)` (the user's own layer
module, one layer's gathered parameters merged into it; the layer i+1 gather behind layer i's
compute, the gradients reduce-scattered in fp32). It returns the loss averaged over the devices
and the gradient of that mean as an `nnx.State` of the shards: what `nnx.Optimizer.update` (or
optax on `nnx.state(model, nnx.Param)`) takes; the optimizer runs on the shards outside the
shard_map, so elementwise updates, global-norm clipping and schedules work unchanged.

Non-parameter state (any `nnx.Variable` that is not an `nnx.Param`: `Dropout`'s `RngKey` and
`RngCount`, `BatchStat`, integer or boolean buffers) is passed through unsharded: replicated on
every device, never differentiated, and updated the way NNX updates it (an RNG count advances every
step; per-layer state of the stacked layers is carried through the layer loop). A state the
forward changes differently on each device (batch statistics of the local batch) is refused naming
it. An `nnx.Param` that is not floating is refused naming its path and dtype.

`call_layers(blocks, carry, *args, **kwargs)` is the one change to a model: each layer runs
`carry = layer(carry, *args, **kwargs)` (`fn=` for another call, `xs=` for per-layer inputs stacked
on the layer axis). Outside the front door it is `nnx.scan` over the layers (a `lax.scan` over
the split state, state updates written back), so the same model trains without tide unchanged.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

try:
    from flax import nnx as _nnx
except ImportError as e:  # pragma: no cover - flax is an optional dependency
    raise ImportError("tide_jax.nnx needs flax: pip install flax (or tide-jax[nnx])") from e

from . import _models

__all__ = ["FSDP", "call_layers", "shard"]

HOOK = "tide_jax.nnx.call_layers"


def _flat(state):
    """[(dotted path, value)], treedef of an nnx.State (Variables' values as leaves)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(state)
    return [(_models.path_str(kp, drop_value=True), x) for kp, x in leaves], tree


def _layer_paths(model, layers) -> list[str]:
    items = _models.layer_items(layers, "tide_jax.nnx.shard", "blocks")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        if callable(item):
            target = item(model)
            for path, node in _nnx.iter_graph(model):
                if node is target:
                    out.append(".".join(str(k) for k in path))
                    break
            else:
                raise ValueError("tide: tide_jax.nnx.shard: layers=<function> returned no submodule of the model")
            continue
        raise TypeError(f"tide: tide_jax.nnx.shard: layers must be a path string or a function, got {type(item).__name__}")
    return out


class FSDP(_models.FrontDoor):
    """The front door of one sharded NNX model (`tide_jax.nnx.shard`). Pure Python: close over it in
    a jitted step."""

    NAME = "tide_jax.nnx"

    def __init__(self, plan: _models.Plan, filt):
        super().__init__(plan)
        self.filter = filt
        plan.nnx_filter = filt

    def _repr_extra(self) -> str:
        return f", gather dtype {jnp.dtype(self.plan.dtype).name if self.plan.dtype else 'as stored'}"

    # ----- the model's leaves -----
    def _split(self, model, what: str):
        if not isinstance(model, _nnx.Module):
            raise TypeError(f"tide: {what}: expected the nnx.Module sharded by tide_jax.nnx.shard, got {type(model).__name__}")
        gd, pstate, ostate = _nnx.split(model, self.filter, ...)
        p, p_tree = _flat(pstate)
        o, o_tree = _flat(ostate)
        have = [path for path, _ in p]
        want = [q.path for q in self.plan.params]
        if have != want:
            extra = sorted(set(have) - set(want))[:3]
            missing = sorted(set(want) - set(have))[:3]
            raise ValueError(
                f"tide: {what}: the model's parameters are not those it was sharded with (new: {extra}, "
                f"missing: {missing}): pass the model given to tide_jax.nnx.shard"
            )
        if [path for path, _ in o] != [s.path for s in self.plan.state]:
            raise ValueError(
                f"tide: {what}: the model's non-parameter state changed structure since tide_jax.nnx.shard "
                "(variables created or removed, e.g. by sow): the front door keeps the state it was sharded with"
            )
        return gd, [x for _, x in p], p_tree, [x for _, x in o], o_tree

    def _local(self, fn, gd, p_tree, o_tree):
        filt = self.filter
        paths = [s.path for s in self.plan.state]

        def local_fn(pvals, ovals, args):
            model = _nnx.merge(gd, jax.tree_util.tree_unflatten(p_tree, pvals),
                               jax.tree_util.tree_unflatten(o_tree, ovals))
            out = fn(model, *args)
            _, _, new = _nnx.split(model, filt, ...)
            by_path = dict(_flat(new)[0])
            return out, [by_path.get(path, old) for path, old in zip(paths, ovals)]

        return local_fn

    def _run(self, fn, model, args, mode: str, what: str):
        gd, pvals, p_tree, ovals, o_tree = self._split(model, what)
        out, grads, new_state = self.plan.run(self._local(fn, gd, p_tree, o_tree), pvals, ovals, args,
                                              mode=mode, with_state=True)
        if new_state is not None and ovals:
            _nnx.update(model, jax.tree_util.tree_unflatten(o_tree, new_state))
        grads = None if grads is None else jax.tree_util.tree_unflatten(p_tree, grads)
        return out, grads

    # ----- training and evaluation -----
    def value_and_grad(self, fn: Callable, *, has_aux: bool = False):
        """`nnx.value_and_grad(fn)` under FSDP: `(model, *batch) -> (loss, grads)` (`((loss, aux), grads)`
        with has_aux). `fn(model, *batch)` returns the mean loss over its (local) batch; batch arguments
        are split on their first axis over the devices (0-d arrays replicated, non-arrays static;
        arrays `fn` closes over are replicated, not split: pass the batch as arguments). The loss is
        averaged over the devices; `grads` is an nnx.State of `nnx.Param` shards; aux: 0-d values
        averaged over the devices, arrays concatenated along their first axis."""
        mode = "grad_aux" if has_aux else "grad"

        def wrapped(model, *args):
            return self._run(fn, model, args, mode, "value_and_grad")

        return wrapped

    def grad(self, fn: Callable, *, has_aux: bool = False):
        """`nnx.grad(fn)` under FSDP: `(model, *batch) -> grads` (`(grads, aux)` with has_aux)."""
        return self.grad_of(self.value_and_grad(fn, has_aux=has_aux), has_aux)

    def apply(self, fn: Callable):
        """`(model, *batch) -> fn(model, *batch)` under FSDP, no gradient (evaluation): outputs' 0-d
        values averaged over the devices, arrays concatenated along their first axis (per-example
        values: logits, losses)."""

        def wrapped(model, *args):
            return self._run(fn, model, args, "apply", "apply")[0]

        return wrapped

    # ----- moving between sharded and full -----
    def unshard(self, tree):
        """Full (replicated) arrays from shards: a sharded model gets its Params back, in place (and is
        returned); an nnx.State shaped like the Params (gradients, optimizer moments) is returned
        with full arrays."""
        if isinstance(tree, _nnx.Module):
            _, pvals, p_tree, _, _ = self._split(tree, "unshard")
            _nnx.update(tree, jax.tree_util.tree_unflatten(p_tree, self.plan.unshard(pvals)))
            return tree
        leaves, t = _flat(tree)
        if [path for path, _ in leaves] != [q.path for q in self.plan.params]:
            raise ValueError("tide: FSDP.unshard: expected the sharded model or a State shaped like its Params")
        return jax.tree_util.tree_unflatten(t, self.plan.unshard([x for _, x in leaves]))

    def shard(self, model):
        """Shards a model of the same structure (e.g. `unshard`'s result) in place; returns it."""
        gd, pstate, ostate = _nnx.split(model, self.filter, ...)
        p, p_tree = _flat(pstate)
        if [path for path, _ in p] != [q.path for q in self.plan.params]:
            raise ValueError("tide: FSDP.shard: the model's parameters are not those this front door was built for")
        for (path, x), q in zip(p, self.plan.params):
            if _models.shape_of(x) != q.shape:
                raise ValueError(f"tide: FSDP.shard: {path} has shape {_models.shape_of(x)}, expected the full {q.shape}")
        _nnx.update(model, jax.tree_util.tree_unflatten(p_tree, self.plan.shard([x for _, x in p])))
        o, o_tree = _flat(ostate)
        if o:
            _nnx.update(model, jax.tree_util.tree_unflatten(o_tree, self.plan.place_state([x for _, x in o])))
        return model


def shard(model, mesh, axis: str, *, layers, params=_nnx.Param, rules=None, dtype=None, remat=None,
          prefetch: int = 1, reshard_after_forward: bool = True, backend: str | None = None,
          batch_axes=None) -> FSDP:
    """Shards `model`'s parameters over `axis` of `mesh` in place (FSDP2's dim-0 rule, fp32 master
    shards) and returns the front door that trains it.

    layers: path of the stacked layers ("blocks", "decoder.layers"; several: a tuple; or a function
      `lambda m: m.blocks`); the model must run them through `call_layers`.
    params: the filter of the trained variables (nnx.Param); every other variable is state.
    rules: logical axis rules, `[(logical name, mesh axis | (axes...) | None), ...]` (MaxText's,
      `nnx.logical_axis_rules`'), added to those of an enclosing `nnx.logical_axis_rules` context:
      how the Params' own annotations (`nnx.with_partitioning`) map to the mesh's axes. A name no rule
      maps stands for the mesh axis of that name (refused when it is none, if any rule is given;
      without rules such names split nothing). Annotations that map to `axis` are left to tide
      (it shards dim 0 of each local block over `axis` itself); the others split the parameters
      (tensor, expert: Megatron-style code runs its own psums), and the batch is split over the mesh
      axes no parameter is split over (`batch_axes`).
    dtype: the dtype the parameters are gathered in (None: as stored, fp32, the model's numerics
      unchanged). jnp.bfloat16 for a model that computes in bf16 (`nnx.Linear(..., dtype=jnp.bfloat16)`):
      the same results at half the bytes, gradients reduce-scattered from bf16 with fp32 sums.
    remat, prefetch, reshard_after_forward: `tide_jax.scan_layers`'s (remat=None: the one
      `call_layers` is given, default no recompute).
    backend: "tide" or "jax" (default: `tide_jax.get_backend()`).
    batch_axes: the mesh axes the batch is split over (default: every axis no parameter is split
      over); the shards are replicated over those other than `axis` (HSDP). They must include `axis`
      (every FSDP rank trains on its own part of the batch) and no axis a spec splits.
    """
    if not isinstance(model, _nnx.Module):
        raise TypeError(f"tide: tide_jax.nnx.shard: expected an nnx.Module, got {type(model).__name__}")
    stacks = _layer_paths(model, layers)
    gd, pstate, ostate = _nnx.split(model, params, ...)
    p, _ = _flat(pstate)
    o, _ = _flat(ostate)
    specs = _mesh_specs(pstate, p, rules, mesh, axis)
    plan = _models.Plan(p, o, stacks, mesh, axis, dtype=dtype, remat=remat, prefetch=prefetch,
                        reshard_after_forward=reshard_after_forward, backend=backend, batch_axes=batch_axes,
                        hook=HOOK, what="tide_jax.nnx.shard", specs=specs)
    fsdp = FSDP(plan, params)
    fsdp.shard(model)
    return fsdp


def _mesh_specs(pstate, params: list, rules, mesh, axis: str) -> list:
    """Per parameter, its annotation (`nnx.get_partition_spec`) mapped to mesh axes by the logical
    axis rules (flax's context rules, then `rules`), `axis` left out. With rules, refuses (naming the
    parameter) a name that maps to no axis of the mesh; with none, such names split nothing (models
    annotated for another setup train as before)."""
    from flax.core import spmd

    try:
        rules = dict(spmd.composite_rules(spmd.get_logical_axis_rules(), tuple(rules or ())))
    except (TypeError, ValueError) as e:
        raise ValueError(f"tide: tide_jax.nnx.shard: rules: {e}") from None
    strict = bool(rules)  # without any rule, names that are not mesh axes split nothing (as before rules)
    logical, _ = _flat(_nnx.get_partition_spec(pstate))
    by_path = dict(logical)
    out = []
    for path, _ in params:
        spec = by_path.get(path)
        if not isinstance(spec, P) or not tuple(spec):
            out.append(None)
            continue
        dims = []
        for entry in tuple(spec):
            names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
            axes = []
            for name in names:
                target = rules.get(name, name)
                for a in target if isinstance(target, tuple) else (() if target is None else (target,)):
                    if a not in mesh.axis_names and not strict:
                        continue
                    if a not in mesh.axis_names:
                        raise ValueError(
                            f"tide: tide_jax.nnx.shard: parameter {path}: its annotation {spec} names {name!r}, "
                            f"which {'the rules map to ' + repr(a) + ', not' if name in rules else 'no rule maps to'} "
                            f"an axis of the mesh (axes {tuple(mesh.axis_names)}): pass rules=[({name!r}, <mesh "
                            "axis, or None for not split>), ...]")
                    if a != axis:  # tide shards dim 0 of each local block over `axis` by its own rule
                        axes.append(a)
            dims.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        out.append(P(*dims))
    return out


# ----------------------------------------------------------------------------------------------
# the hook
# ----------------------------------------------------------------------------------------------


def call_layers(blocks, carry, *args, xs=None, fn: Callable | None = None, remat=None, **kwargs):
    """Runs the stacked layers `blocks` (a module whose leaves have the layers on their first axis,
    made with `nnx.split_rngs` + `nnx.vmap`) on `carry`, one after the other:

        for each layer:  carry = layer(carry, *args, **kwargs)       # fn(layer, carry, *args, **kwargs)
                         (with xs: layer(carry, xs_i, *args, **kwargs))

    Under `tide_jax.nnx.shard`'s front door: `tide_jax.scan_layers` over the layer shards (the
    gathers prefetched, the reduce-scatters overlapped). Elsewhere: `nnx.scan`'s loop (a `lax.scan`
    over the layers' state, its updates written back), so the model trains without tide unchanged.
    The layers' state (RNG streams, counters) is per layer and updated either way. A layer's output
    carry is cast to the input carry's dtypes. `remat`: None, True, a `jax.checkpoint` policy or a
    name (`tide_jax.remat_policy`), in both cases."""
    if not isinstance(blocks, _nnx.Module):
        raise TypeError(f"tide: {HOOK}: expected the stacked layers (an nnx.Module), got {type(blocks).__name__}")
    call = fn or _models.default_call
    has_xs = xs is not None

    def run(layer, c, x, extra=(args, kwargs)):
        a, kw = extra
        out = call(layer, c, x, *a, **kw) if has_xs else call(layer, c, *a, **kw)
        return _models.cast_like(out, c, HOOK)

    found = _models.find_placeholders(jax.tree_util.tree_leaves(_nnx.state(blocks)))
    if found is None:
        return _plain_layers(blocks, carry, xs, run, remat)
    ctx, sid = found
    filt = ctx.plan.nnx_filter
    gd, pstate, ostate = _nnx.split(blocks, filt, ...)
    ph, p_tree = jax.tree_util.tree_flatten(pstate)
    _models.check_stack(ctx, sid, ph, HOOK)
    o_leaves, o_tree = jax.tree_util.tree_flatten(ostate)
    arr = [j for j, v in enumerate(o_leaves) if _models.is_array(v)]
    num = ctx.plan.stacks[sid].num

    def layer_fn(p, c, x, extra):
        if arr:
            c, st = c
        ov = list(o_leaves)
        if arr:
            i = x["i"]
            for j, s in zip(arr, st):
                ov[j] = jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False)
        layer = _nnx.merge(gd, jax.tree_util.tree_unflatten(p_tree, [p[q.path] for q in ph]),
                           jax.tree_util.tree_unflatten(o_tree, ov))
        out = run(layer, c, x["xs"] if has_xs else None, extra)
        if not arr:
            return out
        _, _, new = _nnx.split(layer, filt, ...)
        new_leaves, new_tree = jax.tree_util.tree_flatten(new)
        if new_tree != o_tree:
            raise ValueError(f"tide: {HOOK}: a layer changed its state's structure (variables created, e.g. by sow)")
        st = [jax.lax.dynamic_update_index_in_dim(s, new_leaves[j], i, 0) for j, s in zip(arr, st)]
        return out, st

    xs_all = {}
    if arr:
        xs_all["i"] = jnp.arange(num, dtype=jnp.int32)
    if has_xs:
        xs_all["xs"] = xs
    res = ctx.scan(sid, layer_fn, (carry, [o_leaves[j] for j in arr]) if arr else carry, xs_all or None,
                   (args, kwargs), remat)
    if not arr:
        return res
    carry, st = res
    ov = list(o_leaves)
    for j, s in zip(arr, st):
        ov[j] = s
    _nnx.update(blocks, jax.tree_util.tree_unflatten(o_tree, ov))
    return carry


def _plain_layers(blocks, carry, xs, run, remat):
    """`nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)` over `blocks`, written out."""
    gd, state = _nnx.split(blocks)
    leaves, tree = jax.tree_util.tree_flatten(state)
    arr = [j for j, v in enumerate(leaves) if _models.is_array(v)]
    if not arr:
        raise ValueError(f"tide: {HOOK}: the stacked layers hold no arrays")

    def body(c, x):
        arrays, x_i = x
        lv = list(leaves)
        for j, a in zip(arr, arrays):
            lv[j] = a
        layer = _nnx.merge(gd, jax.tree_util.tree_unflatten(tree, lv))
        out = run(layer, c, x_i)
        new_leaves, new_tree = jax.tree_util.tree_flatten(_nnx.state(layer))
        if new_tree != tree:
            raise ValueError(f"tide: {HOOK}: a layer changed its state's structure (variables created, e.g. by sow)")
        return out, [new_leaves[j] for j in arr]

    carry, new = jax.lax.scan(_models.plain_checkpoint(body, remat), carry, ([leaves[j] for j in arr], xs))
    lv = list(leaves)
    for j, a in zip(arr, new):
        lv[j] = a
    _nnx.update(blocks, jax.tree_util.tree_unflatten(tree, lv))
    return carry
