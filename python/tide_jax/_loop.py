"""scan_layers: the FSDP layer loop with prefetched all-gathers and overlapped reduce-scatters.

    y = scan_layers(layer_fn, x, shards, lay, prefetch=1, remat=False, dtype=jnp.bfloat16)

is exactly `for i in range(L): x = layer_fn(gather_params(shards[i], lay, dtype), x)` and its
gradient, scheduled so the collectives run behind compute (docs/design.md "The layer loop"):

forward, layer i:   done(gather i) -> start(gather i+prefetch) -> [barrier] -> layer_fn -> [barrier]
backward, layer i:  done(gather i) -> start(gather i-prefetch) -> [barrier] -> vjp(layer_fn)
                    -> start(reduce-scatter of layer i's grads) -> [barrier] -> done(RS of layer i+1)

The barriers (`ordered`, i.e. `jax.lax.optimization_barrier`) pin the order: a start is issued
before the layer's compute begins, a done only after the compute that should hide it. The steady
state runs in a `lax.scan` (one HLO body for any L); the first and last `prefetch` layers are
unrolled, so no gather is ever started without its done. On the "jax" backend the same loop runs
the pure-JAX collectives without barriers, leaving their scheduling to XLA.

Memory: the forward saves each layer's input x (L of them) and, with remat=False, each layer's
gathered parameters (L full layers in `dtype`); remat=True re-gathers them in the backward pass
instead. The layer's internals are recomputed in the backward pass (per-layer activation
checkpointing). In flight at once: `prefetch` gathers and one reduce-scatter.

Values `layer_fn` closes over (e.g. a mask, rotary tables, shared weights) are hoisted with
`jax.closure_convert` and differentiated too (their cotangents summed over layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _ops
from ._layout import Layout

__all__ = ["scan_layers"]


def _check_stacked(shards, lay: Layout) -> tuple[list, int]:
    leaves, treedef = jax.tree_util.tree_flatten(shards)
    if treedef != lay.treedef:
        raise ValueError(
            f"tide: scan_layers: the shards do not match the layer layout's pytree structure: got "
            f"{treedef}, the layout has {lay.treedef}"
        )
    num = None
    for p, x in zip(lay.params, leaves):
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) < 1 or shape[1:] != p.shard_shape:
            hint = ""
            if shape[1:] == p.global_shape:
                hint = " (the global stacked shape: call this inside shard_map with in_specs=lay.stacked_spec)"
            raise ValueError(
                f"tide: scan_layers: {p.describe()}: local stacked shard has shape {shape}, expected "
                f"(L, *{p.shard_shape}) for {lay.world} ranks of axis {lay.axis!r}{hint}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"tide: scan_layers: {p.describe()}: shard dtype {np.dtype(x.dtype).name} is not a "
                "floating type; only floating parameters can be differentiated"
            )
        if num is None:
            num = shape[0]
        elif shape[0] != num:
            raise ValueError(f"tide: scan_layers: {p.describe()} has {shape[0]} layers, earlier leaves have {num}")
    if not num:
        raise ValueError("tide: scan_layers: the stacked shards have no layers (L = 0)")
    return leaves, int(num)


def scan_layers(layer_fn, x, shards, lay: Layout, *, prefetch: int = 1, remat: bool = False,
                dtype=jnp.bfloat16, backend: str | None = None, unroll: bool = False):
    """Runs `layer_fn(params_i, x)` for the L layers of `shards` with FSDP collectives overlapped.

    `lay` is the layout of ONE layer's parameters; `shards` that pytree with a leading layer axis on
    every leaf, `(L, shard_rows, *rest)` inside shard_map (globally `(L, P * shard_rows, *rest)`:
    `lay.shard_stacked`, `lay.stacked_spec`). `layer_fn(params, x) -> x` (same shape and dtype of x)
    gets one layer's full parameters cast to `dtype`. Gradients reach `shards` as fp32-accumulated
    reduce-scatters cast to the shards' dtype, and `x` and whatever `layer_fn` closes over as usual.
    `prefetch`: layers gathered ahead (0: gather right before use); `remat`: re-gather in the
    backward pass instead of keeping the gathered parameters; `unroll`: a Python loop instead of
    `lax.scan` (a larger program, but nothing carried between iterations for XLA to copy).
    """
    _ops._check_context(lay, "scan_layers")
    if not isinstance(prefetch, (int, np.integer)) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"tide: scan_layers: prefetch must be an int >= 0, got {prefetch!r}")
    leaves, num = _check_stacked(shards, lay)
    backend = backend or _ops.get_backend()
    if backend not in _ops.BACKENDS:
        raise ValueError(f"tide: unknown backend {backend!r}: expected one of {_ops.BACKENDS}")
    shard_dtypes = [np.dtype(s.dtype) for s in leaves]
    param_dtypes = [np.dtype(dtype) if dtype is not None else d for d in shard_dtypes]

    # HSDP (as gather_params): mesh axes the shards are replicated on; the fp32 gradient shards are
    # summed over them, the gathered parameters typed varying over them.
    shard_vma = frozenset().union(*(_compat.vma_of(s) for s in leaves))
    replica_axes = ()
    if shard_vma:
        manual = _compat.manual_axes(_compat.enclosing_mesh())
        replica_axes = tuple(sorted(manual - shard_vma - {lay.axis}))
    ct_axes = sorted(shard_vma | set(replica_axes) | {lay.axis}) if shard_vma else []

    # Example parameters typed as the gathered ones will be (varying over the axis, the shards'
    # axes and the replica axes), so the converted function needs no casts of varying-ness.
    p_vma = sorted(shard_vma | set(replica_axes) | {lay.axis})
    example = jax.tree_util.tree_unflatten(
        lay.treedef,
        [_compat.mark_varying(jnp.zeros(p.shape, d), p_vma) for p, d in zip(lay.params, param_dtypes)],
    )
    converted, consts = jax.closure_convert(layer_fn, example, x)

    def apply(p_leaves, x, consts):
        return converted(jax.tree_util.tree_unflatten(lay.treedef, p_leaves), x, *consts)

    use_barriers = backend == "tide"

    def order(*xs):
        """`ordered` over the non-empty arguments (the tide backend only)."""
        if not use_barriers:
            return xs
        flat, tree = jax.tree_util.tree_flatten(xs)
        if not flat:
            return xs
        return jax.tree_util.tree_unflatten(tree, list(jax.lax.optimization_barrier(tuple(flat))))

    def layer(stacked, i):
        return [jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False) for s in stacked]

    def gather_start(stacked, i):
        cast = [_ops._maybe_cast(s, d) for s, d in zip(layer(stacked, i), param_dtypes)]
        return _ops._start("all_gather", cast, lay, backend)

    def gather_done(h):
        outs = _ops._done(h, "all_gather")
        if replica_axes:
            outs = [_compat.mark_varying(o, list(replica_axes)) for o in outs]
        return outs

    def scatter_start(dp):
        if ct_axes:
            dp = [_compat.mark_varying(t, ct_axes) for t in dp]
        return _ops._start("reduce_scatter", list(dp), lay, backend)

    def scatter_done(h):
        outs = _ops._done(h, "reduce_scatter")
        if replica_axes:
            outs = [jax.lax.psum(o, replica_axes) for o in outs]
        outs = [o if o.dtype == d else o.astype(d) for o, d in zip(outs, shard_dtypes)]
        if shard_vma:
            outs = [_compat.mark_varying(o, sorted(shard_vma)) for o in outs]
        return outs

    k = min(prefetch, num)

    def gather_now(stacked, i):
        """Start and done back to back: a layer nothing is left to overlap with."""
        return gather_done(gather_start(stacked, i))

    def scan_or_unroll(body, carry, idx):
        """`lax.scan` over `idx` (the steady state), or a Python loop when `unroll` is set."""
        if len(idx) == 0:
            return carry, None
        if unroll:
            ys = []
            for i in idx:
                carry, y = body(carry, i)
                ys.append(y)
            return carry, jax.tree.map(lambda *t: jnp.stack(t), *ys)
        return jax.lax.scan(body, carry, jnp.asarray(idx))

    # ----- forward -----
    # A start and its done are always in the same iteration (a handle never crosses a loop
    # boundary, where XLA may copy it while tide still writes it); what is carried are finished
    # values: the gathered parameters of the next `k` layers.
    def forward(x, stacked, consts, save: bool):
        def step(x, ps, i, ahead):
            p, ps = ps[0], tuple(ps[1:])
            if ahead is None:
                y = apply(p, x, consts)
                return y, ps, (x, p)
            h = gather_start(stacked, ahead)
            h, x_in, p = order(h, x, p)
            y = apply(p, x_in, consts)
            h, y = order(h, y)
            return y, ps + (gather_done(h),), (x_in, p)

        if k == 0:
            ps = ()
            def step0(x, ps, i, ahead):
                p = gather_now(stacked, i)
                return apply(p, x, consts), ps, (x, p)
            run_step, steady = step0, list(range(num))
        else:
            ps = tuple(gather_now(stacked, j) for j in range(k))
            run_step, steady = step, list(range(num - k))

        def body(carry, i):
            x, ps = carry
            y, ps, (x_in, p) = run_step(x, ps, i, i + k if k else None)
            return (y, ps), ((x_in, p if not remat else ()) if save else ())

        (x, ps), saved = scan_or_unroll(body, (x, ps), steady)
        xs_saved, ps_saved = [], []
        if saved is not None and save:
            xs_saved.append(saved[0])
            if not remat:
                ps_saved.append(saved[1])
        for i in range(len(steady), num):
            x, ps, (x_in, p) = run_step(x, ps, i, None)
            if save:
                xs_saved.append(x_in[None])
                if not remat:
                    ps_saved.append([t[None] for t in p])
        if not save:
            return x, None, None
        xs_all = jnp.concatenate(xs_saved, axis=0)
        ps_all = None
        if not remat:
            ps_all = [jnp.concatenate([c[j] for c in ps_saved], axis=0) for j in range(len(leaves))]
        return x, xs_all, ps_all

    # ----- backward -----
    # Step j handles layer i = L-1-j: the reduce-scatter of layer i+1's gradients (computed in
    # step j-1 and carried as a finished value) and, with remat, the gather of layer i-k run while
    # layer i's vjp computes.
    def backward(res, dy):
        xs_all, ps_all, stacked, consts = res
        kg = k if remat else 0

        def params_of(ps, i):
            if not remat:
                return layer(ps_all, i), ps
            if kg == 0:
                return gather_now(stacked, i), ps
            return ps[0], tuple(ps[1:])

        def step(dx, ps, dp_prev, dcs, i, ahead):
            p, ps = params_of(ps, i)
            x_in = jax.lax.dynamic_index_in_dim(xs_all, i, 0, keepdims=False)
            hr = scatter_start(dp_prev) if dp_prev is not None else None
            hg = gather_start(stacked, ahead) if ahead is not None else None
            hr, hg, p, x_in, dx = order(hr, hg, p, x_in, dx)
            _, vjp = jax.vjp(apply, p, x_in, consts)
            dp, dx, dc = vjp(dx)
            dcs = jax.tree.map(jnp.add, dcs, dc)
            hr, hg, dp, dx = order(hr, hg, dp, dx)
            grads = scatter_done(hr) if hr is not None else None
            if hg is not None:
                ps = ps + (gather_done(hg),)
            return dx, ps, dp, dcs, grads

        def ahead_of(i):
            return i - kg if kg and i - kg >= 0 else None

        dcs = jax.tree.map(jnp.zeros_like, consts)
        ps = tuple(gather_now(stacked, num - 1 - j) for j in range(kg))
        # j = 0 (layer L-1): no later layer's gradients to reduce-scatter yet.
        dx, ps, dp, dcs, _ = step(dy, ps, None, dcs, num - 1, ahead_of(num - 1))
        steady_end = num - kg if kg else num  # steps j in [1, steady_end) have a layer to prefetch

        def body(carry, j):
            dx, ps, dp, dcs = carry
            i = num - 1 - j
            dx, ps, dp, dcs, g = step(dx, ps, dp, dcs, i, i - kg if kg else None)
            return (dx, ps, dp, dcs), g

        (dx, ps, dp, dcs), g = scan_or_unroll(body, (dx, ps, dp, dcs), list(range(1, max(steady_end, 1))))
        grads_rev = [] if g is None else [g]  # layers L-1, L-2, ..., 0
        for j in range(max(steady_end, 1), num):
            dx, ps, dp, dcs, g = step(dx, ps, dp, dcs, num - 1 - j, None)
            grads_rev.append([t[None] for t in g])
        grads_rev.append([t[None] for t in scatter_done(scatter_start(dp))])
        dstacked = [
            jnp.flip(jnp.concatenate([c[j] for c in grads_rev], axis=0), axis=0)
            for j in range(len(leaves))
        ]
        return dx, dstacked, dcs

    @jax.custom_vjp
    def run(x, stacked, consts):
        return forward(x, stacked, consts, save=False)[0]

    def run_fwd(x, stacked, consts):
        y, xs_all, ps_all = forward(x, stacked, consts, save=True)
        return y, (xs_all, ps_all, stacked, consts)

    run.defvjp(run_fwd, backward)
    return run(x, leaves, list(consts))
