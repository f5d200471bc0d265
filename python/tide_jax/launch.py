"""Start N processes of one JAX job on this host: `python -m tide_jax.launch -n N [opts] -- cmd ...`

Each process gets `JAX_COORDINATOR_ADDRESS` (a free localhost port), `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`, `TIDE_LOCAL_RANK` and `TIDE_JOB_ID`; the command calls `tide_jax.initialize()`
(or `jax.distributed.initialize` with those values). On a GPU host each process sees one GPU
(`CUDA_VISIBLE_DEVICES`, taken from the launcher's own list when set) unless `--gpus-per-process`
says otherwise or `--no-gpu-split`. `--cpu-devices K` runs on CPU with K devices per process.

Output lines are prefixed with `[rank i]`; Gloo's "Rank i is connected to N peer ranks" lines (one
per process and CPU collective group, from JAX's CPU collectives) are dropped. If a process exits non-zero, dies, or raises an exception it does not
catch (a process that imported `tide_jax` reports it through `TIDE_LAUNCH_DIR` before printing it: it
may not exit, JAX's shutdown barrier waiting for its peers), the others get `--grace` seconds to
finish on their own (they usually fail fast with tide's error naming the dead rank), then SIGTERM,
then SIGKILL 5 s later; the launcher exits non-zero naming the rank and what it did.
Multi-host clusters (SLURM, mpirun): see docs/multiprocess.md.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_gpus() -> list[str]:
    """GPU ids this launcher may hand out: its CUDA_VISIBLE_DEVICES, else /dev/nvidiaN."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip() != ""]
    ids = []
    for path in glob.glob("/dev/nvidia[0-9]*"):
        tail = path[len("/dev/nvidia"):]
        if tail.isdigit():
            ids.append(int(tail))
    return [str(i) for i in sorted(ids)]


def _noise(line: str) -> bool:
    return line.startswith("[Gloo] Rank ") and "is connected to" in line


def _pump(stream, prefix: str, out, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        if _noise(line):
            continue
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the launcher dies (Linux), so no orphan is left."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _cleanup_shm(job: int) -> None:
    for path in glob.glob(f"/dev/shm/tide-{job:016x}-*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _raised(where: str, rank: int) -> str | None:
    """What rank `rank` raised and did not catch (written by `tide_jax` on import's excepthook), or None."""
    try:
        with open(os.path.join(where, f"raised-{rank}")) as f:
            return f.read().strip() or "an exception"
    except OSError:
        return None


def build_env(rank: int, n: int, port: int, job: int, args, gpus: list[str], where: str = "") -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TIDE_LAUNCH_DIR=where,
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(n),
        JAX_PROCESS_ID=str(rank),
        TIDE_LOCAL_RANK=str(rank),
        TIDE_JOB_ID=str(job),
        PYTHONUNBUFFERED="1",
    )
    if args.cpu_devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        flags.append(f"--xla_force_host_platform_device_count={args.cpu_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
        # Spare XLA:CPU pool threads (the pool has max(NPROC or cores, devices) and collectives block
        # one per device): see tests/python/conftest.py.
        env.setdefault("NPROC", str(max(os.cpu_count() or 1, 2 * args.cpu_devices)))
    elif gpus and not args.no_gpu_split:
        k = args.gpus_per_process
        mine = gpus[rank * k:(rank + 1) * k]
        if len(mine) < k:
            raise SystemExit(f"tide.launch: {n} processes x {k} GPUs need {n * k} GPUs, this host has {len(gpus)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        at = argv.index("--")
        ours, cmd = argv[:at], argv[at + 1:]
    else:
        ours, cmd = argv, []
    p = argparse.ArgumentParser(prog="python -m tide_jax.launch", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nprocs", type=int, required=True, help="processes to start on this host")
    p.add_argument("--cpu-devices", type=int, default=None, help="run on CPU with K devices per process")
    p.add_argument("--gpus-per-process", type=int, default=1, help="GPUs per process (default 1)")
    p.add_argument("--no-gpu-split", action="store_true", help="leave CUDA_VISIBLE_DEVICES alone")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free one)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds the others get after one fails")
    args = p.parse_args(ours)
    if not cmd:
        p.error("no command: python -m tide_jax.launch -n N -- cmd ...")
    if args.nprocs < 1:
        p.error("-n must be at least 1")
    n = args.nprocs
    port = args.port or free_port()
    job = int(os.environ.get("TIDE_JOB_ID", "0"), 0) or (secrets.randbits(62) | 1)
    gpus = [] if args.cpu_devices is not None else local_gpus()

    where = tempfile.mkdtemp(prefix="tide-launch-")  # raised-<rank>: uncaught exceptions (tide_jax's excepthook)
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(n):
        proc = subprocess.Popen(
            cmd,
            env=build_env(rank, n, port, job, args, gpus, where),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we can stop its whole tree
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        procs.append(proc)
    for rank, proc in enumerate(procs):  # threads only after every fork (preexec_fn)
        t = threading.Thread(target=_pump, args=(proc.stdout, f"[rank {rank}] ", sys.stdout, lock), daemon=True)
        t.start()
        pumps.append(t)

    def forward(sig, _frame):
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc, sig)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    first_failure: tuple[int, str, int] | None = None  # rank, what it did, exit code to return
    stopped: set[int] = set()  # ranks this launcher terminated
    deadline = None
    terminated_at = None
    try:
        while True:
            codes = [proc.poll() for proc in procs]
            if first_failure is None:
                # An uncaught exception first: its process may live on (JAX's shutdown barrier waits
                # for the peers, which wait in a collective for it) while a peer times out and
                # exits. Then, seen together, a rank killed by a signal is the likelier root cause
                # than the ranks that failed because of it (tide fails them within milliseconds).
                raised = [(r, _raised(where, r)) for r in range(n)]
                raised = [(r, what) for r, what in raised if what is not None]
                order = sorted(range(n), key=lambda r: (not (codes[r] is not None and codes[r] < 0), r))
                failed = [(r, _describe(codes[r]), codes[r]) for r in order if codes[r] not in (None, 0)]
                found = [(r, f"raised {what}", 1) for r, what in raised] + failed
                if found:
                    first_failure = found[0]
                    rank, what, _ = first_failure
                    deadline = time.monotonic() + args.grace
                    with lock:
                        running = [r for r, c in enumerate(codes) if c is None]
                        sys.stderr.write(
                            f"tide.launch: rank {rank} (pid {procs[rank].pid}) {what}; "
                            f"ranks {running} get {args.grace:g} s to finish\n"
                        )
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if deadline is not None and terminated_at is None and now >= deadline:
                for rank, proc in enumerate(procs):
                    if proc.poll() is None:
                        stopped.add(rank)
                        _kill_group(proc, signal.SIGTERM)
                terminated_at = now
            if terminated_at is not None and now >= terminated_at + 5.0:
                for proc in procs:
                    if proc.poll() is None:
                        _kill_group(proc, signal.SIGKILL)
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
        for t in pumps:
            t.join(timeout=5)
        _cleanup_shm(job)
        shutil.rmtree(where, ignore_errors=True)
    if first_failure is not None:
        rank, what, code = first_failure
        others = [
            f"rank {r} {_describe(p.returncode)}"
            for r, p in enumerate(procs)
            if r != rank and r not in stopped and p.returncode not in (None, 0)
        ]
        also = f" (also: {', '.join(others)})" if others else ""
        sys.stderr.write(f"tide.launch: failed: rank {rank} (pid {procs[rank].pid}) {what}{also}\n")
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
