"""Orbax checkpoints of the training state (examples/checkpoint.py, train.py --save / --resume).

- The checkpoint holds every array in its logical (unpadded) shape, bitwise the live FSDP state
  without its padding rows; a process that never imports tide reads it with plain orbax.
- Restored on 8, 4 and 3 devices: every array in that mesh's padded, sharded layout, padding zero.
- train.py on 8 devices, saved at step 4 and resumed on 8: the same losses and the same final
  state, bitwise; resumed on 4 (a process of 4 devices) and on 3: the same losses to fp32 rounding
  (tide's reduce-scatter and the gradient norm sum over a different number of shards).
- Saved by 2 processes x 4 devices (`python -m tide_jax.launch`), each writing its own shards:
  resumed under the launcher, bitwise; resumed in one process of 8 devices, to fp32 rounding (the
  loss and gradient-norm all-reduces of JAX's CPU collectives sum in another order across processes).
Global batch 24 (3 per device on 8), so that it splits over 8, 4 and 3 devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.append(EXAMPLES)  # appended: examples/equinox.py must not shadow the equinox package

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
import jax  # noqa: E402

import checkpoint  # noqa: E402
import llama  # noqa: E402
import train  # noqa: E402
from conftest import make_mesh, subprocess_pythonpath  # noqa: E402

CFG = llama.MODELS["tiny"]  # odd sizes: d_ff 172 is padded to 176 rows on 8 devices, to 174 on 3
STEPS = 8
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--batch-per-device", "3", "--eval-every", "0",
          "--log-every", "4", "--cpu", "--backend", "tide"]

# Plain orbax, no tide: every array of the latest checkpoint as numpy, into an .npz keyed by
# orbax's names; prints the step and the meta.
READER = r"""
import json, sys
import jax
import numpy as np
import orbax.checkpoint as ocp

root, out = sys.argv[1:3]
mngr = ocp.CheckpointManager(root)
step = mngr.latest_step()
got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
def name(path):
    return ".".join(str(k.key if hasattr(k, "key") else k.idx) for k in path)
np.savez(out, **{name(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(got["state"])[0]})
tide = sorted(m for m in sys.modules if m.startswith("tide"))
assert not tide, tide
print("READ " + json.dumps({"step": step, "meta": got["meta"]}))
"""


def _plain_env():
    """No tide on the path: the reader could not import it even by accident."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _read_plain(root, tmp_path):
    out = tmp_path / "plain.npz"
    r = subprocess.run([sys.executable, "-c", READER, str(root), str(out)], env=_plain_env(), cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("READ "))
    with np.load(out) as z:
        return json.loads(line[5:]), {k: z[k] for k in z.files}


def _unpad(state, logical):
    """{orbax name: the array without its padding} of a (fully addressable) state; checks that the
    padding is zero."""
    out = {}
    for (path, x), lg in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(logical)):
        full = np.asarray(x)
        keep = tuple(slice(0, n) for n in lg.shape)
        rest = full.copy()
        rest[keep] = 0
        name = checkpoint.leaf_name(path)
        assert not rest.any(), f"{name}: padding is not zero"
        out[name] = full[keep]
    return out


def _same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].shape != b[k].shape or a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]
    assert not bad, bad


def _optimizer():
    return llama.optimizer(llama.OptConfig(steps=10, lr=CFG.lr, warmup=2), CFG)


# ----- the checkpoint itself (this process, 8 devices) -----
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A state after 2 tide steps on 8 devices, checkpointed at step 2."""
    mesh = make_mesh((8,), (llama.AXIS,))
    lays = llama.Layouts.build(CFG, mesh)
    tx = _optimizer()
    state = llama.init_state(CFG, lays, tx, 0)
    step = llama.make_train_step(CFG, llama.Backend("tide"), lays, mesh, tx, llama.state_shardings(state))
    data = llama.Data("synthetic", None, None, CFG.vocab)
    for i in range(2):
        state, _ = step(state, llama.put_batch(data.batch(0, i, 16, CFG.seq), mesh))
    logical = llama.logical_state(state, lays)
    root = tmp_path_factory.mktemp("ck") / "run"
    ck = checkpoint.Checkpoints(str(root))
    ck.save(2, state, logical, {"step": 2, "devices": 8})
    ck.close()
    return dict(root=root, state=state, logical=logical, want=_unpad(state, logical), tx=tx)


def test_checkpoint_holds_the_logical_shapes(saved):
    stored = checkpoint.stored_shapes(str(saved["root"]))
    assert stored["params.layers.w_down"] == ((2, 172, 64), "float32")
    assert stored["opt.1.0.mu.layers.w_down"] == ((2, 172, 64), "float32")
    assert saved["state"]["params"]["layers"]["w_down"].shape == (2, 176, 64)  # what the devices hold
    assert stored == {k: (v.shape, str(v.dtype)) for k, v in saved["want"].items()}
    assert checkpoint.locate(str(saved["root"])) == (str(saved["root"]), 2)
    assert checkpoint.read_meta(str(saved["root"] / "2")) == {"step": 2, "devices": 8}


def test_plain_orbax_reads_it_without_tide(saved, tmp_path):
    info, arrays = _read_plain(saved["root"], tmp_path)
    assert info == {"step": 2, "meta": {"step": 2, "devices": 8}}
    _same(arrays, saved["want"])


@pytest.mark.parametrize("ndev", [8, 4, 3])
def test_restore_on_any_device_count(saved, ndev):
    mesh = make_mesh((ndev,), (llama.AXIS,))
    lays = llama.Layouts.build(CFG, mesh)
    target = llama.abstract_state(CFG, lays, saved["tx"])
    state, meta = checkpoint.restore(str(saved["root"]), target, llama.logical_state(target, lays))
    assert meta == {"step": 2, "devices": 8}
    assert jax.tree.structure(state) == jax.tree.structure(target)
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert x.shape == t.shape and x.dtype == t.dtype and x.sharding == t.sharding
    _same(_unpad(state, llama.logical_state(target, lays)), saved["want"])
    if ndev == 8:  # the very arrays that were saved, padding included
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(saved["state"])):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def test_restore_refuses_another_model(saved):
    import dataclasses

    cfg = dataclasses.replace(CFG, d_ff=180)
    lays = llama.Layouts.build(cfg, make_mesh((8,), (llama.AXIS,)))
    target = llama.abstract_state(cfg, lays, llama.optimizer(llama.OptConfig(steps=10, lr=CFG.lr, warmup=2), cfg))
    with pytest.raises(ValueError, match="does not hold this state"):
        checkpoint.restore(str(saved["root"]), target, llama.logical_state(target, lays))


# ----- train.py: save, resume (this process: 8 CPU devices, or fewer of them) -----
def _losses(summary):
    return {r["step"]: r["loss"] for r in summary["records"]}


def _state_arrays(step_dir):
    import orbax.checkpoint as ocp

    got = ocp.StandardCheckpointer().restore(os.path.join(str(step_dir), "state"))
    return {checkpoint.leaf_name(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(got)[0]}


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    """The uninterrupted run on 8 devices, checkpointed at steps 4 and 8."""
    ck = tmp_path_factory.mktemp("run8") / "ck"
    return train.main([*COMMON, "--save", str(ck), "--save-every", "4"]), ck


def test_resume_on_8_devices_is_bitwise(run8, tmp_path):
    full, ck = run8
    assert sorted(os.listdir(ck)) == ["4", "8"]
    resumed = train.main([*COMMON, "--resume", str(ck / "4"), "--save", str(tmp_path / "ck")])
    a, b = _losses(full), _losses(resumed)
    assert sorted(a) == list(range(STEPS)) and sorted(b) == list(range(4, STEPS))
    assert all(a[s] == b[s] for s in b), (a, b)
    _same(_state_arrays(tmp_path / "ck" / "8"), _state_arrays(ck / "8"))


def test_resume_on_3_devices(run8):
    full, ck = run8
    resumed = train.main([*COMMON, "--devices", "3", "--resume", str(ck / "4")])
    assert resumed["devices"] == 3 and resumed["batch"] == full["batch"] == 24
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == list(range(4, STEPS))
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in b)
    assert worst < 1e-4, (worst, a, b)


def test_resume_on_4_devices_in_a_process_of_4(run8, tmp_path):
    full, ck = run8
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    cmd = [sys.executable, os.path.join(EXAMPLES, "train.py"), *COMMON, "--devices", "4", "--resume", str(ck / "4"),
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "at step 4 (saved on 8 devices, now 4)" in r.stdout, r.stdout
    with open(tmp_path / "tide.json") as f:
        resumed = json.load(f)
    assert resumed["devices"] == 4 and resumed["batch"] == 24
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == list(range(4, STEPS))
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in b)
    assert worst < 1e-4, (worst, a, b)


# ----- saved by 2 processes x 4 devices -----
def _launch(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = subprocess_pythonpath(env)
    env.setdefault("TIDE_TIMEOUT_S", "60")
    for k in ("XLA_FLAGS", "NPROC"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "tide_jax.launch", "-n", "2", "--cpu-devices", "4", "--",
           sys.executable, os.path.join(EXAMPLES, "train.py"), *COMMON, *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def run_mp(tmp_path_factory):
    """The run as 2 processes x 4 CPU devices, checkpointed at steps 4 and 8."""
    tmp = tmp_path_factory.mktemp("mp")
    _launch("--save", str(tmp / "ck"), "--save-every", "4", "--out", str(tmp / "out"))
    with open(tmp / "out" / "tide.json") as f:
        return json.load(f), tmp / "ck"


def test_two_processes_write_their_own_shards(run_mp, tmp_path):
    summary, ck = run_mp
    assert summary["devices"] == 8 and sorted(os.listdir(ck)) == ["4", "8"]
    # orbax's per-process databases: each process wrote about half of the bytes (its 4 devices' rows)
    sizes = {}
    for p in (0, 1):
        d = ck / "4" / "state" / f"ocdbt.process_{p}"
        sizes[p] = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    assert min(sizes.values()) > 0.3 * sum(sizes.values()), sizes
    info, arrays = _read_plain(ck, tmp_path)  # plain orbax, one process, no tide
    assert info["step"] == 8 and info["meta"]["devices"] == 8
    assert arrays["params.layers.w_down"].shape == (2, 172, 64)
    _same(arrays, _state_arrays(ck / "8"))


def test_two_processes_resume_bitwise(run_mp, tmp_path):
    full, ck = run_mp
    _launch("--resume", str(ck / "4"), "--save", str(tmp_path / "ck"), "--out", str(tmp_path / "out"))
    with open(tmp_path / "out" / "tide.json") as f:
        resumed = json.load(f)
    a, b = _losses(full), _losses(resumed)
    assert sorted(b) == list(range(4, STEPS))
    assert all(a[s] == b[s] for s in b), (a, b)
    _same(_state_arrays(tmp_path / "ck" / "8"), _state_arrays(ck / "8"))


def test_saved_by_two_processes_resumed_by_one(run_mp):
    full, ck = run_mp
    resumed = train.main([*COMMON, "--resume", str(ck / "4")])
    assert resumed["devices"] == 8
    a, b = _losses(full), _losses(resumed)
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in b)
    assert worst < 1e-4, (worst, a, b)


# ----- meshes with a tensor axis: saved on fsdp x tensor 4 x 2, restored on 4 x 2, 2 x 4 and 8 x 1 -----
TP_CFG = dataclasses.replace(CFG, kv_heads=4)  # whole key/value heads on 4 tensor devices too


def _tp_lays(shape):
    mesh = make_mesh(shape, ("fsdp", "tensor"))
    return mesh, llama.Layouts.build(TP_CFG, mesh)


def _crop_host(x, lg) -> np.ndarray:
    """A global array -> its logical array on the host (each block's padding dropped, checked zero)."""
    full = np.asarray(x)
    for d, k in enumerate(checkpoint.blocks_of(lg, full.shape)):
        n, g = lg.shape[d], full.shape[d]
        if n == g:
            continue
        blocks = full.reshape(*full.shape[:d], k, g // k, *full.shape[d + 1:])
        assert not np.take(blocks, range(n // k, g // k), axis=d + 1).any(), f"dim {d}: padding is not zero"
        full = np.take(blocks, range(n // k), axis=d + 1).reshape(*full.shape[:d], n, *full.shape[d + 1:])
    return full


def _logical_host(state, logical) -> dict:
    return {checkpoint.leaf_name(k): _crop_host(x, lg) for (k, x), lg in
            zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(logical))}


@pytest.fixture(scope="module")
def saved_tp(tmp_path_factory):
    """A state on fsdp x tensor 4 x 2 (random parameters and AdamW moments, each block padded on its
    own), checkpointed at step 1."""
    mesh, lays = _tp_lays((4, 2))
    tx = llama.optimizer(llama.OptConfig(steps=10, lr=TP_CFG.lr, warmup=2), TP_CFG)
    state = llama.init_state(TP_CFG, lays, tx, int(np.random.default_rng().integers(1 << 20)))
    rng = np.random.default_rng()
    randoms = lambda: lays.shard(jax.tree.map(  # noqa: E731
        lambda x: rng.standard_normal(x.shape).astype(np.float32), llama.abstract_params(TP_CFG)))
    adam = state["opt"][1][0]
    state["opt"] = (state["opt"][0], (adam._replace(mu=randoms(), nu=randoms()), *state["opt"][1][1:]))
    logical = llama.logical_state(state, lays)
    w_down = state["params"]["layers"]["w_down"]
    assert w_down.shape == (TP_CFG.layers, 2 * 4 * 22, TP_CFG.d_model)  # 86 rows per block, padded to 88
    root = tmp_path_factory.mktemp("ck_tp") / "run"
    ck = checkpoint.Checkpoints(str(root))
    ck.save(1, state, logical, {"step": 1, "mesh": "4x2"})
    ck.close()
    return dict(root=root, state=state, tx=tx, want=_logical_host(state, logical))


def test_tensor_parallel_checkpoint_holds_the_logical_arrays(saved_tp):
    stored = checkpoint.stored_shapes(str(saved_tp["root"]))
    assert stored["params.layers.w_down"] == ((2, 172, 64), "float32")
    assert stored["opt.1.0.mu.layers.wo"] == ((2, 64, 64), "float32")
    _same(_state_arrays(saved_tp["root"] / "1"), saved_tp["want"])  # the blocks in their logical places


@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (8, 1)])
def test_tensor_parallel_restore_on_another_mesh_shape(saved_tp, shape):
    mesh, lays = _tp_lays(shape)
    target = llama.abstract_state(TP_CFG, lays, saved_tp["tx"])
    logical = llama.logical_state(target, lays)
    state, meta = checkpoint.restore(str(saved_tp["root"]), target, logical)
    assert meta == {"step": 1, "mesh": "4x2"}
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert x.shape == t.shape and x.dtype == t.dtype and x.sharding == t.sharding
    _same(_logical_host(state, logical), saved_tp["want"])  # (and every padding row zero)
    if shape == (4, 2):  # the very arrays that were saved, padding included
        assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes()
                   for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(saved_tp["state"])))
