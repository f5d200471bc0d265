"""Multi-process support: what tide needs from `jax.distributed` (docs/multiprocess.md).

When the devices of a mesh belong to more than one process, the ranks of a tide call cannot meet
in one address space. The native library then runs the call through its cross-process transport
(CPU: POSIX shared memory between the processes of one host), keyed by a *job id* that every
process of the job agrees on through JAX's key-value store. This module:

- `initialize()`: `jax.distributed.initialize` from the environment `tide_jax.launch` (or SLURM,
  Open MPI, ... through JAX's own cluster detection) sets up;
- `is_multiprocess(mesh)`: whether the mesh has devices of more than one process;
- `job_id(mesh)`: the FFI attribute `job` (int64): 0 for a single-process mesh, else the job's id
  (the same non-zero value in every process);
- `topology(mesh, axis)`: `(nodes, gpus_per_node)` along `axis`: `TIDE_TOPOLOGY` if set, else one
  node per host (hosts exchanged through the key-value store), checked against the mesh order
  (ranks node-major: rank = node * gpus_per_node + local);
- `setup_rail(layout)`: for CPU meshes over several nodes, starts this process's TCP rail endpoint
  and tells the native library where every rank of the mesh listens (the CPU transport shares
  memory only inside a node; copies between nodes go over the rail).

Key-value store keys (all under `tide/`): `tide/job_id` (first writer wins, everyone reads it),
`tide/host/<process_index>` (host identity: hostname and boot id), `tide/rail/<job>/<process_index>`
("host:port" of the process's rail endpoint).
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Any

import numpy as np

from . import _settings

__all__ = [
    "initialize",
    "is_multiprocess",
    "job_id",
    "topology",
    "process_hosts",
    "ffi_attrs",
    "setup_rail",
    "setup_nccl",
    "nccl_roles",
    "kv_timeout_ms",
]

def kv_timeout_ms() -> int:
    """How long a process waits for its peers' keys in the key-value store (TIDE_KV_TIMEOUT_S,
    default 300 s, at most a day), read when a job is set up."""
    return _settings.kv_timeout_ms()

_lock = threading.Lock()
_job_id: int | None = None
_hosts: dict[int, str] | None = None
_rail_addrs: dict[int, dict[int, str]] = {}  # job -> process index -> "host:port"
_rail_registered: set[tuple[int, int, int]] = set()  # (job, group, rank)


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "tide: the mesh spans several processes but jax.distributed is not initialized here; "
            "call tide_jax.initialize() (or jax.distributed.initialize()) first"
        )
    return client


def initialize(**kwargs: Any) -> None:
    """`jax.distributed.initialize` from the environment, once.

    `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` (set by
    `python -m tide_jax.launch`, or by hand for mpirun / other launchers) are passed explicitly;
    without them JAX's cluster detection (SLURM, Open MPI, Kubernetes, ...) takes over. A single
    process (`JAX_NUM_PROCESSES=1` or nothing set and no cluster) is left uninitialized. Keyword
    arguments go to `jax.distributed.initialize` unchanged and win over the environment.
    """
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    env = os.environ
    args: dict[str, Any] = {}
    if env.get("JAX_COORDINATOR_ADDRESS"):
        args["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    if env.get("JAX_NUM_PROCESSES"):
        args["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if env.get("JAX_PROCESS_ID"):
        args["process_id"] = int(env["JAX_PROCESS_ID"])
    args.update(kwargs)
    if args.get("num_processes") == 1:
        return
    if not args and not _cluster_detected():
        return
    jax.distributed.initialize(**args)


def report_uncaught_to_launcher() -> None:
    """Under `python -m tide_jax.launch` (`TIDE_LAUNCH_DIR` set): an exception nobody catches is
    written to `<dir>/raised-<rank>` (its line "RuntimeError: ...") before Python prints it, so
    the launcher names this rank as the root cause at once. Without it the launcher saw only the
    peer that timed out first: the raising process waits in JAX's shutdown barrier for its peers,
    and they wait in their next collective for it, until TIDE_TIMEOUT_S. Installed once, at import;
    the previous hook still prints the traceback."""
    import sys

    where, rank = os.environ.get("TIDE_LAUNCH_DIR"), os.environ.get("TIDE_LOCAL_RANK")
    if not where or rank is None or getattr(sys.excepthook, "_tide_launch", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            import traceback

            # "Type: first line of the message" (not the notes JAX appends, nor a SyntaxError's source)
            text = "".join(traceback.format_exception_only(kind, value)).strip().splitlines()
            line = next((t for t in text if t.split(":")[0].split(".")[-1] == kind.__name__), text[0] if text else "")
            line = (line or kind.__name__)[:500]
            tmp = os.path.join(where, f".raised-{rank}.{os.getpid()}")
            with open(tmp, "w") as f:
                f.write(line)
            os.replace(tmp, os.path.join(where, f"raised-{rank}"))
        except Exception:
            pass
        previous(kind, value, tb)

    hook._tide_launch = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _cluster_detected() -> bool:
    env = os.environ
    return any(k in env for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JAX_COORDINATOR_ADDRESS"))


def _processes(mesh) -> set[int]:
    return {int(getattr(d, "process_index", 0)) for d in np.asarray(mesh.devices).flat}


def is_multiprocess(mesh) -> bool:
    """Whether `mesh` holds devices of more than one process."""
    return len(_processes(mesh)) > 1


def job_id(mesh=None) -> int:
    """The FFI attribute `job`: 0 for a single-process mesh, else the job's non-zero id.

    Agreed once per job through the key-value store: every process proposes one (`TIDE_JOB_ID` if
    set, as `tide_jax.launch` does, else a random one); the first write wins and all read it.
    """
    global _job_id
    if mesh is not None and not is_multiprocess(mesh):
        return 0
    with _lock:
        if _job_id is None:
            client = _client()
            proposal = os.environ.get("TIDE_JOB_ID", "").strip()
            value = int(proposal, 0) if proposal else secrets.randbits(62) | 1
            if value <= 0 or value >= 1 << 63:
                raise ValueError(f"tide: TIDE_JOB_ID={proposal!r}: must be in 1..2**63-1")
            try:
                client.key_value_set("tide/job_id", str(value), allow_overwrite=False)
            except Exception:  # another process wrote it first
                pass
            _job_id = int(client.blocking_key_value_get("tide/job_id", kv_timeout_ms()))
        return _job_id


def _host_identity() -> str:
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def process_hosts() -> dict[int, str]:
    """Host identity of every process of the job (hostname and boot id), by process index."""
    global _hosts
    import jax

    with _lock:
        if _hosts is None:
            n = jax.process_count()
            if n == 1:
                _hosts = {0: _host_identity()}
            else:
                client = _client()
                client.key_value_set(f"tide/host/{jax.process_index()}", _host_identity(), allow_overwrite=True)
                _hosts = {p: client.blocking_key_value_get(f"tide/host/{p}", kv_timeout_ms()) for p in range(n)}
        return dict(_hosts)


def topology(mesh, axis: str) -> tuple[int, int]:
    """(nodes, gpus_per_node) of `axis` of `mesh`: TIDE_TOPOLOGY if set, else from the hosts.

    From the hosts: along the axis (in every group of the other axes alike) the devices of one host
    must be consecutive and every host must hold the same number, so that rank = node *
    gpus_per_node + local. On CPU, ranks of one node share memory and nodes talk over the rail
    (`setup_rail`), so a CPU mesh may span hosts.
    """
    names = list(mesh.axis_names)
    if axis not in names:
        raise ValueError(f"tide: mesh has axes {tuple(names)}, no axis {axis!r}")
    world = int(mesh.shape[axis])
    devices = np.moveaxis(np.asarray(mesh.devices), names.index(axis), -1).reshape(-1, world)
    multi = is_multiprocess(mesh)
    if multi:
        hosts = process_hosts()
    given = _settings.topology(world)
    if given is not None:
        return given
    if not multi:
        return 1, world
    layouts = set()
    for row in devices:
        seq = [hosts[int(d.process_index)] for d in row]
        blocks: list[tuple[str, int]] = []
        for h in seq:
            if blocks and blocks[-1][0] == h:
                blocks[-1] = (h, blocks[-1][1] + 1)
            else:
                blocks.append((h, 1))
        names_seen = [b[0] for b in blocks]
        sizes = {b[1] for b in blocks}
        if len(set(names_seen)) != len(names_seen) or len(sizes) != 1:
            raise ValueError(
                f"tide: along mesh axis {axis!r} the devices of one host are not consecutive in equal "
                f"numbers (hosts in axis order: {[b[0].split('/')[0] + f' x{b[1]}' for b in blocks]}); "
                "build the mesh with devices sorted by process (jax.make_mesh does) or set "
                "TIDE_TOPOLOGY=NODESxGPUS"
            )
        layouts.add((len(blocks), sizes.pop()))
    if len(layouts) != 1:
        raise ValueError(f"tide: groups of mesh axis {axis!r} have different host layouts {sorted(layouts)}")
    return layouts.pop()


def ffi_attrs(mesh) -> dict[str, np.int64]:
    """The multi-process FFI attributes of a call over `mesh` (docs/multiprocess.md)."""
    return {"job": np.int64(job_id(mesh))}


def _advertised_host() -> str:
    """The address other processes reach this one's rail endpoint at: `TIDE_RAIL_HOST` if set, else
    the local address of the route to the JAX coordinator (loopback when it is local), else the
    host name's address."""
    env = _settings.rail_host()
    if env:
        return env
    coord = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    try:
        from jax._src import distributed

        coord = coord or (distributed.global_state.coordinator_address or "")
    except Exception:  # noqa: BLE001  (private API: best effort)
        pass
    host = coord.rsplit(":", 1)[0].strip("[]") if coord else ""
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(host), 9))  # no packet is sent
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _rail_call(fn, *args) -> int:
    import ctypes

    err = ctypes.create_string_buffer(1024)
    rc = fn(*args, err, ctypes.c_size_t(len(err)))
    if rc < 0:
        raise RuntimeError(f"tide: rail: {err.value.decode(errors='replace')}")
    return rc


def _rail_addresses(job: int) -> dict[int, str]:
    """Every process's rail endpoint in `job`, starting this process's (once per job)."""
    import ctypes

    import jax

    from . import _lib

    if job in _rail_addrs:
        return _rail_addrs[job]
    lib = _lib.load()
    lib.tide_rail_listen.restype = ctypes.c_int
    lib.tide_rail_listen.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    host = _advertised_host()
    bind = _settings.rail_bind(host)
    port = _rail_call(lib.tide_rail_listen, bind.encode())
    client = _client()
    me = jax.process_index()
    client.key_value_set(f"tide/rail/{job}/{me}", f"{host}:{port}", allow_overwrite=True)
    addrs = {p: client.blocking_key_value_get(f"tide/rail/{job}/{p}", kv_timeout_ms()) for p in range(jax.process_count())}
    _rail_addrs[job] = addrs
    return addrs


def setup_rail(lay, job: int) -> None:
    """Makes `lay`'s CPU mesh ready for plans over several nodes: this process's rail endpoint runs
    and the native library knows, for every (group, rank) of the mesh, its process's endpoint.
    Idempotent; a no-op for single-process meshes and single-node topologies."""
    import ctypes

    from . import _lib

    if job == 0 or lay.nodes <= 1:
        return
    with _lock:
        addrs = _rail_addresses(job)
        lib = _lib.load()
        lib.tide_rail_register.restype = ctypes.c_int
        lib.tide_rail_register.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p,
                                           ctypes.c_char_p, ctypes.c_size_t]
        names = list(lay.mesh.axis_names)
        axis_pos = names.index(lay.axis)
        devices = np.asarray(lay.mesh.devices)
        other_dims = [devices.shape[i] for i in range(devices.ndim) if i != axis_pos]
        for idx in np.ndindex(*devices.shape):
            other = [idx[i] for i in range(len(idx)) if i != axis_pos]
            group = int(np.ravel_multi_index(other, other_dims)) if other else 0
            rank = int(idx[axis_pos])
            if (job, group, rank) in _rail_registered:
                continue
            addr = addrs[int(devices[idx].process_index)]
            _rail_call(lib.tide_rail_register, job, group, rank, addr.encode())
            _rail_registered.add((job, group, rank))


def nccl_roles(process_of_rank: np.ndarray, gpus_per_node: int, me: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Which NCCL rail ids process `me` creates and which it needs, for a mesh whose process
    indices are `process_of_rank[group, rank]` (ranks node-major, `gpus_per_node` per node).

    Rail r of a group joins the ranks with local index r of every node; its id is made by the rank
    of node 0 (rank r). Returns (create, need): lists of (group, rail)."""
    create, need = [], []
    groups, world = process_of_rank.shape
    g = max(1, gpus_per_node)
    for group in range(groups):
        for rail in range(min(g, world)):
            members = range(rail, world, g)
            if int(process_of_rank[group, rail]) == me:
                create.append((group, rail))
            if any(int(process_of_rank[group, q]) == me for q in members):
                need.append((group, rail))
    return create, need


def setup_nccl(lay, job: int) -> None:
    """GPU meshes over several nodes whose processes span hosts (or `TIDE_NODE_LOCAL=1`): makes the
    job's control plane per node and registers every rail's `ncclUniqueId` through the key-value
    store (`tide/nccl/<job>/<group>/<rail>`), since no memory is shared between hosts. On one host
    without `TIDE_NODE_LOCAL=1` nothing changes: the library shares the ids through its mailboxes."""
    import ctypes

    import jax

    from . import _lib

    if job == 0 or lay.nodes <= 1:
        return
    hosts = process_hosts()
    procs = {int(d.process_index) for d in np.asarray(lay.mesh.devices).flat}
    spans_hosts = len({hosts[p] for p in procs}) > 1
    from . import _lib

    if not (spans_hosts or _settings.node_local()):
        return
    names = list(lay.mesh.axis_names)
    devices = np.moveaxis(np.asarray(lay.mesh.devices), names.index(lay.axis), -1).reshape(-1, lay.world)
    process_of_rank = np.vectorize(lambda d: int(d.process_index))(devices)
    create, need = nccl_roles(process_of_rank, lay.gpus_per_node, jax.process_index())
    with _lock:
        lib = _lib.load()
        lib.tide_cuda_node_local.argtypes = [ctypes.c_uint64]
        lib.tide_cuda_node_local(job)
        lib.tide_nccl_unique_id.restype = ctypes.c_int
        lib.tide_nccl_unique_id.argtypes = [ctypes.c_char_p]
        lib.tide_nccl_set_unique_id.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_char_p]
        client = _client()
        for group, rail in create:
            buf = ctypes.create_string_buffer(128)
            if lib.tide_nccl_unique_id(buf) != 0:
                raise RuntimeError(f"tide: ncclGetUniqueId failed for rail {rail} of group {group} (is libnccl.so.2 loadable?)")
            client.key_value_set(f"tide/nccl/{job}/{group}/{rail}", buf.raw.hex(), allow_overwrite=True)
        for group, rail in need:
            value = client.blocking_key_value_get(f"tide/nccl/{job}/{group}/{rail}", kv_timeout_ms())
            lib.tide_nccl_set_unique_id(job, group, rail, bytes.fromhex(value))
