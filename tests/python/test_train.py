"""examples/train.py on the tiny model (8 CPU devices): what the training script promises.

- tide and plain-JAX FSDP (fp32 and bf16 gradient reduction) give the same losses, to bf16 level;
  tide and jax-fp32 both sum in fp32, so they agree much closer;
- eval loss decreases on the byte corpus.
Runs in this process (the conftest's 8 CPU devices). Checkpoints (--save / --resume): test_checkpoint.py.
"""

from __future__ import annotations

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
sys.path.insert(0, EXAMPLES)

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
