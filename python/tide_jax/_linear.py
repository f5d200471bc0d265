"""`linear(forward, transpose, leaves)`: a linear map made of tide calls, as one JAX primitive that
every transformation understands.

The FFI calls have no derivative of their own. Each public collective is linear in its operands, so
it is bound as `tide_linear`, a primitive whose rules follow from linearity:
- jvp: the map applied to the tangents (forward mode, `jax.jvp`, `jax.jacfwd`, `jax.hessian`,
  Hessian-vector products as jvp of grad);
- transpose: the caller's `transpose` (reverse mode: the all-gather's is the reduce-scatter of the
  cotangent, and back), itself made of public ops, so derivatives of any order compose;
- batching: the map under `jax.vmap` (each FFI call batched sequentially, as before);
- lowering: the traced forward, inlined.

Contract of `forward` / `transpose`: functions of a list of arrays returning a list, linear in every
element, tracing only tide calls and jax.numpy on their arguments (no tracer closed over), and
block-diagonal: output i depends on input i alone (true of every collective here: each parameter is
gathered or scattered on its own). `forward(xs)` may get None in place of some inputs and then
returns None at those outputs, computing nothing for them. `transpose(cts, needed)` takes one
cotangent per output and returns one per input where `needed[i]` (the operands JAX differentiates),
None elsewhere.

Zeros: only leaves with a tangent or cotangent to move cost a collective. The jvp maps the leaves
whose tangents are not symbolic zeros, and only those of inexact type; the others' output tangents
are symbolic zeros (forward mode in the adapters of a LoRA group gathers no tangent of the frozen
base). The transpose computes the cotangents JAX asks for whose outputs' cotangents are not symbolic
zeros (a frozen parameter beside trained ones, or one the loss does not use, costs no reduce-scatter);
the others are None (zero). JAX's own `linear_call` fails on symbolic zeros. The traced forward is traced afresh for
every bind, so a jvp's tangent call is a call site of its own (docs/design.md "Call sites and
instances").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

tide_linear_p = Primitive("tide_linear")
tide_linear_p.multiple_results = True


def linear(forward, transpose, leaves: list) -> list:
    """`forward(leaves)` bound as one `tide_linear` primitive (contract: module docstring)."""
    leaves = list(leaves)
    callee = jax.make_jaxpr(lambda *xs: list(forward(list(xs))))(*leaves)
    return tide_linear_p.bind(*leaves, callee=callee, forward=forward, transpose=transpose)


def _impl(*args, callee, forward, transpose):
    del forward, transpose
    return jaxpr_as_fun(callee)(*args)


def _abstract_eval(*avals, callee, forward, transpose):
    del avals, forward, transpose
    return callee.out_avals, callee.effects


def _has_tangents(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _jvp(primals, tangents, *, callee, forward, transpose):
    out = tide_linear_p.bind(*primals, callee=callee, forward=forward, transpose=transpose)
    t_out = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    # Integer leaves (float0 tangents) and symbolic-zero tangents map to symbolic zeros: left out.
    idx = [i for i, (p, t) in enumerate(zip(primals, tangents)) if type(t) is not ad.Zero and _has_tangents(p.dtype)]
    if idx:
        sub_forward, sub_transpose = _restrict(forward, transpose, idx, callee.out_avals)
        for i, t in zip(idx, linear(sub_forward, sub_transpose, [tangents[i] for i in idx])):
            if _has_tangents(out[i].dtype):
                t_out[i] = t
    return out, t_out


def _restrict(forward, transpose, idx: list, out_avals: list):
    """The map on the inputs `idx` alone (a block of a block-diagonal map): (forward, transpose) of
    the sub-lists. All of them: the map itself, so the same call as without zeros."""
    n = len(out_avals)
    if len(idx) == n:
        return forward, transpose

    def sub_forward(xs):
        full = [None] * n
        for i, x in zip(idx, xs):
            full[i] = x
        outs = forward(full)
        return [outs[i] for i in idx]

    def sub_transpose(cts, needed):
        # The other outputs' cotangents are never read (not needed): zeros of their types.
        full_cts = [jnp.zeros(a.shape, a.dtype) for a in out_avals]
        full_needed = [False] * n
        for i, ct, nd in zip(idx, cts, needed):
            full_cts[i], full_needed[i] = ct, nd
        res = transpose(full_cts, full_needed)
        return [res[i] for i in idx]

    return sub_forward, sub_transpose


def _transpose(cts, *args, callee, forward, transpose):
    del forward
    # Only the operands JAX differentiates get a cotangent, and only where their output's cotangent
    # is not a symbolic zero (a parameter the loss does not use): the others (constants, integer
    # shards) are left out of the transposed collective altogether (block-diagonal: output i comes
    # from operand i alone).
    needed = [ad.is_undefined_primal(x) and _has_tangents(x.aval.dtype) and type(ct) is not ad.Zero
              for x, ct in zip(args, cts)]
    if not any(needed):
        return [None] * len(args)
    cts = [ad.instantiate_zeros(ct) if _has_tangents(a.dtype) else jnp.zeros(a.shape, a.dtype)
           for ct, a in zip(cts, callee.out_avals)]
    res = list(transpose(cts, needed))
    return [r if n else None for n, r in zip(needed, res)]


def _batch(args, dims, *, callee, forward, transpose):
    del callee
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    # Unbatched operands are broadcast: the map is applied to each batch element on its own.
    args = [jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(args, dims)]

    def vforward(xs):
        return jax.vmap(lambda *x: list(forward(list(x))))(*xs)

    def vtranspose(cts, needed):
        return jax.vmap(lambda *c: list(transpose(list(c), needed)))(*cts)

    outs = linear(vforward, vtranspose, args)
    return outs, [0] * len(outs)


tide_linear_p.def_impl(_impl)
tide_linear_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[tide_linear_p] = _jvp
ad.primitive_transposes[tide_linear_p] = _transpose
batching.primitive_batchers[tide_linear_p] = _batch
mlir.register_lowering(tide_linear_p, mlir.lower_fun(_impl, multiple_results=True))

__all__ = ["linear", "tide_linear_p"]
