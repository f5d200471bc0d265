"""The in-flight bound, kept while tracing (docs/design.md "Start/done", [Note: in-flight lanes]).

On GPUs the engine runs at most TIDE_MAX_IN_FLIGHT (K) calls of one op per device between their start
and their done (each holds a slot: streams, events, staging); a start beyond that fails at run time.
A program that writes one start per done can still get there: XLA schedules a start as early as its
operands allow, so six reduce-scatter starts of gradients that are ready at entry may all be issued
first. While a program is traced, tide_jax sees every hand-written start and done
(`all_gather_start` / `reduce_scatter_start` and their dones) and makes that schedule impossible.

[Note: in-flight lanes]
Each op has K - 1 lanes per traced program (one slot is left for the synchronous calls, all_gather /
reduce_scatter / gather_params, which XLA runs one at a time on a device, each holding a slot only
for its own duration). A start takes a lane whose previous start's done has been traced, and takes a
data dependency on that done: its operands go through one optimization barrier (the one every start
has) with a value of that done's results (a one-element slice where the results are large, so no
gathered layer is held for it). A lane's calls are then start, done, start, done, ... in every
schedule XLA can choose, so at most K - 1 starts of an op are in flight. Lanes are taken
least-recently-freed first: a start waits for the done K - 1 starts before it, as in the program's
own order, and XLA keeps the freedom to issue the K - 2 after that early. A start traced while every
lane is busy (K - 1 starts of the op outstanding in the program's own order) runs the synchronous
collective instead (its done passes the result on) and warns: it cannot run early without a slot.

Nested traces (a `lax.fori_loop` / `scan` / `cond` body, `jax.checkpoint`, an inner `jax.jit`): a
start in a body sees the lanes of the traces around it (a done there is closed over by the body, so
the whole loop waits for it). Once a body is traced, the lanes it used are not taken again by a start
of the enclosing trace: XLA may issue that start before the loop and keep it in flight through it,
and nothing the body traced is reachable from outside it to tie to. Two loop or cond bodies run one
after the other (XLA executes a while loop or conditional as one instruction), so a later body may
reuse an earlier one's lanes; inlined sub-traces (checkpoint, an inner jit) may interleave, so they
do not. A handle carried from one loop iteration to the next is not supported (XLA copies carried
buffers, and the done fails saying so); its lanes stay taken for the rest of the program.

Not seen by tracing, so still bounded only at run time (the engine's error names the fix): starts of
several programs in flight at once on a device, a jitted helper traced once and inlined several
times, the copies of a loop body `lax.scan(unroll=n)` makes, a `custom_vjp` function's body (JAX
traces it apart from the program, as a program of its own), and scan_layers' own calls beside
hand-written ones (scan_layers bounds its own: `prefetch` gathers and one reduce-scatter).
"""

from __future__ import annotations

import collections
import itertools
import threading
import warnings
import weakref

import numpy as np

from . import _settings

# Traces whose bodies XLA executes as one instruction, never interleaved with other instructions of
# the enclosing computation ("traced_for" of their DynamicJaxprTrace).
_SEQUENTIAL = frozenset({"scan", "fori_loop", "while_body", "while_cond", "while_loop", "cond", "switch"})
# Programs whose lanes are kept (the most recently traced); a program being traced is among them.
_KEEP_PROGRAMS = 16
# A done result at most this many elements ties as it is; a larger one through a one-element slice.
_SMALL = 1024

_local = threading.local()


def max_in_flight() -> int:
    """TIDE_MAX_IN_FLIGHT as the native library reads it (`_settings.max_in_flight`)."""
    return _settings.max_in_flight()


def lanes() -> int:
    """Hand-written starts of one op a traced program may have in flight: K - 1."""
    return max_in_flight() - 1


class Tag:
    """What a handle of a laned start carries to its done (`Handle.tag`). Part of the handle's pytree
    auxiliary data, so it survives `ordered` and other barriers; every Tag equals every other, so
    handles of different starts still have equal tree structures (a loop carry, cond branches)."""

    __slots__ = ("call",)

    def __init__(self, call):
        self.call = call

    def __eq__(self, other):
        return isinstance(other, Tag)

    def __hash__(self):
        return 0x7D1E

    def __repr__(self):
        return "Tag()"


class _Call:
    """One laned start: the traces it was traced in (outermost first) and their kinds; once its done
    is traced, that done's result and when (`seq`, for least-recently-freed). Traces and the result
    are held by weak references only: nothing of a finished trace is kept alive (JAX's tracer-leak
    check), and a result that died was not used, so XLA removes that done and its start."""

    __slots__ = ("chain", "kinds", "anchor", "seq")

    def __init__(self, chain, kinds):
        self.chain = tuple(weakref.ref(t) for t in chain)
        self.kinds = kinds
        self.anchor, self.seq = None, 0


class _Program:
    """Lanes of one traced program (one outermost trace): per op, per lane, its calls in trace order."""

    def __init__(self):
        self.lanes: dict[str, dict[int, list[_Call]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.clock = itertools.count(1)


def _programs() -> collections.OrderedDict:
    progs = getattr(_local, "programs", None)
    if progs is None:
        progs = _local.programs = collections.OrderedDict()
    return progs


def reset() -> None:
    """Forgets every program's lanes (this thread): for tests."""
    _programs().clear()


def _trace_chain():
    """The jaxpr traces enclosing the current one, outermost first; None where there is none (eager
    code) or the internals moved (then nothing is laned: the run-time bound stays)."""
    try:
        from jax._src import core
        from jax._src.interpreters import partial_eval as pe

        stack = core.unsafe_get_trace_stack(core.unsafe_get_current_trace())
    except Exception:  # pragma: no cover - JAX internals moved
        return None
    chain = tuple(t for t in stack if isinstance(t, pe.DynamicJaxprTrace))
    return chain or None


def batched(leaves) -> bool:
    """Whether a start's operands are batched by jax.vmap (it then runs synchronously per element)."""
    try:
        from jax._src.interpreters.batching import BatchTracer
    except Exception:  # pragma: no cover - JAX internals moved
        return False
    return any(isinstance(x, BatchTracer) for x in leaves)


def _kind(trace) -> str:
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    return str(getattr(info, "traced_for", "") or "")


def _program(chain, create: bool):
    progs = _programs()
    for key in [k for k, (root, _) in progs.items() if root() is None]:
        del progs[key]  # a program whose trace is gone
    for key, (root, prog) in progs.items():
        if root() is chain[0]:
            progs.move_to_end(key)
            return prog
    if not create:
        return None
    prog = _Program()
    progs[id(chain[0])] = (weakref.ref(chain[0]), prog)
    while len(progs) > _KEEP_PROGRAMS:
        progs.popitem(last=False)
    return prog


_BUSY, _RETIRED, _FRESH = "busy", "retired", "fresh"


def _status(calls: list, chain: tuple, kinds: tuple):
    """A lane's state for a start traced in `chain`: _FRESH (no call to wait for), a `_Call` whose
    done it waits for, _BUSY (its last start in a trace around this one has no done yet) or
    _RETIRED (its last call was in a finished sub-trace that XLA may run beside this start)."""
    for call in reversed(calls):
        common = 0
        for a, b in zip(call.chain, chain):
            if a() is not b:
                break
            common += 1
        if common == len(call.chain):  # traced here or in a trace around this one: reachable
            if call.anchor is None:
                return _BUSY
            if call.anchor() is None:
                continue  # its done's result was never used: XLA removes the call
            return call
        if common == 0:  # another program (the lanes are per program: not reached)
            continue
        if common == len(chain):  # this start is in the trace that holds that sub-trace
            return _RETIRED
        if call.kinds[common] in _SEQUENTIAL and kinds[common] in _SEQUENTIAL:
            continue  # two loop / cond bodies of one computation: never in flight together
        return _RETIRED
    return _FRESH


def acquire(op: str, what: str):
    """A lane for a start of `op` traced now: None where nothing is laned (eager, or no jaxpr trace);
    ("sync", None) where every lane is busy (the caller runs the synchronous collective); else
    (Tag, anchors): the tag for its handle and the values its operands must wait for (possibly none)."""
    chain = _trace_chain()
    if chain is None:
        return None
    n = lanes()
    if n <= 0:
        _warn_sync(op, what, "TIDE_MAX_IN_FLIGHT=1 leaves no slot beside the synchronous calls")
        return "sync", None
    prog = _program(chain, create=True)
    kinds = tuple(_kind(t) for t in chain)
    fresh, oldest = None, None
    for lane in range(n):
        st = _status(prog.lanes[op][lane], chain, kinds)
        anchor = st.anchor() if isinstance(st, _Call) else None
        if st is _FRESH or (isinstance(st, _Call) and anchor is None):
            fresh = lane
            break
        if isinstance(st, _Call) and (oldest is None or st.seq < oldest[1].seq):
            oldest = (lane, st, anchor)
    if fresh is None and oldest is None:
        _warn_sync(op, what, f"{n} {op} starts are outstanding in this program's order (or their lanes "
                             "were used by a loop body or checkpoint traced before it)")
        return "sync", None
    lane = fresh if fresh is not None else oldest[0]
    after = [] if fresh is not None else [_small(oldest[2])]
    call = _Call(chain, kinds)
    prog.lanes[op][lane].append(call)
    return Tag(call), after


def release(tag, results: list) -> None:
    """Records the done of a laned start: `results` are the done's results (as the done call returns
    them, before they are typed per parameter). A done traced in another trace than its start (a
    handle carried into a loop body) frees nothing."""
    if not isinstance(tag, Tag) or tag.call.anchor is not None:
        return
    chain = _trace_chain()
    call = tag.call
    if chain is None or chain[-1] is not call.chain[-1]():
        return
    sized = [r for r in results if int(np.prod(r.shape)) > 0]
    if not sized:
        return
    prog = _program(chain, create=False)
    if prog is None:
        return
    call.anchor = weakref.ref(min(sized, key=lambda r: int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize))
    call.seq = next(prog.clock)


def _small(x):
    """`x`, or a one-element slice of it where it is large: what a start ties to."""
    import jax

    if int(np.prod(x.shape)) <= _SMALL:
        return x
    return jax.lax.slice(x, (0,) * x.ndim, (1,) * x.ndim)


def _warn_sync(op: str, what: str, why: str) -> None:
    warnings.warn(
        f"tide: {what}: {why}; this start runs the synchronous {op} (no overlap), because on GPUs at "
        f"most TIDE_MAX_IN_FLIGHT={max_in_flight()} calls of an op may be in flight and one slot is kept "
        "for synchronous calls (docs/design.md [Note: in-flight lanes]). Call a done before this start, "
        "or raise TIDE_MAX_IN_FLIGHT.",
        stacklevel=5,
    )
