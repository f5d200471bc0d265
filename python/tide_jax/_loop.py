"""scan_layers: the FSDP layer loop, with prefetched all-gathers, overlapped reduce-scatters and the
activation and parameter memory the caller chooses.

    out = scan_layers(layer_fn, carry, shards, lay, xs=None, prefetch=1, remat=None,
                      reshard_after_forward=True, dtype=jnp.bfloat16, prologue=None, epilogue=None)

is exactly (values and gradients)

    carry, aux = prologue(inputs)                   # optional: (fn, shards, layout) or fn
    for i in range(L):
        p = gather_params(shards[i], lay, dtype)
        carry = jax.checkpoint(layer_fn, policy=...)(p, carry[, xs[i]])   # remat=None: no checkpoint
    out = epilogue(carry, aux)                      # optional

scheduled so the collectives run behind compute (docs/design.md "The layer loop"). The contract:

- Activations (`remat`): None/False keeps what autodiff keeps (no recompute: each layer's forward
  residuals are saved by the forward scan and consumed by the backward); True recomputes the layer
  in the backward pass (`jax.checkpoint`); a `jax.checkpoint` policy (`jax.checkpoint_policies.*`,
  `save_only_these_names(...)` with `checkpoint_name` inside `layer_fn`, ...) saves what it names.
  `remat_policy(name)` maps the names the examples use ("none", "full", "dots", ...) to these.
- Parameters (`reshard_after_forward`, FSDP2's name and default): True frees each layer's gathered
  parameters after its forward and re-gathers them (prefetched) in the backward; every residual
  that is a function of the gathered parameters alone (a transpose, a cast, a broadcast of a norm
  scale) is recomputed from the re-gathered ones instead of saved, so no gathered layer outlives its
  use. The last `prefetch` layers stay gathered (the backward needs them first). False keeps every
  layer's gathered parameters (L layers in `dtype`) from the forward to the backward.
- Memory, per device: shards (fp32) + in flight `prefetch` gathered layers and one reduce-scatter,
  plus the saved residuals: with remat=True each layer's input carry; with None everything autodiff
  saves except parameter-only values; with a policy what it saves; plus, with reshard=False, every
  gathered layer.
- `carry` is any pytree (shapes and dtypes unchanged by `layer_fn`); `xs` a pytree whose leaves have
  the layer axis first (per-layer keys, masks): `layer_fn(params, carry, xs_i)`. Non-float leaves
  (PRNG keys, counters) pass through and get no gradient.
- `prologue` / `epilogue` (e.g. the embedding lookup / the final norm and head) run inside the same
  schedule, so the loop's edges are hidden: the first `prefetch` layer gathers run behind the
  prologue (after its own gather), the epilogue's gather behind the last layer, the epilogue's
  reduce-scatter behind the last layer's backward and the first layer's reduce-scatter behind the
  prologue's backward. `prologue=(fn, shards, layout)` gathers `shards` (a group of its own) and calls
  `fn(params, inputs) -> (carry, aux)`; a plain `prologue=fn` is `fn(inputs) -> (carry, aux)`.
  `epilogue=(fn, shards, layout)`: `fn(params, carry, aux) -> out`; plain: `fn(carry, aux) -> out`.
  `aux` carries what both ends share (a tied embedding table); None when there is no prologue.

Schedule (forward, layer i; backward, layer i; `[b]` = `ordered` barrier, tide backend only):
    forward:  start G(i+k) [b] layer i [b] done G(i+k)              (k = prefetch, G = all-gather)
    backward: start RS(i+1), start G(i-k) [b] backward of layer i [b] done RS(i+1), done G(i-k)
The steady state runs in a `lax.scan` (one HLO body for any L); steps without a prefetch or a
reduce-scatter are unrolled around it (`unroll=True`: everything in Python). A start and its done
are always in one iteration (a handle never crosses a loop boundary); what is carried are finished
values. Gradients of the stacked shards are written in place into one (L, ...) buffer per leaf: on
the native backend the reduce-scatter itself writes slice i, the index read on the device
([Note: reduce-scatter into slices] in `_native`; TIDE_RS_INTO=0: a separate result, then an update).
At world size 1 the collectives are local identities (no native call; `_native`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _native, _ops, _settings
from ._layout import Layout

__all__ = ["scan_layers", "remat_policy", "REMAT_NAMES"]


# ----------------------------------------------------------------------------------------------
# activation policies
# ----------------------------------------------------------------------------------------------
def _names_policy(*names):
    return jax.checkpoint_policies.save_only_these_names(*names)


REMAT_NAMES = {
    "none": "keep every residual autodiff keeps (no recompute)",
    "full": "recompute the whole layer in the backward pass",
    "dots": "save matmul outputs without batch dimensions (jax.checkpoint_policies.dots_with_no_batch_dims_saveable; MaxText's 'minimal')",
    "dots_all": "save every matmul output (jax.checkpoint_policies.dots_saveable)",
    "dots_with_context": "'dots' plus values named 'context' (the attention output; MaxText's 'minimal_with_context')",
    "qkv_proj": "values named 'query_proj', 'key_proj', 'value_proj' (MaxText's 'save_qkv_proj')",
    "dots_except_mlp": "values named 'query_proj', 'key_proj', 'value_proj', 'context', 'out_proj' (MaxText's 'save_dot_except_mlp')",
}


def remat_policy(name):
    """The `remat` value for a policy name: "none" -> None, "full" -> True, "dots" ... (REMAT_NAMES),
    or the name of any `jax.checkpoint_policies` attribute (e.g. "everything_saveable"),
    or "names:a,b" (`save_only_these_names("a", "b")`)."""
    if name is None or name is False or name is True or callable(name):
        return name
    key = str(name).strip().lower()
    if key in ("none", "no", "off", "false"):
        return None
    if key in ("full", "true", "all"):
        return True
    if key == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if key == "dots_all":
        return jax.checkpoint_policies.dots_saveable
    if key == "dots_with_context":
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _names_policy("context"))
    if key == "qkv_proj":
        return _names_policy("query_proj", "key_proj", "value_proj")
    if key == "dots_except_mlp":
        return _names_policy("query_proj", "key_proj", "value_proj", "context", "out_proj")
    if key.startswith("names:"):
        names = [n.strip() for n in key[len("names:"):].split(",") if n.strip()]
        if not names:
            raise ValueError(f"tide: remat policy {name!r}: no names after 'names:'")
        return _names_policy(*names)
    policy = getattr(jax.checkpoint_policies, str(name).strip(), None)
    if policy is None or not callable(policy):
        raise ValueError(
            f"tide: unknown remat policy {name!r}: expected one of {sorted(REMAT_NAMES)}, 'names:a,b', "
            "or the name of a jax.checkpoint_policies attribute"
        )
    return policy


def _checkpointed(fn, remat, unroll: bool):
    """`fn` under the activation policy `remat` (None/False: as it is)."""
    remat = remat_policy(remat)
    if remat is None or remat is False:
        return fn
    policy = None if remat is True else remat
    # prevent_cse guards a recompute against being merged with the forward by XLA's CSE; inside a
    # scan body the two live in different loops, so it is only needed for the unrolled loop.
    return jax.checkpoint(fn, policy=policy, prevent_cse=unroll)


# ----------------------------------------------------------------------------------------------
# one layer's forward with its residuals split: saved / gathered parameters / derived from them
# ----------------------------------------------------------------------------------------------
def _aval_key(leaves) -> tuple:
    return tuple(str(jax.typeof(x)) if hasattr(x, "dtype") else repr(x) for x in leaves)


class _Residuals:
    """The residuals of `jax.vjp(fn, p, c, x, k)` for one layer, split by what they depend on.

    Traced once per input signature (`jax.make_jaxpr`): each residual is either one of the gathered
    parameters `p` (then it is not saved: the backward has the parameters, re-gathered or kept), one
    of the closed-over constants `k` (also at hand), a value computed from `p` and `k` alone
    ("derived": recomputed in the backward from the parameters by the dead-code-eliminated forward,
    when `derive`), or anything else ("saved": stacked by the forward scan)."""

    def __init__(self, fn, derive: bool):
        self.fn = fn
        self.derive = derive
        self._plans: dict = {}

    def _plan(self, p, c, x, k):
        flat, in_tree = jax.tree_util.tree_flatten((p, c, x, k))
        key = (in_tree, _aval_key(flat))
        plan = self._plans.get(key)
        if plan is not None:
            return plan, flat
        box = {}

        def fwd_flat(*flat_in):
            p_, c_, x_, k_ = jax.tree_util.tree_unflatten(in_tree, flat_in)
            y, pullback = jax.vjp(self.fn, p_, c_, x_, k_)
            y_leaves, y_tree = jax.tree_util.tree_flatten(y)
            res, res_tree = jax.tree_util.tree_flatten(pullback)
            box.update(y_tree=y_tree, res_tree=res_tree, n_y=len(y_leaves))
            return (*y_leaves, *res)

        closed = jax.make_jaxpr(fwd_flat)(*flat)
        n_p = len(jax.tree_util.tree_leaves(p))
        n_c = len(jax.tree_util.tree_leaves(c))
        n_x = len(jax.tree_util.tree_leaves(x))
        n_in = len(flat)
        kinds_in = ["p"] * n_p + ["c"] * n_c + ["x"] * n_x + ["k"] * (n_in - n_p - n_c - n_x)
        jaxpr = closed.jaxpr
        source = {v: {"const"} for v in jaxpr.constvars}
        for v, kind in zip(jaxpr.invars, kinds_in):
            source[v] = {kind}
        for eqn in jaxpr.eqns:
            dep = set()
            for v in eqn.invars:
                if not _is_literal(v):
                    dep |= source[v]
            for o in eqn.outvars:
                source[o] = dep
        index_of = {v: i for i, v in enumerate(jaxpr.invars)}
        n_y = box["n_y"]
        kinds = []  # per residual: ("p", j) | ("k", j) | ("derive", d) | ("save", s)
        n_save = n_derive = 0
        derive_out = []
        for pos, v in enumerate(jaxpr.outvars[n_y:]):
            i = None if _is_literal(v) else index_of.get(v)
            if i is not None and kinds_in[i] == "p":
                kinds.append(("p", i))
            elif i is not None and kinds_in[i] == "k":
                kinds.append(("k", i - n_p - n_c - n_x))
            elif self.derive and (_is_literal(v) or source[v] <= {"p", "k"}):
                kinds.append(("derive", n_derive))
                derive_out.append(n_y + pos)
                n_derive += 1
            else:
                kinds.append(("save", n_save))
                n_save += 1
        derive_fn = None
        if derive_out:
            derive_fn = _derive_function(closed, derive_out, kinds_in)
        plan = dict(closed=closed, kinds=kinds, n_save=n_save, derive_fn=derive_fn, in_tree=in_tree,
                    n_p=n_p, n_c=n_c, n_x=n_x, **box)
        self._plans[key] = plan
        return plan, flat

    def forward(self, p, c, x, k):
        """(y, saved residuals, plan) of one layer."""
        plan, flat = self._plan(p, c, x, k)
        outs = _eval(plan["closed"].jaxpr, plan["closed"].consts, flat)
        y = jax.tree_util.tree_unflatten(plan["y_tree"], outs[: plan["n_y"]])
        res = outs[plan["n_y"]:]
        saved = [r for r, kind in zip(res, plan["kinds"]) if kind[0] == "save"]
        return y, saved, plan

    @staticmethod
    def backward(plan, saved, p, k, dy):
        """(dp, dc, dx, dk) of one layer from its saved residuals and its gathered parameters."""
        p_leaves = jax.tree_util.tree_leaves(p)
        k_leaves = jax.tree_util.tree_leaves(k)
        derived = plan["derive_fn"](p_leaves, k_leaves) if plan["derive_fn"] else []
        res = []
        for kind, j in plan["kinds"]:
            res.append({"p": p_leaves, "k": k_leaves, "derive": derived, "save": saved}[kind][j])
        pullback = jax.tree_util.tree_unflatten(plan["res_tree"], res)
        return pullback(dy)


def _eval(jaxpr, consts, args):
    from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

    return list(jaxpr_as_fun(ClosedJaxpr(jaxpr, list(consts)))(*args))


def _is_literal(v) -> bool:
    return type(v).__name__ == "Literal"


def _derive_function(closed, outputs: list, kinds_in: list):
    """(p_leaves, k_leaves) -> the residuals at `outputs` of `closed`, computed by the part of the
    forward they depend on (dead-code eliminated: no activation is touched)."""
    jaxpr = closed.jaxpr
    used = [False] * len(jaxpr.outvars)
    for o in outputs:
        used[o] = True
    try:
        from jax._src.interpreters import partial_eval as pe

        if jaxpr.constvars:
            jaxpr = pe.convert_constvars_jaxpr(jaxpr)
            kinds_in = ["const"] * len(closed.jaxpr.constvars) + list(kinds_in)
        dce, used_in = pe.dce_jaxpr(jaxpr, used)
    except Exception:  # pragma: no cover - JAX internals moved: evaluate everything, XLA drops the rest
        dce, used_in = None, None
    consts = list(closed.consts)

    def derive(p_leaves, k_leaves):
        if dce is None:  # pragma: no cover
            full = _eval(closed.jaxpr, consts, _dummy_inputs(closed, kinds_in, p_leaves, k_leaves))
            return [full[o] for o in outputs]
        args = _dummy_inputs(closed, kinds_in, p_leaves, k_leaves, with_consts=consts)
        return _eval(dce, [], [a for a, u in zip(args, used_in) if u])

    return derive


def _dummy_inputs(closed, kinds_in, p_leaves, k_leaves, with_consts=None):
    """The flat inputs of `closed` with the parameters and constants in place; activation inputs are
    zeros (only reached when dead-code elimination is unavailable; their values never matter)."""
    args, ip, ik = [], 0, 0
    consts = list(with_consts) if with_consts is not None else []
    avals = [v.aval for v in closed.jaxpr.invars]
    if with_consts is not None and closed.jaxpr.constvars:
        args.extend(consts)
        kinds_in = kinds_in[len(consts):]
    for kind, aval in zip(kinds_in, avals):
        if kind == "p":
            args.append(p_leaves[ip])
            ip += 1
        elif kind == "k":
            args.append(k_leaves[ik])
            ik += 1
        else:
            args.append(_zeros_of(aval))
    return args


def _zeros_of(aval):
    z = jnp.zeros(aval.shape, aval.dtype)
    vma = _compat.vma_of_aval(aval)
    return _compat.mark_varying(z, sorted(vma)) if vma else z


# ----------------------------------------------------------------------------------------------
# a parameter group's collectives (the layer, the prologue's, the epilogue's)
# ----------------------------------------------------------------------------------------------
class _Group:
    """Start/done of one layout's gather and reduce-scatter, with HSDP replicas and casts; every
    type per parameter, as `gather_params` gives it ([Note: vma of the collectives] in `_ops`)."""

    def __init__(self, lay: Layout, leaves: list, dtype, backend: str, op: str):
        self.lay = lay
        self.shard_dtypes = [np.dtype(s.dtype) for s in leaves]
        self.param_dtypes = [np.dtype(dtype) if dtype is not None else d for d in self.shard_dtypes]
        self.backend = backend
        # HSDP (as gather_params): per parameter, the replica axes its fp32 gradient shards are
        # summed over; its gathered block is typed varying over them.
        self.shard_vma, self.replica_axes = _ops.replica_axes(leaves, lay)
        self.ct_axes = [sorted(v | set(r) | {lay.axis}) if v else [] for v, r in zip(self.shard_vma, self.replica_axes)]
        self.p_vma = [sorted(v | set(r) | {lay.axis}) for v, r in zip(self.shard_vma, self.replica_axes)]
        for p, x in zip(lay.params, leaves):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(
                    f"tide: scan_layers: {op}: {p.describe()}: shard dtype {np.dtype(x.dtype).name} is not "
                    "a floating type; only floating parameters can be gathered and differentiated"
                )

    def example(self):
        """Zeros typed as the gathered parameters will be (for closure conversion)."""
        return jax.tree_util.tree_unflatten(
            self.lay.treedef,
            [_compat.mark_varying(jnp.zeros(p.local_shape, d), v)
             for p, d, v in zip(self.lay.params, self.param_dtypes, self.p_vma)],
        )

    def cast_ok(self) -> bool:
        """Whether this group gathers with the casting all-gather ([Note: the casting all-gather] in
        `_native`): the native backend (not local), float32 shards, bfloat16 parameters, TIDE_AG_CAST."""
        return (len(set(self.param_dtypes)) == 1
                and _native.cast_ok(self.lay, self.shard_dtypes, self.param_dtypes[0], self.backend))

    def start_gather(self, leaves):
        if self.cast_ok():  # one layer's shards: a stack of one (a free reshape)
            return _native.start_cast([x[None] for x in leaves], 0, self.lay, self.backend)
        cast = [_ops.maybe_cast(s, d) for s, d in zip(leaves, self.param_dtypes)]
        return _native.start("all_gather", cast, self.lay, self.backend)

    def start_gather_at(self, stacked, i):
        """`start_gather` of layer `i` of the stacked shards: the casting all-gather reads the slice
        in place (no fp32 slice is cut out of the stack)."""
        if self.cast_ok():
            return _native.start_cast(list(stacked), i, self.lay, self.backend)
        return self.start_gather([jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False) for s in stacked])

    def done_gather(self, h):
        outs = _native.done(h, "all_gather")
        return [_compat.mark_varying(o, list(r)) if r else o for o, r in zip(outs, self.replica_axes)]

    def gather_now(self, leaves):
        return self.done_gather(self.start_gather(leaves))

    def start_scatter(self, dp, urgent: bool = False):
        """`urgent`: the step waits on this reduce-scatter next (the backward's last ones): its sums
        take the whole GPU, as nothing runs beside them (src/call.rs `CallInfo::urgent`)."""
        dp = jax.tree_util.tree_leaves(dp)
        dp = [_native.widened(_compat.mark_varying(t, c) if c else t) for t, c in zip(dp, self.ct_axes)]
        return _native.start("reduce_scatter", list(dp), self.lay, self.backend, urgent)

    def into_ok(self) -> bool:
        """Whether this group's layer gradients can be reduce-scattered straight into their slice of
        the (L, ...) gradient buffers ([Note: reduce-scatter into slices] in `_native`): the native
        backend at world size > 1 (or with TIDE_WORLD1_NATIVE=1), float32 shards, no replica axes
        (HSDP's psum follows the reduce-scatter), and TIDE_RS_INTO not 0."""
        return (_rs_into_enabled() and self.backend == "tide" and not _native.is_local(self.lay, "reduce_scatter")
                and all(d == np.dtype(np.float32) for d in self.shard_dtypes)
                and not any(self.replica_axes))

    def start_scatter_into(self, dp, gbuf, index, urgent: bool = False):
        dp = jax.tree_util.tree_leaves(dp)
        dp = [_native.widened(_compat.mark_varying(t, c) if c else t) for t, c in zip(dp, self.ct_axes)]
        return _native.start_into(list(dp), list(gbuf), index, self.lay, self.backend, urgent)

    def done_scatter_into(self, h):
        outs = _native.done_into(h)
        return [_compat.mark_varying(o, sorted(v)) if v else o for o, v in zip(outs, self.shard_vma)]

    def done_scatter(self, h):
        outs = _native.done(h, "reduce_scatter")
        outs = [jax.lax.psum(o, r) if r else o for o, r in zip(outs, self.replica_axes)]
        outs = [o if o.dtype == d else o.astype(d) for o, d in zip(outs, self.shard_dtypes)]
        return [_compat.mark_varying(o, sorted(v)) if v else o for o, v in zip(outs, self.shard_vma)]


def _scan_unroll(platform: str = "cpu") -> int:
    """TIDE_SCAN_UNROLL (default: 2 on GPUs, 1 on other devices): layers per iteration of the layer
    loop's `lax.scan` (its `unroll`) where tide's calls are pipelined (`_Loop.scan_unroll`). With one,
    the gather prefetched for the next layer is a new buffer while this layer still reads the loop's,
    so XLA copies it into the loop's buffer at every iteration's end (a whole gathered layer, forward
    and backward); with two, the second layer's prefetch lands in the buffer the first one freed and
    the copy is gone. The forward scans a multiple of the unroll (the layers left over run unrolled
    after it): a remainder would make lax.scan concatenate its stacked residuals. The layers of one
    iteration are tied in order (`_Loop.after`, `_Loop.read_after`) by optimization barriers.
    On one H200 with tide's calls real at world 1 (bench/RESULTS.md runs 18-27), against 1 (run
    26): 8b-layers (L = 4) 1.027x -> 0.997-1.000x plain JAX's step (remat dots), 1.000x -> 0.945x
    (none); 1b (L = 16) 1.010x -> 0.997-1.004x, 1.010x -> 0.990-0.997x; memory against plain JAX
    (dots) 8b +0.33 GiB, 1b -0.32 GiB (one per iteration: +0.58 / +0.07): XLA:GPU keeps the barriers'
    order, so an iteration holds the (prefetch + 1) gathered layers of one (run 26's liveness pass).
    XLA:CPU removes optimization barriers before it schedules (OptimizationBarrierExpander), and with
    two layers per iteration it starts both layers' gathers together: an 8-layer stack held 4
    gathered layers, its temp memory with reshard_after_forward 0.50x of without (one per iteration:
    0.25-0.28x; issue #39), hence 1 there: no copy to save on CPU devices worth that."""
    return _settings.scan_unroll(platform)


def _rs_urgent_enabled() -> bool:
    """TIDE_RS_URGENT (default on): the backward's last reduce-scatters (layer 0's and the
    prologue's, which the update waits on) are urgent, their sums taking the whole GPU; 0 sums them
    as every other (the A/B switch)."""
    return _settings.rs_urgent()


def _rs_into_enabled() -> bool:
    """TIDE_RS_INTO (default on): scan_layers reduce-scatters layer gradients into their slice of the
    gradient buffers in place; 0 restores a separate fp32 result and an update (the A/B switch of
    bench/train_bench.py)."""
    return _settings.rs_into()


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
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
            elif shape == p.shard_shape or shape == p.shape:
                hint = (" (no layer axis: `lay` must be the layout of ONE layer, built from the stacked "
                        "parameters without their leading axis, e.g. tide_jax.layout(one_layer, mesh, axis))")
            raise ValueError(
                f"tide: scan_layers: {p.describe()}: local stacked shard has shape {shape}, expected "
                f"(L, *{p.shard_shape}) for {lay.world} ranks of axis {lay.axis!r}{hint}"
            )
        if num is None:
            num = shape[0]
        elif shape[0] != num:
            raise ValueError(f"tide: scan_layers: {p.describe()} has {shape[0]} layers, earlier leaves have {num}")
    if not num:
        raise ValueError("tide: scan_layers: the stacked shards have no layers (L = 0)")
    return leaves, int(num)


def _check_xs(xs, num: int):
    for path, leaf in jax.tree_util.tree_flatten_with_path(xs)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape or shape[0] != num:
            raise ValueError(
                f"tide: scan_layers: xs{jax.tree_util.keystr(path)} has shape {shape}: every leaf of xs "
                f"needs the layer axis first, with L = {num} entries (like lax.scan's xs)"
            )


def _end(spec, what: str, op_name: str):
    """(fn, shards, layout) | fn | None -> (fn, shard leaves, layout or None)."""
    if spec is None:
        return None
    if callable(spec):
        return spec, [], None
    if isinstance(spec, (tuple, list)) and len(spec) == 3 and callable(spec[0]) and isinstance(spec[2], Layout):
        fn, shards, lay = spec
        _native.check_context(lay, f"scan_layers {what}")
        leaves = _ops.check_shards(shards, lay, f"scan_layers {what}")
        return fn, leaves, lay
    raise TypeError(
        f"tide: scan_layers: {what} must be a function or a tuple (fn, shards, layout), got "
        f"{type(spec).__name__}"
    )


def _float(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_cotangents(tree):
    """None (a zero cotangent) for every leaf: what a custom_vjp returns for inputs without gradient."""
    return jax.tree.map(lambda _: None, tree)


def _maybe_none_cts(tree, cts):
    """`cts` with None where the primal leaf is not differentiable (ints, keys)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    ct_leaves = jax.tree_util.tree_flatten(cts, is_leaf=lambda t: t is None)[0]
    return jax.tree_util.tree_unflatten(treedef, [c if _float(x) else None for x, c in zip(leaves, ct_leaves)])


# ----------------------------------------------------------------------------------------------
# scan_layers
# ----------------------------------------------------------------------------------------------
def scan_layers(layer_fn, carry, shards, lay: Layout, *, xs=None, prefetch: int = 1, remat=None,
                reshard_after_forward: bool = True, dtype=jnp.bfloat16, backend: str | None = None,
                unroll: bool = False, prologue=None, epilogue=None):
    """Runs `layer_fn(params_i, carry[, xs_i]) -> carry` for the L layers of `shards` under FSDP.

    `lay` is the layout of ONE layer's parameters; `shards` that pytree with a leading layer axis on
    every leaf, `(L, shard_rows, *rest)` inside shard_map (globally `(L, P * shard_rows, *rest)`:
    `lay.shard_stacked`, `lay.stacked_spec`). `layer_fn` gets one layer's full parameters cast to
    `dtype` and returns a carry of the same structure, shapes and dtypes. Gradients reach `shards`
    as fp32-accumulated reduce-scatters cast to the shards' dtype, and `carry`, `xs`, the prologue's
    inputs and whatever the functions close over as usual.

    `remat`: None/False (no recompute), True (recompute each layer), a `jax.checkpoint` policy or a
    name (`remat_policy`). `reshard_after_forward`: True (default) frees gathered parameters after
    each layer's forward and re-gathers them in the backward; False keeps them. `prefetch`: layers
    gathered ahead (0: right before use). `prologue`/`epilogue`: the computation before and after
    the layers, scheduled with them (module docstring). `unroll`: a Python loop instead of
    `lax.scan`. Memory of each combination: module docstring and README "The layer loop".
    """
    _native.check_context(lay, "scan_layers")
    if not isinstance(prefetch, (int, np.integer)) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"tide: scan_layers: prefetch must be an int >= 0, got {prefetch!r}")
    if not isinstance(reshard_after_forward, (bool, np.bool_)):
        raise TypeError(f"tide: scan_layers: reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    remat = remat_policy(remat)
    leaves, num = _check_stacked(shards, lay)
    if xs is not None:
        _check_xs(xs, num)
    backend = _native.chosen(backend)
    pro = _end(prologue, "prologue", "prologue")
    epi = _end(epilogue, "epilogue", "epilogue")
    loop = _Loop(layer_fn, lay, leaves, num, xs is not None, prefetch, remat, bool(reshard_after_forward),
                 dtype, backend, unroll, pro, epi)
    return loop.run(carry, leaves, xs)


class _Loop:
    """One `scan_layers` call: the traced functions, the schedule, the custom VJP."""

    def __init__(self, layer_fn, lay, leaves, num, has_xs, prefetch, remat, reshard, dtype, backend,
                 unroll, pro, epi):
        self.lay, self.num, self.has_xs = lay, num, has_xs
        # Nothing moves when the collectives are local (world size 1): no prefetch, no ordering,
        # which would only keep buffers alive and constrain XLA's fusion.
        self.local = backend == "tide" and _native.is_local(lay)
        self.k = 0 if self.local else min(int(prefetch), num)
        self.reshard, self.unroll, self.backend = reshard, unroll, backend
        self.layer = _Group(lay, leaves, dtype, backend, "layers")
        self.layer_fn, self.remat, self.dtype = layer_fn, remat, dtype
        self.pro, self.epi = pro, epi
        self.pro_group = _Group(pro[2], pro[1], dtype, backend, "prologue") if pro and pro[2] else None
        self.epi_group = _Group(epi[2], epi[1], dtype, backend, "epilogue") if epi and epi[2] else None
        self.use_barriers = backend == "tide" and not self.local

    # ----- helpers -----
    def after(self, index, value, stacked):
        """The layer index `index`, tied to `value` (the carry, or its cotangent, a layer step
        receives) through an optimization barrier, so what reads `stacked` at it cannot be scheduled
        before the previous layer's work. With several layers per scan iteration (TIDE_SCAN_UNROLL)
        nothing else keeps XLA from hoisting a later layer's work above an earlier layer's: a
        prefetch start (more calls in flight than TIDE_MAX_IN_FLIGHT allows, seen on the H200, 1b
        model), or the backward's recompute from saved residuals (both layers' activations held at
        once). Tied only to a carry array varying over no axis the arrays of `stacked` do not, so
        the index changes no read value's type; untied where there is none (or barriers are off)."""
        if not self.ties_layers():
            return index
        s_vmas = [_compat.vma_of(s) for s in jax.tree_util.tree_leaves(stacked)]
        return self._tied(index, value, set.intersection(*map(set, s_vmas)) if s_vmas else set())

    def read_after(self, stacked, index, value):
        """`stacked`'s slices at `index`, each read only once `value` exists (`after`), the index
        tied once per mesh-axis set of the arrays (so each slice keeps its type; an array varying
        over fewer axes than every carry array is read untied: a constant such as a rope table)."""
        if not self.ties_layers():
            return self.index(stacked, index)
        tied = {}
        out = []
        for s in stacked:
            v = frozenset(_compat.vma_of(s))
            if v not in tied:
                tied[v] = self._tied(index, value, set(v))
            out.append(jax.lax.dynamic_index_in_dim(s, tied[v], 0, keepdims=False))
        return out

    @staticmethod
    def _after(values, value):
        """`values`, each through an optimization barrier with an array of `value` that varies over
        no more mesh axes (one barrier per axis set, so no value changes type): whatever reads them
        waits for `value`. Values with no such array are returned as they are."""
        leaves, tree = jax.tree_util.tree_flatten(values)
        anchors = [a for a in jax.tree_util.tree_leaves(value) if hasattr(a, "dtype")]
        groups: dict = {}
        for j, x in enumerate(leaves):
            if hasattr(x, "dtype"):
                groups.setdefault(frozenset(_compat.vma_of(x)), []).append(j)
        out = list(leaves)
        for v, js in groups.items():
            anchor = next((a for a in anchors if set(_compat.vma_of(a)) <= v), None)
            if anchor is None:
                continue
            tied = jax.lax.optimization_barrier(tuple(leaves[j] for j in js) + (anchor,))
            for j, t in zip(js, tied):
                out[j] = t
        return jax.tree_util.tree_unflatten(tree, out)

    def scan_unroll(self) -> int:
        """Layers per `lax.scan` iteration: TIDE_SCAN_UNROLL for tide's pipelined loop (native calls,
        whose prefetched gathers XLA would copy into the loop's buffer; default 2 on GPUs, 1 on CPU
        devices, `_scan_unroll`); 1 where nothing is carried
        from one layer's calls to the next (the local loop: world 1 without native calls), for the
        jax backend (no ties keep its layers apart) and for a Python loop (`unroll=True`)."""
        return _scan_unroll(self.lay.platform) if self.use_barriers and not self.unroll else 1

    def ties_layers(self) -> bool:
        """Whether the layers of one scan iteration need tying (`after`): several per iteration."""
        return self.scan_unroll() > 1

    @staticmethod
    def _tied(index, value, vma):
        for x in jax.tree_util.tree_leaves(value):
            if hasattr(x, "dtype") and set(_compat.vma_of(x)) <= vma:
                idx, _ = jax.lax.optimization_barrier((jnp.asarray(index, jnp.int32), x))
                return idx
        return index

    def order(self, handles, *others):
        """`ordered(handles, *others)` keeping every value's type (the tide backend only).

        An optimization barrier types all its outputs as varying over the union of its operands'
        mesh axes, which would change a carry's type (an invariant counter) or a residual's. So each
        value is tied only to the handle arrays that vary over no more axes than it does, one barrier
        per value type, smallest first. A start's results are typed varying over the layout's axis
        alone ([Note: vma of the collectives] in `_ops`), so every value varying over that axis ties
        every start (a done needs one of its arrays from the barrier to follow it); values varying
        over fewer axes are left out: nothing they compute can use the collective.

        Each handle array runs through the barriers in a chain (the next barrier takes the previous
        one's output, where its type fits in the next one's) and the done takes it from the last: a
        handle array that also went into a barrier the done does not follow makes XLA copy it before
        the done (it writes in place), and the done then finds no start for the copy. XLA:CPU of jax
        0.12.1 keeps the barriers until after copy insertion and did so on a fsdp x tensor mesh
        (tests/python/test_compose.py); 0.10.2 removes them before. Where a type does not fit (two
        value types neither of which holds the other), the array goes in as it came from the start,
        as before."""
        if not self.use_barriers:
            return (handles, *others)
        h_flat, h_tree = jax.tree_util.tree_flatten(handles)
        o_flat, o_tree = jax.tree_util.tree_flatten(others)
        if not h_flat:
            return (handles, *others)
        h_vmas = [_compat.vma_of(h) for h in h_flat]
        classes: dict = {}
        for i, x in enumerate(o_flat):
            v = _compat.vma_of(x)
            if any(hv <= v for hv in h_vmas):
                classes.setdefault(v, []).append(i)
        new_h, new_o = list(h_flat), list(o_flat)
        cur_vmas = list(h_vmas)  # each handle array's type at the end of its chain
        tied = [False] * len(h_flat)
        for v in sorted(classes, key=lambda v: (len(v), sorted(v))):
            idx = classes[v]
            chained = [j for j, cv in enumerate(cur_vmas) if cv <= v]
            loose = [j for j, hv in enumerate(h_vmas) if hv <= v and not cur_vmas[j] <= v]
            ins = tuple(new_h[j] for j in chained) + tuple(h_flat[j] for j in loose)
            out = jax.lax.optimization_barrier(ins + tuple(o_flat[i] for i in idx))
            for k, j in enumerate(chained):
                new_h[j], tied[j] = out[k], True
                cur_vmas[j] = _compat.vma_of(out[k])
            for k, i in enumerate(idx):
                new_o[i] = out[len(ins) + k]
        if not any(tied):
            new_h = list(jax.lax.optimization_barrier(tuple(h_flat)))
        return (jax.tree_util.tree_unflatten(h_tree, new_h), *jax.tree_util.tree_unflatten(o_tree, new_o))

    @staticmethod
    def index(stacked, i):
        return [jax.lax.dynamic_index_in_dim(s, i, 0, keepdims=False) for s in stacked]

    def scan(self, body, carry, idx: list):
        """`lax.scan` over `idx` (the steady state), or a Python loop when `unroll` is set."""
        if not idx:
            return carry, None
        if self.unroll:
            ys = []
            for i in idx:
                carry, y = body(carry, i)
                ys.append(y)
            return carry, jax.tree.map(lambda *t: jnp.stack(t), *ys)
        return jax.lax.scan(body, carry, jnp.asarray(idx, jnp.int32), unroll=self.scan_unroll())

    # ----- tracing the user's functions -----
    def convert(self, carry, xs):
        """Closure-converts the layer, prologue and epilogue functions (their closed-over values
        become differentiable inputs) and builds the per-layer residual splitter."""
        has_xs = self.has_xs
        fn = self.layer_fn

        def layer3(p, c, x):
            out = fn(p, c, x) if has_xs else fn(p, c)
            return out

        x0 = jax.tree.map(lambda t: t[0], xs) if has_xs else None
        converted, consts = jax.closure_convert(layer3, self.layer.example(), carry, x0)
        treedef = self.lay.treedef

        def apply(p_leaves, c, x, k):
            return converted(jax.tree_util.tree_unflatten(treedef, p_leaves), c, x, *k)

        self.apply = apply
        self.apply_ck = _checkpointed(apply, self.remat, self.unroll)
        self.residuals = _Residuals(self.apply_ck, derive=True)
        # The layers run outside the scan (the forward's last ones, kept for the backward's first)
        # are straight-line code beside their own backward: without prevent_cse XLA merges the
        # backward's recompute with the forward's values and keeps those alive from the forward on
        # (1b, two layers outside the scan: their `silu(gate) * up` and attention outputs held
        # across the loss, +0.6 GiB). Barriers only where something is recomputed (none at remat
        # none), on whole arrays (no stack slice to materialize).
        guarded = _checkpointed(apply, self.remat, True)
        self.residuals_unrolled = (self.residuals if self.unroll or guarded is apply else
                                   _Residuals(guarded, derive=True))
        return list(consts)

    def carry_vma(self, carry, xs):
        """Per carry leaf, the mesh axes it varies over once the layer has run (a fixed point)."""
        has_xs, fn, example = self.has_xs, self.layer_fn, self.layer.example()
        x0 = jax.tree.map(lambda t: t[0], xs) if has_xs else None
        target = [_compat.vma_of(c) for c in jax.tree_util.tree_leaves(carry)]
        for _ in range(4):
            current = _with_vma(carry, target)
            closed = jax.make_jaxpr(lambda c: fn(example, c, x0) if has_xs else fn(example, c))(current)
            out = [_compat.vma_of_aval(a) for a in closed.out_avals]
            if len(out) != len(target):
                break  # a structure error, reported with its names by the first traced layer
            grown = [t | o for t, o in zip(target, out)]
            if grown == target:
                break
            target = grown
        return target

    def convert_end(self, end, group, *example_args):
        if end is None:
            return None, []
        fn = end[0]
        if group is None:
            converted, consts = jax.closure_convert(fn, *example_args)
            return (lambda p, *a: converted(*a[:-1], *a[-1])), list(consts)
        converted, consts = jax.closure_convert(fn, group.example(), *example_args)
        treedef = group.lay.treedef
        return (lambda p, *a: converted(jax.tree_util.tree_unflatten(treedef, p), *a[:-1], *a[-1])), list(consts)

    # ----- the call -----
    def run(self, inputs, leaves, xs):
        L = self.num
        # Trace the prologue on example inputs to learn the carry (closure conversion needs it).
        pro_fn, k_pro = self.convert_end(self.pro, self.pro_group, inputs)
        if pro_fn is not None:
            p_ex = jax.tree_util.tree_leaves(self.pro_group.example()) if self.pro_group else []
            closed, shape = jax.make_jaxpr(lambda i, kk: pro_fn(p_ex, i, kk), return_shape=True)(inputs, k_pro)
            out_tree = jax.tree_util.tree_structure(shape)
            example = jax.tree_util.tree_unflatten(out_tree, [_zeros_of(a) for a in closed.out_avals])
            if not (isinstance(example, tuple) and len(example) == 2):
                raise ValueError(
                    "tide: scan_layers: the prologue must return a pair (carry, aux) (aux: what the "
                    f"epilogue shares with it, or None), got {out_tree}"
                )
            carry_ex, aux_ex = example
        else:
            carry_ex, aux_ex = inputs, None
        # The carry is typed as varying over every mesh axis the layer makes it vary over (lax.scan
        # needs one carry type; `jnp.float32(0)` as a running sum would otherwise change type).
        target = self.carry_vma(carry_ex, xs)
        carry_ex = _with_vma(carry_ex, target)
        if pro_fn is not None:
            pro_raw = pro_fn
            pro_fn = lambda p, i, kk: (lambda ca: (_with_vma(ca[0], target), ca[1]))(pro_raw(p, i, kk))  # noqa: E731
        else:
            inputs = _with_vma(inputs, target)
        k_layer = self.convert(carry_ex, xs)
        epi_fn, k_epi = self.convert_end(self.epi, self.epi_group, carry_ex, aux_ex)
        self.pro_fn, self.epi_fn = pro_fn, epi_fn
        pro_leaves = self.pro[1] if self.pro else []
        epi_leaves = self.epi[1] if self.epi else []
        xs_in = xs if self.has_xs else None

        @jax.custom_vjp
        def run(inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi):
            return self.forward(inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi, save=False)[0]

        def run_fwd(inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi):
            out, res = self.forward(inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi, save=True)
            return out, (res, inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi)

        def run_bwd(res, dout):
            return self.backward(res, dout)

        run.defvjp(run_fwd, run_bwd)
        del L
        return run(inputs, list(leaves), xs_in, k_layer, list(pro_leaves), k_pro, list(epi_leaves), k_epi)

    # ----- forward -----
    def forward(self, inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi, save: bool):
        L, k, g = self.num, self.k, self.layer
        res = {}
        # the prologue, with the first k layer gathers in flight behind it
        pending = [g.start_gather_at(stacked, j) for j in range(k)]
        if self.pro_fn is not None:
            pro_p = []
            if self.pro_group is not None:
                hp = self.pro_group.start_gather(pro_leaves)
                (pending, hp), = self.order((pending, hp))
                pro_p = self.pro_group.done_gather(hp)
            pending, inputs, pro_p, k_pro = self.order(pending, inputs, pro_p, k_pro)
            if save:
                (carry, aux), pro_pb = jax.vjp(lambda p, i, kk: self.pro_fn(p, i, kk), pro_p, inputs, k_pro)
                res["pro_pb"] = pro_pb
            else:
                carry, aux = self.pro_fn(pro_p, inputs, k_pro)
            pending, carry, aux = self.order(pending, carry, aux)
        else:
            carry, aux = inputs, None
        ps = tuple(g.done_gather(h) for h in pending)
        epi_h = None  # the epilogue's gather, started during the last layer

        def layer_step(c, ps, i, x_i, ahead):
            """One layer's forward; `ahead`: the layer to start gathering (or None); returns the new
            carry, queue, and (saved residuals, gathered params) of layer i."""
            nonlocal epi_h
            if k == 0:
                p = g.done_gather(g.start_gather_at(stacked, i))
                rest = ps
            else:
                p, rest = ps[0], tuple(ps[1:])
            starts = []
            if ahead is not None:
                starts.append(g.start_gather_at(stacked, self.after(ahead, c, stacked)))
            want_epi = self.epi_group is not None and k > 0 and isinstance(i, int) and i == L - 1
            if want_epi:
                starts.append(self.epi_group.start_gather(epi_leaves))
            if starts:
                starts, c, p = self.order(starts, c, p)
            plan = None
            if save:
                residuals = self.residuals_unrolled if isinstance(i, int) else self.residuals
                y, saved, plan = residuals.forward(p, c, x_i, k_layer)
            else:
                y, saved = self.apply_ck(p, c, x_i, k_layer), None
            self._check_carry(c, y)
            if starts:
                starts, y = self.order(starts, y)
                if want_epi:
                    epi_h = starts.pop()
                if ahead is not None:
                    rest = rest + (g.done_gather(starts[0]),)
            return y, rest, (saved, p, plan)

        def x_at(i):
            return None if xs is None else jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, 0, keepdims=False), xs)

        steady = list(range(L - k)) if k else list(range(L))
        # a whole number of unrolled scan iterations (TIDE_SCAN_UNROLL): a remainder would make
        # lax.scan concatenate its stacked residuals (a copy of every saved activation: 1b, L = 16,
        # +9 GiB on the H200); those layers run unrolled after the scan instead, prefetching as it
        u = self.scan_unroll()
        steady = steady[:len(steady) - len(steady) % u]

        scan_plan = []

        def body(state, i):
            c, ps = state
            y, ps, (saved, p, plan) = layer_step(c, ps, i, x_at(i), i + k if k else None)
            scan_plan.append(plan)
            out = (saved, p if not self.reshard else []) if save else ()
            return (y, ps), out

        (carry, ps), scanned = self.scan(body, (carry, ps), steady)
        tail = []
        for i in range(len(steady), L):
            carry, ps, (saved, p, plan) = layer_step(carry, ps, i, x_at(i), i + k if k and i + k < L else None)
            # with reshard_after_forward only the last k layers' gathered parameters are kept (the
            # backward starts from them); a layer moved out of the scan is re-gathered like the rest
            tail.append((saved, p if not self.reshard or i >= L - k else None, plan))
        # the epilogue
        if self.epi_fn is not None:
            epi_p = []
            if self.epi_group is not None:
                epi_p = self.epi_group.done_gather(epi_h) if epi_h is not None else self.epi_group.gather_now(epi_leaves)
            if save:
                out, epi_pb = jax.vjp(lambda p, c, a, kk: self.epi_fn(p, c, a, kk), epi_p, carry, aux, k_epi)
                res["epi_pb"] = epi_pb
            else:
                out = self.epi_fn(epi_p, carry, aux, k_epi)
        else:
            out = carry
        if not save:
            return out, None
        # the plans are static (traced once per input signature): kept on the loop, not as residuals
        self.scan_plan = scan_plan[-1] if scan_plan else None
        self.tail_plans = [t[2] for t in tail]
        res["scanned"] = scanned if steady else None
        res["tail"] = [t[:2] for t in tail]
        res["aux"] = aux
        return out, res

    def _check_carry(self, c, y):
        ct, yt = jax.tree_util.tree_structure(c), jax.tree_util.tree_structure(y)
        if ct != yt:
            raise ValueError(
                f"tide: scan_layers: layer_fn must return a carry of the structure it was given: got {yt}, "
                f"expected {ct}"
            )
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(c)[0], jax.tree_util.tree_leaves(y)):
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise ValueError(
                    f"tide: scan_layers: layer_fn changed carry{jax.tree_util.keystr(path)} from "
                    f"{a.dtype}{list(a.shape)} to {b.dtype}{list(b.shape)}; the carry must keep its shapes "
                    "and dtypes (cast inside layer_fn)"
                )

    # ----- backward -----
    def backward(self, saved_all, dout):
        res, inputs, stacked, xs, k_layer, pro_leaves, k_pro, epi_leaves, k_epi = saved_all
        L, k, g = self.num, self.k, self.layer
        aux = res["aux"]
        # the epilogue's backward; its reduce-scatter runs behind the last layer's
        extra = []
        d_epi = None
        dk_epi = _zeros_cts(k_epi)
        if self.epi_fn is not None:
            d_epi_p, dc, daux, dk_epi = res["epi_pb"](dout)
            if self.use_barriers and daux is not None:
                # The layers' backward starts once the cotangent of the prologue's aux exists (a tied
                # embedding's table: the head's weight gradient). Only the prologue's backward, the
                # step's last, reads it, so XLA was free to compute it there and held the logits'
                # cotangent (1b: 1 GiB) through the whole backward (issue #22, run 24's dump).
                dc = self._after(dc, daux)
            if self.epi_group is not None:
                extra.append(("epi", self.epi_group.start_scatter(d_epi_p)))
        else:
            dc, daux = dout, None

        # where each layer's residuals and gathered parameters come from
        scanned, tail = res["scanned"], res["tail"]
        n_scan = L - len(tail)

        def source(i, dynamic: bool, after):
            """(saved residuals, kept parameters or None, plan) of layer i; `after`: in the scan, the
            saved residuals are read only once this carry cotangent exists (`_Loop.read_after`: with
            several layers per iteration XLA would otherwise recompute a later layer's activations
            from its residuals before the earlier layer's backward, holding both layers' at once)."""
            if not dynamic and i >= n_scan:
                saved, p = tail[i - n_scan]
                # (not tied here: their recompute runs under prevent_cse, `residuals_unrolled`; a
                # barrier on every saved value made XLA materialize what it otherwise recomputes
                # inside its consumers' fusions: remat none held +1.3-2.3 GiB)
                return saved, p, self.tail_plans[i - n_scan]
            saved_s, p_s = scanned
            # (layer 0, unrolled after the scan, reads at a tied index too: XLA had fused its
            # recompute into layer 1's and hoisted its rope work above the loss)
            tie = dynamic or self.ties_layers()
            saved = self.read_after(saved_s, i, after) if tie else [s[i] for s in saved_s]
            p = (self.index(p_s, i) if dynamic else [s[i] for s in p_s]) if not self.reshard else None
            return saved, p, self.scan_plan

        # gradient buffers, written in place (no concatenation of per-layer pieces)
        def grad_buffer(dt, p, v):
            z = jnp.zeros((L, *p.shard_shape), dt)
            return _compat.mark_varying(z, sorted(v)) if v else z

        gbuf = [grad_buffer(dt, p, v) for dt, p, v in zip(g.shard_dtypes, self.lay.params, g.shard_vma)]
        dxs_leaves = jax.tree_util.tree_leaves(xs) if xs is not None else []
        dxbuf = [jnp.zeros(t.shape, t.dtype) if _float(t) else None for t in dxs_leaves]
        if dxbuf:
            dxbuf = [_compat.mark_varying(b, sorted(_compat.vma_of(t))) if b is not None and _compat.vma_of(t) else b
                     for b, t in zip(dxbuf, dxs_leaves)]
        dk = _zeros_cts(k_layer)

        def put(buf, i, vals):
            return [jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0) for b, v in zip(buf, vals)]

        # A layer's gradient shards go straight into slice i of the buffers where the native call can
        # write them there (`_Group.into_ok`): no fp32 result in flight, no copy (issue #22).
        into = g.into_ok()

        def start_rs(dp, gbuf, i, urgent=False):
            return g.start_scatter_into(dp, gbuf, i, urgent) if into else g.start_scatter(dp, urgent)

        def done_rs(h, gbuf, i):
            return g.done_scatter_into(h) if into else put(gbuf, i, g.done_scatter(h))

        def x_at(i):
            return None if xs is None else jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, 0, keepdims=False), xs)

        # the backward's queue of gathered parameters: the forward's last k layers (kept)
        reshard = self.reshard
        ps = tuple(tail[-1 - j][1] for j in range(k)) if reshard and k else ()

        def step(state, i, dynamic: bool, extra=()):
            dc, ps, dp_prev, dk, gbuf, dxbuf = state
            saved, p_saved, plan = source(i, dynamic, after=dc)
            starts = []
            if dp_prev is not None:
                starts.append(start_rs(dp_prev, gbuf, i + 1))
            ahead = None
            if reshard and k:
                ahead = i - k if dynamic or i - k >= 0 else None
                if ahead is not None:
                    starts.append(g.start_gather_at(stacked, self.after(ahead, dc, stacked)))
            extra_h = [h for _, h in extra]
            if reshard:
                if k:
                    p, ps = ps[0], tuple(ps[1:])
                elif not dynamic and i >= n_scan and p_saved is not None:
                    p = p_saved
                else:
                    p = g.done_gather(g.start_gather_at(stacked, i))
            else:
                p = p_saved
            if starts or extra_h:
                # (the saved residuals stay out: a barrier would materialize each one's slice of the
                # stacked buffer, which XLA otherwise fuses into its consumers)
                (starts, extra_h), dc, p = self.order((starts, extra_h), dc, p)
            dp, dc, dx, dkk = self.residuals.backward(plan, saved, p, k_layer, dc)
            dk = _add_cts(dk, dkk)
            if starts or extra_h:
                (starts, extra_h), dp, dc = self.order((starts, extra_h), dp, dc)
            if dp_prev is not None:
                gbuf = done_rs(starts[0], gbuf, i + 1)
                starts = starts[1:]
            if ahead is not None:
                ps = ps + (g.done_gather(starts[0]),)
            dp = jax.tree_util.tree_leaves(dp)
            if self.local:  # nothing to overlap: this layer's gradient shards at once, no pipeline
                gbuf = put(gbuf, i, g.done_scatter(g.start_scatter(dp)))
                dp = None
            if dxbuf:
                dx_leaves = jax.tree_util.tree_leaves(dx) if dx is not None else []
                dxbuf = [b if b is None else jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
                         for b, v in zip(dxbuf, _pad_leaves(dx_leaves, len(dxbuf)))]
            done_extra = {name: self.epi_group.done_scatter(h) for (name, _), h in zip(extra, extra_h)}
            return (dc, ps, dp, dk, gbuf, dxbuf), done_extra

        # segments: unrolled [L-1 .. hi), scan [hi-1 .. lo], unrolled [lo-1 .. 0]; local: one scan
        extras_done = {}
        if self.local:
            if extra:  # the epilogue's gradient shards, at once
                extras_done = {name: self.epi_group.done_scatter(h) for name, h in extra}
                extra = []
            hi, lo = n_scan, 0  # the forward's unrolled layers after its scan, if any, then one scan
        else:
            hi = min(n_scan, L - 1)
            lo = k if (reshard and k) else 0
            lo = min(lo, hi)
        state = (dc, ps, None, dk, gbuf, dxbuf)
        first = True
        for i in range(L - 1, hi - 1, -1):
            state, done_extra = step(state, i, False, extra if first else ())
            extras_done.update(done_extra)
            first = False
        # (pipelined, the unrolled part holds layer L-1: the first step has no reduce-scatter to start)
        if hi > lo:
            def body(st, i):
                st, _ = step(st, i, True)
                return st, None

            state, _ = self.scan(body, state, list(range(hi - 1, lo - 1, -1)))
        for i in range(lo - 1, -1, -1):
            state, done_extra = step(state, i, False, extra if first else ())
            extras_done.update(done_extra)
            first = False
        dc, ps, dp0, dk, gbuf, dxbuf = state

        # layer 0's reduce-scatter behind the prologue's backward; it and the prologue's are the
        # step's last: urgent (the update waits on them, nothing else is left to hide them)
        urgent = _rs_urgent_enabled()
        h0 = start_rs(dp0, gbuf, 0, urgent=urgent) if dp0 is not None else None
        d_pro = None
        dk_pro = _zeros_cts(k_pro)
        if self.pro_fn is not None:
            if daux is None:
                daux = jax.tree.map(jnp.zeros_like, aux)
            h0, dc, daux = self.order(h0, dc, daux)
            d_pro_p, d_inputs, dk_pro = res["pro_pb"]((dc, daux))
            h0, d_pro_p, d_inputs = self.order(h0, d_pro_p, d_inputs)
            if self.pro_group is not None:
                hpr = self.pro_group.start_scatter(d_pro_p, urgent=urgent)
                if h0 is not None:
                    gbuf = done_rs(h0, gbuf, 0)
                d_pro = self.pro_group.done_scatter(hpr)
            elif h0 is not None:
                gbuf = done_rs(h0, gbuf, 0)
        else:
            d_inputs = dc
            if h0 is not None:
                gbuf = done_rs(h0, gbuf, 0)
        d_epi = extras_done.get("epi")

        d_xs = None
        if xs is not None:
            d_xs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(xs), [b for b in dxbuf])
        d_pro_leaves = d_pro if d_pro is not None else [None] * len(pro_leaves)
        d_epi_leaves = d_epi if d_epi is not None else [None] * len(epi_leaves)
        return (_maybe_none_cts(inputs, d_inputs), gbuf, d_xs, _maybe_none_cts(k_layer, dk), d_pro_leaves,
                _maybe_none_cts(k_pro, dk_pro), d_epi_leaves, _maybe_none_cts(k_epi, dk_epi))


def _with_vma(tree, target):
    """`tree` with each leaf marked varying over its entry of `target` (a no-op where it is)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves or not any(target):
        return tree
    return jax.tree_util.tree_unflatten(
        treedef, [_compat.mark_varying(x, sorted(t)) if t else x for x, t in zip(leaves, target)])


def _zeros_cts(tree):
    """Zero cotangent accumulators for the float leaves of `tree` (None for the others)."""
    return jax.tree.map(lambda x: jnp.zeros_like(x) if _float(x) else None, tree)


def _add_cts(acc, new):
    return jax.tree.map(lambda a, b: a if a is None else a + b.astype(a.dtype), acc, new,
                        is_leaf=lambda t: t is None)


def _pad_leaves(leaves, n):
    leaves = list(leaves)
    return leaves + [None] * (n - len(leaves))
