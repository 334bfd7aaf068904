"""`mypy` finds nothing: the settings in pyproject.toml's [tool.mypy] hold over workers/ —
strict on the contracts (workers/api.py, agents/api.py, weights/update.py) and the typed
messages (rollout/messages.py, train/rank_messages.py, io/wire.py), mypy's defaults on
the rest but the modules it lists as the baseline still to fix. workers/api.py assigns
every trainer and rollout engine to its Protocol, so an implementation that drifts from
its contract fails here."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing():
    # a cache of its own, outside the tree: a second run rechecks only what changed
    cache = Path(tempfile.gettempdir()) / f"fluxrl-mypy-{os.getuid()}"
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
