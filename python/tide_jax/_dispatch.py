"""One tide program launch at a time: `dispatch_lock` (issue #17).

Every device runs the programs launched on it one at a time, in launch order. Two threads that
call two jitted tide programs at once can launch them in different orders on different devices;
the programs' collectives then wait for each other forever (tide detects that cycle and fails
every call of it at once, naming the programs). XLA:CPU has a stall of its own: each device admits
32 programs in flight, and two threads launching past that can leave a device unable to start a
program the others wait for (tide cannot see it; the call fails after TIDE_TIMEOUT_S). Launching
under one lock rules out both. Only the launch is serialized, not the execution: a jitted call
returns once its program is enqueued on every device, so the lock is held for microseconds (longer
only while XLA holds a launch back because 32 are in flight), and the programs still run back to
back on the devices.
"""

import contextlib
import threading

_LOCK = threading.RLock()


@contextlib.contextmanager
def dispatch_lock(mesh=None):
    """Context manager: launches of tide programs inside it happen one at a time in this process.

        with tide_jax.dispatch_lock(mesh):
            state, loss = step(state, batch)        # in every thread that runs tide programs

    One process-wide lock (re-entrant), whatever `mesh` is: programs on overlapping meshes are
    ordered too. `mesh` is accepted for readability and ignored. Results are futures as usual;
    wait for them (`jax.block_until_ready`) outside the lock, or other threads wait behind it.
    """
    del mesh
    with _LOCK:
        yield
