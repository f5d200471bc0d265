"""Hand-written start/done with the in-flight bound kept while tracing (issue #39, item 1;
docs/design.md "Start/done", [Note: in-flight lanes] in tide_jax/_inflight.py).

On GPUs at most TIDE_MAX_IN_FLIGHT (K) calls of an op may be in flight per device, and XLA issues a
start as early as its operands allow. tide_jax gives every hand-written start one of K - 1 lanes per
op and ties it after that lane's previous done, so no schedule of one traced program has more than
K - 1 starts of an op in flight. Checked here on CPU devices:
  - the loops people write (a prefetching forward, backward-style reduce-scatters of gradients made
    in the loop, reduce-scatters of gradients ready at entry), each in a Python loop and in
    lax.fori_loop, equal the jax backend bitwise (exact data), on 8 devices and at world 1 with the
    native calls (TIDE_WORLD1_NATIVE);
  - the lowered program (HLO before optimization): each start depends on the done K - 1 starts before
    it, and the largest set of starts some schedule can have in flight at once is K - 1 (without the
    lanes, six starts of gradients ready at entry: all six);
  - a start with every lane busy runs synchronously (a warning), equal to the others; a start after a
    loop body whose lanes it cannot wait for takes another lane.
The CPU engine has no slots (a start's collective runs on its worker threads), so the run-time limit
itself is checked on GPUs (test_gpu.py `test_hand_written_loops_on_gpus`).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tide_jax
from tide_jax import _inflight, _native, _ops
from conftest import make_mesh

AXIS = "fsdp"
L = 6
SHAPES = {"w": (7, 5), "b": (3,)}  # 7 rows: uneven over 8 ranks


@pytest.fixture(autouse=True)
def _fresh_lanes():
    _inflight.reset()
    yield
    _inflight.reset()


@pytest.fixture
def world1_native(monkeypatch):
    monkeypatch.setattr(_native, "_world1_native", True)


def _exact(rng, shape):
    """Values whose sums over up to 8 ranks are exact in float32: any summation order, same bits."""
    return (rng.integers(-16, 17, shape) / 8).astype(np.float32)


# ----- the loops -----
def _layer(p, x):
    """x: (2, 5). Exact in float32 whatever XLA fuses: multiples of 1/32, bounded by the clip (tanh
    was here: XLA:GPU compiled the two backends' programs with different roundings of it, so an H100
    saw the last bits differ, which says nothing of the collectives compared)."""
    return jnp.clip(x + p["w"][:2] * 0.5 + jnp.sum(p["b"]) * 0.25, -4.0, 4.0)


def _prefetch_python(s, x, lay, backend, depth=2):
    """Forward with `depth` gathers in flight ahead: start G(i+1..i+depth) before layer i's compute."""
    handles = [tide_jax.all_gather_start(jax.tree.map(lambda t: t[j], s), lay, backend=backend)
               for j in range(min(depth, L))]
    outs = []
    for i in range(L):
        p = tide_jax.all_gather_done(handles.pop(0))
        if i + depth < L:
            handles.append(tide_jax.all_gather_start(jax.tree.map(lambda t: t[i + depth], s), lay, backend=backend))
            *handles, x = tide_jax.ordered(*handles, x)
        x = _layer(p, x)
        if handles:
            *handles, x = tide_jax.ordered(*handles, x)
        outs.append(x)
    return jnp.stack(outs)


def _prefetch_fori(s, x, lay, backend):
    """The same in lax.fori_loop: the carry holds the next layer's gathered (finished) parameters."""
    p0 = tide_jax.all_gather_done(tide_jax.all_gather_start(jax.tree.map(lambda t: t[0], s), lay, backend=backend))

    def body(i, carry):
        x, p, outs = carry
        nxt = jnp.minimum(i + 1, L - 1)
        shard, x = tide_jax.ordered(jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, nxt, 0, False), s), x)
        h = tide_jax.all_gather_start(shard, lay, backend=backend)
        h, x, p = tide_jax.ordered(h, x, p)
        x = _layer(p, x)
        h, x = tide_jax.ordered(h, x)
        return x, tide_jax.all_gather_done(h), jax.lax.dynamic_update_index_in_dim(outs, x, i, 0)

    outs = jnp.zeros((L, *x.shape), x.dtype)
    outs = _ops._compat.mark_varying(outs, [AXIS])
    return jax.lax.fori_loop(0, L, body, (x, p0, outs))[2]


def _grad_of(x, i):
    """Layer i's 'gradient' from the activation x (2, 5): exact multiples of 1/8."""
    w = jnp.round(jnp.tile(x, (4, 1))[:7] * 8) / 8 + i
    return {"w": w, "b": jnp.round(x[0, :3] * 8) / 8 - i}


def _backward_python(x, lay, backend):
    """Backward-style: layer i's gradient made in the loop, its reduce-scatter behind the next layer."""
    out = []
    for i in reversed(range(L)):
        h = tide_jax.reduce_scatter_start(_grad_of(x, i), lay, backend=backend)
        h, x = tide_jax.ordered(h, x)
        x = jnp.round(jnp.tanh(x) * 8) / 8
        h, x = tide_jax.ordered(h, x)
        out.append(tide_jax.reduce_scatter_done(h))
    return out[::-1]


def _backward_fori(x, lay, backend):
    def body(k, carry):
        x, acc = carry
        i = L - 1 - k
        h = tide_jax.reduce_scatter_start(_grad_of(x, i), lay, backend=backend)
        h, x = tide_jax.ordered(h, x)
        x = jnp.round(jnp.tanh(x) * 8) / 8
        h, x = tide_jax.ordered(h, x)
        g = tide_jax.reduce_scatter_done(h)
        return x, jax.tree.map(lambda a, t: jax.lax.dynamic_update_index_in_dim(a, t, i, 0), acc, g)

    acc = jax.lax.fori_loop(0, L, body, (x, _zero_shards(lay)))[1]
    return [jax.tree.map(lambda t: t[i], acc) for i in range(L)]


def _zero_shards(lay):
    """(L, *shard_shape) float32 zeros per parameter, typed as the reduce-scatter's results."""
    zeros = [_ops._compat.mark_varying(jnp.zeros((L, *p.shard_shape), jnp.float32), [AXIS]) for p in lay.params]
    return jax.tree_util.tree_unflatten(lay.treedef, zeros)


def _ready_python(g, x, lay, backend):
    """Reduce-scatters of gradients ready at entry (after gradient accumulation): one per layer, each
    started, hidden behind some compute, done; nothing ties a start to the compute before it."""
    out = []
    for i in range(L):
        h = tide_jax.reduce_scatter_start(jax.tree.map(lambda t: t[i], g), lay, backend=backend)
        h, x = tide_jax.ordered(h, x)
        x = jnp.round(jnp.tanh(x) * 8) / 8
        h, x = tide_jax.ordered(h, x)
        out.append(tide_jax.reduce_scatter_done(h))
    return out


def _ready_fori(g, x, lay, backend):
    def body(i, carry):
        x, acc = carry
        h = tide_jax.reduce_scatter_start(jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, 0, False), g),
                                          lay, backend=backend)
        h, x = tide_jax.ordered(h, x)
        x = jnp.round(jnp.tanh(x) * 8) / 8
        h, x = tide_jax.ordered(h, x)
        done = tide_jax.reduce_scatter_done(h)
        return x, jax.tree.map(lambda a, t: jax.lax.dynamic_update_index_in_dim(a, t, i, 0), acc, done)

    acc = jax.lax.fori_loop(0, L, body, (x, _zero_shards(lay)))[1]
    return [jax.tree.map(lambda t: t[i], acc) for i in range(L)]


PATTERNS = {
    "prefetch": (_prefetch_python, _prefetch_fori),
    "backward": (_backward_python, _backward_fori),
    "ready": (_ready_python, _ready_fori),
}


def _setup(world, seed, devices=None):
    """(mesh, layout, stacked shards, per-device gradients (world, L, ...), activations): exact data.
    `devices`: the mesh's (GPUs in test_gpu.py); else `world` CPU devices."""
    mesh = make_mesh((world,), (AXIS,)) if devices is None else jax.sharding.Mesh(np.array(devices), (AXIS,))
    rng = np.random.default_rng(seed)
    lay = tide_jax.layout({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, mesh, AXIS)
    stacked = {k: _exact(rng, (L, *s)) for k, s in SHAPES.items()}
    shards = lay.shard_stacked(stacked)
    on_axis = NamedSharding(mesh, P(AXIS))
    grads = {k: jax.device_put(_exact(rng, (world, L, *s)), on_axis) for k, s in SHAPES.items()}
    x = jax.device_put(_exact(rng, (world, 2, 5)), on_axis)
    return mesh, lay, shards, grads, x


def _program(pattern, loop, mesh, lay, backend):
    """jit(shard_map) of one pattern; outputs stacked per device on a leading axis."""
    fn = PATTERNS[pattern][loop == "fori"]

    def per_device(s, g, x):
        g, x = jax.tree.map(lambda t: t[0], g), x[0]
        if pattern == "prefetch":
            out = fn(s, x, lay, backend)
        elif pattern == "backward":
            out = fn(x, lay, backend)
        else:
            out = fn(g, x, lay, backend)
        return jax.tree.map(lambda t: t[None], out)

    spec = jax.tree.map(lambda _: P(AXIS), {k: 0 for k in SHAPES})
    return jax.jit(tide_jax.shard_map(per_device, mesh=mesh, in_specs=(lay.stacked_spec, spec, P(AXIS)),
                                      out_specs=P(AXIS)))


def check_loop(pattern, loop, world, seed, devices=None):
    """One hand-written loop on the tide backend: bitwise the jax backend's results, no start run
    synchronously (no warning), and at most K - 1 = 3 starts in flight in any schedule of each
    computation of the lowered program. `devices`: test_gpu.py's GPUs."""
    mesh, lay, shards, grads, x = _setup(world, seed, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no start falls back to the synchronous collective
        f = _program(pattern, loop, mesh, lay, "tide")
        text = f.lower(shards, grads, x).as_text(dialect="hlo")
        got = jax.device_get(f(shards, grads, x))
    want = jax.device_get(_program(pattern, loop, mesh, lay, "jax")(shards, grads, x))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    op = "all_gather" if pattern == "prefetch" else "reduce_scatter"
    flights = most_in_flight(text, op)
    assert flights and all(most <= 3 for most, _ in flights.values()), flights


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("loop", ["python", "fori"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_hand_written_loops_equal_the_jax_backend(world, loop, pattern, monkeypatch):
    """Each loop, its starts laned (K = 4: 3 lanes per op), equals the jax backend bitwise; at world
    1 the calls are native (TIDE_WORLD1_NATIVE), so the lanes and ties are in the program there too."""
    if world == 1:
        monkeypatch.setattr(_native, "_world1_native", True)
    check_loop(pattern, loop, world, seed=100 * world + len(pattern) + len(loop))


# ----- the lowered program -----
def _hlo(text: str) -> dict:
    """{computation: {instruction: {op, operands, index, target}}} of an HLO module's text."""
    comps, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head.group(1), {})
            continue
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\((.*)$", line)
        if not m or current is None:
            continue
        name, opcode, rest = m.groups()
        depth, args = 1, ""
        for ch in rest:
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
            args += ch
        index = re.search(r"\bindex=(\d+)", rest[len(args):])
        target = re.search(r'custom_call_target="(\w+)"', line)
        called = re.findall(r"(?:body|condition|calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", line)
        current[name] = dict(op=opcode, operands=re.findall(r"%?([\w.\-]+)", args) if opcode != "constant" else [],
                             index=int(index.group(1)) if index else None, called=called,
                             target=target.group(1) if target else None)
    return comps


def _origin(instrs, name, k=None):
    """The instruction a value comes from, through tuples, get-tuple-elements and barriers."""
    ins = instrs.get(name)
    if ins is None:
        return None
    if ins["op"] == "get-tuple-element":
        return _origin(instrs, ins["operands"][0], ins["index"])
    if ins["op"] == "tuple" and k is not None:
        return _origin(instrs, ins["operands"][k])
    if ins["op"] == "opt-barrier":
        return _origin(instrs, ins["operands"][0], k)
    return name


def _ancestors(instrs) -> dict:
    memo: dict = {}

    def up(n):
        if n not in memo:
            memo[n] = set()
            out = set()
            for o in instrs[n]["operands"]:
                if o in instrs:
                    out |= {o} | up(o)
            memo[n] = out
        return memo[n]

    return {n: up(n) for n in instrs}


def _calls(instrs, op) -> list:
    """[(start, done)] of tide `op` in one computation, in the order the starts were traced (their
    names' numbers: the text lists instructions in an order of its own)."""
    order = {n: int(re.search(r"(\d+)$", n).group(1)) for n in instrs}
    out = []
    for n, ins in instrs.items():
        if ins["target"] == f"tide_{op}_done":
            start = _origin(instrs, ins["operands"][0])
            assert instrs[start]["target"] == f"tide_{op}_start", (n, start)
            out.append((start, n))
    return sorted(out, key=lambda sd: order[sd[0]])


def most_in_flight(text: str, op: str) -> dict:
    """Per computation holding calls of `op`: (the largest number of its starts some schedule has in
    flight at once, how many there are). Starts s and t can be in flight together unless one's done
    is an ancestor of the other's start; the largest such set, by branch and bound."""
    result = {}
    for comp, instrs in _hlo(text).items():
        calls = _calls(instrs, op)
        if not calls:
            continue
        anc = _ancestors(instrs)
        n = len(calls)
        ok = [[i == j or not (calls[i][1] in anc[calls[j][0]] or calls[j][1] in anc[calls[i][0]])
               for j in range(n)] for i in range(n)]
        best = 0

        def grow(size, rest):
            nonlocal best
            best = max(best, size)
            if size + len(rest) <= best:
                return
            for k, i in enumerate(rest):
                grow(size + 1, [j for j in rest[k + 1:] if ok[i][j]])

        grow(0, list(range(n)))
        result[comp] = (best, n)
    return result


def _ready_program(mesh, lay, backend="tide"):
    return _program("ready", "python", mesh, lay, backend)


@pytest.mark.parametrize("max_in_flight", [4, 2, 16])
def test_lowered_program_orders_each_start_after_the_done_k_before_it(max_in_flight, monkeypatch):
    """Six reduce-scatters of gradients ready at entry, one start per done in the program's text: in
    the lowered program each start from the K-th on depends on the done of the start K - 1 before it,
    and no schedule has more than K - 1 in flight (TIDE_MAX_IN_FLIGHT = K = 4 and 2). With K = 16 the
    lanes tie nothing here, and all six can be in flight: what the run-time limit met on the H100."""
    monkeypatch.setenv("TIDE_MAX_IN_FLIGHT", str(max_in_flight))
    mesh, lay, shards, grads, x = _setup(8, seed=5)
    text = _ready_program(mesh, lay).lower(shards, grads, x).as_text(dialect="hlo")
    (comp, (most, n)), = most_in_flight(text, "reduce_scatter").items()
    assert n == L
    assert most == min(max_in_flight - 1, L), (most, max_in_flight)
    instrs = _hlo(text)[comp]
    anc = _ancestors(instrs)
    calls = _calls(instrs, "reduce_scatter")
    k = max_in_flight - 1
    for j, (start, _) in enumerate(calls):
        if j >= k:
            assert calls[j - k][1] in anc[start], (j, "is not after the done", k, "starts before it")
        if k < L:  # nothing is tied closer than that
            assert all(calls[i][1] not in anc[start] for i in range(max(0, j - k + 1), j)), j


def test_fori_loop_body_and_the_program_around_it(monkeypatch):
    """A start before a fori_loop whose body starts and finishes reduce-scatters, its done after the
    loop: the body's starts take the other lanes; with K = 2 (one lane) the body's start waits for
    the done before the loop (closed over: the whole loop waits), and a start after the loop cannot
    wait for the body's calls, so it runs synchronously and says so."""
    monkeypatch.setenv("TIDE_MAX_IN_FLIGHT", "2")
    mesh, lay, shards, grads, x = _setup(8, seed=6)

    def per_device(g, x, backend):
        g, x = jax.tree.map(lambda t: t[0], g), x[0]
        first = tide_jax.reduce_scatter_done(
            tide_jax.reduce_scatter_start(jax.tree.map(lambda t: t[0], g), lay, backend=backend))
        out = _ready_fori(g, x, lay, backend)
        after = tide_jax.reduce_scatter_done(
            tide_jax.reduce_scatter_start(jax.tree.map(lambda t: t[1], g), lay, backend=backend))
        return jax.tree.map(lambda t: t[None], (first, out, after))

    spec = {k: P(AXIS) for k in SHAPES}

    def program(backend):
        return jax.jit(tide_jax.shard_map(lambda g, x: per_device(g, x, backend), mesh=mesh,
                                          in_specs=(spec, P(AXIS)), out_specs=P(AXIS)))

    with pytest.warns(UserWarning, match="runs the synchronous reduce_scatter"):
        f = program("tide")
        text = f.lower(grads, x).as_text(dialect="hlo")
    comps = _hlo(text)
    # the body: one call at a time; the loop waits for the done before it
    body = [c for c, instrs in comps.items() if _calls(instrs, "reduce_scatter")
            and any(i["op"] == "parameter" for i in instrs.values()) and c != "main"]
    flights = most_in_flight(text, "reduce_scatter")
    assert all(most == 1 for most, _ in flights.values()), flights
    outer = next(c for c, instrs in comps.items() if any(i["op"] == "while" for i in instrs.values()))
    instrs = comps[outer]
    anc = _ancestors(instrs)
    (loop,) = [n for n, i in instrs.items() if i["op"] == "while"]
    (first,) = _calls(instrs, "reduce_scatter")  # the one before the loop (the one after is synchronous)
    assert first[1] in anc[loop], "the loop does not wait for the done before it"
    assert any(i["target"] == "tide_reduce_scatter" for i in instrs.values()), "the start after the loop"
    assert body
    got, want = jax.device_get(f(grads, x)), jax.device_get(program("jax")(grads, x))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_more_starts_outstanding_than_lanes_run_synchronously(monkeypatch):
    """Eight all-gathers started before their eight dones (K = 4: 3 lanes): the first three are in
    flight, the other five run synchronously with a warning; results equal the jax backend, and the
    lowered program has at most 3 in flight."""
    mesh, lay, shards, grads, x = _setup(8, seed=7)

    def per_device(s, backend):
        hs = [tide_jax.all_gather_start(jax.tree.map(lambda t: t[i % L], s), lay, backend=backend) for i in range(8)]
        return jax.tree.map(lambda t: t[None], [tide_jax.all_gather_done(h) for h in hs])

    def program(backend):
        return jax.jit(tide_jax.shard_map(lambda s: per_device(s, backend), mesh=mesh,
                                          in_specs=(lay.stacked_spec,), out_specs=P(AXIS)))

    with pytest.warns(UserWarning, match="3 all_gather starts are outstanding") as record:
        f = program("tide")
        text = f.lower(shards).as_text(dialect="hlo")
    assert len([w for w in record if "runs the synchronous" in str(w.message)]) == 5
    assert [most for most, _ in most_in_flight(text, "all_gather").values()] == [3]
    assert text.count('custom_call_target="tide_all_gather"') == 5
    got, want = jax.device_get(f(shards)), jax.device_get(program("jax")(shards))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_lanes_keep_no_tracer_alive():
    """The lanes hold traces and done results by weak reference: JAX's tracer-leak check passes over
    a program of laned starts, in a Python loop and in lax.fori_loop."""
    mesh, lay, shards, grads, x = _setup(8, seed=9)
    for loop in ("python", "fori"):
        with jax.checking_leaks():
            _program("ready", loop, mesh, lay, "tide").lower(shards, grads, x)


def test_setting_is_read_as_the_library_reads_it(monkeypatch):
    for value, want in (("", 4), (" 7 ", 7), ("+2", 2), ("16", 16)):
        monkeypatch.setenv("TIDE_MAX_IN_FLIGHT", value)
        assert _inflight.max_in_flight() == want
    for value in ("0", "17", "x", "4.0"):
        monkeypatch.setenv("TIDE_MAX_IN_FLIGHT", value)
        with pytest.raises(tide_jax.SettingError, match="TIDE_MAX_IN_FLIGHT"):
            _inflight.max_in_flight()
