"""The README's API snippet runs as written (a fresh process: it sets up 8 CPU devices itself)."""

import math
import os
import re
import subprocess
import sys

from conftest import subprocess_pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_api_snippet_runs(tmp_path):
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    api = readme[readme.index("## API"):]
    snippet = api[api.index("```python\n") + len("```python\n"):api.index("```\n", api.index("```python\n") + 10)]
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "NPROC")}
    env["PYTHONPATH"] = subprocess_pythonpath(env)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # It learns, visibly: every printed loss lower than the one before, the last a small part of the first.
    losses = [float(v) for v in re.findall(r"^step +\d+  loss (\S+)$", r.stdout, re.M)]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses), r.stdout
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] / 50, r.stdout
