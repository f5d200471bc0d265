"""examples/train.py on the tiny model (8 CPU devices): what the training script promises.

- tide and plain-JAX FSDP (fp32 and bf16 gradient reduction) give the same losses, to bf16 level;
  tide and jax-fp32 both sum in fp32, so they agree much closer;
- eval loss decreases on the byte corpus.
Runs in this process (the conftest's 8 CPU devices). Checkpoints (--save / --resume): test_checkpoint.py.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.append(EXAMPLES)  # appended: examples/equinox.py must not shadow the equinox package

pytest.importorskip("optax")
import train  # noqa: E402

STEPS = 8
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--eval-every", "4", "--log-every", "4", "--cpu"]


def _run(*extra):
    return train.main([*COMMON, *extra])


@pytest.fixture(scope="module")
def tide_run():
    return _run("--backend", "tide")


def _losses(summary):
    return {r["step"]: r["loss"] for r in summary["records"]}


@pytest.mark.parametrize("reduce,rtol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_tide_and_jax_losses_agree(tide_run, reduce, rtol):
    tide = tide_run
    jax_run = _run("--backend", "jax", "--reduce", reduce, "--xla-flags", "default")
    a, b = _losses(tide), _losses(jax_run)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a)
    assert worst <= rtol, (reduce, worst, a, b)


def test_eval_loss_decreases(tide_run):
    tide = tide_run
    evals = [e["loss"] for e in tide["evals"]]
    assert [e["step"] for e in tide["evals"]] == [0, 4, 8]
    assert evals[0] > evals[1] > evals[2], evals
    assert evals[-1] < evals[0] - 0.3, evals  # from ~log(256) = 5.5
    assert tide["records"][-1]["loss"] < tide["records"][0]["loss"]


# ----- the loss check (--check): a healthy pair never disagrees, a real difference always does -----
def _summary(losses, evals=None, name="run"):
    return {"name": name, "records": [{"step": s, "loss": float(v)} for s, v in enumerate(losses)],
            "evals": [{"step": s, "loss": float(v)} for s, v in (evals or [])]}


def _curve(n, rng, chaos=0.0, offset=0.0, start_chaos=10):
    """A loss curve 5.5 -> ~1.2 with per-step noise; `chaos`: relative per-step jitter from
    `start_chaos` on (what bf16 rounding amplified by a gradient-norm spike looks like)."""
    steps = np.arange(n)
    base = 1.2 + 4.3 * np.exp(-steps / 60.0) + 0.05 * np.sin(steps / 3.0)
    jitter = np.where(steps >= start_chaos, chaos * rng.standard_normal(n), 0.0)
    return base * (1 + jitter) * (1 + np.where(steps >= 20, offset, 0.0))


def test_loss_check_accepts_a_healthy_pair():
    """The 150m H200 run's pattern: equal to 4 digits for 10 steps, then chaotic drift (raw per-step
    differences up to ~4 %) around the same curve: agrees."""
    rng = np.random.default_rng(0)
    ref = _summary(_curve(300, rng), evals=[(150, 1.9), (300, 1.30)], name="tide")
    for seed in range(5):
        other = _curve(300, np.random.default_rng(seed + 1), chaos=0.02)
        other[:10] = ref_losses = [r["loss"] * (1 + 2e-4) for r in ref["records"][:10]]
        del ref_losses
        got = train.agreement(ref, _summary(other, evals=[(150, 1.91), (300, 1.307)]), 2e-2, 10, 5e-2, 25)
        assert got.ok, got
        assert got.early < 1e-3 and got.smooth < 5e-2
        pair = [{**_meta("tide"), **ref}, {**_meta("jax-fp32"), **_summary(other, [(150, 1.91), (300, 1.307)])}]
        ok, text = train.summarize(pair, 2e-2, 10)
        assert ok and "DISAGREE" not in text


def test_loss_check_catches_real_differences():
    rng = np.random.default_rng(1)
    ref = _summary(_curve(200, rng), evals=[(200, 1.4)], name="tide")
    base = [r["loss"] for r in ref["records"]]
    cases = {
        "curve 10% higher after step 20": _curve(200, np.random.default_rng(1), offset=0.10),
        "an early step 5% off": [v * (1.05 if s == 3 else 1.0) for s, v in enumerate(base)],
        "a plateau (no learning after step 50)": [v if s < 50 else base[50] for s, v in enumerate(base)],
        "nan": [v if s != 60 else float("nan") for s, v in enumerate(base)],
    }
    for what, losses in cases.items():
        got = train.agreement(ref, _summary(losses, evals=[(200, 1.4)]), 2e-2, 10, 5e-2, 25)
        assert not got.ok, what
        assert got.why, what
    # the same curve, but the final eval loss 8% off
    got = train.agreement(ref, _summary(base, evals=[(200, 1.4 * 1.08)]), 2e-2, 10, 5e-2, 25)
    assert not got.ok and "eval" in got.why


def test_loss_check_on_real_runs(tide_run):
    """A real run with 10x the learning rate is a real difference: the check says so, naming the step."""
    other = _run("--backend", "jax", "--xla-flags", "default", "--lr", "3e-2", "--steps", str(STEPS))
    ok, text = train.summarize([tide_run, other], 2e-2, 10)
    assert not ok and "DISAGREES" in text, text


def _meta(name):
    return {"name": name, "model": "m", "config": {"layers": 1, "d_model": 1, "seq": 1, "remat": "dots"},
            "devices": 1, "device_kind": "cpu", "jax": "0", "batch": 1, "steps": 300, "data": "d",
            "xla_flags": "default", "median_step_s": 1.0, "tokens_per_s": 1.0, "mfu": None,
            "peak_memory_bytes": None, "timed_steps": 1}


@pytest.mark.parametrize("model,mesh", [("tiny", "fsdp=4,tensor=2"), ("tiny-moe", "fsdp=4,expert=2")])
def test_composed_mesh_trains_and_agrees_with_plain_jax(model, mesh):
    """--mesh fsdp=4,tensor=2 (Megatron-style attention and MLP over "tensor", FSDP over "fsdp") and
    --model tiny-moe --mesh fsdp=4,expert=2 (a top-2 mixture of 4 experts, 2 per "expert" device):
    the loss falls, and the loss check (--check's) finds tide and plain-JAX FSDP (jax-fp32: JAX's
    all-gather and fp32 psum_scatter on the same mesh) in agreement, to fp32 summation order."""
    runs = [_run("--model", model, "--backend", backend, "--mesh", mesh, "--eval-every", "0", "--xla-flags", "default")
            for backend in ("tide", "jax")]
    want = {k: int(v) for k, v in (item.split("=") for item in mesh.split(","))}
    assert [r["mesh"] for r in runs] == [want] * 2 and runs[0]["model"] == model
    ok, text = train.summarize(runs, 2e-2, 10)
    assert ok, text
    a, b = (_losses(r) for r in runs)
    assert max(abs(a[s] - b[s]) / abs(b[s]) for s in a) <= 1e-4, (a, b)
    assert a[STEPS - 1] < a[0] - 0.3, a  # from ~log(256) = 5.5
