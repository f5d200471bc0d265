"""tide across processes on CPU (docs/multiprocess.md), under `python -m tide_jax.launch`.

Every test starts real processes: 2 or 3 JAX processes with 1 or 2 CPU devices each, meeting
through jax.distributed, running tide's all_gather / reduce_scatter through its shared-memory
transport. Checked: against jax.lax.all_gather / an fp64 sum (inside the workers), bitwise equal
to the single-process run of the same data (here), and a process killed mid-run makes the others
fail with tide's error naming the dead rank, in bounded time.

This file is also the worker: `python test_multiprocess.py worker --out DIR [--die RANK]`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.abspath(__file__)

# (name, shape, dtype): odd row counts (fewer rows than ranks too), 0-d, 1-d, 3-d, mixed dtypes.
PARAMS = [
    ("w", (7, 3), "bfloat16"),
    ("b", (5,), "float32"),
    ("s", (), "bfloat16"),
    ("e", (2, 4, 3), "float16"),
    ("big", (1031, 17), "bfloat16"),
]


def _data(world: int):
    """The same full parameters and per-rank gradients in every process (seeded)."""
    import ml_dtypes  # noqa: F401  (numpy bfloat16)

    rng = np.random.default_rng(1234 + world)
    params, grads = {}, {}
    for name, shape, dtype in PARAMS:
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        params[name] = rng.standard_normal(shape).astype(np.float32).astype(dt)
        grads[name] = rng.standard_normal((world, *shape)).astype(np.float32).astype(dt)
    return params, grads


def worker(out_dir: str, die: int | None, hsdp: int = 0) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import tide_jax

    tide_jax.initialize()
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if hsdp:
        # HSDP: a ("rep", "fsdp") mesh whose fsdp axis takes one device from each of `hsdp` blocks
        # (processes, when run under the launcher): several groups, each spanning the processes.
        grid = np.array(devices).reshape(hsdp, -1).T
        mesh = jax.sharding.Mesh(grid, ("rep", "fsdp"))
        world = hsdp
        rank_of = {d: int(np.argwhere(grid == d)[0][1]) for d in devices}
    else:
        world = len(devices)
        mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
        rank_of = {d: r for r, d in enumerate(devices)}
    params, grads = _data(world)
    lay = tide_jax.layout(params, mesh, "fsdp")

    def global_array(full: np.ndarray, shape, spec=P("fsdp")):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(shape, sharding, lambda idx: full[idx])

    # Shards (padded, rank-major) and gradients (rank r's full gradient is block r).
    shards, gstack = {}, {}
    for p in lay.params:
        x = params[p.path.strip("[]'")].reshape(p.rows, *p.rest)
        pad = np.zeros((p.padded_rows, *p.rest), x.dtype)
        pad[: p.rows] = x
        shards[p.path.strip("[]'")] = global_array(pad, p.global_shape)
        g = grads[p.path.strip("[]'")].reshape(world * p.rows, *p.rest)
        gstack[p.path.strip("[]'")] = global_array(g, (world * p.rows, *p.rest))

    def step(sh, gr):
        full = tide_jax.all_gather(sh, lay)
        ref = {k: jax.lax.all_gather(v, "fsdp", tiled=True) for k, v in sh.items()}
        gr = {k: v.reshape(params[k].shape) for k, v in gr.items()}
        rs = tide_jax.reduce_scatter(gr, lay)
        # the reduce-scatter into slice 1 of 3 (scan_layers' gradient buffers; issue #22)
        from tide_jax import _native, _ops

        bufs = [jnp.zeros((3, *p.shard_shape), jnp.float32) for p in lay.params]
        h = _native.start_into(_ops.check_grads(gr, lay, "test"), bufs, 1, lay, "tide")
        into = jax.tree_util.tree_unflatten(lay.treedef, _native.done_into(h))
        into_rs = {k: v[1] for k, v in into.items()}
        others = {k: (jnp.abs(v[0]).max() + jnp.abs(v[2]).max())[None] for k, v in into.items()}
        stacked = lambda t: {k: v[None] for k, v in t.items()}  # noqa: E731  one copy per rank
        # the casting all-gather of slice 1 of fp32 stacks (scan_layers' gathers; issue #22):
        # bitwise XLA's convert, then the gather
        f32 = {k: v.astype(jnp.float32) for k, v in sh.items()}
        stacks = [jnp.stack([x * 3, x, x * 5]) for x in jax.tree_util.tree_leaves(f32)]
        cast = _ops.all_gather_done(_native.start_cast(stacks, 1, lay, "tide"))
        cast_ref = {}
        for p in lay.params:
            k = p.path.strip("[]'")
            g = jax.lax.all_gather(f32[k].astype(jnp.bfloat16), "fsdp", tiled=True)
            cast_ref[k] = g[: p.rows].reshape(params[k].shape)
        return stacked(full), stacked(ref), rs, into_rs, others, stacked(cast), stacked(cast_ref)

    fn = jax.jit(
        tide_jax.shard_map(step, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")),
                           out_specs=(P("fsdp"),) * 7)
    )
    # The program as lowered, the same in every process (its digest is in the "ok" line): XLA:CPU of
    # jax 0.12.1 hangs in the first gloo collective of programs that differ between processes (this
    # step's jax.lax.all_gather did while tide's attributes listed each process's own devices).
    import hashlib

    program = hashlib.sha256(fn.lower(shards, gstack).as_text().encode()).hexdigest()[:16]
    full, ref, rs, into_rs, others, cast, cast_ref = fn(shards, gstack)
    jax.block_until_ready((full, ref, rs, into_rs, others, cast, cast_ref))
    for k in params:
        for a, b in zip(cast[k].addressable_shards, cast_ref[k].addressable_shards):
            got, want = np.asarray(a.data), np.asarray(b.data)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"casting all_gather {k}"

    for k in params:
        for a, b in zip(rs[k].addressable_shards, into_rs[k].addressable_shards):
            assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), f"reduce_scatter into slices {k}"
        for o in others[k].addressable_shards:
            assert not np.asarray(o.data).any(), f"reduce_scatter into slices wrote another slice of {k}"

    # All-gathered only: float8, complex, int8 and empty parameters (bytes; the empty ones make no call).
    import ml_dtypes

    rng = np.random.default_rng(99 + world)
    extra = {"f8": rng.standard_normal((13, 3)).astype(ml_dtypes.float8_e4m3fn),
             "c": (rng.standard_normal((5,)) + 1j * rng.standard_normal((5,))).astype(np.complex64),
             "i8": rng.integers(-100, 100, (world + 1, 2)).astype(np.int8), "none": np.zeros((0, 4), np.float32)}
    elay = tide_jax.layout(extra, mesh, "fsdp")
    eshards = {}
    for p in elay.params:
        x = extra[p.path.strip("[]'")].reshape(p.rows, *p.rest)
        pad = np.zeros((p.padded_rows, *p.rest), x.dtype)
        pad[: p.rows] = x
        eshards[p.path.strip("[]'")] = global_array(pad, p.global_shape)
    efull = jax.jit(tide_jax.shard_map(lambda s: {k: v[None] for k, v in tide_jax.all_gather(s, elay).items()},
                                       mesh=mesh, in_specs=(P("fsdp"),), out_specs=P("fsdp")))(eshards)
    for k, x in extra.items():
        for sh in efull[k].addressable_shards:
            got = np.asarray(sh.data)[0]
            assert got.dtype == x.dtype and got.shape == x.shape and got.tobytes() == x.tobytes(), f"all_gather {k}"

    results = {}
    for k in params:
        p = next(q for q in lay.params if q.path.strip("[]'") == k)
        for s_full, s_ref in zip(full[k].addressable_shards, ref[k].addressable_shards):
            r = rank_of[s_full.device]
            got = np.asarray(s_full.data)[0]
            want = np.asarray(s_ref.data)[0][: p.rows].reshape(params[k].shape)
            assert got.dtype == params[k].dtype and got.tobytes() == want.tobytes(), f"all_gather {k} rank {r}"
            assert got.tobytes() == params[k].tobytes()
            assert f"ag_{k}_{r}" not in results or results[f"ag_{k}_{r}"].tobytes() == got.tobytes(), "groups differ"
            results[f"ag_{k}_{r}"] = got
        exact = grads[k].astype(np.float64).sum(axis=0).reshape(p.rows, p.row_elems)
        for s in rs[k].addressable_shards:
            r = rank_of[s.device]
            got = np.asarray(s.data).reshape(p.shard_rows, p.row_elems)
            lo, hi = p.owned_rows(r)
            want = np.zeros((p.shard_rows, p.row_elems))
            want[: hi - lo] = exact[lo:hi]
            tol = 1e-5 * world * np.abs(grads[k].astype(np.float64)).max() + 1e-30
            assert got.dtype == np.float32 and np.abs(got - want).max() <= tol, f"reduce_scatter {k} rank {r}"
            assert not got[hi - lo :].any(), f"padding rows of {k} rank {r} not zero"
            assert f"rs_{k}_{r}" not in results or results[f"rs_{k}_{r}"].tobytes() == got.tobytes(), "groups differ"
            results[f"rs_{k}_{r}"] = got
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"p{jax.process_index()}.npz"), **{k: np.ascontiguousarray(v).reshape(-1).view(np.uint8) for k, v in results.items()})
    rail_bytes = tide_jax._lib.load().tide_rail_bytes_received
    rail_bytes.restype = __import__("ctypes").c_uint64
    print(f"worker {jax.process_index()}: ok ({len(results)} arrays, job {lay.job}, topology {lay.nodes}x{lay.gpus_per_node}, "
          f"mesh {dict(mesh.shape)}, "
          f"rail {rail_bytes()} bytes, program {program})", flush=True)

    if die is not None:
        # Process `die` is killed before a call; the others must fail, not hang.
        def tide_only(sh, gr):  # no jax.lax collective: its failure must come from tide
            gr = {k: v.reshape(params[k].shape) for k, v in gr.items()}
            return {k: v[None] for k, v in tide_jax.all_gather(sh, lay).items()}, tide_jax.reduce_scatter(gr, lay)

        fn2 = jax.jit(tide_jax.shard_map(tide_only, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=(P("fsdp"), P("fsdp"))))
        jax.block_until_ready(fn2(shards, gstack))  # compiled and run once by everyone
        if jax.process_index() == die:
            os.kill(os.getpid(), 9)
        t0 = time.monotonic()
        try:
            jax.block_until_ready(fn2(shards, gstack))
        except Exception as e:  # XlaRuntimeError carrying tide's message
            msg = str(e).splitlines()
            line = next((m for m in msg if "died" in m or "failed" in m), msg[0] if msg else "")
            print(f"TIDE_ERROR after {time.monotonic() - t0:.1f}s: {line}", flush=True)
            os._exit(3)
        print("NO_ERROR", flush=True)
        os._exit(4)
    sys.stdout.flush()
    os._exit(0)  # skip jax.distributed's shutdown barrier


# ----- the tests -----


def _env(**extra):
    env = dict(os.environ)
    # Under pytest: the package under test first. This file also runs as the worker (and evaluates
    # `pytestmark` there), which must not import conftest: it sets 8 CPU devices for the process.
    conftest = sys.modules.get("conftest")
    if conftest is not None:
        env["PYTHONPATH"] = conftest.subprocess_pythonpath(env)
    env.setdefault("TIDE_TIMEOUT_S", "60")
    env.update(extra)
    return env


def _native_available() -> bool:
    env = _env()
    # The native library, and the `job` attribute wired through (docs/multiprocess.md "FFI contract").
    code = "import tide_jax; tide_jax.library_path(); assert hasattr(tide_jax.Layout, 'job')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _native_available(), reason="tide_jax native library not built, or the multi-process `job` attribute not wired")


def _launch(n, devs, out, *extra, timeout=300, env=None, worker_args=()):
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", str(n), "--cpu-devices", str(devs), *extra, "--",
           sys.executable, WORKER, "worker", "--out", str(out), *worker_args]
    return subprocess.run(cmd, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def _single(world, out, worker_args=(), **extra):
    env = _env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={world}", **extra)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, WORKER, "worker", "--out", str(out), *worker_args], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return _load(out)


def _load(out):
    merged = {}
    for name in sorted(os.listdir(out)):
        with np.load(os.path.join(out, name)) as z:
            merged.update({k: z[k] for k in z.files})
    return merged


@pytest.mark.parametrize("nprocs,devs", [(2, 1), (3, 1), (2, 2), (3, 2)])
def test_multiprocess_matches_jax_and_single_process(tmp_path, nprocs, devs):
    r = _launch(nprocs, devs, tmp_path / "multi")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok (") == nprocs, r.stdout
    programs = re.findall(r"program ([0-9a-f]{16})\)", r.stdout)
    assert len(programs) == nprocs and len(set(programs)) == 1, f"each process lowered its own program: {r.stdout}"
    multi = _load(tmp_path / "multi")
    single = _single(nprocs * devs, tmp_path / "single")
    assert multi.keys() == single.keys()
    for k in single:
        assert np.array_equal(multi[k], single[k]), f"{k}: multi-process result differs from the single-process run"


@pytest.mark.parametrize("nprocs,devs,topo", [(2, 2, "2x2"), (2, 1, "2x1"), (3, 2, "3x2"), (4, 1, "2x2")])
def test_forced_multi_node_topology(tmp_path, nprocs, devs, topo):
    """TIDE_TOPOLOGY=NxG runs the hierarchical plans across processes of one host as if the nodes
    were hosts: node-local shared memory, the TCP rail between nodes (every process receives bytes
    through it), results bitwise equal to the single-process engine on the same topology. (4, 1,
    "2x2"): two processes per node."""
    r = _launch(nprocs, devs, tmp_path / "multi", env=_env(TIDE_TOPOLOGY=topo))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(f"topology {topo}") == nprocs, r.stdout
    assert " rail 0 bytes" not in r.stdout, r.stdout
    multi = _load(tmp_path / "multi")
    single = _single(nprocs * devs, tmp_path / "single", TIDE_TOPOLOGY=topo)
    assert multi.keys() == single.keys()
    for k in single:
        assert np.array_equal(multi[k], single[k]), k


@pytest.mark.parametrize("topo", [None, "2x1"])
def test_hsdp_mesh_groups_span_processes(tmp_path, topo):
    """A ("rep", "fsdp") mesh over 2 processes x 2 CPU devices whose fsdp axis pairs one device of
    each process: 2 groups, each across both processes; one node (shared memory) and forced 2x1
    (the rail, registered per group). Bitwise equal to the same mesh in one process."""
    env = _env(TIDE_TOPOLOGY=topo) if topo else _env()
    r = _launch(2, 2, tmp_path / "multi", env=env, worker_args=("--hsdp", "2"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("'rep': 2, 'fsdp': 2") == 2, r.stdout
    if topo:
        assert " rail 0 bytes" not in r.stdout, r.stdout
    multi = _load(tmp_path / "multi")
    extra = {"TIDE_TOPOLOGY": topo} if topo else {}
    single = _single(4, tmp_path / "single", worker_args=("--hsdp", "2"), **extra)
    assert multi.keys() == single.keys()
    for k in single:
        assert np.array_equal(multi[k], single[k]), k


@pytest.mark.parametrize("topo", [None, "3x1"])
def test_killed_process_fails_the_others_in_bounded_time(tmp_path, topo):
    """One node (shared control plane: the dead pid is named) and 3 nodes (the rail: the rank whose
    stream closed is named)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "3", "--cpu-devices", "1", "--grace", "60", "--",
           sys.executable, WORKER, "worker", "--out", str(tmp_path), "--die", "1"]
    env = _env(TIDE_TOPOLOGY=topo) if topo else _env()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "tide.launch: failed: rank 1" in out and "SIGKILL" in out, out
    for survivor in (0, 2):
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[rank {survivor}] TIDE_ERROR")]
        assert lines, out
        if topo is None:
            assert "rank 1 (pid" in lines[0] and "died" in lines[0], lines[0]
        else:
            assert "rank 1 on node 1" in lines[0], lines[0]
    assert "NO_ERROR" not in out
    assert took < 120, f"took {took:.0f}s"


@pytest.mark.parametrize("topo", [None, "2x4"])
def test_fsdp_example_under_the_launcher(topo):
    """The README's example as a 2-process job (4 CPU devices each): a real training step has many
    independent tide calls, which XLA:CPU runs concurrently and in different orders on different
    devices; every process must print the same losses as the plain-JAX run, flat and through the
    rail."""
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "2", "--cpu-devices", "4", "--",
           sys.executable, os.path.join(REPO, "tests", "python", "fsdp_toy.py"), "--cpu", "--steps", "4"]
    env = _env(TIDE_TOPOLOGY=topo) if topo else _env()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] OK: the two loss curves agree" in r.stdout, r.stdout
    # Both processes saw the same (global) losses. (Native libraries' stderr logs share the pipe and
    # can split a line: compare the well-formed loss rows, by step.)
    import re

    row = re.compile(r"^\[rank (\d)\]\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+\s*$")
    losses: dict[int, dict[int, tuple[str, str]]] = {0: {}, 1: {}}
    for ln in r.stdout.splitlines():
        m = row.match(ln)
        if m:
            losses[int(m.group(1))][int(m.group(2))] = (m.group(3), m.group(4))
    common = set(losses[0]) & set(losses[1])
    assert len(common) >= 2, r.stdout
    assert all(losses[0][k] == losses[1][k] for k in common), losses


def test_launcher_reports_failing_rank(tmp_path):
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "2", "--cpu-devices", "1", "--grace", "2", "--",
           sys.executable, "-c", "import os,time; r=int(os.environ['TIDE_LOCAL_RANK']); print('hello', r, os.environ['JAX_NUM_PROCESSES']); time.sleep(600 if r else 0); raise SystemExit(5 if r == 0 else 0)"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 5, r.stdout + r.stderr
    assert "[rank 0] hello 0 2" in r.stdout and "[rank 1] hello 1 2" in r.stdout
    assert "rank 0 (pid" in r.stderr and "exited with code 5" in r.stderr
    assert time.monotonic() - t0 < 30


RAISES = """
import jax, jax.numpy as jnp, numpy as np
import tide_jax
tide_jax.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
lay = tide_jax.layout({"w": np.ones((5, 3), np.float32)}, mesh, "fsdp")
shards = lay.shard({"w": np.ones((5, 3), np.float32)})
if jax.process_index() == 1:
    e = RuntimeError("boom on rank 1\\nsecond line")
    e.add_note("For simplicity, JAX has removed its internal frames (a note, as JAX adds)")
    raise e
f = jax.jit(tide_jax.shard_map(lambda s: tide_jax.all_gather(s, lay)["w"][None], mesh=mesh,
                               in_specs=(lay.spec,), out_specs=jax.sharding.PartitionSpec("fsdp")))
print("NO_ERROR", jax.block_until_ready(f(shards)).shape, flush=True)
"""


def test_launcher_names_a_rank_that_raised(tmp_path):
    """A rank raises an exception it does not catch, before its first tide call: its process lives
    on in JAX's shutdown barrier and its peer waits in tide for it, so neither exits soon. The
    launcher learns of the exception from tide_jax's excepthook, names rank 1 and what it raised as
    the root cause, and ends the job after --grace (not after TIDE_TIMEOUT_S)."""
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "2", "--cpu-devices", "1", "--grace", "3", "--",
           sys.executable, str(script)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=_env(TIDE_TIMEOUT_S="300"), capture_output=True, text=True, timeout=200)
    took = time.monotonic() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "tide.launch: rank 1 (pid" in r.stderr and "raised RuntimeError: boom on rank 1; ranks" in r.stderr, out
    assert r.stderr.rstrip().splitlines()[-1].startswith("tide.launch: failed: rank 1 (pid"), out
    assert "raised RuntimeError: boom on rank 1" in r.stderr.rstrip().splitlines()[-1], out
    assert "NO_ERROR" not in out
    assert took < 120, f"took {took:.0f}s"  # TIDE_TIMEOUT_S is 300 s: the launcher ended it


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("worker")
    ap.add_argument("--out", required=True)
    ap.add_argument("--die", type=int, default=None)
    ap.add_argument("--hsdp", type=int, default=0, help="fsdp axis size of a (rep, fsdp) mesh")
    a = ap.parse_args()
    worker(a.out, a.die, a.hsdp)
