"""The front door's core, shared by `tide_jax.nnx` and `tide_jax.equinox` (it imports neither library).

A model is seen as a flat list of named leaves, which the adapters read out of their library's
structure (an `nnx.State`, an Equinox pytree):

- parameters: floating arrays that are trained. Those under a *stack* path (e.g. "blocks": layers
  stacked on a leading axis, `nnx.vmap` / `eqx.filter_vmap`) are sharded per layer (one layout of
  ONE layer, `Layout.shard_stacked`) and run through `scan_layers`; the others ("rest": embedding,
  final norm, head) form one layout, gathered once at the start of the forward.
- state: everything else. Arrays (PRNG keys, RNG counters, int buffers, bools, float buffers that
  are not parameters such as batch statistics) are passed through unsharded: replicated on every
  device, no gradient, and (NNX) updated by the forward the way the library updates them, so an
  RNG counter advances every step. Non-arrays (Python numbers, strings, functions) stay static.

Meshes with several axes: each parameter may carry a spec over the mesh's other axes (NNX: its
annotations through logical axis rules; Equinox: a specs pytree), which its group's layout takes
(`tide_jax.layout(specs=...)`: FSDP over each local block). The batch is split over the axes no
parameter is split over (`batch_axes`), and the shards are replicated over those other than `axis`
(the layouts' `replicas`, HSDP); the model's own code runs the psums its split needs.

`Plan.run` is one FSDP computation: a `shard_map` over the mesh with the parameter shards (their
layouts' specs: `P(axis)`, stacks `P(None, axis)`, when nothing else splits them), the state (`P()`)
and the batch arguments (split on their first axis over `batch_axes`), in which the adapter rebuilds the model (the rest gathered, the stacked
parameters as placeholders that only the adapter's `call_layers` hook can run), calls the user's
function on it and, for gradients, differentiates with respect to the shards: the result has the
shards' shapes and shardings, ready for optax outside the shard_map. The shard_map is jitted (inlined
under the caller's jit; an eager call would dispatch tide's starts and dones separately).

`Context.scan` is the hook's loop: `scan_layers` over one stack. Called under `jax.vmap` (an Equinox
model run per example), it moves the vmap inside the layer with `custom_vmap`, so a layer is gathered
and reduce-scattered once for the whole batch, not once per example.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import _compat, _ops
from ._layout import Layout, crop_blocks, pad_blocks, spec_leaves
from ._layout import layout as _layout
from ._loop import remat_policy, scan_layers

_REDUCIBLE = tuple(np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32))


def is_array(x) -> bool:
    """A JAX or NumPy array (tracers included); Python scalars are not."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def dtype_name(x) -> str:
    dt = getattr(x, "dtype", None)
    return str(dt) if dt is not None else type(x).__name__


def is_float(x) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def shape_of(x) -> tuple:
    return tuple(int(d) for d in np.shape(x)) if not hasattr(x, "shape") else tuple(int(d) for d in x.shape)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


@dataclasses.dataclass
class _Stack:
    name: str  # the stack's path, e.g. "blocks"
    params: list  # indices into Plan.params
    state: list  # indices into Plan.state (arrays under the stack: per-layer state)
    num: int  # L
    lay: Layout  # ONE layer's layout, keyed by the parameters' full paths


class Placeholder:
    """Stands in for a stacked layer parameter while the model runs under the front door: the
    stacked parameters exist only as FSDP shards, which the adapter's `call_layers` hook gathers
    one layer at a time. Anything else that touches one fails with a message saying so."""

    __slots__ = ("ctx", "sid", "path", "shape", "dtype")

    def __init__(self, ctx, sid: int, path: str, shape, dtype):
        self.ctx, self.sid, self.path = ctx, sid, path
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _message(self) -> str:
        plan = self.ctx.plan
        return (f"tide: {self.path} is a parameter of the stacked layers {plan.stacks[self.sid].name!r}, held as "
                f"FSDP shards: the model must run those layers through {plan.hook}(self."
                f"{plan.stacks[self.sid].name}, x, ...) (README 'Your own model'), which gathers one layer at a "
                "time; it was used directly")

    def __repr__(self) -> str:
        return f"<{self._message()}>"

    def _refuse(self, *args, **kwargs):
        raise TypeError(self._message())

    __array__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __matmul__ = __rmatmul__ = __truediv__ = __rtruediv__ = __getitem__ = __neg__ = _refuse
    __pow__ = __rpow__ = __lt__ = __le__ = __gt__ = __ge__ = astype = reshape = _refuse
    __float__ = __int__ = _refuse


class Context:
    """One traced run: the local stacked shards (as the differentiated function sees them)."""

    def __init__(self, plan: "Plan", stack_shards: list):
        self.plan = plan
        self.stack_shards = stack_shards

    def scan(self, sid: int, layer_fn, carry, xs, extra, remat):
        """`scan_layers` over stack `sid`: `layer_fn(params, carry, xs_i, extra) -> carry` with
        `params` keyed by the parameters' full paths and `extra` what the layers share (the hook's
        arguments). `remat`: the hook's (the plan's wins when set).

        Under `jax.vmap` (an Equinox model called per example), the loop is not vmapped: the vmap
        moves inside the layer (`custom_vmap`), so each layer is still gathered and its gradient
        reduce-scattered once for the whole batch."""
        plan = self.plan
        stack = plan.stacks[sid]
        if plan.remat is not None:
            remat = plan.remat
        shards = self.stack_shards[sid]
        e_leaves, e_tree = jax.tree_util.tree_flatten(extra)
        e_dyn = [j for j, v in enumerate(e_leaves) if is_array(v)]

        def with_extra(dyn):
            lv = list(e_leaves)
            for j, v in zip(e_dyn, dyn):
                lv[j] = v
            return jax.tree_util.tree_unflatten(e_tree, lv)

        def direct(fn, carry, xs, dyn):
            ex = with_extra(dyn)
            if xs is None:
                body = lambda p, c: fn(p, c, None, ex)  # noqa: E731
            else:
                body = lambda p, c, x: fn(p, c, x, ex)  # noqa: E731
            return scan_layers(body, carry, shards, stack.lay, xs=xs, prefetch=plan.prefetch, remat=remat,
                               reshard_after_forward=plan.reshard, dtype=plan.dtype, backend=plan.backend)

        def call(fn, carry, xs, dyn):
            # custom_vmap has no reverse mode of its own: used only where a vmap is there to apply it
            if not _under_vmap((carry, xs, dyn)):
                return direct(fn, carry, xs, dyn)

            @jax.custom_batching.custom_vmap
            def run(carry, xs, dyn):
                return direct(fn, carry, xs, dyn)

            @run.def_vmap
            def rule(axis_size, in_batched, carry, xs, dyn):
                c_b, x_b, d_b = in_batched
                carry = jax.tree.map(lambda c, b: c if b else jnp.broadcast_to(c, (axis_size, *jnp.shape(c))),
                                     carry, c_b)
                # per-layer inputs: the layer axis first again, the batch axis second
                x_axes = jax.tree.map(lambda b: 0 if b else None, x_b)
                xs = jax.tree.map(lambda t, b: jnp.moveaxis(t, 0, 1) if b else t, xs, x_b)
                d_axes = [0 if b else None for b in d_b]

                def inner(p, c, x, ex):
                    def one(c1, x1, d1):
                        return fn(p, c1, x1, with_extra(d1))

                    return jax.vmap(one, in_axes=(0, x_axes, d_axes))(c, x, _dyn_of(ex, e_dyn))

                return call(inner, carry, xs, dyn), jax.tree.map(lambda _: True, carry)

            return run(carry, xs, dyn)

        return call(layer_fn, carry, xs, [e_leaves[j] for j in e_dyn])


def _under_vmap(tree) -> bool:
    """Whether a leaf of `tree` is being vmapped (a batching tracer at the current level)."""
    try:
        from jax._src.interpreters.batching import BatchTracer
    except Exception:  # noqa: BLE001 - JAX internals moved: leave vmap to scan_layers itself
        return False
    return any(isinstance(x, BatchTracer) for x in jax.tree_util.tree_leaves(tree))


def _dyn_of(extra, e_dyn):
    leaves = jax.tree_util.tree_leaves(extra)
    return [leaves[j] for j in e_dyn]


def find_placeholders(leaves):
    """(context, stack id) of the first stack placeholder among `leaves`, None when there is none."""
    for x in leaves:
        if isinstance(x, Placeholder):
            return x.ctx, x.sid
    return None


def check_stack(ctx, sid: int, param_leaves, hook: str):
    """`param_leaves` (a module's parameter leaves) must be exactly stack `sid`'s placeholders."""
    stack = ctx.plan.stacks[sid]
    want = {ctx.plan.params[i].path for i in stack.params}
    phs = [x for x in param_leaves if isinstance(x, Placeholder)]
    ok = (len(phs) == len(param_leaves) and {p.path for p in phs} == want
          and all(p.ctx is ctx and p.sid == sid for p in phs))
    if not ok:
        raise ValueError(
            f"tide: {hook}: pass the whole stack of layers {stack.name!r} (what the model was sharded with, "
            f"layers={stack.name!r}), not a part of it or a module holding more than it"
        )


@dataclasses.dataclass
class _Param:
    path: str
    shape: tuple  # full (stacked for stack parameters)
    dtype: np.dtype
    sid: int | None


@dataclasses.dataclass
class _State:
    path: str
    array: bool
    sid: int | None


class Plan:
    """How a model's leaves are sharded and run (the module docstring)."""

    def __init__(self, params: Sequence[tuple[str, Any]], state: Sequence[tuple[str, Any]], stacks,
                 mesh: Mesh, axis: str, *, dtype, remat, prefetch, reshard_after_forward, backend,
                 batch_axes, hook: str, what: str, specs: Sequence | None = None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"tide: {what}: needs a jax.sharding.Mesh, got {type(mesh).__name__}")
        if axis not in mesh.axis_names:
            raise ValueError(f"tide: {what}: the mesh has axes {tuple(mesh.axis_names)}, no axis {axis!r}")
        self.mesh, self.axis, self.world = mesh, axis, int(mesh.shape[axis])
        self.hook, self.what = hook, what
        self.dtype = dtype
        self.remat = None if remat is None else remat_policy(remat)
        self.prefetch, self.reshard = prefetch, bool(reshard_after_forward)
        self.backend = backend
        self._batch_axes_arg = batch_axes

        if isinstance(stacks, str):
            stacks = (stacks,)
        stacks = [str(s).strip(".") for s in (stacks or ())]
        for i, a in enumerate(stacks):
            for b in stacks[i + 1:]:
                if _under(a, b) or _under(b, a):
                    raise ValueError(f"tide: {what}: stacks {a!r} and {b!r} overlap")

        self._stack_names = list(stacks)

        def stack_of(path):
            for sid, s in enumerate(stacks):
                if _under(path, s):
                    return sid
            return None

        self.params: list[_Param] = []
        for path, x in params:
            if not is_array(x):
                raise TypeError(f"tide: {what}: parameter {path} is a {type(x).__name__}, not an array")
            dt = np.dtype(x.dtype) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else None
            if dt is not None and jnp.issubdtype(dt, jnp.complexfloating):
                raise TypeError(
                    f"tide: {what}: parameter {path} has dtype {dt.name}: the front doors keep float32 master "
                    "shards and cannot train complex parameters; store the real and imaginary parts as two "
                    "float32 parameters (w = w_re + 1j * w_im), or gather it with tide_jax.all_gather, whose "
                    "backward sums complex gradients in their own dtype"
                )
            if dt is None or not jnp.issubdtype(dt, jnp.floating):
                raise TypeError(
                    f"tide: {what}: parameter {path} has dtype {dtype_name(x)}: tide shards and differentiates "
                    "floating parameters only; keep integer, boolean and PRNG-key state out of the parameters "
                    f"({self._state_hint()}) and it is passed through unsharded (replicated)"
                )
            if dt not in _REDUCIBLE:
                raise TypeError(
                    f"tide: {what}: parameter {path} has dtype {dt.name}: gradients are reduce-scattered in "
                    "bfloat16, float16 or float32 only; cast the model's parameters to float32"
                )
            shape = shape_of(x)
            self.params.append(_Param(path, shape, dt, stack_of(path)))
        self.state: list[_State] = [_State(path, is_array(x), stack_of(path)) for path, x in state]
        self.specs = self._layer_specs(specs)
        self._set_batch_axes(self._batch_axes_arg)

        self.stacks: list[_Stack] = []
        for sid, name in enumerate(stacks):
            idx = [i for i, p in enumerate(self.params) if p.sid == sid]
            if not idx:
                tops = sorted({p.path.split(".")[0] for p in self.params})
                raise ValueError(
                    f"tide: {what}: layers={name!r} names no parameters; the model's parameters are under "
                    f"{', '.join(map(repr, tops))}"
                )
            num = None
            for i in idx:
                p = self.params[i]
                if not p.shape:
                    raise ValueError(
                        f"tide: {what}: {p.path} (shape ()) is under the stacked layers {name!r} but has no layer "
                        "axis: every parameter of the stack needs the layers on its first axis (nnx.vmap / "
                        "eqx.filter_vmap at creation)"
                    )
                if num is None:
                    num, first = p.shape[0], p.path
                elif p.shape[0] != num:
                    raise ValueError(
                        f"tide: {what}: the stacked layers {name!r} disagree on their number: {first} has "
                        f"{num} on its first axis, {p.path} {p.shape[0]} (shape {p.shape}); is {name!r} the "
                        "stack of layers (created with nnx.vmap / eqx.filter_vmap)?"
                    )
            sidx = []
            for j, (st, (path, x)) in enumerate(zip(self.state, state)):
                if st.sid != sid or not st.array:
                    continue
                shape = shape_of(x)
                if not shape or shape[0] != num:
                    raise ValueError(
                        f"tide: {what}: {path} (shape {shape}, {dtype_name(x)}) is under the stacked layers "
                        f"{name!r} but its first axis is not the {num} layers: per-layer state must be stacked "
                        "like the parameters"
                    )
                sidx.append(j)
            one = {self.params[i].path: jax.ShapeDtypeStruct(self.params[i].shape[1:], self.params[i].dtype)
                   for i in idx}
            self.stacks.append(_Stack(name, idx, sidx, int(num), self._group_layout(one, idx)))
        self.rest = [i for i, p in enumerate(self.params) if p.sid is None]
        self.rest_lay = None
        if self.rest:
            self.rest_lay = self._group_layout(
                {self.params[i].path: jax.ShapeDtypeStruct(self.params[i].shape, self.params[i].dtype)
                 for i in self.rest}, self.rest)
        if not self.params:
            raise ValueError(f"tide: {what}: the model has no floating parameters to shard")
        self.infos = [self._info(i) for i in range(len(self.params))]

    # ----- meshes with several axes -----
    def _layer_specs(self, specs) -> list:
        """Each parameter's PartitionSpec over the mesh's other axes (None: replicated), as its layout
        takes it: a stacked parameter's spec is one layer's; one written for the whole stack (its
        rank) has the layer axis first, which must not be split."""
        if specs is None:
            return [None] * len(self.params)
        specs = list(specs)
        if len(specs) != len(self.params):  # pragma: no cover - the adapters align them
            raise ValueError(f"tide: {self.what}: {len(specs)} specs for {len(self.params)} parameters")
        out = []
        for p, spec in zip(self.params, specs):
            if spec is not None and not isinstance(spec, P):
                raise TypeError(f"tide: {self.what}: parameter {p.path}: its spec must be a PartitionSpec, got "
                                f"{type(spec).__name__} {spec!r}")
            if spec is not None and p.sid is not None and len(tuple(spec)) == len(p.shape):
                if tuple(spec)[0] not in (None, ()):
                    raise ValueError(
                        f"tide: {self.what}: parameter {p.path} (shape {p.shape}) is a parameter of the stacked "
                        f"layers {self.stacks_names[p.sid]!r}: its spec {spec} splits the layer axis (dim 0) over "
                        f"{tuple(spec)[0]!r}; the layer axis cannot be split (give one layer's spec)")
                spec = P(*tuple(spec)[1:])
            out.append(spec)
        return out

    def _set_batch_axes(self, batch_axes):
        """The mesh axes the batch is split over (default: every axis no parameter's spec names) and
        the replicas of the shards (those of them other than `axis`: HSDP)."""
        mesh, what = self.mesh, self.what
        model_axes = {}
        for p, spec in zip(self.params, self.specs):
            for entry in tuple(spec or ()):
                for a in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
                    model_axes.setdefault(a, p.path)
        if batch_axes is None:
            batch_axes = tuple(a for a in mesh.axis_names if a not in model_axes)
        elif isinstance(batch_axes, str):
            batch_axes = (batch_axes,)
        batch_axes = tuple(batch_axes)
        for a in batch_axes:
            if a not in mesh.axis_names:
                raise ValueError(f"tide: {what}: batch_axes names {a!r}, the mesh has axes {tuple(mesh.axis_names)}")
            if a in model_axes:
                raise ValueError(
                    f"tide: {what}: batch_axes names {a!r}, but parameter {model_axes[a]}'s spec splits it over "
                    f"{a!r}: the devices along an axis that splits the parameters must see the same batch")
        if self.axis not in batch_axes:
            raise ValueError(
                f"tide: {what}: batch_axes={batch_axes} leaves out the FSDP axis {self.axis!r}: every rank along "
                f"it holds a shard of every parameter and trains on its own part of the batch (FSDP is data "
                f"parallel), so the batch must be split over {self.axis!r} too, e.g. batch_axes="
                f"{tuple(dict.fromkeys((*batch_axes, self.axis)))}")
        self.batch_axes = batch_axes
        self.replicas = tuple(a for a in batch_axes if a != self.axis)
        self.n_batch = int(np.prod([mesh.shape[a] for a in batch_axes])) if batch_axes else 1
        self.batch_spec = P(batch_axes if len(batch_axes) != 1 else batch_axes[0]) if batch_axes else P()

    @property
    def stacks_names(self) -> list:
        return self._stack_names

    def _group_layout(self, abstract: dict, idx: list) -> Layout:
        """The layout of one parameter group (a stack's ONE layer, or the rest), keyed by path."""
        specs = {self.params[i].path: self.specs[i] or P() for i in idx}
        try:
            return _layout(abstract, self.mesh, self.axis, specs=specs, replicas=self.replicas)
        except ValueError as e:
            # A stack's spec shorter than the stacked rank is read as one layer's (`_layer_specs`): a
            # spec meant for the stack with its trailing Nones left out splits the wrong dims.
            short = [self.params[i].path for i in idx if self.params[i].sid is not None and self.specs[i] is not None
                     and 0 < len(tuple(self.specs[i])) < len(self.params[i].shape)]
            if not short:
                raise
            raise ValueError(
                f"{e} (the specs of stacked layers' parameters {', '.join(short)} were read as ONE layer's: "
                "a spec is the stack's only with one entry per stacked dimension, the layer axis first, "
                "e.g. P(None, 'expert', None, None) for an (L, E, F, D) stack)") from None

    def _info(self, i: int):
        """Parameter i's `ParamInfo` in its group's layout (one layer's, for a stack)."""
        p = self.params[i]
        lay = self.rest_lay if p.sid is None else self.stacks[p.sid].lay
        return jax.tree_util.tree_unflatten(lay.treedef, lay.params)[p.path]

    def _state_hint(self) -> str:
        return ("NNX: an nnx.Variable that is not an nnx.Param" if "nnx" in self.hook else
                "Equinox: every non-floating array is state")

    # ----- shards -----
    def global_shape(self, i: int) -> tuple:
        """The global shard array's shape of parameter i: its layout's, stacks (L, ...)."""
        p, info = self.params[i], self.infos[i]
        return info.global_shape if p.sid is None else (p.shape[0], *info.global_shape)

    def spec(self, i: int):
        """The PartitionSpec of parameter i's global shard array (P(axis), stacks P(None, axis), when
        its spec is P())."""
        p = self.params[i]
        lay = self.rest_lay if p.sid is None else self.stacks[p.sid].lay
        return lay.param_spec(self.infos[i], stacked=p.sid is not None)

    def full_sharding(self, i: int) -> NamedSharding:
        """How parameter i's full value is placed on the mesh: split as its spec says (stacks: a
        layer axis first), replicated under P()."""
        p = self.params[i]
        spec = tuple(self.infos[i].spec)
        return NamedSharding(self.mesh, P(*spec) if p.sid is None else P(None, *spec))

    def _lead(self, i: int) -> tuple:
        p = self.params[i]
        return () if p.sid is None else (p.shape[0],)

    def shard(self, values: list) -> list:
        """Full parameters (in `params` order) -> global shard arrays: zero-padded rows of each block,
        sharded as `spec` (stacks: per layer). One compiled function for the whole model."""
        if getattr(self, "_shard_fn", None) is None:
            fns = [pad_blocks(self.infos[i], self._lead(i)) for i in range(len(self.params))]
            shardings = [NamedSharding(self.mesh, self.spec(i)) for i in range(len(self.params))]
            self._shard_fn = jax.jit(lambda xs: [f(x) for f, x in zip(fns, xs)], out_shardings=shardings)
        for p, x in zip(self.params, values):
            if shape_of(x) != p.shape:
                raise ValueError(f"tide: {self.what}: {p.path} has shape {shape_of(x)}, expected the full {p.shape}")
        return list(self._shard_fn([jnp.asarray(x) for x in values]))

    def unshard(self, values: list) -> list:
        """Global shard arrays -> full parameters (split as their specs say; replicated under P()),
        padding dropped."""
        self.check_sharded(values, "unshard")
        full = [self.full_sharding(i) for i in range(len(self.params))]
        if getattr(self, "_unshard_fn", None) is None:
            fns = [crop_blocks(self.infos[i], self._lead(i)) for i in range(len(self.params))]
            self._unshard_fn = jax.jit(lambda xs: [f(x) for f, x in zip(fns, xs)], out_shardings=full)
        # placed as the result first (dim 0 split over the block axes only, which divide it): slicing a
        # sharded dim to a size the mesh does not divide is not expressible under explicit sharding
        return list(self._unshard_fn([jax.device_put(x, sh) for x, sh in zip(values, full)]))

    def place_state(self, values: list) -> list:
        rep = NamedSharding(self.mesh, P())
        return [jax.device_put(v, rep) if st.array and isinstance(v, (jax.Array, np.ndarray)) else v
                for st, v in zip(self.state, values)]

    def check_sharded(self, values: list, what: str):
        if len(values) != len(self.params):
            raise ValueError(
                f"tide: {what}: the model has {len(values)} parameters, the sharded model had {len(self.params)}: "
                "was it sharded by this front door?"
            )
        for i, (p, x) in enumerate(zip(self.params, values)):
            want = self.global_shape(i)
            shape = shape_of(x)
            if shape != want:
                hint = ""
                if shape == p.shape:
                    hint = (" (its full, unsharded shape: pass the model sharded by "
                            f"{self.hook.rsplit('.', 1)[0]}.shard, which shards it in place / returns it)")
                raise ValueError(
                    f"tide: {what}: parameter {p.path} has shape {shape}, its FSDP shards have {want}{hint}"
                )

    def _place(self, x, spec):
        """`x` resharded to `spec` on the mesh where its type says otherwise (explicit axes)."""
        try:
            cur = jax.typeof(x).sharding
            cur_spec = getattr(cur, "spec", None)
            ndim = len(shape_of(x))
            if cur_spec is not None and _norm(cur_spec, ndim) == _norm(spec, ndim):
                return x
        except Exception:  # noqa: BLE001 - numpy inputs and the like: let reshard place them
            pass
        return jax.reshard(x, NamedSharding(self.mesh, spec))

    # ----- one FSDP computation -----
    def run(self, local_fn: Callable, params: list, state: list, args: tuple, *, mode: str, with_state: bool):
        """`local_fn(param_values, state_values, args) -> (out, new_state_values | None)` on every device,
        `param_values` the rest gathered and the stacked ones as `Placeholder`s. `mode`: "grad" (out
        is the scalar loss), "grad_aux" (out is (loss, aux)) or "apply" (out any pytree).

        Returns (out, grads | None, new_state | None): the loss averaged over the batch shards
        (gradients of that mean, as the shards' global arrays); aux / apply outputs: 0-d leaves
        averaged, the others concatenated along their first axis (per-example values)."""
        self.check_sharded(params, self.what)
        mesh, axis = self.mesh, self.axis
        stack_in = [{self.params[i].path: params[i] for i in s.params} for s in self.stacks]
        rest_in = {self.params[i].path: params[i] for i in self.rest}
        st_arrays = [v for st, v in zip(self.state, state) if st.array]
        st_static = [v for st, v in zip(self.state, state) if not st.array]
        arg_leaves, arg_tree = jax.tree_util.tree_flatten(args)
        arg_kind = []  # "batch" | "replicated" | "static"
        for j, x in enumerate(arg_leaves):
            if not is_array(x):
                arg_kind.append("static")
            elif not shape_of(x):
                arg_kind.append("replicated")
            else:
                rows = shape_of(x)[0]
                if rows % self.n_batch:
                    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(args)[0][j][0])
                    raise ValueError(
                        f"tide: {self.what}: argument{path} has {rows} rows (shape {shape_of(x)}): the batch "
                        f"arguments are split on their first axis over {self.n_batch} devices "
                        f"(mesh axes {self.batch_axes}), which must divide it"
                    )
                arg_kind.append("batch")
        arg_dyn = [x for x, k in zip(arg_leaves, arg_kind) if k != "static"]
        arg_specs = [self.batch_spec if k == "batch" else P() for k in arg_kind if k != "static"]
        n = self.n_batch
        batch_axes = self.batch_axes
        grad = mode != "apply"

        def rebuild_state(arrays):
            it_a, it_s = iter(arrays), iter(st_static)
            return [next(it_a) if st.array else next(it_s) for st in self.state]

        def rebuild_args(dyn):
            it_d, it_s = iter(dyn), iter(x for x, k in zip(arg_leaves, arg_kind) if k == "static")
            return jax.tree_util.tree_unflatten(arg_tree, [next(it_s) if k == "static" else next(it_d) for k in arg_kind])

        def forward(stack_sh, rest_sh, st_arr, dyn):
            ctx = Context(self, stack_sh)
            values = [None] * len(self.params)
            if self.rest:
                full = _ops.gather_params(rest_sh, self.rest_lay, self.dtype, backend=self.backend)
                for i in self.rest:
                    values[i] = full[self.params[i].path]
            for sid, s in enumerate(self.stacks):
                for i in s.params:
                    p = self.params[i]
                    values[i] = Placeholder(ctx, sid, p.path, p.shape, self.dtype or p.dtype)
            out, new_state = local_fn(values, rebuild_state(st_arr), rebuild_args(dyn))
            new_arrays = []
            if with_state:
                for st, v in zip(self.state, new_state):
                    if not st.array:
                        continue
                    vma = _compat.vma_of(v) if is_array(v) else frozenset()
                    if vma:
                        raise ValueError(
                            f"tide: {self.what}: the state {st.path} ({dtype_name(v)}) is changed by the forward "
                            f"differently on each device (it depends on the local batch: it varies over "
                            f"{sorted(vma)}); tide keeps a model's non-parameter state replicated: reduce it over "
                            "the devices in the model (e.g. nnx.BatchNorm(..., axis_name=...)) or keep it out of "
                            "the training forward"
                        )
                    new_arrays.append(v)
            return out, new_arrays

        def local_out(x):
            """aux / apply outputs: 0-d -> mean over the batch shards; others concatenated."""
            if not is_array(x):
                raise TypeError(f"tide: {self.what}: outputs must be arrays, got a {type(x).__name__}")
            x = _compat.mark_varying(jnp.asarray(x), list(batch_axes))
            return x[None]

        def inner(stack_sh, rest_sh, st_arr, dyn):
            if grad:
                def loss_fn(stack_sh, rest_sh):
                    out, new_arrays = forward(stack_sh, rest_sh, st_arr, dyn)
                    if mode == "grad_aux":
                        if not (isinstance(out, (tuple, list)) and len(out) == 2):
                            raise TypeError(
                                f"tide: {self.what}: with has_aux=True the function must return (loss, aux), got "
                                f"{type(out).__name__}"
                            )
                        loss, aux = out
                    else:
                        loss, aux = out, None
                    if not is_array(loss) or shape_of(loss) != () or not jnp.issubdtype(loss.dtype, jnp.floating):
                        raise TypeError(
                            f"tide: {self.what}: the function must return a scalar floating loss (the mean over its "
                            f"batch), got {dtype_name(loss)}{list(shape_of(loss)) if is_array(loss) else ''}"
                            + ("" if mode == "grad_aux" else "; with auxiliary outputs pass has_aux=True")
                        )
                    loss = _compat.mark_varying(loss.astype(jnp.float32), list(batch_axes))
                    return loss / n, (loss, aux, new_arrays)

                (_, (loss, aux, new_arrays)), (g_stack, g_rest) = jax.value_and_grad(
                    loss_fn, argnums=(0, 1), has_aux=True)(stack_sh, rest_sh)
                loss = jax.lax.psum(loss, batch_axes) / n if batch_axes else loss
                aux = jax.tree.map(local_out, aux)
                return loss, aux, g_stack, g_rest, new_arrays
            out, new_arrays = forward(stack_sh, rest_sh, st_arr, dyn)
            return jax.tree.map(local_out, out), new_arrays

        stack_specs = [s.lay.stacked_spec for s in self.stacks]
        rest_spec = self.rest_lay.spec if self.rest else {}
        st_specs = [P() for _ in st_arrays]
        in_specs = (stack_specs, rest_spec, st_specs, arg_specs)
        new_specs = [P() for _ in st_arrays] if with_state else []
        if grad:
            out_specs = (P(), self.batch_spec, stack_specs, rest_spec, new_specs)
        else:
            out_specs = (self.batch_spec, new_specs)
        # jit: inlined under the caller's jit; called eagerly, shard_map would dispatch tide's starts
        # and dones as separate computations
        fn = jax.jit(_compat.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
        if _explicit(mesh):  # explicit mesh axes: shard_map wants inputs already typed as in_specs say
            stack_in = [{k: self._place(v, sp[k]) for k, v in d.items()} for d, sp in zip(stack_in, stack_specs)]
            rest_in = {k: self._place(v, rest_spec[k]) for k, v in rest_in.items()}
            st_arrays = [self._place(v, P()) for v in st_arrays]
            arg_dyn = [self._place(v, sp) for v, sp in zip(arg_dyn, arg_specs)]
        res = fn(stack_in, rest_in, st_arrays, arg_dyn)

        def finish(x):
            x = jnp.reshape(x, (-1, *x.shape[2:])) if x.ndim > 1 else jnp.mean(x)
            return x

        if grad:
            loss, aux, g_stack, g_rest, new_arrays = res
            grads = [None] * len(self.params)
            for s, g in zip(self.stacks, g_stack):
                for i in s.params:
                    grads[i] = g[self.params[i].path]
            for i in self.rest:
                grads[i] = g_rest[self.params[i].path]
            out = loss if mode == "grad" else (loss, jax.tree.map(finish, aux))
        else:
            out_raw, new_arrays = res
            out, grads = jax.tree.map(finish, out_raw), None
        new_state = None
        if with_state:
            it = iter(new_arrays)
            new_state = [next(it) if st.array else v for st, v in zip(self.state, state)]
        return out, grads, new_state


def _explicit(mesh) -> bool:
    return any(str(t).endswith("Explicit") for t in (getattr(mesh, "axis_types", None) or ()))


def _norm(spec, ndim: int) -> tuple:
    parts = list(tuple(spec)) + [None] * max(0, ndim - len(tuple(spec)))
    return tuple(None if p in ((), None) else (p if isinstance(p, tuple) and len(p) != 1 else
                 (p[0] if isinstance(p, tuple) else p)) for p in parts[:max(ndim, len(tuple(spec)))])


# ----------------------------------------------------------------------------------------------
# shared helpers for the adapters
# ----------------------------------------------------------------------------------------------
class FrontDoor:
    """What the adapters' FSDP objects share: their plan's mesh, axis, layouts and specs, a repr, and
    `grad` from `value_and_grad`. Pure Python: close over it in a jitted step."""

    NAME = "tide_jax"

    def __init__(self, plan: Plan):
        self.plan = plan

    @property
    def mesh(self):
        return self.plan.mesh

    @property
    def axis(self) -> str:
        return self.plan.axis

    @property
    def batch_axes(self) -> tuple:
        """The mesh axes the batch arguments are split over (default: those no parameter is split over)."""
        return self.plan.batch_axes

    @property
    def layouts(self) -> dict:
        """{stack path: ONE layer's Layout, ..., "rest": the other parameters' Layout (or None)}."""
        out = {s.name: s.lay for s in self.plan.stacks}
        out["rest"] = self.plan.rest_lay
        return out

    @property
    def specs(self) -> dict:
        """{parameter path: its PartitionSpec over the mesh's other axes} (one layer's for a stack)."""
        return {p.path: info.spec for p, info in zip(self.plan.params, self.plan.infos)}

    def _repr_extra(self) -> str:
        return ""

    def __repr__(self) -> str:
        plan = self.plan
        stacks = ", ".join(f"{s.name!r}: {s.num} layers x {len(s.params)} params" for s in plan.stacks)
        split = sum(bool(tuple(info.spec)) for info in plan.infos)
        split = f", {split} params split over {sorted({a for i in plan.infos for a in _axes_of(i.spec)})}" if split else ""
        return (f"{self.NAME}.FSDP(axis={self.axis!r}, world={plan.world}, {stacks}, {len(plan.rest)} other params"
                f"{split}, batch over {plan.batch_axes}, {sum(st.array for st in plan.state)} state arrays passed "
                f"through{self._repr_extra()})")

    @staticmethod
    def grad_of(value_and_grad: Callable, has_aux: bool) -> Callable:
        """`(model, *batch) -> grads` (`(grads, aux)` with has_aux) from a value_and_grad function."""

        def wrapped(model, *args):
            out, grads = value_and_grad(model, *args)
            return (grads, out[1]) if has_aux else grads

        return wrapped


def _axes_of(spec) -> list:
    return [a for e in tuple(spec) for a in ((e,) if isinstance(e, str) else tuple(e or ()))]


def specs_from_tree(specs, model, count: int, what: str) -> list:
    """Per leaf of `model` (`count` of them, in `jax.tree_util` order), the spec `specs` gives it: a
    pytree matching the model or a prefix of it, PartitionSpecs or None."""
    return spec_leaves(specs, model, count, f"{what}: the model's specs")


def layer_items(layers, what: str, example: str) -> list:
    """`layers=` as a list of paths and selector functions (refusing a missing one)."""
    if layers is None:
        raise TypeError(f"tide: {what}: pass layers=, the path of the stacked layers (e.g. layers={example!r})")
    return list(layers) if isinstance(layers, (list, tuple)) else [layers]


def default_call(layer, carry, *args, **kwargs):
    """`call_layers`' default: `layer(carry, *args, **kwargs)`."""
    return layer(carry, *args, **kwargs)


def path_str(key_path, drop_value: bool = False) -> str:
    """A jax key path as a dotted name: ('blocks', 'lin', 'kernel') -> "blocks.lin.kernel"."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if drop_value and parts and parts[-1] == "value":
        parts = parts[:-1]
    return ".".join(parts)


def cast_like(out, carry, hook: str):
    """The layer's output carry cast to the input carry's dtypes (a scan needs one carry type)."""
    ot, ct = jax.tree_util.tree_structure(out), jax.tree_util.tree_structure(carry)
    if ot != ct:
        raise ValueError(
            f"tide: {hook}: a layer must return a carry of the structure it was given: got {ot}, expected {ct}"
        )
    return jax.tree.map(lambda o, c: o.astype(c.dtype) if is_array(o) and is_array(c) and o.dtype != c.dtype else o,
                        out, carry)


def plain_checkpoint(fn, remat):
    """`fn` under the activation policy `remat` for the plain (`lax.scan`) loop; inside a scan body
    the recompute cannot be merged with the forward, so CSE need not be prevented (JAX's advice)."""
    remat = remat_policy(remat)
    if remat is None or remat is False:
        return fn
    return jax.checkpoint(fn, policy=None if remat is True else remat, prevent_cse=False)
