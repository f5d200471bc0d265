"""Programs launched from several threads at once (issue #17): two different tide programs, or the
same step from 2 and 4 threads, forward and with gradients, on 8 CPU devices, each call waited for
(as a loop that reads its loss): every call must return the right values, or fail within a second
with the interleaving message, never stall; the process is usable afterwards.

What these can and cannot show on CPU: XLA:CPU gang-schedules multi-device launches, so the cycle
tide breaks (devices running programs in different orders, the GPUs' case) has not occurred through
JAX here, and the failure branch below has never run; the cycle itself is tested at the FFI edge
(tests/ffi_cpu.rs), in the rendezvous (tests/rendezvous.rs) and on a GPU (tests/cuda_failure.rs).
XLA:CPU's own stall (a device admits 32 executions in flight) needs many calls in flight from each
thread: `dispatch_lock` is tested against it below, bench/interleaved_cpu.py measures it. (A rank
that really never arrives still fails at the timeout naming it: tests/rendezvous.rs and
tests/python/test_errors.py.)"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tide_jax
from conftest import make_mesh

AXIS = "fsdp"
# A failed call returns in far less (milliseconds); the bound leaves room for a loaded 2-core CI.
FAIL_WITHIN_S = 1.0


def _program(mesh, rows, cols, grad):
    """A jitted tide program on `mesh` and its expected output for an input value v: forward, one
    all_gather + one reduce_scatter (sum over the 8 ranks: 8 * v); with gradients, the gradient of
    sum(gathered^2) reduce-scattered (16 * v)."""
    params = {"w": np.zeros((rows, cols), np.float32), "b": np.zeros((rows,), np.float32)}
    lay = tide_jax.layout(params, mesh, AXIS)
    if grad:
        def step(shards):
            loss = lambda s: sum(jnp.sum(x * x) for x in jax.tree.leaves(tide_jax.gather_params(s, lay)))
            return jax.grad(loss)(shards)
        expect = 16.0
    else:
        def step(shards):
            full = tide_jax.all_gather(shards, lay)
            return tide_jax.reduce_scatter(jax.tree.map(lambda x: x.astype(jnp.bfloat16), full), lay)
        expect = 8.0
    f = jax.jit(tide_jax.shard_map(step, mesh=mesh, in_specs=(lay.spec,), out_specs=lay.spec, check_vma=False))

    def make_input(v):
        return lay.shard({"w": np.full((rows, cols), v, np.float32), "b": np.full((rows,), -v, np.float32)})

    def check(out, v):
        full = lay.unshard(out)
        return bool((np.asarray(full["w"]) == expect * v).all() and (np.asarray(full["b"]) == -expect * v).all())

    return f, make_input, check


def _run_threads(jobs, rounds, lock=None, window=1):
    """Runs `rounds` calls of each job (f, input, check) in its own thread, all at once, each thread
    keeping up to `window` calls in flight (1: every call waited for before the next, as a training
    loop that reads its loss). Returns (ok calls, failures as (job, seconds, message), wrong
    results, slowest successful call); a call's seconds run from when the thread could wait for it
    (its launch, or the previous result) to its result."""
    ok, failed, wrong, slowest = [0], [], [], [0.0]
    guard = threading.Lock()
    start = threading.Barrier(len(jobs))

    def run(j, f, x, check):
        start.wait()
        pending = []
        last = time.monotonic()

        def collect(out):
            nonlocal last
            try:
                jax.block_until_ready(out)
                dt = time.monotonic() - last
                good = check(out)
                with guard:
                    ok[0] += good
                    slowest[0] = max(slowest[0], dt)
                    if not good:
                        wrong.append(j)
            except Exception as e:  # noqa: BLE001 (every failure is checked by the caller)
                with guard:
                    failed.append((j, time.monotonic() - last, str(e)))
            last = time.monotonic()

        for _ in range(rounds):
            try:
                if lock is None:
                    out = f(x)
                else:
                    with lock():
                        out = f(x)
            except Exception as e:  # noqa: BLE001 (a launch that fails at once)
                with guard:
                    failed.append((j, 0.0, str(e)))
                continue
            if window == 1:
                last = time.monotonic()
            pending.append(out)
            if len(pending) >= window:
                collect(pending.pop(0))
        for out in pending:
            collect(out)

    threads = [threading.Thread(target=run, args=(j, *job)) for j, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ok[0], failed, wrong, slowest[0]


def _jobs(case, grad):
    mesh = make_mesh((8,), (AXIS,))
    if case == "two programs":
        progs = [_program(mesh, 20, 3, grad), _program(mesh, 9, 5, grad)]  # different layouts
    else:
        n = int(case.split()[-2])
        progs = [_program(mesh, 20, 3, grad)] * n
    jobs = []
    for j, (f, make_input, check) in enumerate(progs):
        v = float(j + 1)
        x = make_input(v)
        jax.block_until_ready(f(x))  # compile outside the timed threads
        jobs.append((f, x, lambda out, v=v, check=check: check(out, v)))
    return jobs


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradients"])
@pytest.mark.parametrize("case", ["two programs", "same step 2 threads", "same step 4 threads"])
def test_interleaved_programs_complete_or_fail_fast(case, grad, tide_backend):
    jobs = _jobs(case, grad)
    rounds = 100 if case == "two programs" else 40
    t0 = time.monotonic()
    ok, failed, wrong, slowest = _run_threads(jobs, rounds)
    elapsed = time.monotonic() - t0
    assert not wrong, f"wrong results in jobs {wrong[:5]}"
    assert ok + len(failed) == rounds * len(jobs)
    for j, dt, msg in failed:
        assert "programs interleaved across devices" in msg, f"job {j}: unexpected error: {msg[:800]}"
        assert "dispatch_lock" in msg and "run 0x" in msg, msg[:800]
        assert dt < FAIL_WITHIN_S, f"job {j}: a call failed after {dt:.2f} s: {msg[:300]}"
    # No stall: a call that succeeded never waited out a timeout either.
    assert slowest < 10, f"slowest successful call {slowest:.1f} s"
    print(f"{case} {'grad' if grad else 'fwd'}: {ok} ok, {len(failed)} broken deadlocks, {elapsed:.1f} s")
    # Usable afterwards: each job once more, alone.
    for j, (f, x, check) in enumerate(jobs):
        assert check(f(x)), f"job {j} after the threaded run"


def test_dispatch_lock_keeps_every_device_in_one_order(tide_backend):
    """32 calls in flight per thread: without the lock XLA:CPU stalls here (each device admits 32
    executions in flight; two threads launching past that fill a device with executions that wait
    for a launch whose part on that device cannot be admitted; bench/interleaved_cpu.py measured 2 of
    3 runs stalling at 32 in flight per thread, 3 of 3 at 48, none at 20 or fewer). That stall is inside XLA, before a device starts the program, where tide
    cannot see it: it ends at TIDE_TIMEOUT_S with a message naming this lock. Under the lock every
    call succeeds."""
    jobs = _jobs("two programs", grad=False)
    ok, failed, wrong, _ = _run_threads(jobs, 100, lock=tide_jax.dispatch_lock, window=32)
    assert not failed, failed[0][2][:800]
    assert not wrong and ok == 200
